"""Incremental detokenisation with stop strings.

Decoding token by token breaks multi-byte characters and word-initial spaces, so each step decodes a
small window (a few tokens of context + the new ones) and emits only the text past the context.
Text that could be the start of a stop string is held back until it is known not to be one, so a
stop string never reaches the client.
"""

from __future__ import annotations

from typing import Protocol

_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, step by step."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], stop: list[str]) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # all output text so far (truncated at a stop string)
        self._emitted = 0

    def add(self, token_id: int) -> bool:
        """Add one generated token; True when a stop string appeared (the text is cut before it)."""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # an incomplete character: wait for more bytes
        new = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        start = max(0, len(self.text) - self._holdback)
        self.text += new
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i != -1]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def take(self, final: bool) -> str:
        """Text not yet handed out; while not `final`, a possible stop-string prefix stays back."""
        end = (
            len(self.text) if final or not self._stop else max(self._emitted, len(self.text) - self._holdback)
        )
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
