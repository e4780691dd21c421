"""Is the gRPC port free, and if not, who holds it: checked before serving starts, so a busy port
ends the start with one line naming the port, its holder and the setting to change, instead of
the bind error surfacing as a traceback from inside the app's start-up.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from gateway.config import ConfigError


class GrpcPortBusy(ConfigError):
    """The gRPC port cannot be bound (another process listens on it)."""


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on `port` (any address), from Linux's /proc/net tables."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:  # not Linux, or /proc not mounted
            continue
        for line in lines:
            fields = line.split()
            # local_address is ADDR:PORT in hex; state 0A is LISTEN; field 9 is the socket's inode
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def port_holder(port: int) -> str | None:
    """`pid 1234 (name)` of a process listening on `port`, or None when it cannot be seen (another
    user's process without the rights to look, or a system without /proc)."""
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not wanted:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in wanted:
                    name = (entry / "comm").read_text().strip()
                    return f"pid {entry.name} ({name})"
            except OSError:
                continue
    return None


def _bind_refused(host: str, port: int) -> bool:
    """True when no address of `host` can be bound on `port`, binding as gRPC does (SO_REUSEADDR and
    SO_REUSEPORT: gateway workers share the port, so a port held by a sibling worker is not busy)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False  # an unresolvable host: gRPC's own bind reports it
    refused = 0
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if hasattr(socket, "SO_REUSEPORT"):
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    return False  # not "busy": gRPC's own bind reports what it is
                refused += 1
    return bool(infos) and refused == len(infos)


def busy_message(host: str, port: int) -> str:
    holder = port_holder(port)
    held = f", held by {holder}" if holder else ""
    return (
        f"the gRPC port {host}:{port} is already in use{held}; set `server.grpc_port` to a free port "
        "(or null to serve HTTP alone)"
    )


def check_port_free(host: str, port: int) -> None:
    """Raise GrpcPortBusy (one line: the port, its holder if known, the setting) when `port` is taken."""
    if port != 0 and _bind_refused(host, port):
        raise GrpcPortBusy(busy_message(host, port))
