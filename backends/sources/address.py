"""Model addresses: `hf://org/name[@revision][/path]`, `s3://bucket/key-or-prefix`,
`https://host/file[#sha256=HEX]` (and `http://`); anything without a scheme is a local path."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from backends.sources.errors import SourceError

Scheme = Literal["hf", "s3", "https"]

_HF = re.compile(r"hf://(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<rev>[^/\s]+))?(?:/(?P<path>\S+))?")
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: a relative path that reads like a Hugging Face repo id (`org/name`): worth suggesting `hf://`
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
SCHEMES = "hf://, s3://, https:// (or http://)"


@dataclass(frozen=True)
class Address:
    """One parsed model address; `text` is what the config says (the cache's key)."""

    text: str
    scheme: Scheme
    #: hf: `org/name`; s3: the bucket; https: the URL without its fragment
    location: str
    #: hf: the branch, tag or commit asked for (None: main); s3: the key or prefix; https: unused
    ref: str | None = None
    #: hf: a file or folder inside the repository to hand to the loader (None: the repository)
    path: str | None = None
    #: https: the sha256 the `#sha256=` fragment promises
    sha256: str | None = None


    @property
    def key(self) -> str:
        """The address without its moving part (an hf:// branch or tag): with the resolved revision
        it names one snapshot, so `hf://org/name` and `hf://org/name@main` share theirs."""
        if self.scheme == "hf":
            return f"hf://{self.location}/{self.path or ''}"
        return self.location if self.scheme == "https" else self.text


def is_address(text: str) -> bool:
    """Whether `text` names a remote model (has a scheme) rather than a local path."""
    return "://" in text


def parse_address(text: str) -> Address:
    """Parse a model address.

    Raises:
        SourceError: an unknown scheme or a malformed address (one line saying the accepted forms).
    """
    scheme = text.partition("://")[0].lower()
    if scheme == "hf":
        match = _HF.fullmatch(text)
        if match is None:
            raise SourceError(f"{text}: a Hugging Face address is hf://org/name[@revision][/path]")
        path = (match["path"] or "").strip("/") or None
        return Address(text, "hf", match["repo"], ref=match["rev"], path=path)
    if scheme == "s3":
        bucket, _, key = text[len("s3://") :].partition("/")
        if not bucket or not key:
            raise SourceError(f"{text}: an S3 address is s3://bucket/key or s3://bucket/prefix/")
        return Address(text, "s3", bucket, ref=key)
    if scheme in ("https", "http"):
        return _parse_url(text)
    raise SourceError(f"{text}: unknown model address scheme {scheme}://; use {SCHEMES} or a local path")


def _parse_url(text: str) -> Address:
    parts = urlsplit(text)
    if not parts.netloc or not parts.path.strip("/"):
        raise SourceError(f"{text}: a URL address names a file, https://host/path/file[#sha256=HEX]")
    sha256 = None
    if parts.fragment:
        key, _, value = parts.fragment.partition("=")
        if key != "sha256" or not _SHA256.fullmatch(value.lower()):
            raise SourceError(f"{text}: the URL's fragment must be #sha256= and 64 hex digits")
        sha256 = value.lower()
    return Address(text, "https", parts._replace(fragment="").geturl(), sha256=sha256)


#: a last segment ending so names a file, not a repository (`models/digits.onnx` is a missing file)
_FILE_SUFFIXES = (".onnx", ".xml", ".bin", ".safetensors", ".pt", ".pth", ".gguf", ".json", ".npz", ".pb")


def looks_like_repo_id(text: str) -> bool:
    """Whether a local path that does not exist reads like `org/name` (then `hf://` is suggested)."""
    return _REPO_ID.fullmatch(text) is not None and not text.lower().endswith(_FILE_SUFFIXES)


#: files a model file needs beside it (OpenVINO IR weights, ONNX external data), by suffix
_COMPANIONS = {".xml": (".bin",), ".onnx": (".onnx.data", ".onnx_data", ".data")}


def companions(name: str) -> tuple[str, ...]:
    """The names of the files `name` loads from beside it (`model.xml` -> `model.bin`)."""
    for suffix, extra in _COMPANIONS.items():
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            return tuple(stem + e if e != ".onnx.data" else name + ".data" for e in extra)
    return ()
