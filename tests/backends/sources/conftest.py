"""Stores for the model-source tests: a Hub-compatible endpoint, a file server and moto's S3."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.backends.sources.stores import S3, Store, http_store, s3_store


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """The Hub endpoint (HF_ENDPOINT points at it) and the file server; no token, online."""
    with http_store() as running:
        monkeypatch.setenv("HF_ENDPOINT", running.url)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield running


@pytest.fixture(scope="session")
def _moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3]:
    with s3_store(tmp_path_factory.mktemp("moto") / "recording.jsonl") as running:
        yield running


@pytest.fixture
def s3(_moto: S3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3:
    """moto's S3 through the standard variables (AWS_ENDPOINT_URL and the AWS_* credentials)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", _moto.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    _moto.reset()
    return _moto


def put(bucket: str, files: dict[str, bytes]) -> None:
    """Create `bucket` (if new) and upload `files` (key -> content) with boto3."""
    import boto3

    client = boto3.client("s3")
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        client.create_bucket(Bucket=bucket)
    for key, data in files.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)
