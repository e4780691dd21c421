"""One line of a batch job through the gateway's core, exactly as its endpoint serves a client.

The line's body goes to the same protocol function as an HTTP request to its `url` (decode, then
`GatewayCore`: plan, admit, queue, attempt with fallbacks, settle, record), with a `Call` that the
gateway makes itself: it carries the job's principal instead of a credential, and that principal
marks the call as background work (the fair queue's background class, no per-minute limits, and its
settlement held for the job to commit with the line's record). The answer is the JSON body and status
a client would have received, errors in OpenAI's envelope included.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.batches.input import Request
from gateway.core.calls import Call
from gateway.core.service import GatewayCore
from gateway.http.openai import generate
from gateway.http.openai_embeddings import embed
from policies.principal import Principal


class LineAnswer(msgspec.Struct, frozen=True):
    """What the endpoint answered: HTTP status, JSON body, and the gateway's request id."""

    status: int
    body: Any
    request_id: str

    @property
    def transient(self) -> bool:
        """A refusal that says "not now" rather than "not this request" (a full queue, no healthy
        deployment, a timeout, a draining gateway): the line is tried again later. A spent quota or
        budget is final: it is the tenant's bill, and waiting for the next period is not the job's call."""
        if self.status == 429:
            error = self.body.get("error") if isinstance(self.body, dict) else None
            return not (isinstance(error, dict) and error.get("code") in ("quota_exceeded", "budget_exceeded"))
        return self.status in (503, 504)


async def run_line(core: GatewayCore, principal: Principal, request: Request) -> LineAnswer:
    """Serve one request of a batch as `principal` (whose `background` holds its settlement)."""
    call = Call("openai", {})
    call.principal = principal

    async def read() -> bytes:
        return request.body

    if request.url == "/v1/embeddings":
        response = await embed(core, call, read)
    else:
        response = await generate(core, call, request.url == "/v1/chat/completions", read)
    content = response.content
    body = msgspec.json.decode(content) if isinstance(content, bytes | bytearray) and content else None
    return LineAnswer(response.status_code, body, call.request_id)
