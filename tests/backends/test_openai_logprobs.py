"""Reading upstream logprobs back: both OpenAI shapes, and malformed ones refused."""

from __future__ import annotations

import pytest

from backends.openai_logprobs import MalformedLogprobs, read_logprobs


def test_chat_shape_keeps_bytes_and_alternatives() -> None:
    entries = read_logprobs(
        {
            "content": [
                {"token": "é", "bytes": [195, 169], "logprob": -0.5,
                 "top_logprobs": [{"token": "é", "bytes": [195, 169], "logprob": -0.5},
                                  {"token": "e", "bytes": None, "logprob": -1.5}]},
            ],
            "refusal": None,
        }
    )  # fmt: skip
    assert entries is not None and entries[0].bytes == [195, 169] and entries[0].logprob == -0.5
    assert [(t.token, t.bytes) for t in entries[0].top] == [("é", [195, 169]), ("e", [101])]


def test_completions_shape_becomes_entries() -> None:
    entries = read_logprobs(
        {
            "tokens": ["a", " b"],
            "token_logprobs": [-0.1, -0.2],
            "top_logprobs": [{"a": -0.1}, None],
            "text_offset": [0, 1],
        }
    )
    assert entries is not None
    assert [(e.token, e.bytes, e.logprob) for e in entries] == [("a", [97], -0.1), (" b", [32, 98], -0.2)]
    assert [t.token for t in entries[0].top] == ["a"] and entries[1].top == []


def test_none_is_none() -> None:
    assert read_logprobs(None) is None


@pytest.mark.parametrize(
    "bad",
    [
        [1, 2],
        {"something": 1},
        {"tokens": ["a"], "token_logprobs": [-0.1, -0.2]},
    ],
)
def test_malformed_shapes_are_refused(bad: object) -> None:
    with pytest.raises(MalformedLogprobs):
        read_logprobs(bad)
