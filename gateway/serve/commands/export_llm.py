"""`fleetgate export-llm`: a Hugging Face LLM folder as the export `backend: openvino_llm` serves.

Progress goes to stderr one step a line; the last line on stdout names the export. Failures are one
line (`fleetgate: ...`) and exit code 2. How the export is made: docs/decisions/openvino-llm-export.md.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys

from gateway.serve.commands.base import AddParser, fail

_WEIGHTS = ("fp32", "fp16", "int8", "int4")


def register(add_parser: AddParser) -> None:
    p = add_parser("export-llm", help="export a Hugging Face LLM folder for the openvino_llm backend")
    p.add_argument("--model", required=True, help="the Hugging Face model folder (config.json, weights, tokenizer.json)")
    p.add_argument("--out", required=True, help="the export folder to write (created)")
    p.add_argument(
        "--weights", choices=_WEIGHTS, default="fp32", help="weight storage: fp32, fp16, or NNCF-compressed int8/int4"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from backends.openvino_llm.export import ExportError, export_llm

    def progress(step: str) -> None:
        print(f"export-llm: {step}", file=sys.stderr, flush=True)

    model, out = pathlib.Path(args.model), pathlib.Path(args.out)
    if not model.is_dir():
        return fail(f"--model {args.model}: no such folder")
    try:
        # transformers and NNCF draw their own bars and tables on stdout: stdout carries the answer only
        with contextlib.redirect_stdout(sys.stderr):
            manifest = export_llm(model, out, args.weights, progress=progress)
    except ExportError as exc:
        return fail(f"export-llm: {exc}")
    except OSError as exc:
        return fail(f"export-llm: cannot write {out}: {exc.strerror or exc}")
    print(f"{out}: {manifest.architecture}, {manifest.layers} layers, {manifest.weights} weights ({manifest.seconds:.1f} s)")
    return 0
