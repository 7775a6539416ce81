"""`kvshare transcribe`: sends a WAV file to a worker serving a Whisper folder and prints the
transcript (or, with --json, one object with the text, the token ids, whether the encoder's
cross-attention K/V came from the shared cache, and the time to the first token); with --n or
--num-beams, every sample or hypothesis, one per line, best first for beams."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete_all
from services.connection import Connection, rpc_error_line

MAX_NEW_TOKENS = 224
"""Whisper's own cap per 30-s window: half the decoder's 448 positions (CTranslate2 and
faster-whisper decode at most max_length / 2 tokens)."""


@dataclass(frozen=True, slots=True)
class Transcript:
    index: int
    """The sample (or, with beams, the hypothesis' rank) this is."""
    text: str
    token_ids: list[int]
    """The text's tokens, without the end-of-text token that ended it."""
    encoder_cache_hit: bool
    ttft_ms: float
    finish_reason: str


def transcribe_request(audio: bytes, *, temperature: float = 0.0, seed: int | None = None, prompt: str = "",
                       max_new_tokens: int = MAX_NEW_TOKENS, n: int = 1, num_beams: int = 1,
                       salt: str = "") -> pb.GenerateRequest:
    """The request for ``audio`` (WAV bytes): the folder's start sequence and suppressions apply;
    ``prompt`` becomes the previous-text context (``<|startofprev|>``)."""
    sampling = pb.SamplingParams(temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    return pb.GenerateRequest(encoder_audio=audio, prompt=prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                              n=n, num_beams=num_beams, cache=pb.CacheOptions(salt=salt))


def transcribe(stub: pb_grpc.GeneratorStub, request: pb.GenerateRequest, timeout_s: float,
               metadata: tuple[tuple[str, str], ...] = ()) -> list[Transcript]:
    """Every sample's (or hypothesis') transcript, by index."""
    transcripts = []
    for done in complete_all(stub, request, timeout_s, metadata=metadata):
        last = done.last
        ids = list(done.token_ids)
        if last.finish_reason == pb.FINISH_REASON_EOS and ids:
            ids.pop()  # the end-of-text token is not part of the transcript
        transcripts.append(Transcript(
            index=last.index, text=done.text.strip(), token_ids=ids, encoder_cache_hit=last.usage.encoder_cache_hit,
            ttft_ms=round(last.timings.time_to_first_token_ms, 1), finish_reason=pb.FinishReason.Name(last.finish_reason)))
    return transcripts


def transcribe_main(connection: Connection, args: argparse.Namespace) -> int:
    path: Path = args.file
    try:
        audio = path.read_bytes()
    except OSError as exc:
        print(f"kvshare transcribe: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if not audio:
        print(f"kvshare transcribe: {path} is empty", file=sys.stderr)
        return 2
    if args.n > 1 and args.temperature == 0 and args.num_beams <= 1:
        print("kvshare transcribe: --n samples at --temperature 0 are all the greedy transcript", file=sys.stderr)
    with connection.channel() as channel:
        try:
            request = transcribe_request(audio, temperature=args.temperature, seed=args.seed, prompt=args.prompt or "",
                                         max_new_tokens=args.max_new_tokens, n=args.n, num_beams=args.num_beams,
                                         salt=args.salt)
            results = transcribe(pb_grpc.GeneratorStub(channel), request, args.timeout_s, connection.metadata)
        except grpc.RpcError as exc:
            print(rpc_error_line("transcribe", exc, connection), file=sys.stderr)
            return 1
    several = len(results) > 1
    for result in results:
        print(json.dumps(asdict(result)) if args.json else f"[{result.index}] {result.text}" if several else result.text,
              flush=True)
        if result.finish_reason == "FINISH_REASON_LENGTH":
            print(f"kvshare transcribe: {'[%d] ' % result.index if several else ''}cut at --max-new-tokens "
                  f"{args.max_new_tokens}", file=sys.stderr)
    return 0
