"""The speech demo (`kvshare demo --whisper`): a Redis server and two worker replicas serving
Whisper tiny.en (fetched and converted on first use). Replica A transcribes a clip; replica B then
decodes the same audio again three ways (greedy, three sampled candidates, with a text prompt)
from the encoder output A published, and each replica's encoder runs are read from its metrics:
B's stay at zero.
"""

from __future__ import annotations

import re
import sys
from contextlib import ExitStack
from importlib import resources
from pathlib import Path
from urllib.request import urlopen

import grpc

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete_all
from services.local.cross_keys import wait_for_cross_keys
from services.local.model_catalogue import fetch_model
from services.local.redis_process import RedisServer, free_port
from services.local.worker_process import WorkerProcess
from services.transcribe import MAX_NEW_TOKENS

DEMO_MODEL = "whisper-tiny.en"
CLIP = "demo_clip.wav"
"""A 3-s espeak-ng sentence, 16 kHz mono (tests/data/whisper/clip1.wav: the demo needs no
microphone and no sound tools)."""
SPOKEN = "The quick brown fox jumps over the lazy dog."
"""What the clip's robotic voice says; tiny.en's greedy transcript hears "nog" for "dog"."""


def _encoder_runs(metrics_port: int) -> int:
    text = urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return int(float(re.search(r"^kvshare_encoder_runs_total (\S+)$", text, re.MULTILINE).group(1)))


def run_whisper_demo(model_dir: Path | None) -> int:
    model = model_dir or fetch_model(DEMO_MODEL)
    if not (model / "preprocessor_config.json").is_file():
        print(f"kvshare demo --whisper: {model} is not a Whisper folder (no preprocessor_config.json); "
              f"leave --model out, or give a folder from `kvshare fetch-model {DEMO_MODEL}`", file=sys.stderr)
        return 2
    audio = resources.files(__package__).joinpath(CLIP).read_bytes()
    asks = (
        ("A", "transcribe (greedy)", {}),
        ("B", "the same audio again (greedy)", {}),
        ("B", "3 sampled candidates, temperature 0.7", {"n": 3, "sampling": pb.SamplingParams(temperature=0.7, seed=1)}),
        ("B", "with a prompt: 'A fox and a dog.'", {"prompt": "A fox and a dog."}),
    )
    with ExitStack() as stack:
        redis_server = stack.enter_context(RedisServer())
        ports = [free_port() for _ in range(2)]
        workers = [stack.enter_context(WorkerProcess(model, "--cache", redis_server.url, "--metrics-port", str(p)))
                   for p in ports]
        stubs = dict(zip("AB", (pb_grpc.GeneratorStub(stack.enter_context(grpc.insecure_channel(w.target)))
                                for w in workers), strict=True))
        print(f"redis-server on {redis_server.url}; Whisper tiny.en on replicas A {workers[0].target} and "
              f"B {workers[1].target}")
        print(f"audio: a 3-s espeak-ng clip (tests/data/whisper/clip1.wav) saying \"{SPOKEN}\"\n")
        rows = []
        for i, (replica, what, fields) in enumerate(asks):
            if i == 1:  # A's publish runs after its answer: B asks once the cross K/V is in Redis
                with redis_server.client() as client:
                    wait_for_cross_keys(client, 1)
            request = pb.GenerateRequest(encoder_audio=audio, max_new_tokens=MAX_NEW_TOKENS, **fields)
            samples = complete_all(stubs[replica], request, timeout_s=300)
            for i, done in enumerate(samples):
                print(f"replica {replica}, {what}{f' [{i}]' if len(samples) > 1 else ''}:{done.text}")
            last = samples[0].last
            rows.append((replica, what, last.usage.encoder_cache_hit, last.timings.time_to_first_token_ms,
                         last.timings.total_ms))
        runs = dict(zip("AB", (_encoder_runs(p) for p in ports), strict=True))
    print(f"\n{'replica':>7}  {'request':<40}  {'cross K/V from store':>20}  {'TTFT ms':>8}  {'total ms':>8}")
    for replica, what, hit, ttft, total in rows:
        print(f"{replica:>7}  {what:<40}  {'yes' if hit else 'no (encoder ran)':>20}  {ttft:>8.1f}  {total:>8.1f}")
    print(f"\nencoder runs: replica A {runs['A']}, replica B {runs['B']}. B decoded the audio three more ways "
          "from the cross-attention K/V that A published to Redis, without running its encoder. The robotic voice's "
          "\"dog\" is a near-tie for tiny.en: greedy hears \"nog\", samples vary, and the prompt tips it to \"dog\".")
    return 0 if runs["B"] == 0 else 1
