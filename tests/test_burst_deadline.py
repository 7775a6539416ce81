"""A burst of 500 requests from two tenants, behind a slot that never frees (a stream of tenant A
nobody reads, its patience set beyond the test): what the worker cannot queue it refuses at once,
tenant B's requests push tenant A's out of the queue, and what it did queue is refused
RESOURCE_EXHAUSTED before the callers' deadlines. No call may end DEADLINE_EXCEEDED (12 of 500
did, queued until their deadlines). The outcome is counted, never timed: the deadline is the
callers', and a refusal before it is the only answer that is not DEADLINE_EXCEEDED."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.api.api_keys import key_line
from services.local.worker_process import WorkerProcess

pytestmark = pytest.mark.subprocess

KEYS = {"a": "tenant-a-key-" + "1" * 32, "b": "tenant-b-key-" + "2" * 32}
DEADLINE_S = 10.0
QUEUED = 16


def auth(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


def test_a_burst_with_push_out_ends_in_refusals_never_in_deadline_exceeded(tiny_model, tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text("".join(key_line(t, k) for t, k in KEYS.items()))
    with WorkerProcess(tiny_model, "--api-keys-file", str(keys), "--max-batch", "1", "--max-queued", str(QUEUED),
                       "--max-unread-tokens", "2", "--max-paused-s", "3600", "--yield-paused-s", "3600") as worker:
        async def scenario() -> tuple[Counter, int]:
            # The holder's channel keeps HTTP/2 windows at 64 KiB: with 20 log-probabilities a token,
            # its unread messages fill them within a few hundred tokens and the stream pauses.
            async with grpc.aio.insecure_channel(worker.target) as channel, \
                    grpc.aio.insecure_channel(worker.target, options=[("grpc.http2.bdp_probe", 0)]) as held:
                stub = pb_grpc.GeneratorStub(channel)
                holder = pb_grpc.GeneratorStub(held).Generate(pb.GenerateRequest(
                    prompt="the slot holder", max_new_tokens=1000, ignore_eos=True, logprobs=True, top_logprobs=20),
                    metadata=auth("a"))
                await holder.read()  # it holds the only slot from here on, paused: nobody reads it

                async def one(i: int, tenant: str) -> str:
                    call = stub.Generate(pb.GenerateRequest(prompt=f"question {i}", max_new_tokens=2),
                                         metadata=auth(tenant), timeout=DEADLINE_S)
                    try:
                        async for _ in call:
                            pass
                    except grpc.aio.AioRpcError as exc:
                        return exc.code().name + (" pushed out" if "another client arrived" in exc.details() else "")
                    return "OK"

                # Tenant A's half first: once all but the 16 it queued have their refusals, tenant B's
                # half arrives holding fewer rows, and pushes A's newest queued requests out.
                first = [asyncio.ensure_future(one(i, "a")) for i in range(250)]
                while sum(call.done() for call in first) < 250 - QUEUED:
                    await asyncio.sleep(0.01)
                second = [asyncio.ensure_future(one(i, "b")) for i in range(250)]
                outcomes = Counter(await asyncio.gather(*first, *second))
                holder.cancel()
                return outcomes

        outcomes = asyncio.run(scenario())
    assert "DEADLINE_EXCEEDED" not in outcomes, outcomes
    assert set(outcomes) <= {"RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED pushed out"}, outcomes
    assert outcomes["RESOURCE_EXHAUSTED pushed out"] > 0, f"tenant B pushed tenant A out of the queue: {outcomes}"
