"""Tokenizers: the byte-level tokenizer of the shipped tiny models, and an HF
``tokenizer.json`` through the ``tokenizers`` package (its chat template from
``tokenizer_config.json`` or ``chat_template.jinja``, rendered with Jinja).

:func:`load_tokenizer` finds the one a model directory uses; :func:`encode_chat` turns chat
messages into prompt ids.

Byte tokenizer: token ``i < 256`` is byte ``i``; then ``BOS``, ``EOS`` and ``PAD``. No
vocabulary file.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 260  # 256 bytes + 3 specials, one spare


class ByteTokenizer:
    """``encode(text) -> [BOS, b_0, b_1, ...]``; ``decode`` drops specials, replaces bad UTF-8."""

    vocab_size = VOCAB_SIZE
    bos_token_id = BOS
    eos_token_id = EOS
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return ([BOS] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def _read_json(file: Path) -> dict:
    try:
        out = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(out).__name__}")
    return out


def _token_text(v: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


class HFTokenizer:
    """An HF fast tokenizer (``tokenizer.json``) with the special tokens and chat template of
    its ``tokenizer_config.json``."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        directory = Path(directory)
        file = directory / "tokenizer.json"
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises its own Exception subclass
            raise ValueError(f"{file}: not a readable tokenizer.json ({e})") from None
        conf_file = directory / "tokenizer_config.json"
        conf = _read_json(conf_file) if conf_file.is_file() else {}
        template = conf.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = directory / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.bos_token = _token_text(conf.get("bos_token"))
        self.eos_token = _token_text(conf.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(source: Any):
    """The tokenizer of ``source``: ``None``; ``"bytes"``; an object with ``encode`` and
    ``decode`` (returned as is); or a model directory (or a file in one): the byte tokenizer
    when its ``config.json`` says ``"tokenizer": "bytes"``, its ``tokenizer.json`` when it has
    one, else ``None``."""
    if source is None:
        return None
    if isinstance(source, str) and source == "bytes":
        return ByteTokenizer()
    if hasattr(source, "encode") and hasattr(source, "decode") and not isinstance(source, str):
        return source
    if not isinstance(source, str | Path):
        raise ValueError(
            f"tokenizer must be 'bytes', a directory or an object with encode/decode, got "
            f"{type(source).__name__}"
        )
    path = Path(source)
    directory = path if path.is_dir() else path.parent
    config = directory / "config.json"
    if config.is_file():
        try:
            conf = json.loads(config.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            conf = {}  # the model loader reports a malformed config.json
        if isinstance(conf, dict) and conf.get("tokenizer") == "bytes":
            return ByteTokenizer()
    if (directory / "tokenizer.json").is_file():
        return HFTokenizer(directory)
    return None


# ------------------------------------------------------------------------------------ chat


def _message_text(i: int, content: Any) -> str:
    """A message's content: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{i}].content: a text part needs a 'text' string")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts")


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """``[{"role": str, "content": str}, ...]``, checked; text parts joined."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a 'role' string")
        out.append({"role": m["role"], "content": _message_text(i, m.get("content") or "")})
    return out


def _render_template(template: str, messages: list[dict], tokenizer) -> str:
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=getattr(tokenizer, "bos_token", None) or "",
            eos_token=getattr(tokenizer, "eos_token", None) or "",
        )
    except TemplateError as e:
        raise ValueError(f"messages: the chat template failed: {e}") from None


def encode_chat(tokenizer, messages: Any) -> list[int]:
    """Prompt ids of a chat: the tokenizer's chat template (with the generation prompt) when it
    has one, else each message as a ``"role: content"`` line followed by ``"assistant:"``."""
    msgs = normalize_messages(messages)
    template = getattr(tokenizer, "chat_template", None)
    if template:
        text = _render_template(template, msgs, tokenizer)
        return tokenizer.encode(text, add_special_tokens=False)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"
    return tokenizer.encode(text)
