"""``LocalStorage``: remote storage in a local directory (the embedded default, and tests).

A key is a path under the root. Writes go to ``<path>.___temp`` and are renamed into place
after an fsync, with the parent directory fsynced, so a reader (or a crash) sees a whole object
or none. Listing walks the directory; temp files are never listed. File IO runs in worker
threads under a ``CapacityLimiter`` (``concurrency_limit``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import trio

from common.fsync import fsync_dir
from remote_storage.base import Listing
from remote_storage.config import LocalStorageConfig
from remote_storage.errors import RemoteFatalError, RemoteNotFoundError, RemoteStorageError

_TEMP = ".___temp"
T = TypeVar("T")


class LocalStorage:
    def __init__(self, config: LocalStorageConfig) -> None:
        self.root = config.path
        self.limiter = trio.CapacityLimiter(config.concurrency_limit)

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts) or key.endswith(_TEMP):
            raise RemoteFatalError(f"invalid object key {key!r}")
        return self.root.joinpath(*parts)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)
        except FileNotFoundError as exc:
            raise RemoteNotFoundError(str(exc)) from exc
        except OSError as exc:
            raise RemoteStorageError(f"local storage: {exc}") from exc

    def _write(self, key: str, write: Callable[[BinaryIO], int]) -> int:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + _TEMP)
        with open(tmp, "wb") as f:
            size = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
        return size

    async def upload(self, key: str, data: bytes) -> None:
        await self._run(self._write, key, lambda f: f.write(data))

    async def upload_file(self, key: str, path: Path) -> int:
        def copy(f: BinaryIO) -> int:
            with open(path, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)
                return src.tell()

        return await self._run(self._write, key, copy)

    def _read(self, key: str, start: int, end: int | None) -> bytes:
        with open(self._path(key), "rb") as f:
            if end is None:
                f.seek(start)
                return f.read()
            return os.pread(f.fileno(), max(0, end - start), start)

    async def download(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        return await self._run(self._read, key, start, end)

    async def download_file(self, key: str, path: Path) -> int:
        def copy() -> int:
            with open(self._path(key), "rb") as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
                return dst.tell()

        return await self._run(copy)

    def _list(self, prefix: str, delimiter: str | None) -> Listing:
        # The directory that holds every key with this prefix (a prefix may end mid-name).
        head, _, _ = prefix.rpartition("/")
        base = self.root.joinpath(*head.split("/")) if head else self.root
        keys: list[str] = []
        prefixes: set[str] = set()
        if not base.is_dir():
            return Listing([], [])
        for dirpath, dirnames, filenames in os.walk(base):
            rel = os.path.relpath(dirpath, self.root)
            rel_key = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            for name in filenames:
                key = rel_key + name
                if name.endswith(_TEMP) or not key.startswith(prefix):
                    continue
                rest = key[len(prefix):]
                if delimiter is not None and delimiter in rest:
                    prefixes.add(prefix + rest[: rest.index(delimiter) + len(delimiter)])
                else:
                    keys.append(key)
            dirnames.sort()
        return Listing(sorted(keys), sorted(prefixes))

    async def list(self, prefix: str, delimiter: str | None = None) -> Listing:
        return await self._run(self._list, prefix, delimiter)

    def _delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        fsync_dir(path.parent)

    async def delete(self, key: str) -> None:
        await self._run(self._delete, key)

    async def delete_objects(self, keys: Sequence[str]) -> None:
        def delete_all() -> None:
            for key in keys:
                self._delete(key)

        await self._run(delete_all)

    async def aclose(self) -> None:
        pass
