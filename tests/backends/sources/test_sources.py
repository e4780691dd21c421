"""Model addresses fetched into the cache from real-protocol stores: once, verified, resumed."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from backends.sources import ModelSources, StorageSpec, parse_address
from backends.sources.errors import (
    ChecksumMismatch,
    DiskFull,
    NotCached,
    SourceError,
    SourceForbidden,
    SourceNotFound,
    Unreachable,
)
from tests.backends.sources.conftest import put
from tests.backends.sources.stores import S3, Store

WEIGHTS = os.urandom(300_000)


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(WEIGHTS)
    (folder / "pytorch_model.bin").write_bytes(b"duplicate weights, skipped")
    (folder / "onnx").mkdir()
    (folder / "onnx" / "model.onnx").write_bytes(b"onnx bytes")
    return folder


def _sources(tmp_path: Path, **storage: object) -> ModelSources:
    return ModelSources(StorageSpec(cache_dir=str(tmp_path / "cache"), **storage))  # type: ignore[arg-type]


def test_hf_repository_is_fetched_once_at_its_commit(store: Store, tmp_path: Path) -> None:
    repo = store.add_repo("acme/tiny", _folder(tmp_path))
    path = _sources(tmp_path).fetch("hf://acme/tiny")
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    assert (path / "model.safetensors").read_bytes() == WEIGHTS
    assert store.served.file_gets == 2
    # a second gateway on the same cache: the commit is looked up, nothing is downloaded
    again = _sources(tmp_path).fetch("hf://acme/tiny@main")
    assert again.parent.parent == path.parent.parent and store.served.file_gets == 2
    pinned = _sources(tmp_path).fetch(f"hf://acme/tiny@{repo.commit}/onnx/model.onnx")
    assert pinned.read_bytes() == b"onnx bytes" and pinned.name == "model.onnx"


def test_hf_errors_are_one_line_and_say_what_to_do(store: Store, tmp_path: Path) -> None:
    store.add_repo("acme/tiny", _folder(tmp_path))
    sources = _sources(tmp_path)
    with pytest.raises(SourceNotFound, match=r"repository acme/missing not found at http://127.0.0.1:\d+ \(if it is private or gated, set HF_TOKEN\)"):
        sources.check("hf://acme/missing")
    with pytest.raises(SourceNotFound, match="revision v9 not found in acme/tiny"):
        sources.check("hf://acme/tiny@v9")
    with pytest.raises(SourceNotFound, match="no file nope.onnx"):
        sources.check("hf://acme/tiny/nope.onnx")
    store.served.token = "secret"
    with pytest.raises(SourceError, match="HF_TOKEN") as refused:
        sources.check("hf://acme/tiny")
    assert "\n" not in str(refused.value)
    os.environ["HF_TOKEN"] = "secret"  # the store fixture's monkeypatch removes it again
    try:
        assert sources.check("hf://acme/tiny").revision == store.repos["acme/tiny"].commit
    finally:
        del os.environ["HF_TOKEN"]


def test_address_forms() -> None:
    hf = parse_address("hf://org/name@v1.2/onnx/model.onnx")
    assert (hf.location, hf.ref, hf.path) == ("org/name", "v1.2", "onnx/model.onnx")
    assert parse_address("s3://bucket/models/digits/").ref == "models/digits/"
    url = parse_address("https://example.org/m.onnx#sha256=" + "a" * 64)
    assert url.location == "https://example.org/m.onnx" and url.sha256 == "a" * 64
    for bad, why in (
        ("gs://bucket/key", "unknown model address scheme gs://"),
        ("hf://just-a-name", "hf://org/name"),
        ("s3://bucket", "s3://bucket/key"),
        ("https://example.org/m.onnx#md5=00", "#sha256="),
    ):
        with pytest.raises(SourceError, match=why):
            parse_address(bad)


def test_s3_object_with_its_companion_and_a_prefix(s3: S3, tmp_path: Path) -> None:
    put("models", {"ir/digits.xml": b"<xml/>", "ir/digits.bin": b"weights", "ir/other.bin": b"no",
                   "onnx/m.onnx": b"onnx"})
    sources = _sources(tmp_path)
    xml = sources.fetch("s3://models/ir/digits.xml")
    assert xml.name == "digits.xml" and (xml.parent / "digits.bin").read_bytes() == b"weights"
    assert sorted(p.name for p in xml.parent.iterdir()) == ["digits.bin", "digits.xml"]
    folder = sources.fetch("s3://models/ir/")
    assert sorted(p.name for p in folder.iterdir()) == ["digits.bin", "digits.xml", "other.bin"]
    gets = s3.object_gets()
    assert gets == 3  # digits.bin and digits.xml once (blobs are shared by content), other.bin once
    _sources(tmp_path).fetch("s3://models/ir/digits.xml")
    assert s3.object_gets() == gets
    with pytest.raises(SourceNotFound, match="no object or prefix nope in bucket models"):
        sources.check("s3://models/nope")
    with pytest.raises(SourceNotFound, match="bucket absent does not exist"):
        sources.check("s3://absent/key")


def test_s3_without_credentials_names_the_variables(s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(SourceForbidden, match="no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        _sources(tmp_path).check("s3://models/onnx/m.onnx")


def test_url_checksum_is_verified(store: Store, tmp_path: Path) -> None:
    store.plain["m.onnx"] = b"model bytes"
    good = hashlib.sha256(b"model bytes").hexdigest()
    sources = _sources(tmp_path)
    path = sources.fetch(f"{store.url}/files/m.onnx#sha256={good}")
    assert path.read_bytes() == b"model bytes" and path.name == "m.onnx"
    with pytest.raises(ChecksumMismatch, match=f"checksum mismatch on m.onnx: sha256 is {good}, {'0' * 64} expected"):
        sources.fetch(f"{store.url}/files/m.onnx#sha256={'0' * 64}")
    assert sources.cached(f"{store.url}/files/m.onnx#sha256={'0' * 64}") is None
    assert not list((tmp_path / "cache" / "partial").iterdir())
    with pytest.raises(SourceNotFound, match="answered 404: no such file"):
        sources.check(f"{store.url}/files/absent.onnx")


def test_a_download_cut_midway_resumes_and_is_never_served_half(store: Store, tmp_path: Path) -> None:
    store.add_repo("acme/tiny", _folder(tmp_path))
    store.served.cut_after = 100_000
    sources = _sources(tmp_path)
    with pytest.raises(Unreachable):
        sources.fetch("hf://acme/tiny")
    assert sources.cached("hf://acme/tiny") is None  # nothing half-written is visible
    parts = list((tmp_path / "cache" / "partial").iterdir())
    assert [p.stat().st_size for p in parts] == [100_000]
    path = sources.fetch("hf://acme/tiny")
    assert (path / "model.safetensors").read_bytes() == WEIGHTS
    # each byte crossed the wire once: the second try asked for the rest only
    assert store.served.file_bytes == len(WEIGHTS) + len('{"model_type": "llama"}')


def test_a_damaged_cached_file_is_fetched_again(store: Store, tmp_path: Path) -> None:
    store.add_repo("acme/tiny", _folder(tmp_path))
    path = _sources(tmp_path).fetch("hf://acme/tiny")
    weights = path / "model.safetensors"
    os.chmod(weights, 0o644)
    with weights.open("r+b") as f:  # same size, one byte flipped
        f.seek(10)
        f.write(bytes([WEIGHTS[10] ^ 0xFF]))
    assert _sources(tmp_path).cached("hf://acme/tiny") is None
    assert _sources(tmp_path, verify="size").cached("hf://acme/tiny") is not None
    again = _sources(tmp_path).fetch("hf://acme/tiny")
    assert (again / "model.safetensors").read_bytes() == WEIGHTS
    assert store.served.file_gets == 3


def test_offline_serves_the_cache_and_refuses_what_it_lacks(store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store.add_repo("acme/tiny", _folder(tmp_path))
    path = _sources(tmp_path).fetch("hf://acme/tiny")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the network is gone
    offline = _sources(tmp_path, offline=True)
    assert offline.fetch("hf://acme/tiny") == path
    with pytest.raises(NotCached, match=r"hf://acme/other is not in the model cache .* and offline mode is on .*fleetgate pull"):
        offline.fetch("hf://acme/other")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _sources(tmp_path).fetch("hf://acme/tiny") == path
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(Unreachable, match="cannot reach http://127.0.0.1:9"):
        _sources(tmp_path).fetch("hf://acme/tiny")


def test_concurrent_fetches_download_each_file_once(store: Store, tmp_path: Path) -> None:
    store.add_repo("acme/tiny", _folder(tmp_path))
    paths: list[Path] = []
    threads = [threading.Thread(target=lambda: paths.append(_sources(tmp_path).fetch("hf://acme/tiny"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 1 and store.served.file_gets == 2


def test_no_room_is_refused_before_the_first_byte(store: Store, tmp_path: Path) -> None:
    repo = store.add_repo("acme/tiny", _folder(tmp_path))
    repo.files["huge.safetensors"] = b""
    store.claimed["huge.safetensors"] = 1 << 60
    with pytest.raises(DiskFull, match=r"disk full: it needs .* MB and the model cache .* has .* MB free"):
        _sources(tmp_path).check("hf://acme/tiny")
    assert store.served.file_gets == 0


def test_a_damaged_blob_is_not_reused_by_another_address(store: Store, tmp_path: Path) -> None:
    store.plain["m.onnx"] = WEIGHTS
    sha = hashlib.sha256(WEIGHTS).hexdigest()
    sources = _sources(tmp_path)
    sources.fetch(f"{store.url}/files/m.onnx#sha256={sha}")
    blob = tmp_path / "cache" / "blobs" / sha
    os.chmod(blob, 0o644)
    with blob.open("r+b") as f:
        f.write(b"\0" * 16)
    folder = tmp_path / "same-bytes"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(WEIGHTS)  # an LFS file: the Hub names it by the same sha256
    store.add_repo("acme/same", folder)
    path = sources.fetch("hf://acme/same/model.onnx")
    assert path.read_bytes() == WEIGHTS and store.served.file_gets == 2  # fetched again, not linked
