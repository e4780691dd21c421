"""The engine's C++ CPU kernels: built once per install, only loaded while serving.

Used by the CPU kernels (`attention_cpu`, `fused_cpu`, `blocked_linear`). `build` compiles a kernel's
source with `torch.utils.cpp_extension.load_inline` (tens of seconds each) into the install's own
directory, `<sys.prefix>/share/fleetgate/kernels` (the virtualenv's, or the image's); `fleetgate
build-kernels` runs it for every kernel, and `make install` / `make test` / the container build run
that command right after `pip install`. A library's name carries a key of everything it was built
for: the source, torch's version, Python's, the CPU model (the code is built for the host's
instruction set, `-march=native`) and the compile flags; two installs on one machine have two
directories and never rebuild each other's kernels (torch's default cache, `~/.cache/torch_extensions`,
is shared by every install and keyed by none of these).

`load_built` only imports a built library: serving never compiles. A kernel that is not built for
this install raises `KernelNotBuilt`, whose message names the command that builds it; the callers turn
that into one warning and keep the path the kernel replaces. `checked_or_none` is how every fast path
is taken into use (these kernels, the CUDA decode graphs): built, checked against the path it
replaces, or left out with a warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import pathlib
import platform
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import structlog
import torch

from fleetgate.host import cpu_model

log = structlog.get_logger("fleetgate.torch_llm")

BUILD_COMMAND = "fleetgate build-kernels"


class KernelNotBuilt(RuntimeError):
    """The kernel's library for this install, torch, CPU and flags is not there."""


def kernels_dir() -> pathlib.Path:
    """Where this install keeps its built kernels (inside the virtualenv or image, not the home)."""
    return pathlib.Path(sys.prefix) / "share" / "fleetgate" / "kernels"


@dataclass(frozen=True)
class CpuKernel:
    """One C++ source of this package and how it is compiled."""

    #: the library's name before its key, e.g. `fleetgate_paged_decode`
    prefix: str
    source: pathlib.Path
    #: the C++ functions bound into the Python module
    functions: tuple[str, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...] = ("-fopenmp",)

    def name(self) -> str:
        """The module's name: the prefix and a key of everything the library depends on."""
        facts = [
            self.source.read_text(),
            torch.__version__,
            sys.version,
            platform.machine(),
            cpu_model(),
            " ".join(self.functions),
            " ".join(self.cflags),
            " ".join(self.ldflags),
        ]
        key = hashlib.sha256("\0".join(facts).encode()).hexdigest()[:16]
        return f"{self.prefix}_{key}"

    def library(self, directory: pathlib.Path | None = None) -> pathlib.Path:
        """The built library's path (torch names a Python extension `<name>.so`)."""
        return (directory or kernels_dir()) / f"{self.name()}.so"


def load_built(kernel: CpuKernel, directory: pathlib.Path | None = None) -> ModuleType:
    """The kernel's built module; `KernelNotBuilt` (naming the build command) when it is missing."""
    library = kernel.library(directory)
    if not library.is_file():
        raise KernelNotBuilt(
            f"{kernel.prefix} is not built for this install (torch {torch.__version__}, this CPU, "
            f"looked for {library}): run `{BUILD_COMMAND}` once after installing"
        )
    name = library.name.removesuffix(".so")
    if name in sys.modules:  # built in this process (build() imports what it builds)
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise KernelNotBuilt(f"{library} is not a loadable extension: run `{BUILD_COMMAND}`")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def build(kernel: CpuKernel, directory: pathlib.Path | None = None) -> pathlib.Path:
    """Compile `kernel` into the install's kernel directory unless it is there; its library's path.

    torch builds in `build/<name>/` (its lock file keeps two builders of one kernel apart); the
    library is then copied beside it under a temporary name and renamed, so a process loading it
    never reads half a file.
    """
    from torch.utils.cpp_extension import load_inline

    library = kernel.library(directory)
    if library.is_file():
        return library
    name = kernel.name()
    work = library.parent / "build" / name
    work.mkdir(parents=True, exist_ok=True)
    module = load_inline(
        name=name,
        cpp_sources=kernel.source.read_text(),
        functions=list(kernel.functions),
        extra_cflags=list(kernel.cflags),
        extra_ldflags=list(kernel.ldflags),
        build_directory=str(work),
        verbose=False,
    )
    built = pathlib.Path(module.__file__ or "")
    if built.name != library.name:
        # torch renames a module it built before in this process from other sources (`_v1`); a
        # library whose init symbol differs from its file's name would not import later
        raise RuntimeError(f"torch built {built.name} for {name}: run the build in a fresh process")
    partial = library.with_name(f".{library.name}.{os.getpid()}")
    shutil.copyfile(built, partial)
    os.replace(partial, library)
    shutil.rmtree(work, ignore_errors=True)
    with contextlib.suppress(OSError):  # another kernel may be building beside it
        work.parent.rmdir()
    # the module is already imported: `load_built` in this process returns it rather than loading
    # a second copy of the same extension from the renamed file
    sys.modules[name] = module
    return library


def checked_or_none(load: Callable[[], Any], check: Callable[[Any], str | None], event: str) -> Any | None:
    """`load()`'s result (a built kernel module, captured CUDA graphs) when it loads and `check`
    finds no disagreement with the path it replaces; otherwise None and one `event` warning with
    the reason (the caller keeps that path)."""
    try:
        module = load()
        error = check(module)
    except Exception as exc:  # noqa: BLE001 - not built, a load or capture error: the old path serves
        error = f"{type(exc).__name__}: {exc}"
    if error is not None:
        log.warning(event, reason=error[:500])
        return None
    return module
