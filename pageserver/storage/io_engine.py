"""The pageserver's only door to the file system: ``IoEngine`` and ``IoFile``.

Every read and write of a layer file or an ephemeral file goes through one ``IoEngine`` chosen by
the ``io_engine`` config knob:

- ``"blocking"``: the ``os.*`` call runs inline on the trio thread. Cheapest per call, but the
  whole trio run loop stalls while the kernel works (writeback under memory pressure, fsync).
- ``"threadpool"``: the call runs in ``trio.to_thread.run_sync`` under a ``trio.CapacityLimiter``
  (default 8 threads). Costs a thread hop (tens of µs) per call, but never blocks the run loop,
  and ``os.pwrite``/``os.preadv`` release the GIL, so a background flush really overlaps with the
  Python code that fills the next buffer (see ``buffered_writer``).

Cancellation: threadpool calls are not abandoned on cancel (trio's default), so a write is never
left half-done in the background while the caller believes it was cancelled.

Files are opened with ``IoEngine.open_file(path, mode, sync_mode=...)``, which returns an
``IoFile`` (fd + path + sync mode + the engine). The sync mode knob is for write-path experiments:

- ``"none"``: plain page-cache IO (default).
- ``"dsync"``: ``O_DSYNC``; every write returns only once the data is on stable storage.
- ``"direct"``: ``O_DIRECT``; the kernel requires buffer address, file offset and length to be
  multiples of ``DIRECT_IO_ALIGN`` (4096). ``IoFile.read_at``/``write_at`` take care of the
  alignment (aligned bounce buffers from ``alloc_aligned``, which uses anonymous ``mmap``, so
  page-aligned). A filesystem that refuses ``O_DIRECT`` gives ``DirectIoNotSupportedError``
  naming the path, never a silent fallback to buffered IO.

Durability helpers: ``fsync_file_and_dir`` and ``durable_rename`` (fsync the temp file, rename
it, fsync the directory) are what a layer file goes through before it may be listed in
``index_part.json``.

Every engine keeps ``IoStats`` counters (calls and bytes per operation) so benchmarks can print
e.g. the number of ``preadv`` calls per batch.
"""

from __future__ import annotations

import abc
import ctypes
import errno
import mmap
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

import attrs
import trio

if TYPE_CHECKING:
    # collections.abc.Buffer is 3.12+; annotations only, never needed at run time.
    from typing_extensions import Buffer

IoEngineKind = Literal["blocking", "threadpool"]
SyncMode = Literal["none", "dsync", "direct"]
OpenMode = Literal["r", "r+", "w", "w+", "x", "x+"]

IO_ENGINE_KINDS: tuple[IoEngineKind, ...] = ("blocking", "threadpool")
SYNC_MODES: tuple[SyncMode, ...] = ("none", "dsync", "direct")

#: Alignment of buffer address, file offset and length for ``O_DIRECT``. 4096 covers every
#: logical block size we expect (512 and 4096); the page size makes ``mmap`` buffers aligned.
DIRECT_IO_ALIGN = 4096

DEFAULT_THREADPOOL_THREADS = 8

_T = TypeVar("_T")

# mode -> open(2) flags. "x" modes refuse to overwrite: layer files are created once.
_MODE_FLAGS: dict[str, int] = {
    "r": os.O_RDONLY,
    "r+": os.O_RDWR,
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "w+": os.O_RDWR | os.O_CREAT | os.O_TRUNC,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "x+": os.O_RDWR | os.O_CREAT | os.O_EXCL,
}
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class DirectIoNotSupportedError(OSError):
    """The filesystem holding ``path`` refuses ``O_DIRECT`` (open or first aligned IO failed)."""


class ShortReadError(OSError):
    """A read that had to return ``size`` bytes hit the end of the file first."""


@attrs.define(slots=True)
class IoStats:
    """Counters of one engine's calls; benchmarks read and ``reset()`` them."""

    opens: int = 0
    preads: int = 0
    preadvs: int = 0
    pwrites: int = 0
    pwritevs: int = 0
    fsyncs: int = 0
    fdatasyncs: int = 0
    truncates: int = 0
    run_syncs: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    def reset(self) -> None:
        for field in attrs.fields(IoStats):
            setattr(self, field.name, 0)

    def snapshot(self) -> dict[str, int]:
        return attrs.asdict(self)


def alloc_aligned(size: int) -> mmap.mmap:
    """A zeroed, writable buffer whose address is page-aligned (good for ``O_DIRECT``)."""
    if size <= 0:
        raise ValueError(f"aligned buffer size must be positive, got {size}")
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def align_up(n: int, align: int = DIRECT_IO_ALIGN) -> int:
    return (n + align - 1) // align * align


def align_down(n: int, align: int = DIRECT_IO_ALIGN) -> int:
    return n // align * align


def buffer_address(buf: Buffer) -> int | None:
    """The memory address of a writable buffer, or None for read-only ones (e.g. ``bytes``)."""
    view = memoryview(buf)
    if view.readonly or not view.contiguous:
        return None
    if view.nbytes == 0:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def is_aligned_buffer(buf: Buffer, align: int = DIRECT_IO_ALIGN) -> bool:
    """True if ``buf`` may be handed to an ``O_DIRECT`` write as is (address and length)."""
    addr = buffer_address(buf)
    return addr is not None and addr % align == 0 and memoryview(buf).nbytes % align == 0


def sync_mode_flags(sync_mode: SyncMode) -> int:
    if sync_mode == "none":
        return 0
    if sync_mode == "dsync":
        return os.O_DSYNC
    if sync_mode == "direct":
        if not hasattr(os, "O_DIRECT"):
            raise DirectIoNotSupportedError(errno.EINVAL, "O_DIRECT is not available on this platform")
        return os.O_DIRECT
    raise ValueError(f"unknown sync mode {sync_mode!r}; expected one of {SYNC_MODES}")


# -- the raw syscalls, shared by both engines ----------------------------------------------


def unlink_if_present(path: str | os.PathLike[str]) -> None:
    """``os.unlink`` that takes an absent file as done (blocking: ``IoEngine.unlink`` runs it
    the engine's way)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _pread_all(fd: int, size: int, offset: int) -> bytes:
    """pread until ``size`` bytes or EOF (regular files only return short at EOF)."""
    data = os.pread(fd, size, offset)
    if len(data) == size or not data:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        more = os.pread(fd, size - got, offset + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _pread_direct(fd: int, size: int, offset: int) -> bytes:
    """pread for an O_DIRECT fd: the aligned span into a page-aligned buffer, then the slice."""
    if size == 0:
        return b""
    start = align_down(offset)
    end = align_up(offset + size)
    bounce = alloc_aligned(end - start)
    try:
        n = _preadv_all(fd, [bounce], start)
        lo = offset - start
        return bounce[lo : min(lo + size, max(n, lo))]
    finally:
        bounce.close()


def _pread_many(fd: int, ranges: Sequence[tuple[int, int]], direct: bool) -> list[bytes]:
    read = _pread_direct if direct else _pread_all
    return [read(fd, size, offset) for offset, size in ranges]


def _preadv_all(fd: int, buffers: Sequence[Buffer], offset: int) -> int:
    """preadv until every buffer is full or EOF; returns the bytes read."""
    views = [memoryview(b).cast("B") for b in buffers]
    total = sum(v.nbytes for v in views)
    got = os.preadv(fd, views, offset)
    if got == total or got == 0:
        return got
    done = got
    while done < total:
        # Skip the buffers already filled and resume inside the partly filled one.
        rest: list[memoryview] = []
        skip = done
        for v in views:
            if skip >= v.nbytes:
                skip -= v.nbytes
                continue
            rest.append(v[skip:])
            skip = 0
        n = os.preadv(fd, rest, offset + done)
        if n == 0:
            break
        done += n
    return done


def _pwrite_all(fd: int, data: Buffer, offset: int) -> int:
    view = memoryview(data).cast("B")
    total = view.nbytes
    n = os.pwrite(fd, view, offset)
    while n < total:
        w = os.pwrite(fd, view[n:], offset + n)
        if w == 0:
            raise OSError(errno.EIO, f"pwrite made no progress at offset {offset + n}")
        n += w
    return total


def _pwritev_all(fd: int, buffers: Sequence[Buffer], offset: int) -> int:
    views = [memoryview(b).cast("B") for b in buffers]
    total = sum(v.nbytes for v in views)
    done = os.pwritev(fd, views, offset)
    while done < total:
        rest: list[memoryview] = []
        skip = done
        for v in views:
            if skip >= v.nbytes:
                skip -= v.nbytes
                continue
            rest.append(v[skip:])
            skip = 0
        n = os.pwritev(fd, rest, offset + done)
        if n == 0:
            raise OSError(errno.EIO, f"pwritev made no progress at offset {offset + done}")
        done += n
    return total


def _open(path: str, flags: int, sync_mode: SyncMode) -> int:
    try:
        return os.open(path, flags, 0o644)
    except OSError as exc:
        if sync_mode == "direct" and exc.errno == errno.EINVAL:
            raise DirectIoNotSupportedError(
                errno.EINVAL, f"the filesystem refuses O_DIRECT (sync_mode='direct'): {path}"
            ) from exc
        raise


class IoEngine(abc.ABC):
    """Runs file syscalls either inline (``blocking``) or in worker threads (``threadpool``).

    All methods take raw fds; ``open_file`` wraps one in an ``IoFile`` that remembers its path
    and sync mode. Counters are in ``stats``. One engine is shared by a whole pageserver.
    """

    kind: IoEngineKind

    def __init__(self, *, write_sync_mode: SyncMode = "none") -> None:
        sync_mode_flags(write_sync_mode)  # validate early
        self.stats = IoStats()
        #: Sync mode of files opened for writing without an explicit ``sync_mode`` (the
        #: ``io_sync_mode`` knob; read-only opens always use the page cache).
        self.write_sync_mode: SyncMode = write_sync_mode

    @abc.abstractmethod
    async def _call(self, fn: Callable[..., _T], *args: object) -> _T:
        """Run ``fn(*args)`` this engine's way: the one hook a concrete engine implements."""

    async def run_sync(self, fn: Callable[..., _T], *args: object) -> _T:
        """Run any blocking callable the engine's way (e.g. a whole batch of reads at once)."""
        self.stats.run_syncs += 1
        return await self._call(fn, *args)

    async def unlink(self, path: str | os.PathLike[str]) -> None:
        """Delete ``path`` if it exists (removing a large file can block for milliseconds)."""
        await self.run_sync(unlink_if_present, path)

    async def pread(self, fd: int, size: int, offset: int) -> bytes:
        """Up to ``size`` bytes at ``offset``; shorter only at end of file."""
        self.stats.preads += 1
        data = await self._call(_pread_all, fd, size, offset)
        self.stats.bytes_read += len(data)
        return data

    async def pread_exact(self, fd: int, size: int, offset: int) -> bytes:
        """Exactly ``size`` bytes at ``offset``, else ``ShortReadError``."""
        data = await self.pread(fd, size, offset)
        if len(data) != size:
            raise ShortReadError(
                errno.EIO, f"short read: wanted {size} bytes at offset {offset}, file has {len(data)}"
            )
        return data

    async def preadv(self, fd: int, buffers: Sequence[Buffer], offset: int) -> int:
        """Fill ``buffers`` (writable) from ``offset`` in one vectored read; returns bytes read
        (less than their total only at end of file)."""
        self.stats.preadvs += 1
        n = await self._call(_preadv_all, fd, buffers, offset)
        self.stats.bytes_read += n
        return n

    async def pwrite(self, fd: int, data: Buffer, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (loops on short writes) or raise ``OSError``."""
        self.stats.pwrites += 1
        self.stats.bytes_written += await self._call(_pwrite_all, fd, data, offset)

    async def pwritev(self, fd: int, buffers: Sequence[Buffer], offset: int) -> None:
        """Write all ``buffers`` back to back from ``offset`` or raise ``OSError``."""
        self.stats.pwritevs += 1
        self.stats.bytes_written += await self._call(_pwritev_all, fd, buffers, offset)

    async def fsync(self, fd: int) -> None:
        self.stats.fsyncs += 1
        await self._call(os.fsync, fd)

    async def fdatasync(self, fd: int) -> None:
        self.stats.fdatasyncs += 1
        await self._call(os.fdatasync, fd)

    async def ftruncate(self, fd: int, length: int) -> None:
        self.stats.truncates += 1
        await self._call(os.ftruncate, fd, length)

    async def close_fd(self, fd: int) -> None:
        await self._call(os.close, fd)

    async def open_file(
        self,
        path: str | os.PathLike[str],
        mode: OpenMode = "r",
        *,
        sync_mode: SyncMode | None = None,
    ) -> IoFile:
        """Open ``path``: ``"r"`` read-only, ``"r+"`` read-write, ``"w"``/``"w+"`` create or
        truncate, ``"x"``/``"x+"`` create, failing if it exists (``+`` = also readable).

        ``sync_mode=None`` means the engine's ``write_sync_mode`` for writable modes and
        ``"none"`` for ``"r"``. ``"direct"`` on a filesystem without ``O_DIRECT`` raises
        ``DirectIoNotSupportedError``.
        """
        if sync_mode is None:
            sync_mode = "none" if mode == "r" else self.write_sync_mode
        try:
            flags = _MODE_FLAGS[mode] | _O_CLOEXEC | sync_mode_flags(sync_mode)
        except KeyError:
            raise ValueError(f"unknown open mode {mode!r}; expected one of {list(_MODE_FLAGS)}") from None
        self.stats.opens += 1
        spath = os.fspath(path)
        fd = await self._call(_open, spath, flags, sync_mode)
        return IoFile(engine=self, fd=fd, path=Path(spath), sync_mode=sync_mode)


class BlockingIoEngine(IoEngine):
    """Syscalls inline on the trio thread."""

    kind: IoEngineKind = "blocking"

    async def _call(self, fn: Callable[..., _T], *args: object) -> _T:
        # No checkpoint: the point of this engine is the absence of scheduling overhead.
        return fn(*args)


class ThreadpoolIoEngine(IoEngine):
    """Syscalls in ``trio.to_thread.run_sync`` under one ``CapacityLimiter``."""

    kind: IoEngineKind = "threadpool"

    def __init__(
        self, max_threads: int = DEFAULT_THREADPOOL_THREADS, *, write_sync_mode: SyncMode = "none"
    ) -> None:
        super().__init__(write_sync_mode=write_sync_mode)
        if max_threads < 1:
            raise ValueError(f"threadpool io engine needs at least 1 thread, got {max_threads}")
        self.max_threads = max_threads
        self._limiter: trio.CapacityLimiter | None = None

    @property
    def limiter(self) -> trio.CapacityLimiter:
        # Created lazily: a CapacityLimiter belongs to the trio run that first uses it, and an
        # engine may be constructed before trio.run starts.
        if self._limiter is None:
            self._limiter = trio.CapacityLimiter(self.max_threads)
        return self._limiter

    async def _call(self, fn: Callable[..., _T], *args: object) -> _T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)


def make_io_engine(
    kind: str,
    *,
    max_threads: int = DEFAULT_THREADPOOL_THREADS,
    write_sync_mode: SyncMode = "none",
) -> IoEngine:
    """The engine for the ``io_engine`` config value; unknown kinds are a clear error.
    ``write_sync_mode`` is the default sync mode of files opened for writing."""
    if kind == "blocking":
        return BlockingIoEngine(write_sync_mode=write_sync_mode)
    if kind == "threadpool":
        return ThreadpoolIoEngine(max_threads=max_threads, write_sync_mode=write_sync_mode)
    raise ValueError(f"unknown io_engine {kind!r}; expected one of {IO_ENGINE_KINDS}")


@attrs.define(slots=True, eq=False)
class IoFile:
    """An open file: fd, path, sync mode and the engine that does its IO.

    ``read_at``/``write_at`` hide ``O_DIRECT`` alignment (bounce buffers); the raw ``fd`` may be
    passed to the engine's methods directly by code that does its own alignment.
    """

    engine: IoEngine
    fd: int
    path: Path
    sync_mode: SyncMode
    closed: bool = False

    @property
    def direct(self) -> bool:
        return self.sync_mode == "direct"

    async def read_at(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` (short only at end of file)."""
        if size == 0:
            return b""
        if not self.direct:
            return await self.engine.pread(self.fd, size, offset)
        stats = self.engine.stats
        stats.preadvs += 1
        data = await self.engine._call(_pread_direct, self.fd, size, offset)
        stats.bytes_read += len(data)
        return data

    async def read_exact_at(self, offset: int, size: int) -> bytes:
        """Exactly ``size`` bytes at ``offset``, else ``ShortReadError`` naming the file."""
        data = await self.read_at(offset, size)
        if len(data) != size:
            raise ShortReadError(
                errno.EIO,
                f"short read in {self.path}: wanted {size} bytes at offset {offset}, got {len(data)}",
            )
        return data

    async def read_many_exact_at(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Exactly ``size`` bytes at each ``(offset, size)``, all in one engine call (one thread
        hop for the threadpool engine, however many ranges); ``ShortReadError`` if any range
        runs past the end of the file."""
        if not ranges:
            return []
        stats = self.engine.stats
        stats.run_syncs += 1
        stats.preads += len(ranges)
        datas = await self.engine._call(_pread_many, self.fd, ranges, self.direct)
        for (offset, size), data in zip(ranges, datas, strict=True):
            stats.bytes_read += len(data)
            if len(data) != size:
                raise ShortReadError(
                    errno.EIO,
                    f"short read in {self.path}: wanted {size} bytes at offset {offset}, got {len(data)}",
                )
        return datas

    async def write_at(self, offset: int, data: Buffer) -> None:
        """Write all of ``data`` at ``offset``.

        With ``O_DIRECT``, the offset must be a multiple of ``DIRECT_IO_ALIGN``, and so must the
        length unless the write ends the file (it is then padded and the file truncated back;
        a read-modify-write of partial blocks is deliberately not offered). An unaligned source
        address is fixed with a bounce buffer.
        """
        if not self.direct:
            await self.engine.pwrite(self.fd, data, offset)
            return
        nbytes = memoryview(data).nbytes
        if nbytes == 0:
            return
        if offset % DIRECT_IO_ALIGN:
            raise ValueError(
                f"O_DIRECT write to {self.path} must start {DIRECT_IO_ALIGN}-aligned: "
                f"offset {offset}, length {nbytes}"
            )
        if nbytes % DIRECT_IO_ALIGN == 0 and is_aligned_buffer(data):
            await self.engine.pwrite(self.fd, data, offset)
            return
        # An unaligned length is only allowed where it ends the file: the zero padding written
        # past it is cut off again by a truncate (never cutting data that was there before).
        padded = align_up(nbytes)
        old_size = await self.size() if padded != nbytes else 0
        if padded != nbytes and old_size > offset + nbytes:
            raise ValueError(
                f"O_DIRECT write to {self.path} of {nbytes} bytes at {offset} is neither "
                f"{DIRECT_IO_ALIGN}-aligned in length nor at the end of the file ({old_size} bytes)"
            )
        bounce = alloc_aligned(padded)
        try:
            bounce[:nbytes] = memoryview(data).cast("B")
            await self.engine.pwrite(self.fd, bounce, offset)
        finally:
            bounce.close()
        if padded != nbytes:
            await self.truncate(offset + nbytes)

    async def size(self) -> int:
        st = await self.engine.run_sync(os.fstat, self.fd)
        return st.st_size

    async def truncate(self, length: int) -> None:
        await self.engine.ftruncate(self.fd, length)

    async def fsync(self) -> None:
        await self.engine.fsync(self.fd)

    async def fdatasync(self) -> None:
        await self.engine.fdatasync(self.fd)

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            await self.engine.close_fd(self.fd)


def _fsync_path(path: str, directory: bool) -> None:
    flags = os.O_RDONLY | _O_CLOEXEC | (os.O_DIRECTORY if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def fsync_dir(engine: IoEngine, directory: str | os.PathLike[str]) -> None:
    """fsync a directory, making the creations, renames and unlinks in it durable."""
    engine.stats.fsyncs += 1
    await engine.run_sync(_fsync_path, os.fspath(directory), True)


async def fsync_file_and_dir(engine: IoEngine, path: str | os.PathLike[str]) -> None:
    """fsync a file by path, then its directory, so both its bytes and its name are durable."""
    spath = os.fspath(path)
    engine.stats.fsyncs += 1
    await engine.run_sync(_fsync_path, spath, False)
    await fsync_dir(engine, os.path.dirname(os.path.abspath(spath)))


async def durable_rename(
    engine: IoEngine, tmp_path: str | os.PathLike[str], final_path: str | os.PathLike[str]
) -> None:
    """Make a fully written temp file durable under its final name: fsync it, rename it over
    ``final_path``, fsync the directory. After this returns the file may be listed in
    ``index_part.json``; a crash before it leaves at most a temp file to delete."""
    stmp = os.fspath(tmp_path)
    engine.stats.fsyncs += 1
    await engine.run_sync(_fsync_path, stmp, False)
    await engine.run_sync(os.replace, stmp, os.fspath(final_path))
    await fsync_dir(engine, os.path.dirname(os.path.abspath(os.fspath(final_path))))
