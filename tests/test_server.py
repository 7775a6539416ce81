"""`kvshare serve` as a real subprocess, driven over gRPC on loopback."""

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete
from services.local.redis_process import stored_values
from services.local.worker_process import WorkerProcess
from services.runtime.kv_layout import KVLayout

pytestmark = pytest.mark.subprocess
ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The system prompt tells the assistant who it is."


def still_serves(stub) -> None:
    done = complete(stub, pb.GenerateRequest(prompt=PROMPT, max_new_tokens=3, ignore_eos=True), timeout_s=30)
    assert done.last.usage.completion_tokens == 3


def test_stream_arrives_message_by_message(stub):
    request = pb.GenerateRequest(request_id="r1", prompt=PROMPT, max_new_tokens=40, ignore_eos=True)
    messages = list(stub.Generate(request, timeout=30))
    # One message per token, or a few tokens per message when the client reads slower than the
    # worker generates; the worker holds at most 8 unread tokens per stream (the fixture's
    # --max-unread-tokens), so however fast it generates, no message carries more than 8 tokens.
    assert all(1 <= len(m.token_ids) <= 8 for m in messages), [len(m.token_ids) for m in messages]
    assert sum(len(m.token_ids) for m in messages) == 40
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not m.HasField("usage") for m in messages[:-1])
    last = messages[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 40
    assert last.usage.prompt_tokens == len(stub.Tokenize(pb.TokenizeRequest(text=PROMPT)).token_ids)
    assert last.usage.cached_prompt_tokens == 0
    assert 0 < last.timings.time_to_first_token_ms <= last.timings.total_ms
    ids = [t for m in messages for t in m.token_ids]
    assert "".join(m.text for m in messages) == stub.Tokenize(pb.TokenizeRequest(token_ids=ids)).text


def test_health_and_reflection(worker):
    with grpc.insecure_channel(worker.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvshare.v1.Generator"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert "kvshare.v1.Generator" in services
        assert "grpc.health.v1.Health" in services


def test_model_info(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_size) == (2, 4, 2, 16)
    assert info.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert info.cache_dtype == "float16" and info.cached_bytes_per_token == 2 * 2 * 2 * 16 * 2
    assert info.vocab_size == 512 and info.context_length == 1024
    assert info.execution_provider == "CPUExecutionProvider"
    assert len(info.fingerprint) == 64 and not info.encoder_decoder and info.block_size == 64
    (group,) = info.layer_groups
    assert (list(group.layers), group.window, group.fetched_over_window) == ([0, 1], 0, False)
    assert (group.kv_bytes_per_token, group.cached_bytes_per_token) == (info.kv_bytes_per_token, info.cached_bytes_per_token)


def test_tokenize_both_ways(stub):
    ids = stub.Tokenize(pb.TokenizeRequest(text="café 🙂")).token_ids
    assert stub.Tokenize(pb.TokenizeRequest(token_ids=ids)).text == "café 🙂"


def test_stop_string_and_eos(stub):
    free = complete(stub, pb.GenerateRequest(prompt=PROMPT, max_new_tokens=30, ignore_eos=True), timeout_s=30)
    stop = free.text[5:9]
    done = complete(stub, pb.GenerateRequest(prompt=PROMPT, max_new_tokens=30, ignore_eos=True, stop=[stop]), timeout_s=30)
    assert done.last.finish_reason == pb.FINISH_REASON_STOP
    assert done.text == free.text[: free.text.find(stop)]


def test_unset_max_new_tokens_generates_up_to_the_context_end(stub):
    """0 (proto3's unset) means as many as fit: here the 24 tokens left of the 1024-token context
    (the worker's cap, 512, is larger), then finish_reason LENGTH."""
    done = complete(stub, pb.GenerateRequest(prompt_token_ids=[5] * 1000, ignore_eos=True), timeout_s=60)
    assert done.last.finish_reason == pb.FINISH_REASON_LENGTH
    assert len(done.token_ids) == done.last.usage.completion_tokens == 24


def test_seeded_sampling_repeats(stub):
    def sample(seed):
        request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=20, ignore_eos=True,
                                     sampling=pb.SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=seed))
        return complete(stub, request, timeout_s=30).token_ids

    assert sample(5) == sample(5)
    assert sample(5) != sample(6)


BAD_REQUESTS = {
    "no prompt": (pb.GenerateRequest(max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    "prompt and ids": (pb.GenerateRequest(prompt="x", prompt_token_ids=[5], max_new_tokens=4),
                       grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    "token outside vocabulary": (pb.GenerateRequest(prompt_token_ids=[5, 512], max_new_tokens=4),
                                 grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids[1]"),
    "negative token": (pb.GenerateRequest(prompt_token_ids=[-1], max_new_tokens=4),
                       grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids[0]"),
    "beyond context": (pb.GenerateRequest(prompt_token_ids=[5] * 1000, max_new_tokens=100),
                       grpc.StatusCode.OUT_OF_RANGE, "context length"),
    "prompt alone fills the context": (pb.GenerateRequest(prompt_token_ids=[5] * 1024), grpc.StatusCode.OUT_OF_RANGE,
                                       "context length"),
    "min_new_tokens above what fits": (pb.GenerateRequest(prompt_token_ids=[5] * 1000, min_new_tokens=30),
                                       grpc.StatusCode.INVALID_ARGUMENT, "min_new_tokens"),
    "max_new_tokens above cap": (pb.GenerateRequest(prompt="x", max_new_tokens=513),
                                 grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
    "negative temperature": (pb.GenerateRequest(prompt="x", max_new_tokens=4, sampling=pb.SamplingParams(temperature=-0.5)),
                             grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
    "infinite temperature": (pb.GenerateRequest(prompt="x", max_new_tokens=4, sampling=pb.SamplingParams(temperature=float("inf"))),
                             grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
    "top_p zero": (pb.GenerateRequest(prompt="x", max_new_tokens=4, sampling=pb.SamplingParams(top_p=0.0)),
                   grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
    "top_p above one": (pb.GenerateRequest(prompt="x", max_new_tokens=4, sampling=pb.SamplingParams(top_p=1.5)),
                        grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
    "encoder input for decoder-only": (pb.GenerateRequest(prompt="x", encoder_prompt="y", max_new_tokens=4),
                                       grpc.StatusCode.INVALID_ARGUMENT, "encoder_prompt"),
    "empty stop string": (pb.GenerateRequest(prompt="x", max_new_tokens=4, stop=[""]),
                          grpc.StatusCode.INVALID_ARGUMENT, "stop[0]"),
    "request id too long": (pb.GenerateRequest(request_id="r" * 257, prompt="x", max_new_tokens=4),
                            grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    "cache salt too long": (pb.GenerateRequest(prompt="x", max_new_tokens=4, cache=pb.CacheOptions(salt="s" * 257)),
                            grpc.StatusCode.INVALID_ARGUMENT, "cache.salt"),
    # The worker fixture caps messages at 64 KiB.
    "message over the limit": (pb.GenerateRequest(prompt="x" * 70_000, max_new_tokens=4),
                               grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_input_gets_a_clear_status_and_server_keeps_serving(stub, case):
    request, code, field = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=30))
    assert info.value.code() == code, info.value.details()
    assert field in info.value.details()
    still_serves(stub)


def test_tokenize_bad_input(stub):
    with pytest.raises(grpc.RpcError) as info:
        stub.Tokenize(pb.TokenizeRequest(token_ids=[9999]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids[0]" in info.value.details()


def test_eight_concurrent_streams_complete(stub):
    def one(i):
        request = pb.GenerateRequest(request_id=f"c{i}", prompt=f"{PROMPT} Number {i}.", max_new_tokens=48, ignore_eos=True)
        return complete(stub, request, timeout_s=60)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert all(r.last.finish_reason == pb.FINISH_REASON_LENGTH and len(r.token_ids) == 48 for r in results)


def test_cancelled_stream_stops_generation(tiny_model):
    """The stream pauses on its unread tokens and a paused stream is kept for an hour, so the only
    thing that can end it within the test is the cancel (with the shared worker's 30 s
    --max-paused-s, or had the stream run on, the old check that it stopped before its 500 tokens
    could not fail). The 10 s wait is a hang guard, not a verdict."""
    with WorkerProcess(tiny_model, "--max-unread-tokens", "8", "--max-paused-s", "3600") as worker, \
            grpc.insecure_channel(worker.target) as channel:
        call = pb_grpc.GeneratorStub(channel).Generate(
            pb.GenerateRequest(request_id="to-cancel", prompt=PROMPT, max_new_tokens=500, ignore_eos=True))
        next(call)
        call.cancel()
        deadline = time.monotonic() + 10
        while not any("request to-cancel stopped after" in line for line in worker.log_lines):
            assert time.monotonic() < deadline, "the worker did not report the cancelled stream"
            time.sleep(0.05)
        line = next(line for line in worker.log_lines if "request to-cancel stopped after" in line)
        assert "(cancelled or failed)" in line, line
        still_serves(pb_grpc.GeneratorStub(channel))


def test_expired_deadline_stops_the_request_and_frees_its_slot(tiny_model):
    """The store is a socket that accepts and never answers, so the request is still fetching when
    its 0.3 s deadline passes, however fast the machine (the old version of this test assumed 500
    tokens take more than 100 ms): the worker ends it and serves on."""
    import socket

    with socket.socket() as blackhole:
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(16)
        store = f"redis://127.0.0.1:{blackhole.getsockname()[1]}/0"
        # Store calls hang 1.5 s (twice, with the retry): five times the deadline, and short enough
        # that the worker's shutdown, which lets a running lookup end, stays quick.
        with WorkerProcess(tiny_model, "--cache", store, "--cache-op-timeout-ms", "1500", "--cache-connect-timeout-ms",
                           "1500", "--max-batch", "1") as w, grpc.insecure_channel(w.target) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            request = pb.GenerateRequest(request_id="deadline", prompt_token_ids=list(range(3, 200)), max_new_tokens=500,
                                         ignore_eos=True)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=0.3))
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            deadline = time.monotonic() + 30
            while not any("request deadline stopped after 0 generated tokens" in line for line in w.log_lines):
                assert time.monotonic() < deadline, "the worker never ended the request"
                time.sleep(0.05)
            # The only slot is free again: a request that does not read the store completes.
            done = complete(stub, pb.GenerateRequest(prompt=PROMPT, max_new_tokens=3, ignore_eos=True,
                                                     cache=pb.CacheOptions(skip_read=True, skip_write=True)), timeout_s=30)
            assert done.last.usage.completion_tokens == 3


def test_second_worker_on_a_taken_port_refuses_to_start(worker, tiny_model):
    port = worker.target.rsplit(":", 1)[1]
    proc = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", str(tiny_model), "--port", port],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert "kvshare listening" not in proc.stdout
    message = [line for line in proc.stderr.splitlines() if line.startswith("kvshare serve:")]
    assert len(message) == 1 and f"cannot listen on 127.0.0.1:{port}" in message[0], proc.stderr
    still_serves_on(worker)


@pytest.mark.parametrize(("url", "says"), [("memcached://cache:11211", "is not one of memory://, redis"),
                                           ("memory", "has no scheme: use memory://, redis")])
def test_bad_cache_url_is_one_line(tiny_model, url, says):
    proc = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", str(tiny_model), "--port", "0",
                           "--cache", url], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.strip().count("\n") == 0 and says in proc.stderr


def still_serves_on(worker) -> None:
    with grpc.insecure_channel(worker.target) as channel:
        still_serves(pb_grpc.GeneratorStub(channel))


def test_sigterm_reports_not_serving_then_drains(model_dirs):
    # The small model, so that the in-flight stream is still running when SIGTERM lands.
    # --not-serving-s 2 is the default, which the suite's workers otherwise skip (conftest).
    with WorkerProcess(model_dirs["small", KVLayout.SEPARATE], "--drain-s", "30", "--not-serving-s", "2") as w, \
            grpc.insecure_channel(w.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        result = {}
        started = threading.Event()

        def long_call():
            request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=1500, ignore_eos=True)
            for m in stub.Generate(request, timeout=60):
                started.set()
                result["last"] = m
        t = threading.Thread(target=long_call)
        t.start()
        assert started.wait(10)
        os.kill(w.pid, signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 5
        status = None
        while time.monotonic() < deadline:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
            except grpc.RpcError:
                break
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.02)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        t.join(60)
        assert result["last"].finish_reason == pb.FINISH_REASON_LENGTH, "the in-flight stream was drained"
        assert w.wait(30) == 0  # it exits by itself once drained: SIGTERM was its one signal


def test_a_stream_still_running_when_the_drain_ends_gets_a_last_message(tiny_model):
    """SIGTERM with --drain-s 4: a stream still running a second before the drain ends (its client
    read one message and then waits until the worker says the drain is ending; meanwhile the stream
    is paused, its client's window full) is ended by the worker, so the client reads every token
    sent and a last message with FINISH_REASON_ABORT, as documented, not gRPC's cancel
    (UNAVAILABLE); the worker logs no traceback and exits 0."""
    with WorkerProcess(tiny_model, "--drain-s", "4", "--max-paused-s", "600") as w, \
            grpc.insecure_channel(w.target, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        request = pb.GenerateRequest(prompt="hello", max_new_tokens=1000, ignore_eos=True, logprobs=True,
                                     top_logprobs=5)  # ~200 KB of messages: more than the client's 64 KiB window
        stream = pb_grpc.GeneratorStub(channel).Generate(request, timeout=120)
        first = next(stream)
        os.kill(w.pid, signal.SIGTERM)
        deadline = time.monotonic() + 60  # a failsafe, not a measure: the loop ends on the log line
        while not any("drain ending" in line for line in w.log_lines):
            assert time.monotonic() < deadline, "the worker never reached its drain's end"
            time.sleep(0.05)
        rest = list(stream)
        assert rest and rest[-1].finish_reason == pb.FINISH_REASON_ABORT, rest[-1:]
        assert 0 < sum(len(m.token_ids) for m in [first, *rest]) < 1000
        assert w.wait(60) == 0
        assert not any("Traceback" in line for line in w.log_lines), "\n".join(w.log_lines)


def test_generate_cli_streams_text_and_reports_usage(worker):
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "--target", worker.target, "--max-new-tokens", "8", PROMPT],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "completion_tokens=" in proc.stderr and "ttft_ms=" in proc.stderr


def test_serve_refuses_a_folder_without_a_model(tmp_path, tiny_model):
    proc = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", str(tmp_path), "--port", "0"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "genai_config.json" in proc.stderr
    (tmp_path / "genai_config.json").write_bytes((tiny_model / "genai_config.json").read_bytes())
    proc = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", str(tmp_path), "--port", "0"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "model.onnx: not found" in proc.stderr


def kvshare_generate(target: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "generate", "--target", target, *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_generate_command_takes_the_sampling_and_cache_flags(worker):
    sampled = ["--temperature", "1.0", "--top-k", "40", "--top-p", "0.9", "--seed", "7", "--ignore-eos",
               "--max-new-tokens", "20", "--salt", "tenant-a", PROMPT]
    first, again = kvshare_generate(worker.target, *sampled), kvshare_generate(worker.target, *sampled)
    assert first.returncode == 0 and first.stdout == again.stdout and "completion_tokens=20" in first.stderr
    greedy = kvshare_generate(worker.target, "--ignore-eos", "--max-new-tokens", "30", PROMPT)
    stop = greedy.stdout.strip()[4:7]
    stopped = kvshare_generate(worker.target, "--ignore-eos", "--max-new-tokens", "30", "--stop", stop, PROMPT)
    assert "finish=FINISH_REASON_STOP" in stopped.stderr and stop not in stopped.stdout
    refused = kvshare_generate(worker.target, "--encoder-prompt", "a document", PROMPT)
    assert refused.returncode == 1 and "INVALID_ARGUMENT: encoder_prompt" in refused.stderr


def test_generate_command_prints_samples_beams_and_logprobs(worker):
    samples = kvshare_generate(worker.target, "--n", "3", "--temperature", "1.0", "--seed", "3", "--ignore-eos",
                               "--max-new-tokens", "6", "--logprobs", "2", "--repetition-penalty", "1.2", PROMPT)
    assert samples.returncode == 0, samples.stderr
    assert samples.stdout.count("--- sample") == 3 and "[2] finish=FINISH_REASON_LENGTH" in samples.stderr
    token_lines = [line for line in samples.stderr.splitlines() if line.startswith("  ")]
    assert len(token_lines) == 3 * 6 and all(line.count(":") >= 2 * 2 for line in token_lines)
    greedy = kvshare_generate(worker.target, "--max-new-tokens", "6", "--ignore-eos", "--logprobs", "0", PROMPT)
    third = [line.split()[0] for line in greedy.stderr.splitlines() if line.startswith("  ")][2]
    stopped = kvshare_generate(worker.target, "--max-new-tokens", "6", "--ignore-eos", "--stop-token-id", third, PROMPT)
    assert f"matched_stop_token_id={third}" in stopped.stderr and "completion_tokens=3" in stopped.stderr
    negative = kvshare_generate(worker.target, "--n", "-1", PROMPT)
    assert negative.returncode == 2 and "--n: must be 0 or more" in negative.stderr
    beams = kvshare_generate(worker.target, "--num-beams", "3", "--n", "2", "--max-new-tokens", "6", PROMPT)
    assert beams.returncode == 0, beams.stderr
    assert "[1] finish=" in beams.stderr and "beam_score=" in beams.stderr
    refused = kvshare_generate(worker.target, "--num-beams", "2", "--temperature", "0.5", PROMPT)
    assert refused.returncode == 1 and "INVALID_ARGUMENT: sampling.temperature" in refused.stderr


def test_generate_command_calls_an_encoder_decoder_model(encdec_model):
    with WorkerProcess(encdec_model) as w:
        done = kvshare_generate(w.target, "--encoder-prompt", "the document to read", "--max-new-tokens", "5",
                                "--ignore-eos", "")
    assert done.returncode == 0, done.stderr
    assert "completion_tokens=5" in done.stderr


def test_unreachable_redis_is_said_at_start_and_the_worker_serves(tiny_model):
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with WorkerProcess(tiny_model, "--cache", f"redis://127.0.0.1:{port}/0") as w, grpc.insecure_channel(w.target) as channel:
        assert any("WARNING" in line and "unreachable at start-up" in line for line in w.log_lines), w.log_lines
        still_serves(pb_grpc.GeneratorStub(channel))
        # Without --cache-required nothing watches the store: the Generator stays in rotation too.
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="kvshare.v1.Generator"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_one_json_log_line_per_request(tiny_model):
    import json

    with WorkerProcess(tiny_model, "--log-format", "json") as w, grpc.insecure_channel(w.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        complete(stub, pb.GenerateRequest(request_id="logged-1", prompt=PROMPT, max_new_tokens=4, ignore_eos=True),
                 timeout_s=30)
        deadline = time.monotonic() + 10
        while not any('"logged-1"' in line for line in w.log_lines):
            assert time.monotonic() < deadline, w.log_lines
            time.sleep(0.02)
        lines = [line for line in w.log_lines if not line.startswith("kvshare listening")]
    entries = [json.loads(line) for line in lines]  # every log line is one JSON object
    (done,) = [e for e in entries if e.get("request_id") == "logged-1"]
    assert done["outcome"] == "length" and done["completion_tokens"] == 4 and done["level"] == "INFO"
    assert done["prompt_tokens"] > 0 and done["cached_prompt_tokens"] == 0 and done["total_ms"] >= done["ttft_ms"] > 0


def test_prometheus_metrics_on_their_own_port(tiny_model, redis_server, redis_url):
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    from services.local.redis_process import free_port

    port = free_port()
    with WorkerProcess(tiny_model, "--metrics-port", str(port), "--cache", redis_url, "--block-size", "16") as w, \
            grpc.insecure_channel(w.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        ids = list(range(3, 3 + 40))
        request = pb.GenerateRequest(prompt_token_ids=ids, max_new_tokens=5, ignore_eos=True)
        complete(stub, request, timeout_s=30)
        with redis_server.client() as client:  # the second request hits the first one's two blocks
            deadline = time.monotonic() + 10
            while stored_values(client) < 2:
                assert time.monotonic() < deadline, "the first request's blocks were never published"
                time.sleep(0.01)
        complete(stub, request, timeout_s=30)
        text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        with redis_server.client() as client:
            stored_bytes = sum(client.strlen(k) for k in client.keys())
    samples = {s.name + str(sorted(s.labels.items())): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["kvshare_requests_total[('outcome', 'length')]"] == 2
    assert samples["kvshare_generation_tokens_total[]"] == 10
    assert samples["kvshare_prefix_cache_queries_total[]"] == 80
    assert samples["kvshare_prefix_cache_hits_total[]"] == 32  # two full 16-token blocks of 40
    assert samples["kvshare_time_to_first_token_seconds_count[('prefix_cache', 'miss')]"] == 1
    assert samples["kvshare_time_to_first_token_seconds_count[('prefix_cache', 'hit')]"] == 1
    assert samples["kvshare_requests_running[]"] == 0 and samples["kvshare_requests_rejected_total[]"] == 0
    assert samples["kvshare_cache_breaker_open[('direction', 'reads')]"] == 0
    assert samples["kvshare_cache_blocks_written_total[]"] == 2
    assert samples["kvshare_prefix_fetch_skipped_total[]"] == 0  # the CPU provider always fetches
    # The warm request had no new full block: it sends nothing (the cached ones are not sent again).
    assert samples["kvshare_cache_publish_bytes_total[]"] == stored_bytes
    assert samples["kvshare_inter_token_latency_seconds_count[]"] == 8  # one per gap: 4 in each request
    for kind in ("timeout", "connection", "tls", "protocol"):  # a series each from the start, as for reasons
        assert samples[f"kvshare_cache_store_errors_total[('kind', '{kind}')]"] == 0
    for reason in ("format", "owner", "checksum", "non_finite", "out_of_range", "unsigned", "signature", "lease",
                   "bad_output"):
        assert samples[f"kvshare_cache_values_rejected_total[('reason', '{reason}')]"] == 0


def test_text_log_lines_cannot_be_forged_through_a_request_id():
    import logging

    from services.api.logs import TextFormatter

    for brk in ("\n", "\r", "\x85", "\u2028", "\u2029", "\x0b"):
        forged = f"id{brk}2026-01-01 00:00:00,000 ERROR services.api.servicer: FORGED"
        record = logging.LogRecord("services.engine.engine", logging.WARNING, __file__, 1, "request %s failed",
                                   (forged,), None)
        record.fields = {"request_id": forged, "outcome": "length"}
        line = TextFormatter().format(record)
        assert len(line.splitlines()) == 1 and "FORGED" in line, repr(brk)
        assert 'request_id="id\\' in line and line.endswith("outcome=length")


def test_grpcs_records_of_undecodable_metadata_never_show_the_value_and_cannot_flood():
    import logging

    from services.api.logs import UndecodableMetadataFilter

    now = [0.0]
    redact = UndecodableMetadataFilter(interval_s=10.0, clock=lambda: now[0])

    def record() -> logging.LogRecord:
        try:
            b"Bearer secret-key\xff".decode()
        except UnicodeDecodeError:
            import sys
            exc = sys.exc_info()
        return logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, "x", 1, "Invalid encoding on %s",
                                 (b"Bearer secret-key\xff",), exc)

    first = record()
    assert redact.filter(first) and first.levelno == logging.WARNING and first.exc_info is None
    assert "secret-key" not in first.getMessage()
    assert not any(redact.filter(record()) for _ in range(999)), "held back within the interval"
    now[0] = 11.0
    later = record()
    assert redact.filter(later) and "999 more" in later.getMessage() and "secret-key" not in later.getMessage()
    other = logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, "x", 1, "something else", (), None)
    assert redact.filter(other) and other.levelno == logging.ERROR


def test_no_kvshare_process_lets_onnx_runtime_phone_home():
    """ONNX Runtime 1.29+ uploads telemetry from Linux from import on; importing kvshare opts out
    first (services/__init__.py), unless the operator set ORT_DISABLE_TELEMETRY themselves."""
    probe = "import services.runtime.ort, os; print(os.environ['ORT_DISABLE_TELEMETRY'])"
    clean = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"}
    for environ, expected in ((clean, "1"), ({**clean, "ORT_DISABLE_TELEMETRY": "0"}, "0")):
        out = subprocess.run([sys.executable, "-c", probe], env=environ, capture_output=True, text=True, timeout=60,
                             cwd=Path(__file__).resolve().parent.parent)
        assert out.returncode == 0 and out.stdout.strip() == expected, out.stderr
