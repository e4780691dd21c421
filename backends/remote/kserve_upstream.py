"""The Open Inference Protocol v2 side of the remote backend: model metadata, infer bodies, answers.

Pure translation between the internal tensor types and v2 JSON; the HTTP exchange is the backend's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backends.base import V2_TO_NUMPY, ModelMetadata, Tensor, TensorRequest, TensorResponse, TensorSpec
from backends.remote.errors import UpstreamMalformed


def metadata_path(upstream_model: str) -> str:
    return f"/v2/models/{upstream_model}"


def infer_path(upstream_model: str) -> str:
    return f"/v2/models/{upstream_model}/infer"


def metadata_from(name: str, url: str | None, upstream_model: str, meta: Any) -> ModelMetadata:
    """The deployment's metadata from the upstream's v2 model metadata answer."""
    try:

        def specs(items: list[dict[str, Any]]) -> list[TensorSpec]:
            return [
                TensorSpec(name=i["name"], datatype=i["datatype"], shape=tuple(int(d) for d in i["shape"]))
                for i in items
            ]

        return ModelMetadata(
            name=name,
            platform=str(meta.get("platform", "remote")),
            inputs=specs(meta.get("inputs", [])),
            outputs=specs(meta.get("outputs", [])),
            device="remote",
            extra={"url": url, "upstream_model": upstream_model},
        )
    except (AttributeError, KeyError, TypeError, ValueError):
        raise UpstreamMalformed(f"upstream {name!r} sent malformed model metadata") from None


def infer_body(request: TensorRequest) -> dict[str, Any]:
    """The v2 JSON infer body of `request` (tensors as flat JSON lists)."""
    body: dict[str, Any] = {
        "id": request.id,
        "inputs": [
            {
                "name": t.name,
                "shape": list(t.shape),
                "datatype": t.datatype,
                "data": _to_json_list(t.data, t.datatype),
            }
            for t in request.inputs
        ],
    }
    if request.outputs is not None:
        body["outputs"] = [{"name": n} for n in request.outputs]
    return body


def response_from(name: str, request_id: str, answer: Any) -> TensorResponse:
    """The internal response of the upstream's v2 JSON infer answer."""
    try:
        outputs = [
            Tensor(
                name=o["name"],
                datatype=o["datatype"],
                shape=tuple(o["shape"]),
                data=_from_json_list(o["data"], o["datatype"], tuple(o["shape"])),
            )
            for o in answer["outputs"]
        ]
    except (KeyError, TypeError, ValueError):
        raise UpstreamMalformed(f"upstream {name!r} sent a malformed inference response") from None
    return TensorResponse(id=request_id, outputs=outputs)


def _to_json_list(data: np.ndarray, datatype: str) -> list[Any]:
    flat = data.reshape(-1)
    if datatype == "BYTES":
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in flat]
    return flat.tolist()


def _from_json_list(values: list[Any], datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    if datatype == "BYTES":
        return np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=object).reshape(
            shape
        )
    return np.asarray(values, dtype=V2_TO_NUMPY[datatype]).reshape(shape)
