"""LoRA adapters by address: one in the config on an S3 prefix (fetched with its base model from
the Hub endpoint), one loaded at run time through the admin API from an hf:// address."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backends.demo_models.tiny_llama import write_tiny_llama
from gateway.config import parse_config
from gateway.http.app import create_app
from tests.backends.sources.conftest import put
from tests.backends.sources.stores import S3, Store
from tests.conftest import ADMIN_HEADERS, create_key
from tests.lora_adapters import write_peft_adapter
from tests.servers import serve_app

pytestmark = pytest.mark.slow
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-sources")
    base = write_tiny_llama(root / "base", init_std=0.05, seed=3)
    qv = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    return {
        "base": base,
        "tuned": write_peft_adapter(base, root / "tuned", seed=1, **qv),
        "later": write_peft_adapter(base, root / "later", seed=2, **qv),
    }


@pytest.fixture
def url(store: Store, s3: S3, folders: dict[str, Path], tmp_path: Path) -> Iterator[str]:
    store.add_repo("acme/base", folders["base"])
    store.add_repo("acme/later", folders["later"])
    put("models", {f"adapters/tuned/{p.name}": p.read_bytes() for p in folders["tuned"].iterdir() if p.is_file()})
    config = parse_config(
        f"""
state: {{url: "memory://"}}
storage: {{cache_dir: "{tmp_path / 'cache'}"}}
tenants: {{acme: {{}}}}
deployments:
  llm:
    backend: torch_llm
    model: "hf://acme/base"
    device: cpu
    adapters: {{acme-tuned: "s3://models/adapters/tuned/"}}
    options: {{max_num_seqs: 4, max_loras: 2, kv_cache_bytes: 4194304}}
models:
  tiny: {{routes: [{{deployment: llm}}]}}
""",
        base_dir=Path("."),
    )
    with serve_app(create_app(config)) as running:
        yield running


def _complete(url: str, key: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "the quick brown fox", "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_adapters_from_addresses(url: str, store: Store) -> None:
    deadline = time.monotonic() + 120
    while not httpx.get(f"{url}/health/ready", headers=ADMIN_HEADERS).json()["deployments"]["llm"]["ready"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    key = create_key(url, "acme")
    base, tuned = _complete(url, key, "tiny"), _complete(url, key, "acme-tuned")
    assert base.status_code == tuned.status_code == 200, tuned.text
    assert base.json()["choices"][0]["text"] != tuned.json()["choices"][0]["text"]  # the adapter is applied

    loaded = httpx.post(
        f"{url}/admin/deployments/llm/adapters", headers=ADMIN_HEADERS, json={"name": "acme-later", "path": "hf://acme/later"}
    )
    assert loaded.status_code == 201, loaded.text
    assert _complete(url, key, "acme-later").status_code == 200
    missing = httpx.post(
        f"{url}/admin/deployments/llm/adapters", headers=ADMIN_HEADERS, json={"name": "acme-x", "path": "hf://acme/absent"}
    )
    assert missing.status_code == 400 and "repository acme/absent not found" in missing.json()["error"], missing.text
