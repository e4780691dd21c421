"""Conformance of the remote backend's HTTP client (aiohttp underneath) against scripted upstreams on
real loopback sockets: chunked bodies, keep-alive reuse and close, answers broken off or malformed,
timeouts, byte bounds; and the backend's mapping of those faults to gateway errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from backends.base import GenerateRequest, SamplingParams
from backends.errors import BackendTimeout, BackendUnavailable
from backends.remote import UpstreamTooLarge, create
from backends.remote.client import UpstreamClient, UpstreamTooLong, UpstreamUnreachable
from backends.spec import DeploymentSpec

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"

#: plays the upstream: (request number, request head, writer) -> keep the connection open?
Answer = Callable[[int, bytes, asyncio.StreamWriter], Awaitable[bool]]


class Upstream:
    """A loopback HTTP server that counts connections and requests; `answer` scripts each reply."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests = 0
        self.heads: list[bytes] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> Upstream:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in self._tasks:  # handlers still waiting on a connection the client kept open
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                self.requests += 1
                self.heads.append(head)
                if not await self.answer(self.requests, head, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass  # the test is over: end quietly, not as a cancelled task asyncio would log
        finally:
            self._tasks.discard(task)
            writer.close()


def _reply(data: bytes, keep: bool = True) -> Answer:
    async def answer(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(data)
        await writer.drain()
        return keep

    return answer


def _client(url: str, max_connections: int = 4) -> UpstreamClient:
    return UpstreamClient(url, {}, max_connections=max_connections, connect_timeout_s=2)


async def test_a_chunked_body_is_read_whole_and_as_lines() -> None:
    body = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab\ncd\r\n3\r\n\nef\r\n0\r\n\r\n"
    async with Upstream(_reply(body)) as up:
        client = _client(up.url)
        assert await (await client.request("GET", "/")).read(100) == b"ab\ncd\nef"
        assert [line async for line in (await client.request("GET", "/")).lines(100)] == ["ab", "cd", "ef"]
        assert up.connections == 1  # a chunked answer read to its end keeps its connection
        await client.aclose()


async def test_keep_alive_reuses_one_connection_and_sends_the_fixed_headers() -> None:
    async with Upstream(_reply(OK)) as up:
        client = UpstreamClient(up.url + "/prefix", {"Authorization": "Bearer k"}, 4, 2)
        for _ in range(5):
            assert await (await client.request("POST", "/x", b"{}")).read(100) == b"ok"
        assert (up.connections, up.requests, client.connections_opened) == (1, 5, 1)
        assert up.heads[0].startswith(b"POST /prefix/x HTTP/1.1\r\n")
        head = up.heads[0].lower()
        assert b"\r\nauthorization: bearer k\r\n" in head
        assert b"\r\naccept-encoding: identity\r\n" in head  # bounded bytes are the bytes read
        await client.aclose()


async def test_an_answer_with_connection_close_is_not_reused_and_nothing_is_sent_twice() -> None:
    closing = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"
    async with Upstream(_reply(closing, keep=False)) as up:
        client = _client(up.url)
        for _ in range(3):
            assert await (await client.request("POST", "/x", b"{}")).read(100) == b"ok"
        assert (up.connections, up.requests) == (3, 3)
        await client.aclose()


async def test_connections_the_upstream_closed_while_idle_are_replaced() -> None:
    async with Upstream(_reply(OK, keep=False)) as up:  # closes after every answer, no header says so
        client = _client(up.url)
        for _ in range(4):
            assert await (await client.request("POST", "/x", b"{}")).read(100) == b"ok"
            await asyncio.sleep(0.05)  # the upstream's close has arrived
        assert up.requests == 4
        await client.aclose()


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_a_kept_connection_closed_under_a_request_is_retried_only_when_idempotent(method: str) -> None:
    """The upstream takes the second request on a kept-alive connection and closes it unanswered (an
    idle close racing the request): a GET is sent once more on a fresh connection; a POST is never
    sent twice (the upstream may have acted on it) and is unreachable (a 503, fallbacks tried)."""

    async def answer(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        if n == 2:
            return False  # closed without a byte of an answer
        writer.write(OK)
        await writer.drain()
        return True

    async with Upstream(answer) as up:
        client = _client(up.url, max_connections=1)
        assert await (await client.request(method, "/", b"{}")).read(100) == b"ok"
        if method == "GET":
            assert await (await client.request(method, "/", b"{}")).read(100) == b"ok"
            assert (up.requests, up.connections) == (3, 2)
        else:
            with pytest.raises(UpstreamUnreachable):
                await client.request(method, "/", b"{}")
            assert up.requests == 2
            assert await (await client.request(method, "/", b"{}")).read(100) == b"ok"  # a fresh one
        await client.aclose()


async def test_an_answer_broken_off_mid_body_is_unreachable() -> None:
    short = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc"
    async with Upstream(_reply(short, keep=False)) as up:
        client = _client(up.url)
        response = await client.request("GET", "/")
        with pytest.raises(UpstreamUnreachable):
            await response.read(100)
        await client.aclose()


async def test_an_answer_broken_off_mid_head_is_unreachable_and_never_sent_again() -> None:
    async with Upstream(_reply(b"HTTP/1.1 200 O", keep=False)) as up:
        client = _client(up.url)
        with pytest.raises(UpstreamUnreachable):
            await client.request("POST", "/charge", b"{}")
        assert up.requests == 1
        await client.aclose()


@pytest.mark.parametrize(
    "reply",
    [
        b"HELLO\r\n\r\n",  # not a status line
        b"HTTP/1.1 OK\r\ncontent-length: 2\r\n\r\nok",  # no status code
        b"HTTP/1.1 200 OK\r\ncontent-length: abc\r\n\r\nok",  # not a number
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\nforged",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",  # bad chunk size
    ],
)
async def test_a_malformed_answer_is_unreachable(reply: bytes) -> None:
    async with Upstream(_reply(reply, keep=False)) as up:
        client = _client(up.url)
        with pytest.raises(UpstreamUnreachable):
            await (await client.request("GET", "/")).read(100)
        await client.aclose()


@pytest.mark.parametrize("same_segment", [False, True])
async def test_bytes_past_a_body_never_reach_the_next_caller_as_its_body(same_segment: bool) -> None:
    """An upstream that sends more than it declared: the next caller on that connection gets its own
    answer or UpstreamUnreachable (a 503, fallbacks tried), never the stray bytes as its body.

    Stray bytes arriving in the same segment as the answer make aiohttp's parser refuse that segment
    whole, so the answer they trail is refused too (UpstreamUnreachable, served around); arriving
    after it, the answer is delivered. (A stray *complete* answer would be taken as the next one:
    pooled clients trust the upstream's framing. The upstream answers every request anyway, so it
    gains nothing.)"""

    async def answer(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        if n == 1 and not same_segment:
            writer.write(OK)
            await writer.drain()
            await asyncio.sleep(0.05)  # the client has read the answer before the stray bytes come
            writer.write(b"forged")
        else:
            writer.write(OK + b"forged" if n == 1 else OK)
        await writer.drain()
        return True

    async with Upstream(answer) as up:
        client = _client(up.url, max_connections=1)
        try:
            first = await (await client.request("GET", "/")).read(100)
        except UpstreamUnreachable:
            assert same_segment
            first = b"ok"
        assert first == b"ok"
        await asyncio.sleep(0.1)
        try:
            second = await (await client.request("GET", "/")).read(100)
        except UpstreamUnreachable:
            second = b"ok"  # refused is fine too: a fault of the upstream, served around
        assert second == b"ok"
        assert await (await client.request("GET", "/")).read(100) == b"ok"  # the pool recovers
        await client.aclose()


async def test_refused_connections_are_unreachable() -> None:
    async with Upstream(_reply(OK)) as up:
        url = up.url
    await asyncio.sleep(0.05)  # the listener is closed: nothing accepts on the port now
    client = _client(url)
    with pytest.raises(UpstreamUnreachable):
        await client.request("GET", "/")
    await client.aclose()


async def test_an_upstream_that_does_not_answer_times_out() -> None:
    async def silent(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(5)
        return False

    async with Upstream(silent) as up:
        client = _client(up.url)
        with pytest.raises(TimeoutError):
            await client.request("GET", "/", timeout_s=0.2)
        await client.aclose()


async def test_a_stream_that_stalls_times_out_per_read() -> None:
    async def stalls(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\ndata:\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)
        return False

    async with Upstream(stalls) as up:
        client = _client(up.url)
        lines = (await client.request("GET", "/", timeout_s=0.2)).lines(100)
        assert await anext(lines) == "data:"
        with pytest.raises(TimeoutError):
            await anext(lines)
        await client.aclose()


async def test_stream_lines_arrive_before_the_answer_ends() -> None:
    first_seen = asyncio.Event()

    async def stream(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: a\n\n\r\n")
        await writer.drain()
        await asyncio.wait_for(first_seen.wait(), 5)  # the rest only once the client has the first
        writer.write(b"9\r\ndata: b\n\n\r\n0\r\n\r\n")
        await writer.drain()
        return True

    async with Upstream(stream) as up:
        client = _client(up.url)
        seen = []
        async for line in (await client.request("GET", "/", timeout_s=2)).lines(100):
            seen.append(line)
            if line == "data: a":
                first_seen.set()
        assert seen == ["data: a", "", "data: b", ""]
        await client.aclose()


async def test_a_body_over_the_cap_is_refused_at_the_bound_not_buffered() -> None:
    async def huge(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"%x\r\n" % (50 << 20))
        for _ in range(50 * 16):
            writer.write(b"x" * 65536)
            await writer.drain()
        return False

    async with Upstream(huge) as up:
        client = _client(up.url)
        response = await client.request("GET", "/")
        with pytest.raises(UpstreamTooLong):
            await response.read(1 << 20)
        with pytest.raises(UpstreamTooLong):
            await anext((await client.request("GET", "/")).lines(1 << 20))  # a line without end
        await client.aclose()


async def test_cookies_an_upstream_sets_are_never_sent_on() -> None:
    cookie = b"HTTP/1.1 200 OK\r\nset-cookie: session=tenant-a; Path=/\r\ncontent-length: 2\r\n\r\nok"
    async with Upstream(_reply(cookie)) as up:
        client = _client(up.url)
        for _ in range(2):
            await (await client.request("GET", "/")).read(100)
        assert b"cookie" not in up.heads[1].lower()
        await client.aclose()


# --- the backend's mapping of those faults ---------------------------------------------------------


async def _generate(
    url: str, options: dict[str, int] | None = None, timeout_s: float = 2, stream: bool = False
) -> list[str]:
    spec = DeploymentSpec(
        backend="remote", url=url, protocol="openai", timeout_s=timeout_s, options=options or {}
    )
    backend = create("up", spec)
    await backend.load()
    try:
        request = GenerateRequest(request_id="r", prompt="hi", sampling=SamplingParams(max_tokens=2), stream=stream)
        return [event.text async for event in backend.generate(request)]
    finally:
        await backend.close()


async def test_backend_maps_a_malformed_answer_to_unavailable() -> None:
    async with Upstream(_reply(b"HELLO\r\n\r\n", keep=False)) as up:
        with pytest.raises(BackendUnavailable):
            await _generate(up.url)


async def test_backend_maps_a_silent_upstream_to_its_deadline() -> None:
    async def silent(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(5)
        return False

    async with Upstream(silent) as up:
        with pytest.raises(BackendTimeout):
            await _generate(up.url, timeout_s=0.2)


def _head_then_silence(status: bytes) -> Answer:
    """An answer whose head comes at once and whose promised body never does."""

    async def answer(n: int, head: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: 50\r\n\r\n{")
        await writer.drain()
        await asyncio.sleep(5)
        return False

    return answer


@pytest.mark.parametrize(("status", "stream"), [(b"200 OK", False), (b"500 Internal Server Error", True)])
async def test_a_body_that_stalls_after_its_head_times_out_at_the_deployments_timeout(status: bytes, stream: bool) -> None:
    """The backend's own timers bound every wait on the upstream (no per-read timer of aiohttp's on
    top): a whole answer's body, and a stream's error body, that stop coming are the deployment's
    timeout (504, fallbacks), not a wait until the request's own deadline."""
    async with Upstream(_head_then_silence(status)) as up:
        started = time.perf_counter()
        with pytest.raises(BackendTimeout):
            await _generate(up.url, timeout_s=0.3, stream=stream)
        assert time.perf_counter() - started < 2


async def test_backend_maps_a_body_over_the_cap_to_too_large() -> None:
    big = b"HTTP/1.1 200 OK\r\ncontent-length: 5000\r\n\r\n" + b"x" * 5000
    async with Upstream(_reply(big)) as up:
        with pytest.raises(UpstreamTooLarge):
            await _generate(up.url, options={"max_response_bytes": 1000})


async def test_a_failed_load_closes_its_connections() -> None:
    """A v2 upstream whose metadata answer is an error: the load fails (and is retried later with a
    new client), and the kept-alive connection of the failed one is closed, not left to the GC."""
    error = b'HTTP/1.1 500 Internal Server Error\r\ncontent-length: 2\r\n\r\n{}'
    async with Upstream(_reply(error)) as up:
        spec = DeploymentSpec(backend="remote", url=up.url, protocol="kserve_v2", timeout_s=2)
        backend = create("up", spec)
        with pytest.raises(BackendUnavailable):
            await backend.load()
        for _ in range(100):  # the upstream sees the connection end
            if not up._tasks:
                break
            await asyncio.sleep(0.01)
        assert up.requests == 1 and not up._tasks
        await backend.close()
