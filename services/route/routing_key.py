"""The routing key of a Generate request: a hash of the beginning of its prompt, its cache salt and
its caller.

The router has no tokenizer, so it routes on what the client sent, the way SGLang's cache-aware
router routes on text prefixes. Prompts that begin with the same ``route_prefix_bytes`` bytes
(256: about one 64-token block of text) begin with the same tokens, so they share at least their
first cached blocks and go to the same worker, where the later ones meet the K/V of the first in
that worker's memory L1. Prompts sharing less than that may go to different workers even when they
share a block; so the setting belongs below the length of the prefixes worth keeping together (a
system prompt), not above.

For an encoder-decoder model the encoder input (audio, features, encoder prompt) is the prefix
instead of the prompt: its cross-attention K/V is the largest thing requests share, and the
decoder's own blocks are namespaced by it (they are shared only under the same encoder input), so
the same audio decoded again (another temperature, prompt or task) lands where its K/V already is.

A key is a routing hint, never a cache key: two different prompts with the same key merely meet
on one worker, and the worker's own keys (``cachestore/keys.py``) keep their K/V apart.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from kvshare.v1 import generator_pb2 as pb

ENCODER_BYTES_ROUTED = 64 << 10
"""Leading bytes of ``encoder_audio`` or ``encoder_features`` hashed (with their length) into the
key: 2 s of 16-kHz audio tells recordings apart, and the router's loop never hashes megabytes."""
PROMPT_TOKEN_IDS_ROUTED = 64
"""Leading ``prompt_token_ids`` that choose the worker: one block of the default block size."""

_SEPARATOR = b"\x00"


def encoder_input(request: pb.GenerateRequest, prefix_bytes: int) -> bytes:
    """The request's encoder input, tagged (audio or feature bytes: their length and first
    ``ENCODER_BYTES_ROUTED`` bytes; an encoder prompt: its first ``prefix_bytes`` bytes or
    ``PROMPT_TOKEN_IDS_ROUTED`` ids), or b"" when it has none."""
    for tag, data in ((b"a", request.encoder_audio), (b"f", request.encoder_features.data)):
        if data:
            return tag + len(data).to_bytes(8, "little") + data[:ENCODER_BYTES_ROUTED]
    if request.encoder_prompt:
        return b"e" + _text_prefix(request.encoder_prompt, prefix_bytes) + _SEPARATOR
    if request.encoder_prompt_token_ids:
        return b"i" + _ids_prefix(request.encoder_prompt_token_ids)
    return b""


def _text_prefix(text: str, prefix_bytes: int) -> bytes:
    """The first ``prefix_bytes`` UTF-8 bytes of ``text``; a character is at least one byte, so
    encoding that many characters covers them (O(``prefix_bytes``), not O(text))."""
    return text[:prefix_bytes].encode()[:prefix_bytes]


def _ids_prefix(ids) -> bytes:
    """The first ``PROMPT_TOKEN_IDS_ROUTED`` ids as int32 little-endian."""
    return b"".join(i.to_bytes(4, "little", signed=True) for i in ids[:PROMPT_TOKEN_IDS_ROUTED])


def prompt_prefix(request: pb.GenerateRequest, prefix_bytes: int) -> bytes | None:
    """The first ``prefix_bytes`` UTF-8 bytes of ``prompt``, or of the messages' roles and contents
    joined as ``role NUL content NUL ...`` (what a chat template renders first comes first), or
    the first ``PROMPT_TOKEN_IDS_ROUTED`` ids as int32 little-endian; each after a one-byte tag, so
    a text and a conversation never share a key by accident. None for a request without a prompt
    (the worker refuses it). Costs O(``prefix_bytes``), not O(prompt): only that much is encoded."""
    if request.prompt:
        return b"p" + _text_prefix(request.prompt, prefix_bytes)
    if request.messages:
        joined = bytearray()
        for message in request.messages:
            joined += message.role[:prefix_bytes].encode() + _SEPARATOR
            joined += message.content[:prefix_bytes].encode() + _SEPARATOR
            if len(joined) >= prefix_bytes:
                break
        return b"m" + bytes(joined[:prefix_bytes])
    if request.prompt_token_ids:
        return b"t" + _ids_prefix(request.prompt_token_ids)
    return None


def routing_key(request_bytes: bytes, metadata: Iterable[tuple[str, str | bytes]], prefix_bytes: int) -> bytes | None:
    """The key of a serialized GenerateRequest: BLAKE2b over its encoder input, else its prompt prefix, its ``cache.salt``
    and its ``authorization`` metadata (tenants never share cached blocks, so their requests need
    not meet); salt and caller are length-prefixed, so no two different pairs hash alike. None
    when the bytes do not parse or the request has neither prompt nor encoder input: such a call
    goes round-robin and its worker answers it."""
    try:
        request = pb.GenerateRequest.FromString(request_bytes)
    except Exception:  # noqa: BLE001 - whatever FromString raises, the worker will say why
        return None
    prefix = encoder_input(request, prefix_bytes) or prompt_prefix(request, prefix_bytes)
    if prefix is None:
        return None
    caller = b"\x00".join(v if isinstance(v, bytes) else v.encode() for k, v in metadata if k == "authorization")
    key = hashlib.blake2b(digest_size=16)
    for part in (request.cache.salt.encode(), caller):
        key.update(len(part).to_bytes(8, "little") + part)
    key.update(prefix)
    return key.digest()
