"""The floor under issue 14's targets: fleetgate's HTTP server stack with none of fleetgate behind it.

Each app here is a plain ASGI app served by uvicorn with httptools and uvloop, the server fleetgate
runs, and does only the work no gateway can skip. No framework routing, no keys, limits, quotas,
queue, routing, metrics or logs. What these servers reach is the most any gateway built on this stack
can reach on this machine; a target beyond them is beyond the stack, not beyond fleetgate's code.

  proxy    POST any path: reads the body and forwards it to `--upstream` with a pooled keep-alive
           `aiohttp.ClientSession` (the client the remote backend uses), answering the upstream's status,
           content type and body. The floor for "proxying adds <= 0.3 ms p50 at c=1".
  tensors  POST any path: decodes a v2 JSON infer body (one FP32 tensor) with msgspec straight into
           numpy, runs ONNX Runtime on a worker thread, gathering the requests that arrive while a run
           is in flight into the next run (up to 64 rows, no waiting: a lone request runs at once),
           and answers a v2 JSON body. The floor for a batching tensor server's requests/s.
           With `--inline`, every run is on the event loop's thread instead (no thread hand-off, no
           gathering): the floor for one caller's p50.

Run: `python -m bench.floor_servers proxy --port P --upstream http://127.0.0.1:U`
     `python -m bench.floor_servers tensors --port P --model [NAME=]model.onnx ... [--inline]
         [--threads T] [--workers N]`: with several models, `/v2/models/NAME/...` picks one; with one,
         any path reaches it. `--threads`: ONNX Runtime's intra-op threads (0: its default).
Each answers GET /ready with 200 once it can serve. Benches start them with `start(...)`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from bench.servers import ROOT, free_port, stop, wait_ready

MAX_ROWS = 64
MODEL_ENV = "FLEETGATE_FLOOR_MODEL"  # how `--workers` processes find the model (uvicorn imports the app)
UPSTREAM_ENV = "FLEETGATE_FLOOR_UPSTREAM"
INLINE_ENV = "FLEETGATE_FLOOR_INLINE"
THREADS_ENV = "FLEETGATE_FLOOR_THREADS"


class V2Tensor(msgspec.Struct):
    name: str
    shape: list[int]
    datatype: str
    data: list[float]


class V2Request(msgspec.Struct):
    inputs: list[V2Tensor]


_decode_v2 = msgspec.json.Decoder(V2Request).decode
_encode = msgspec.json.Encoder().encode


async def _read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _answer(send: Any, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Any, send: Any, start: Any, stop: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await start()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await stop()
            await send({"type": "lifespan.shutdown.complete"})
            return


# --- proxy -------------------------------------------------------------------------------------------


def proxy_app() -> Any:
    """The bare proxy: body in, the same body to the upstream, its answer back (with the same client
    as the remote backend, backends/remote/client.py, so the floor moves when that client does)."""
    import aiohttp

    state: dict[str, Any] = {}

    async def start() -> None:
        connector = aiohttp.TCPConnector(limit=256, keepalive_timeout=4.0)
        state["base"] = os.environ[UPSTREAM_ENV].rstrip("/")
        state["client"] = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None, connect=5.0), auto_decompress=False
        )

    async def stop() -> None:
        await state["client"].close()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send, start, stop)
        if scope["method"] == "GET":
            return await _answer(send, 200, b"{}")
        body = await _read_body(receive)
        url = state["base"] + scope["path"]
        async with state["client"].post(url, data=body, headers={"content-type": "application/json"}) as answer:
            content = await answer.read()
            kind = answer.headers.get("content-type", "application/json").encode("latin-1")
            await _answer(send, answer.status, content, kind)

    return app


# --- tensors -----------------------------------------------------------------------------------------


class Gather:
    """Runs requests on ONNX Runtime, one run at a time; rows that arrive during a run share the next."""

    def __init__(self, model: str, inline: bool, threads: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        self.input = self.session.get_inputs()[0].name
        self.pool = ThreadPoolExecutor(1)
        self.waiting: list[tuple[np.ndarray, asyncio.Future[np.ndarray]]] = []
        self.running = False
        self.inline = inline

    async def infer(self, rows: np.ndarray) -> np.ndarray:
        if self.inline:
            return self.session.run(None, {self.input: rows})[0]
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((rows, future))
        if not self.running:
            self.running = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self.waiting:
                taken, count = [], 0
                while self.waiting and count + len(self.waiting[0][0]) <= MAX_ROWS:
                    item = self.waiting.pop(0)
                    taken.append(item)
                    count += len(item[0])
                if not taken:  # one request over MAX_ROWS: runs alone
                    taken.append(self.waiting.pop(0))
                batch = taken[0][0] if len(taken) == 1 else np.concatenate([x for x, _ in taken])
                try:
                    out = await loop.run_in_executor(self.pool, self.session.run, None, {self.input: batch})
                except Exception as exc:  # noqa: BLE001 - each caller of the run gets the error
                    for _, future in taken:
                        future.set_exception(exc)
                    continue
                start = 0
                for rows, future in taken:
                    future.set_result(out[0][start : start + len(rows)])
                    start += len(rows)
        finally:
            self.running = False


def tensors_app() -> Any:
    """The bare batching tensor server: v2 JSON in, ONNX Runtime, v2 JSON out."""
    models: dict[str, Gather] = {}

    async def start() -> None:
        inline, threads = os.environ.get(INLINE_ENV) == "1", int(os.environ.get(THREADS_ENV, "0"))
        for entry in os.environ[MODEL_ENV].split(os.pathsep):
            name, _, path = entry.rpartition("=")
            models[name or "mlp"] = Gather(path, inline, threads)

    async def stop() -> None:
        for gather in models.values():
            gather.pool.shutdown()

    def model_of(path: str) -> Gather:
        if len(models) == 1:
            return next(iter(models.values()))
        return models[path.split("/")[3]]  # /v2/models/NAME/infer

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send, start, stop)
        if scope["method"] == "GET":
            return await _answer(send, 200, b"{}")
        try:
            tensor = _decode_v2(await _read_body(receive)).inputs[0]
            rows = np.asarray(tensor.data, np.float32).reshape(tensor.shape)
        except (msgspec.ValidationError, msgspec.DecodeError, IndexError, ValueError) as exc:
            return await _answer(send, 400, _encode({"error": str(exc)}))
        out = await model_of(scope["path"]).infer(rows)
        body = {
            "model_name": "mlp",
            "outputs": [
                {"name": "output", "datatype": "FP32", "shape": list(out.shape), "data": out.ravel().tolist()}
            ],
        }
        await _answer(send, 200, _encode(body))

    return app


def start(args: list[str], log: Path, stack: ExitStack) -> tuple[int, int]:
    """Start this script (`args`: the kind and its flags, no port) on a free loopback port, its
    output in `log`, and wait until it answers GET /ready; `stack` stops it (and its uvicorn
    workers) when it closes. Returns the port and the process id."""
    port = free_port()
    cmd = [sys.executable, "-m", "bench.floor_servers", *args, "--port", str(port)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("wb"), start_new_session=True
    )
    stack.callback(stop, proc)  # the whole process group
    wait_ready(proc, f"http://127.0.0.1:{port}/ready", log)
    return port, proc.pid


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("kind", choices=("proxy", "tensors"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", help="proxy: the upstream's base URL")
    parser.add_argument("--model", action="append", default=[], help="tensors: [NAME=]model.onnx")
    parser.add_argument("--threads", type=int, default=0, help="tensors: ONNX Runtime intra-op threads")
    parser.add_argument("--inline", action="store_true", help="tensors: every run on the loop's thread")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    if args.kind == "proxy":
        os.environ[UPSTREAM_ENV] = args.upstream
    else:
        os.environ[MODEL_ENV] = os.pathsep.join(args.model)
        os.environ[THREADS_ENV] = str(args.threads)
        os.environ[INLINE_ENV] = "1" if args.inline else "0"
    import uvicorn

    uvicorn.run(
        f"bench.floor_servers:{args.kind}_app",
        factory=True,
        app_dir=str(ROOT),
        host="127.0.0.1",
        port=args.port,
        workers=args.workers,
        http="httptools",
        loop="uvloop",
        log_level="warning",
        access_log=False,
        lifespan="on",
    )


if __name__ == "__main__":
    main()
