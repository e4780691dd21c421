"""Build every C++ CPU kernel of the engine for this install (`fleetgate build-kernels`).

Run once by the install (`make install`, `make test`, the container build) right after
`pip install`, never by a serving process: serving only loads what is built here
(`cpu_extension.load_built`). A kernel already built for this install, torch, CPU and flags is
left as it is, so running it again costs an import of torch.
"""

from __future__ import annotations

import pathlib
import time

import msgspec

from backends.torch_llm.kernels import attention_cpu, blocked_linear, fused_cpu
from backends.torch_llm.kernels.cpu_extension import CpuKernel, build

KERNELS: tuple[CpuKernel, ...] = (attention_cpu.KERNEL, fused_cpu.KERNEL, blocked_linear.KERNEL)


class Built(msgspec.Struct, frozen=True):
    """What happened to one kernel."""

    prefix: str
    #: the library's path (where it would be, when the build failed)
    library: str
    #: "built", "present" (built before) or "failed"
    outcome: str
    seconds: float
    #: why the build failed (the compiler's last lines); empty otherwise
    error: str = ""


def build_all(directory: pathlib.Path | None = None) -> list[Built]:
    """Build each kernel missing from `directory` (the install's by default); one `Built` each.

    A failure does not stop the others: each kernel has its own fallback when serving."""
    results = []
    for kernel in KERNELS:
        library = kernel.library(directory)
        if library.is_file():
            results.append(Built(kernel.prefix, str(library), "present", 0.0))
            continue
        start = time.perf_counter()
        try:
            build(kernel, directory)
        except Exception as exc:  # noqa: BLE001 - no compiler, a compile error: reported, not raised
            reason = f"{type(exc).__name__}: {exc}".strip().splitlines()
            error = " | ".join(reason[-3:])[:500]
            results.append(Built(kernel.prefix, str(library), "failed", time.perf_counter() - start, error))
            continue
        results.append(Built(kernel.prefix, str(library), "built", time.perf_counter() - start))
    return results
