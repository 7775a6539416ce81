"""A small synchronous client: what `kvshare generate`, the demo, the benchmarks and the tests use
to call a worker."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.connection import Connection, rpc_error_line


@dataclass(slots=True)
class Completion:
    """A finished Generate call: the concatenated text and ids, and the last message's fields."""

    text: str
    token_ids: list[int]
    last: pb.GenerateResponse | None
    messages: int
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)


def stream(stub: pb_grpc.GeneratorStub, request: pb.GenerateRequest, timeout_s: float | None = None,
           metadata: tuple[tuple[str, str], ...] = ()) -> Iterator[pb.GenerateResponse]:
    yield from stub.Generate(request, timeout=timeout_s, metadata=metadata)


def complete(stub: pb_grpc.GeneratorStub, request: pb.GenerateRequest, timeout_s: float | None = None, echo=None,
             metadata: tuple[tuple[str, str], ...] = ()) -> Completion:
    """Runs one Generate call to its end; ``echo(text)`` sees each text delta as it arrives.
    The first sample's completion (see ``complete_all`` for every sample)."""
    return complete_all(stub, request, timeout_s, echo, metadata)[0]


def complete_all(stub: pb_grpc.GeneratorStub, request: pb.GenerateRequest, timeout_s: float | None = None, echo=None,
                 metadata: tuple[tuple[str, str], ...] = ()) -> list[Completion]:
    """Every sample's (or beam hypothesis') completion, by index; ``echo`` sees sample 0's text."""
    by_index: dict[int, Completion] = {}
    for message in stream(stub, request, timeout_s, metadata):
        done = by_index.setdefault(message.index, Completion(text="", token_ids=[], last=None, messages=0))
        done.text += message.text
        done.token_ids.extend(message.token_ids)
        done.logprobs.extend(message.logprobs)
        done.last, done.messages = message, done.messages + 1
        if echo is not None and message.text and message.index == 0:
            echo(message.text)
    return [by_index[i] for i in sorted(by_index)] or [Completion(text="", token_ids=[], last=None, messages=0)]


def raw_call(channel: grpc.Channel, method: str, request: bytes, timeout_s: float) -> tuple[grpc.StatusCode, bytes]:
    """Sends ``request`` bytes to /kvshare.v1.Generator/``method`` and returns the status and the
    response bytes unparsed (all messages of a stream, joined), or the error's details.

    Bytes both ways: a request may be malformed on purpose (fuzzing), and a big answer is not
    parsed by this process while it measures something else."""
    path = f"/kvshare.v1.Generator/{method}"
    try:
        if method == "Generate":
            return grpc.StatusCode.OK, b"".join(channel.unary_stream(path)(request, timeout=timeout_s))
        return grpc.StatusCode.OK, channel.unary_unary(path)(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        return exc.code(), exc.details().encode()

def generate_request(args: argparse.Namespace, chat: bool = False) -> pb.GenerateRequest:
    """The request `kvshare generate` sends for its parsed flags, ``args.prompt`` and ``args.system``
    holding the text (``-`` and ``@FILE`` already read). ``chat``: the prompt goes as one user message
    (after a system message, with --system) for the worker to render with the model's chat template;
    otherwise it goes as text, exactly as given."""
    sampling = pb.SamplingParams(temperature=args.temperature, top_k=args.top_k, min_p=args.min_p,
                                 presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.seed is not None:
        sampling.seed = args.seed
    if args.repetition_penalty is not None:
        sampling.repetition_penalty = args.repetition_penalty
    if chat:
        system = [] if args.system is None else [pb.ChatMessage(role="system", content=args.system)]
        text: dict = {"messages": [*system, pb.ChatMessage(role="user", content=args.prompt)]}
    else:
        text = {"prompt": args.prompt}
    return pb.GenerateRequest(
        **text, max_new_tokens=args.max_new_tokens, sampling=sampling, stop=args.stop,
        ignore_eos=args.ignore_eos, cache=pb.CacheOptions(salt=args.salt),
        encoder_prompt=args.encoder_prompt or "", n=args.n, num_beams=args.num_beams,
        logprobs=args.logprobs is not None, top_logprobs=args.logprobs or 0, min_new_tokens=args.min_new_tokens,
        stop_token_ids=args.stop_token_id, include_stop_str_in_output=args.include_stop_str,
        suppress_token_ids=args.suppress_token_id, begin_suppress_token_ids=args.begin_suppress_token_id,
        early_stopping=args.early_stopping, **({} if args.length_penalty is None else {"length_penalty": args.length_penalty}),
    )


def model_info(stub: pb_grpc.GeneratorStub, connection: Connection, timeout_s: float) -> pb.GetModelInfoResponse:
    return stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s, metadata=connection.metadata)


def generate_main(connection: Connection, args: argparse.Namespace) -> int:
    """`kvshare generate`: text to stdout as it streams, usage and timings to stderr. The prompt goes
    through the model's chat template when it has one (GetModelInfo's ``chat_template``), unless
    --raw. With several samples or beams, each sample's text follows a ``--- sample i`` line (sample
    0 streams); with logprobs, one ``id logprob [id:text:logprob alternatives]`` line per token goes
    to stderr. Returns 1 when a call fails, 2 for --system on a model without a chat template."""
    with connection.channel() as channel:
        stub = pb_grpc.GeneratorStub(channel)
        echoed = []

        def echo(text: str) -> None:
            echoed.append(text)
            print(text, end="", flush=True)

        try:
            info = None if args.raw else model_info(stub, connection, args.timeout_s)
        except grpc.RpcError as exc:
            print(rpc_error_line("generate", exc, connection), file=sys.stderr)
            return 1
        chat = info is not None and info.chat_template
        if args.system is not None and not chat:
            print(f"kvshare generate: --system needs a chat template, and model {info.name} has none: "
                  "put the system text in the prompt", file=sys.stderr)
            return 2
        request = generate_request(args, chat)
        if request.n > 1 or request.num_beams > 1:
            print("--- sample 0", flush=True)
        try:
            samples = complete_all(stub, request, args.timeout_s, echo=echo, metadata=connection.metadata)
        except grpc.RpcError as exc:
            print(f"{chr(10) if echoed else ''}{rpc_error_line('generate', exc, connection)}", file=sys.stderr)
            return 1
    print(flush=True)  # before the stderr line, also when both go to one pipe
    for i, done in enumerate(samples):
        if i:
            print(f"--- sample {i}\n{done.text}", flush=True)
        for entry in done.logprobs:
            alternatives = " ".join(f"{t.token_id}:{t.text!r}:{t.logprob:.3f}" for t in entry.top)
            print(f"  {entry.token_id} {entry.logprob:.4f} {alternatives}".rstrip(), file=sys.stderr)
        u, t = done.last.usage, done.last.timings
        beam = f" beam_score={done.last.beam_score:.4f}" if request.num_beams > 1 else ""
        matched = done.last.WhichOneof("matched_stop")
        if matched is not None:
            beam += f" {matched}={getattr(done.last, matched)!r}"
        print(
            f"{f'[{i}] ' if len(samples) > 1 else ''}finish={pb.FinishReason.Name(done.last.finish_reason)} "
            f"prompt_tokens={u.prompt_tokens} cached_prompt_tokens={u.cached_prompt_tokens} "
            f"completion_tokens={u.completion_tokens} ttft_ms={t.time_to_first_token_ms:.1f} "
            f"prefill_ms={t.prefill_ms:.1f} total_ms={t.total_ms:.1f}{beam}",
            file=sys.stderr, flush=True,
        )
    return 0


def chat_main(connection: Connection, system: str | None, sampling: pb.SamplingParams, max_new_tokens: int, timeout_s: float,
              read=input) -> int:
    """`kvshare chat`: a conversation on the terminal. Each line is a user message; the answer streams
    back and both join the history that the next request sends as ``messages``. ``/reset`` starts
    over, ``/exit`` or end of input quits. Returns 1 when the worker cannot be reached at the start
    and 2 when its model has no chat template; a failed turn is said and the conversation goes on."""
    history: list[pb.ChatMessage] = [pb.ChatMessage(role="system", content=system)] if system else []
    with connection.channel() as channel:
        stub = pb_grpc.GeneratorStub(channel)
        try:
            info = model_info(stub, connection, timeout_s)
        except grpc.RpcError as exc:
            print(rpc_error_line("chat", exc, connection), file=sys.stderr)
            return 1
        if not info.chat_template:
            print(f"kvshare chat: model {info.name} has no chat template: use kvshare generate", file=sys.stderr)
            return 2
        print("kvshare chat: type a message; /reset starts over, /exit quits.", file=sys.stderr)
        while True:
            try:
                line = read("> ").strip()
            except EOFError:
                print()
                return 0
            if line == "/exit":
                return 0
            if line == "/reset":
                del history[1 if system else 0:]
                print("(history cleared)", file=sys.stderr)
                continue
            if not line:
                continue
            history.append(pb.ChatMessage(role="user", content=line))
            request = pb.GenerateRequest(messages=history, max_new_tokens=max_new_tokens, sampling=sampling)
            try:
                done = complete(stub, request, timeout_s, echo=lambda t: print(t, end="", flush=True),
                                metadata=connection.metadata)
            except grpc.RpcError as exc:
                history.pop()
                print(f"\n{rpc_error_line('chat', exc, connection)}", file=sys.stderr)
                continue
            print(flush=True)
            u = done.last.usage
            print(f"({u.completion_tokens} tokens, {u.cached_prompt_tokens} of {u.prompt_tokens} prompt tokens cached, "
                  f"first token after {done.last.timings.time_to_first_token_ms:.0f} ms)", file=sys.stderr)
            history.append(pb.ChatMessage(role="assistant", content=done.text))
