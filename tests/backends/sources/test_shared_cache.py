"""Two gateways of two workers each, started together on one cache volume: each file of each
model crosses the network once (file locks, atomic renames), and all four processes serve."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.demo_models.digits import DigitsModel
from tests.backends.sources.conftest import put
from tests.backends.sources.stores import S3, Store
from tests.tenancy.conftest import (
    ADMIN_HEADERS,
    admin_create_key,
    bearer,
    gateway_processes,
    v2_body,
    write_config,
)

pytestmark = pytest.mark.slow

MODELS = ("from-hf", "from-s3", "from-url")


def _ready_workers(url: str) -> int:
    """Worker processes that report every deployment loaded."""
    text = httpx.get(f"{url}/metrics", headers=ADMIN_HEADERS).text
    ready: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "fleetgate_backend_ready":
            for s in family.samples:
                ready[s.labels["pid"]] = ready.get(s.labels["pid"], 0) + int(s.value == 1)
    return sum(1 for n in ready.values() if n == len(MODELS))


def test_two_gateways_of_two_workers_fetch_each_file_once(
    digits: DigitsModel, store: Store, s3: S3, tmp_path: Path
) -> None:
    onnx = digits.onnx_path.read_bytes()
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "digits.onnx").write_bytes(onnx)
    store.add_repo("acme/digits", folder)
    put("models", {"digits/digits.onnx": onnx})
    store.plain["digits.onnx"] = onnx
    sha = hashlib.sha256(onnx).hexdigest()
    configs = [
        write_config(
            tmp_path / f"gw{i}.yaml",
            f"""
server: {{workers: 2, readiness: all}}
state: {{url: "sqlite:///{tmp_path / f'state{i}.db'}"}}
storage: {{cache_dir: "{tmp_path / 'shared-cache'}"}}
tenants: {{t: {{}}}}
deployments:
  from-hf: {{backend: onnxruntime, model: "hf://acme/digits/digits.onnx"}}
  from-s3: {{backend: onnxruntime, model: "s3://models/digits/digits.onnx"}}
  from-url: {{backend: onnxruntime, model: "{store.url}/files/digits.onnx#sha256={sha}"}}
models: {{{", ".join(f"{m}: {{routes: [{{deployment: {m}}}]}}" for m in MODELS)}}}
""",
        )
        for i in range(2)
    ]
    with gateway_processes(configs, tmp_path) as gateways:
        deadline = time.monotonic() + 120
        while any(_ready_workers(gw.url) < 2 for gw in gateways):
            assert time.monotonic() < deadline, "the workers did not all load their models"
            time.sleep(0.2)
        for gw in gateways:
            key, _ = admin_create_key(gw.url, "t")
            for model in MODELS:
                answer = httpx.post(f"{gw.url}/v2/models/{model}/infer", json=v2_body(), headers=bearer(key))
                assert answer.status_code == 200, answer.text
    # four processes, three addresses of the same bytes: the Hub's LFS file and the URL both name
    # them by their sha256, so one download serves both; S3 names them by an MD5 ETag: one more
    assert store.served.file_gets == 1
    assert s3.object_gets() == 1
