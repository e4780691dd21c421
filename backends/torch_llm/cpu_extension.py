"""Build a C++ source file of this package into a torch extension at first use.

Used by the CPU kernels (`attention_cpu`, `fused_cpu`): `torch.utils.cpp_extension.load_inline`
compiles the source (tens of seconds) and caches the library under `~/.cache/torch_extensions`;
the module name carries a hash of the source, the CPU model and torch's version, because the code
is built for the host's instruction set (`-march=native`) against that torch's headers.
"""

from __future__ import annotations

import hashlib
import pathlib
from typing import Any

import torch

from fleetgate.host import cpu_model


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
