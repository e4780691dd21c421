"""`fleetgate quantize`: post-training INT8 quantization of a model for OpenVINO on CPU (NNCF)."""

from __future__ import annotations

import argparse
import sys

from gateway.serve.commands.base import AddParser, fail


def register(add_parser: AddParser) -> None:
    p = add_parser("quantize", help="post-training INT8 quantization of a model for OpenVINO on CPU")
    p.add_argument("--model", required=True, help="the f32 model: .onnx or OpenVINO IR .xml")
    p.add_argument(
        "--calibration", required=True, help="representative input rows: .npy, or .npz keyed by input name"
    )
    p.add_argument("--out", required=True, help="the INT8 IR to write (.xml; its .bin goes beside it)")
    p.add_argument("--input", help="the input the rows feed (required when the model has several)")
    p.add_argument("--subset-size", type=int, default=300, help="calibration rows used at most")
    p.add_argument("--preset", choices=("performance", "mixed"), default="performance")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import contextlib

    from backends.openvino.quantize import quantize_to_int8, quantized_op_counts
    from backends.runtime.lazy import MissingRuntime

    try:
        # NNCF draws progress bars on stdout; stdout carries only the answer line
        with contextlib.redirect_stdout(sys.stderr):
            out = quantize_to_int8(
                args.model,
                args.calibration,
                args.out,
                input_name=args.input,
                subset_size=args.subset_size,
                preset=args.preset,
            )
    except (ValueError, MissingRuntime) as exc:
        return fail(str(exc))
    counts = quantized_op_counts(out)
    if counts["fake_quantize"] == 0:
        print(f"fleetgate: NNCF found nothing to quantize in {args.model}", file=sys.stderr)
    print(
        f"{out}: {counts['fake_quantize']} FakeQuantize, {counts['quantized_ops']} quantized ops, "
        f"{counts['int8_weights']} int8 weight tensors"
    )
    return 0
