"""The parts of bench/bench_llm_gpu.py that need no GPU: the model shape, byte accounting, the driver."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest
import torch

from backends.torch_llm.costs import (
    decode_bytes_per_step,
    kv_bytes_per_token,
    parameter_count,
    weight_bytes_per_step,
)
from backends.torch_llm.options import LLMOptions

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "bench_llm_gpu.py"


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("bench_llm_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300}  # fmt: skip


def test_llama3_8b_shape_and_bytes(bench) -> None:
    cfg = bench.model_config()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        4096, 32, 32, 8,
    )  # fmt: skip
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.dtype == "bfloat16"
    assert parameter_count(cfg) == 8_030_261_248  # Llama-3-8B's published parameter count
    assert kv_bytes_per_token(cfg, 2) == 2 * 32 * 8 * 128 * 2  # 128 KiB per token in bf16
    # One decode step reads every weight except the 128256 x 4096 embedding rows it does not use.
    assert weight_bytes_per_step(cfg, 2) == (8_030_261_248 - 128256 * 4096) * 2
    assert decode_bytes_per_step(cfg, 2, [100, 50]) == weight_bytes_per_step(cfg, 2) + 150 * 131072


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_matches_a_built_model(bench, tied) -> None:
    cfg = bench.model_config(**TINY, tie_word_embeddings=tied)
    model = bench.build_random_model(cfg, "cpu", torch.float32)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(cfg)
    assert model.model.norm.weight.eq(1).all() and model.lm_head.weight.std() > 0.01


def test_measure_decode_drives_the_engine_on_cpu(bench) -> None:
    cfg = bench.model_config(**TINY)
    model = bench.build_random_model(cfg, "cpu", torch.float32)
    opts = LLMOptions(block_size=8, kv_cache_bytes=4 << 20, max_num_batched_tokens=64)
    engine = bench.build_engine_for(model, max_num_seqs=4, options=opts)
    row = bench.measure_decode(engine, cfg, 4, batch=3, prompt_len=20, warmup=2, steps=4)
    assert row["batch"] == 3 and row["decode_tokens_per_s"] > 0
    # Contexts after prefill (21) and warmup (2), measured at mid-run (+2): 25 tokens x 3 sequences.
    assert row["kv_bytes_per_step"] == 3 * 25 * kv_bytes_per_token(cfg, 4)
    assert not engine.has_unfinished and engine.block_manager.num_free_blocks == engine.runner.num_blocks
    assert bench.copy_bandwidth("cpu", nbytes=1 << 20, repeats=2) > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_without_cuda_exits_cleanly_and_writes_nothing(tmp_path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "no CUDA device" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()
