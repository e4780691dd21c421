"""`s3://bucket/key` or `s3://bucket/prefix/` through boto3: the standard AWS credential chain, and
`AWS_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_S3`) for MinIO, Ceph and other S3-compatible stores."""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Iterator
from typing import Any

from backends.sources.address import Address, companions
from backends.sources.cache import CHUNK
from backends.sources.errors import SourceError, SourceForbidden, SourceNotFound, Unreachable
from backends.sources.types import Listing, RemoteFile

_CREDENTIALS = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or a role)"


def _translate(address: Address, exc: Exception, client: Any) -> SourceError:
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    endpoint = client.meta.endpoint_url
    if isinstance(exc, NoCredentialsError):
        return SourceForbidden(f"{address.text}: no AWS credentials found: {_CREDENTIALS}")
    if isinstance(exc, EndpointConnectionError):
        return Unreachable(f"{address.text}: cannot reach {endpoint}; check AWS_ENDPOINT_URL")
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code == "NoSuchBucket":
            return SourceNotFound(f"{address.text}: bucket {address.location} does not exist at {endpoint}")
        if code in ("404", "NoSuchKey"):
            return SourceNotFound(f"{address.text}: no object or prefix {address.ref} in bucket {address.location}")
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
            return SourceForbidden(f"{address.text}: {endpoint} refused the credentials ({code}); {_CREDENTIALS}")
        return SourceError(f"{address.text}: {endpoint} answered {code}")
    first = str(exc).splitlines()[0] if str(exc) else ""
    return Unreachable(f"{address.text}: {type(exc).__name__}: {first}")


def _file(address: Address, key: str, path: str, size: int, etag: str) -> RemoteFile:
    etag = etag.strip('"')
    md5 = etag if len(etag) == 32 and "-" not in etag else None  # a multipart ETag is not an MD5
    return RemoteFile(
        path=path, size=size, md5=md5, locator=key, identity=f"s3:{address.location}/{key}@{etag}"
    )


class S3Fetcher:
    """An object (and the files it loads from beside it) or every object under a prefix."""

    def __init__(self, read_timeout_s: float = 60.0) -> None:
        import boto3
        from botocore.config import Config

        self._client = boto3.session.Session().client(
            "s3", config=Config(read_timeout=read_timeout_s, retries={"mode": "standard"})
        )

    def _objects(self, address: Address, prefix: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=address.location, Prefix=prefix):
            found += page.get("Contents", [])
        return found

    def _head(self, address: Address, key: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        try:
            return self._client.head_object(Bucket=address.location, Key=key)
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code")) in ("404", "NoSuchKey"):
                return None
            raise

    def list(self, address: Address) -> Listing:
        key = str(address.ref)
        try:
            head = None if key.endswith("/") else self._head(address, key)
            if head is not None:
                return self._single(address, key, head)
            prefix = key if key.endswith("/") else key + "/"
            objects = [o for o in self._objects(address, prefix) if not o["Key"].endswith("/")]
        except Exception as exc:  # noqa: BLE001 - every failure becomes one line naming what to do
            raise _translate(address, exc, self._client) from None
        if not objects:
            raise SourceNotFound(f"{address.text}: no object or prefix {key} in bucket {address.location}")
        files = tuple(_file(address, o["Key"], o["Key"][len(prefix) :], o["Size"], o["ETag"]) for o in objects)
        return Listing(address=address.text, revision=_revision(files), files=files, target="")

    def _single(self, address: Address, key: str, head: dict[str, Any]) -> Listing:
        """One object, with the files it loads from beside it (model.xml's model.bin) when present."""
        folder, name = posixpath.split(key)
        files = [_file(address, key, name, head["ContentLength"], head["ETag"])]
        for other in companions(name):
            found = self._head(address, posixpath.join(folder, other))
            if found is not None:
                files.append(_file(address, posixpath.join(folder, other), other, found["ContentLength"], found["ETag"]))
        return Listing(address=address.text, revision=_revision(tuple(files)), files=tuple(files), target=name)

    def read(self, address: Address, file: RemoteFile, start: int) -> tuple[int, Iterator[bytes]]:
        etag = file.identity.rpartition("@")[2]
        args: dict[str, Any] = {"Bucket": address.location, "Key": file.locator, "IfMatch": etag}
        if start:
            args["Range"] = f"bytes={start}-"
        try:
            response = self._client.get_object(**args)
        except Exception as exc:  # noqa: BLE001
            raise _translate(address, exc, self._client) from None
        offset = start if response.get("ContentRange") else 0
        return offset, response["Body"].iter_chunks(CHUNK)


def _revision(files: tuple[RemoteFile, ...]) -> str:
    """A digest of the objects' keys and ETags: the version of a prefix (or of one object)."""
    return hashlib.sha256("\n".join(sorted(f.identity for f in files)).encode()).hexdigest()[:32]
