"""Hostile clients against the embeddings, batch and gRPC surfaces, with a loop-stall probe.

The sibling of bench/fuzz_gateway.py (schema-driven cases): here each case is one hand-written
hostile client from issue 40. The gateway runs as a real `fleetgate serve` in a subprocess (its
own httptools server, connection caps and GIL, so the client's work here cannot pass for a server
stall), with a tiny random BERT encoder (embeddings), the ONNX Runtime digits model (gRPC) and
batch files on disk. While each case runs, a thread sends GET /health/live every 50 ms and keeps
the worst latency. Per case: the HTTP statuses and gRPC codes seen, every 5xx and gRPC
INTERNAL/UNKNOWN, the worst liveness latency, and whether the process answers afterwards.

Writes bench/results/fuzz_hostile.json with a summary {cases, any_5xx, max_stall_ms, alive}.
Run: `.venv/bin/python -m bench.fuzz_hostile [--quick]` (--quick: 20 MiB / 4 x 5 MiB uploads,
300 idle sockets).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
ADMIN_KEY = "fuzz-hostile-admin-key-0123456789"
MIB = 1024 * 1024
#: the client connection preface and an empty SETTINGS frame (RFC 9113 section 3.4)
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
BOUNDARY = "fuzzhostileboundary7b1c"


@dataclass
class Target:
    url: str
    grpc: str
    key: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@dataclass
class Sizes:
    upload_bytes: int
    concurrent_upload_bytes: int
    idle_sockets: int


@dataclass
class Record:
    """What one case saw: HTTP statuses, gRPC codes, and every answer that counts as a server error."""

    statuses: Counter[str] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def http(self, label: str, response: httpx.Response) -> None:
        self.statuses[f"http {response.status_code}"] += 1
        if response.status_code >= 500 or "Traceback" in response.text:
            self.server_errors.append(f"{label}: {response.status_code} {response.text[:200]}")

    def grpc(self, label: str, code: str, details: str = "") -> None:
        code = code.removeprefix("StatusCode.")
        self.statuses[f"grpc {code}"] += 1
        if code in ("INTERNAL", "UNKNOWN"):
            self.server_errors.append(f"{label}: {code} {details[:200]}")


class StallProbe:
    """GET /health/live every 50 ms on its own thread and connection; keeps the worst latency."""

    def __init__(self, url: str) -> None:
        self._url = f"{url}/health/live"
        self._stop = threading.Event()
        self.worst_ms = 0.0
        self.failures: Counter[str] = Counter()
        self._thread = threading.Thread(target=self._run, name="stall-probe", daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    status = client.get(self._url).status_code
                    if status != 200:
                        self.failures[str(status)] += 1
                except httpx.HTTPError as exc:
                    self.failures[type(exc).__name__] += 1
                self.worst_ms = max(self.worst_ms, (time.perf_counter() - started) * 1000)
                self._stop.wait(0.05)

    def __enter__(self) -> StallProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


# --- embeddings ----------------------------------------------------------------------------------


def _embed(t: Target, rec: Record, label: str, body: dict) -> None:
    try:
        rec.http(label, httpx.post(f"{t.url}/v1/embeddings", json=body, headers=t.auth, timeout=120))
    except httpx.HTTPError as exc:
        rec.notes.append(f"{label}: {type(exc).__name__}")


def embeddings_huge_string(t: Target, s: Sizes, rec: Record) -> None:
    _embed(t, rec, "15 MiB string", {"model": "mini-embed", "input": ("word " * (3 * MIB))[: 15 * MIB]})


def embeddings_too_many_inputs(t: Target, s: Sizes, rec: Record) -> None:
    _embed(t, rec, "2049 inputs", {"model": "mini-embed", "input": ["hello"] * 2049})


def embeddings_many_long_inputs(t: Target, s: Sizes, rec: Record) -> None:
    text = ("lorem ipsum " * 700)[: 7 * 1024]
    _embed(t, rec, "2048 x 7 KiB", {"model": "mini-embed", "input": [text] * 2048})


def embeddings_huge_token_ids(t: Target, s: Sizes, rec: Record) -> None:
    for ids in ([2**31], [2**63 - 1], [10**30], [-1], [[5, 2**40], [7]], [0] * 100_000):
        _embed(t, rec, f"token ids {str(ids)[:40]}", {"model": "mini-embed", "input": ids})


def embeddings_negative_dimensions(t: Target, s: Sizes, rec: Record) -> None:
    for dims in (-1, 0, -(2**63), 2**64, 10**6):
        _embed(t, rec, f"dimensions {dims}", {"model": "mini-embed", "input": "hi", "dimensions": dims})


# --- batches -------------------------------------------------------------------------------------


def _multipart(size: int, chunk: int = MIB) -> Iterator[bytes]:
    """A files.create body carrying `size` bytes of JSONL, made chunk by chunk (never held whole)."""
    yield (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    line = json.dumps(
        {"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {"model": "mini-embed", "input": "hi"}}
    ).encode() + b"\n"
    block = line * (chunk // len(line))
    sent = 0
    while sent < size:
        piece = block[: size - sent]
        sent += len(piece)
        yield piece
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


def _upload(t: Target, rec: Record, label: str, content: Iterator[bytes] | bytes, content_type: str) -> str | None:
    headers = {**t.auth, "Content-Type": content_type}
    try:
        response = httpx.post(f"{t.url}/v1/files", content=content, headers=headers, timeout=300)
    except httpx.HTTPError as exc:  # a 413 sent early may reset the rest of a streamed body
        rec.notes.append(f"{label}: {type(exc).__name__}")
        return None
    rec.http(label, response)
    return response.json().get("id") if response.status_code == 200 else None


def batches_streamed_upload(t: Target, s: Sizes, rec: Record) -> None:
    kind = f"multipart/form-data; boundary={BOUNDARY}"
    _upload(t, rec, f"{s.upload_bytes // MIB} MiB upload", _multipart(s.upload_bytes), kind)


def batches_concurrent_uploads(t: Target, s: Sizes, rec: Record) -> None:
    kind = f"multipart/form-data; boundary={BOUNDARY}"
    with ThreadPoolExecutor(4) as pool:
        for n in range(4):
            pool.submit(_upload, t, rec, f"concurrent {n}", _multipart(s.concurrent_upload_bytes), kind)


def batches_malformed_multipart(t: Target, s: Sizes, rec: Record) -> None:
    good = f"multipart/form-data; boundary={BOUNDARY}"
    bodies: dict[str, tuple[bytes, str]] = {
        "no closing boundary": (b"".join(_multipart(1024))[: -len(BOUNDARY) - 8], good),
        "wrong boundary": (b"".join(_multipart(1024)), "multipart/form-data; boundary=other"),
        "no boundary parameter": (b"".join(_multipart(1024)), "multipart/form-data"),
        "garbage": (os.urandom(64 * 1024), good),
        "headers never end": (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=".encode() + b"x" * 70_000, good),
        "no file part": (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{BOUNDARY}--\r\n'.encode(), good),
        "empty": (b"", good),
    }
    for label, (body, kind) in bodies.items():
        _upload(t, rec, label, body, kind)


def batches_invalid_jsonl(t: Target, s: Sizes, rec: Record) -> None:
    lines = [b"not json", b"{}", b'{"custom_id": 1}', b"\xff\xfe\x00", b"[1,2,3]", b'{"custom_id": "a", "url": "/etc"}', b"x" * 200_000]
    body = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="bad.jsonl"\r\n\r\n'
    ).encode() + b"\n".join(lines) + f"\r\n--{BOUNDARY}--\r\n".encode()
    file_id = _upload(t, rec, "invalid jsonl upload", body, f"multipart/form-data; boundary={BOUNDARY}")
    if file_id is None:
        return
    create = {"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"}
    response = httpx.post(f"{t.url}/v1/batches", json=create, headers=t.auth, timeout=30)
    rec.http("batch of invalid lines", response)
    if response.status_code != 200:
        return
    batch_id, deadline = response.json()["id"], time.monotonic() + 10
    while time.monotonic() < deadline:  # the job itself must fail cleanly, not crash a worker
        answer = httpx.get(f"{t.url}/v1/batches/{batch_id}", headers=t.auth, timeout=30)
        rec.http("batch status", answer)
        state = answer.json().get("status") if answer.status_code == 200 else None
        if state in ("failed", "completed", "cancelled", "expired"):
            rec.notes.append(f"batch ended {state}")
            return
        time.sleep(0.5)
    rec.notes.append("batch still running after 10 s")


# --- gRPC ----------------------------------------------------------------------------------------


def _infer(t: Target, rec: Record, label: str, request: object) -> None:
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    with grpc.insecure_channel(t.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            stub.ModelInfer(request, metadata=(("authorization", f"Bearer {t.key}"),), timeout=60)
            rec.grpc(label, "OK")
        except grpc.RpcError as exc:
            rec.grpc(label, exc.code().name, exc.details() or "")


def _request(shape: list[int], raw: bytes | None = None) -> object:
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name="digits")
    request.inputs.add(name="input", datatype="FP32", shape=shape)
    if raw is not None:
        request.raw_input_contents.append(raw)
    return request


def grpc_non_finite(t: Target, s: Sizes, rec: Record) -> None:
    import tritonclient.grpc as triton_grpc
    from tritonclient.utils import InferenceServerException

    client = triton_grpc.InferenceServerClient(t.grpc)
    for bad in (np.nan, np.inf, -np.inf):
        x = np.full((2, 64), 0.5, np.float32)
        x[1, 5] = bad
        inp = triton_grpc.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)  # raw_input_contents
        try:
            client.infer("digits", [inp], headers={"authorization": f"Bearer {t.key}"})
            rec.grpc(f"raw {bad}", "OK")
        except InferenceServerException as exc:
            rec.grpc(f"raw {bad}", str(exc.status()), exc.message() or "")
        typed = _request([1, 64])
        typed.inputs[0].contents.fp32_contents.extend([0.5] * 63 + [float(bad)])  # type: ignore[attr-defined]
        _infer(t, rec, f"typed {bad}", typed)


def grpc_huge_shape(t: Target, s: Sizes, rec: Record) -> None:
    for shape in ([2**20, 2**20], [2**40, 1], [2**40, 64], [-1, 64], [2**62, 2**62]):
        _infer(t, rec, f"shape {shape} raw", _request(shape, raw=b"\0" * 256))
        _infer(t, rec, f"shape {shape} no data", _request(shape))


def grpc_idle_sockets(t: Target, s: Sizes, rec: Record) -> None:
    host, port = t.grpc.rsplit(":", 1)
    held: list[socket.socket] = []
    try:
        for _ in range(s.idle_sockets):
            try:
                held.append(socket.create_connection((host, int(port)), timeout=5))
            except OSError as exc:
                rec.statuses[f"connect {type(exc).__name__}"] += 1
        rec.notes.append(f"{len(held)} of {s.idle_sockets} idle connections opened")
        time.sleep(3)  # left silent while the probe runs; then a real client must still get through
        _infer(t, rec, "call while flooded", _request([1, 64], raw=np.zeros(64, np.float32).tobytes()))
    finally:
        for sock in held:
            sock.close()


def grpc_garbage_preface(t: Target, s: Sizes, rec: Record) -> None:
    host, port = t.grpc.rsplit(":", 1)
    sends = {
        "http/1.1": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        "random": os.urandom(4096),
        "half preface": PREFACE[:12],
        "preface then garbage frame": PREFACE + b"\xff" * 64,
        "bad preface": b"PRI * HTTP/9.9\r\n\r\nXX\r\n\r\n" + b"\x00" * 9,
    }
    for label, data in sends.items():
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(data)
            sock.settimeout(15)  # a half preface waits for the handshake deadline
            try:
                first = sock.recv(64)
                rec.statuses["preface closed" if not first else "preface answered"] += 1
            except (TimeoutError, OSError) as exc:
                rec.statuses[f"preface {type(exc).__name__}"] += 1
                rec.notes.append(f"{label}: {type(exc).__name__}")
    _infer(t, rec, "call after garbage", _request([1, 64], raw=np.zeros(64, np.float32).tobytes()))


CASES: list[Callable[[Target, Sizes, Record], None]] = [
    embeddings_huge_string,
    embeddings_too_many_inputs,
    embeddings_many_long_inputs,
    embeddings_huge_token_ids,
    embeddings_negative_dimensions,
    batches_streamed_upload,
    batches_concurrent_uploads,
    batches_malformed_multipart,
    batches_invalid_jsonl,
    grpc_non_finite,
    grpc_huge_shape,
    grpc_idle_sockets,
    grpc_garbage_preface,
]


# --- the served gateway --------------------------------------------------------------------------


def _config(tmp: Path, http_port: int, grpc_port: int) -> Path:
    from backends.demo_models.digits import write_digits
    from backends.demo_models.encoder import write_tiny_encoder

    digits, encoder = write_digits(tmp / "digits"), write_tiny_encoder(tmp / "encoder")
    embedding = f"embedding: {{tokenizer: {encoder.tokenizer_dir}, pooling: mean, normalize: true, max_length: 64}}"
    path = tmp / "gateway.yaml"
    path.write_text(f"""
server: {{port: {http_port}, grpc_port: {grpc_port}, log_level: warning}}
state: {{url: "memory://"}}
batches: {{files_dir: "{tmp / 'files'}", poll_interval_s: 0.2}}
tenants: {{fuzz: {{limits: {{requests_per_minute: 1000000}}}}}}
deployments:
  enc: {{backend: onnxruntime, model: {encoder.onnx_path}, batching: {{max_batch_size: 64, max_delay_ms: 2}}, {embedding}}}
  digits: {{backend: onnxruntime, model: {digits.onnx_path}}}
models:
  mini-embed: {{routes: [{{deployment: enc}}]}}
  digits: {{routes: [{{deployment: digits}}]}}
""")
    return path


def _alive(t: Target, server: subprocess.Popen[bytes]) -> bool:
    if server.poll() is not None:
        return False
    try:
        return httpx.get(f"{t.url}/health/live", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller uploads and fewer idle sockets")
    args = parser.parse_args()
    sizes = Sizes(20 * MIB, 5 * MIB, 300) if args.quick else Sizes(300 * MIB, 50 * MIB, 3000)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # 3,000 sockets; the server inherits it too
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    from tests.servers import free_port

    tmp = Path(tempfile.mkdtemp())
    http_port, grpc_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "FLEETGATE_GRPC_PORT"} | {"FLEETGATE_ADMIN_KEY": ADMIN_KEY}
    log = (tmp / "serve.log").open("wb")
    command = [sys.executable, "-m", "gateway.serve.cli", "serve", "--config", str(_config(tmp, http_port, grpc_port))]
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{http_port}"
    report: dict = {"quick": args.quick, "sizes": vars(sizes), "cases": {}}
    try:
        deadline = time.monotonic() + 180
        while not _alive(Target(url, "", ""), server):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start; see {tmp / 'serve.log'}")
            time.sleep(0.5)
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        key = httpx.post(f"{url}/admin/keys", json={"tenant": "fuzz"}, headers=admin, timeout=30).json()["key"]
        target = Target(url, f"127.0.0.1:{grpc_port}", key)
        for case in CASES:
            rec = Record()
            started = time.perf_counter()
            with StallProbe(url) as probe:
                try:
                    case(target, sizes, rec)
                except Exception as exc:  # noqa: BLE001 - a client-side failure is recorded, the run goes on
                    rec.notes.append(f"case raised {type(exc).__name__}: {str(exc)[:200]}")
            alive = _alive(target, server)
            report["cases"][case.__name__] = {
                "statuses": dict(rec.statuses),
                "server_errors": rec.server_errors,
                "max_stall_ms": round(probe.worst_ms, 1),
                "probe_failures": dict(probe.failures),
                "alive_after": alive,
                "seconds": round(time.perf_counter() - started, 2),
                "notes": rec.notes,
            }
            sys.stderr.write(f"{case.__name__}: {json.dumps(report['cases'][case.__name__])[:400]}\n")
            if not alive:
                break
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    cases = report["cases"].values()
    report["summary"] = {
        "cases": len(report["cases"]),
        "any_5xx": any(c["server_errors"] for c in cases),
        "max_stall_ms": max((c["max_stall_ms"] for c in cases), default=0.0),
        "alive": len(report["cases"]) == len(CASES) and all(c["alive_after"] for c in cases),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fuzz_hostile.json").write_text(json.dumps(report, indent=1))
    sys.stdout.write(json.dumps(report["summary"]) + "\n")


if __name__ == "__main__":
    main()
