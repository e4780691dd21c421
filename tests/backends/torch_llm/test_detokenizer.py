"""Streams never show broken text: chunks hold whole characters, and the text adds up to
`tokenizer.decode` of every generated id (a dangling partial character included, as U+FFFD)."""

from __future__ import annotations

import random

import pytest

from backends.base import SamplingParams
from backends.torch_llm.detokenizer import IncrementalDetokenizer
from backends.torch_llm.tokenizer import TextTokenizer
from tests.backends.torch_llm.conftest import engine_for

torch = pytest.importorskip("torch")

MULTI_BYTE = [
    "héllo wörld ça va, ñandú",
    "日本語のテキスト 你好世界",
    "emoji 🙂🎉 👩‍👩‍👧 flags 🇫🇷",
    "mixed é你🙂 end",
]


def _stream(tok: TextTokenizer, ids: list[int], stop: list[str] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tok, [], stop or [])
    chunks = []
    for i, token in enumerate(ids):
        detok.add(token)
        chunks.append(detok.take(final=i == len(ids) - 1))
    return chunks


def test_multi_byte_text_streams_whole_characters(llama_dir) -> None:
    tok = TextTokenizer(llama_dir)
    for text in MULTI_BYTE:
        ids = tok.encode(text, add_special_tokens=False)
        chunks = _stream(tok, ids)
        assert "".join(chunks) == tok.decode(ids) == text
        assert not any("\ufffd" in c for c in chunks), chunks


def test_any_id_sequence_adds_up_to_the_full_decode(llama_dir) -> None:
    """Random ids split characters anywhere, and may end inside one (U+FFFD at the end, as decode gives)."""
    tok = TextTokenizer(llama_dir)
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        chunks = _stream(tok, ids)
        final = tok.decode(ids)
        assert "".join(chunks) == final
        if "\ufffd" not in final:
            assert not any("\ufffd" in c for c in chunks)


def test_engine_outputs_equal_the_decode_of_their_ids(llama_dir) -> None:
    """Sampled (temperature 1) outputs of the engine, streamed, against decode of the ids."""
    engine = engine_for(llama_dir)
    tok = TextTokenizer(llama_dir)
    for i in range(8):
        engine.add_request(
            f"r{i}",
            [0, 9 + i, 10, 11],
            SamplingParams(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True),
        )
    texts: dict[str, list[str]] = {}
    ids: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            texts.setdefault(out.request_id, []).append(out.text)
            ids.setdefault(out.request_id, []).extend(out.token_ids)
    for rid, chunks in texts.items():
        final = tok.decode(ids[rid])
        assert "".join(chunks) == final, rid
        if "\ufffd" not in final:
            assert not any("\ufffd" in c for c in chunks), rid


def test_a_sentencepiece_first_word_keeps_its_space(tmp_path) -> None:  # noqa: ANN001
    """Metaspace tokenizers (Llama 2, Mistral) drop a leading space when the output is decoded on
    its own; primed with the prompt, the stream reads " Paris" after "...France is", as vLLM's."""
    from tokenizers import SentencePieceBPETokenizer

    spm = SentencePieceBPETokenizer()
    spm.train_from_iterator(["the capital of france is paris", "paris is nice"] * 50, vocab_size=120)
    spm.save(str(tmp_path / "tokenizer.json"))
    tok = TextTokenizer(tmp_path)
    prompt = tok.encode("the capital of france is", add_special_tokens=False)
    whole = tok.encode("the capital of france is paris", add_special_tokens=False)
    assert whole[: len(prompt)] == prompt
    output = whole[len(prompt) :]
    assert tok.decode(output) == "paris"  # decoded alone, the space is gone
    detok = IncrementalDetokenizer(tok, prompt, [])
    streamed = ""
    for i, token in enumerate(output):
        detok.add(token)
        streamed += detok.take(final=i == len(output) - 1)
    assert streamed == " paris"
