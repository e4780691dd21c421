"""`fleetgate keys` and `fleetgate usage` as a user runs them: exit codes, stdout, one-line errors."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from policies.keys import KeyService, parse_key
from policies.stores import open_store
from tests.servers import free_port
from tests.tenancy.conftest import ROOT, write_config


def fleetgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.serve.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int, needle: str) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fleetgate: ") and needle in lines[0], lines[0]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    # A relative SQLite path resolves against the config file's folder.
    return write_config(
        tmp_path / "fleetgate.yaml",
        'state: {url: "sqlite:///state.db"}\ntenants:\n  a: {}\n  b: {models: ["digits-b*"]}\n',
    )


def test_create_prints_the_secret_alone_on_stdout(config: Path) -> None:
    made = fleetgate(
        "keys",
        "create",
        "--config",
        str(config),
        "--tenant",
        "b",
        "--models",
        "digits-b1",
        "--expires",
        "30d",
    )
    assert made.returncode == 0, made.stderr
    secret = made.stdout.removesuffix("\n")
    assert made.stdout == secret + "\n" and "\n" not in secret
    parsed = parse_key(secret)
    assert parsed is not None, made.stdout
    key_id = parsed[0]
    assert key_id in made.stderr and secret not in made.stderr

    async def check() -> None:
        store = await open_store(f"sqlite:///{config.parent / 'state.db'}")
        try:
            principal = await KeyService(store, time.time).authenticate(secret)
        finally:
            await store.close()
        assert (principal.tenant, principal.key_id, principal.models) == ("b", key_id, ("digits-b1",))

    asyncio.run(check())
    listed = fleetgate("keys", "list", "--config", str(config), "--tenant", "b")
    assert listed.returncode == 0 and key_id in listed.stdout and "active" in listed.stdout
    assert secret not in listed.stdout and parsed[1] not in listed.stdout
    assert fleetgate("keys", "revoke", "--config", str(config), key_id).returncode == 0
    assert "revoked" in fleetgate("keys", "list", "--config", str(config)).stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["keys", "create", "--tenant", "nope"], "unknown tenant 'nope' (configured: a, b)"),
        (["keys", "list", "--tenant", "nope"], "unknown tenant 'nope'"),
        (["usage", "--tenant", "nope"], "unknown tenant 'nope'"),
        (["keys", "create", "--tenant", "a", "--expires", "tomorrow"], "--expires 'tomorrow'"),
        (["keys", "create", "--tenant", "a", "--expires", "2027-13-01"], "--expires '2027-13-01'"),
        (["keys", "create", "--tenant", "a", "--expires", "30x"], "--expires '30x'"),
        (["keys", "create", "--tenant", "a", "--expires", "99999999999d"], "too far in the future"),
        (["keys", "create", "--tenant", "a", "--expires", "2020-01-01T00:00:00Z"], "not in the future"),
        (["keys", "create", "--tenant", "a", "--models", ""], "model globs must be non-empty"),
        (["keys", "revoke", "0123456789ab"], "no key '0123456789ab'"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_input_is_one_line_and_exit_2(config: Path, args: list[str], needle: str) -> None:
    split = 2 if args[0] == "keys" else 1  # --config belongs to the (sub)command
    result = fleetgate(*args[:split], "--config", str(config), *args[split:])
    assert_one_line_error(result, 2, needle)
    # Nothing was created by a refused command.
    assert "\ta\t" not in fleetgate("keys", "list", "--config", str(config)).stdout


@pytest.mark.parametrize("command", [["keys", "create", "--tenant", "a"], ["keys", "list"], ["usage"]])
def test_state_commands_refuse_a_memory_state(tmp_path: Path, command: list[str]) -> None:
    """A key written to a memory:// state would live only in this command's process: refuse, say why."""
    config = write_config(tmp_path / "mem.yaml", 'state: {url: "memory://"}\ntenants:\n  a: {}\n')
    result = fleetgate(*command[:2], "--config", str(config), *command[2:])
    assert_one_line_error(result, 2, "admin API")


def test_invalid_limit_spec_in_config_names_the_field(tmp_path: Path) -> None:
    bad = write_config(tmp_path / "bad.yaml", "tenants:\n  a: {limits: {requests_per_minute: 0}}\n")
    assert_one_line_error(
        fleetgate("keys", "create", "--config", str(bad), "--tenant", "a"), 2, "$.tenants.a.limits"
    )
    typo = write_config(tmp_path / "typo.yaml", "tenants:\n  a: {quotas: {requests_per_dya: 5}}\n")
    assert_one_line_error(fleetgate("usage", "--config", str(typo)), 2, "requests_per_dya")


def test_unreachable_state_store_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    down = write_config(
        tmp_path / "down.yaml", f'state: {{url: "redis://127.0.0.1:{free_port()}/0"}}\ntenants: {{a: {{}}}}\n'
    )
    assert_one_line_error(
        fleetgate("keys", "create", "--config", str(down), "--tenant", "a"), 1, "unavailable"
    )


def test_a_secret_file_keeps_one_key_across_runs(config: Path, tmp_path: Path) -> None:
    """`make run` passes --secret-file var/demo-key: each run prints the same key instead of minting
    another, and a key that stopped working (revoked) is replaced, never printed again."""
    kept = tmp_path / "var" / "demo-key"
    args = ("keys", "create", "--config", str(config), "--tenant", "a", "--name", "make-run")
    first = fleetgate(*args, "--secret-file", str(kept))
    assert first.returncode == 0, first.stderr
    secret = first.stdout.strip()
    assert kept.read_text().strip() == secret and (kept.stat().st_mode & 0o777) == 0o600
    assert secret not in first.stderr
    again = fleetgate(*args, "--secret-file", str(kept))
    assert again.returncode == 0 and again.stdout.strip() == secret, again.stderr
    assert "reusing key" in again.stderr and secret not in again.stderr
    assert again.stderr.count("\n") == 1, again.stderr  # one line: no warning from the key's last use
    listed = fleetgate("keys", "list", "--config", str(config), "--tenant", "a").stdout.splitlines()
    assert len(listed) == 1, listed
    key_id = parse_key(secret)[0]  # type: ignore[index]
    assert fleetgate("keys", "revoke", "--config", str(config), key_id).returncode == 0
    replaced = fleetgate(*args, "--secret-file", str(kept))
    assert replaced.returncode == 0 and "no longer valid" in replaced.stderr
    assert replaced.stdout.strip() not in ("", secret)
    assert kept.read_text().strip() == replaced.stdout.strip()
    # another tenant's kept key is not handed out for this one
    other = fleetgate("keys", "create", "--config", str(config), "--tenant", "b", "--secret-file", str(kept))
    assert other.returncode == 0 and "another tenant" in other.stderr
    assert other.stdout.strip() != replaced.stdout.strip()


def test_version_prints_the_installed_version() -> None:
    from importlib.metadata import version

    shown = fleetgate("--version")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == f"fleetgate {version('fleetgate')}\n"


def test_keys_create_with_limits_and_a_budget_and_usage_prints_spend(config: Path) -> None:
    made = fleetgate(
        "keys", "create", "--config", str(config), "--tenant", "a",
        "--requests-per-minute", "7", "--budget-usd-per-day", "2.5",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    key_id = parse_key(made.stdout.strip())[0]  # type: ignore[index]
    listed = fleetgate("keys", "list", "--config", str(config), "--tenant", "a")
    (line,) = [row for row in listed.stdout.splitlines() if row.startswith(key_id)]
    assert "requests_per_minute=7" in line and "usd_per_day=2.5" in line
    bad = fleetgate("keys", "create", "--config", str(config), "--tenant", "a", "--budget-usd-per-day", "-1")
    assert_one_line_error(bad, 2, "usd_per_day")
    usage = fleetgate("usage", "--config", str(config))
    assert usage.returncode == 0 and usage.stdout.splitlines()[0].endswith("\tcost_usd"), usage.stdout
    by_key = fleetgate("usage", "--config", str(config), "--by-key")
    assert by_key.returncode == 0 and by_key.stdout.startswith("tenant\tkey\tmodel\tdeployment\t"), by_key.stdout
