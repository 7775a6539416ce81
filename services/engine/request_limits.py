"""Size limits on a request, checked on the event loop before any tokenizing or rendering.

Each check is O(1) or O(request size) with a small constant (counting UTF-8 bytes), so a request
that would cost seconds of tokenizing or an oversized stop automaton is refused at once with
INVALID_ARGUMENT, naming the field, the limit and the flag that raises it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from services.audio.wav import MAX_RATE, max_wav_bytes
from services.engine.generation import GenerationRequest, TokenizeRequest
from services.errors import InvalidRequest, RequestOutOfRange
from services.runtime.chat_template import Message
from services.runtime.model_spec import ModelSpec
from services.runtime.tokenizer import TextTokenizer, TokenBytes

log = logging.getLogger(__name__)

MAX_MESSAGES = 4096
"""Messages in one conversation: each renders to at least a few template tokens, so a request of
a million empty messages would otherwise cost seconds of rendering before any length check."""
MAX_REQUEST_ID_CHARS = 256
"""A request id is logged with every line about its request: it is an id, not a payload."""
MAX_SALT_CHARS = 256
"""A cache salt names a group of requests; it is hashed into every block key of the request."""
MAX_STOP_TOKEN_IDS = 64
MAX_SUPPRESS_TOKEN_IDS = 1024
"""Ids in each of suppress_token_ids and begin_suppress_token_ids: Whisper's default list holds
about 90; a request is not a way to send a second vocabulary."""
UTF8_CHAR_BYTES = 4
"""Bytes of one character in UTF-8 at most (a limit counted in characters bounds 4x as many bytes)."""
SCALAR_FIELDS_BYTES = 512
"""Bytes of a GenerateRequest's numbers, flags and sampling parameters with their tags, at most (about 30
fields of at most 11 bytes each)."""
SHRINKING_TOKENIZER_FACTOR = 4
MESSAGE_TEMPLATE_BYTES = 256
"""Bytes a chat template is assumed to add around one message when a Tokenize answer's size is
bounded before rendering (role markers and separators: SmolLM2's add 24)."""
ID_BYTES = 5
"""Bytes of one token id in a serialized message at most (a varint below 2**35)."""
FRAMING_BYTES = 32
"""Bytes of protobuf framing (tags and lengths) around one message of a chat, at most."""
"""For a tokenizer that can drop or shorten text no prompt size bounds the tokens; the derived
limit then allows this many times the exact bound of a tokenizer that keeps every byte."""


def utf8_length(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (what the client sent); O(1) for ASCII text."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def derived_prompt_bytes(context_length: int, token_bytes: TokenBytes) -> int:
    """The most prompt bytes that can fit ``context_length`` tokens: when every byte of the text
    lies inside some token and no token stands for more than ``token_bytes.longest`` bytes, a
    longer text cannot encode to ``context_length`` tokens or fewer, so refusing it refuses
    nothing that could run. For a tokenizer that drops or shortens text no such bound exists;
    there it is ``SHRINKING_TOKENIZER_FACTOR`` times larger (a bound on work, not on fit)."""
    factor = 1 if token_bytes.shrinker is None else SHRINKING_TOKENIZER_FACTOR
    return context_length * token_bytes.longest * factor


@dataclass(frozen=True, slots=True)
class RequestLimits:
    prompt_bytes: int
    """UTF-8 bytes of a prompt's text: ``prompt``, all messages' roles and contents together,
    ``encoder_prompt``, and Tokenize's ``text`` or messages."""
    prompt_bytes_origin: str
    """Where ``prompt_bytes`` comes from, said in refusals ("derived from ...", or the flag)."""
    stop_strings: int
    """Stop strings per request."""
    stop_string_bytes: int
    """UTF-8 bytes of one stop string."""
    audio_seconds: float = 0.0
    """The longest ``encoder_audio`` the model takes, which bounds its bytes (``max_wav_bytes``);
    0 for a model that takes no audio (``encoder_array`` refuses it unread)."""
    context_tokens: int = 0
    """Tokens of the decoder's context: no prompt given as ids may hold as many (0: unchecked)."""
    encoder_context_tokens: int = 0
    """Tokens of the encoder's context (0: no encoder, or unchecked)."""
    token_bytes: int = 0
    """Most bytes of text one token decodes to (``TokenBytes.longest``): bounds a Tokenize answer."""
    answer_bytes: int = 0
    """The largest answer message the face may send (its --max-message-bytes); a Tokenize call whose
    answer could be larger is refused before any work (0: unchecked)."""
    encoder: bool = False
    """The model has an encoder: a request may carry its input (audio, features)."""

    @property
    def token_ids(self) -> int:
        """Ids one Tokenize call may decode: the longest context, since no prompt or answer holds more."""
        return max(self.context_tokens, self.encoder_context_tokens)

    @property
    def tokenize_request_bytes(self) -> int:
        """The most bytes a TokenizeRequest within these limits can take: its text or messages (each
        message's two fields framed in at most ``FRAMING_BYTES``), or its ids, beside some slack."""
        text = self.prompt_bytes + MAX_MESSAGES * FRAMING_BYTES
        return max(text, self.token_ids * ID_BYTES) + FRAMING_BYTES

    @property
    def generate_request_bytes(self) -> int | None:
        """The most bytes a GenerateRequest within these limits can take, for a model without an
        encoder: its prompt (text, messages or ids, as ``tokenize_request_bytes`` bounds them),
        stop strings and ids, suppressed ids, request id, salt and scalars, each field framed in at
        most ``FRAMING_BYTES``. None for a model with an encoder: its requests may carry audio or
        encoder features, which only the face's message limit bounds."""
        if self.encoder:
            return None
        ids = (MAX_STOP_TOKEN_IDS + 2 * MAX_SUPPRESS_TOKEN_IDS) * ID_BYTES + 3 * FRAMING_BYTES
        names = (MAX_REQUEST_ID_CHARS + MAX_SALT_CHARS) * UTF8_CHAR_BYTES + 2 * FRAMING_BYTES
        stops = self.stop_strings * (self.stop_string_bytes + FRAMING_BYTES)
        return self.tokenize_request_bytes + stops + ids + names + SCALAR_FIELDS_BYTES

    @property
    def message_bytes(self) -> int | None:
        """The most bytes any valid request message of a worker with these limits can take (None:
        ``generate_request_bytes`` is unbounded here); what the face may set as its receive bound,
        so that a larger message is refused on its length alone, before its bytes are held."""
        generate = self.generate_request_bytes
        return None if generate is None else max(generate, self.tokenize_request_bytes)

    def check_generation(self, request: GenerationRequest) -> None:
        """Every size of a Generate request, in the order a client would fix them."""
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequest("request_id", f"{len(request.request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
        if len(request.cache.salt) > MAX_SALT_CHARS:
            raise InvalidRequest("cache.salt", f"{len(request.cache.salt)} characters; at most {MAX_SALT_CHARS}")
        self.check_prompt("prompt", request.prompt, request.messages)
        self.check_prompt("encoder_prompt", request.encoder.prompt, None)
        # Counted, never turned into Python ints: a million ids would hold the GIL for a second.
        ids, context = request.prompt_token_ids, self.context_tokens
        if context and ids and len(ids) >= context:
            raise RequestOutOfRange("prompt_token_ids", f"the prompt alone is {len(ids)} tokens; the context length of "
                                    f"{context} tokens must hold it and at least one new token: shorten the prompt")
        ids, context = request.encoder.token_ids, self.encoder_context_tokens
        if context and ids and len(ids) > context:
            raise RequestOutOfRange("encoder_prompt_token_ids",
                                    f"{len(ids)} tokens exceed the encoder's context length of {context}")
        audio = request.encoder.audio
        if audio and self.audio_seconds and len(audio) > (most := max_wav_bytes(self.audio_seconds)):
            raise InvalidRequest("encoder_audio", f"{len(audio)} bytes; at most {most} (a WAV file of at most "
                                 f"{self.audio_seconds:g} s, stereo 32-bit float at {MAX_RATE} Hz, and metadata)")
        if len(request.stop) > self.stop_strings:
            raise InvalidRequest("stop", f"at most {self.stop_strings} stop strings, got more (the worker's "
                                 "--max-stop-strings, env KVSHARE_MAX_STOP_STRINGS)")
        for i, s in enumerate(request.stop):
            if not s:
                raise InvalidRequest(f"stop[{i}]", "stop strings must not be empty")
            if (size := utf8_length(s)) > self.stop_string_bytes:
                raise InvalidRequest(f"stop[{i}]", f"{size} bytes; at most {self.stop_string_bytes} (the worker's "
                                     "--max-stop-string-bytes, env KVSHARE_MAX_STOP_STRING_BYTES)")

    def check_tokenize(self, request: TokenizeRequest) -> None:
        """A Tokenize call's sizes, and the most bytes its answer could take: each input byte is at
        most one id (of ``ID_BYTES``) beside the text echoed back, each id at most ``token_bytes``
        of text; a chat template is assumed to add ``MESSAGE_TEMPLATE_BYTES`` per message."""
        self.check_prompt("text", request.text, request.messages)
        ids = request.token_ids or ()
        if len(ids) > self.token_ids:
            raise InvalidRequest("token_ids", f"{len(ids)} ids; at most {self.token_ids}, the model's context "
                                 "length (no prompt or answer holds more): decode longer texts in parts")
        if request.messages:
            size = sum(utf8_length(m.role) + utf8_length(m.content) + MESSAGE_TEMPLATE_BYTES for m in request.messages)
            worst, field = size * (1 + ID_BYTES), "messages"
        elif ids:
            worst, field = len(ids) * (self.token_bytes + ID_BYTES), "token_ids"
        else:
            worst, field = utf8_length(request.text or "") * (1 + ID_BYTES), "text"
        if self.answer_bytes and worst > self.answer_bytes:
            raise InvalidRequest(field, f"the answer could take {worst} bytes, more than the largest message this "
                                 f"worker sends ({self.answer_bytes} bytes, its --max-message-bytes): send it in parts")

    def check_prompt(self, field: str, text: str | None, messages: Sequence[Message] | None) -> None:
        """A prompt given as ``text`` (refusals name ``field``) or as ``messages``."""
        if messages:
            if len(messages) > MAX_MESSAGES:
                raise InvalidRequest("messages", f"at most {MAX_MESSAGES} messages, got more")
            field, what = "messages", "bytes of roles and contents"
            size = sum(utf8_length(m.role) + utf8_length(m.content) for m in messages)
        else:
            what, size = "bytes of text", utf8_length(text or "")
        if size > self.prompt_bytes:
            raise InvalidRequest(field, f"{size} {what}; at most {self.prompt_bytes} ({self.prompt_bytes_origin}; "
                                 "the worker's --max-prompt-bytes, env KVSHARE_MAX_PROMPT_BYTES, sets it)")


def limits_for(spec: ModelSpec, tokenizer: TextTokenizer, max_prompt_bytes: int, max_stop_strings: int,
               max_stop_string_bytes: int, answer_bytes: int = 0) -> RequestLimits:
    """The limits of a worker serving ``spec``: ``max_prompt_bytes`` as the operator set it, or 0
    to derive the most text that can fit the model's (or its encoder's) context; ``answer_bytes``
    the face's largest message (0: Tokenize answers unchecked)."""
    token_bytes = tokenizer.token_bytes()
    if max_prompt_bytes:
        prompt_bytes, origin = max_prompt_bytes, "set by the operator"
    else:
        context = max(spec.context_length, (spec.encoder and spec.encoder.context_length) or 0)
        prompt_bytes = derived_prompt_bytes(context, token_bytes)
        origin = (f"the most text that can fit the model's context of {context} tokens, at most "
                  f"{token_bytes.longest} bytes per token")
        if token_bytes.shrinker is not None:
            origin = (f"{SHRINKING_TOKENIZER_FACTOR}x the context of {context} tokens at {token_bytes.longest} "
                      f"bytes per token, since the tokenizer's {token_bytes.shrinker} can drop text")
            log.warning("the tokenizer's %s can drop or shorten text, so no prompt size is too large to fit the "
                        "context; prompts are limited to %d bytes (--max-prompt-bytes sets another limit)",
                        token_bytes.shrinker, prompt_bytes)
    audio_seconds = spec.audio.max_seconds if spec.audio else 0.0
    log.info("requests: prompts up to %d bytes (%s), %d stop strings of up to %d bytes%s", prompt_bytes, origin,
             max_stop_strings, max_stop_string_bytes, f", audio up to {audio_seconds:g} s" if audio_seconds else "")
    return RequestLimits(prompt_bytes, origin, max_stop_strings, max_stop_string_bytes, audio_seconds,
                         spec.context_length, (spec.encoder and spec.encoder.context_length) or 0, token_bytes.longest,
                         answer_bytes, spec.encoder is not None)
