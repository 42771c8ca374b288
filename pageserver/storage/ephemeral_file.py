"""``EphemeralFile``: the append-only scratch file behind an in-memory layer.

An in-memory layer appends every serialized value here and keeps only offsets in its index;
values are read back at those offsets (while the layer is open, while frozen, and once more when
it is flushed to an L0 delta layer). The file is ``ephemeral-N`` in the timeline directory,
opened read-write and created exclusively; it is deleted by ``aclose()`` and never survives a
restart (``remove_stale_ephemeral_files`` sweeps leftovers of a crash at timeline load).

Appends go through a ``BufferedWriter`` (``write_buffer_size``, ``double_buffering``, sync mode
and IO engine as configured), and ``read_at`` sees bytes still in a buffer or in a flush in
flight. The framing of values (length headers, blob format) is the in-memory layer's business:
this file only stores and returns byte ranges.

The background flush runs in a nursery the owner passes (the timeline's, which outlives every
in-memory layer); with ``double_buffering=False`` no nursery is needed. ``freeze()`` is called
when the layer is frozen: it writes the tail and drops the buffers (a frozen layer waiting for
its flush should not pin two write buffers), after which reads come from the file.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pageserver.storage.buffered_writer import DEFAULT_WRITE_BUFFER_SIZE, BufferedWriter

if TYPE_CHECKING:
    import trio

    from pageserver.storage.io_engine import IoEngine, IoFile, SyncMode

EPHEMERAL_PREFIX = "ephemeral-"

# Process-wide, so two in-memory layers of one timeline never pick the same name; O_EXCL guards
# against leftovers of another process.
_next_id = itertools.count(1)


class EphemeralFile:
    """Append-only file with reads at offsets; see the module docstring."""

    def __init__(self, file: IoFile, writer: BufferedWriter) -> None:
        self.file = file
        self._writer = writer
        self._deleted = False

    @classmethod
    async def create(
        cls,
        engine: IoEngine,
        directory: str | os.PathLike[str],
        *,
        nursery: trio.Nursery | None = None,
        write_buffer_size: int = DEFAULT_WRITE_BUFFER_SIZE,
        double_buffering: bool = True,
        sync_mode: SyncMode | None = None,
    ) -> EphemeralFile:
        """Create a fresh ``ephemeral-N`` in ``directory``.

        ``double_buffering=True`` needs ``nursery`` (where background flushes run);
        ``sync_mode=None`` takes the engine's ``write_sync_mode``.
        """
        if double_buffering and nursery is None:
            raise ValueError("an ephemeral file with double_buffering needs the owner's nursery")
        for _ in range(1000):
            path = Path(directory) / f"{EPHEMERAL_PREFIX}{next(_next_id)}"
            try:
                file = await engine.open_file(path, "x+", sync_mode=sync_mode)
            except FileExistsError:
                continue
            break
        else:
            raise OSError(errno.EEXIST, f"no free ephemeral file name in {directory}")
        try:
            writer = BufferedWriter(
                file,
                buffer_size=write_buffer_size,
                double_buffering=double_buffering,
                nursery=nursery,
            )
        except BaseException:
            await file.aclose()
            await engine.unlink(path)
            raise
        return cls(file, writer)

    @property
    def path(self) -> Path:
        return self.file.path

    @property
    def length(self) -> int:
        """Bytes appended so far."""
        return self._writer.length

    def __len__(self) -> int:
        return self._writer.length

    @property
    def writer(self) -> BufferedWriter:
        """The underlying writer (its ``stats`` are what the ingest benchmark reports)."""
        return self._writer

    async def append(self, data: bytes | bytearray | memoryview) -> int:
        """Append ``data``; returns its offset. Raises ``FlushFailedError`` if an earlier
        background write failed."""
        return await self._writer.write(data)

    def try_append(self, data: bytes, limit: int = 1 << 62) -> int:
        """``append`` without an await if ``data`` fits in the write buffer and ends at or
        before offset ``limit``; -1 otherwise (nothing appended)."""
        return self._writer.try_write(data, limit)

    def room(self, limit: int = 1 << 62) -> int:
        """Bytes ``try_append`` accepts now (ending at or before ``limit``)."""
        return self._writer.room(limit)

    async def read_at(self, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` (must be within ``length``), buffered or not."""
        return await self._writer.read_at(offset, size)

    async def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """``read_at`` for each ``(offset, size)``; the flushed parts come from the file in one
        engine call (one thread hop with the threadpool engine), however many ranges."""
        return await self._writer.read_many(ranges)

    async def read_all(self) -> bytes:
        """The whole content, e.g. to flush a frozen layer from memory in one pass."""
        return await self._writer.read_at(0, self._writer.length)

    def mapped(self) -> mmap.mmap | None:
        """The whole content mapped read-only (the caller closes it), for the flush of a big
        frozen layer; ``None`` before ``freeze`` wrote the tail (the bytes are not all in the
        file yet: ``read_all`` has them) or when there is nothing to map."""
        return map_readonly(self.file.fd, self._writer.length) if self._writer.closed else None

    async def freeze(self) -> None:
        """No more appends: write the tail, drop the buffers; reads continue from the file."""
        await self._writer.close()

    async def aclose(self) -> None:
        """Close and delete the file. A pending flush error is not raised here (the data is
        being thrown away); it was raised by ``append``/``freeze`` if anyone cared."""
        if self._deleted:
            return
        self._deleted = True
        # A background flush may still be writing to this fd: let it finish first.
        await self._writer.abort()
        await self.file.aclose()
        # Unlinking a large file can block for milliseconds: the engine's way, like its writes.
        await self.file.engine.unlink(self.file.path)


def map_readonly(fd: int, length: int) -> mmap.mmap | None:
    """``length`` bytes of the file ``fd`` mapped read-only (shared: the page cache's own pages,
    no copy); ``None`` for an empty file (which cannot be mapped)."""
    if length <= 0:
        return None
    return mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)


def remove_stale_ephemeral_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete ``ephemeral-*`` files a crashed process left in ``directory``; returns them."""
    removed: list[Path] = []
    for entry in Path(directory).iterdir():
        if entry.name.startswith(EPHEMERAL_PREFIX) and entry.is_file():
            entry.unlink()
            removed.append(entry)
    return removed
