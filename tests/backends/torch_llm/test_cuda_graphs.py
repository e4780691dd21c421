"""What of the CUDA decode graphs can be checked without a GPU: the captured batch sizes, and that a
CPU engine neither captures nor allocates the scratch block (the replays themselves are checked
against eager steps and transformers in test_gpu.py, on CUDA only)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from backends.torch_llm.kernels.cuda_graphs import batch_sizes  # noqa: E402
from tests.backends.torch_llm.conftest import engine_for  # noqa: E402


@pytest.mark.parametrize(
    ("max_num_seqs", "expected"),
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (12, [1, 2, 4, 8, 12]),
        (16, [1, 2, 4, 8, 16]),
        (256, [1, 2, 4, *range(8, 129, 8)]),
    ],
)
def test_captured_batch_sizes(max_num_seqs: int, expected: list[int]) -> None:
    assert batch_sizes(max_num_seqs) == expected


def test_a_cpu_engine_captures_nothing(llama_dir) -> None:
    runner = engine_for(llama_dir).runner
    assert runner.graphs is None and runner.use_decode_graphs(16, 256) is False
    slots = runner.kv_caches[0][0].shape[0]
    assert slots == runner.num_blocks * runner.block_size, "no scratch block on CPU"
