"""Loopback stores speaking the real protocols: a Hugging Face Hub (the API paths huggingface_hub
calls, through HF_ENDPOINT), a plain file server (https:// addresses are served over http:// here),
and moto's S3 server. Each counts what it served, so a test can say "downloaded nothing"."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from tests.servers import free_port

#: files stored through LFS on the Hub (named by their sha256); the rest are kept in git
_LFS_SUFFIXES = (".safetensors", ".onnx", ".bin", ".xml")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass
class Repo:
    #: path -> content at the one commit the repository has
    files: dict[str, bytes]
    commit: str
    #: branch and tag names -> the commit
    refs: dict[str, str] = field(default_factory=dict)


@dataclass
class Served:
    """What a server answered: requests per (method, route kind), file bytes sent."""

    requests: Counter[str] = field(default_factory=Counter)
    file_bytes: int = 0
    #: stop a file response after this many bytes (the connection drops): a download killed midway
    cut_after: int | None = None
    #: the Bearer token every Hub request must carry (None: public)
    token: str | None = None
    #: seconds to wait after each 64 KiB of a file (a slow link, for killing a download midway)
    pace_s: float = 0.0
    #: file name -> the size the Hub's listing claims (a model too large for the disk)
    claimed: dict[str, int] = field(default_factory=dict)

    @property
    def file_gets(self) -> int:
        return self.requests["GET file"]


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # quiet: pytest shows failures
        pass

    def do_HEAD(self) -> None:  # noqa: N802 - the stdlib's naming
        self._route(head=True)

    def do_GET(self) -> None:  # noqa: N802
        self._route(head=False)

    def _route(self, head: bool) -> None:
        served = self.server.served
        path = self.path.split("?")[0]
        if served.token is not None and self.headers.get("authorization") != f"Bearer {served.token}":
            served.requests["denied"] += 1
            return self._answer(401, b"{}", {"X-Error-Message": "Invalid credentials in Authorization header"})
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path):
            served.requests["GET info"] += 1
            return self._info(match[1], match[2] or "main")
        if match := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo = self.server.repos.get(match[1])
            commit = repo.refs.get(match[2], match[2]) if repo else None
            data = repo.files.get(match[3]) if repo and commit == repo.commit else None
            headers = {"X-Repo-Commit": commit or ""}
            return self._file(data, head, headers, match[3])
        if path.startswith("/files/"):
            return self._file(self.server.plain.get(path.removeprefix("/files/")), head, {}, path)
        self._answer(404, b"not found")

    def _info(self, repo_id: str, revision: str) -> None:
        repo = self.server.repos.get(repo_id)
        if repo is None:
            return self._answer(404, b"{}", {"X-Error-Code": "RepoNotFound"})
        commit = repo.refs.get(revision, revision)
        if commit != repo.commit:
            return self._answer(404, b"{}", {"X-Error-Code": "RevisionNotFound"})
        siblings = []
        for name, data in sorted(repo.files.items()):
            size = self.server.served.claimed.get(name, len(data))
            entry: dict[str, object] = {"rfilename": name, "size": size, "blobId": git_blob_id(data)}
            if name.endswith(_LFS_SUFFIXES):
                sha = hashlib.sha256(data).hexdigest()
                entry["lfs"] = {"size": size, "sha256": sha, "pointerSize": 134}
            siblings.append(entry)
        body = {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "siblings": siblings, "private": False}
        self._answer(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def _file(self, data: bytes | None, head: bool, headers: dict[str, str], name: str) -> None:
        served = self.server.served
        if data is None:
            return self._answer(404, b"not found", {"X-Error-Code": "EntryNotFound"})
        served.requests[f"{'HEAD' if head else 'GET'} file"] += 1
        start = 0
        if match := re.fullmatch(r"bytes=(\d+)-", self.headers.get("range", "")):
            start = int(match[1])
        etag = hashlib.sha256(data).hexdigest() if name.endswith(_LFS_SUFFIXES) else git_blob_id(data)
        headers = {**headers, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        status = 206 if start else 200
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if head:
            return
        if served.cut_after is not None and len(body) > served.cut_after:
            self.wfile.write(body[: served.cut_after])
            served.file_bytes += served.cut_after
            served.cut_after = None  # once: the next try gets the rest
            self.close_connection = True
            return
        step = 1 << 16 if served.pace_s else len(body) or 1
        for at in range(0, len(body), step):
            self.wfile.write(body[at : at + step])
            served.file_bytes += len(body[at : at + step])
            if served.pace_s:
                self.wfile.flush()
                time.sleep(served.pace_s)

    def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    repos: dict[str, Repo]
    plain: dict[str, bytes]
    served: Served

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients that hang up (a cut download) are part of these tests


@dataclass
class Store:
    url: str
    repos: dict[str, Repo]
    #: name -> content of the plain file server (`{url}/files/{name}`)
    plain: dict[str, bytes]
    served: Served

    @property
    def claimed(self) -> dict[str, int]:
        return self.served.claimed

    def add_repo(self, repo_id: str, folder: Path, commit: str | None = None) -> Repo:
        """Publish every file of `folder` as the repository's one commit (branch `main`)."""
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        commit = commit or hashlib.sha1(repo_id.encode() + b"".join(files.values())).hexdigest()
        repo = Repo(files=files, commit=commit, refs={"main": commit})
        self.repos[repo_id] = repo
        return repo


@contextmanager
def http_store() -> Iterator[Store]:
    """A Hub-compatible endpoint and a file server on one loopback port."""
    server = _Server(("127.0.0.1", 0), _Handler)  # the kernel picks the port: no race with other processes
    server.repos, server.plain, server.served = {}, {}, Served()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Store(f"http://127.0.0.1:{server.server_port}", server.repos, server.plain, server.served)
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class S3:
    url: str

    def object_gets(self) -> int:
        """GET requests on objects since the recording was reset (moto's request recorder)."""
        rows = httpx.get(f"{self.url}/moto-api/recorder/download-recording").text.splitlines()
        calls = [json.loads(r) for r in rows if r.strip()]
        paths = [urlsplit(c["url"]) for c in calls if c["method"] == "GET"]
        return sum(1 for p in paths if p.path.strip("/").count("/") >= 1 and "list-type" not in p.query)

    def reset(self) -> None:
        httpx.post(f"{self.url}/moto-api/recorder/reset-recording").raise_for_status()


@contextmanager
def s3_store(recording: Path) -> Iterator[S3]:
    """moto's S3 server on a free loopback port, its requests recorded (moto reads where to, once:
    `recording` applies to the first server of the process)."""
    os.environ.setdefault("MOTO_RECORDER_FILEPATH", str(recording))
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    s3 = S3(f"http://127.0.0.1:{port}")
    httpx.post(f"{s3.url}/moto-api/recorder/start-recording").raise_for_status()
    s3.reset()
    try:
        yield s3
    finally:
        server.stop()
