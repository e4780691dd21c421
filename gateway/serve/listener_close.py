"""Closing a listening socket without resetting connections the kernel has already accepted.

Closing a TCP listener resets every connection still in its accept queue, and a connection whose
handshake is under way, although their clients may have sent a request already (to them the
connection was open). A drain (gateway/serve/drain.py) instead:

1. stops new handshakes: on Linux a socket filter on the listener drops new SYNs (those clients
   retry after about a second and are then refused by the closed port), while handshakes under way
   complete for `HANDSHAKE_SETTLE_S`, taken by the server as usual;
2. takes what is left in the accept queue (`take_backlog`), then closes the listener, with nothing
   in between that could let another connection in.

Where the filter cannot be set (not Linux), or the listener is shared by the workers of
`server.workers > 1` (a filter would stop the workers still serving), step 1 is skipped: step 2
alone leaves a short window, the last accept to the close, and handshakes still under way.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys

#: how long handshakes under way may complete once new ones are dropped (a round trip, with margin)
HANDSHAKE_SETTLE_S = 0.1

_SO_ATTACH_FILTER = 26
# classic BPF over the TCP header: drop a segment whose flags are SYN without ACK (a new handshake),
# accept everything else (handshakes completing, data on connections already accepted)
_SYN_DROP = [
    (0x30, 0, 0, 13),  # ldb [13]: the flags byte
    (0x54, 0, 0, 0x12),  # and #(SYN|ACK)
    (0x15, 0, 1, 0x02),  # jeq #SYN: next (drop), else skip one (accept)
    (0x06, 0, 0, 0),  # ret #0: drop
    (0x06, 0, 0, 0xFFFFFFFF),  # ret #-1: accept
]


def duplicate(listener: object) -> socket.socket | None:
    """A socket object of our own on a server's listening socket (asyncio or uvloop wrappers),
    which keeps the listener open after the server closes its own; None when it cannot be had."""
    try:
        return socket.socket(fileno=os.dup(listener.fileno()))  # type: ignore[attr-defined]
    except (OSError, AttributeError):
        return None


def stop_new_handshakes(listener: socket.socket) -> bool:
    """Drop new SYNs at `listener` (Linux); False where it cannot be done."""
    if not sys.platform.startswith("linux") or listener.type != socket.SOCK_STREAM:
        return False
    code = b"".join(struct.pack("HBBI", *op) for op in _SYN_DROP)
    program = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("HL", len(_SYN_DROP), ctypes.addressof(program))
    try:
        listener.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)  # the kernel copies it
    except OSError:
        return False
    return True


def take_backlog(listeners: list[socket.socket]) -> list[socket.socket]:
    """Accept every connection waiting in the listeners' queues, then close the listeners."""
    accepted = []
    for listener in listeners:  # no await until all are closed: nothing else gets in
        listener.setblocking(False)
        try:
            while True:
                accepted.append(listener.accept()[0])
        except OSError:  # BlockingIOError: none left
            pass
        finally:
            listener.close()
    return accepted
