"""OpenAI `POST /v1/embeddings`, served by tensor deployments declared with `embedding:`.

`input` may be a string, a list of strings, token ids, or lists of token ids; `encoding_format`
`float` (JSON numbers) or `base64` (little-endian float32, as the OpenAI SDK decodes it);
`dimensions` keeps the first N components (scaled back to unit length when the deployment
normalizes; Matryoshka-style truncation, meaningful for models trained for it), checked against
the model's width before admission.
`usage.prompt_tokens` is what the call cost the tenant's token limits and quotas.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import numpy as np
from litestar import Response, post
from litestar.params import Body

from gateway.core.calls import Call, ModelRef
from gateway.core.results import EmbeddingsInput
from gateway.core.service import GatewayCore
from gateway.http.api_docs import KEYED, OPENAI_ERRORS, EmbeddingList, answers
from gateway.http.bodies import keyed_body
from gateway.http.requests import http_failure, json_response, protocol_opt
from gateway.wire.openai_schema import EmbeddingsBody, decode, embedding_inputs, embeddings_decoder
from router.planner import split_model_name


def _encoded(vector: np.ndarray, encoding: str) -> Any:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


@post(
    "/v1/embeddings",
    status_code=200,
    opt=protocol_opt("openai"),
    before_request=keyed_body,  # the key is checked first, then the body read under the deadline
    responses=answers(EmbeddingList, OPENAI_ERRORS),
    security=KEYED,
)
async def embeddings(
    core: GatewayCore,
    call: Call,
    data: Annotated[EmbeddingsBody, Body(title="Embeddings request", description="OpenAI's embeddings body")],
) -> Response[bytes]:
    async def given() -> EmbeddingsBody:
        return data

    return await embed_decoded(core, call, given)


async def embed(core: GatewayCore, call: Call, read: Callable[[], Awaitable[bytes]]) -> Response[bytes]:
    """Serve an embeddings call whose JSON body `read` returns (a batch job's line)."""

    async def decoded() -> EmbeddingsBody:
        return decode(await read(), embeddings_decoder)

    return await embed_decoded(core, call, decoded)


async def embed_decoded(
    core: GatewayCore, call: Call, body_of: Callable[[], Awaitable[EmbeddingsBody]]
) -> Response[bytes]:
    """Serve an embeddings call whose decoded body `body_of` returns, inside the core's load step."""

    async def load() -> EmbeddingsInput:
        body = await body_of()
        name, version, label = split_model_name(body.model)
        return EmbeddingsInput(ModelRef(name, version, label), embedding_inputs(body), body, body.dimensions)

    try:
        outcome = await core.serve_embeddings(call, load)
        body = outcome.body
        vectors = outcome.vectors
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        usage = {"prompt_tokens": outcome.tokens, "total_tokens": outcome.tokens}
        call.done(200)
        return json_response(
            {"object": "list", "data": data, "model": body.model, "usage": usage},
            headers=outcome.served.response_headers(call),
        )
    except Exception as exc:  # noqa: BLE001 - answered in the OpenAI envelope
        return http_failure(call, exc)


ROUTES = [embeddings]
