"""Run `fleetgate serve` on Intel's OpenMP runtime when an LLM engine computes on the CPU.

The engine steps on its own thread (the event loop owns the main one). With the GNU OpenMP runtime
that torch ships with, every parallel region opened from a thread other than the process's first one
pays far more to start its team: measured here, oneDNN's linears on 2 threads ran 2.5x slower from
such a thread than from the main one, and batch-1 decode fell from 82 to 61 tokens/s. Intel's
runtime (`libiomp5`, the `intel-openmp` package, which also implements the GNU entry points) keeps
hot teams for any thread: the same engine thread decodes at the main thread's speed (88 tokens/s).
vLLM's CPU build asks its users to preload it for the same reason; here `serve` does it itself by
re-executing once with `LD_PRELOAD`, before anything is loaded.

`FLEETGATE_OPENMP=gnu` keeps torch's own runtime (nothing is re-executed).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from gateway.config import Config

_LIBRARY = "libiomp5.so"


def intel_openmp_library() -> Path | None:
    """`libiomp5.so` installed in this environment by the `intel-openmp` package, if any."""
    candidate = Path(sys.prefix) / "lib" / _LIBRARY
    return candidate if candidate.is_file() else None


def wants_intel_openmp(config: Config, environ: os._Environ[str] | dict[str, str]) -> bool:
    """Whether a torch_llm deployment may run on the CPU and nothing has opted out or preloaded yet."""
    if not sys.platform.startswith("linux") or environ.get("FLEETGATE_OPENMP", "").lower() == "gnu":
        return False
    if _LIBRARY in environ.get("LD_PRELOAD", ""):
        return False
    return any(
        d.backend == "torch_llm" and not str(d.device or "auto").startswith("cuda")
        for d in config.deployments.values()
    )


def reexec_with_intel_openmp(config: Config, argv: list[str]) -> None:
    """Replace this process by itself with Intel's OpenMP preloaded, when that is wanted and possible.

    `argv` are the command's arguments (`serve --config ...`), as `main` parsed them. Returns only
    when nothing is re-executed (no CPU engine, opted out, already preloaded, or the library is not
    installed).
    """
    library = intel_openmp_library()
    if library is None or not wants_intel_openmp(config, os.environ):
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (str(library), env.get("LD_PRELOAD", "")) if p)
    print(
        f"fleetgate: restarting on Intel's OpenMP runtime ({library}) for the CPU LLM engine", file=sys.stderr
    )
    sys.stderr.flush()
    # -P: the working directory does not shadow our packages in the new interpreter
    os.execve(sys.executable, [sys.executable, "-P", "-m", "gateway.serve.cli", *argv], env)
