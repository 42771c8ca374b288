"""The WAL run pre-check, pageserver side: ``WalPrecheck`` runs the child that checks runs of
like records ahead of the ingest (``pageserver.wal_runs``: the claims, their finder, the wire
format and the child itself; docs/wal-precheck.md).

- ``WalPrecheck`` (trio): one ``python -m pageserver.wal_runs`` child per handle, started on
  ``start()`` or the first ``submit``; pieces in (through a shared-memory ring), claims out, in
  order, every answer checked against its piece (base, length, CRC-32C of the bytes) and for
  well-formed claims (``check_claims``). Any failure breaks the handle for good
  (``WalPrecheckError``; the child is killed and reaped).
- ``bench`` / ``main``: ``python -m pageserver.wal_precheck --bench FILE`` measures the finder
  and the round trip (not a test).
"""

from __future__ import annotations

import argparse
import collections
import mmap
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import trio

from common.child_io import PIPE_SIZE
from common.children import reap, spawn, stop
from pageserver.wal_runs import (
    ANSWER_HEADER,
    ANSWER_MAGIC,
    INLINE,
    MAX_LSN,
    MAX_PIECE,
    MIN_STRIDE,
    PAGE_MASK,
    READY_MAGIC,
    REQUEST_HEADER,
    REQUEST_MAGIC,
    RING_SIZE,
    RunClaims,
    RunFinder,
    check_claims,
)
from protocol.lsn import WAL_SEGMENT_SIZE
from protocol.wal import crc as _crcmod

__all__ = ["PrecheckPool", "WalPrecheck", "WalPrecheckError", "bench", "main"]

# (aclose: how long a child that got EOF may take to exit before it is killed)
_EXIT_GRACE_S = 2.0


class WalPrecheckError(Exception):
    """The pre-check child failed (died, killed, garbled or mismatched answer, cancelled
    mid-request) or the handle is closed: the handle is broken for good."""


@attrs.define(slots=True)
class _Pending:
    base: int
    length: int
    crc: int
    low: int  # where the child's buffer for this piece starts (claims start there or later)
    ring_offset: int  # where its bytes are in the ring (INLINE: sent on the pipe)


class WalPrecheck:
    """One pre-check child (started on the first ``submit``); see the module docstring.

    ``submit`` (one task) and ``result`` (another) may run concurrently, one caller each
    (a second concurrent caller gets ``trio.BusyResourceError``); answers come in submit
    order. Any failure breaks the handle for good: that call and every later one raise
    ``WalPrecheckError`` (the child is killed and reaped, pending answers are dropped); make
    a new handle (and a new ``RunFinder`` state: the child starts without a carry). A
    ``submit`` cancelled before its header was written, or a ``result`` cancelled at any
    point, leaves the handle working (a partly read answer stays buffered for the next
    ``result``); a request cut in the middle breaks it.

    Neither call is a trio checkpoint when it need not wait (the ring has room and the pipe
    takes the header; the answer is already in the pipe): the ingest pays one ``write`` per
    piece and one ``read`` per answer, not trips through the scheduler.
    """

    def __init__(
        self,
        *,
        segment_size: int = WAL_SEGMENT_SIZE,
        worker_args: Sequence[str] = (),
        ring_size: int = RING_SIZE,
    ) -> None:
        RunFinder(segment_size)  # (validates)
        if not 0 <= ring_size < INLINE:
            raise ValueError(f"ring size {ring_size} out of range")
        self._args = (f"--segment-size={segment_size}", *worker_args)
        self._ring_size = ring_size
        self._ring: mmap.mmap | None = None
        self.inline = 0  # pieces that went through the pipe (the ring was full)
        self._proc: trio.Process | None = None
        self._pending: collections.deque[_Pending] = collections.deque()
        # (flags, not locks: a lock's acquire is a trip through the scheduler on every call,
        # and each side has one caller; a second concurrent caller is a bug)
        self._sending = False
        self._receiving = False
        self._starting: trio.Event | None = None  # set once a start in progress is over
        self._ready = False  # the child's READY_MAGIC was read
        self._inbuf = bytearray()
        self._broken: str | None = None
        self._last_end: int | None = None  # the end of the last piece submitted
        self._last_page: int | None = None  # the start of the page the child may carry
        self.submitted = 0
        self.answered = 0

    @property
    def pending(self) -> int:
        """Pieces submitted whose answer ``result`` has not returned yet."""
        return len(self._pending)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def broken(self) -> str | None:
        return self._broken

    @property
    def ready(self) -> bool:
        """The child is up and has said so: a ``submit`` now is answered without waiting for
        the child's start (~70 ms of imports)."""
        return self._ready

    async def start(self) -> None:
        """Start the child and wait until it is ready (``submit`` otherwise starts it on
        first use, and the first ``result`` then waits for its start). Meant for a task of its
        own, so that the caller goes on without the pre-check meanwhile (``ready``). Must not
        run beside ``result`` (the ready message comes on the answer pipe)."""
        self._check()
        if self._ready:
            return
        if self._receiving:
            raise trio.BusyResourceError("another task is in WalPrecheck.result")
        self._receiving = True
        try:
            await self._await_ready(await self._start())
        finally:
            self._receiving = False

    async def _await_ready(self, proc: trio.Process) -> None:
        if self._ready:
            return
        assert isinstance(proc.stdout, trio.lowlevel.FdStream)
        try:
            await self._fill(proc.stdout.fileno(), len(READY_MAGIC))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, WalPrecheckError) as exc:
            await self._break(f"the child did not start: {exc}")
            raise WalPrecheckError(self._broken) from exc
        if self._inbuf[: len(READY_MAGIC)] != READY_MAGIC:
            await self._break(f"the child started with {bytes(self._inbuf[:4])!r}, not {READY_MAGIC!r}")
            raise WalPrecheckError(self._broken)
        del self._inbuf[: len(READY_MAGIC)]
        self._ready = True

    async def submit(self, base: int, data: bytes | memoryview) -> None:
        """Send one piece (``base``: the LSN of ``data[0]``) to the child."""
        self._check()
        if not (base >= 0 and base + len(data) <= MAX_LSN and len(data) <= MAX_PIECE):
            raise ValueError(f"piece of {len(data)} bytes at {base:X} is out of range")
        if self._sending:
            raise trio.BusyResourceError("another task is in WalPrecheck.submit")
        self._sending = True
        try:
            await self._send(base, data)
        finally:
            self._sending = False

    async def _send(self, base: int, data: bytes | memoryview) -> None:
        proc = self._proc if self._proc is not None else await self._start()
        assert isinstance(proc.stdin, trio.lowlevel.FdStream)
        fd = proc.stdin.fileno()
        at = self._ring_place(len(data))
        entry = _Pending(base, len(data), _crcmod.crc32c(data), self._low(base), at)
        header = REQUEST_HEADER.pack(REQUEST_MAGIC, base, len(data), at)
        if at == INLINE:
            frame = memoryview(header + data)
            self.inline += 1
        else:
            assert self._ring is not None
            # (the region is no pending piece's: the child does not read it until the header)
            self._ring[at : at + len(data)] = data
            frame = memoryview(header)
        self._pending.append(entry)
        sent = 0
        try:
            while sent < len(frame):
                try:
                    sent += os.write(fd, frame[sent:])
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(fd)
        except trio.Cancelled:
            if sent:
                await self._break("submit was cancelled in the middle of a request")
            else:
                self._pending.remove(entry)
            raise
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            # EPIPE: the child is gone; Closed: result() broke the handle meanwhile
            await self._break(f"writing a request failed: {exc}")
            raise WalPrecheckError(self._broken) from exc
        self._last_end = base + len(data)
        self._last_page = self._last_end & ~PAGE_MASK if self._last_end & PAGE_MASK else None
        self.submitted += 1
        # (no checkpoint after the write: a Cancelled raised then would hide a sent piece)

    def _ring_place(self, size: int) -> int:
        """Where a piece of ``size`` bytes goes in the ring: after the newest pending piece's
        bytes, or at the start when the oldest's are not there; ``INLINE`` when it does not fit
        without touching a pending piece's bytes (those are freed when ``result`` returns)."""
        if self._ring is None or not size:
            return INLINE
        used = [(e.ring_offset, e.ring_offset + e.length) for e in self._pending if e.ring_offset != INLINE]
        if not used:
            return 0 if size <= self._ring_size else INLINE
        tail, head = used[0][0], used[-1][1]
        if head > tail:  # [tail, head) in use
            if head + size <= self._ring_size:
                return head
            return 0 if size <= tail else INLINE
        return head if head + size <= tail else INLINE  # (wrapped: [tail, end) and [0, head))

    def _low(self, base: int) -> int:
        if base == self._last_end and self._last_page is not None:
            return self._last_page
        return base

    async def result(self) -> RunClaims:
        """The claims about the oldest piece not yet answered (waits for the child)."""
        self._check()
        if self._receiving:
            raise trio.BusyResourceError("another task is in WalPrecheck.result")
        self._receiving = True
        try:
            return await self._receive()
        finally:
            self._receiving = False

    async def _receive(self) -> RunClaims:
        if not self._pending:
            raise WalPrecheckError("result() without a submitted piece")
        proc = self._proc
        assert proc is not None and isinstance(proc.stdout, trio.lowlevel.FdStream)
        fd = proc.stdout.fileno()
        await self._await_ready(proc)
        try:
            header = await self._fill(fd, ANSWER_HEADER.size)
            magic, base, length, crc, n = ANSWER_HEADER.unpack_from(header)
            if magic != ANSWER_MAGIC or n > MAX_PIECE // MIN_STRIDE:
                raise WalPrecheckError(f"garbled answer header {bytes(header)!r}")
            await self._fill(fd, ANSWER_HEADER.size + 24 * n)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, WalPrecheckError) as exc:
            await self._break(f"reading an answer failed: {exc}")
            raise WalPrecheckError(self._broken) from exc
        body = bytes(self._inbuf[ANSWER_HEADER.size : ANSWER_HEADER.size + 24 * n])
        del self._inbuf[: ANSWER_HEADER.size + 24 * n]
        entry = self._pending.popleft()
        problem: str | None = None
        if (base, length, crc) != (entry.base, entry.length, entry.crc):
            problem = (
                f"answer for the piece at {base:X} ({length} bytes, crc {crc:08X}); "
                f"expected {entry.base:X} ({entry.length} bytes, crc {entry.crc:08X})"
            )
        claims = RunClaims()
        claims.starts.frombytes(body[: 8 * n])
        claims.lasts.frombytes(body[8 * n : 16 * n])
        claims.strides.frombytes(body[16 * n :])
        problem = problem or check_claims(claims, entry.low, entry.base + entry.length)
        if problem:
            await self._break(f"bad answer: {problem}")
            raise WalPrecheckError(self._broken)
        self.answered += 1
        return claims

    async def _fill(self, fd: int, size: int) -> bytearray:
        """Wait until ``size`` bytes are buffered (a cancelled wait loses nothing). Reads the
        pipe directly: when the answer is there (the child is ahead) this is one ``read``
        and no trip through trio's scheduler."""
        while len(self._inbuf) < size:
            try:
                data = os.read(fd, PIPE_SIZE)
            except BlockingIOError:
                # (ClosedResourceError when the handle is broken meanwhile: the fd is closed)
                await trio.lowlevel.wait_readable(fd)
                continue
            if not data:
                raise WalPrecheckError(f"the child closed its answer pipe: {await self._ended()}")
            self._inbuf += data
        return self._inbuf

    async def _ended(self) -> str:
        proc = self._proc
        if proc is None:
            return "no child"
        with trio.move_on_after(1.0):
            await proc.wait()
        rc = proc.returncode
        return "still running" if rc is None else f"exit status {rc}" if rc >= 0 else f"killed by signal {-rc}"

    def _check(self) -> None:
        if self._broken is not None:
            raise WalPrecheckError(f"the WAL pre-check is broken: {self._broken}")

    async def _start(self) -> trio.Process:
        # (start() in one task and submit() in another must not start two children)
        while self._starting is not None:
            await self._starting.wait()
        if self._proc is not None:
            return self._proc
        self._check()
        self._starting = trio.Event()
        try:
            return await self._spawn()
        except OSError as exc:
            # (no memory, no fds, no processes left: the pre-check's failure, like a child
            # that dies; never the safekeeper's, which the receiver would blame)
            await self._break(f"the child could not be started: {exc!r}")
            raise WalPrecheckError(self._broken) from exc
        finally:
            self._starting.set()
            self._starting = None

    async def _spawn(self) -> trio.Process:
        args = list(self._args)
        ring_fd: int | None = None
        ring: mmap.mmap | None = None
        try:
            if self._ring_size:
                ring_fd = os.memfd_create("wal-precheck-ring", os.MFD_CLOEXEC)
                os.ftruncate(ring_fd, self._ring_size)
                # (mapped before the child exists: nothing may fail between its spawn and
                # ``self._proc``, or it would be left running, unreaped)
                ring = mmap.mmap(ring_fd, self._ring_size)
                args += [f"--ring-fd={ring_fd}", f"--ring-size={self._ring_size}"]
            proc = await spawn("pageserver.wal_runs", args, pass_fds=() if ring_fd is None else (ring_fd,))
        except BaseException:
            if ring is not None:
                ring.close()
            raise
        finally:
            if ring_fd is not None:
                os.close(ring_fd)  # (the mappings keep the memory)
        self._ring = ring
        if self._broken is not None:  # closed while it started: it must not outlive us
            await reap(proc)
            self._close_ring()
            self._check()
        self._proc = proc
        return proc

    async def _break(self, why: str) -> None:
        if self._broken is None:
            self._broken = why
        self._pending.clear()
        proc, self._proc = self._proc, None
        if proc is not None:
            await reap(proc)
        self._close_ring()

    def _close_ring(self) -> None:
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.close()

    async def aclose(self) -> None:
        """Stop the child: EOF on its stdin, kill after ``_EXIT_GRACE_S``; reaped before this
        returns. Later calls raise ``WalPrecheckError``."""
        if self._broken is None:
            self._broken = "closed"
        self._pending.clear()
        proc, self._proc = self._proc, None
        if proc is not None:
            await stop(proc, _EXIT_GRACE_S)
        self._close_ring()


class PrecheckPool:
    """A pageserver-wide limit on pre-check children: the WAL receivers' factory. A session
    that finds ``limit`` children at work gets none (``None``) and its ingest checks every
    record itself: on two cores, a third process checking WAL would only compete (and each
    child holds a 4 MiB ring). A child's slot is free again when its handle is closed."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a pre-check pool needs room for one child, got {limit}")
        self.limit = limit
        self.in_use = 0

    def __call__(self) -> WalPrecheck | None:
        if self.in_use >= self.limit:
            return None
        self.in_use += 1
        return _Pooled(self)


class _Pooled(WalPrecheck):
    def __init__(self, pool: PrecheckPool) -> None:
        super().__init__()
        self._pool: PrecheckPool | None = pool

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.in_use -= 1


def default_children() -> int:
    """One pre-check child per core beyond the first (the ingest's own), at least one."""
    return max(1, (os.cpu_count() or 2) - 1)


# -- measuring it (not a test) -------------------------------------------------------------


def bench(path: Path, file_lsn: int, start_lsn: int, piece: int = 131072, rounds: int = 3) -> None:
    """Print JSON lines: CPU per record of ``RunFinder.feed`` over the WAL file at ``path``
    (holding WAL from ``file_lsn`` on) cut into receiver-sized pieces from ``start_lsn``'s
    page on, and the round trip through the child (4 pieces in flight; the parent's CPU in
    ``submit`` + ``result`` per record), with the parent otherwise idle and with it busy
    0.8 ms per piece (an ingest's pace: ~0.9 µs for each of ~900 records)."""
    import json

    from protocol.wal.reader import WalStreamDecoder
    from protocol.wal.record import DecodedRecord

    wal = path.read_bytes()
    page = start_lsn & ~PAGE_MASK
    pieces = [(file_lsn + at, wal[at : at + piece]) for at in range(page - file_lsn, len(wal), piece)]
    dec = WalStreamDecoder(start_lsn, data_start=page)
    records = 0
    for _, data in pieces:
        dec.feed(data)
        batch: list[DecodedRecord] = []
        dec.decode_into(batch)
        records += len(batch)
    load = os.getloadavg()[0]
    for _ in range(rounds):
        finder = RunFinder()
        claimed = 0
        t0 = time.process_time()
        for base, data in pieces:
            claimed += finder.feed(base, data).records()
        cpu = time.process_time() - t0
        print(json.dumps({"mode": "feed", "records": records, "claimed": claimed, "cpu_s": round(cpu, 3),
                          "us_per_record": round(cpu / records * 1e6, 3), "load": load}))

    async def round_trip(busy_s: float) -> None:
        handle = WalPrecheck()
        await handle.submit(0, b"")  # (the child starts outside the timing)
        await handle.result()
        handle_cpu = 0.0
        t0 = time.perf_counter()
        ahead = 4
        for i in range(len(pieces) + ahead):
            c0 = time.process_time()
            if i < len(pieces):
                await handle.submit(*pieces[i])
            if i >= ahead:
                await handle.result()
            handle_cpu += time.process_time() - c0
            if busy_s and i >= ahead:
                # (the ingest's work on the piece: the answers are ready when it asks)
                until = time.perf_counter() + busy_s
                while time.perf_counter() < until:
                    pass
        wall = time.perf_counter() - t0
        await handle.aclose()
        print(json.dumps({"mode": "child", "parent_busy_us_per_piece": round(busy_s * 1e6), "records": records,
                          "wall_s": round(wall, 3),
                          "wall_us_per_record": round(wall / records * 1e6, 3),
                          "parent_us_per_record": round(handle_cpu / records * 1e6, 3), "load": os.getloadavg()[0]}))

    for busy_s in (0.0, 0.0008):
        for _ in range(rounds):
            trio.run(round_trip, busy_s)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pageserver.wal_precheck")
    parser.add_argument("--bench", type=Path, required=True, help="measure over this WAL file")
    parser.add_argument("--bench-file-lsn", type=lambda v: int(v, 0), default=WAL_SEGMENT_SIZE,
                        help="the LSN of the WAL file's first byte")
    parser.add_argument("--bench-start", type=lambda v: int(v, 0), default=0x1500780,
                        help="the LSN of the first record")
    args = parser.parse_args(argv)
    bench(args.bench, args.bench_file_lsn, args.bench_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
