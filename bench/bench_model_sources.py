"""Bytes fetched per start and time to ready of a gateway whose models are addresses (issue 44).

Stores on loopback speaking the real protocols: a Hugging Face Hub-compatible endpoint (HF_ENDPOINT)
holding a random-weight Llama folder (about 14 MB of safetensors), moto's S3 server
(AWS_ENDPOINT_URL) holding the digits OpenVINO IR (xml + bin) and a file server holding the digits
ONNX model at a URL with its sha256. Each start is a `fleetgate serve` subprocess with
`server.readiness: all`, timed from the process start to its first 200 on /health/ready (every
deployment loaded); bytes fetched are counted at the stores (the Hub endpoint's and the file
server's file bytes, S3's object GETs times the objects' sizes).

Starts, each `--rounds` times, in turn round by round (drift on a shared machine hits them alike):
  local       the same models as local paths (the floor: no address, no cache)
  cold        addresses, an empty cache (everything fetched)
  warm        addresses, the cache of a cold start (storage.verify: sha256, the default)
  warm_size   the same with storage.verify: size (no re-read of the files)
  offline     storage.offline: true, the stores' endpoints pointing at a closed port

    .venv/bin/python -m bench.bench_model_sources [--rounds 3]

Writes bench/results/model_sources.json and bench/results/model_sources.png. Targets: a second
start on the same cache fetches 0 bytes; offline serves from the cache.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.bench_gateway import RESULTS, start_gateway
from bench.plotting import figure, grouped_bars, save

SCENARIOS = ("local", "cold", "warm", "warm_size", "offline")


def _models(root: Path) -> dict[str, Path]:
    from backends.demo_models.digits import write_digits
    from backends.demo_models.exports import write_openvino_ir
    from backends.demo_models.tiny_llama import write_tiny_llama

    digits = write_digits(root / "digits")
    return {
        "llama": write_tiny_llama(root / "llama", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2),
        "ir": write_openvino_ir(digits.onnx_path, root / "ir" / "digits.xml"),
        "onnx": digits.onnx_path,
    }


def _config(models: dict[str, str], storage: str) -> Callable[[int], str]:
    def make(port: int) -> str:
        return f"""
server: {{port: {port}, log_level: warning, readiness: all}}
state: {{url: "memory://"}}
storage: {storage}
tenants: {{bench: {{}}}}
deployments:
  llm: {{backend: torch_llm, model: "{models['llm']}", device: cpu, options: {{kv_cache_bytes: 8388608}}}}
  edge: {{backend: openvino, model: "{models['edge']}"}}
  digits: {{backend: onnxruntime, model: "{models['digits']}"}}
models: {{llm: {{routes: [{{deployment: llm}}]}}, edge: {{routes: [{{deployment: edge}}]}}, digits: {{routes: [{{deployment: digits}}]}}}}
"""

    return make


class Stores:
    """The three stores and what they sent."""

    def __init__(self, built: dict[str, Path], workdir: Path) -> None:
        import boto3

        from tests.backends.sources.stores import http_store, s3_store

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request lines
        self._http = http_store()
        self.http = self._http.__enter__()
        self._s3 = s3_store(workdir / "moto-recording.jsonl")
        self.s3 = self._s3.__enter__()
        os.environ.update({
            "HF_ENDPOINT": self.http.url, "AWS_ENDPOINT_URL": self.s3.url, "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
        })  # fmt: skip
        self.http.add_repo("bench/llama", built["llama"])
        client = boto3.client("s3")
        client.create_bucket(Bucket="models")
        self.object_sizes = {}
        for path in (built["ir"], built["ir"].with_suffix(".bin")):
            client.put_object(Bucket="models", Key=f"digits/{path.name}", Body=path.read_bytes())
            self.object_sizes[f"/models/digits/{path.name}"] = path.stat().st_size
        self.http.plain["digits.onnx"] = built["onnx"].read_bytes()
        self.digits_sha256 = hashlib.sha256(self.http.plain["digits.onnx"]).hexdigest()
        self.s3.reset()

    def sent(self) -> int:
        """File bytes sent since the last call."""
        rows = httpx.get(f"{self.s3.url}/moto-api/recorder/download-recording").text.splitlines()
        s3_bytes = 0
        for row in rows:
            call = json.loads(row) if row.strip() else {}
            if call.get("method") == "GET":
                s3_bytes += self.object_sizes.get(urlsplit(call["url"]).path, 0)
        total = self.http.served.file_bytes + s3_bytes
        self.http.served.file_bytes = 0
        self.s3.reset()
        return total

    def close(self) -> None:
        self._s3.__exit__(None, None, None)
        self._http.__exit__(None, None, None)


def _start(workdir: Path, make: Callable[[int], str], env: dict[str, str] | None = None) -> float:
    started = time.perf_counter()
    proc, _, _ = start_gateway(workdir, make, env=env)
    ready_s = time.perf_counter() - started
    proc.terminate()
    proc.wait(timeout=60)
    return ready_s


def run(rounds: int) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-sources-"))
    built = _models(workdir / "built")
    stores = Stores(built, workdir)
    addresses = {
        "llm": "hf://bench/llama",
        "edge": "s3://models/digits/digits.xml",
        "digits": f"{stores.http.url}/files/digits.onnx#sha256={stores.digits_sha256}",
    }
    local = {"llm": str(built["llama"]), "edge": str(built["ir"]), "digits": str(built["onnx"])}
    dead = {"HF_ENDPOINT": "http://127.0.0.1:9", "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    samples: dict[str, list[tuple[float, int]]] = {s: [] for s in SCENARIOS}
    try:
        for _ in range(rounds):
            cache = workdir / "cache"
            shutil.rmtree(cache, ignore_errors=True)
            storage = f'{{cache_dir: "{cache}"}}'
            plan: list[tuple[str, Callable[[int], str], dict[str, str] | None]] = [
                ("local", _config(local, storage), None),
                ("cold", _config(addresses, storage), None),
                ("warm", _config(addresses, storage), None),
                ("warm_size", _config(addresses, f'{{cache_dir: "{cache}", verify: size}}'), None),
                ("offline", _config(addresses, f'{{cache_dir: "{cache}", offline: true}}'), dead),
            ]
            for name, make, env in plan:
                stores.sent()
                seconds = _start(workdir, make, env)
                samples[name].append((seconds, stores.sent()))
    finally:
        stores.close()
    model_bytes = sum(p.stat().st_size for p in built["llama"].rglob("*") if p.is_file()) + sum(
        stores.object_sizes.values()
    ) + len(stores.http.plain["digits.onnx"])
    return {
        "model_bytes": model_bytes,
        "scenarios": {
            name: {
                "median_time_to_ready_s": round(statistics.median(s for s, _ in runs), 3),
                "times_to_ready_s": [round(s, 3) for s, _ in runs],
                "bytes_fetched": [b for _, b in runs],
            }
            for name, runs in samples.items()
        },
    }


def plot(result: dict[str, Any], path: Path) -> None:
    fig, (left, right) = figure(1, 2, size=(11, 4))
    names = list(result["scenarios"])
    grouped_bars(left, names, {"time to ready (s), median": [result["scenarios"][n]["median_time_to_ready_s"] for n in names]}, fmt="{:.2f}")
    left.set_ylabel("seconds from process start to all deployments ready")
    mb = [statistics.median(result["scenarios"][n]["bytes_fetched"]) / 1e6 for n in names]
    grouped_bars(right, names, {"MB fetched per start, median": mb}, fmt="{:.1f}")
    right.set_ylabel("MB sent by the stores")
    fig.suptitle(f"fleetgate serve with model addresses ({result['model_bytes'] / 1e6:.1f} MB of models)")
    save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    result = {
        "bench": "model_sources",
        "machine": {"python": platform.python_version(), "processor": platform.processor() or platform.machine()},
        "target": "a second start on the same cache fetches 0 bytes; offline serves from the cache",
        **run(args.rounds),
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "model_sources.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "model_sources.png")
    summary = {n: (s["median_time_to_ready_s"], s["bytes_fetched"]) for n, s in result["scenarios"].items()}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
