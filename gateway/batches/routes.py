"""The Batch API's HTTP routes, as the `openai` SDK calls them (`client.files`, `client.batches`).

Every route authenticates first (a missing or bad key is refused before a body is read) and works
on the caller's tenant only: another tenant's file or batch answers 404, exactly like one that does
not exist. Errors are answered in OpenAI's envelope.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import msgspec
from litestar import Request, Response, delete, get, params, post

from backends.errors import InvalidInput
from fleetgate.errors import GatewayError
from gateway.batches.book import Book
from gateway.batches.form import FRAMING_BYTES, Body, file_too_large, read_form
from gateway.batches.input import parse_input
from gateway.batches.objects import (
    ENDPOINTS,
    TERMINAL,
    BatchRecord,
    FileObject,
    RequestCounts,
    new_id,
    window_seconds,
)
from gateway.batches.service import BatchService
from gateway.core.calls import Call
from gateway.core.service import GatewayCore
from gateway.http.api_docs import OPENAI_ERRORS, UploadOperation
from gateway.http.bodies import keyed_body
from gateway.http.requests import ADMIN_BODY_LIMIT, answer_json, http_failure, protocol_opt

OPENAI = protocol_opt("openai")
MAX_PAGE = 100
MAX_METADATA = 16


class CreateBatch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    #: OpenAI's expiry of the output files: accepted, not applied (files stay until deleted)
    output_expires_after: dict[str, Any] | None = None


async def _read_by_a_running_job(service: BatchService, file_id: str) -> bool:
    for batch_id in await service.book.active():
        found = await service.book.load(batch_id)
        if found is not None and found[1].input_file_id == file_id:
            return True
    return False


def _service(request: Request) -> BatchService:
    return request.app.state.batches


def _page(request: Request) -> tuple[str | None, int]:
    """`after` and `limit` query parameters (limit 1..100, default 20)."""
    after = request.query_params.get("after") or None
    raw = request.query_params.get("limit", "20")
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidInput(f"limit must be an integer in 1..{MAX_PAGE}, got {raw[:20]!r}")
    return after, limit


def _listing(items: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


# --- files ----------------------------------------------------------------------------------------


def _declared_length(headers: dict[str, str]) -> int | None:
    declared = headers.get("content-length")
    if declared is None:
        return None
    try:
        return int(declared)
    except ValueError:
        raise GatewayError(400, "bad_content_length", "Content-Length is not a number") from None


async def _receive_upload(
    body: Body, service: BatchService, tenant: str, content_type: str, declared: int | None
) -> FileObject:
    """Stream the upload to disk, counting its bytes against the tenant's storage quota.

    What a declared length says the file needs at least is reserved before any byte is read (a
    tenant over its quota is refused at once, not after sending the body); the rest once the file's
    size is known. A refusal or failure gives the reservations back and removes the partial file.
    """
    quota, now = service.files.quota, service.clock()
    least = max(0, (declared or 0) - FRAMING_BYTES)
    leases = [(await quota.reserve(tenant, least, now, at_least=True), least)]
    upload = None
    try:
        upload = await asyncio.to_thread(service.files.begin_upload, service.config.max_lines)
        form = await read_form(
            body.receive, content_type, file_field="file", sink=upload,
            max_file_bytes=service.config.max_file_bytes,
        )  # fmt: skip
        purpose = form.fields.get("purpose")
        if purpose != "batch":
            raise InvalidInput(
                f"purpose must be `batch` (the only purpose this gateway stores), got {purpose!r}"
            )
        if form.filename is None:
            raise InvalidInput("the form has no `file` part")
        await asyncio.to_thread(upload.finish)  # the last line checked, the bytes on disk
        if form.file_bytes > least:
            extra = form.file_bytes - least
            leases.append((await quota.reserve(tenant, extra, service.clock(), whole=form.file_bytes), extra))
        obj = await service.files.store_upload(tenant, upload, form.filename[:256], form.file_bytes, now)
    except BaseException:
        if upload is not None:
            await asyncio.to_thread(upload.discard)
        for lease_id, size in leases:
            await quota.release(lease_id, tenant, size, service.clock())
        raise
    # the record is stored: the bytes stay counted (a crash before this refunds them, an undercount);
    # the first reservation is cut to the file's size where the framing was smaller than allowed for
    for n, (lease_id, _) in enumerate(leases):
        await quota.confirm(lease_id, tenant, min(0, form.file_bytes - least) if n == 0 else 0, now)
    return obj


@post("/v1/files", status_code=200, opt=OPENAI, responses=OPENAI_ERRORS, operation_class=UploadOperation)
async def upload_file(request: Request, core: GatewayCore, call: Call) -> Response[bytes]:
    body = Body(request.receive)

    async def work() -> tuple[Any, int]:
        principal = await core.identify(call)
        service = _service(request)
        content_type = call.headers.get("content-type", "")
        if not content_type.lower().startswith("multipart/form-data"):
            raise GatewayError(415, "unsupported_media_type", "send the file as multipart/form-data")
        try:
            declared = _declared_length(call.headers)
            if declared is not None and declared > service.config.max_file_bytes + FRAMING_BYTES:
                raise file_too_large(service.config.max_file_bytes)  # refused before a byte is read
            obj = await _receive_upload(body, service, principal.tenant, content_type, declared)
        except (GatewayError, InvalidInput):
            await body.drain()  # the client reads the refusal, not a reset
            raise
        return msgspec.to_builtins(obj), 200

    return await answer_json(call, work)


@get("/v1/files", opt=OPENAI, responses=OPENAI_ERRORS)
async def list_files(request: Request, core: GatewayCore, call: Call) -> Response[bytes]:
    async def work() -> tuple[Any, int]:
        principal = await core.identify(call)
        after, limit = _page(request)
        files = await _service(request).files.list(principal.tenant, after, limit + 1)
        return _listing([msgspec.to_builtins(f) for f in files], limit), 200

    return await answer_json(call, work)


@get("/v1/files/{file_id:str}", opt=OPENAI, responses=OPENAI_ERRORS)
async def get_file(request: Request, core: GatewayCore, call: Call, file_id: str) -> Response[bytes]:
    async def work() -> tuple[Any, int]:
        principal = await core.identify(call)
        return msgspec.to_builtins(await _service(request).files.get(principal.tenant, file_id)), 200

    return await answer_json(call, work)


@get("/v1/files/{file_id:str}/content", opt=OPENAI, responses=OPENAI_ERRORS)
async def file_content(request: Request, core: GatewayCore, call: Call, file_id: str) -> Response[bytes]:
    try:
        principal = await core.identify(call)
        data = await _service(request).files.content(principal.tenant, file_id)
    except Exception as exc:  # noqa: BLE001 - answered in OpenAI's envelope
        return http_failure(call, exc)
    call.done(200)
    return Response(content=data, status_code=200, media_type="application/jsonl")


@delete("/v1/files/{file_id:str}", status_code=200, opt=OPENAI, responses=OPENAI_ERRORS)
async def delete_file(request: Request, core: GatewayCore, call: Call, file_id: str) -> Response[bytes]:
    async def work() -> tuple[Any, int]:
        principal = await core.identify(call)
        service = _service(request)
        await service.files.get(principal.tenant, file_id)  # 404 first: never say whose job reads it
        if await _read_by_a_running_job(service, file_id):
            # a resumed job reads its input again: deleting it would lose lines already billed
            raise GatewayError(409, "file_in_use", "a batch that has not ended reads this file; cancel it first")
        await service.files.delete(principal.tenant, file_id, service.clock())  # frees its bytes
        return {"id": file_id, "object": "file", "deleted": True}, 200

    return await answer_json(call, work)


# --- batches --------------------------------------------------------------------------------------


async def _checked_input(service: BatchService, tenant: str, body: CreateBatch) -> int:
    """The number of requests of the job's input file, after checking it fits the job."""
    file = await service.files.get(tenant, body.input_file_id)
    if file.purpose != "batch":
        raise InvalidInput(f"file {body.input_file_id!r} has purpose {file.purpose!r}, not `batch`")
    data = await service.files.content(tenant, body.input_file_id)
    requests = await asyncio.to_thread(parse_input, data, service.config.max_lines)
    for r in requests:
        if r.url != body.endpoint:
            raise InvalidInput(
                f"request {r.custom_id[:64]!r} (line {r.index + 1} of the requests) calls {r.url}, "
                f"not the batch's endpoint {body.endpoint}"
            )
    return len(requests)


@post(
    "/v1/batches",
    status_code=200,
    opt=OPENAI,
    before_request=keyed_body,  # the key is checked first, then the body read under the deadline and decoded
    request_max_body_size=ADMIN_BODY_LIMIT,
    responses=OPENAI_ERRORS,
)
async def create_batch(
    request: Request,
    core: GatewayCore,
    call: Call,
    data: Annotated[CreateBatch, params.Body(title="Batch request")],
) -> Response[bytes]:
    async def work() -> tuple[Any, int]:
        principal = await core.identify(call)
        service = _service(request)
        body = data
        if body.endpoint not in ENDPOINTS:
            raise InvalidInput(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {body.endpoint[:64]!r}")
        window = window_seconds(body.completion_window)
        if window is None:
            raise InvalidInput(
                f"completion_window must be `24h` (or a shorter `<n>h`, `<n>m`, `<n>s`), got {body.completion_window[:16]!r}"
            )
        if body.metadata is not None and len(body.metadata) > MAX_METADATA:
            raise InvalidInput(f"metadata holds at most {MAX_METADATA} pairs")
        total = await _checked_input(service, principal.tenant, body)
        created = service.clock()
        now = int(created)
        record = BatchRecord(
            id=new_id("batch_"),
            endpoint=body.endpoint,
            input_file_id=body.input_file_id,
            completion_window=body.completion_window,
            status="validating",
            created_at=now,
            expires_at=now + window,
            request_counts=RequestCounts(total=total),
            metadata=body.metadata,
            owner_key=principal.key_id,
            owner_models=list(principal.models),
            created=created,
        )
        await service.book.create(principal.tenant, record)
        service.runner.wake()
        return record.public(), 200

    return await answer_json(call, work)


async def _view(book: Book, record: BatchRecord) -> dict[str, Any]:
    return record.public((await book.cancels()).get(record.id))


@get("/v1/batches/{batch_id:str}", opt=OPENAI, responses=OPENAI_ERRORS)
async def get_batch(request: Request, core: GatewayCore, call: Call, batch_id: str) -> Response[bytes]:
    async def work() -> tuple[Any, int]:
        principal = await core.identify(call)
        book = _service(request).book
        return await _view(book, await book.get(principal.tenant, batch_id)), 200

    return await answer_json(call, work)


@get("/v1/batches", opt=OPENAI, responses=OPENAI_ERRORS)
async def list_batches(request: Request, core: GatewayCore, call: Call) -> Response[bytes]:
    async def work() -> tuple[Any, int]:
        principal = await core.identify(call)
        after, limit = _page(request)
        book = _service(request).book
        cancels = await book.cancels()
        records = await book.list(principal.tenant, after, limit + 1)
        return _listing([r.public(cancels.get(r.id)) for r in records], limit), 200

    return await answer_json(call, work)


@post("/v1/batches/{batch_id:str}/cancel", status_code=200, opt=OPENAI, responses=OPENAI_ERRORS)
async def cancel_batch(request: Request, core: GatewayCore, call: Call, batch_id: str) -> Response[bytes]:
    async def work() -> tuple[Any, int]:
        principal = await core.identify(call)
        service = _service(request)
        record = await service.book.get(principal.tenant, batch_id)
        if record.status in TERMINAL and record.status != "cancelled":
            raise GatewayError(409, "batch_not_cancellable", f"the batch has already ended ({record.status})")
        if record.status != "cancelled":
            await service.book.request_cancel(batch_id, service.clock())
        return await _view(service.book, record), 200

    return await answer_json(call, work)


ROUTES = [
    upload_file,
    list_files,
    get_file,
    file_content,
    delete_file,
    create_batch,
    get_batch,
    list_batches,
    cancel_batch,
]
