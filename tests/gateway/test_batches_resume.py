"""A batch job survives `kill -9`: a real gateway process is killed mid-job, a new one resumes the job
where it stopped, and every line is in the output once and on the tenant's bill once (SQLite and Redis)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import openai
import pytest

from tests.conftest import create_key
from tests.gateway.test_batches import chat_line, expected_tokens, jsonl, read_lines, usage_of, wait_for
from tests.openai_upstream import RECEIVED, reply_words
from tests.tenancy.conftest import redis_url, start_gateway, wait_ready  # noqa: F401 - redis_url: fixture

LINES = 40


def resume_yaml(state_url: str, files: Path, upstream_url: str) -> str:
    return f"""
state: {{url: "{state_url}"}}
batches: {{files_dir: "{files}", poll_interval_s: 0.1, claim_ttl_s: 1.5, concurrency: 2}}
tenants:
  acme: {{limits: {{requests_per_minute: 5}}}}
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


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_a_job_killed_mid_way_resumes_with_every_line_once(
    store: str, upstream_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if store == "sqlite":
        state_url = f"sqlite:///{tmp_path / 'state.db'}"
    else:
        state_url = f"{request.getfixturevalue('redis_url')}?prefix=b{tmp_path.name[-8:]}:"
    config = tmp_path / "gateway.yaml"
    config.write_text(resume_yaml(state_url, tmp_path / "files", upstream_url), encoding="utf-8")
    prompts = {f"k{i}": f"sleep-ms-60 resume{i} {store} words here" for i in range(LINES)}
    first = start_gateway(config, tmp_path / "first.log")
    try:
        wait_ready(first)
        key = create_key(first.url, "acme")
        client = openai.OpenAI(base_url=f"{first.url}/v1", api_key=key, max_retries=0)
        file_id = client.files.create(
            file=("in.jsonl", io.BytesIO(jsonl([chat_line(c, p) for c, p in prompts.items()]))),
            purpose="batch",
        ).id
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        seen = wait_for(client, batch.id, {"in_progress"}, completed=6)
        # killed at once: the ~34 lines left take the job about a second more
        assert seen.status == "in_progress" and seen.request_counts.completed < LINES
    finally:
        first.kill()  # SIGKILL, mid-job: lines in flight, nothing flushed on the way out
    second = start_gateway(config, tmp_path / "second.log")
    try:
        wait_ready(second)
        client = openai.OpenAI(base_url=f"{second.url}/v1", api_key=key, max_retries=0)
        done = wait_for(client, batch.id, {"completed", "failed"}, timeout_s=60)
        assert done.status == "completed" and done.request_counts.completed == LINES
        output = read_lines(client, done.output_file_id)
        assert sorted(x["custom_id"] for x in output) == sorted(prompts)  # none lost, none twice
        for x in output:
            text = x["response"]["body"]["choices"][0]["message"]["content"]
            assert text == " ".join(reply_words(prompts[x["custom_id"]], 8))
        assert done.error_file_id is None
        resumed = [
            json.loads(x) for x in (tmp_path / "second.log").read_text().splitlines() if "batch_running" in x
        ]
        assert resumed and resumed[0]["left"] < LINES  # the second process ran only what was left
        # on the bill once per line, though the lines in flight at the kill reached the upstream twice
        assert usage_of(second.url, "acme") == (LINES, sum(expected_tokens(p) for p in prompts.values()))
        sent = [json.dumps(b.get("messages")) for b in RECEIVED if store in json.dumps(b.get("messages"))]
        assert LINES <= len(sent) <= LINES + 2
    finally:
        second.kill()


def test_two_gateways_sharing_a_store_run_each_job_once(upstream_url: str, tmp_path: Path) -> None:
    from gateway.config import parse_config
    from gateway.http.app import create_app
    from tests.servers import serve_app

    text = resume_yaml(f"sqlite:///{tmp_path / 'state.db'}", tmp_path / "files", upstream_url)
    config = parse_config(text, base_dir=tmp_path)
    prompts = {f"t{i}": f"sleep-ms-20 twin{i} shared store" for i in range(30)}
    with serve_app(create_app(config)) as first, serve_app(create_app(config)) as second:
        key = create_key(first, "acme")
        clients = [openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) for url in (first, second)]
        file_id = (
            clients[0]
            .files.create(
                file=("in.jsonl", io.BytesIO(jsonl([chat_line(c, p) for c, p in prompts.items()]))),
                purpose="batch",
            )
            .id
        )
        batch = clients[1].batches.create(  # created on the other replica: the file is shared
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = wait_for(clients[0], batch.id, {"completed", "failed"})
        assert done.status == "completed" and done.request_counts.completed == 30
        assert sorted(x["custom_id"] for x in read_lines(clients[1], done.output_file_id)) == sorted(prompts)
        assert usage_of(first, "acme") == (30, sum(expected_tokens(p) for p in prompts.values()))
    sent = [json.dumps(b.get("messages")) for b in RECEIVED if "twin" in json.dumps(b.get("messages"))]
    assert len(sent) == 30  # one claim: no line ran on both replicas
