"""A TensorFlow Serving stand-in for tests: the PredictionService gRPC API over real SavedModels.

No `tensorflow_model_server` binary can be installed on these machines, so tests run the gateway's
TF Serving adapter against this server instead. It uses the official generated stubs from
`tensorflow_serving.apis` and executes the SavedModel with TensorFlow, so tensors, signatures and
status codes are real. It covers `Predict` and `GetModelMetadata` with model versions and version
labels, and answers the way TF Serving does: NOT_FOUND for an unknown model, version or label,
INVALID_ARGUMENT for an unknown signature, a missing or unknown input, or a tensor the signature
rejects.

What it does NOT cover (see the real-binary test group): Classify/Regress/MultiInference, the
ModelService (status, reload), version policies and hot reload from disk, batching, REST, TLS.

Run: `python tests/tfserving_server.py --model-name digits --model-base-path DIR [--label stable=1]`
where DIR holds one SavedModel per numeric version folder. It binds 127.0.0.1 on a free port and
prints `LISTENING <port>` on stdout once it serves.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import grpc  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.core.protobuf import meta_graph_pb2  # noqa: E402
from tensorflow_serving.apis import (  # noqa: E402
    get_model_metadata_pb2,
    predict_pb2,
    prediction_service_pb2_grpc,
)


class ServableError(Exception):
    """A request error with the gRPC status TF Serving would answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Servables:
    """The SavedModels of one model name, by version, plus version labels."""

    def __init__(self, name: str, base_path: Path, labels: dict[str, int]) -> None:
        self.name = name
        self.versions = {
            int(p.name): tf.saved_model.load(str(p)) for p in base_path.iterdir() if p.name.isdigit()
        }
        if not self.versions:
            raise SystemExit(f"no numeric version folder under {base_path}")
        self.labels = labels

    def resolve(self, spec) -> tuple[int, object]:  # type: ignore[no-untyped-def]
        if spec.name != self.name:
            raise ServableError(
                grpc.StatusCode.NOT_FOUND, f"Servable not found for request: Latest({spec.name})"
            )
        which = spec.WhichOneof("version_choice")
        if which == "version":
            version = spec.version.value
        elif which == "version_label":
            if spec.version_label not in self.labels:
                raise ServableError(
                    grpc.StatusCode.NOT_FOUND,
                    f"Unrecognized servable version label: {spec.version_label}",
                )
            version = self.labels[spec.version_label]
        else:
            version = max(self.versions)
        if version not in self.versions:
            raise ServableError(
                grpc.StatusCode.NOT_FOUND, f"Servable not found for request: Specific({self.name}, {version})"
            )
        return version, self.versions[version]


def _signature(model, name: str):  # type: ignore[no-untyped-def]
    key = name or "serving_default"
    if key not in model.signatures:
        raise ServableError(grpc.StatusCode.INVALID_ARGUMENT, f'Serving signature key "{key}" not found.')
    return key, model.signatures[key]


def _tensor_info(name: str, dtype: tf.DType, shape: tf.TensorShape) -> meta_graph_pb2.TensorInfo:
    return meta_graph_pb2.TensorInfo(name=name, dtype=dtype.as_datatype_enum, tensor_shape=shape.as_proto())


def _signature_def(fn) -> meta_graph_pb2.SignatureDef:  # type: ignore[no-untyped-def]
    sig = meta_graph_pb2.SignatureDef(method_name="tensorflow/serving/predict")
    _, kwargs = fn.structured_input_signature
    for key, spec in kwargs.items():
        sig.inputs[key].CopyFrom(_tensor_info(f"serving_default_{key}:0", spec.dtype, spec.shape))
    for key, spec in fn.structured_outputs.items():
        sig.outputs[key].CopyFrom(_tensor_info(f"StatefulPartitionedCall:{key}", spec.dtype, spec.shape))
    return sig


class PredictionService(prediction_service_pb2_grpc.PredictionServiceServicer):
    def __init__(self, servables: Servables) -> None:
        self.servables = servables

    def GetModelMetadata(self, request, context):  # noqa: N802 - gRPC method name
        try:
            version, model = self.servables.resolve(request.model_spec)
            fields = list(request.metadata_field)
            if fields != ["signature_def"]:
                raise ServableError(
                    grpc.StatusCode.INVALID_ARGUMENT, "Metadata field(s) not supported: " + ",".join(fields)
                )
            sig_map = get_model_metadata_pb2.SignatureDefMap()
            for key, fn in model.signatures.items():
                sig_map.signature_def[key].CopyFrom(_signature_def(fn))
        except ServableError as exc:
            context.abort(exc.code, exc.message)
        response = get_model_metadata_pb2.GetModelMetadataResponse()
        response.model_spec.name = self.servables.name
        response.model_spec.version.value = version
        response.metadata["signature_def"].Pack(sig_map)
        return response

    def Predict(self, request, context):  # noqa: N802 - gRPC method name
        try:
            version, model = self.servables.resolve(request.model_spec)
            key, fn = _signature(model, request.model_spec.signature_name)
            outputs = self._run(fn, request)
        except ServableError as exc:
            context.abort(exc.code, exc.message)
        response = predict_pb2.PredictResponse()
        response.model_spec.name = self.servables.name
        response.model_spec.version.value = version
        response.model_spec.signature_name = key
        for name, value in outputs.items():
            response.outputs[name].CopyFrom(tf.make_tensor_proto(value.numpy()))
        return response

    @staticmethod
    def _run(fn, request) -> dict:  # type: ignore[no-untyped-def]
        _, expected = fn.structured_input_signature
        given = set(request.inputs)
        if given != set(expected):
            raise ServableError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"input size does not match signature: {len(given)}!={len(expected)} len({{{','.join(sorted(given))}}}) "
                f"!= len({{{','.join(sorted(expected))}}})",
            )
        feeds = {}
        for key, spec in expected.items():
            try:
                value = tf.make_ndarray(request.inputs[key])
            except Exception as exc:  # a malformed TensorProto
                raise ServableError(grpc.StatusCode.INVALID_ARGUMENT, f"input {key}: {exc}") from None
            tensor = tf.constant(value)
            if tensor.dtype != spec.dtype:
                raise ServableError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"Expects arg[{key}] to be {spec.dtype.name} but {tensor.dtype.name} is provided",
                )
            if not spec.shape.is_compatible_with(tensor.shape):
                raise ServableError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"input {key}: shape {tensor.shape} is incompatible with {spec.shape}",
                )
            feeds[key] = tensor
        outputs = fn(**feeds)
        wanted = list(request.output_filter)
        unknown = [name for name in wanted if name not in outputs]
        if unknown:
            raise ServableError(
                grpc.StatusCode.INVALID_ARGUMENT, f"output tensor alias not found in signature: {unknown[0]}"
            )
        return {name: outputs[name] for name in (wanted or outputs)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--model-base-path", required=True, type=Path)
    parser.add_argument("--label", action="append", default=[], help="LABEL=VERSION, repeatable")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args(argv)
    labels = {k: int(v) for k, v in (item.split("=", 1) for item in args.label)}
    servables = Servables(args.model_name, args.model_base_path, labels)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=args.workers),
        options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)],
    )
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(PredictionService(servables), server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    sys.stdout.write(f"LISTENING {port}\n")
    sys.stdout.flush()
    stop.wait()
    server.stop(grace=0.5).wait()


if __name__ == "__main__":
    main()
