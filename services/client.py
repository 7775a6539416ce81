"""A small synchronous client: what `kvshare generate`, the demo, the benchmarks and the tests use
to call a worker."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc

API_KEY_ENV = "KVSHARE_API_KEY"


class ConnectionSettingsError(ValueError):
    """A client flag names a file that cannot be used; the message says which."""


@dataclass(frozen=True, slots=True)
class Connection:
    """How to reach a worker: its address, TLS files (none: plaintext) and API key (none: no header)."""

    target: str
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    api_key: str = field(default="", repr=False)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Connection:
        """From ``add_connection_flags``' flags; the key from --api-key-file, else KVSHARE_API_KEY.
        Raises ConnectionSettingsError for a key file that cannot be read or holds no key."""
        key = os.environ.get(API_KEY_ENV, "")
        if args.api_key_file is not None:
            try:
                key = args.api_key_file.read_text().strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConnectionSettingsError(f"cannot read --api-key-file {args.api_key_file}: {exc}") from exc
            if not key:
                raise ConnectionSettingsError(f"--api-key-file {args.api_key_file} is empty")
        for flag, path in (("--tls-ca-file", args.tls_ca_file), ("--tls-cert-file", args.tls_cert_file),
                           ("--tls-key-file", args.tls_key_file)):
            if path is not None and not path.is_file():
                raise ConnectionSettingsError(f"{flag} {path}: no such file")
        if (args.tls_cert_file is None) != (args.tls_key_file is None):
            raise ConnectionSettingsError("a client certificate needs both --tls-cert-file and --tls-key-file")
        return cls(args.target, args.tls_ca_file, args.tls_cert_file, args.tls_key_file, key)

    def channel(self) -> grpc.Channel:
        if self.ca_file is None and self.cert_file is None:
            return grpc.insecure_channel(self.target)
        return grpc.secure_channel(self.target, grpc.ssl_channel_credentials(
            root_certificates=self.ca_file.read_bytes() if self.ca_file else None,
            private_key=self.key_file.read_bytes() if self.key_file else None,
            certificate_chain=self.cert_file.read_bytes() if self.cert_file else None))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="127.0.0.1:50051", help="worker host:port")
    parser.add_argument("--tls-ca-file", type=Path, default=None, help="connect over TLS, trusting this CA (PEM)")
    parser.add_argument("--tls-cert-file", type=Path, default=None, help="client certificate for mutual TLS (PEM)")
    parser.add_argument("--tls-key-file", type=Path, default=None, help="key of --tls-cert-file (PEM)")
    parser.add_argument("--api-key-file", type=Path, default=None,
                        help=f"file holding the API key sent as 'authorization: Bearer KEY' (or set {API_KEY_ENV})")


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

def generate_request(args: argparse.Namespace) -> pb.GenerateRequest:
    """The request `kvshare generate` sends for its parsed flags."""
    sampling = pb.SamplingParams(temperature=args.temperature, top_k=args.top_k, min_p=args.min_p,
                                 presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.seed is not None:
        sampling.seed = args.seed
    if args.repetition_penalty is not None:
        sampling.repetition_penalty = args.repetition_penalty
    return pb.GenerateRequest(
        prompt=args.prompt, max_new_tokens=args.max_new_tokens, sampling=sampling, stop=args.stop,
        ignore_eos=args.ignore_eos, cache=pb.CacheOptions(salt=args.salt),
        encoder_prompt=args.encoder_prompt or "", n=args.n, num_beams=args.num_beams,
        logprobs=args.logprobs is not None, top_logprobs=args.logprobs or 0, min_new_tokens=args.min_new_tokens,
        stop_token_ids=args.stop_token_id, include_stop_str_in_output=args.include_stop_str,
        suppress_token_ids=args.suppress_token_id, begin_suppress_token_ids=args.begin_suppress_token_id,
        early_stopping=args.early_stopping, **({} if args.length_penalty is None else {"length_penalty": args.length_penalty}),
    )


def generate_main(connection: Connection, request: pb.GenerateRequest, timeout_s: float) -> int:
    """`kvshare generate`: text to stdout as it streams, usage and timings to stderr. With several
    samples or beams, each sample's text follows a ``--- sample i`` line (sample 0 streams); with
    logprobs, one ``id logprob [id:text:logprob alternatives]`` line per token goes to stderr."""
    with connection.channel() as channel:
        stub = pb_grpc.GeneratorStub(channel)
        echoed = []

        def echo(text: str) -> None:
            echoed.append(text)
            print(text, end="", flush=True)

        if request.n > 1 or request.num_beams > 1:
            print("--- sample 0", flush=True)
        try:
            samples = complete_all(stub, request, timeout_s, echo=echo, metadata=connection.metadata)
        except grpc.RpcError as exc:
            print(f"{chr(10) if echoed else ''}error: {exc.code().name}: {exc.details()}", file=sys.stderr)
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
    over, ``/exit`` or end of input quits."""
    history: list[pb.ChatMessage] = [pb.ChatMessage(role="system", content=system)] if system else []
    with connection.channel() as channel:
        stub = pb_grpc.GeneratorStub(channel)
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
                print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
                continue
            print(flush=True)
            u = done.last.usage
            print(f"({u.completion_tokens} tokens, {u.cached_prompt_tokens} of {u.prompt_tokens} prompt tokens cached, "
                  f"first token after {done.last.timings.time_to_first_token_ms:.0f} ms)", file=sys.stderr)
            history.append(pb.ChatMessage(role="assistant", content=done.text))
