"""Graceful drain of a real `fleetgate serve` process under load (gateway/serve/drain.py).

SIGTERM while streams and tensor requests are in flight: readiness turns 503 at once, requests are
still served during the grace, open streams run to their end, the process exits 0, and the usage
it recorded equals what the clients received. A second SIGTERM ends at once, still exiting cleanly.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from backends.demo_models.digits import digits_split
from backends.demo_models.tiny_llama import write_tiny_llama
from policies.stores import open_store
from policies.types import UsageRow
from tests.tenancy.conftest import ADMIN_HEADERS, admin_create_key, start_gateway, wait_ready

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")

# Enough queued work (one engine slot) that streams still run well past the 1.5 s grace on a fast
# machine: 3 x 1500 tokens once ended 1.24 s after the signal on a host decoding ~3,000 tokens/s.
STREAMS = 5
OUTPUT_TOKENS = 2000


def _config(tmp: Path, digits_path: Path, llm: Path, grace_s: float, timeout_s: float, workers: int = 1) -> Path:
    path = tmp / "drain.yaml"
    path.write_text(
        f"""
server: {{drain_grace_s: {grace_s}, drain_timeout_s: {timeout_s}, workers: {workers}}}
state: {{url: "sqlite:///{tmp / "state.db"}"}}
tenants: {{acme: {{}}}}
deployments:
  ort: {{backend: onnxruntime, model: {digits_path}}}
  llm: {{backend: torch_llm, model: {llm}, device: cpu, options: {{max_num_seqs: 1}}}}
models:
  digits: {{routes: [{{deployment: ort}}]}}
  tiny: {{routes: [{{deployment: llm}}]}}
"""
    )
    return path


def _stream(url: str, key: str, out: dict, started: threading.Event) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,  # the last queued stream waits for 4 x 2000 tokens before its first byte
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                started.set()
                events.append(line[6:])
    out["events"] = events
    out["ended_at"] = time.monotonic()


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("drain") / "tiny-llama")


async def _usage(url: str) -> list[UsageRow]:
    store = await open_store(url)
    try:
        return await store.usage("acme")
    finally:
        await store.close()


def _worker_pids(url: str, workers: int) -> set[int]:
    """The workers' pids, once every one of them has loaded its deployments."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(f"{url}/metrics", headers=ADMIN_HEADERS).text
        pids = {
            int(s.labels["pid"])
            for f in text_string_to_metric_families(text) if f.name == "fleetgate_backend_ready"
            for s in f.samples if s.value == 1
        }  # fmt: skip
        if len(pids) == workers or time.monotonic() > deadline:
            return pids
        time.sleep(0.2)


@pytest.mark.parametrize("workers, to_group", [(1, False), (2, False), (2, True)])
def test_sigterm_drains_without_losing_an_answer_or_usage(
    tmp_path: Path, digits, llm_dir: Path, workers: int, to_group: bool  # noqa: ANN001
) -> None:
    """With `workers: 2` the parent tells each worker to drain, and each drains the same way; also
    when the SIGTERM reaches the workers directly too (a process-group kill: systemd, tini -g)."""
    gw = start_gateway(
        _config(tmp_path, digits.onnx_path, llm_dir, grace_s=1.5, timeout_s=90, workers=workers),
        tmp_path / "gw.log",
    )
    try:
        wait_ready(gw)
        key, _ = admin_create_key(gw.url, "acme")
        auth = {"Authorization": f"Bearer {key}"}
        row = {
            "inputs": [
                {"name": "input", "shape": [1, 64], "datatype": "FP32", "data": digits_split()[1][0].tolist()}
            ]
        }
        # every worker loaded before the streams start: a slow second load must not eat their time
        pids = _worker_pids(gw.url, workers) if to_group else set()
        assert len(pids) == (2 if to_group else 0)
        results = [{} for _ in range(STREAMS)]
        started = [threading.Event() for _ in range(STREAMS)]
        threads = [
            threading.Thread(target=_stream, args=(gw.url, key, results[i], started[i]))
            for i in range(STREAMS)
        ]
        for t in threads:
            t.start()
        # one engine slot: the first stream runs, the others wait their turn in the fair queue
        assert any(e.wait(30) for e in started[:1])
        answered_rows = 0
        assert httpx.post(f"{gw.url}/v2/models/digits/infer", json=row, headers=auth).status_code == 200
        answered_rows += 1

        gw.proc.send_signal(signal.SIGTERM)
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        sent_at = time.monotonic()
        time.sleep(0.3)
        for _ in range(2 * workers):  # every worker (new connections may reach either)
            assert httpx.get(f"{gw.url}/health/ready").status_code == 503  # load balancers stop sending
            assert httpx.get(f"{gw.url}/v2/health/ready").status_code == 503
        during_grace = httpx.post(f"{gw.url}/v2/models/digits/infer", json=row, headers=auth)
        assert during_grace.status_code == 200  # ...but what still arrives is served
        answered_rows += 1

        time.sleep(1.5)  # past the grace: new work is refused (503 + Retry-After), or the port is closed
        try:
            late = httpx.post(f"{gw.url}/v2/models/digits/infer", json=row, headers=auth, timeout=5)
            assert late.status_code == 503 and late.headers.get("retry-after"), late.text
        except httpx.ConnectError:  # refused at once (a hanging connection would be a defect)
            pass

        for t in threads:
            t.join(120)
        gw.proc.wait(timeout=120)
        assert gw.proc.returncode == 0, gw.log.read_text()[-3000:]
    finally:
        gw.kill()

    # the streams were still running when the signal came, and after the grace ended
    assert max(r["ended_at"] for r in results) > sent_at + 1.5
    completion_tokens = prompt_tokens = 0
    for result in results:
        events = result["events"]
        assert events[-1] == "[DONE]", events[-3:]
        usage = json.loads(events[-2])["usage"]  # the include_usage chunk
        assert usage["completion_tokens"] == OUTPUT_TOKENS  # no stream was cut
        completion_tokens += usage["completion_tokens"]
        prompt_tokens += usage["prompt_tokens"]

    # the usage the drained process recorded, read from its SQLite file here (another process; a
    # second gateway started to read it through /admin/usage took 8 s a run for the same rows)
    rows = asyncio.run(_usage(f"sqlite:///{tmp_path / 'state.db'}"))
    day = {r.model: r for r in rows if len(r.period) == 10}
    assert day["tiny"].requests == STREAMS and day["tiny"].tokens == prompt_tokens + completion_tokens
    assert day["digits"].requests == answered_rows and day["digits"].tokens == answered_rows


@pytest.mark.parametrize("workers", [1, 2])
def test_a_second_sigterm_ends_at_once(tmp_path: Path, digits, llm_dir: Path, workers: int) -> None:  # noqa: ANN001
    gw = start_gateway(
        _config(tmp_path, digits.onnx_path, llm_dir, grace_s=30, timeout_s=60, workers=workers),
        tmp_path / "gw.log",
    )
    try:
        wait_ready(gw)
        gw.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert httpx.get(f"{gw.url}/health/ready").status_code == 503
        started = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)
        gw.proc.wait(timeout=20)
        assert time.monotonic() - started < 15  # not the 30 s grace nor the 60 s timeout
        assert gw.proc.returncode == 0, gw.log.read_text()[-3000:]
    finally:
        gw.kill()


def test_sighup_to_the_parent_reloads_the_workers_in_place(tmp_path: Path, digits, llm_dir: Path) -> None:  # noqa: ANN001
    """SIGHUP is the config reload: the parent passes it on and keeps running (it used to end it)."""
    config = _config(tmp_path, digits.onnx_path, llm_dir, grace_s=0, timeout_s=5, workers=2)
    gw = start_gateway(config, tmp_path / "gw.log")
    try:
        wait_ready(gw)
        before = _worker_pids(gw.url, 2)
        gw.proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert gw.proc.poll() is None
        assert _worker_pids(gw.url, 2) == before  # reloaded in place, not restarted
        assert gw.log.read_text().count("config_reloaded") == 2  # each worker reloaded
        gw.proc.send_signal(signal.SIGTERM)
        gw.proc.wait(timeout=30)
        assert gw.proc.returncode == 0, gw.log.read_text()[-3000:]
    finally:
        gw.kill()
