"""The Triton paged-decode kernel on CPU (interpreter mode, in a subprocess) and the fallback to SDPA.

`TRITON_INTERPRET=1` must be set before triton is imported and would leak into the rest of the test
session, so the kernel and the engine-with-kernel checks run in one subprocess
(`paged_kernel_checks.py`); this process only imports triton for the fallback tests, without it.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import structlog

from backends.base import SamplingParams
from tests.backends.torch_llm.conftest import engine_for, make_prompts, run_engine
from tests.backends.torch_llm.paged_kernel_checks import KERNEL_CASES, SPLITS

pytest.importorskip("triton")
ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def interpreted(llama_dir: pathlib.Path) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.backends.torch_llm.paged_kernel_checks", str(llama_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kernel_matches_gather_sdpa(interpreted: dict) -> None:
    errors = interpreted["kernel_errors"]
    assert len(errors) == len(SPLITS) * sum(len(case[-1]) for case in KERNEL_CASES)
    assert max(errors) < 1e-4, errors


def test_engine_with_kernel_is_token_identical(interpreted: dict) -> None:
    runs = interpreted["engine"]
    assert runs["triton"]["impl"] == "triton" and runs["triton"]["disabled"] is None
    assert runs["torch"]["impl"] == "torch"
    assert runs["triton"]["preemptions"] > 0, "the small pool should force preemption"
    assert runs["triton"]["outputs"] == runs["torch"]["outputs"]
    assert all(len(toks) == 10 for toks in runs["triton"]["outputs"].values())


@pytest.mark.skipif("TRITON_INTERPRET" in os.environ, reason="the interpreter makes the kernel work on CPU")
def test_kernel_that_cannot_run_falls_back_with_one_warning(llama_dir: pathlib.Path) -> None:
    # Without the interpreter Triton has no CPU driver: the load-time probe fails for real.
    with structlog.testing.capture_logs() as logs:
        engine = engine_for(llama_dir, attention_backend="triton")
        out = run_engine(engine, make_prompts(3, seed=1), SamplingParams(max_tokens=4, temperature=0.0))
    assert engine.runner.attention.name == "torch"
    assert all(len(t) == 4 for t in out.values())
    warnings = [e for e in logs if e["event"] == "llm_attention_fallback"]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning", logs
    assert "driver" in warnings[0]["reason"].lower() or "triton" in warnings[0]["reason"].lower()


@pytest.mark.skipif("TRITON_INTERPRET" in os.environ, reason="the interpreter makes the kernel work on CPU")
def test_kernel_failing_mid_run_falls_back_once(llama_dir: pathlib.Path) -> None:
    # A kernel that passed its probe but fails later (e.g. a new specialisation fails to compile):
    # installed as if its probe had passed; with no interpreter here, its first launch fails for real.
    from backends.torch_llm.kernels.attention_triton import TritonPagedAttention

    engine = engine_for(llama_dir)
    runner = engine.runner
    fast = TritonPagedAttention(4, 2, 16, block_size=runner.block_size, device=runner.device)
    fast.strict = False  # as if the probe had passed
    runner.attention = fast
    runner.model.set_attention(fast)
    prompts = make_prompts(4, seed=2)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with structlog.testing.capture_logs() as logs:
        out = run_engine(engine, prompts, params)
    reference = run_engine(engine_for(llama_dir, attention_backend="torch"), prompts, params)
    assert out == reference
    assert fast.disabled_reason is not None
    assert [e["event"] for e in logs].count("llm_attention_fallback") == 1
