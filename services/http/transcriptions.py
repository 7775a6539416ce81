"""POST /v1/audio/transcriptions: a multipart upload (``file``, ``model``, ``prompt``,
``temperature``, ``response_format``, ``language``) as one gRPC ``Generate`` call with the WAV
as ``encoder_audio``, answered as OpenAI answers: ``json`` ({"text"}), ``text`` (the transcript
alone) or ``verbose_json`` (task, language, duration, text, and one segment spanning the clip:
this server decodes no timestamps, so it has no finer segments, no ``srt``/``vtt`` and no word
timings, and no ``no_speech_prob``). Whisper's own rules apply (``services.transcribe``): the
folder's start sequence, ``prompt`` as previous-text context, at most 224 tokens.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from kvshare.v1 import generator_pb2 as pb
from services.audio.wav import WavError, read_layout
from services.http.choices import Choices
from services.http.errors import ApiError, bad_request
from services.transcribe import transcribe_request

FORMATS = ("json", "text", "verbose_json")
ENGLISH = ("en", "english")


@dataclass(frozen=True, slots=True)
class TranscriptionForm:
    audio: bytes
    model: str | None
    prompt: str
    temperature: float
    response_format: str


async def read_form(request: web.Request) -> TranscriptionForm:
    if not request.content_type.startswith("multipart/"):
        raise bad_request(None, "send the audio as multipart/form-data with a file field (as the OpenAI clients do)")
    try:
        form = await request.post()
    # A malformed multipart body (413 passes: not these); aiohttp raises LookupError for a part's
    # unknown charset and RuntimeError for its unknown Content-Transfer-Encoding.
    except (ValueError, LookupError, RuntimeError, HttpProcessingError) as exc:
        raise bad_request(None, f"the multipart body does not parse ({type(exc).__name__})") from None
    upload = form.get("file")
    if not isinstance(upload, web.FileField):
        raise bad_request("file", "a WAV file is required, as the multipart field file")
    audio = upload.file.read()
    if not audio:
        raise bad_request("file", "the file is empty")
    fields = {name: form.get(name) for name in ("model", "prompt", "temperature", "response_format", "language",
                                                "stream", "timestamp_granularities[]")}
    for name, value in fields.items():
        if value is not None and not isinstance(value, str):
            raise bad_request(name, "must be a text field, not a file")
    response_format = fields["response_format"] or "json"
    if response_format not in FORMATS:
        raise bad_request("response_format", f"{response_format[:32]!r} is not one of {', '.join(FORMATS)} (srt and "
                          "vtt need timestamps, which this server does not decode)")
    if fields["language"] and fields["language"].lower() not in ENGLISH:
        raise bad_request("language", "only English (en) is transcribed by this server's model")
    if fields["stream"] and fields["stream"].lower() == "true":
        raise bad_request("stream", "streamed transcriptions are not supported")
    if fields["timestamp_granularities[]"] and fields["timestamp_granularities[]"] != "segment":
        raise bad_request("timestamp_granularities[]", "word timestamps are not supported")
    return TranscriptionForm(audio, fields["model"], fields["prompt"] or "", _temperature(fields["temperature"]),
                             response_format)


def _temperature(value: str | None) -> float:
    if not value:
        return 0.0
    try:
        number = float(value)
    except ValueError:
        raise bad_request("temperature", f"must be a number, got {value[:32]!r}") from None
    if not 0.0 <= number <= 1.0:
        raise bad_request("temperature", f"must be between 0 and 1, got {number}")
    return number


def transcription_call(form: TranscriptionForm, request_id: str) -> pb.GenerateRequest:
    call = transcribe_request(form.audio, temperature=form.temperature, prompt=form.prompt)
    call.request_id = request_id
    call.logprobs = form.response_format == "verbose_json"
    return call


def answer(form: TranscriptionForm, choices: Choices) -> web.Response:
    (choice,) = choices.in_order()
    text = choice.text.strip()
    if choice.finish_reason is None:
        raise ApiError(503, "the transcription ended early: retry", "service_unavailable")
    if form.response_format == "text":
        return web.Response(text=text + "\n", content_type="text/plain")
    if form.response_format == "json":
        return web.json_response({"text": text})
    ids = list(choice.token_ids)
    logprobs = [e.logprob for e in choice.logprobs]
    if choice.finish_reason == "stop" and ids:  # the end-of-text token is not part of the text
        ids.pop()
        logprobs = logprobs[:-1]
    try:
        duration = read_layout(form.audio).seconds
    except WavError:  # the worker decoded it: cannot happen for an answered request
        duration = 0.0
    encoded = text.encode()
    segment = {
        "id": 0, "seek": 0, "start": 0.0, "end": duration, "text": text, "tokens": ids,
        "temperature": form.temperature,
        "avg_logprob": sum(logprobs) / len(logprobs) if logprobs else 0.0,
        # Whisper's repetition signal: the text's length over its zlib-compressed length.
        "compression_ratio": len(encoded) / len(zlib.compress(encoded)) if encoded else 0.0,
    }
    return web.json_response({"task": "transcribe", "language": "english", "duration": duration, "text": text,
                              "segments": [segment], "usage": {"type": "duration", "seconds": math.ceil(duration)}})

