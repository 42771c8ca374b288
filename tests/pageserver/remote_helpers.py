"""Test helpers for remote storage: a store that fails or hangs on chosen operations, and the
invariant checks every remote-storage test runs."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from pathlib import Path

import lz4.frame
import trio
import zstandard

from pageserver import remote_layout
from pageserver.storage.index_part import IndexPart
from remote_storage import Listing, RemoteStorage, RemoteStorageError


class FaultyStorage:
    """Wraps a store. ``fail(op, pattern, times)`` makes the next ``times`` calls of ``op``
    (``"upload"`` covers upload and upload_file, ``"download"``, ``"list"``, ``"delete"``
    covers delete and delete_objects) on keys matching ``pattern`` (fnmatch) raise a retryable
    error; ``times=None``: until ``heal``. ``hang(op, pattern, after=n)``: the call after ``n``
    matching ones never returns (a crash at that point, once the test cancels the node);
    ``hung`` is set when it is reached."""

    def __init__(self, inner: RemoteStorage, *, audit: bool = False) -> None:
        self.inner = inner
        # audit: after every upload and delete, the remote state as a crash right then would
        # leave it must pass ``check_remote_invariant`` (``audits`` counts the checks)
        self.audit = audit
        self.audits = 0
        self._fail: list[list[object]] = []
        self._hang: list[list[object]] = []
        self.hung = trio.Event()
        self.calls: list[tuple[str, str]] = []

    def fail(self, op: str, pattern: str = "*", times: int | None = 1) -> None:
        self._fail.append([op, pattern, times])

    def hang(self, op: str, pattern: str = "*", after: int = 0) -> None:
        self._hang.append([op, pattern, after])

    def heal(self) -> None:
        self._fail.clear()
        self._hang.clear()

    async def _check(self, op: str, keys: Sequence[str]) -> None:
        for key in keys:
            self.calls.append((op, key))
        for rule in self._hang:
            r_op, pattern, after = rule
            assert isinstance(pattern, str) and isinstance(after, int)
            if r_op == op and any(fnmatch.fnmatch(k, pattern) for k in keys):
                if after == 0:
                    self.hung.set()
                    await trio.sleep_forever()
                rule[2] = after - 1
        for rule in self._fail:
            r_op, pattern, times = rule
            assert isinstance(pattern, str)
            if r_op == op and any(fnmatch.fnmatch(k, pattern) for k in keys) and times != 0:
                if isinstance(times, int):
                    rule[2] = times - 1
                raise RemoteStorageError(f"injected failure of {op} {keys[0]}")

    async def _audit(self) -> None:
        if self.audit:
            await check_remote_invariant(self.inner)
            self.audits += 1

    async def upload(self, key: str, data: bytes) -> None:
        await self._check("upload", [key])
        await self.inner.upload(key, data)
        await self._audit()

    async def upload_file(self, key: str, path: Path) -> int:
        await self._check("upload", [key])
        size = await self.inner.upload_file(key, path)
        await self._audit()
        return size

    async def download(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        await self._check("download", [key])
        return await self.inner.download(key, start, end)

    async def download_file(self, key: str, path: Path) -> int:
        await self._check("download", [key])
        return await self.inner.download_file(key, path)

    async def list(self, prefix: str, delimiter: str | None = None) -> Listing:
        await self._check("list", [prefix])
        return await self.inner.list(prefix, delimiter)

    async def delete(self, key: str) -> None:
        await self._check("delete", [key])
        await self.inner.delete(key)
        await self._audit()

    async def delete_objects(self, keys: Sequence[str]) -> None:
        await self._check("delete", list(keys))
        await self.inner.delete_objects(keys)
        await self._audit()

    async def aclose(self) -> None:
        await self.inner.aclose()


async def check_remote_invariant(storage: RemoteStorage) -> int:
    """Every index of every generation names only objects that exist, with their sizes.
    Returns how many indexes were checked."""
    listing = await storage.list(remote_layout.tenants_prefix())
    keys = set(listing.keys)
    checked = 0
    for key in listing.keys:
        if remote_layout.index_generation(key) is None:
            continue
        part = IndexPart.from_json(Path(key), await storage.download(key))
        prefix = key.rpartition("/")[0] + "/"
        for name, size in part.layers.items():
            gen = part.generations[name]
            obj = prefix + name + remote_layout.suffix(gen)
            assert obj in keys, f"{key} names {obj}, which is not in remote storage"
            raw = await storage.download(obj)
            stored = part.stored_layer(name)
            assert len(raw) == stored.size, f"{obj}: {len(raw)} bytes, {key} says {stored}"
            if stored.compression == "zstd":
                raw = zstandard.ZstdDecompressor().decompress(raw)
            elif stored.compression == "lz4":
                raw = lz4.frame.decompress(raw)
            assert len(raw) == size, f"{obj}: {len(raw)} bytes as a file, {key} says {size}"
        checked += 1
    return checked
