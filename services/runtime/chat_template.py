"""A model folder's chat template: the Jinja template in tokenizer_config.json that turns a list of
messages into the prompt text, with the conventions of Hugging Face's ``apply_chat_template``
(a sandboxed environment, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, the special tokens
as variables). The template is the folder's: a client cannot run its own."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the conversation (its ``raise_exception``): the client's to fix."""


class BrokenChatTemplate(RuntimeError):
    """The template itself failed (an error in it, or something it needs): the model folder's to fix."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now  # Hugging Face provides it; Llama 3 templates use it
        self._template = env.from_string(source)
        self._special = special_tokens

    def render(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(messages=[{"role": m.role, "content": m.content} for m in messages],
                                         add_generation_prompt=add_generation_prompt, **self._special)
        except ChatTemplateError:
            raise
        except (TemplateError, ArithmeticError, LookupError, TypeError, ValueError, RecursionError) as exc:
            raise BrokenChatTemplate(f"the model's chat template failed: {type(exc).__name__}: {exc}") from exc


def load_chat_template(folder: Path) -> ChatTemplate | None:
    """The folder's template, or None when tokenizer_config.json has none."""
    path = folder / "tokenizer_config.json"
    if not path.exists():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    source = config.get("chat_template")
    if not isinstance(source, str) or not source:
        return None
    special = {k: v for k in ("bos_token", "eos_token", "pad_token", "unk_token")
               if isinstance(v := config.get(k), str)}
    return ChatTemplate(source, special)
