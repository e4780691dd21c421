"""The remote backend's HTTP/1.1 client against upstreams that misbehave (real sockets, scripted servers)."""

from __future__ import annotations

import asyncio

import pytest

from backends.upstream_http import UpstreamPool, UpstreamTooLong, UpstreamUnreachable

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


async def _server(answer):  # type: ignore[no-untyped-def]
    """A loopback server; `answer(request_number, reader, writer)` plays the upstream."""
    count = {"n": 0, "requests": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                count["requests"] += 1
                if not await answer(count["requests"], writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], count


async def test_connections_the_upstream_closed_while_idle_are_replaced() -> None:
    async def answer(n, writer):  # type: ignore[no-untyped-def]
        writer.write(OK)
        await writer.drain()
        return False  # then close: every pooled connection goes stale

    server, port, count = await _server(answer)
    pool = UpstreamPool(f"http://127.0.0.1:{port}", {}, max_connections=4, connect_timeout_s=2)
    responses = await asyncio.gather(*(pool.request("GET", "/") for _ in range(4)))
    assert [await r.read(100) for r in responses] == [b"ok"] * 4
    await asyncio.sleep(0.1)  # the upstream has closed all four
    for _ in range(6):
        r = await pool.request("POST", "/x", b"{}")
        assert await r.read(100) == b"ok"
    assert count["requests"] == 10  # nothing sent twice
    await pool.aclose()
    server.close()


async def test_a_request_the_upstream_began_answering_is_never_sent_again() -> None:
    async def answer(n, writer):  # type: ignore[no-untyped-def]
        if n == 1:
            writer.write(OK)
            await writer.drain()
            return True
        writer.write(b"HTTP/1.1 200 O")  # then dies mid-answer
        await writer.drain()
        return False

    server, port, count = await _server(answer)
    pool = UpstreamPool(f"http://127.0.0.1:{port}", {}, max_connections=1, connect_timeout_s=2)
    assert await (await pool.request("POST", "/charge")).read(100) == b"ok"
    with pytest.raises(UpstreamUnreachable):
        await pool.request("POST", "/charge", b"{}")
    assert count["requests"] == 2
    await pool.aclose()
    server.close()


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokforged",  # more than it declared
        b"HTTP/1.1 200 OK\r\ncontent-length: abc\r\n\r\nok",  # not a number
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\nforged",
    ],
)
async def test_bytes_past_a_body_never_reach_the_next_caller(reply: bytes) -> None:
    async def answer(n, writer):  # type: ignore[no-untyped-def]
        writer.write(reply if n == 1 else OK)
        await writer.drain()
        return True

    server, port, _ = await _server(answer)
    pool = UpstreamPool(f"http://127.0.0.1:{port}", {}, max_connections=1, connect_timeout_s=2)
    try:
        first = await pool.request("GET", "/")
        await first.read(100)
    except UpstreamUnreachable:
        pass  # a malformed Content-Length is refused outright
    second = await pool.request("GET", "/")
    assert await second.read(100) == b"ok"
    await pool.aclose()
    server.close()


async def test_a_huge_chunk_is_refused_at_the_bound_not_buffered() -> None:
    async def answer(n, writer):  # type: ignore[no-untyped-def]
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"%x\r\n" % (50 << 20))
        for _ in range(50 * 16):
            writer.write(b"x" * 65536)
            await writer.drain()
        return False

    server, port, _ = await _server(answer)
    pool = UpstreamPool(f"http://127.0.0.1:{port}", {}, max_connections=1, connect_timeout_s=2)
    response = await pool.request("GET", "/")
    with pytest.raises(UpstreamTooLong):
        await response.read(1 << 20)
    await pool.aclose()
    server.close()
