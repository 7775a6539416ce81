"""POST /v1/chat/completions: OpenAI's chat request as one gRPC ``Generate`` call with
``messages`` (the worker renders the folder's chat template), its answer as a
``chat.completion`` or a stream of ``chat.completion.chunk`` events.

Roles: system, user, assistant, and developer (OpenAI's newer name for system, sent as system).
Content: a string, or an array of text parts (joined with newlines, as vLLM joins them); other
parts (images, audio) and tool messages are refused with the index of the message at fault.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshare.v1 import generator_pb2 as pb
from services.http.body import Body, text
from services.http.choices import Choice, Choices, chat_logprobs, finish_reason
from services.http.errors import bad_request
from services.http.generation_fields import generation_request

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_TOP_LOGPROBS = 20
"""OpenAI's bound on top_logprobs."""


def chat_call(body: Body, request_id: str) -> pb.GenerateRequest:
    request = generation_request(body, request_id, max_tokens_default=0)
    request.messages.extend(_messages(body))
    request.logprobs = body.boolean("logprobs")
    top = body.integer("top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top and not request.logprobs:
        raise bad_request("top_logprobs", "needs logprobs set to true")
    request.top_logprobs = top or 0
    return request


def _messages(body: Body) -> list[pb.ChatMessage]:
    raw = body.raw("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages", "must be a non-empty array of {role, content} objects")
    out = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(where, "must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            shown = role if isinstance(role, str) and len(role) <= 32 else "this value"
            raise bad_request(f"{where}.role", f"{shown!r} is not one of {', '.join(ROLES)} (tool calls are not supported)")
        if message.get("tool_calls") or message.get("function_call"):
            raise bad_request(f"{where}.tool_calls", "tool calls are not supported")
        out.append(pb.ChatMessage(role=ROLES[role], content=_content(message.get("content"), f"{where}.content")))
    return out


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return text(where, content)
    if not isinstance(content, list):
        raise bad_request(where, "must be a string or an array of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) and isinstance(part.get("type"), str) else None
            why = f"{kind!r} parts are not supported: only text" if kind and len(kind) <= 32 else \
                "must be a {\"type\": \"text\", \"text\": ...} part"
            raise bad_request(f"{where}[{j}]", why)
        texts.append(text(f"{where}[{j}].text", part["text"]))
    return "\n".join(texts)


@dataclass(frozen=True, slots=True)
class ChatFormat:
    logprobs: bool
    object_name: str = "chat.completion"
    chunk_name: str = "chat.completion.chunk"

    def delta(self, prompt: int, choice: Choice, message: pb.GenerateResponse, first: bool) -> list[dict]:
        delta: dict = {"role": "assistant"} if first else {}
        if message.text or first:
            delta["content"] = message.text
        logprobs = chat_logprobs(message.logprobs) if self.logprobs and message.logprobs else None
        reason = finish_reason(message)
        if not delta and logprobs is None and reason is None:
            return []
        return [{"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]

    def choice(self, choice: Choice, choices: Choices) -> dict:
        return {"index": choice.index, "message": {"role": "assistant", "content": choice.text},
                "logprobs": chat_logprobs(choice.logprobs) if self.logprobs else None,
                "finish_reason": choice.finish_reason}
