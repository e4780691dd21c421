"""Each batch line runs once and is billed once within a live process, even when the job is cut
mid-way: a real gateway, the real `openai` SDK, the OpenAI upstream as a remote deployment, and
failure injection (a slow key lookup, a state store that fails once).

Before the fix two workers could both pass `while pending` before their key lookup and race for the
last line (`IndexError: pop from an empty deque`, the job failed and was resumed), and a store error
while the job looked for a cancel ended the job with its lines in flight cut: the job resumed at the
next poll and ran those lines a second time.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import openai
import pytest
import structlog

from gateway.batches.objects import BatchRecord
from gateway.config import parse_config
from gateway.http.app import create_app
from policies.errors import StoreUnavailable
from tests.conftest import create_key
from tests.gateway.test_batches import chat_line, expected_tokens, read_lines, start, usage_of, wait_for
from tests.openai_upstream import RECEIVED
from tests.servers import serve_app

#: what a store lookup of the job's key costs when the key cache has expired (the race's window)
LOOKUP_S = 0.05


def once_yaml(upstream_url: str, root: Path) -> str:
    return f"""
state: {{url: "sqlite:///{root / 'state.db'}"}}
batches: {{files_dir: "{root / 'files'}", poll_interval_s: 0.1, claim_ttl_s: 2, concurrency: 4}}
tenants:
  acme: {{quotas: {{tokens_per_day: 1000000}}}}
deployments:
  echo-remote:
    backend: remote
    url: {upstream_url}
    protocol: openai
    model_name: echo-upstream
    api_key_env: TEST_UPSTREAM_KEY
models:
  echo: {{routes: [{{deployment: echo-remote}}]}}
"""


@pytest.fixture
def gateway(upstream_url: str, tmp_path: Path) -> Iterator[tuple[str, object]]:
    app = create_app(parse_config(once_yaml(upstream_url, tmp_path), base_dir=tmp_path))
    with serve_app(app) as url:
        yield url, app


def _slow_key_checks(app: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every key check of a job wait like a store lookup (as after the key cache expired)."""
    keys = app.state.core.keys  # type: ignore[attr-defined]
    real: Callable[[str], Awaitable[bool]] = keys.still_valid

    async def slow_still_valid(key_id: str) -> bool:
        await asyncio.sleep(LOOKUP_S)
        return await real(key_id)

    monkeypatch.setattr(keys, "still_valid", slow_still_valid)


def _run_and_check(url: str, marker: str, lines: int, sleep_ms: int) -> None:
    key = create_key(url, "acme")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    prompts = {f"{marker}{i}": f"sleep-ms-{sleep_ms} {marker} line{i} words" for i in range(lines)}
    batch_id = start(client, [chat_line(c, p) for c, p in prompts.items()])
    done = wait_for(client, batch_id, {"completed", "failed"}, timeout_s=30)
    assert done.status == "completed" and done.request_counts.completed == lines
    output = read_lines(client, done.output_file_id)
    assert sorted(x["custom_id"] for x in output) == sorted(prompts)  # each result once
    assert done.error_file_id is None
    # each line reached the upstream once: none was cut mid-way and run again
    sent = [json.dumps(b.get("messages")) for b in RECEIVED if marker in json.dumps(b.get("messages"))]
    assert len(sent) == lines, f"{len(sent)} upstream calls for {lines} lines"
    assert usage_of(url, "acme") == (lines, sum(expected_tokens(p) for p in prompts.values()))


def test_workers_never_race_for_the_last_line(
    gateway: tuple[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, app = gateway
    _slow_key_checks(app, monkeypatch)
    with structlog.testing.capture_logs() as logs:
        # 4 workers take lines 0-3 together and come back together for the one line left
        _run_and_check(url, "lastline", 5, sleep_ms=20)
    failed = [e for e in logs if e["event"] in ("batch_job_failed", "batches_runner_failed")]
    assert not failed, failed
    assert sum(e["event"] == "batch_running" for e in logs) == 1  # never resumed: it never failed


def test_a_store_error_mid_job_cuts_no_line_in_flight(
    gateway: tuple[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, app = gateway
    book = app.state.batches.book  # type: ignore[attr-defined]
    real_save = book.save
    failures: list[str] = []

    async def save_failing_once(tenant: str, record: BatchRecord) -> None:
        # the job saves its counts while other lines are in flight: the store fails that once
        if record.status == "in_progress" and record.request_counts.completed >= 1 and not failures:
            failures.append(record.id)
            raise StoreUnavailable("injected: the store is down for a moment")
        await real_save(tenant, record)

    monkeypatch.setattr(book, "save", save_failing_once)
    _run_and_check(url, "midjob", 8, sleep_ms=300)
    assert failures  # the outage happened mid-job
