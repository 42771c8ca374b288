"""``BufferedWriter``: append-only, buffered, optionally double-buffered writes to one file.

Used by the ephemeral file (in-memory layers) and the delta and image layer writers. Two knobs
(pageserver config): ``write_buffer_size`` (default 1 MiB; 8 KiB reproduces the seed's
pathological ingest) and ``double_buffering``.

How it works
------------
``write(data)`` copies ``data`` into the current buffer and returns the file offset where it
starts. Offsets are contiguous: the writer appends at ``start_offset``, ``start_offset +
len(first)``, ... When the buffer is full it is written at its file offset:

- ``double_buffering=False``: the writer awaits that write itself (the seed's behaviour: ingest
  stalls on every flush).
- ``double_buffering=True``: the full buffer is handed to a background flush task and writing
  continues at once into the second buffer. **At most one flush is in flight**: if the second
  buffer fills before the first flush is done, the writer waits for it, then hands over the second
  buffer and continues in the first (recycled). Buffers are never reallocated.

Failures are never lost: an exception in a background flush is stored, and the next ``write``,
``flush``, ``close`` or ``read_at`` raises ``FlushFailedError`` (its ``__cause__`` is the
original error). A write the caller awaits itself (no double buffering, or the tail in
``flush``/``close``) raises ``FlushFailedError`` at once. The writer stays failed: the file has a hole at the failed offset, so every
later call raises too. A background flush that is *cancelled* is recorded the same way (and the
``Cancelled`` propagates, as trio requires).

Where the background flush task runs (the nursery)
--------------------------------------------------
The writer never opens a nursery of its own inside ``write``; it starts one short task per flush
with ``nursery.start_soon`` in a nursery it is given:

- Long-lived owners (the ephemeral file of an in-memory layer lives for many minutes) pass their
  own nursery: ``BufferedWriter(file, nursery=timeline_nursery, ...)``. Each flush task ends when
  its write ends, so the owner's nursery is never kept open by an idle writer.
- Short-lived users (a layer writer during one flush/compaction) use
  ``async with open_buffered_writer(file, ...) as w:``, which opens a nursery around the writer
  and ``close()``-s it on a normal exit.
- With ``double_buffering=False`` no nursery is needed (``nursery=None``).

Reads
-----
``read_at(offset, size)`` returns bytes already written, wherever they are: in the current
buffer, in the buffer being flushed (it is not touched until its write completes), or in the
file. Memory parts are copied before the first await, and the file part is below every buffer
and never rewritten, so a read racing with flushes is consistent.

O_DIRECT (``sync_mode="direct"``)
---------------------------------
Buffers are then page-aligned ``mmap`` memory, ``write_buffer_size`` and ``start_offset`` must be
multiples of 4096, full buffers are written as is, and the partial tail (on ``flush`` /
``close``) is zero-padded to 4096 and written from the buffer start; ``close`` then truncates the
file to its true length. ``flush`` keeps the partial tail in the buffer, so the next write of that
buffer rewrites the same blocks with more data (correct in both modes, and flush is rare).

One writer per ``BufferedWriter``: concurrent ``write`` calls from two tasks raise
``trio.BusyResourceError``. ``read_at`` may be called from any task at any time.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import attrs
import trio

from pageserver.storage.io_engine import DIRECT_IO_ALIGN, IoFile, align_up, alloc_aligned

if TYPE_CHECKING:
    import mmap

DEFAULT_WRITE_BUFFER_SIZE = 64 * 1024
SEED_WRITE_BUFFER_SIZE = 8 * 1024



class FlushFailedError(Exception):
    """A buffered write to the file failed; ``__cause__`` is the original error."""


@attrs.define(slots=True)
class WriterStats:
    """What the writer did; the ingest benchmark prints these."""

    flushes: int = 0  # buffer writes (full buffers and tails)
    background_flushes: int = 0
    max_in_flight: int = 0  # must never exceed 1
    wait_seconds: float = 0.0  # time write() spent waiting for a flush (inline or in flight)


class BufferedWriter:
    """Append-only buffered writer over an ``IoFile``; see the module docstring."""

    def __init__(
        self,
        file: IoFile,
        *,
        buffer_size: int = DEFAULT_WRITE_BUFFER_SIZE,
        double_buffering: bool = True,
        nursery: trio.Nursery | None = None,
        start_offset: int = 0,
    ) -> None:
        if buffer_size <= 0:
            raise ValueError(f"write_buffer_size must be positive, got {buffer_size}")
        if double_buffering and nursery is None:
            raise ValueError(
                "double_buffering needs a nursery for the background flush: pass nursery=, "
                "or use open_buffered_writer()"
            )
        if file.direct and (buffer_size % DIRECT_IO_ALIGN or start_offset % DIRECT_IO_ALIGN):
            raise ValueError(
                f"O_DIRECT writer for {file.path}: write_buffer_size ({buffer_size}) and "
                f"start_offset ({start_offset}) must be multiples of {DIRECT_IO_ALIGN}"
            )
        self.file = file
        self.buffer_size = buffer_size
        self.double_buffering = double_buffering
        self.stats = WriterStats()
        self._nursery = nursery
        self._buf: bytearray | mmap.mmap = self._alloc()
        self._spare: bytearray | mmap.mmap | None = self._alloc() if double_buffering else None
        self._buf_start = start_offset  # file offset of self._buf[0]
        self._fill = 0
        # The buffer being written in the background, its file offset, and its completion.
        self._inflight: bytearray | mmap.mmap | None = None
        self._inflight_start = 0
        self._inflight_done: trio.Event | None = None
        self._error: BaseException | None = None
        self._busy = False
        self._closed = False

    def _alloc(self) -> bytearray | mmap.mmap:
        return alloc_aligned(self.buffer_size) if self.file.direct else bytearray(self.buffer_size)

    # -- state ---------------------------------------------------------------------------

    @property
    def length(self) -> int:
        """Logical end of the data: the offset the next ``write`` returns."""
        return self._buf_start + self._fill

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def flush_in_flight(self) -> bool:
        return self._inflight is not None

    def _check(self) -> None:
        if self._error is not None:
            raise FlushFailedError(
                f"a buffered write to {self.file.path} failed: {self._error!r}"
            ) from self._error

    # -- writing -------------------------------------------------------------------------

    async def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append ``data``; returns the file offset where it starts.

        Only checkpoints when a full buffer has to be handed over (so appending small values is
        cheap); raises ``FlushFailedError`` if an earlier flush failed.
        """
        if self._error is not None:
            self._check()
        if self._closed:
            raise trio.ClosedResourceError(f"buffered writer for {self.file.path} is closed")
        pos = self._fill
        n = len(data)  # memoryviews must be byte-format (cast("B")) for this to be a size
        offset = self._buf_start + pos
        if pos + n < self.buffer_size:
            self._buf[pos : pos + n] = data
            self._fill = pos + n
            return offset
        await self._write_slow(memoryview(data).cast("B"))
        return offset

    def try_write(self, data: bytes | bytearray | memoryview, limit: int = 1 << 62) -> int:
        """``write`` without an await when ``data`` fits in the buffer (the ingest hot path):
        the offset, or -1 when ``write`` has to be used (full buffer, error, closed, busy) or
        when the data would end past file offset ``limit``."""
        pos = self._fill
        n = len(data)
        offset = self._buf_start + pos
        if (
            pos + n >= self.buffer_size
            or offset + n > limit
            or self._error is not None
            or self._closed
            or self._busy
        ):
            return -1
        self._buf[pos : pos + n] = data
        self._fill = pos + n
        return offset

    def room(self, limit: int = 1 << 62) -> int:
        """How many bytes ``try_write`` takes now (in one call or several) without declining,
        the data to end at or before file offset ``limit``; 0 when it declines everything."""
        if self._error is not None or self._closed or self._busy:
            return 0
        pos = self._fill
        return max(0, min(self.buffer_size - 1 - pos, limit - self._buf_start - pos))

    async def _write_slow(self, view: memoryview) -> None:
        if self._busy:
            raise trio.BusyResourceError(f"another task is writing to {self.file.path}")
        self._busy = True
        try:
            cap = self.buffer_size
            while view:
                pos = self._fill
                take = min(cap - pos, len(view))
                self._buf[pos : pos + take] = view[:take]
                self._fill = pos + take
                view = view[take:]
                if self._fill == cap:
                    await self._hand_over_full_buffer()
        finally:
            self._busy = False

    async def _hand_over_full_buffer(self) -> None:
        start = time.perf_counter()
        if not self.double_buffering:
            # The seed's path: the writer waits for the write. Readers still see the bytes in
            # self._buf, because _buf_start/_fill only move after the write completed.
            try:
                await self._write_buffer(self._buf, self._buf_start, self.buffer_size)
            except BaseException as exc:
                self._record_error(exc)
                if isinstance(exc, Exception):
                    self._check()
                raise
            self._buf_start += self.buffer_size
            self._fill = 0
            self.stats.wait_seconds += time.perf_counter() - start
            return
        await self._wait_in_flight()
        self.stats.wait_seconds += time.perf_counter() - start
        self._check()
        assert self._spare is not None and self._nursery is not None
        full = self._buf
        done = trio.Event()
        try:
            # First, so that a closed nursery leaves the writer unchanged (and failed). The task
            # cannot run before we yield, so the state changes below are in place by then.
            self._nursery.start_soon(self._flush_task, full, self._buf_start, done)
        except BaseException as exc:
            self._record_error(exc)
            raise
        self._buf, self._spare = self._spare, None
        self._inflight = full
        self._inflight_start = self._buf_start
        self._inflight_done = done
        self._buf_start += self.buffer_size
        self._fill = 0
        self.stats.background_flushes += 1
        self.stats.max_in_flight = max(self.stats.max_in_flight, 1)
        # Let the flush task start now: callers of write() rarely checkpoint otherwise, and a
        # flush that only starts when the next buffer is full overlaps with nothing (with the
        # threadpool engine this yield is what puts the write on a thread while we go on).
        await trio.lowlevel.checkpoint()

    async def _flush_task(
        self, buf: bytearray | mmap.mmap, start: int, done: trio.Event
    ) -> None:
        try:
            await self._write_buffer(buf, start, self.buffer_size)
        except BaseException as exc:
            self._record_error(exc)
            # Surface it through the writer, not through the owner's nursery (which may be a
            # whole timeline's). Cancelled and KeyboardInterrupt must still propagate.
            if not isinstance(exc, Exception):
                raise
        finally:
            # The buffer may be recycled only now: readers were served from it until here.
            self._inflight = None
            self._inflight_done = None
            self._spare = buf
            done.set()

    async def _wait_in_flight(self) -> None:
        done = self._inflight_done
        if done is not None:
            await done.wait()

    async def _write_buffer(self, buf: bytearray | mmap.mmap, start: int, length: int) -> None:
        self.stats.flushes += 1
        if self.file.direct and length % DIRECT_IO_ALIGN:
            padded = align_up(length)
            buf[length:padded] = bytes(padded - length)
            length = padded
        with memoryview(buf) as view:
            await self.file.engine.pwrite(self.file.fd, view[:length], start)

    def _record_error(self, exc: BaseException) -> None:
        if self._error is None:
            if isinstance(exc, trio.Cancelled):
                self._error = RuntimeError(f"a buffered write to {self.file.path} was cancelled")
            else:
                self._error = exc

    async def pad_to_alignment(self, align: int) -> int:
        """Append zeros until ``length`` is a multiple of ``align`` (e.g. to start an index at a
        block boundary); returns the new length."""
        rem = self.length % align
        if rem:
            await self.write(bytes(align - rem))
        return self.length

    async def flush(self) -> None:
        """Make every byte written so far reach the file (not stable storage: that is
        ``file.fsync()``). Waits for a flush in flight. The tail stays in the buffer."""
        self._check()
        if self._busy:
            raise trio.BusyResourceError(f"another task is writing to {self.file.path}")
        self._busy = True
        try:
            await self._wait_in_flight()
            self._check()
            if self._fill:
                try:
                    await self._write_buffer(self._buf, self._buf_start, self._fill)
                except BaseException as exc:
                    self._record_error(exc)
                    if isinstance(exc, Exception):
                        self._check()
                    raise
        finally:
            self._busy = False

    async def close(self) -> int:
        """Flush everything, truncate an O_DIRECT file to its true length, drop the buffers.
        Returns the final length. The file stays open (its owner closes it); ``read_at`` keeps
        working, from the file. Raises ``FlushFailedError`` if any flush failed."""
        if self._closed:
            self._check()
            return self.length
        await self.flush()
        if self.file.direct and self.length % DIRECT_IO_ALIGN:
            await self.file.truncate(self.length)
        self._closed = True
        # Everything is in the file now: reads come from there, buffers go.
        self._buf_start += self._fill
        self._fill = 0
        self._buf = bytearray()
        self._spare = None
        return self._buf_start

    async def abort(self) -> None:
        """Stop writing without writing the tail and without raising a stored error: waits
        for a flush in flight (so its fd is not closed under it) and drops the buffers."""
        await self._wait_in_flight()
        self._closed = True
        self._buf = bytearray()
        self._spare = None
        self._fill = 0

    # -- reading -------------------------------------------------------------------------

    def _check_range(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.length:
            raise ValueError(
                f"read of {size} bytes at {offset} is outside {self.file.path} (length {self.length})"
            )

    async def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """``read_at`` for every ``(offset, size)``, with all the parts that are in the file read
        in one engine call (one thread hop with the threadpool engine)."""
        for offset, size in ranges:
            self._check_range(offset, size)
        self._check()
        results: list[bytes] = [b""] * len(ranges)
        # (result index, file offset, file size, memory tail) of the reads that need the file
        pending: list[tuple[int, int, int, bytes]] = []
        bstart = self._buf_start
        inflight = self._inflight
        mem_lo = self._inflight_start if inflight is not None else bstart
        for i, (offset, size) in enumerate(ranges):
            end = offset + size
            if offset >= bstart:
                results[i] = bytes(self._buf[offset - bstart : end - bstart])
            elif end <= mem_lo:
                pending.append((i, offset, size, b""))
            else:
                tail = self._memory_part(offset, end, bstart, inflight, mem_lo)
                if offset >= mem_lo:
                    results[i] = tail
                else:
                    pending.append((i, offset, mem_lo - offset, tail))
        if pending:
            heads = await self.file.read_many_exact_at([(o, n) for _, o, n, _ in pending])
            for (i, _, _, tail), head in zip(pending, heads, strict=True):
                results[i] = head + tail if tail else head
        return results

    def _memory_part(
        self,
        offset: int,
        end: int,
        bstart: int,
        inflight: bytearray | mmap.mmap | None,
        mem_lo: int,
    ) -> bytes:
        """The bytes of ``[max(offset, mem_lo), end)``, which are all in the two buffers."""
        parts: list[bytes] = []
        if inflight is not None:
            lo = max(offset, mem_lo)
            hi = min(end, mem_lo + self.buffer_size)
            if hi > lo:
                parts.append(bytes(inflight[lo - mem_lo : hi - mem_lo]))
        if end > bstart:
            parts.append(bytes(self._buf[0 : end - bstart]))
        return b"".join(parts)

    async def read_at(self, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset``, which must lie within what was written."""
        self._check_range(offset, size)
        self._check()
        end = offset + size
        bstart = self._buf_start
        if offset >= bstart:  # the common case for fresh data
            return bytes(self._buf[offset - bstart : end - bstart])
        # Everything below mem_lo is in the file and never rewritten.
        inflight = self._inflight
        mem_lo = self._inflight_start if inflight is not None else bstart
        if end <= mem_lo:
            return await self.file.read_exact_at(offset, size)
        # Copy the memory part now, before any await lets the buffers move on.
        tail = self._memory_part(offset, end, bstart, inflight, mem_lo)
        if offset >= mem_lo:
            return tail
        head = await self.file.read_exact_at(offset, mem_lo - offset)
        return head + tail


@asynccontextmanager
async def open_buffered_writer(
    file: IoFile,
    *,
    buffer_size: int = DEFAULT_WRITE_BUFFER_SIZE,
    double_buffering: bool = True,
    start_offset: int = 0,
) -> AsyncIterator[BufferedWriter]:
    """A ``BufferedWriter`` with its own nursery for background flushes; ``close()``-d on a
    normal exit (so a failed flush raises here at the latest). On an exception the in-flight
    flush is still awaited (the nursery), but the tail is not written."""
    try:
        async with trio.open_nursery() as nursery:
            writer = BufferedWriter(
                file,
                buffer_size=buffer_size,
                double_buffering=double_buffering,
                nursery=nursery,
                start_offset=start_offset,
            )
            yield writer
    except BaseExceptionGroup as group:
        # Flush tasks never raise Exceptions (they store them), so a one-member group is the
        # body's own exception: give it back unwrapped, as if there were no nursery.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    # Outside the nursery: no flush is in flight any more, and close() writes the tail inline.
    await writer.close()
