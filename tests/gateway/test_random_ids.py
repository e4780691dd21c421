"""Request and lease ids cut from a buffer of os.urandom bytes: the right length, never repeated
(across refills and a forked worker), a buffer per thread."""

from __future__ import annotations

import os
import re
import threading

import pytest

from fleetgate import random_ids
from fleetgate.random_ids import random_hex


def test_ids_are_hex_of_the_asked_length_and_never_repeat_across_refills() -> None:
    ids = [random_hex(16) for _ in range(5_000)]  # ~20 refills of the 4 KiB buffer
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert re.fullmatch(r"[0-9a-f]{24}", random_hex(12))
    assert len(random_hex(5000)) == 10_000  # more than the buffer holds


def test_each_thread_draws_from_its_own_buffer() -> None:
    random_hex(16)
    main_pool = random_ids._local.pool
    seen: list[bytes] = []

    def draw() -> None:
        random_hex(16)
        seen.append(random_ids._local.pool)

    thread = threading.Thread(target=draw)
    thread.start()
    thread.join()
    assert seen and seen[0] is not main_pool and seen[0] != main_pool
    with pytest.raises(ValueError):
        random_hex(-1)


def test_a_forked_worker_does_not_repeat_its_parents_ids() -> None:
    random_hex(16)  # the parent holds a partly used buffer
    assert random_ids._local.pool
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: what it draws next, and out (never back into pytest)
        try:
            os.write(write, "".join(random_hex(16) for _ in range(8)).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 1024).decode()
    os.close(read)
    parent = "".join(random_hex(16) for _ in range(8))
    assert len(child) == 256 and child != parent
