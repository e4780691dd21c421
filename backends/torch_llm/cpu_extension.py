"""Build a C++ source file of this package into a torch extension at first use.

Used by the CPU kernels (`attention_cpu`, `fused_cpu`, `blocked_linear`):
`torch.utils.cpp_extension.load_inline` compiles the source (tens of seconds) and caches the library
under `~/.cache/torch_extensions`; the module name carries a hash of the source, the CPU model and
torch's version, because the code is built for the host's instruction set (`-march=native`) against
that torch's headers. `checked_or_none` is how every fast path is taken into use (these kernels,
the CUDA decode graphs): built, checked against the path it replaces, or left out with a warning.
"""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Callable
from typing import Any

import structlog
import torch

from fleetgate.host import cpu_model

log = structlog.get_logger("fleetgate.torch_llm")


def load_cpu_extension(source: pathlib.Path, prefix: str, functions: list[str], cflags: list[str]) -> Any:
    """The compiled module exposing `functions` of `source` (raises if it does not build)."""
    from torch.utils.cpp_extension import load_inline

    text = source.read_text()
    key = hashlib.sha256((text + cpu_model() + torch.__version__).encode()).hexdigest()[:12]
    return load_inline(
        name=f"{prefix}_{key}",
        cpp_sources=text,
        functions=functions,
        extra_cflags=cflags,
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def checked_or_none(load: Callable[[], Any], check: Callable[[Any], str | None], event: str) -> Any | None:
    """`load()`'s result (a compiled kernel module, captured CUDA graphs) when it builds and
    `check` finds no disagreement with the path it replaces; otherwise None and one `event` warning
    with the reason (the caller keeps that path)."""
    try:
        module = load()
        error = check(module)
    except Exception as exc:  # noqa: BLE001 - no compiler, a build or capture error: the old path serves
        error = f"{type(exc).__name__}: {exc}"
    if error is not None:
        log.warning(event, reason=error[:500])
        return None
    return module
