"""Request and lease ids cut from a buffer of os.urandom bytes: the right length, never repeated
(across refills, threads and a forked worker)."""

from __future__ import annotations

import os
import re
import threading

from fleetgate import random_ids
from fleetgate.random_ids import random_hex


def test_ids_are_hex_of_the_asked_length_and_never_repeat_across_refills() -> None:
    ids = [random_hex(16) for _ in range(5_000)]  # ~20 refills of the 4 KiB buffer
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert re.fullmatch(r"[0-9a-f]{24}", random_hex(12))
    assert len(random_hex(5000)) == 10_000  # more than the buffer holds


def test_threads_draw_different_bytes() -> None:
    drawn: list[list[str]] = [[], []]

    def draw(out: list[str]) -> None:
        out.extend(random_hex(16) for _ in range(500))

    threads = [threading.Thread(target=draw, args=(out,)) for out in drawn]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not set(drawn[0]) & set(drawn[1])


def test_a_forked_worker_does_not_repeat_its_parents_ids() -> None:
    random_hex(16)  # the parent holds a partly used buffer
    assert random_ids._local.pool
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: what it draws next
        os.write(write, "".join(random_hex(16) for _ in range(8)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 1024).decode()
    os.close(read)
    parent = "".join(random_hex(16) for _ in range(8))
    assert len(child) == 256 and child != parent
