"""The `kvshare` command line as a new user meets it: a chat model's prompt goes through its chat
template, long prompts come from a file or standard input, a prompt longer than the context is
blamed on the prompt, a wrong address or a TLS mismatch is one line saying what to check, and a
mistyped or shortened flag is refused in one line naming the flag it is closest to.

Real `kvshare serve` processes (the seeded tiny model, which has no chat template, and
SmolLM2-135M-Instruct, which has one) and the real `kvshare` command as a subprocess. Expected
token counts come from the worker's Tokenize call, never from a guess."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import grpc
import pytest
from certs import TestCA

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.api.config import Settings
from services.cli import build_parser, main
from services.client import complete
from services.connection import (
    ROUTER_PORT,
    WORKER_PORT,
    ConnectionSettingsError,
    target_with_port,
)
from services.local.redis_process import free_port
from services.local.worker_process import WorkerProcess
from services.route.config import RouteSettings

QUESTION = "What is the capital of France?"
SYSTEM = "You are a geography teacher. Answer in one sentence."
REQUIRED = {"generate": ["x"], "transcribe": ["clip.wav"], "build-model": ["out"], "fetch-model": ["smollm2-135m-instruct"]}
"""Positional arguments each sub-command needs before its flags are looked at."""


def kvshare(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """The real command, as a user runs it; stdout and stderr as text."""
    proc = subprocess.run([sys.executable, "-m", "services.cli", *args], input=stdin, capture_output=True,
                          timeout=300, env={k: v for k, v in os.environ.items() if k != "KVSHARE_API_KEY"})
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(), proc.stderr.decode())


def one_line(proc: subprocess.CompletedProcess, code: int) -> str:
    """The single stderr line of a command that failed with ``code`` (and printed nothing else)."""
    assert proc.returncode == code and proc.stderr.count("\n") == 1 and not proc.stdout, (proc.returncode, proc.stderr)
    return proc.stderr


def summary(proc: subprocess.CompletedProcess) -> dict[str, str]:
    """The key=value fields of `kvshare generate`'s last stderr line."""
    assert proc.returncode == 0, proc.stderr
    return dict(field.split("=", 1) for field in proc.stderr.strip().splitlines()[-1].split() if "=" in field)


def tokens(stub, **request) -> int:
    return len(stub.Tokenize(pb.TokenizeRequest(**request), timeout=120).token_ids)


def user(text: str, system: str | None = None) -> list[pb.ChatMessage]:
    return [*([pb.ChatMessage(role="system", content=system)] if system else []), pb.ChatMessage(role="user", content=text)]


@pytest.fixture(scope="module")
def smol(smollm2):
    with WorkerProcess(smollm2) as worker, grpc.insecure_channel(worker.target) as channel:
        yield worker.target, pb_grpc.GeneratorStub(channel)


@pytest.mark.subprocess
def test_a_chat_models_prompt_goes_through_its_template_and_raw_sends_the_text(smol):
    target, stub = smol
    assert stub.GetModelInfo(pb.GetModelInfoRequest()).chat_template
    templated = kvshare("generate", QUESTION, "--target", target)
    assert int(summary(templated)["prompt_tokens"]) == tokens(stub, messages=user(QUESTION))
    expected = complete(stub, pb.GenerateRequest(messages=user(QUESTION), max_new_tokens=64), 120).text
    assert templated.stdout == expected + "\n" and "Paris" in expected  # the raw text got an empty answer

    raw = kvshare("generate", QUESTION, "--target", target, "--raw")
    assert int(summary(raw)["prompt_tokens"]) == tokens(stub, text=QUESTION)
    assert raw.stdout == complete(stub, pb.GenerateRequest(prompt=QUESTION, max_new_tokens=64), 120).text + "\n"

    with_system = kvshare("generate", QUESTION, "--target", target, "--system", SYSTEM, "--max-new-tokens", "4")
    assert int(summary(with_system)["prompt_tokens"]) == tokens(stub, messages=user(QUESTION, SYSTEM))
    assert "not allowed with argument --raw" in kvshare("generate", QUESTION, "--raw", "--system", SYSTEM).stderr


@pytest.mark.subprocess
def test_a_model_without_a_template_gets_the_text_and_system_is_refused(worker, stub):
    assert not stub.GetModelInfo(pb.GetModelInfoRequest()).chat_template
    plain = kvshare("generate", "hello there", "--target", worker.target, "--max-new-tokens", "2")
    assert int(summary(plain)["prompt_tokens"]) == tokens(stub, text="hello there")
    line = one_line(kvshare("generate", "hello", "--target", worker.target, "--system", "be brief"), 2)
    assert "--system needs a chat template" in line
    # What a template-less worker answers to messages, which is why the client asks first.
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(pb.GenerateRequest(messages=user("hello"), max_new_tokens=2), timeout=30))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    chat = kvshare("chat", "--target", worker.target, stdin=b"hello\n")
    assert "has no chat template: use kvshare generate" in one_line(chat, 2)


@pytest.mark.subprocess
def test_a_prompt_over_an_arguments_limit_comes_from_a_file_or_stdin_and_is_blamed_on_the_prompt(smol, tmp_path):
    """180 KB: over Linux's 128 KiB for one argument, under the worker's prompt byte limit, and
    several times SmolLM2's context, so the answer is the prompt's own refusal, with its count."""
    target, stub = smol
    text = "The quick brown fox jumps over the lazy dog. " * 4000
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(text + "\n")
    count = tokens(stub, messages=user(text))
    context = stub.GetModelInfo(pb.GetModelInfoRequest()).context_length
    assert count > context
    for args, stdin in ((["@" + str(prompt_file)], None), (["-"], prompt_file.read_bytes())):
        line = one_line(kvshare("generate", *args, "--target", target, stdin=stdin), 1)
        assert f"OUT_OF_RANGE: messages: the prompt alone is {count} tokens; the context length of {context} tokens" in line
        assert "max_new_tokens" not in line
    raw = one_line(kvshare("generate", "--raw", "@" + str(prompt_file), "--target", target), 1)
    assert f"OUT_OF_RANGE: prompt: the prompt alone is {tokens(stub, text=text)} tokens" in raw


@pytest.mark.subprocess
def test_a_prompt_that_fits_without_its_new_tokens_names_max_new_tokens(worker, stub):
    text = "The quick brown fox. " * 40
    count = tokens(stub, text=text)
    context = stub.GetModelInfo(pb.GetModelInfoRequest()).context_length
    too_many = context - count + 1
    assert 1 < too_many <= 512, "within the fixture worker's --max-new-tokens-cap, so the context check answers"
    line = one_line(kvshare("generate", text, "--target", worker.target, "--max-new-tokens", str(too_many)), 1)
    assert (f"max_new_tokens: prompt ({count} tokens) + max_new_tokens ({too_many}) exceeds the context length of "
            f"{context} tokens: at most {context - count} new tokens fit") in line
    with pytest.raises(grpc.RpcError) as full:  # a prompt that fills the context leaves no room for any token
        list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[5] * context, max_new_tokens=1), timeout=30))
    assert full.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert full.value.details().startswith(f"prompt_token_ids: the prompt alone is {context} tokens")


def test_unreadable_prompt_and_system_files_are_one_line_and_exit_2(tmp_path):
    missing = tmp_path / "missing.txt"
    line = one_line(kvshare("generate", f"@{missing}", "--target", "127.0.0.1:1"), 2)
    assert f"PROMPT @{missing}: cannot read {missing}: No such file or directory" in line
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    assert "--system" in one_line(kvshare("generate", "x", "--system", f"@{latin1}", "--target", "127.0.0.1:1"), 2)
    assert "not UTF-8" in one_line(kvshare("generate", f"@{latin1}", "--target", "127.0.0.1:1"), 2)
    both = one_line(kvshare("generate", "-", "--system", "-", "--target", "127.0.0.1:1", stdin=b"x"), 2)
    assert "only one of PROMPT and --system can be -" in both
    assert "give --system @FILE" in one_line(kvshare("chat", "--system", "-", "--target", "127.0.0.1:1"), 2)


def test_a_target_without_a_port_gets_the_workers_and_gRPC_forms_pass():
    assert WORKER_PORT == Settings().port and ROUTER_PORT == RouteSettings().port
    cases = {"127.0.0.1": "127.0.0.1:50051", "worker-1": "worker-1:50051", "[::1]": "[::1]:50051", "::1": "[::1]:50051",
             "10.0.0.2:7000": "10.0.0.2:7000", "[::1]:7000": "[::1]:7000",
             "dns:///kvshare.inference.svc:50051": "dns:///kvshare.inference.svc:50051", "unix:/tmp/k.sock": "unix:/tmp/k.sock"}
    assert {target: target_with_port(target) for target in cases} == cases
    for bad in ("", "host:", "host:0", "host:http", "host:70000", "[::1", "[::1]x", "http://127.0.0.1:8000"):
        with pytest.raises(ConnectionSettingsError):
            target_with_port(bad)
    assert "--target host:http is not HOST[:PORT]" in one_line(kvshare("generate", "x", "--target", "host:http"), 2)
    assert "is a URL: give the gRPC port's HOST[:PORT]" in one_line(
        kvshare("generate", "x", "--target", "http://127.0.0.1:8000"), 2)


@pytest.fixture(scope="module")
def tls_worker(tiny_model, tmp_path_factory):
    """A worker over mutual TLS with a metrics port; the CA that signed its certificate and a
    client certificate from it, as the flags that reach it."""
    ca = TestCA(tmp_path_factory.mktemp("ca"))
    server, client = ca.issue("worker", server=True), ca.issue("client", server=False)
    metrics = free_port()
    credentials = grpc.ssl_channel_credentials(ca.cert.read_bytes(), client.key.read_bytes(), client.cert.read_bytes())
    with WorkerProcess(tiny_model, "--tls-cert-file", str(server.cert), "--tls-key-file", str(server.key),
                       "--tls-client-ca-file", str(ca.cert), "--metrics-port", str(metrics),
                       credentials=credentials) as worker:
        yield worker.target, metrics, ca, ("--tls-cert-file", str(client.cert), "--tls-key-file", str(client.key))


@pytest.mark.subprocess
def test_connection_failures_say_what_to_check_in_one_line(tls_worker, worker, tmp_path):
    target, metrics, ca, client = tls_worker
    trusted = ("--tls-ca-file", str(ca.cert))
    assert summary(kvshare("generate", "hi", "--target", target, *trusted, *client, "--max-new-tokens", "2"))
    host = target.rsplit(":", 1)[0]
    stranger = TestCA(tmp_path / "stranger").cert
    checks = {
        ("--target", f"{host}:{free_port()}"): "nothing listens there",
        ("--target", target): "as a TLS server does to plaintext: if it serves TLS, give --tls-ca-file",
        ("--target", target, *trusted): "as a mutual-TLS server does to a client without a certificate",
        ("--target", f"{host}:{metrics}"): "answers HTTP/1, not gRPC (a --metrics-port or --http-port?)",
        ("--target", worker.target, *trusted): "does not speak TLS: drop the --tls-* flags",
        ("--target", target, "--tls-ca-file", str(stranger)): "TLS handshake failed: check that --tls-ca-file",
    }
    for args, expected in checks.items():
        for command in (["generate", "hi"], ["transcribe", __file__], ["chat"]):
            line = one_line(kvshare(*command, *args, stdin=b""), 1)
            assert line.startswith(f"kvshare {command[0]}: cannot reach a kvshare server at {args[1]}") and expected in line


def subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_an_unknown_flag_is_one_line_naming_the_closest_flag(name, capsys):
    """Each sub-command's longest flag with one letter doubled is refused in one line that names
    that flag; a word like no flag is refused without a guess."""
    flag = max((f for action in subcommands()[name]._actions for f in action.option_strings), key=len)
    typo = flag + flag[-1]
    assert main([name, *REQUIRED.get(name, []), typo]) == 2
    assert capsys.readouterr().err == (f"kvshare {name}: unknown flag {typo} (did you mean {flag}?); "
                                       f"kvshare {name} --help lists them\n")
    assert main([name, *REQUIRED.get(name, []), "--zzzz"]) == 2
    assert capsys.readouterr().err == f"kvshare {name}: unknown flag --zzzz; kvshare {name} --help lists them\n"


def test_a_misspelt_serve_flag_is_one_line_and_exit_2():
    """The report as it came: `kvshare serve --max-batchh 4` printed the whole usage (57 lines)."""
    line = one_line(kvshare("serve", "--max-batchh", "4"), 2)
    assert line == "kvshare serve: unknown flag --max-batchh (did you mean --max-batch?); kvshare serve --help lists them\n"
    line = one_line(kvshare("route", "--workerz=a:1", "--max-streams-per-workr", "2"), 2)
    assert line.startswith("kvshare route: unknown flags --workerz (did you mean --workers?), --max-streams-per-workr "
                           "(did you mean --max-streams-per-worker?);")


def test_extra_words_are_one_line_too(capsys):
    assert main(["generate", "hello", "there", "-1"]) == 2
    assert capsys.readouterr().err == ("kvshare generate: unexpected arguments 'there' '-1'; kvshare generate --help "
                                       "lists what it takes\n")


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_no_flag_is_taken_from_a_prefix_of_it(name):
    parser = subcommands()[name]
    flags = {flag for action in parser._actions for flag in action.option_strings}
    shortened = [flag[:-1] for flag in flags if flag.startswith("--") and len(flag) > 4 and flag[:-1] not in flags]
    assert shortened
    for prefix in shortened:
        _, unknown = build_parser().parse_known_args([name, *REQUIRED.get(name, []), prefix])
        assert unknown == [prefix]


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_help_shows_each_default_once(name):
    text = " ".join(subcommands()[name].format_help().split())
    assert "(default: None)" not in text and "(default: [])" not in text and "(default: False)" not in text
    if name == "demo":
        assert text.count("SmolLM2") == 1 and "default: SmolLM2" not in text

