"""Incremental detokenisation with stop strings.

Each generated token goes through the tokenizer's own streaming decoder (`tokenizers`'
`DecodeStream`), primed with the last prompt tokens, which holds bytes back until they form whole
UTF-8 characters and returns, chunk by chunk, what decoding the output after that context gives: a
stream never shows a U+FFFD that the final text does not have, and a SentencePiece model's first
word keeps its leading space (" Paris" after "The capital of France is", as vLLM gives it; for
byte-level tokenizers this is exactly `decode(output ids)`). When the sequence ends, the text is
completed to that decode (a dangling partial character at the end becomes U+FFFD). On top of that, text that could be the start of a stop string is held back until it is
known not to be one, so a stop string never reaches the client.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

#: prompt tokens that prime the decoder: enough for a word boundary or a split character
_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...

    def decode_stream(self, context: list[int]) -> Callable[[int], str | None]:
        """A fresh streaming decoder primed with `context`: feed one id, get the text it completes
        (None: not yet)."""
        ...


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, step by step.

    Args:
        tokenizer: the model's tokenizer.
        prompt_token_ids: the prompt; its last few tokens prime the decoder (word boundaries).
        stop: stop strings; the text is cut before the first one that appears.
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], stop: list[str]) -> None:
        self._tok = tokenizer
        self._context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._step = tokenizer.decode_stream(self._context)
        self._ids: list[int] = []
        self._stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # all output text so far (truncated at a stop string)
        self._emitted = 0
        self._stopped = False

    def add(self, token_id: int) -> bool:
        """Add one generated token; True when a stop string appeared (the text is cut before it)."""
        self._ids.append(token_id)
        new = self._step(token_id)
        return bool(new) and self._append(new)

    def _append(self, new: str) -> bool:
        start = max(0, len(self.text) - self._holdback)
        self.text += new
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self._stopped = True
            return True
        return False

    def finish(self) -> None:
        """The sequence ended: complete the text to the decode of every output id (unless a stop
        string cut it), so bytes still held back for an incomplete character are not lost."""
        if self._stopped:
            return
        before = self._tok.decode(self._context)
        whole = self._tok.decode(self._context + self._ids)
        whole = whole[len(before) :] if whole.startswith(before) else self._tok.decode(self._ids)
        if whole.startswith(self.text) and len(whole) > len(self.text):
            self._append(whole[len(self.text) :])

    def take(self, final: bool) -> str:
        """Text not yet handed out; while not `final`, a possible stop-string prefix stays back."""
        if final:
            self.finish()
        end = (
            len(self.text) if final or not self._stop else max(self._emitted, len(self.text) - self._holdback)
        )
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
