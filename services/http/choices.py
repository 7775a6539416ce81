"""gRPC stream messages gathered into OpenAI choices, and the pieces both completion APIs share:
finish reasons, usage, the two log-probability formats.

One gRPC call answers one prompt with ``n`` samples (message ``index``); a text completion of
several prompts makes one call each, and its choice ``index`` is ``prompt * n + sample``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from kvshare.v1 import generator_pb2 as pb

FINISH_REASONS = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_EOS: "stop",
    # The worker ended the stream early (shutting down past its drain time, or a client that left
    # its tokens unread): vLLM's name for an answer that ended without the model ending it.
    pb.FINISH_REASON_ABORT: "abort",
}


def finish_reason(message: pb.GenerateResponse) -> str | None:
    return FINISH_REASONS.get(message.finish_reason)


@dataclass(slots=True)
class Choice:
    """One sample of one prompt, as its messages arrive. Its text is kept as the messages'
    pieces, joined once when asked for: appending to one string per message would copy the
    whole answer so far for every token. ``length`` is the text's length in characters."""

    index: int
    pieces: list[str] = field(default_factory=list)
    length: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: pb.Usage | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, message: pb.GenerateResponse) -> None:
        self.pieces.append(message.text)
        self.length += len(message.text)
        self.token_ids.extend(message.token_ids)
        self.logprobs.extend(message.logprobs)
        self.prompt_logprobs.extend(message.prompt_logprobs)
        if message.finish_reason:
            self.finish_reason = finish_reason(message)
            self.usage = message.usage


class Choices:
    """Every choice of a request, by index, gathered from ``(prompt, message)`` pairs."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.by_index: dict[int, Choice] = {}

    def index(self, prompt: int, message: pb.GenerateResponse) -> int:
        return prompt * self.n + message.index

    def add(self, prompt: int, message: pb.GenerateResponse) -> Choice:
        i = self.index(prompt, message)
        choice = self.by_index.setdefault(i, Choice(i))
        choice.add(message)
        return choice

    def in_order(self) -> list[Choice]:
        return [self.by_index[i] for i in sorted(self.by_index)]

    def usage(self) -> dict:
        """OpenAI's usage: each prompt's tokens once (its samples share it), every sample's
        completion tokens, and ``prompt_tokens_details.cached_tokens``: prompt tokens whose K/V
        came from the shared cache."""
        prompts: dict[int, pb.Usage] = {}
        completion = 0
        for choice in self.by_index.values():
            if choice.usage is not None:
                prompts.setdefault(choice.index // self.n, choice.usage)
                completion += choice.usage.completion_tokens
        return usage_json(prompts.values(), completion)


def usage_json(prompts: Iterable[pb.Usage], completion_tokens: int) -> dict:
    prompts = list(prompts)
    prompt_tokens = sum(u.prompt_tokens for u in prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(u.cached_prompt_tokens for u in prompts)},
    }


def chat_logprobs(entries: Iterable[pb.TokenLogprob]) -> dict:
    """Chat's format: per token its text, log-probability, UTF-8 bytes and alternatives."""
    return {"content": [
        {**_token(e.text, e.logprob), "top_logprobs": [_token(t.text, t.logprob) for t in e.top]} for e in entries
    ]}


def _token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def text_logprobs(entries: Iterable[pb.TokenLogprob | None], texts: Iterable[str], offset: int) -> dict:
    """Text completions' (legacy) format: parallel lists of token texts, log-probabilities (None
    for an echoed prompt's first token, which nothing predicts), ``{text: logprob}`` alternatives,
    and each token's character offset in the choice's text from ``offset`` on."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for entry, text in zip(entries, texts, strict=True):
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        logprobs.append(None if entry is None else entry.logprob)
        tops.append(None if entry is None else {t.text: t.logprob for t in entry.top})
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


async def merged(streams: list[AsyncIterator[pb.GenerateResponse]]) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
    """``(stream number, message)`` from every stream: one stream is read directly; several are
    read in turn as their messages come, one message ahead each, so that a client that stops
    reading stops every stream (gRPC's flow control then holds the workers' sends)."""
    if len(streams) == 1:
        async for message in streams[0]:
            yield 0, message
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    message = task.result()
                except StopAsyncIteration:
                    continue
                yield i, message
                pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        # A generator can only be closed once its pending read has ended.
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
