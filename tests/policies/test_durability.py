"""SQLite durability: keys and usage survive a restart and a `kill -9` of the process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from policies.keys import KeyService
from policies.stores import open_store
from policies.types import Quotas
from tests.policies.helpers import ACME, admission

ROOT = Path(__file__).resolve().parents[2]


async def test_usage_keys_and_quotas_survive_reopen(tmp_path, clock) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = await open_store(url)
    keys = KeyService(store, clock)
    record, secret = await keys.create("acme", name="durable")
    adm = admission(store, clock, quotas=Quotas(tokens_per_day=100))
    await adm.reconcile(await adm.admit(ACME, "m", 60), 60)
    await store.close()

    store = await open_store(url)
    try:
        assert (await KeyService(store, clock).authenticate(secret)).key_id == record.key_id
        adm = admission(store, clock, quotas=Quotas(tokens_per_day=100))
        assert [(u.period, u.requests, u.tokens) for u in await adm.usage()] == [
            ("2026-11", 1, 60),
            ("2026-11-21", 1, 60),
        ]
        await adm.admit(ACME, "m", 40)  # the quota spent before the restart still counts
        try:
            await adm.admit(ACME, "m", 1)
            raise AssertionError("quota was lost across the restart")
        except Exception as exc:  # noqa: BLE001
            assert getattr(exc, "code", None) == "quota_exceeded"
    finally:
        await store.close()


_CHILD = textwrap.dedent(
    """
    import asyncio, sys, time
    from policies.admission import Admission
    from policies.principal import Principal
    from policies.stores import open_store
    from policies.types import TenantSpec

    async def main() -> None:
        store = await open_store(sys.argv[1])
        adm = Admission(store, {"acme": TenantSpec()}, time.time)
        who = Principal("acme", "0123456789ab", ("*",))
        n = 0
        while True:
            r = await adm.admit(who, "m", 20)
            await adm.reconcile(r, 7)
            n += 1
            print(n, flush=True)  # the "answer" goes out only after reconcile returned

    asyncio.run(main())
    """
)


async def test_acknowledged_usage_survives_kill_9(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, url],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        text=True,
    )
    acknowledged = 0
    deadline = time.monotonic() + 60
    try:
        assert child.stdout is not None
        while acknowledged < 200 and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            acknowledged = int(line)
        os.kill(child.pid, signal.SIGKILL)  # in the middle of its next admit/reconcile
        for line in child.stdout.read().split():  # what it acknowledged before it died
            acknowledged = int(line)
    finally:
        child.wait(timeout=10)
    assert acknowledged >= 200, "the child did not get going"
    store = await open_store(url)
    try:
        (month,) = [u for u in await store.usage("acme") if len(u.period) == 7]
        assert month.requests >= acknowledged
        assert month.tokens >= 7 * acknowledged
        assert month.requests <= acknowledged + 1  # at most the one in flight at the kill
    finally:
        await store.close()
