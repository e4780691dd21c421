"""`fleetgate audit` and the CLI's own changes in the trail: `keys create` and `keys revoke` each
leave one entry as `cli:<user>`; a SIGHUP reload of `fleetgate serve` one as the signal; filters,
JSON lines, one-line errors."""

from __future__ import annotations

import getpass
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.servers import free_port
from tests.tenancy.conftest import ROOT, write_config


def fleetgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.serve.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def config(tmp_path: Path) -> Path:
    return write_config(tmp_path / "fleetgate.yaml", 'state: {url: "sqlite:///state.db"}\ntenants:\n  a: {}\n')


def test_cli_key_changes_are_audited_and_listed(config: Path) -> None:
    made = fleetgate("keys", "create", "--config", str(config), "--tenant", "a", "--name", "ci")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    key_id = secret.split("-")[1]
    assert fleetgate("keys", "revoke", "--config", str(config), key_id).returncode == 0
    listed = fleetgate("audit", "--config", str(config), "--json")
    assert listed.returncode == 0, listed.stderr
    entries = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [e["action"] for e in entries] == ["keys.revoke", "keys.create"]  # newest first
    actor = f"cli:{getpass.getuser()}"
    assert {(e["actor"], e["via"], e["client"], e["target"]) for e in entries} == {(actor, "cli", "local", key_id)}
    assert entries[1]["after"]["tenant"] == "a" and entries[0]["after"] == {"active": False}
    assert secret not in listed.stdout
    table = fleetgate("audit", "--config", str(config), "--action", "keys.create")
    rows = table.stdout.splitlines()
    assert rows[0].startswith("when\tactor") and len(rows) == 2 and "keys.create" in rows[1]
    assert fleetgate("audit", "--config", str(config), "--actor", "nobody").stdout.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["--since", "yesterday"], "--since 'yesterday'"), (["--limit", "0"], "--limit must be within")],
)
def test_bad_options_are_one_line_errors(config: Path, args: list[str], needle: str) -> None:
    result = fleetgate("audit", "--config", str(config), *args)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and needle in result.stderr, result.stderr


def test_a_memory_state_is_refused(tmp_path: Path) -> None:
    path = write_config(tmp_path / "m.yaml", 'state: {url: "memory://"}\ntenants:\n  a: {}\n')
    result = fleetgate("audit", "--config", str(path))
    assert result.returncode == 2 and "GET /admin/audit" in result.stderr


def test_a_sighup_reload_is_audited_as_the_signal(tmp_path: Path) -> None:
    """`fleetgate serve` reloads on SIGHUP; the trail names the signal, not an admin."""
    port = free_port()
    path = write_config(
        tmp_path / "g.yaml",
        f'server: {{port: {port}}}\nstate: {{url: "sqlite:///state.db"}}\ntenants:\n  a: {{}}\n',
    )
    env = {**os.environ, "FLEETGATE_GRPC_PORT": "off"}
    server = subprocess.Popen(
        [sys.executable, "-m", "gateway.serve.cli", "serve", "--config", str(path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.2)
        path.write_text(path.read_text() + "  b: {}\n")  # a second tenant
        server.send_signal(signal.SIGHUP)
        entries: list[dict] = []
        while time.monotonic() < deadline and not entries:
            time.sleep(0.2)
            listed = fleetgate("audit", "--config", str(path), "--json")
            entries = [json.loads(line) for line in listed.stdout.splitlines()]
        (entry,) = entries
        assert (entry["actor"], entry["via"], entry["client"], entry["action"]) == (
            "signal:SIGHUP",
            "signal",
            "local",
            "config.reload",
        )
        assert entry["before"]["tenants"] == ["a"] and entry["after"]["tenants"] == ["a", "b"]
        assert entry["after"]["changed_sections"] == ["tenants"]
    finally:
        server.terminate()
        server.wait(timeout=60)
