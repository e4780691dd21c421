"""Logprobs as OpenAI-compatible servers send them, read back into `TokenLogprob` entries.

A remote deployment asks its upstream for logprobs in the caller's terms and hands them on, so a
client sees the same shapes whether the own engine or another server of the fleet answered. Two wire
shapes exist: chat's `logprobs.content` (a list of entries with bytes and alternatives) and the legacy
completions' parallel lists (`tokens`, `token_logprobs`, `top_logprobs` as token -> logprob maps,
without bytes: those are the token's UTF-8, the best a client of that shape can know either).
"""

from __future__ import annotations

from typing import Any

from backends.base import TokenLogprob


class MalformedLogprobs(ValueError):
    """The upstream's logprobs object is not one of OpenAI's two shapes."""


def read_logprobs(obj: Any) -> list[TokenLogprob] | None:
    """The entries of one choice's (or one chunk's) `logprobs` object; None where it has none."""
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise MalformedLogprobs("logprobs is not an object")
    if "content" in obj:
        return [_chat_entry(e) for e in obj["content"] or []]
    if "tokens" in obj:
        return _completion_entries(obj)
    raise MalformedLogprobs("logprobs has neither `content` nor `tokens`")


def _chat_entry(entry: Any, nested: bool = False) -> TokenLogprob:
    token = str(entry["token"])
    raw = entry.get("bytes")
    return TokenLogprob(
        token=token,
        bytes=[int(b) for b in raw] if raw is not None else list(token.encode()),
        logprob=float(entry["logprob"]),
        top=[] if nested else [_chat_entry(t, nested=True) for t in entry.get("top_logprobs") or []],
    )


def _completion_entries(obj: dict[str, Any]) -> list[TokenLogprob]:
    tokens, logprobs = obj["tokens"], obj["token_logprobs"]
    tops = obj.get("top_logprobs") or [None] * len(tokens)
    if not len(tokens) == len(logprobs) == len(tops):
        raise MalformedLogprobs("tokens, token_logprobs and top_logprobs differ in length")
    return [
        TokenLogprob(
            token=str(token),
            bytes=list(str(token).encode()),
            logprob=float(logprob),
            top=[
                TokenLogprob(token=str(t), bytes=list(str(t).encode()), logprob=float(lp))
                for t, lp in (top or {}).items()
            ],
        )
        for token, logprob, top in zip(tokens, logprobs, tops, strict=True)
    ]
