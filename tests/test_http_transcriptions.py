"""POST /v1/audio/transcriptions through the official ``openai`` client against a worker serving
Whisper tiny.en: the transcript equals faster-whisper's recorded one and the gRPC answer, in each
response format, and bad uploads are the client's ``BadRequestError`` naming the field."""

from __future__ import annotations

import grpc
import openai
import pytest
from test_whisper import DATA, REFERENCES

from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.audio.wav import read_layout
from services.local.redis_process import free_port
from services.local.worker_process import WorkerProcess
from services.transcribe import transcribe, transcribe_request

pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module")
def worker(whisper_tiny):
    with WorkerProcess(whisper_tiny, "--http-port", str(free_port())) as w:
        yield w


@pytest.fixture(scope="module")
def client(worker):
    with openai.OpenAI(base_url=f"http://{worker.http_target}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def model(client) -> str:
    return client.models.list().data[0].id


def test_each_response_format_holds_faster_whispers_transcript(client):
    reference = REFERENCES["clips"][0]
    clip = DATA / reference["file"]
    as_json = client.audio.transcriptions.create(model=model(client), file=clip.open("rb"))
    assert as_json.text == reference["text"].strip()
    as_text = client.audio.transcriptions.create(model=model(client), file=clip.open("rb"), response_format="text")
    assert as_text.strip() == as_json.text
    verbose = client.audio.transcriptions.create(model=model(client), file=clip.open("rb"),
                                                 response_format="verbose_json", language="en")
    assert verbose.text == as_json.text and verbose.language == "english"
    assert verbose.duration == pytest.approx(read_layout(clip.read_bytes()).seconds)
    (segment,) = verbose.segments
    assert segment.tokens == reference["token_ids"] and segment.start == 0 and segment.end == verbose.duration
    assert segment.avg_logprob < 0 and segment.compression_ratio > 0


def test_a_prompt_and_a_temperature_reach_the_worker_as_over_grpc(client, worker):
    clip = (DATA / REFERENCES["clips"][1]["file"]).read_bytes()
    with grpc.insecure_channel(worker.target) as channel:
        (expected,) = transcribe(pb_grpc.GeneratorStub(channel), transcribe_request(clip, prompt="Meeting notes."), 120)
    answer = client.audio.transcriptions.create(model=model(client), file=("clip.wav", clip), prompt="Meeting notes.",
                                                temperature=0.0)
    assert answer.text == expected.text


@pytest.mark.parametrize("fields, param", [
    ({"file": ("notes.mp3", b"ID3\x04\x00" + b"\xff\xfb" * 500)}, "file"),
    ({"language": "fr"}, "language"),
    ({"response_format": "srt"}, "response_format"),
    ({"temperature": 1.5}, "temperature"),
    ({"timestamp_granularities": ["word"]}, "timestamp_granularities[]"),
])
def test_bad_uploads_are_bad_request_errors_naming_the_field(client, fields, param):
    upload = {"file": (DATA / "clip1.wav").open("rb"), **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.transcriptions.create(model=model(client), **upload)
    assert info.value.body["param"] == param, info.value.body


def test_chat_on_a_speech_model_is_refused_and_the_worker_serves_on(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model(client), messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["param"] == "model" and "/v1/audio/transcriptions" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model(client), prompt="hi")
    assert client.audio.transcriptions.create(model=model(client), file=(DATA / "clip1.wav").open("rb")).text
