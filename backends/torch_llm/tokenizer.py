"""Tokenizer and chat template from a local model folder (`tokenizer.json`, `tokenizer_config.json`)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise(message: str) -> None:
    raise TemplateError(message)


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
        cfg_path = folder / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self._template = None
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Render `messages` with the generation prompt appended, then tokenize.

        Raises:
            ValueError: the model has no chat template, or the template rejects the chat.
        """
        if self._template is None:
            raise ValueError("this model has no chat template; send a prompt instead of messages")
        try:
            text = self._template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from None
        # The template writes the special tokens itself.
        return self.encode(text, add_special_tokens=False)
