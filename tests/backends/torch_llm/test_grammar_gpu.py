"""Constrained decoding on CUDA (skipped without a GPU; not run in CI, which has none): the masks
are filled on the host and applied to device logits, decode steps replay captured CUDA graphs, and
a preempted sequence's seeded answer is the one it gives alone."""

from __future__ import annotations

import asyncio
import gc
import json
import pathlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("xgrammar")

from backends.base import SamplingParams, StructuredOutput  # noqa: E402
from backends.torch_llm.structured.compiler import GrammarCompiler  # noqa: E402
from backends.torch_llm.tokenizer import TextTokenizer  # noqa: E402
from tests.backends.torch_llm.conftest import engine_for  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCHEMA = {
    "type": "object",
    "properties": {
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 6},
        "tag": {"enum": ["a", "bb", "ccc"]},
    },
    "required": ["xs", "tag"],
    "additionalProperties": False,
}


def _check(value: object) -> None:
    assert isinstance(value, dict) and set(value) == {"xs", "tag"}
    assert value["tag"] in ("a", "bb", "ccc")
    assert len(value["xs"]) <= 6 and all(type(x) is int and 0 <= x <= 99 for x in value["xs"])


def _run(engine, n: int, so: StructuredOutput, grammar: object) -> dict[str, tuple[str, str]]:  # type: ignore[no-untyped-def]
    texts: dict[str, list] = {}
    for i in range(n):
        engine.add_request(str(i), [0, 7 + i, 9, 11], SamplingParams(max_tokens=48, temperature=1.0, seed=i,
                           structured=so), grammar=grammar)  # fmt: skip
        texts[str(i)] = ["", ""]
    while engine.has_unfinished:
        for o in engine.step():
            texts[o.request_id][0] += o.text
            texts[o.request_id][1] = o.finish_reason or texts[o.request_id][1]
    return {k: (v[0], v[1]) for k, v in texts.items()}


def test_cuda_constrained_answers_validate_and_survive_preemption(llama_dir: pathlib.Path) -> None:
    so = StructuredOutput(json_schema=json.dumps(SCHEMA, sort_keys=True))
    roomy = engine_for(llama_dir, device="cuda", gpu_memory_utilization=0.2)
    compiler = GrammarCompiler(TextTokenizer(llama_dir), roomy.config.vocab_size, roomy.config.eos_token_ids)
    grammar = asyncio.run(compiler.get(so))
    alone = _run(roomy, 1, so, grammar)["0"]
    together = _run(roomy, 24, so, grammar)
    assert together["0"] == alone  # the batch it shares does not change a seeded answer
    stopped = [text for text, reason in together.values() if reason == "stop"]
    assert len(stopped) >= 12
    for text in stopped:
        _check(json.loads(text))
    del roomy
    gc.collect()
    torch.cuda.empty_cache()
    tight = engine_for(llama_dir, device="cuda", num_kv_blocks=16, block_size=4, enable_prefix_caching=False)
    squeezed = _run(tight, 8, so, grammar)
    assert tight.scheduler.num_preemptions > 0
    assert squeezed == {k: together[k] for k in squeezed}
