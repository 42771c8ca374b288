"""Both backends (a local directory and S3 on a real SeaweedFS) behave the same: whole
objects, ranged reads, listing with and without a delimiter, idempotent deletes, not-found."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import trio

from pageserver import remote_layout
from remote_storage import (
    LocalStorageConfig,
    RemoteNotFoundError,
    RemoteStorage,
    RemoteStorageError,
    S3StorageConfig,
    make_remote_storage,
)
from remote_storage.base import Listing
from remote_storage.errors import RemoteFatalError
from remote_storage.prefix_delete import delete_prefix
from remote_storage.retry import backoff_delay, retry


@pytest.fixture
async def storage(remote_store: RemoteStorage) -> RemoteStorage:
    return remote_store


async def test_upload_download_ranges(storage: RemoteStorage) -> None:
    data = bytes(range(256)) * 40
    await storage.upload("tenants/t1/timelines/a/index_part.json-00000001", data)
    key = "tenants/t1/timelines/a/index_part.json-00000001"
    assert await storage.download(key) == data
    assert await storage.download(key, 100, 356) == data[100:356]
    assert await storage.download(key, 10000) == data[10000:]
    assert await storage.download(key, 5, 5) == b""


async def test_upload_file_download_file(storage: RemoteStorage, tmp_path: Path) -> None:
    src = tmp_path / "layer"
    payload = b"x" * (3 << 20) + b"tail"
    src.write_bytes(payload)
    assert await storage.upload_file("a/layer-1", src) == len(payload)
    dst = tmp_path / "back"
    assert await storage.download_file("a/layer-1", dst) == len(payload)
    assert dst.read_bytes() == payload


async def test_missing_object_is_not_found(storage: RemoteStorage, tmp_path: Path) -> None:
    with pytest.raises(RemoteNotFoundError):
        await storage.download("no/such/key")
    with pytest.raises(RemoteNotFoundError):
        await storage.download_file("no/such/key", tmp_path / "x")


async def test_listing(storage: RemoteStorage) -> None:
    keys = [
        "tenants/t1/timelines/a/index_part.json-00000001",
        "tenants/t1/timelines/a/index_part.json-00000003",
        "tenants/t1/timelines/a/layer-00000001",
        "tenants/t1/timelines/b/index_part.json-00000002",
        "tenants/t2/timelines/c/index_part.json-00000001",
    ]
    for k in keys:
        await storage.upload(k, k.encode())
    every = await storage.list("tenants/")
    assert every.keys == sorted(keys)
    assert every.prefixes == []
    idx = await storage.list("tenants/t1/timelines/a/index_part.json")
    assert idx.keys == keys[:2]
    dirs = await storage.list("tenants/t1/timelines/", delimiter="/")
    assert dirs.keys == []
    assert dirs.prefixes == ["tenants/t1/timelines/a/", "tenants/t1/timelines/b/"]
    assert (await storage.list("nothing/here/")).keys == []


async def test_delete_is_idempotent(storage: RemoteStorage) -> None:
    for i in range(5):
        await storage.upload(f"d/k{i}", b"v")
    await storage.delete("d/k0")
    await storage.delete("d/k0")  # already gone: not an error
    await storage.delete_objects(["d/k1", "d/k2", "d/missing"])
    assert (await storage.list("d/")).keys == ["d/k3", "d/k4"]


async def test_overwrite_replaces_whole(storage: RemoteStorage) -> None:
    await storage.upload("o/k", b"first version")
    await storage.upload("o/k", b"2nd")
    assert await storage.download("o/k") == b"2nd"


async def test_bad_keys_refused(tmp_path: Path) -> None:
    store = make_remote_storage(LocalStorageConfig(path=tmp_path))
    for key in ("", "/abs", "a/../b", "a//b", "x.___temp"):
        with pytest.raises(RemoteFatalError):
            await store.upload(key, b"")


async def test_local_temp_files_never_listed(tmp_path: Path) -> None:
    store = make_remote_storage(LocalStorageConfig(path=tmp_path))
    await store.upload("a/k", b"v")
    (tmp_path / "a" / "k2.___temp").write_bytes(b"half")
    assert (await store.list("a/")).keys == ["a/k"]


async def test_unreachable_s3_is_a_retryable_error() -> None:
    from common.ports import free_port

    store = make_remote_storage(S3StorageConfig(
        bucket="nobody", endpoint=f"http://127.0.0.1:{free_port()}", access_key_id="x",
        secret_access_key="x", timeout_s=1.0, connect_timeout_s=1.0,
    ))
    with pytest.raises(RemoteStorageError) as info:
        await store.upload("k", b"v")
    assert info.value.retryable
    await store.aclose()


async def test_missing_bucket_is_fatal(seaweedfs: str) -> None:
    store = make_remote_storage(S3StorageConfig(
        bucket="never-created-bucket", endpoint=seaweedfs, access_key_id="x", secret_access_key="x",
    ))
    with pytest.raises(RemoteStorageError) as info:
        await store.download("k")
    assert not info.value.retryable
    await store.aclose()


def test_backoff_is_capped() -> None:
    assert backoff_delay(1) == 0.0
    assert backoff_delay(2) == pytest.approx(0.1)
    assert backoff_delay(50) == 3.0


async def test_retry_until_success_and_not_on_fatal(autojump_clock: trio.testing.MockClock) -> None:
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 5:
            raise RemoteStorageError("503 SlowDown")
        return "ok"

    assert await retry(flaky, what="put") == "ok"
    assert calls == 5

    async def fatal() -> None:
        raise RemoteNotFoundError("gone")

    with pytest.raises(RemoteNotFoundError):
        await retry(fatal, what="get")

    calls = 0
    with pytest.raises(RemoteStorageError):
        await retry(flaky, what="get", attempts=3)
    assert calls == 3


class _Recording:
    """A storage that records the keys of each delete call and can put an object in while a
    deletion runs (a writer that had not stopped yet)."""

    def __init__(self, inner: RemoteStorage, late_key: str | None = None) -> None:
        self.inner = inner
        self.calls: list[list[str]] = []
        self.late_key = late_key

    async def list(self, prefix: str, delimiter: str | None = None) -> Listing:
        return await self.inner.list(prefix, delimiter)

    async def delete_objects(self, keys: Sequence[str]) -> None:
        self.calls.append(list(keys))
        await self.inner.delete_objects(keys)
        if self.late_key is not None:
            key, self.late_key = self.late_key, None
            await self.inner.upload(key, b"late")


async def test_delete_prefix_only_its_objects_indexes_first(storage: RemoteStorage) -> None:
    tl = "tenants/t1/timelines/aa/"
    doomed = [tl + "index_part.json-00000001", tl + "index_part.json-00000002", tl + "L1-00000001",
              tl + "L2-00000002"]
    # neighbours: a timeline whose id starts like it, the tenant's other files, a WAL backup
    kept = ["tenants/t1/timelines/aab/index_part.json-00000001", "tenants/t1/timelines/aa-note",
            "tenants/t1/timelines/a/L1-00000001", "wal/t1/aa/000000010000000000000001"]
    for key in doomed + kept:
        await storage.upload(key, b"x")
    rec = _Recording(storage, late_key=tl + "L3-00000002")
    n = await delete_prefix(rec, tl, first=lambda k: remote_layout.index_generation(k) is not None)  # type: ignore[arg-type]
    assert n == len(doomed) + 1  # the object put meanwhile went too
    assert sorted(rec.calls[0]) == doomed[:2]  # the indexes in a call of their own, first
    assert sorted(rec.calls[1]) == doomed[2:]
    assert rec.calls[2:] == [[tl + "L3-00000002"]]
    assert (await storage.list(tl)).keys == []
    assert sorted((await storage.list("")).keys) == sorted(kept)
    assert await delete_prefix(storage, tl) == 0  # again: nothing to do
    for bad in ("tenants/t1/timelines/aa", "", "/"):
        with pytest.raises(ValueError):
            await delete_prefix(storage, bad)


def test_s3_client_sends_bodies_in_large_blocks() -> None:
    """The botocore client's connections send a PUT body 1 MiB at a time (remote_storage.s3:
    SEND_BLOCK), not urllib3's 16 KiB: a botocore release that moves the knob fails here."""
    from remote_storage.s3 import SEND_BLOCK, make_client

    client = make_client(S3StorageConfig(bucket="probe", endpoint="http://127.0.0.1:9", access_key_id="a",
                                         secret_access_key="a"))
    try:
        pool = client._endpoint.http_session._manager.connection_from_url("http://127.0.0.1:9/")
        assert pool.conn_kw["blocksize"] == SEND_BLOCK
        assert pool._new_conn().blocksize == SEND_BLOCK
    finally:
        client.close()
