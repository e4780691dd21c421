"""A process that already has TensorFlow must not import triton (it aborts): the engine falls back."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("triton")
ROOT = pathlib.Path(__file__).resolve().parents[3]

SCRIPT = """
import sys
import tensorflow  # noqa: F401  (as a gateway with a tfserving deployment has it)
import torch
from backends.torch_llm.model.attention import TorchPagedAttention
from backends.torch_llm.kernels.attention_select import make_attention

impl = make_attention(torch.device("cpu"), 4, 2, 8, block_size=16, dtype=torch.float32, backend="triton")
assert isinstance(impl, TorchPagedAttention), type(impl)
assert "triton" not in sys.modules
print("fell back")
"""


def test_triton_is_not_loaded_after_tensorflow() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fell back" in proc.stdout
    assert "TensorFlow is loaded" in proc.stdout + proc.stderr
