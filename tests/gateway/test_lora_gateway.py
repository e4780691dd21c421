"""LoRA adapters through the gateway: each adapter a model name, tenant-scoped, listed with its base
as parent, counted per adapter, batched with the base, loaded and unloaded at run time under load."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("peft")

from openai import NotFoundError, OpenAI  # noqa: E402

from backends.demo_models.tiny_llama import write_tiny_llama  # noqa: E402
from gateway.config import ConfigError, parse_config  # noqa: E402
from gateway.http.app import create_app  # noqa: E402
from tests.conftest import ADMIN_HEADERS, create_key  # noqa: E402
from tests.lora_adapters import write_peft_adapter  # noqa: E402
from tests.servers import serve_app  # noqa: E402

PROMPT = "the quick brown fox"
ARGS = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-gw")
    base = write_tiny_llama(root / "base", init_std=0.05, seed=3)
    qv = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    mlp = {"r": 8, "lora_alpha": 16, "target_modules": ["gate_proj", "up_proj", "down_proj"]}
    return {
        "base": base,
        "acme-support": write_peft_adapter(base, root / "acme", seed=1, **qv),
        "beta-legal": write_peft_adapter(base, root / "beta", seed=2, **mlp),
        "acme-new": write_peft_adapter(base, root / "new", seed=4, **mlp),
        "too-wide": write_peft_adapter(
            base, root / "wide", seed=5, r=32, lora_alpha=8, target_modules=["q_proj"]
        ),
    }


def _config(f: dict[str, Path]):  # type: ignore[no-untyped-def]
    return parse_config(
        f"""
state: {{url: "memory://"}}
tenants:
  acme: {{models: ["tiny", "acme-*"]}}
  beta: {{models: ["tiny", "beta-*"]}}
  ops: {{models: ["*"]}}
deployments:
  llm:
    backend: torch_llm
    model: {f["base"]}
    device: cpu
    adapters: {{acme-support: {f["acme-support"]}, beta-legal: {f["beta-legal"]}}}
    options: {{max_num_seqs: 8, max_loras: 2}}
models:
  tiny: {{routes: [{{deployment: llm}}]}}
""",
        base_dir=Path("."),
    )


@pytest.fixture(scope="module")
def gateway(folders: dict[str, Path]) -> Iterator[dict[str, str]]:
    with serve_app(create_app(_config(folders))) as url:
        yield {"url": url, **{t: create_key(url, t) for t in ("acme", "beta", "ops")}}


def _client(gw: dict[str, str], tenant: str) -> OpenAI:
    return OpenAI(base_url=f"{gw['url']}/v1", api_key=gw[tenant], max_retries=0, timeout=120)


def _complete(client: OpenAI, model: str, prompt: str = PROMPT) -> str:
    return client.completions.create(model=model, prompt=prompt, **ARGS).choices[0].text


def test_each_tenant_sees_and_calls_only_its_adapters(gateway) -> None:
    acme = _client(gateway, "acme")
    models = {m.id: m for m in acme.models.list().data}
    assert set(models) == {"tiny", "acme-support"}
    assert models["acme-support"].model_extra["parent"] == "tiny"
    assert "parent" not in (models["tiny"].model_extra or {})
    with pytest.raises(NotFoundError):
        _complete(acme, "beta-legal")  # another tenant's adapter answers as if it did not exist
    beta = _client(gateway, "beta")
    assert {m.id for m in beta.models.list().data} == {"tiny", "beta-legal"}


def test_adapters_and_base_in_one_batch_answer_as_alone(gateway) -> None:
    ops = _client(gateway, "ops")
    alone = {m: _complete(ops, m) for m in ("tiny", "acme-support", "beta-legal")}
    assert len(set(alone.values())) == 3, "each adapter must change the output"
    jobs = [m for m in alone for _ in range(3)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda m: (m, _complete(ops, m)), jobs))
    assert all(text == alone[m] for m, text in together)


def test_usage_is_counted_per_adapter(gateway) -> None:
    acme = _client(gateway, "acme")
    out = acme.completions.create(model="acme-support", prompt=PROMPT, **ARGS)
    rows = httpx.get(f"{gateway['url']}/admin/usage", params={"tenant": "acme"}, headers=ADMIN_HEADERS).json()
    mine = [r for r in rows["usage"] if r["model"] == "acme-support" and len(r["period"]) == 10]  # days
    assert mine and sum(r["tokens"] for r in mine) >= out.usage.total_tokens
    assert sum(r["requests"] for r in mine) >= 1


def test_load_and_unload_at_run_time_under_load(gateway, folders) -> None:
    url, ops = gateway["url"], _client(gateway, "ops")
    errors: list[BaseException] = []
    stop = threading.Event()

    def keep_calling(model: str) -> None:
        while not stop.is_set():
            try:
                _complete(ops, model)
            except BaseException as exc:  # noqa: BLE001 - every failure is reported
                errors.append(exc)

    workers = [threading.Thread(target=keep_calling, args=(m,)) for m in ("tiny", "beta-legal")]
    for w in workers:
        w.start()
    try:
        # a long stream of an adapter unloaded after its first token runs to its end
        stream = ops.completions.create(model="acme-support", prompt=PROMPT, stream=True, max_tokens=1500,
                                        temperature=0, extra_body={"ignore_eos": True},
                                        stream_options={"include_usage": True})  # fmt: skip
        first = next(iter(stream))
        gone = httpx.delete(f"{url}/admin/deployments/llm/adapters/acme-support", headers=ADMIN_HEADERS)
        assert gone.status_code == 200, gone.text
        loaded = httpx.post(
            f"{url}/admin/deployments/llm/adapters",
            json={"name": "acme-new", "path": str(folders["acme-new"])},
            headers=ADMIN_HEADERS,
            timeout=60,
        )
        assert loaded.status_code == 201, loaded.text
        assert loaded.json()["parent"] == "tiny"
        assert _complete(ops, "acme-new") != _complete(ops, "tiny")
        with pytest.raises(NotFoundError):
            _complete(ops, "acme-support")
        rest = list(stream)
        assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
        assert rest[-1].usage.completion_tokens == 1500 and first.choices
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    assert not errors, errors[:3]
    listed = httpx.get(f"{url}/admin/adapters", headers=ADMIN_HEADERS).json()["deployments"]["llm"]
    assert set(listed["adapters"]) == {"beta-legal", "acme-new"}


def test_admin_refusals_say_why(gateway, folders) -> None:
    url = gateway["url"]

    def load(dep: str, name: str, path: str) -> httpx.Response:
        return httpx.post(
            f"{url}/admin/deployments/{dep}/adapters",
            json={"name": name, "path": path},
            headers=ADMIN_HEADERS,
        )

    wide = load("llm", "acme-wide", str(folders["too-wide"]))
    assert wide.status_code == 400 and "max_lora_rank" in wide.text
    assert load("nope", "x", str(folders["acme-new"])).status_code == 404
    taken = load("llm", "tiny", str(folders["acme-new"]))
    assert taken.status_code == 400 and "model in the config" in taken.text
    assert load("llm", "bad:name", str(folders["acme-new"])).status_code == 400
    assert load("llm", "acme-x", "/nonexistent").status_code == 400
    again = load("llm", "beta-legal", str(folders["acme-new"]))  # never replaced in place
    assert again.status_code == 400 and "unload it first" in again.text
    assert (
        httpx.delete(f"{url}/admin/deployments/llm/adapters/nobody", headers=ADMIN_HEADERS).status_code == 404
    )
    tenant = httpx.post(
        f"{url}/admin/deployments/llm/adapters",
        json={"name": "x", "path": str(folders["acme-new"])},
        headers={"Authorization": f"Bearer {gateway['ops']}"},
    )
    assert tenant.status_code in (401, 403)


def test_config_refuses_adapters_that_cannot_serve(folders, tmp_path) -> None:
    def parse(deployment: str, models: str = "") -> None:
        parse_config(
            f"deployments:\n  {deployment}\nmodels:\n  {models or 'm: {routes: [{deployment: d}]}'}\n",
            base_dir=tmp_path,
        )

    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"x")
    with pytest.raises(ConfigError, match="torch_llm deployments only"):
        parse(f"d: {{backend: onnxruntime, model: {onnx}, adapters: {{a: {folders['acme-new']}}}}}")
    with pytest.raises(ConfigError, match="also a model"):
        parse(f"d: {{backend: torch_llm, model: {folders['base']}, adapters: {{m: {folders['acme-new']}}}}}")
    with pytest.raises(ConfigError, match="does not exist"):
        parse(f"d: {{backend: torch_llm, model: {folders['base']}, adapters: {{a: /nonexistent}}}}")
    with pytest.raises(ConfigError, match="fleetgate quantize"):  # int8 where the backend has no int8 path
        parse(f"d: {{backend: onnxruntime, model: {onnx}, options: {{quantization: int8}}}}")
    config = parse_config(
        f"deployments:\n  d: {{backend: torch_llm, model: {folders['base']}, adapters: {{w: {folders['too-wide']}}}}}\n",
        base_dir=tmp_path,
    )
    with pytest.raises(ConfigError, match="max_lora_rank"):
        create_app(config)  # the backend checks the adapter against its base when it is created


def test_run_time_adapters_are_refused_with_several_workers(folders, tmp_path) -> None:
    # each worker would hold its own adapters: a change through one would reach one worker only
    config = parse_config(
        f"""
server: {{workers: 2}}
state: {{url: "sqlite:///{tmp_path}/state.db"}}
tenants: {{acme: {{}}}}
deployments:
  llm: {{backend: torch_llm, model: {folders["base"]}, device: cpu, options: {{enable_lora: true}}}}
models:
  tiny: {{routes: [{{deployment: llm}}]}}
""",
        base_dir=Path("."),
    )
    with serve_app(create_app(config)) as url:
        r = httpx.post(
            f"{url}/admin/deployments/llm/adapters",
            json={"name": "acme-new", "path": str(folders["acme-new"])},
            headers=ADMIN_HEADERS,
        )
    assert r.status_code == 409 and "workers" in r.text


@pytest.mark.parametrize("name", ["a/../../b", "acme/./x", "acme//x", "acme/", "/acme", "..", "acme:1", "acme@x"])
def test_adapter_names_that_could_not_be_addressed_are_refused(gateway, folders, name) -> None:
    # `a/../../b` used to load, and no DELETE URL could name it again: clients fold the dots away
    r = httpx.post(
        f"{gateway['url']}/admin/deployments/llm/adapters",
        json={"name": name, "path": str(folders["acme-new"])},
        headers=ADMIN_HEADERS,
    )
    assert r.status_code == 400, r.text
    assert "not a valid model name" in r.json()["error"] and "segments joined by /" in r.json()["error"]


@pytest.mark.parametrize("name", ["acme/support-v2", "acme.v1_x", "Org/team/a.b"])
def test_every_loadable_adapter_name_can_be_unloaded(gateway, folders, name) -> None:
    url = gateway["url"]
    loaded = httpx.post(
        f"{url}/admin/deployments/llm/adapters",
        json={"name": name, "path": str(folders["acme-new"])},
        headers=ADMIN_HEADERS,
        timeout=60,
    )
    assert loaded.status_code == 201, loaded.text
    ops = _client(gateway, "ops")
    assert name in {m.id for m in ops.models.list().data}
    assert _complete(ops, name)  # served under its name
    gone = httpx.delete(f"{url}/admin/deployments/llm/adapters/{name}", headers=ADMIN_HEADERS)
    assert gone.status_code == 200, gone.text
    assert gone.json() == {"name": name, "deployment": "llm", "unloaded": True}
    listed = httpx.get(f"{url}/admin/adapters", headers=ADMIN_HEADERS).json()["deployments"]["llm"]
    assert name not in listed["adapters"]
