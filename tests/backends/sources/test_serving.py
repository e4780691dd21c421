"""A gateway serving models from their addresses: an LLM folder and an embedding tokenizer on a
Hub-compatible endpoint (HF_ENDPOINT), an ONNX encoder and an OpenVINO IR on moto's S3, a digits
model at a URL with its sha256. One start fetches everything; a second start on the same cache
downloads nothing; offline with the stores gone it still serves; a deployment still fetching is
not ready and says so while the others serve."""

from __future__ import annotations

import hashlib
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from backends.demo_models.digits import DigitsModel
from backends.demo_models.encoder import write_tiny_encoder
from backends.demo_models.exports import write_openvino_ir
from backends.demo_models.tiny_llama import write_tiny_llama
from gateway.config import parse_config
from gateway.http.app import create_app
from tests.backends.sources.conftest import put
from tests.backends.sources.stores import S3, Store
from tests.conftest import ADMIN_HEADERS, create_key
from tests.servers import serve_app

pytestmark = pytest.mark.slow
pytest.importorskip("torch")
pytest.importorskip("openvino")

ROW = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}]}


@dataclass
class Published:
    digits_sha256: str
    files: int


@pytest.fixture(scope="module")
def built(digits: DigitsModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("published")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        encoder = write_tiny_encoder(root / "encoder")
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_bytes((encoder.tokenizer_dir / "tokenizer.json").read_bytes())
    return {
        "llama": write_tiny_llama(root / "llama"),
        "tokenizer": tokenizer,
        "encoder": encoder.onnx_path,
        "ir": write_openvino_ir(digits.onnx_path, root / "ir" / "digits.xml"),
        "digits": digits.onnx_path,
    }


def _publish(store: Store, built: dict[str, Path]) -> Published:
    store.add_repo("acme/tiny-llama", built["llama"])
    store.add_repo("acme/encoder-tokenizer", built["tokenizer"])
    put("models", {
        "encoder/encoder.onnx": built["encoder"].read_bytes(),
        "ir/digits.xml": built["ir"].read_bytes(),
        "ir/digits.bin": built["ir"].with_suffix(".bin").read_bytes(),
    })
    store.plain["digits.onnx"] = built["digits"].read_bytes()
    llama_files = len(store.repos["acme/tiny-llama"].files)
    return Published(hashlib.sha256(store.plain["digits.onnx"]).hexdigest(), llama_files + 1 + 3 + 1)


def _config(store: Store, cache: Path, published: Published, *, offline: bool = False, llm: str = "hf://acme/tiny-llama") -> str:
    return f"""
state: {{url: "memory://"}}
storage: {{cache_dir: "{cache}", offline: {str(offline).lower()}}}
tenants: {{acme: {{}}}}
deployments:
  llm: {{backend: torch_llm, model: "{llm}", device: cpu, options: {{max_model_len: 256, kv_cache_bytes: 4194304}}}}
  embed: {{backend: onnxruntime, model: "s3://models/encoder/encoder.onnx",
           embedding: {{tokenizer: "hf://acme/encoder-tokenizer", max_length: 32}}}}
  digits-ov: {{backend: openvino, model: "s3://models/ir/digits.xml"}}
  digits-url: {{backend: onnxruntime, model: "{store.url}/files/digits.onnx#sha256={published.digits_sha256}"}}
models:
  llm: {{routes: [{{deployment: llm}}]}}
  embed: {{routes: [{{deployment: embed}}]}}
  digits-ov: {{routes: [{{deployment: digits-ov}}]}}
  digits-url: {{routes: [{{deployment: digits-url}}]}}
"""


def _detail(url: str) -> dict[str, dict[str, object]]:
    return httpx.get(f"{url}/health/ready", headers=ADMIN_HEADERS).json()["deployments"]


def _wait_ready(url: str, names: set[str], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        detail = _detail(url)
        if all(detail[n]["ready"] for n in names):
            return
        time.sleep(0.2)
    raise AssertionError(f"not ready in time: {detail}")


def _serves_everything(url: str) -> None:
    headers = {"Authorization": f"Bearer {create_key(url, 'acme')}"}
    done = httpx.post(f"{url}/v1/completions", headers=headers, timeout=60,
                      json={"model": "llm", "prompt": "hello", "max_tokens": 3})
    assert done.status_code == 200, done.text
    vectors = httpx.post(f"{url}/v1/embeddings", headers=headers, json={"model": "embed", "input": ["hello world"]})
    assert vectors.status_code == 200 and len(vectors.json()["data"][0]["embedding"]) == 32, vectors.text
    for model in ("digits-ov", "digits-url"):
        answer = httpx.post(f"{url}/v2/models/{model}/infer", headers=headers, json=ROW)
        assert answer.status_code == 200 and answer.json()["outputs"][0]["shape"] == [1, 10], answer.text


def test_one_start_fetches_everything_a_second_downloads_nothing_offline_serves(
    store: Store, s3: S3, built: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    published = _publish(store, built)
    cache = tmp_path / "cache"
    yaml = _config(store, cache, published)
    with serve_app(create_app(parse_config(yaml, base_dir=Path(".")))) as url:
        _wait_ready(url, {"llm", "embed", "digits-ov", "digits-url"})
        _serves_everything(url)
    fetched = store.served.file_gets + s3.object_gets()
    assert fetched == published.files

    # a second gateway on the same cache: every model is there, nothing is downloaded
    with serve_app(create_app(parse_config(yaml, base_dir=Path(".")))) as url:
        _wait_ready(url, {"llm", "embed", "digits-ov", "digits-url"})
        _serves_everything(url)
    assert store.served.file_gets + s3.object_gets() == fetched

    # the stores are gone: offline mode serves from the cache alone
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    offline = _config(store, cache, published, offline=True).replace(store.url, "http://127.0.0.1:9")
    offline = offline.replace("http://127.0.0.1:9/files", f"{store.url}/files")  # same address, same cache entry
    store_requests = sum(store.served.requests.values())
    with serve_app(create_app(parse_config(offline, base_dir=Path(".")))) as url:
        _wait_ready(url, {"llm", "embed", "digits-ov", "digits-url"})
        _serves_everything(url)
    assert sum(store.served.requests.values()) == store_requests


def test_a_deployment_still_fetching_is_not_ready_and_the_others_serve(
    store: Store, s3: S3, built: dict[str, Path], tmp_path: Path
) -> None:
    published = _publish(store, built)
    llama = store.repos.pop("acme/tiny-llama")  # not published yet: its fetch fails and is retried
    yaml = _config(store, tmp_path / "cache", published)
    with serve_app(create_app(parse_config(yaml, base_dir=Path(".")))) as url:
        _wait_ready(url, {"embed", "digits-ov", "digits-url"})
        detail = _detail(url)["llm"]
        assert detail["ready"] is False
        assert "repository acme/tiny-llama not found" in str(detail["error"]), detail
        assert httpx.get(f"{url}/health/ready").status_code == 200  # readiness: any
        headers = {"Authorization": f"Bearer {create_key(url, 'acme')}"}
        refused = httpx.post(f"{url}/v1/completions", headers=headers, json={"model": "llm", "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        store.served.pace_s = 0.3  # a slow link: the download takes seconds, its progress is shown
        store.repos["acme/tiny-llama"] = llama  # published: the retry (backoff from 1 s) fetches and loads it
        deadline = time.monotonic() + 60
        while "MB" not in str(_detail(url)["llm"]["error"]):
            assert time.monotonic() < deadline, _detail(url)
            time.sleep(0.05)
        detail = _detail(url)["llm"]
        assert detail["ready"] is False and str(detail["error"]).startswith("fetching hf://acme/tiny-llama "), detail
        store.served.pace_s = 0.0
        _wait_ready(url, {"llm"})
        _serves_everything(url)
