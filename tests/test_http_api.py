"""The OpenAI-compatible HTTP face, called with the official ``openai`` client as users call it:
against a real worker serving SmolLM2 and through `kvshare route` over two such workers sharing a
real redis-server. Every HTTP answer is checked against the gRPC answer to the same request.

Requests compared between the faces carry distinct ``cache_salt`` values, so both compute their
prompt: the comparison is of the translation, never of cached K/V against computed."""

from __future__ import annotations

import json
import socket
import uuid
from dataclasses import dataclass

import grpc
import openai
import pytest
from conftest import wait_until
from test_route import LOG_TIMEOUT_S, request_line, running

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete, complete_all, stream
from services.local.redis_process import free_port
from services.local.worker_process import RouterProcess, ServerProcess, WorkerProcess

pytestmark = pytest.mark.subprocess

QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}]


METRICS = free_port()
"""The first worker's metrics port."""


@dataclass
class Face:
    """One server's two faces: the gRPC channel and the OpenAI client on its HTTP port."""

    server: ServerProcess
    client: openai.OpenAI
    stub: pb_grpc.GeneratorStub
    model: str


@pytest.fixture(scope="module")
def fleet(smollm2, redis_server):
    common = ("--cache", redis_server.url, "--max-batch", "4", "--kv-cache-bytes", str(1 << 30))
    with WorkerProcess(smollm2, *common, "--http-port", str(free_port()), "--metrics-port", str(METRICS)) as a, \
            WorkerProcess(smollm2, *common, "--http-port", str(free_port())) as b, \
            RouterProcess([a.target, b.target], "--http-port", str(free_port())) as router:
        yield {"worker": a, "router": router}


@pytest.fixture(params=["worker", "router"])
def face(request, fleet):
    server = fleet[request.param]
    client = openai.OpenAI(base_url=f"http://{server.http_target}/v1", api_key="unused", max_retries=0, timeout=120)
    with grpc.insecure_channel(server.target) as channel:
        yield Face(server, client, pb_grpc.GeneratorStub(channel), client.models.list().data[0].id)
    client.close()


def salt() -> str:
    return uuid.uuid4().hex


def grpc_chat(face: Face, messages: list[dict], **fields) -> list:
    request = pb.GenerateRequest(messages=[pb.ChatMessage(**m) for m in messages], cache=pb.CacheOptions(salt=salt()),
                                 **fields)
    return complete_all(face.stub, request, timeout_s=120)


def test_models_lists_the_served_model_and_its_context(face):
    (card,) = face.client.models.list().data
    info = face.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert card.id == face.model == info.name and card.owned_by == "kvshare"
    assert card.model_extra["max_model_len"] == info.context_length == 8192
    assert face.client.models.retrieve(face.model).id == face.model


def test_greedy_chat_equals_the_grpc_answer_whole_and_streamed(face):
    (expected,) = grpc_chat(face, QUESTION, max_new_tokens=24)
    whole = face.client.chat.completions.create(model=face.model, messages=QUESTION, max_tokens=24, temperature=0,
                                                extra_body={"cache_salt": salt()})
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == "stop" and whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.usage.completion_tokens == len(expected.token_ids)
    assert whole.usage.prompt_tokens == expected.last.usage.prompt_tokens
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(face.client.chat.completions.create(
        model=face.model, messages=QUESTION, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"cache_salt": salt()}))
    *deltas, last = chunks
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == expected.text
    assert [c.choices[0].finish_reason for c in deltas][-1] == "stop"
    assert all(c.usage is None for c in deltas) and not last.choices
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens


def test_max_tokens_hit_is_length_and_stop_lists_end_the_answer(face):
    short = face.client.chat.completions.create(model=face.model, messages=QUESTION, max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    (free,) = grpc_chat(face, QUESTION, max_new_tokens=24)
    word = free.text.split()[3]  # a word inside the greedy answer: the answer ends before it
    stopped = face.client.chat.completions.create(
        model=face.model, messages=QUESTION, max_completion_tokens=24, temperature=0, stop=["no such text", word])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == free.text[: free.text.find(word)]


def test_n_samples_with_a_seed_equal_the_grpc_samples(face):
    expected = grpc_chat(face, QUESTION, max_new_tokens=12, n=2, sampling=pb.SamplingParams(temperature=0.9, seed=7))
    answer = face.client.chat.completions.create(model=face.model, messages=QUESTION, max_tokens=12, temperature=0.9,
                                                 seed=7, n=2, extra_body={"cache_salt": salt()})
    assert [c.index for c in answer.choices] == [0, 1]
    assert [c.message.content for c in answer.choices] == [e.text for e in expected]
    assert answer.usage.completion_tokens == sum(len(e.token_ids) for e in expected)


def test_logprobs_equal_the_grpc_logprobs(face):
    (expected,) = grpc_chat(face, QUESTION, max_new_tokens=8, logprobs=True, top_logprobs=3)
    answer = face.client.chat.completions.create(model=face.model, messages=QUESTION, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=3, extra_body={"cache_salt": salt()})
    content = answer.choices[0].logprobs.content
    assert [t.logprob for t in content] == [e.logprob for e in expected.logprobs]
    assert [t.token for t in content] == [e.text for e in expected.logprobs]
    assert "".join(t.token for t in content) == answer.choices[0].message.content
    assert all(t.bytes == list(t.token.encode()) for t in content)
    for token, entry in zip(content, expected.logprobs, strict=True):
        assert [(a.token, a.logprob) for a in token.top_logprobs] == [(a.text, a.logprob) for a in entry.top]
    streamed = face.client.chat.completions.create(model=face.model, messages=QUESTION, max_tokens=8, temperature=0,
                                                   logprobs=True, top_logprobs=3, stream=True,
                                                   extra_body={"cache_salt": salt()})
    assert [t.logprob for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.content] == \
        [e.logprob for e in expected.logprobs]


def test_a_shared_long_system_message_is_reported_as_cached_tokens(face):
    system = {"role": "system", "content": f"Session {uuid.uuid4()}. " + "You answer questions about geography, "
              "history and science briefly and precisely, in one sentence, and never invent facts. " * 6}
    first = face.client.chat.completions.create(
        model=face.model, messages=[system, {"role": "user", "content": "Name a river."}], max_tokens=4, temperature=0)
    second = face.client.chat.completions.create(
        model=face.model, messages=[system, {"role": "user", "content": "Name a mountain."}], max_tokens=4,
        temperature=0, stream=True, stream_options={"include_usage": True})
    usage = list(second)[-1].usage
    assert first.usage.prompt_tokens > 128
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_text_completions_of_several_prompts_equal_the_grpc_answers(face):
    prompts = ["The capital of France is", "Water boils at"]
    expected = [complete(face.stub, pb.GenerateRequest(prompt=p, max_new_tokens=6, cache=pb.CacheOptions(salt=salt())),
                         timeout_s=120) for p in prompts]
    answer = face.client.completions.create(model=face.model, prompt=prompts, max_tokens=6, temperature=0,
                                            extra_body={"cache_salt": salt()})
    assert answer.object == "text_completion" and [c.index for c in answer.choices] == [0, 1]
    assert [c.text for c in answer.choices] == [e.text for e in expected]
    assert answer.usage.prompt_tokens == sum(e.last.usage.prompt_tokens for e in expected)
    ids = face.stub.Tokenize(pb.TokenizeRequest(text=prompts[0]), timeout=30).token_ids
    by_ids = face.client.completions.create(model=face.model, prompt=list(ids), max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == expected[0].text


def test_echo_puts_the_prompt_and_its_logprobs_first(face):
    prompt = "The capital of France is"
    messages = list(stream(face.stub, pb.GenerateRequest(prompt=prompt, max_new_tokens=4, logprobs=True, top_logprobs=1,
                                                         prompt_logprobs=True), 120))
    expected = [None, *(e.logprob for m in messages for e in m.prompt_logprobs),
                *(e.logprob for m in messages for e in m.logprobs)]
    for streamed in (False, True):
        answer = face.client.completions.create(model=face.model, prompt=prompt, max_tokens=4, temperature=0,
                                                echo=True, logprobs=1, stream=streamed)
        chunks = list(answer) if streamed else [answer]
        assert "".join(c.choices[0].text for c in chunks) == prompt + "".join(m.text for m in messages)
        logprobs = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
        assert [v for lp in logprobs for v in lp.token_logprobs] == expected, streamed
        tokens = [t for lp in logprobs for t in lp.tokens]
        assert "".join(tokens[: len(expected) - 4]) == prompt
        offsets = [o for lp in logprobs for o in lp.text_offset]
        assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]


def test_a_client_that_leaves_mid_stream_frees_its_row(fleet):
    """The stream would fill the context (some 8000 tokens): only the client's leaving ends it."""
    worker = fleet["worker"]
    host, port = worker.http_target.rsplit(":", 1)
    body = json.dumps({"messages": QUESTION, "stream": True, "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port)), timeout=60) as client:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvshare\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(body) + body)
        received = b""
        while received.count(b"data: ") < 3:  # the stream is under way
            received += client.recv(65536)
        assert received.startswith(b"HTTP/1.1 200")
        wait_until(lambda: running(METRICS) == 1, LOG_TIMEOUT_S, "the stream to hold its row")
        client.shutdown(socket.SHUT_RDWR)
    wait_until(lambda: running(METRICS) == 0, LOG_TIMEOUT_S, "the worker to free the row of a client that left")
    request_id = received.split(b'"id":"')[1].split(b'"')[0].decode()
    wait_until(lambda: any(f"request {request_id} stopped after" in line for line in worker.log_lines),
               LOG_TIMEOUT_S, "the request's line")
    line = request_line(worker, request_id)
    assert "(cancelled or failed)" in line, line
