"""Random ids for the request path: unguessable hex strings without a system call each.

`os.urandom` is one `getrandom(2)` call per id; a request draws two (its request id and its
admission's lease id), and under load at c=16 they showed as ~4 % of a tensor request's gateway CPU
in a py-spy profile (`Call.__init__` and `secrets.token_hex`). Here ids are cut from a 4 KiB buffer of
`os.urandom` bytes, refilled when used up: the same kernel CSPRNG bytes, one call per ~256 ids. The
buffer is per thread (two threads never hand out the same bytes) and dropped in a forked child (a
worker process never repeats its parent's ids).
"""

from __future__ import annotations

import os
import threading

_POOL_BYTES = 4096
_local = threading.local()


def random_hex(nbytes: int = 16) -> str:
    """`nbytes` random bytes as 2 * `nbytes` hex digits (what `secrets.token_hex(nbytes)` gives)."""
    if nbytes < 0:
        raise ValueError("nbytes must not be negative")
    local = _local
    pool: bytes = getattr(local, "pool", b"")
    start = getattr(local, "pos", 0)
    end = start + nbytes
    if end > len(pool):
        pool, start, end = os.urandom(max(_POOL_BYTES, nbytes)), 0, nbytes
        local.pool = pool
    local.pos = end
    return pool[start:end].hex()


def _forget_in_child() -> None:
    global _local
    _local = threading.local()


os.register_at_fork(after_in_child=_forget_in_child)
