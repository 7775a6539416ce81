"""`kvshare transcribe`: sends a WAV file to a worker serving a Whisper folder and prints the
transcript (or, with --json, one object with the text, the token ids, whether the encoder's
cross-attention K/V came from the shared cache, and the time to the first token)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import Connection, complete

MAX_NEW_TOKENS = 224
"""Whisper's own cap per 30-s window: half the decoder's 448 positions (CTranslate2 and
faster-whisper decode at most max_length / 2 tokens)."""


@dataclass(frozen=True, slots=True)
class Transcript:
    text: str
    token_ids: list[int]
    """The text's tokens, without the end-of-text token that ended it."""
    encoder_cache_hit: bool
    ttft_ms: float
    finish_reason: str


def transcribe_request(audio: bytes, args: argparse.Namespace) -> pb.GenerateRequest:
    """The request for ``audio`` (WAV bytes): the folder's start sequence and suppressions apply;
    ``--prompt`` becomes the previous-text context (``<|startofprev|>``)."""
    sampling = pb.SamplingParams(temperature=args.temperature)
    if args.seed is not None:
        sampling.seed = args.seed
    return pb.GenerateRequest(encoder_audio=audio, prompt=args.prompt or "", max_new_tokens=args.max_new_tokens,
                              sampling=sampling, n=args.n, cache=pb.CacheOptions(salt=args.salt))


def transcribe(stub: pb_grpc.GeneratorStub, request: pb.GenerateRequest, timeout_s: float,
               metadata: tuple[tuple[str, str], ...] = ()) -> Transcript:
    done = complete(stub, request, timeout_s, metadata=metadata)
    last = done.last
    ids = list(done.token_ids)
    if last.finish_reason == pb.FINISH_REASON_EOS and ids:
        ids.pop()  # the end-of-text token is not part of the transcript
    return Transcript(text=done.text.strip(), token_ids=ids, encoder_cache_hit=last.usage.encoder_cache_hit,
                      ttft_ms=round(last.timings.time_to_first_token_ms, 1),
                      finish_reason=pb.FinishReason.Name(last.finish_reason))


def transcribe_main(connection: Connection, args: argparse.Namespace) -> int:
    path: Path = args.file
    try:
        audio = path.read_bytes()
    except OSError as exc:
        print(f"kvshare transcribe: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    with connection.channel() as channel:
        try:
            result = transcribe(pb_grpc.GeneratorStub(channel), transcribe_request(audio, args), args.timeout_s,
                                connection.metadata)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(json.dumps(asdict(result)) if args.json else result.text, flush=True)
    return 0
