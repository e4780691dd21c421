"""`fleetgate build-kernels`: build the native code of this install (the engine's CPU kernels) once."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gateway.serve.commands.base import AddParser


def register(add_parser: AddParser) -> None:
    p = add_parser("build-kernels", help="build the native code of this install once (the engine's CPU kernels)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the native code of this install (the LLM engine's CPU kernels) so that no serving
    process compiles anything; one line per library, exit 1 when one failed."""
    try:
        import torch  # noqa: F401 - only to know whether the engine is installed
    except ImportError:
        print("torch is not installed (the `torch` extra): no engine kernels to build", file=sys.stderr)
        torch_results: list[Any] = []
    else:
        from backends.torch_llm.kernels.build_kernels import build_all

        torch_results = build_all()
    failed = 0
    for result in torch_results:
        took = f" in {result.seconds:.1f} s" if result.outcome == "built" else ""
        print(f"{result.outcome} {result.prefix}{took}: {result.library}")
        if result.outcome == "failed":
            failed += 1
            print(
                f"fleetgate: {result.prefix} did not build ({result.error}); engines serve without it",
                file=sys.stderr,
            )
    return 1 if failed else 0
