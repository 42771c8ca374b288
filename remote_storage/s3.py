"""``S3Storage``: remote storage in an S3 bucket (AWS, or any S3 server: SeaweedFS in tests).

boto3 does the protocol (signing, checksums, pagination); its calls block, so each one runs in
a worker thread under a ``CapacityLimiter`` of ``concurrency_limit`` (the client's connection
pool has the same size). boto3's own retries are off (one attempt per call): the callers retry
with their own backoff and know which operations are safe to repeat. Timeouts are botocore's
connect and read timeouts. A custom ``endpoint`` uses path-style addressing (a bucket name is
not a host there). Keys are put under ``prefix`` (a ``/`` is added between them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import boto3
import botocore.config
import botocore.exceptions
import structlog
import trio

from remote_storage.base import Listing
from remote_storage.config import S3StorageConfig
from remote_storage.errors import (
    RemoteFatalError,
    RemoteNotFoundError,
    RemoteStorageError,
    RemoteTimeoutError,
)

T = TypeVar("T")

_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_FATAL = {"NoSuchBucket", "AccessDenied", "InvalidBucketName", "InvalidAccessKeyId",
          "SignatureDoesNotMatch", "InvalidArgument", "InvalidRange", "400", "403"}
DELETE_BATCH = 1000  # S3's DeleteObjects limit
# urllib3 sends a file body in blocks of 16 KiB by default, each a read, a sendall and a GIL
# hand-off in the worker thread; 1 MiB blocks take about a third less CPU per PUT (0.10 against
# 0.15 CPU-s per 128 MiB on SeaweedFS: bench remote's ingest part). Only how a body is cut into
# send calls; the bytes on the wire are the same.
SEND_BLOCK = 1 << 20

log = structlog.get_logger("remote_storage.s3")


def make_client(config: S3StorageConfig) -> Any:
    """A boto3 S3 client for ``config`` (also used by the benchmark's plain put loop)."""
    session = boto3.session.Session(
        aws_access_key_id=config.access_key_id,
        aws_secret_access_key=config.secret_access_key,
        region_name=config.region,
    )
    bcfg = botocore.config.Config(
        connect_timeout=config.connect_timeout_s,
        read_timeout=config.timeout_s,
        retries={"max_attempts": 1, "mode": "standard"},
        max_pool_connections=config.concurrency_limit,
        s3={"addressing_style": "path" if config.endpoint else "auto",
            # botocore hashes the whole body for SigV4 over http unless told not to: a second
            # read of every layer and about half the client's CPU per PUT (bench remote).
            "payload_signing_enabled": config.payload_signing},
        # Trailing (aws-chunked) checksums are not understood by every S3 server; sizes are
        # checked by the callers against the index.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    client = session.client("s3", endpoint_url=config.endpoint, config=bcfg)
    _set_send_block(client)
    return client


def _set_send_block(client: Any) -> None:
    # botocore has no setting for it: its urllib3 pool manager passes connection_pool_kw to
    # every connection it makes. If a botocore release changes that shape, PUTs still work
    # (in 16 KiB blocks); say so once instead of failing.
    manager = getattr(getattr(getattr(client, "_endpoint", None), "http_session", None), "_manager", None)
    kw = getattr(manager, "connection_pool_kw", None)
    if isinstance(kw, dict):
        kw["blocksize"] = SEND_BLOCK
    else:
        log.warning("botocore's connection pool is not the shape expected; PUT bodies go in "
                    "urllib3's default 16 KiB blocks (more CPU per upload)")


def _translate(exc: Exception, what: str) -> RemoteStorageError:
    if isinstance(exc, botocore.exceptions.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        msg = f"{what}: {code or status} {err.get('Message', '')}".rstrip()
        if code in _NOT_FOUND or status == 404:
            return RemoteNotFoundError(msg)
        if code in _FATAL:
            return RemoteFatalError(msg)
        return RemoteStorageError(msg)
    if isinstance(exc, botocore.exceptions.ReadTimeoutError | botocore.exceptions.ConnectTimeoutError):
        return RemoteTimeoutError(f"{what}: {exc}")
    return RemoteStorageError(f"{what}: {type(exc).__name__}: {exc}")


class S3Storage:
    def __init__(self, config: S3StorageConfig) -> None:
        self.config = config
        self.bucket = config.bucket
        self.prefix = config.prefix.strip("/") + "/" if config.prefix.strip("/") else ""
        self.limiter = trio.CapacityLimiter(config.concurrency_limit)
        self._client: Any = None
        self._bucket_checked = not config.create_bucket

    def _key(self, key: str) -> str:
        if not key or key.startswith("/"):
            raise RemoteFatalError(f"invalid object key {key!r}")
        return self.prefix + key

    def _get_client(self) -> Any:
        if self._client is None:
            self._client = make_client(self.config)
        if not self._bucket_checked:
            try:
                self._client.head_bucket(Bucket=self.bucket)
            except botocore.exceptions.ClientError:
                try:
                    self._client.create_bucket(Bucket=self.bucket)
                except botocore.exceptions.ClientError as exc:
                    if exc.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        raise
            self._bucket_checked = True
        return self._client

    async def _run(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        def call() -> T:
            return fn(self._get_client(), *args)

        try:
            return await trio.to_thread.run_sync(call, limiter=self.limiter)
        except RemoteStorageError:
            raise
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise _translate(exc, what) from exc
        except OSError as exc:
            raise RemoteStorageError(f"{what}: {exc}") from exc

    async def upload(self, key: str, data: bytes) -> None:
        k = self._key(key)
        await self._run(f"PUT {k}", lambda c: c.put_object(Bucket=self.bucket, Key=k, Body=data, ContentLength=len(data)))

    async def upload_file(self, key: str, path: Path) -> int:
        k = self._key(key)

        def put(c: Any) -> int:
            with open(path, "rb") as f:
                size = f.seek(0, 2)
                f.seek(0)
                c.put_object(Bucket=self.bucket, Key=k, Body=f, ContentLength=size)
                return size

        return await self._run(f"PUT {k}", put)

    async def download(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        k = self._key(key)
        if end is not None and end <= start:
            return b""

        def get(c: Any) -> bytes:
            kw: dict[str, Any] = {}
            if start or end is not None:
                kw["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
            resp = c.get_object(Bucket=self.bucket, Key=k, **kw)
            body = resp["Body"]
            try:
                data: bytes = body.read()
            finally:
                body.close()
            return data

        return await self._run(f"GET {k}", get)

    async def download_file(self, key: str, path: Path) -> int:
        k = self._key(key)

        def get(c: Any) -> int:
            resp = c.get_object(Bucket=self.bucket, Key=k)
            body = resp["Body"]
            try:
                with open(path, "wb") as f:
                    for chunk in body.iter_chunks(1 << 20):
                        f.write(chunk)
                    return f.tell()
            finally:
                body.close()

        return await self._run(f"GET {k}", get)

    async def list(self, prefix: str, delimiter: str | None = None) -> Listing:
        full = self.prefix + prefix

        def list_all(c: Any) -> Listing:
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
            if delimiter is not None:
                kw["Delimiter"] = delimiter
            keys: list[str] = []
            prefixes: list[str] = []
            for page in c.get_paginator("list_objects_v2").paginate(**kw):
                keys += [o["Key"][len(self.prefix):] for o in page.get("Contents", ())]
                prefixes += [p["Prefix"][len(self.prefix):] for p in page.get("CommonPrefixes", ())]
            return Listing(sorted(keys), sorted(prefixes))

        return await self._run(f"LIST {full}", list_all)

    async def delete(self, key: str) -> None:
        k = self._key(key)
        await self._run(f"DELETE {k}", lambda c: c.delete_object(Bucket=self.bucket, Key=k))

    async def delete_objects(self, keys: Sequence[str]) -> None:
        full = [self._key(k) for k in keys]
        for i in range(0, len(full), DELETE_BATCH):
            chunk = full[i : i + DELETE_BATCH]

            def delete(c: Any, chunk: list[str] = chunk) -> None:
                resp = c.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True}
                )
                errors = [e for e in resp.get("Errors", ()) if e.get("Code") != "NoSuchKey"]
                if errors:
                    first = errors[0]
                    raise RemoteStorageError(
                        f"DeleteObjects: {len(errors)} keys failed, first {first.get('Key')}: "
                        f"{first.get('Code')} {first.get('Message', '')}"
                    )

            await self._run(f"DELETE {len(chunk)} objects", delete)

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await trio.to_thread.run_sync(client.close)
