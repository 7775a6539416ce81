"""POST /v1/completions: OpenAI's (legacy) text completion. ``prompt`` is a string, an array of
strings, an array of token ids or an array of such arrays: one gRPC call per prompt, run
together, choice ``index`` = prompt * n + sample. ``echo`` puts each prompt's text before its
choices' text; with ``logprobs`` too, the prompt's tokens and their log-probabilities lead the
choice's (the first token's is null: nothing predicts it), as OpenAI and vLLM return them.
``suffix`` is refused: no fill-in-the-middle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvshare.v1 import generator_pb2 as pb
from services.http.body import Body, checked_ids, is_integers, text
from services.http.choices import Choice, Choices, finish_reason, text_logprobs
from services.http.errors import bad_request
from services.http.generation_fields import generation_request

DEFAULT_MAX_TOKENS = 16
"""OpenAI's (and vLLM's) default for text completions."""
MAX_PROMPTS = 32
"""Prompts per request: each is a gRPC call, and the calls run together."""
MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str | None
    token_ids: list[int] | None


def prompts(body: Body) -> list[Prompt]:
    raw = body.raw("prompt")
    shape = "must be a string, an array of strings, an array of token ids or an array of arrays of token ids"
    if isinstance(raw, str):
        found = [Prompt(text("prompt", raw), None)]
    elif isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw):
        found = [Prompt(text(f"prompt[{i}]", p), None) for i, p in enumerate(raw)]
    elif raw and is_integers(raw):
        found = [Prompt(None, checked_ids("prompt", raw))]
    elif isinstance(raw, list) and raw and all(p and is_integers(p) for p in raw):
        found = [Prompt(None, checked_ids(f"prompt[{i}]", p)) for i, p in enumerate(raw)]
    else:
        raise bad_request("prompt", shape)
    if len(found) > MAX_PROMPTS:
        raise bad_request("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(found)}")
    return found


def completion_calls(body: Body, request_id: str, found: list[Prompt]) -> list[pb.GenerateRequest]:
    logprobs = body.integer("logprobs", 0, MAX_LOGPROBS)
    echo = body.boolean("echo")
    calls = []
    for i, prompt in enumerate(found):
        call = generation_request(body, f"{request_id}-{i}" if len(found) > 1 else request_id, DEFAULT_MAX_TOKENS)
        if prompt.text is not None:
            call.prompt = prompt.text
        else:
            call.prompt_token_ids.extend(prompt.token_ids)
        call.logprobs = logprobs is not None
        call.top_logprobs = logprobs or 0
        call.prompt_logprobs = echo and logprobs is not None
        calls.append(call)
    return calls


@dataclass(frozen=True, slots=True)
class Echo:
    """A prompt as echoed: its text, and its first token's text (the one token the prompt's
    log-probabilities leave out)."""

    text: str
    first_token: str


@dataclass(slots=True)
class TextFormat:
    n: int
    logprobs: bool
    echoes: list[Echo] | None
    object_name: str = "text_completion"
    chunk_name: str = "text_completion"
    _ready: set[int] = field(default_factory=set)
    """Prompts whose log-probabilities are all in (they come before sample 0's first token)."""
    _held: dict[int, list[tuple[Choice, pb.GenerateResponse, bool, int]]] = field(default_factory=dict)
    _sample0: dict[int, Choice] = field(default_factory=dict)

    def delta(self, prompt: int, choice: Choice, message: pb.GenerateResponse, first: bool) -> list[dict]:
        before = choice.length - len(message.text)
        if choice.index % self.n == 0:
            self._sample0[prompt] = choice
        if self.echoes is None or not self.logprobs or prompt in self._ready:
            return self._entry(prompt, choice, message, first, before)
        # Echoed prompt log-probabilities lead every choice of the prompt: hold its messages until
        # sample 0 has sent them all (with or before its first token).
        self._held.setdefault(prompt, []).append((choice, message, first, before))
        if choice.index % self.n != 0 or not (message.token_ids or message.finish_reason):
            return []
        self._ready.add(prompt)
        return [e for held in self._held.pop(prompt) for e in self._entry(prompt, *held)]

    def _entry(self, prompt: int, choice: Choice, message: pb.GenerateResponse, first: bool, before: int) -> list[dict]:
        echo = self.echoes[prompt] if self.echoes is not None else None
        text, entries, texts = message.text, list(message.logprobs), [e.text for e in message.logprobs]
        offset = before + (len(echo.text) if echo else 0)
        if first and echo is not None:
            text, offset = echo.text + text, 0
            if self.logprobs:
                lead = self._prompt_entries(prompt)
                entries, texts = [None, *lead, *entries], [echo.first_token, *(e.text for e in lead), *texts]
        logprobs = text_logprobs(entries, texts, offset) if self.logprobs else None
        reason = finish_reason(message)
        if not text and not entries and reason is None:
            return []
        return [{"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": reason}]

    def _prompt_entries(self, prompt: int) -> list[pb.TokenLogprob]:
        sample0 = self._sample0.get(prompt)
        return list(sample0.prompt_logprobs) if sample0 is not None else []

    def choice(self, choice: Choice, choices: Choices) -> dict:
        prompt = choice.index // self.n
        self._sample0[prompt] = choices.by_index.get(prompt * self.n, choice)
        whole = pb.GenerateResponse(text=choice.text, logprobs=choice.logprobs)
        (entry,) = self._entry(prompt, choice, whole, True, 0) or [
            {"index": choice.index, "text": "", "logprobs": None, "finish_reason": None}]
        return {**entry, "finish_reason": choice.finish_reason}
