"""Checks of the Triton paged-decode kernel, shared by the CPU (interpreter) and the GPU tests.

On CPU the kernel runs only under `TRITON_INTERPRET=1`, which must be set before triton is first
imported and would leak into every later import in the process. So `test_triton_kernel` runs this file
in a subprocess (`python -m tests.backends.torch_llm.paged_kernel_checks MODEL_DIR`), which sets the variable
first and prints one JSON report; `test_gpu` calls `kernel_errors` directly on CUDA.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

# (block_size, query heads, kv heads, head_dim, context lengths): several block sizes, MHA and
# GQA ratios 2/4/8, lengths that are not multiples of the block size, single-key and multi-tile cases.
KERNEL_CASES = [
    (16, 4, 4, 16, [1, 16, 17, 40]),
    (16, 8, 2, 32, [3, 33, 130]),
    (8, 8, 1, 32, [5, 64, 100]),
    (32, 6, 3, 64, [31, 1, 70]),
    (3, 4, 2, 8, [7, 1, 12]),
]


#: programs per (sequence, KV head): one (the kernel writes the output), and split contexts with a
#: combine, including more splits than a short context has tiles (empty shares)
SPLITS = (1, 3, 8)


def kernel_errors(device: str = "cpu", dtype_name: str = "float32") -> list[float]:
    """Max abs difference between the kernel and gather + SDPA, one per case in KERNEL_CASES and
    sequence, for each count in SPLITS."""
    import torch
    import torch.nn.functional as F

    from backends.torch_llm.kernels.triton_decode import paged_decode_attention

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    errors = []
    for bs, h, kvh, d, lengths in KERNEL_CASES:
        num_blocks = sum(-(-n // bs) for n in lengths) + 3
        k_cache = torch.randn(num_blocks * bs, kvh, d, generator=gen).to(device, dtype)
        v_cache = torch.randn(num_blocks * bs, kvh, d, generator=gen).to(device, dtype)
        order = torch.randperm(num_blocks, generator=gen).tolist()  # blocks out of order in the pool
        tables, used = [], 0
        for n in lengths:
            tables.append(order[used : used + -(-n // bs)])
            used += len(tables[-1])
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
        lens = torch.tensor(lengths, dtype=torch.int32, device=device)
        q = torch.randn(len(lengths), h, d, generator=gen).to(device, dtype)
        refs = []
        for i, (t, n) in enumerate(zip(tables, lengths, strict=True)):
            slots = torch.tensor([t[p // bs] * bs + p % bs for p in range(n)], device=device)
            kk = k_cache[slots].transpose(0, 1).float()  # [KVH, n, D]
            vv = v_cache[slots].transpose(0, 1).float()
            refs.append(
                F.scaled_dot_product_attention(q[i].float().unsqueeze(1), kk, vv, scale=d**-0.5, enable_gqa=True)
                .squeeze(1)
            )  # fmt: skip
        for splits in SPLITS:
            out = torch.full_like(q, float("nan"))  # every element must be written
            got = paged_decode_attention(
                q, k_cache, v_cache, table, lens, block_size=bs, scale=d**-0.5, out=out, splits=splits
            )
            errors += [(got[i].float() - ref).abs().max().item() for i, ref in enumerate(refs)]
    return errors


def engine_check(model_dir: str) -> dict[str, Any]:
    """Greedy tokens with the Triton decode path vs gather + SDPA, through the whole engine."""
    import pathlib
    import random

    from backends.base import SamplingParams
    from tests.backends.torch_llm.conftest import engine_for, make_prompts, run_engine

    prompts = make_prompts(6, seed=11)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    arrivals = sorted(random.Random(5).randrange(0, 12) for _ in prompts)
    runs = {}
    for backend in ("triton", "torch"):
        engine = engine_for(
            pathlib.Path(model_dir), attention_backend=backend, max_num_batched_tokens=16, num_kv_blocks=12
        )
        runs[backend] = {
            "impl": engine.runner.attention.name,
            "disabled": getattr(engine.runner.attention, "disabled_reason", None),
            "outputs": run_engine(engine, prompts, params, arrival_steps=arrivals),
            "preemptions": engine.scheduler.num_preemptions,
        }
    return runs


def main() -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import torch

    torch.set_num_threads(1)
    report = {"kernel_errors": kernel_errors()}
    if len(sys.argv) > 1:
        report["engine"] = engine_check(sys.argv[1])
    sys.stdout.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
