"""A chat's next turn reuses the previous answer's K/V on another replica.

A stream that ends by EOS, a stop token id or its length publishes the full blocks of its prompt
plus its generated tokens, all but the last generated token (whose K/V was never computed: it was
not fed back). Turn 2 of a chat sends [system, user, assistant = turn 1's text, user 2] through the
chat template, so its prompt starts with turn 1's prompt and answer, and a replica that never saw
turn 1 finds those blocks in Redis.

A model whose matmuls quantize their activations (the gguf folder) computes its answer again as
prompt before publishing it: its decoded K/V differs from a prefill's by more than rounding, and
the recomputed blocks make the next turn answer exactly as a cold request.

Real redis-server, two real `kvshare serve` processes on the SmolLM2 folders, real gRPC, blocks of
16 tokens. Expected counts are computed from the Tokenize RPC, never guessed. Publishes are awaited
by counting keys in Redis; the one negative check (nothing published) is ordered by a later publish
on the same single write thread, so nothing waits on the clock.
"""

from __future__ import annotations

import contextlib

import grpc
import numpy as np
import pytest
from conftest import record_margin, wait_until

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete
from services.local.redis_process import stored_values
from services.local.worker_process import WorkerProcess

pytestmark = pytest.mark.subprocess
B = 16
TIMEOUT_S = 300
PUBLISH_TIMEOUT_S = 60
SYSTEM = "You are the support assistant of a bicycle shop. Answer briefly and politely."
QUESTION = "How do I fix a flat tyre?"
FOLLOW_UP = "Which of those is the most important?"
# Chosen so that turn 2's greedy choices are far apart (smallest top-1/top-2 gap 0.19 over its 32
# tokens): a cached and a cold prefill differ in float rounding only, and must pick the same ids.


def chat(*turns: tuple[str, str]) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=role, content=content) for role, content in turns]


def ids_of(stub, messages: list[pb.ChatMessage]) -> list[int]:
    return list(stub.Tokenize(pb.TokenizeRequest(messages=messages)).token_ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_cached(stored: list[int], prompt: list[int]) -> int:
    """Tokens of ``prompt`` a lookup serves when exactly the full blocks of ``stored`` are in the
    store: the common prefix cut down to whole blocks, capped so the last prompt token runs."""
    return min(common_prefix(stored, prompt) // B * B, len(prompt) - 1)


@contextlib.contextmanager
def replicas(model, cache_url):
    """Two workers sharing one Redis. One write thread each: publishes land in the order they were
    scheduled, so a later publish having landed proves an earlier one would have."""
    args = ("--cache", cache_url, "--block-size", str(B), "--store-write-threads", "1")
    with WorkerProcess(model, *args) as a, WorkerProcess(model, *args) as b, \
            grpc.insecure_channel(a.target) as ca, grpc.insecure_channel(b.target) as cb:
        yield pb_grpc.GeneratorStub(ca), pb_grpc.GeneratorStub(cb)


def wait_for_keys(client, count: int, what: str) -> None:
    wait_until(lambda: stored_values(client) >= count, timeout_s=PUBLISH_TIMEOUT_S, what=what)
    assert stored_values(client) == count, f"{what}: {stored_values(client)} values, expected {count}"


def after_turn_one(stub, client, turn1: list[pb.ChatMessage], prompt_tokens: int, what: str) -> None:
    """Publishes turn 1's prompt again under another salt, scheduled after turn 1 ended on the
    replica's single write thread, and waits until it landed: anything turn 1 had scheduled would
    have landed before it. Redis then holds turn 1's prompt blocks twice over, and nothing else."""
    sentinel = complete(stub, pb.GenerateRequest(messages=turn1, max_new_tokens=1, cache=pb.CacheOptions(salt="x")),
                        TIMEOUT_S)
    assert sentinel.last.usage.cached_prompt_tokens == 0
    wait_for_keys(client, 2 * (prompt_tokens // B), what)


def generate(stub, messages, max_new_tokens: int, **cache) -> tuple[list[int], str, pb.GenerateResponse, list]:
    """Greedy; returns (token ids, text, last message, top-2 log-probabilities of each token)."""
    request = pb.GenerateRequest(messages=messages, max_new_tokens=max_new_tokens, logprobs=True, top_logprobs=2,
                                 cache=pb.CacheOptions(**cache))
    ids, text, last, tops = [], [], None, []
    for message in stub.Generate(request, timeout=TIMEOUT_S):
        ids += message.token_ids
        text.append(message.text)
        tops += [[t.logprob for t in lp.top] for lp in message.logprobs]
        last = message
    return ids, "".join(text), last, tops


def test_turn_two_on_another_replica_reuses_turn_ones_answer(smollm2, redis_server, redis_url):
    with replicas(smollm2, redis_url) as (a, b), redis_server.client() as client:
        turn1 = chat(("system", SYSTEM), ("user", QUESTION))
        prompt1 = ids_of(a, turn1)
        answer, text, last, _ = generate(a, turn1, 48)
        assert last.finish_reason in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_LENGTH)
        assert last.usage.cached_prompt_tokens == 0
        # Stored: the prompt and every generated token but the last, in full blocks.
        stored = prompt1 + answer[:-1]
        wait_for_keys(client, len(stored) // B, "replica A's prompt and answer blocks")

        turn2 = chat(("system", SYSTEM), ("user", QUESTION), ("assistant", text), ("user", FOLLOW_UP))
        prompt2 = ids_of(b, turn2)
        # The template resends turn 1's prompt, then the answer's text, then "<|im_end|>\n" and the
        # next user message. Re-tokenizing the answer's text gives back the generated ids here (an
        # EOS that ended turn 1 is the template's own <|im_end|>): prompt 2 extends prompt 1 +
        # answer, so the blocks stop only because of the uncomputed last token and the partial block.
        assert common_prefix(prompt1 + answer, prompt2) == len(prompt1 + answer), (
            "re-tokenizing the answer changed its ids", answer, prompt2[len(prompt1):])
        cached = expected_cached(stored, prompt2)
        # More than turn 1's whole prompt, so more than its own full blocks: part of the answer.
        assert cached > len(prompt1), (cached, len(prompt1))

        warm_ids, _, warm_last, _ = generate(b, turn2, 32)
        assert warm_last.usage.prompt_tokens == len(prompt2)
        assert warm_last.usage.cached_prompt_tokens == cached
        assert warm_last.timings.cache_fetch_ms > 0
        cold_ids, _, cold_last, tops = generate(b, turn2, 32, skip_read=True, skip_write=True)
        assert cold_last.usage.cached_prompt_tokens == 0
        for top in tops[: len(cold_ids)]:
            record_margin("chat turn 2 over turn 1's cached answer vs cold (SmolLM2)", np.asarray(top[::-1]))
        assert warm_ids == cold_ids
        # B published the blocks of turn 2 it computed, its own answer too: a third turn would hit.
        wait_for_keys(client, len(stored) // B + (len(prompt2) + len(warm_ids) - 1) // B - cached // B,
                      "replica B's turn-2 blocks")


def test_skip_write_on_turn_one_publishes_nothing_of_the_answer(smollm2, redis_server, redis_url):
    with replicas(smollm2, redis_url) as (a, b), redis_server.client() as client:
        turn1 = chat(("system", SYSTEM), ("user", QUESTION))
        prompt1 = ids_of(a, turn1)
        # Another request publishes turn 1's prompt (one token generated: no answer blocks).
        assert complete(a, pb.GenerateRequest(messages=turn1, max_new_tokens=1), TIMEOUT_S).token_ids
        wait_for_keys(client, len(prompt1) // B, "the prompt's blocks")

        answer, text, last, _ = generate(a, turn1, 48, skip_write=True)
        assert last.finish_reason in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_LENGTH)
        assert last.usage.cached_prompt_tokens == len(prompt1) // B * B
        assert (len(prompt1) + len(answer) - 1) // B > len(prompt1) // B, "the answer would fill a block"
        after_turn_one(a, client, turn1, len(prompt1), "the sentinel's blocks (and nothing of the answer)")

        turn2 = chat(("system", SYSTEM), ("user", QUESTION), ("assistant", text), ("user", FOLLOW_UP))
        done = complete(b, pb.GenerateRequest(messages=turn2, max_new_tokens=1), TIMEOUT_S)
        assert done.last.usage.cached_prompt_tokens == len(prompt1) // B * B


def test_a_model_that_quantizes_activations_publishes_its_answer_computed_as_prompt(smollm2_gguf, redis_server,
                                                                                    redis_url):
    """The gguf folder (int8 activations): a decode step's row is not a prompt row, so turn 1's
    answer is computed again as prompt before it is published (reused as decoded, those blocks
    moved a turn-2 token at a 0.04 margin); turn 2 on the other replica reuses it and answers as a
    cold request, bit for bit (the same tokens and log-probabilities)."""
    with replicas(smollm2_gguf, redis_url) as (a, b):
        turn1 = chat(("system", SYSTEM), ("user", QUESTION))
        prompt1 = ids_of(a, turn1)
        answer, text, last, _ = generate(a, turn1, 48)
        assert last.usage.cached_prompt_tokens == 0
        stored = prompt1 + answer[:-1]
        with redis_server.client() as client:
            wait_for_keys(client, len(stored) // B, "replica A's prompt and recomputed answer blocks")

        turn2 = chat(("system", SYSTEM), ("user", QUESTION), ("assistant", text), ("user", FOLLOW_UP))
        prompt2 = ids_of(b, turn2)
        assert common_prefix(prompt1 + answer, prompt2) == len(prompt1 + answer)
        cached = expected_cached(stored, prompt2)
        assert cached > len(prompt1), (cached, len(prompt1))
        warm_ids, _, warm_last, warm_tops = generate(b, turn2, 32)
        assert warm_last.usage.cached_prompt_tokens == cached
        cold_ids, _, cold_last, cold_tops = generate(b, turn2, 32, skip_read=True, skip_write=True)
        assert cold_last.usage.cached_prompt_tokens == 0
        assert warm_ids == cold_ids and warm_tops == cold_tops
