"""What Litestar's OpenAPI document says beyond the handlers' signatures: each protocol's error
responses (`responses=` on the routes), the shapes of the success answers the hot routes send as
bare ASGI responses, and the request bodies of the two routes that read their bodies raw.

Typed bodies (`data: ChatBody`) are documented by Litestar from their Structs. The tensor routes
(v2 `/infer`, TF Serving `:predict`) read theirs raw (docs/decisions/0001-raw-tensor-bodies.md);
their operations get the body schema msgspec generates from the Struct the v2 decoder uses, so the
document and the decoder cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import (
    OpenAPIMediaType,
    Operation,
    RequestBody,
    SecurityRequirement,
    SecurityScheme,
)

from gateway.wire.v2_codec import InferRequestJSON

# --- the error envelopes (gateway/http/errors.py writes them) --------------------------------------


class OpenAIErrorDetail(msgspec.Struct):
    message: str
    type: str
    code: str
    param: str | None = None


class OpenAIError(msgspec.Struct):
    """OpenAI's error envelope: `{"error": {message, type, code, param}}`."""

    error: OpenAIErrorDetail


class PlainError(msgspec.Struct):
    """Open Inference Protocol v2, TF Serving and the admin API: `{"error": "..."}`."""

    error: str


_CLIENT_ERRORS = {
    400: "bad input",
    401: "missing or invalid API key",
    404: "unknown model (or one the key may not see)",
    413: "body too large",
    415: "not JSON",
    429: "rate limit, quota or queue full (Retry-After)",
    500: "the generation failed",
    502: "the upstream's answer was refused",
    503: "no healthy deployment, or the state store is down",
    504: "server.request_timeout_s passed",
}
_ADMIN_ERRORS = {
    400: "bad input",
    401: "missing or invalid admin key",
    403: "the admin API is off",
    404: "no such key, tenant or canary",
    429: "too many failed admin key attempts",
}


def _errors(table: dict[int, str], envelope: type) -> dict[int, ResponseSpec]:
    return {
        status: ResponseSpec(data_container=envelope, description=why, generate_examples=False)
        for status, why in table.items()
    }


#: `responses=` of each family of routes: every error status it answers, in its envelope
OPENAI_ERRORS = _errors(_CLIENT_ERRORS, OpenAIError)
TENSOR_ERRORS = _errors(_CLIENT_ERRORS, PlainError)
ADMIN_ERRORS = _errors(_ADMIN_ERRORS, PlainError)

#: how a client presents its key (every client route but the probes)
KEYED: list[SecurityRequirement] = [{"bearer": []}, {"apiKey": []}]
SECURITY_SCHEMES: dict[str, SecurityScheme] = {
    "bearer": SecurityScheme(type="http", scheme="bearer"),
    "apiKey": SecurityScheme(type="apiKey", security_scheme_in="header", name="x-api-key"),
}

# --- success shapes of the routes that answer with bare ASGI responses -----------------------------


class Completion(msgspec.Struct):
    """An OpenAI completion or chat completion (with `stream: true`, Server-Sent Events of chunks)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, int] | None = None


class EmbeddingList(msgspec.Struct):
    """An OpenAI list of embeddings (float arrays, or base64 little-endian float32)."""

    object: str
    data: list[dict[str, Any]]
    model: str
    usage: dict[str, int]


class V2Tensor(msgspec.Struct):
    name: str
    datatype: str
    shape: list[int]
    data: list[Any] | None = None
    parameters: dict[str, Any] | None = None


class V2InferResponse(msgspec.Struct):
    """A v2 answer (with binary outputs: a JSON header of Inference-Header-Content-Length bytes,
    then the raw tensors)."""

    model_name: str
    outputs: list[V2Tensor]
    model_version: str | None = None
    id: str | None = None


class PredictResponse(msgspec.Struct):
    """TF Serving: `predictions` (row form) or `outputs` (columnar form)."""

    predictions: list[Any] | None = None
    outputs: Any = None


def answers(shape: type, errors: dict[int, ResponseSpec]) -> dict[int, ResponseSpec]:
    """`responses=` of a route whose success answer is `shape` and whose errors are `errors`."""
    return {200: ResponseSpec(data_container=shape, description="success", generate_examples=False), **errors}


# --- request bodies of the raw tensor routes ------------------------------------------------------


class PredictBody(msgspec.Struct):
    """TF Serving REST: exactly one of `instances` (row form) or `inputs` (columnar form)."""

    signature_name: str | None = None
    instances: list[Any] | None = None
    inputs: dict[str, Any] | list[Any] | None = None


def _inlined(struct: type) -> dict[str, Any]:
    """msgspec's JSON schema of `struct` with its nested Structs written in place: Litestar's
    registry holds only the types it saw in signatures, so references would point nowhere."""
    (root,), defs = msgspec.json.schema_components([struct], ref_template="{name}")

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return inline(root)


def _body(content: dict[str, Any]) -> RequestBody:
    return RequestBody(content={media: OpenAPIMediaType(schema=schema) for media, schema in content.items()}, required=True)


_INFER_BODY = _body(
    {
        "application/json": _inlined(InferRequestJSON),
        # the binary tensor extension: a JSON header of Inference-Header-Content-Length bytes, then raw tensors
        "application/octet-stream": {"type": "string", "format": "binary"},
    }
)
_PREDICT_BODY = _body({"application/json": _inlined(PredictBody)})


_UPLOAD_BODY = _body(
    {
        "multipart/form-data": {
            "type": "object",
            "required": ["file", "purpose"],
            "properties": {
                "file": {"type": "string", "format": "binary", "description": "JSONL, one request a line"},
                "purpose": {"type": "string", "enum": ["batch"]},
            },
        }
    }
)


@dataclass
class UploadOperation(Operation):
    """The operation of `POST /v1/files`, whose multipart body is streamed to disk as it arrives."""

    def __post_init__(self) -> None:
        self.request_body = _UPLOAD_BODY


@dataclass
class InferOperation(Operation):
    """The operation of a v2 `/infer` route: its body, read raw, documented from the decoder's Struct."""

    def __post_init__(self) -> None:
        self.request_body = _INFER_BODY


@dataclass
class PredictOperation(Operation):
    """The operation of a TF Serving `:predict` route, whose body is read raw."""

    def __post_init__(self) -> None:
        self.request_body = _PREDICT_BODY
