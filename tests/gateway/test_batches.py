"""OpenAI Batch API end to end with the real `openai` SDK against a running gateway (SQLite state,
files on disk, the OpenAI upstream of tests/openai_upstream.py as a remote deployment)."""

from __future__ import annotations

import io
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import ADMIN_HEADERS, create_key
from tests.openai_upstream import reply_words
from tests.servers import serve_app


def batch_yaml(upstream_url: str, state: Path, files: Path) -> str:
    return f"""
state: {{url: "sqlite:///{state}"}}
batches: {{files_dir: "{files}", poll_interval_s: 0.1, claim_ttl_s: 2, concurrency: 4}}
tenants:
  acme: {{limits: {{requests_per_minute: 3}}}}
  other: {{}}
  capped: {{quotas: {{tokens_per_day: 30}}}}
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


@dataclass
class BatchGateway:
    url: str
    keys: dict[str, str]

    def client(self, tenant: str = "acme") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.keys[tenant], max_retries=0)


@pytest.fixture(scope="module")
def gw(upstream_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatchGateway]:
    root = tmp_path_factory.mktemp("batches")
    config = parse_config(batch_yaml(upstream_url, root / "state.db", root / "files"), base_dir=root)
    with serve_app(create_app(config)) as url:
        yield BatchGateway(url, {t: create_key(url, t) for t in ("acme", "other", "capped")})


def chat_line(custom_id: str, prompt: str, model: str = "echo", max_tokens: int = 8) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def upload(client: openai.OpenAI, lines: list[dict]) -> str:
    return client.files.create(file=("input.jsonl", io.BytesIO(jsonl(lines))), purpose="batch").id


def start(client: openai.OpenAI, lines: list[dict], window: str = "24h") -> str:
    """Upload `lines` and create a chat completions job of them; its id."""
    file_id = upload(client, lines)
    return client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window=window
    ).id


def wait_for(
    client: openai.OpenAI, batch_id: str, statuses: set[str], timeout_s: float = 30.0, completed: int = 0
):
    """The job once its status is one of `statuses` with at least `completed` lines done."""
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses and batch.request_counts.completed >= completed:
            return batch
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}"
        time.sleep(0.05)


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).content.splitlines() if x.strip()]


def usage_of(url: str, tenant: str) -> tuple[int, int]:
    """(requests, tokens) on the tenant's bill today, from the admin API."""
    rows = httpx.get(f"{url}/admin/usage", params={"tenant": tenant}, headers=ADMIN_HEADERS).json()
    rows = rows["usage"] if isinstance(rows, dict) else rows
    days = [r for r in rows if len(r["period"]) == 10]
    return sum(r["requests"] for r in days), sum(r["tokens"] for r in days)


def background_in_flight(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=ADMIN_HEADERS).text
    found = re.search(r'fleetgate_queue_background\{deployment="echo-remote",state="in_flight"\} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def expected_tokens(prompt: str, max_tokens: int = 8) -> int:
    return len(prompt.split()) + len(reply_words(prompt, max_tokens))


def test_a_batch_runs_end_to_end_through_the_sdk_past_the_per_minute_limit(gw: BatchGateway) -> None:
    client = gw.client()
    before = usage_of(gw.url, "acme")
    prompts = {f"r{i}": f"alpha beta gamma {i}" for i in range(10)}
    lines = [chat_line(cid, p) for cid, p in prompts.items()] + [chat_line("bad-model", "x y", model="nope")]
    file_id = upload(client, lines)
    assert client.files.retrieve(file_id).purpose == "batch"
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"k": "v"}
    )
    assert batch.status == "validating" and batch.request_counts.total == 11 and batch.metadata == {"k": "v"}
    done = wait_for(client, batch.id, {"completed", "failed"})
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
        11,
        10,
        1,
    )
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    output = read_lines(client, done.output_file_id)
    assert sorted(x["custom_id"] for x in output) == sorted(prompts)
    for x in output:
        assert x["response"]["status_code"] == 200 and x["error"] is None
        text = x["response"]["body"]["choices"][0]["message"]["content"]
        assert text == " ".join(reply_words(prompts[x["custom_id"]], 8))
    (failed,) = read_lines(client, done.error_file_id)
    assert failed["custom_id"] == "bad-model" and failed["response"]["status_code"] == 404
    assert failed["response"]["body"]["error"]["code"] == "model_not_found"
    # ten lines ran although the tenant may send three requests a minute, and each is billed once
    spent = usage_of(gw.url, "acme")
    assert spent[0] - before[0] == 10
    assert spent[1] - before[1] == sum(expected_tokens(p) for p in prompts.values())
    # and its interactive requests/minute budget is untouched
    for _ in range(3):
        client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "a b"}], max_tokens=2
        )


def test_completions_lines_listing_and_pagination(gw: BatchGateway) -> None:
    client = gw.client("other")
    line = {
        "custom_id": "c1",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "echo", "prompt": "one two", "max_tokens": 4},
    }
    ids = []
    for _ in range(3):
        file_id = upload(client, [line])
        ids.append(
            client.batches.create(
                input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
            ).id
        )
    done = wait_for(client, ids[-1], {"completed"})
    (out,) = read_lines(client, done.output_file_id)
    assert out["response"]["body"]["choices"][0]["text"] == "two one"
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    rest = client.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in rest.data] == [ids[0]] and not rest.has_more
    assert [b.id for b in client.batches.list(limit=1)] == ids[::-1]  # the SDK pages with `after`
    assert {f.id for f in client.files.list()} >= {done.input_file_id, done.output_file_id}


def test_another_tenant_cannot_see_read_or_cancel(gw: BatchGateway) -> None:
    owner, stranger = gw.client(), gw.client("other")
    file_id = upload(owner, [chat_line("a", "sleep-ms-300 x")])
    batch = owner.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for call in (
        lambda: stranger.files.retrieve(file_id),
        lambda: stranger.files.content(file_id),
        lambda: stranger.files.delete(file_id),
        lambda: stranger.batches.retrieve(batch.id),
        lambda: stranger.batches.cancel(batch.id),
        lambda: stranger.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in {b.id for b in stranger.batches.list()}
    assert file_id not in {f.id for f in stranger.files.list()}
    assert wait_for(owner, batch.id, {"completed"}).request_counts.completed == 1


def test_cancel_stops_the_job_with_what_finished(gw: BatchGateway) -> None:
    client = gw.client()
    lines = [chat_line(f"s{i}", f"sleep-ms-100 w{i}") for i in range(40)]
    batch = client.batches.retrieve(start(client, lines))
    wait_for(client, batch.id, {"in_progress"})
    # its lines wait in the fair queue's background class, not in the tenant's interactive queue
    deadline = time.monotonic() + 10
    while background_in_flight(gw.url) < 1:
        assert time.monotonic() < deadline, "no batch line ever ran in the background class"
        time.sleep(0.02)
    wait_for(client, batch.id, {"in_progress"}, completed=2)
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = wait_for(client, batch.id, {"cancelled"})
    assert done.cancelling_at and done.cancelled_at
    output = read_lines(client, done.output_file_id)
    assert 2 <= len(output) == done.request_counts.completed < 40
    assert len({x["custom_id"] for x in output}) == len(output)
    ended = start(client, [chat_line("q", "q")])
    wait_for(client, ended, {"completed"})
    with pytest.raises(openai.ConflictError):  # a job that has ended cannot be cancelled
        client.batches.cancel(ended)


def test_an_expired_job_ends_expired_with_what_finished(gw: BatchGateway) -> None:
    client = gw.client()
    # 120 lines of 150 ms, 4 at a time, need ~4.5 s: a 2 s window ends with some done, some not
    # (a 1 s window once ended before the shared runner got to the job at all, in a full run)
    lines = [chat_line(f"e{i}", f"sleep-ms-150 w{i}") for i in range(120)]
    done = wait_for(client, start(client, lines, window="2s"), {"expired"})
    output, errors = read_lines(client, done.output_file_id), read_lines(client, done.error_file_id)
    assert output and len(output) + len(errors) == 120
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert done.request_counts.completed == len(output) and done.request_counts.failed == len(errors)


def test_token_quota_counts_and_bad_input_is_refused_clearly(gw: BatchGateway) -> None:
    client = gw.client("capped")  # 30 tokens a day: the first lines fit, the rest are refused
    lines = [chat_line(f"q{i}", "one two three four") for i in range(6)]
    done = wait_for(client, start(client, lines), {"completed"})
    errors = read_lines(client, done.error_file_id)
    assert done.request_counts.completed >= 1 and errors
    assert {e["response"]["body"]["error"]["code"] for e in errors} == {"quota_exceeded"}
    assert usage_of(gw.url, "capped")[1] <= 30
    acme = gw.client()
    bad = [
        (b'{"custom_id": "a"', "line 1: malformed JSON"),
        (jsonl([chat_line("a", "x"), {**chat_line("a", "y")}]), "line 2: custom_id 'a' is not unique"),
        (jsonl([{**chat_line("a", "x"), "url": "/v1/images"}]), "line 1: url must be one of"),
        (
            jsonl([{**chat_line("a", "x"), "body": {"model": "echo", "messages": 3}}]),
            "line 1: body: invalid request",
        ),
    ]
    for data, message in bad:
        with pytest.raises(openai.BadRequestError) as refused:
            acme.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        assert message in refused.value.message
    with pytest.raises(openai.BadRequestError, match="purpose must be `batch`"):
        acme.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line("a", "x")]))), purpose="fine-tune")
    file_id = upload(acme, [chat_line("a", "x")])
    with pytest.raises(openai.BadRequestError, match="not the batch's endpoint"):
        acme.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        acme.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="48h")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{gw.url}/v1", api_key="fg-bad", max_retries=0).batches.list()
    auth = {"Authorization": f"Bearer {gw.keys['acme']}"}
    raw = [
        httpx.get(f"{gw.url}/v1/batches", params={"limit": "x"}, headers=auth),
        httpx.post(f"{gw.url}/v1/files", json={"purpose": "batch"}, headers=auth),
        httpx.post(f"{gw.url}/v1/batches", json={"input_file_id": file_id, "endpoint": "x"}, headers=auth),
        httpx.post(f"{gw.url}/v1/batches", content=b"{", headers={**auth, "content-type": "application/json"}),
    ]
    assert [r.status_code for r in raw] == [400, 415, 400, 400]
    assert all(set(r.json()["error"]) >= {"message", "type", "code"} for r in raw)  # OpenAI's envelope


def test_a_draining_gateway_pauses_batch_lines_instead_of_failing_them(
    upstream_url: str, tmp_path: Path
) -> None:
    """While the gateway drains (SIGTERM), a batch line refused for it stays open, the job pauses
    and takes on nothing new; once serving again it resumes: every line answered, none failed,
    each billed once. (`max_retries: 0`: before the fix the refusals were the lines' answers.)"""
    yaml = batch_yaml(upstream_url, tmp_path / "state.db", tmp_path / "files").replace(
        "concurrency: 4}", "concurrency: 2, max_retries: 0}"
    )
    app = create_app(parse_config(yaml, base_dir=tmp_path))
    with serve_app(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=create_key(url, "other"), max_retries=0)
        lines = [chat_line(f"r{i}", f"sleep-ms-150 line {i}") for i in range(12)]
        batch_id = start(client, lines)
        wait_for(client, batch_id, {"in_progress"}, completed=2)
        drain = app.state.drain
        drain.begin()
        drain.refuse_new()
        time.sleep(1.5)  # (the API itself answers 503 meanwhile)
        drain.draining = drain.refusing = False  # serving again (as a restarted process would)
        done = wait_for(client, batch_id, {"completed"})
        assert (done.request_counts.completed, done.request_counts.failed) == (12, 0)
        assert read_lines(client, done.error_file_id) == []
        assert len(read_lines(client, done.output_file_id)) == 12
        assert usage_of(url, "other")[0] == 12


def test_the_input_of_a_running_batch_cannot_be_deleted(gw: BatchGateway) -> None:
    """A resumed job reads its input again: deleting it mid-job would lose lines already billed."""
    client = gw.client("other")
    file_id = upload(client, [chat_line(f"d{i}", f"sleep-ms-100 line {i}") for i in range(6)])
    batch_id = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    ).id
    with pytest.raises(openai.ConflictError) as info:
        client.files.delete(file_id)
    assert "cancel" in info.value.message
    wait_for(client, batch_id, {"completed"})
    assert client.files.delete(file_id).deleted


def test_a_revoked_key_stops_its_batch(gw: BatchGateway) -> None:
    """A key revoked (say, leaked) while its job runs stops spending the tenant's quota."""
    from policies.keys import parse_key

    key = create_key(gw.url, "other")
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    batch_id = start(client, [chat_line(f"k{i}", f"sleep-ms-150 line {i}") for i in range(40)])
    wait_for(client, batch_id, {"in_progress"}, completed=1)
    key_id = parse_key(key)[0]
    assert httpx.delete(f"{gw.url}/admin/keys/{key_id}", headers=ADMIN_HEADERS).status_code == 200
    reader = gw.client("other")  # another key of the tenant still reads the job
    ended = wait_for(reader, batch_id, {"failed"})
    assert ended.errors.data[0].code == "key_revoked"
    assert ended.request_counts.completed < 40


def test_a_line_past_its_deadline_waits_for_its_turn_instead_of_failing(upstream_url: str, tmp_path: Path) -> None:
    """A 504 (the line's deadline passed, as behind a long interactive rush) is not one of its
    `max_retries`: the line is tried again and answered. (`max_retries: 0`: before, the 504 was it.)"""
    yaml = batch_yaml(upstream_url, tmp_path / "state.db", tmp_path / "files").replace(
        "concurrency: 4}", "concurrency: 2, max_retries: 0}"
    )
    yaml = "server: {request_timeout_s: 0.5}\n" + yaml
    with serve_app(create_app(parse_config(yaml, base_dir=tmp_path))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=create_key(url, "other"), max_retries=0)
        token = f"t{time.monotonic_ns()}"
        batch_id = start(client, [chat_line("late", f"slow-once-{token} words"), chat_line("fine", "words")])
        done = wait_for(client, batch_id, {"completed"})
        assert (done.request_counts.completed, done.request_counts.failed) == (2, 0)
        assert usage_of(url, "other")[0] == 2


def test_a_batch_created_with_a_jwt_runs(upstream_url: str, tmp_path: Path) -> None:
    """A job's owner may be a token's subject (`jwt:<sub>`), not an API key: the job's check that its
    owner is still valid asks the identity step, so the lines run (it failed as "key revoked" when
    the check asked only the API keys)."""
    from tests.jwt_issuer import auth_yaml, serve_issuer

    with serve_issuer() as (issuer, jwks_url):
        yaml = batch_yaml(upstream_url, tmp_path / "state.db", tmp_path / "files") + auth_yaml(jwks_url)
        with serve_app(create_app(parse_config(yaml, base_dir=tmp_path))) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=issuer.token("other", "svc-1"), max_retries=0)
            batch_id = start(client, [chat_line(f"j{i}", f"alpha {i}") for i in range(3)])
            done = wait_for(client, batch_id, {"completed", "failed"})
            assert done.status == "completed", done.errors
            assert done.request_counts.completed == 3


def test_a_keys_own_budget_bounds_its_batch_lines(upstream_url: str, tmp_path: Path) -> None:
    """A key's own budget holds for the lines of the jobs it creates, as for its requests: a key
    worth three requests gets three lines answered, the rest fail with `budget_exceeded` (before,
    lines were held only to the tenant's budget, so a batch spent past the key's)."""
    yaml = batch_yaml(upstream_url, tmp_path / "state.db", tmp_path / "files").replace(
        "    api_key_env: TEST_UPSTREAM_KEY\n", "    api_key_env: TEST_UPSTREAM_KEY\n    pricing: {usd_per_request: 0.1}\n"
    )
    with serve_app(create_app(parse_config(yaml, base_dir=tmp_path))) as url:
        made = httpx.post(
            f"{url}/admin/keys", json={"tenant": "other", "budget": {"usd_per_day": 0.3}}, headers=ADMIN_HEADERS
        )
        assert made.status_code == 201, made.text
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=made.json()["key"], max_retries=0)
        done = wait_for(client, start(client, [chat_line(f"b{i}", f"alpha {i}") for i in range(6)]), {"completed"})
        assert (done.request_counts.completed, done.request_counts.failed) == (3, 3)
        errors = read_lines(client, done.error_file_id)
        assert {line["response"]["body"]["error"]["code"] for line in errors} == {"budget_exceeded"}, errors
