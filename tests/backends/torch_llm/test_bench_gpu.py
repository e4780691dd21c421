"""The parts of bench/bench_llm_gpu.py that need no GPU: the model shape, byte accounting, the driver."""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys

import pytest
import torch

from backends.torch_llm.model.costs import (
    decode_bytes_per_step,
    kv_bytes_per_token,
    parameter_count,
    weight_bytes_per_step,
)
from backends.torch_llm.options import LLMOptions

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201
    return importlib.import_module("bench.bench_llm_gpu")


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
    assert row["cuda_graphs"] is False and row["steps_replayed"] == 0  # CPU: never captured
    # Contexts after prefill (21) and warmup (2), measured at mid-run (+2): 25 tokens x 3 sequences.
    assert row["kv_bytes_per_step"] == 3 * 25 * kv_bytes_per_token(cfg, 4)
    assert not engine.has_unfinished and engine.block_manager.num_free_blocks == engine.runner.num_blocks
    assert bench.copy_bandwidth("cpu", nbytes=1 << 20, repeats=2) > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_without_cuda_exits_cleanly_and_writes_nothing(tmp_path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.bench_llm_gpu", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "no CUDA device" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_summary_takes_medians_per_mode_and_the_graphs_ratio(bench) -> None:
    def row(graphs: bool, tok_s: float) -> dict:
        return {"batch": 8, "cuda_graphs": graphs, "steps_replayed": 4 * graphs, "decode_tokens_per_s": tok_s,
                "step_time_s": 8 / tok_s, "bandwidth_utilisation": tok_s / 1000}  # fmt: skip

    rows = [row(False, 100), row(True, 300), row(False, 120), row(True, 200), row(False, 110), row(True, 240)]
    (entry,) = bench.summarise(rows)
    assert entry["eager"]["decode_tokens_per_s"] == 110 and entry["graphs"]["decode_tokens_per_s"] == 240
    assert entry["graphs"]["steps_replayed"] == 12 and entry["eager"]["steps_replayed"] == 0
    assert entry["graphs_over_eager_tokens_per_s"] == pytest.approx(240 / 110)
    assert "graphs" not in bench.summarise([r for r in rows if not r["cuda_graphs"]])[0]
