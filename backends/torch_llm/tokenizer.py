"""Tokenizer and chat template from a local model folder, as Hugging Face writes it.

The chat template is read from `tokenizer_config.json` (`chat_template`, a string or named
templates), else from `chat_template.jinja` beside it (what transformers 5's `save_pretrained`
writes), else from `chat_template.json`. It is rendered in a sandboxed Jinja environment that offers
what Hugging Face's does: `tojson` (non-ASCII kept, `indent`), `raise_exception`, `strftime_now`,
and loop controls (`break` / `continue`).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from datetime import datetime
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's scheme), inverted: char -> byte.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...) are moved to
    code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    table = {chr(b): b for b in keep}
    shift = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + shift)] = b
            shift += 1
    return table


_UNICODE_TO_BYTE = _byte_alphabet()


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters and non-ASCII text; chat templates expect plain JSON
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def chat_environment() -> ImmutableSandboxedEnvironment:
    """The sandboxed Jinja environment chat templates are written for."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


def read_chat_template(folder: pathlib.Path, config: dict[str, Any]) -> str | None:
    """The model's default chat template, wherever its `save_pretrained` put it."""
    template = config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if template is None and (folder / "chat_template.json").is_file():
        template = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) and template.strip() else None


class TextTokenizer:
    """Encode, decode and render chats the way the model was trained.

    Args:
        folder: a model folder holding `tokenizer.json` (and optionally `tokenizer_config.json`).
    """

    def __init__(self, folder: pathlib.Path) -> None:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        self._tok = Tokenizer.from_file(str(path))
        #: GPT-2 style byte-level BPE: pieces are written in a printable alphabet of the 256 bytes
        self._byte_level = (json.loads(path.read_text()).get("decoder") or {}).get("type") == "ByteLevel"
        cfg_path = folder / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template = read_chat_template(folder, cfg)
        self._template = chat_environment().from_string(self.chat_template) if self.chat_template else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens (`<s>`, `<|im_end|>`...): control tokens, never text."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (OpenAI's logprobs `bytes`), even a partial character.

        Byte-level BPE pieces map back through the byte alphabet, byte-fallback pieces (`<0xE4>`)
        are their byte, SentencePiece pieces have `▁` for a space; anything else is its decoded text.
        """
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        if "\u2581" in piece:
            return piece.replace("\u2581", " ").encode()
        return self._tok.decode([token_id], skip_special_tokens=False).encode()

    def decode_stream(self, context: list[int] | None = None) -> Callable[[int], str | None]:
        """A streaming decoder for one sequence, primed with `context` (the prompt's last ids): each
        id gives the text it completes after what came before, or None while a character is still
        incomplete."""
        stream = DecodeStream(ids=list(context or []), skip_special_tokens=True)
        tokenizer = self._tok
        return lambda token_id: stream.step(tokenizer, token_id)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Render `messages` with the generation prompt appended, then tokenize.

        `tools` (OpenAI function definitions) are handed to the template as Hugging Face's
        `apply_chat_template(tools=...)` does; a template without tool support ignores them.

        Raises:
            ValueError: the model has no chat template, or the template rejects the chat.
        """
        if self._template is None:
            raise ValueError("this model has no chat template; send a prompt instead of messages")
        try:
            text = self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from None
        # The template writes the special tokens itself.
        return self.encode(text, add_special_tokens=False)
