"""`fleetgate demo-models --out DIR`: build the demo models (digits in every format, a tiny Llama) locally."""

from __future__ import annotations

import argparse
from pathlib import Path

from gateway.serve.commands.base import AddParser


def register(add_parser: AddParser) -> None:
    p = add_parser("demo-models", help="build the demo models locally")
    p.add_argument("--out", default="models")
    p.add_argument(
        "--no-savedmodel", action="store_true", help="skip the TF SavedModel (no TensorFlow needed)"
    )
    p.add_argument("--no-llama", action="store_true", help="skip the tiny Llama (no torch needed)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    # TensorFlow (for the SavedModel) is chatty on stderr at import; keep the command's output readable.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    from backends.demo_models.digits import write_all

    written = write_all(Path(args.out), savedmodel=not args.no_savedmodel, llama=not args.no_llama)
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0
