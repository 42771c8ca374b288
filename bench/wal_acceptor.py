"""``pagestore bench wal-acceptor``: how fast one safekeeper accepts WAL, coalesced or not.

For every AppendRequest size x fsync on/off x coalescing on/off x commit_lsn advancing or
not, a fresh safekeeper node runs as a subprocess (the real ``pagestore safekeeper``) and this
process, the proposer, pushes pre-framed AppendRequests as fast as the socket takes them for
``--seconds`` (or until ``--max-mib`` are acknowledged); ``--repeat N`` runs each N times and
prints the best (the machine is shared; the other runs are listed in ``runs_mib_s``). The rate is the acknowledged
flush_lsn progress divided by the time of the last acknowledgement. The same run measures
the disk's raw rate for 1 MiB ``pwrite`` s (about one write group) into a preallocated file,
with and without ``fdatasync`` after each, as the ceiling; each twice, into fresh pages
of a fallocated file (``"page_cache": "fresh"``, what a new WAL segment gets) and over a file
written and synced once before (``"cached"``: its pages in the page cache and its blocks
initialized, what a segment recycled PostgreSQL's way would be), with the writer's MiB per
CPU-second; because the fsynced rate of a virtual disk swings
between minutes, every fsynced run is also preceded by a short raw fsynced measurement, and
the line reports the median of run / adjacent raw (``median_pct_of_raw_fsync``), plus the
median rate and MiB per CPU-second of the safekeeper over the runs. One JSON line per
configuration.

WAL content: valid PostgreSQL WAL of XLOG NOOP records (``--record-size`` bytes each), made
once as a 16 MiB segment template whose page addresses are patched per segment, so the
safekeeper's record tracker and CRC checks do their normal work.

AppendRequest size: the protocol caps one message at 128 KiB (MAX_SEND_SIZE), so the
"1 MiB" configuration sends bursts of eight 128 KiB AppendRequests in one socket write.

FLOORS (``--floors on``, the default; the ``-crc`` ones only for sizes >= 128 KiB, whose
Python framing loop would be the floor at 1 KiB): how fast *any* Python
receiver on this machine could take the same stream, measured in the same run, from the
same proposer code, with the same pre-framed AppendRequest bytes and the same socket
bursts, into the same directory. Each floor is its own process (``python -m
bench.wal_acceptor --floor MODE DIR START BYTES``) that speaks no pgwire: it receives the raw
stream with ``recv_into`` into a pool of 1 MiB buffers and answers with 8-byte counts of
the stream bytes it has taken (the proposer converts them to WAL bytes):

- ``sink``: receive and discard; one count per MiB. The socket + proposer ceiling.
- ``sink-write`` / ``sink-write-fsync``: a receive thread hands each ``recv_into`` slice to
  a writer thread, which takes everything queued (up to 1 MiB), writes it with one
  ``pwritev`` per 16 MiB segment (preallocated + fsynced + directory fsynced like the
  safekeeper's), and with fsync starts one ``fdatasync`` per group on a fresh descriptor
  (two in flight, acknowledged in order, like the safekeeper). No parsing, no checks.
- ``sink-write-crc`` / ``sink-write-fsync-crc``: the same, and the receive thread first cuts
  the CopyData / AppendRequest framing and feeds the WAL to the real ``RecordTracker``
  (every record's CRC-32C and page header), as the safekeeper does before writing.

Anything the real safekeeper does beyond these (pgwire, acceptor, trio) is the gap between
its row and the floor's; the floor's own distance to the raw fsynced rate is what no Python
receiver structured like this can close on this machine.

``--wal-direct-io off,on`` runs the safekeeper rows with buffered and with ``O_DIRECT`` segment
writes (``wal_direct_io``), side by side, and adds raw rows of 1 MiB ``O_DIRECT`` writes
(``"io": "direct"``); an fsynced run's adjacent raw measurement then uses the run's own IO
(``median_pct_of_raw_fsync``), and a direct run is also set against the buffered raw rate
measured beside it (``median_pct_of_raw_fsync_buffered``). Rows without fsync run buffered only (a
``no_sync`` node never writes direct).

``--wal-io-engine writer-thread,threadpool`` runs the safekeeper rows once per WAL IO engine
(``safekeeper.wal_io``), side by side; ``--gil-switch-interval 0.005,0.0005`` once per
``gil_switch_interval_s`` of the node (0.005 s is Python's own default).
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import queue
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import trio

from protocol.ids import TenantId, TimelineId
from protocol.lsn import INVALID_LSN, WAL_SEGMENT_SIZE, XLOG_BLCKSZ, Lsn
from protocol.safekeeper import (
    MAX_SEND_SIZE,
    AppendRequest,
    AppendResponse,
    decode_acceptor_message,
    encode_append_request_header,
)
from protocol.wal.encoder import WalEncoder
from protocol.wal.rmgr import RmgrId
from safekeeper.record_tracker import RecordTracker
from safekeeper.testing import XLOG_NOOP, SafekeeperProcess, TestProposer
from safekeeper.wal_io import ENGINES
from safekeeper.wal_storage import split_at_segments

SIZES = {"1KiB": 1024, "8KiB": 8192, "128KiB": 128 * 1024, "1MiB": 1 << 20}
_COPY_HEAD = struct.Struct(">cI")
_PAGEADDR = struct.Struct("<Q")
TENANT = TenantId(bytes.fromhex("be" * 16))
TIMELINE = TimelineId(bytes.fromhex("ac" * 16))
_ACK = struct.Struct("<Q")
FLOOR_GROUP = 1 << 20
FLOOR_BUFFERS = 16
# Floors run for these fsync settings (the names say what each does).
FLOORS_FSYNC = ("sink", "sink-write-fsync", "sink-write-fsync-crc")
FLOORS_NO_FSYNC = ("sink-write", "sink-write-crc")


def segment_template(record_size: int) -> bytes:
    """One segment of NOOP records from its long header, ended by XLOG_SWITCH."""
    enc = WalEncoder(0, system_identifier=1)
    body = bytes(range(256)) * (record_size // 256 + 1)
    body = body[: max(record_size - 26, 0)]
    while enc.insert_lsn < WAL_SEGMENT_SIZE - 2 * record_size - XLOG_BLCKSZ:
        enc.append(RmgrId.XLOG, XLOG_NOOP, main_data=body)
    enc.switch()
    data = enc.take()
    assert len(data) == WAL_SEGMENT_SIZE, len(data)
    return data


def wal_segment(template: bytes, segno: int) -> bytearray:
    seg = bytearray(template)
    base = segno * WAL_SEGMENT_SIZE
    for off in range(0, WAL_SEGMENT_SIZE, XLOG_BLCKSZ):
        _PAGEADDR.pack_into(seg, off + 8, base + off)
    return seg


def framed_stream(
    template: bytes, start_segno: int, total: int, msg_size: int, commit: bool
) -> tuple[bytes, Lsn]:
    """CopyData frames of AppendRequests for ``total`` bytes of WAL from a segment start."""
    out = bytearray()
    pos = Lsn(start_segno * WAL_SEGMENT_SIZE)
    piece = min(msg_size, MAX_SEND_SIZE)
    segno = start_segno
    remaining = total
    while remaining > 0:
        seg = memoryview(wal_segment(template, segno))
        for off in range(0, WAL_SEGMENT_SIZE, piece):
            wal = seg[off : off + piece]
            msg = AppendRequest(
                1, pos, Lsn(pos + len(wal)), pos if commit else INVALID_LSN, INVALID_LSN, wal
            )
            head = encode_append_request_header(msg, 3)
            out += _COPY_HEAD.pack(b"d", 4 + len(head) + len(wal))
            out += head
            out += wal
            pos = Lsn(pos + len(wal))
            remaining -= len(wal)
            if remaining <= 0:
                break
        segno += 1
    return bytes(out), pos


async def run_config(
    workdir: Path, stream: bytes, start: Lsn, end: Lsn, msg_size: int, *, fsync: bool,
    coalescing: bool, seconds: float, impl: str = "native",
    wal_io_engine: str = "writer-thread", gil_switch_interval_s: float | None = None,
    direct_io: bool = False,
) -> dict[str, object]:
    settings: dict[str, Any] = {
        "no_sync": not fsync, "max_write_bytes": (1 << 20) if coalescing else 0,
        "wal_io_engine": wal_io_engine, "wal_direct_io": direct_io,
    }
    if gil_switch_interval_s is not None:
        settings["gil_switch_interval_s"] = gil_switch_interval_s
    sk = SafekeeperProcess(workdir, pure_python=impl == "python", **settings)
    sk.start()
    try:
        assert sk.proc is not None
        cpu_at_start = process_cpu_seconds(sk.proc.pid)
        async with await TestProposer.connect("127.0.0.1", sk.pg_port, TENANT, TIMELINE) as p:
            await p.greet()
            await p.elect(start, term=1)
            last_flush = start
            last_ack = time.perf_counter()
            responses = 0
            transport = p.copy.transport
            burst = max(msg_size, 1 << 20) if msg_size > MAX_SEND_SIZE else 1 << 20
            t0 = time.perf_counter()
            proposer_cpu0 = time.process_time()

            async def send_all() -> None:
                view = memoryview(stream)
                for off in range(0, len(view), burst):
                    await transport.send_all(view[off : off + burst])

            async def receive_acks(cancel: trio.CancelScope) -> None:
                nonlocal last_flush, last_ack, responses
                while True:
                    payload = await p.copy.receive()
                    if payload is None:
                        raise RuntimeError("safekeeper ended the stream")
                    msg = decode_acceptor_message(payload, 3)
                    if isinstance(msg, AppendResponse):
                        responses += 1
                        if msg.flush_lsn > last_flush:
                            last_flush = msg.flush_lsn
                            last_ack = time.perf_counter()
                        if last_flush >= end:
                            cancel.cancel()
                            return

            with trio.move_on_after(seconds) as window:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(send_all)
                    nursery.start_soon(receive_acks, nursery.cancel_scope)
            del window
        proposer_cpu_s = time.process_time() - proposer_cpu0
        status = sk.timeline_status(TENANT, TIMELINE)
        assert sk.proc is not None
        cpu_s = process_cpu_seconds(sk.proc.pid) - cpu_at_start
    finally:
        sk.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    elapsed = last_ack - t0
    acked = last_flush - start
    return {
        "bench": "wal-acceptor",
        "msg_size": msg_size,
        "fsync": fsync,
        "coalescing": coalescing,
        "wal_io_engine": wal_io_engine,
        "wal_direct_io": direct_io,
        # None: the node's default (SafekeeperConfig.gil_switch_interval_s).
        "gil_switch_interval_s": gil_switch_interval_s,
        "acked_mib": round(acked / (1 << 20), 2),
        "seconds": round(elapsed, 3),
        "mib_s": round(acked / (1 << 20) / elapsed, 2) if elapsed > 0 else 0.0,
        # CPU seconds the safekeeper used: on a shared machine MiB per CPU-second is the
        # steadier figure of its efficiency.
        "sk_cpu_s": round(cpu_s, 3),
        "mib_per_cpu_s": round(acked / (1 << 20) / cpu_s, 2) if cpu_s > 0 else 0.0,
        "proposer_cpu_s": round(proposer_cpu_s, 3),
        "responses": responses,
        "write_groups": status["write_groups"],
        "write_messages": status["write_messages"],
        "write_appends": status.get("write_appends"),
        "fsyncs": status["fsyncs"],
    }


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux ``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raw_disk_rate(
    directory: Path, *, fsync: bool, seconds: float, max_mib: int, cached: bool = False,
    direct: bool = False,
) -> dict[str, object]:
    """1 MiB ``pwrite`` s (about one write group) into a preallocated file, each followed by
    an ``fdatasync`` if ``fsync``. ``cached``: the file was written once and synced before
    the timed pass, so the pass only overwrites pages already in the page cache (a fresh file
    needs a new page-cache page for every 4 KiB, which is most of a no-fsync write's cost
    on this machine) over blocks already initialized (a fallocated block is "unwritten" in
    ext4 until its first write, and the ``fdatasync`` after that write commits the change
    in the journal). ``direct``: the file is written with ``O_DIRECT`` from an aligned
    buffer (no page cache at all; ``cached`` then only means initialized blocks)."""
    path = directory / "raw-disk-test"
    block: bytes | mmap.mmap = os.urandom(1 << 20)
    if direct:
        aligned = mmap.mmap(-1, 1 << 20)
        aligned.write(block)
        block = aligned
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    cpu0 = 0.0
    try:
        os.posix_fallocate(fd, 0, max_mib << 20)
        os.fsync(fd)
        if cached:
            for off in range(0, max_mib << 20, len(block)):
                os.pwrite(fd, block, off)
            os.fsync(fd)
        written = 0
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        while written < max_mib << 20 and time.perf_counter() - t0 < seconds:
            os.pwrite(fd, block, written)
            if fsync:
                os.fdatasync(fd)
            written += len(block)
        elapsed = time.perf_counter() - t0
        cpu_s = time.process_time() - cpu0
    finally:
        os.close(fd)
        path.unlink()
    return {
        "bench": "raw-disk",
        "write_size": 1 << 20,
        "fsync": fsync,
        "page_cache": "cached" if cached else "fresh",
        "io": "direct" if direct else "buffered",
        "mib": written >> 20,
        "seconds": round(elapsed, 3),
        "mib_s": round(written / (1 << 20) / elapsed, 2),
        "mib_per_cpu_s": round(written / (1 << 20) / cpu_s, 2) if cpu_s > 0 else 0.0,
    }


# -- floors: the receiver process --------------------------------------------------------


class _FrameFeeder:
    """Cuts CopyData('d') + v3 AppendRequest framing out of the raw stream, in any
    segmentation, and feeds the WAL bytes to a ``RecordTracker`` (which raises on any
    invalid record or page header)."""

    def __init__(self, start: Lsn) -> None:
        self.tracker = RecordTracker(start, WAL_SEGMENT_SIZE)
        dummy = AppendRequest(1, start, start, INVALID_LSN, INVALID_LSN, b"")
        self.head_len = _COPY_HEAD.size + len(encode_append_request_header(dummy, 3))
        self.head = bytearray()
        self.wal_left = 0

    def feed(self, view: memoryview) -> None:
        i, n = 0, len(view)
        while i < n:
            if self.wal_left:
                take = min(self.wal_left, n - i)
                self.tracker.feed(view[i : i + take])
                self.wal_left -= take
                i += take
                continue
            take = min(self.head_len - len(self.head), n - i)
            self.head += view[i : i + take]
            i += take
            if len(self.head) == self.head_len:
                tag, length = _COPY_HEAD.unpack_from(self.head)
                if tag != b"d":
                    raise ValueError(f"unexpected message {tag!r} in the floor stream")
                self.wal_left = length + 1 - self.head_len
                self.head = bytearray()


class _FloorWriter:
    """The writer thread of the write floors: groups of received slices, one ``pwritev``
    per segment, one ``fdatasync`` per group on a fresh descriptor (at most two in flight,
    acknowledged in order), 8-byte acknowledgements of the stream bytes taken."""

    def __init__(self, directory: Path, conn: socket.socket, fsync: bool, free: queue.Queue[bytearray]) -> None:
        self.directory = directory
        self.conn = conn
        self.fsync = fsync
        self.free = free
        self.slices: queue.Queue[tuple[bytearray, int, int] | None] = queue.Queue()
        self.pos = 0  # stream bytes written
        self.fd = -1
        self.segno = -1
        self.syncs: deque[tuple[Future[None], int]] = deque()
        self.pool = ThreadPoolExecutor(max_workers=2)

    def segment(self, segno: int) -> int:
        if segno != self.segno:
            if self.fd >= 0:
                os.close(self.fd)
            path = self.directory / f"floor-{segno:08X}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.posix_fallocate(fd, 0, WAL_SEGMENT_SIZE)
            if self.fsync:
                os.fsync(fd)
                dfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
                os.fsync(dfd)
                os.close(dfd)
            self.fd, self.segno = fd, segno
        return self.fd

    def write(self, views: list[memoryview]) -> None:
        for segno, off, iov, size in split_at_segments(self.pos, views, WAL_SEGMENT_SIZE):
            fd = self.segment(segno)
            done = 0
            while done < size:
                n = os.pwritev(fd, iov, off + done)
                if n <= 0:
                    raise OSError("pwritev made no progress")
                done += n
                iov = _drop_written(iov, n)
            self.pos += size

    def ack(self, count: int) -> None:
        self.conn.sendall(_ACK.pack(count))

    def ack_oldest(self) -> None:
        fut, count = self.syncs.popleft()
        fut.result()
        self.ack(count)

    def run(self) -> None:
        try:
            while True:
                if self.syncs:
                    try:
                        item = self.slices.get_nowait()
                    except queue.Empty:
                        # Nothing to overlap with: acknowledge the oldest group.
                        self.ack_oldest()
                        continue
                else:
                    item = self.slices.get()
                if item is None:
                    break
                group = [item]
                size = item[2] - item[1]
                while size < FLOOR_GROUP:
                    try:
                        more = self.slices.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        self.slices.put(None)
                        break
                    group.append(more)
                    size += more[2] - more[1]
                self.write([memoryview(b)[s:e] for b, s, e in group])
                for b, _s, e in group:
                    if e == len(b):
                        self.free.put(b)  # written: the receive thread may refill it
                if not self.fsync:
                    self.ack(self.pos)
                    continue
                while len(self.syncs) >= 2:
                    self.ack_oldest()
                sync_fd = os.open(self.directory / f"floor-{self.segno:08X}", os.O_RDONLY)
                self.syncs.append((self.pool.submit(_fdatasync_close, sync_fd), self.pos))
            while self.syncs:
                self.ack_oldest()
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            self.pool.shutdown()


def _fdatasync_close(fd: int) -> None:
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _drop_written(iov: list[memoryview], n: int) -> list[memoryview]:
    rest: list[memoryview] = []
    for v in iov:
        if n >= len(v):
            n -= len(v)
            continue
        rest.append(v[n:])
        n = 0
    return rest


def floor_serve(mode: str, directory: Path, start: Lsn, total_bytes: int) -> int:
    """The receiver process of one floor configuration (see the module docstring)."""
    write = mode.startswith("sink-write")
    fsync = "fsync" in mode
    feeder = _FrameFeeder(start) if mode.endswith("-crc") else None
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
    listener.close()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if not write:
        buf = bytearray(FLOOR_GROUP)
        view = memoryview(buf)
        total = acked = 0
        try:
            while True:
                n = conn.recv_into(view)
                if n == 0:
                    break
                total += n
                if total - acked >= FLOOR_GROUP or total == total_bytes:
                    conn.sendall(_ACK.pack(total))
                    acked = total
        except (BrokenPipeError, ConnectionResetError):
            pass
        return 0
    free: queue.Queue[bytearray] = queue.Queue()
    for _ in range(FLOOR_BUFFERS):
        free.put(bytearray(FLOOR_GROUP))
    writer = _FloorWriter(directory, conn, fsync, free)
    thread = threading.Thread(target=writer.run, name="floor-writer")
    thread.start()
    try:
        while True:
            buf = free.get()
            view = memoryview(buf)
            fill = 0
            while fill < len(buf):
                n = conn.recv_into(view[fill:])
                if n == 0:
                    break
                if feeder is not None:
                    # Checked before it is handed to the writer, as in the safekeeper.
                    feeder.feed(view[fill : fill + n])
                writer.slices.put((buf, fill, fill + n))
                fill += n
            if fill < len(buf):
                break
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        writer.slices.put(None)
        thread.join()
    return 0


# -- floors: the proposer side -------------------------------------------------------------


async def run_floor(
    workdir: Path, mode: str, stream: bytes, start: Lsn, wal_bytes: int, msg_size: int,
    seconds: float,
) -> dict[str, object]:
    """Push ``stream`` to a floor receiver exactly as ``run_config`` pushes it to the
    safekeeper (same bursts); the rate is acknowledged WAL bytes over the last ack's time."""
    workdir.mkdir(parents=True)
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "bench.wal_acceptor", "--floor", mode, str(workdir),
            str(start), str(len(stream)),
        ],
        cwd=root, stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        cpu_at_start = process_cpu_seconds(proc.pid)
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        burst = max(msg_size, 1 << 20) if msg_size > MAX_SEND_SIZE else 1 << 20
        acked = 0
        t0 = last_ack = time.perf_counter()
        proposer_cpu0 = time.process_time()
        responses = 0

        async def send_all() -> None:
            view = memoryview(stream)
            for off in range(0, len(view), burst):
                await tcp.send_all(view[off : off + burst])

        async def receive_acks(cancel: trio.CancelScope) -> None:
            nonlocal acked, last_ack, responses
            pending = b""
            while True:
                data = await tcp.receive_some(1 << 16)
                if not data:
                    raise RuntimeError(f"floor {mode} ended the stream")
                pending += data
                whole = len(pending) - len(pending) % _ACK.size
                for off in range(0, whole, _ACK.size):
                    (count,) = _ACK.unpack_from(pending, off)
                    responses += 1
                    if count > acked:
                        acked = count
                        last_ack = time.perf_counter()
                pending = pending[whole:]
                if acked >= len(stream):
                    cancel.cancel()
                    return

        with trio.move_on_after(seconds):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_all)
                nursery.start_soon(receive_acks, nursery.cancel_scope)
        proposer_cpu_s = time.process_time() - proposer_cpu0
        cpu_s = process_cpu_seconds(proc.pid) - cpu_at_start
        await tcp.aclose()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    elapsed = last_ack - t0
    # Acknowledged stream bytes -> WAL bytes (the framing is ~0.04% at 128 KiB).
    acked_wal = acked * wal_bytes / len(stream)
    return {
        "bench": "wal-acceptor-floor",
        "floor": mode,
        "msg_size": msg_size,
        "fsync": "fsync" in mode,
        "acked_mib": round(acked_wal / (1 << 20), 2),
        "seconds": round(elapsed, 3),
        "mib_s": round(acked_wal / (1 << 20) / elapsed, 2) if elapsed > 0 else 0.0,
        "sk_cpu_s": round(cpu_s, 3),
        "mib_per_cpu_s": round(acked_wal / (1 << 20) / cpu_s, 2) if cpu_s > 0 else 0.0,
        "proposer_cpu_s": round(proposer_cpu_s, 3),
        "responses": responses,
    }


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=",".join(SIZES), help="AppendRequest sizes: " + ",".join(SIZES))
    parser.add_argument("--seconds", type=float, default=3.0, help="time window per configuration")
    parser.add_argument("--max-mib", type=int, default=256, help="WAL pushed at most per configuration")
    parser.add_argument("--record-size", type=int, default=200, help="WAL record size in bytes")
    parser.add_argument("--fsync", default="on,off", help="on, off or both")
    parser.add_argument("--coalescing", default="on,off", help="on, off or both")
    parser.add_argument("--commit", default="on,off", help="commit_lsn advancing: on, off or both")
    parser.add_argument("--repeat", type=int, default=1, help="runs per configuration; the best is printed (noisy machines)")
    parser.add_argument("--dir", type=Path, default=None, help="where the safekeepers write (default: a temp dir)")
    parser.add_argument("--floor", nargs=4, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG: MiB/s and MiB per CPU-second per row, native beside python")
    parser.add_argument(
        "--impl", default="native,python",
        help="kernels of the safekeeper under test: native (Cython), python (PAGESTORE_PURE_PYTHON=1) or both, side by side",
    )
    parser.add_argument(
        "--wal-io-engine", default="writer-thread",
        help="the safekeeper's wal_io_engine: writer-thread, threadpool or both, side by side",
    )
    parser.add_argument(
        "--wal-direct-io", default="off",
        help="the safekeeper's wal_direct_io: off (buffered writes), on (O_DIRECT) or both, side by side",
    )
    parser.add_argument(
        "--gil-switch-interval", default="node",
        help="the safekeeper's gil_switch_interval_s (seconds; 'node': its default), several "
        "side by side: e.g. 0.005,0.0005 (0.005 is Python's own default)",
    )
    parser.add_argument(
        "--floors", default="on", choices=("on", "off", "only"),
        help="floor receivers beside the safekeeper for sizes >= 128KiB (only: floors alone)",
    )


def _impls(text: str) -> list[str]:
    impls = [part.strip() for part in text.split(",") if part.strip()]
    bad = [i for i in impls if i not in ("native", "python")]
    if bad or not impls:
        raise SystemExit(f"--impl: native, python or both (got {text!r})")
    return impls


def _flags(text: str) -> list[bool]:
    return [part.strip() == "on" for part in text.split(",") if part.strip()]


def _repeat(
    args: argparse.Namespace, base: Path, adjacent_raw: bool,
    one: Callable[[int], dict[str, object]], direct: bool = False,
) -> dict[str, object]:
    """Run one configuration ``--repeat`` times (each fsynced or floor run right after its
    own 1 s raw fsynced measurement, with the run's IO: ``direct`` for O_DIRECT runs, which
    also get a buffered one) and summarise: the best run, plus every run's rate, the medians
    and the median ratio to the adjacent raw fsynced rate."""
    runs = []
    raw_near: list[float] = []
    raw_near_buffered: list[float] = []
    for i in range(max(args.repeat, 1)):
        if adjacent_raw:
            # This virtual disk's fsynced rate swings several-fold between minutes:
            # measure it right next to every fsynced run.
            near = raw_disk_rate(
                base, fsync=True, seconds=min(args.seconds, 1.0), max_mib=args.max_mib,
                direct=direct,
            )
            raw_near.append(float(near["mib_s"]))  # type: ignore[arg-type]
            if direct:
                near = raw_disk_rate(
                    base, fsync=True, seconds=min(args.seconds, 1.0), max_mib=args.max_mib
                )
                raw_near_buffered.append(float(near["mib_s"]))  # type: ignore[arg-type]
        runs.append(one(i))
    result = max(runs, key=lambda r: float(r["mib_s"]))  # type: ignore[arg-type]
    result["runs_mib_s"] = [r["mib_s"] for r in runs]
    result["runs_mib_per_cpu_s"] = [r["mib_per_cpu_s"] for r in runs]
    result["median_mib_s"] = statistics.median(float(r["mib_s"]) for r in runs)  # type: ignore[arg-type]
    result["median_mib_per_cpu_s"] = statistics.median(
        float(r["mib_per_cpu_s"]) for r in runs  # type: ignore[arg-type]
    )
    if raw_near:
        result["raw_fsync_near_mib_s"] = raw_near
        result["median_pct_of_raw_fsync"] = _median_pct(runs, raw_near)
    if raw_near_buffered:
        result["raw_fsync_near_buffered_mib_s"] = raw_near_buffered
        result["median_pct_of_raw_fsync_buffered"] = _median_pct(runs, raw_near_buffered)
    result["record_size"] = args.record_size
    return result


def _median_pct(runs: list[dict[str, object]], raws: list[float]) -> float:
    """The median of each run's rate over the raw fsynced rate measured just before it, in %."""
    ratios = [
        float(r["mib_s"]) / raw  # type: ignore[arg-type]
        for r, raw in zip(runs, raws, strict=True)
        if raw > 0
    ]
    return round(100 * statistics.median(ratios), 1)


def _one_real(
    workdir: Path, stream: bytes, start: Lsn, end: Lsn, msg_size: int, fsync: bool,
    coalescing: bool, seconds: float, impl: str, engine: str, switch: float | None,
    direct: bool, i: int,
) -> dict[str, object]:
    return trio.run(
        partial(
            run_config, workdir.with_name(f"{workdir.name}-{i}"), stream, start, end, msg_size,
            fsync=fsync, coalescing=coalescing, seconds=seconds, impl=impl,
            wal_io_engine=engine, gil_switch_interval_s=switch, direct_io=direct,
        )
    )


def _switch_intervals(text: str) -> list[float | None]:
    out: list[float | None] = []
    for part in (p.strip() for p in text.split(",")):
        if part == "node":
            out.append(None)
            continue
        try:
            value = float(part)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise SystemExit(f"--gil-switch-interval: positive seconds or 'node' (got {part!r})")
        out.append(value)
    if not out:
        raise SystemExit("--gil-switch-interval: at least one value")
    return out


def _engines(text: str) -> list[str]:
    engines = [part.strip() for part in text.split(",") if part.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad or not engines:
        raise SystemExit(f"--wal-io-engine: {', '.join(ENGINES)} or several (got {text!r})")
    return engines


def _one_floor(
    workdir: Path, mode: str, stream: bytes, start: Lsn, wal_bytes: int, msg_size: int,
    seconds: float, i: int,
) -> dict[str, object]:
    return trio.run(
        run_floor, workdir.with_name(f"{workdir.name}-{i}"), mode, stream, start, wal_bytes,
        msg_size, seconds,
    )


def run(args: argparse.Namespace) -> int:
    if args.floor:
        mode, directory, start, total_bytes = args.floor
        return floor_serve(mode, Path(directory), Lsn(int(start)), int(total_bytes))
    base = Path(tempfile.mkdtemp(prefix="pagestore-bench-sk-", dir=args.dir))
    rows: list[dict[str, object]] = []
    try:
        directs = _flags(args.wal_direct_io)
        raw_kinds = [(True, False, False), (True, True, False), (False, False, False), (False, True, False)]
        if True in directs:
            raw_kinds += [(True, False, True), (True, True, True)]
        for fsync, cached, direct in raw_kinds:
            raws = [
                raw_disk_rate(
                    base, fsync=fsync, seconds=args.seconds, max_mib=args.max_mib, cached=cached,
                    direct=direct,
                )
                for _ in range(max(args.repeat, 1))
            ]
            raw = max(raws, key=lambda r: float(r["mib_s"]))  # type: ignore[arg-type]
            raw["runs_mib_s"] = [r["mib_s"] for r in raws]
            raw["runs_mib_per_cpu_s"] = [r["mib_per_cpu_s"] for r in raws]
            raw["median_mib_s"] = statistics.median(float(r["mib_s"]) for r in raws)  # type: ignore[arg-type]
            print(json.dumps(raw), flush=True)
        template = segment_template(args.record_size)
        start = Lsn(WAL_SEGMENT_SIZE)
        total = args.max_mib << 20
        n = 0
        for size_name in args.sizes.split(","):
            msg_size = SIZES[size_name.strip()]
            for c, commit in enumerate(_flags(args.commit)):
                stream, end = framed_stream(template, 1, total, msg_size, commit)
                for fsync in _flags(args.fsync) if args.floors != "only" else []:
                    for coalescing in _flags(args.coalescing):
                        for impl in _impls(args.impl):
                            for engine, switch, direct in itertools.product(
                                _engines(args.wal_io_engine),
                                _switch_intervals(args.gil_switch_interval),
                                directs,
                            ):
                                if direct and not fsync:
                                    # no_sync writes through the page cache in both modes
                                    # (SafekeeperConfig.direct_io): the row would repeat.
                                    continue
                                n += 1

                                real = partial(
                                    _one_real, base / f"sk{n}", stream, start, end, msg_size,
                                    fsync, coalescing, args.seconds, impl, engine, switch,
                                    direct,
                                )
                                result = _repeat(args, base, fsync, real, direct)
                                result["commit_advancing"] = commit
                                result["impl"] = impl
                                rows.append(result)
                                print(json.dumps(result), flush=True)
                if args.floors != "off" and c == 0:
                    modes: list[str] = []
                    flags = _flags(args.fsync)
                    if True in flags:
                        modes += FLOORS_FSYNC
                    if False in flags:
                        modes += [m for m in ("sink", *FLOORS_NO_FSYNC) if m not in modes]
                    if msg_size < MAX_SEND_SIZE:
                        # The -crc floors cut the framing per message in Python: below
                        # 128 KiB that loop, not the machine, would be the floor.
                        modes = [m for m in modes if not m.endswith("-crc")]
                    for mode in modes:
                        n += 1

                        floor = partial(
                            _one_floor, base / f"floor{n}", mode, stream, start, end - start,
                            msg_size, args.seconds,
                        )
                        result = _repeat(args, base, "fsync" in mode or mode == "sink", floor)
                        result["commit_advancing"] = commit
                        print(json.dumps(result), flush=True)
                del stream
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.plot is not None:
        plot_impls(rows, args.plot)
    return 0


def plot_impls(rows: list[dict[str, object]], path: Path) -> None:
    """Bars per configuration (size, fsync, coalescing): median MiB/s and median MiB per
    safekeeper CPU-second, one bar per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(r: dict[str, object]) -> str:
        size = int(r["msg_size"])  # type: ignore[call-overload]
        name = f"{size // 1024} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
        return f"{name} fsync {'on' if r['fsync'] else 'off'}" + ("" if r["coalescing"] else " uncoal.")

    several_engines = len({r.get("wal_io_engine") for r in rows}) > 1
    several_switches = len({r.get("gil_switch_interval_s") for r in rows}) > 1
    several_io = len({r.get("wal_direct_io") for r in rows}) > 1

    def series(r: dict[str, object]) -> str:
        # One bar per implementation, and per WAL IO engine / GIL switch interval when the
        # run compared them.
        name = f"{r['impl']} {r['wal_io_engine']}" if several_engines else str(r["impl"])
        if several_switches:
            switch = r.get("gil_switch_interval_s")
            name += " switch " + ("node" if switch is None else f"{float(switch) * 1e3:g} ms")  # type: ignore[arg-type]
        if several_io:
            name += " O_DIRECT" if r.get("wal_direct_io") else " buffered"
        return name

    configs = list(dict.fromkeys(label(r) for r in rows))
    impls = list(dict.fromkeys(series(r) for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(max(11.0, 1.1 * len(configs)), 5.2))
    width = 0.8 / max(len(impls), 1)
    for ax, key, title in (
        (axes[0], "median_mib_s", "WAL acknowledged, MiB/s (median)"),
        (axes[1], "median_mib_per_cpu_s", "MiB per safekeeper CPU-second (median)"),
    ):
        for k, impl in enumerate(impls):
            values = [
                next((float(r[key]) for r in rows if label(r) == c and series(r) == impl), 0.0)  # type: ignore[arg-type]
                for c in configs
            ]
            ax.bar([x + k * width for x in range(len(configs))], values, width, label=impl)
        ax.set_xticks(
            [x + width * (len(impls) - 1) / 2 for x in range(len(configs))], configs,
            rotation=55, ha="right", fontsize=8,
        )
        ax.set_title(title, fontsize=10)
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle("pagestore bench wal-acceptor: native kernels vs pure-Python twins (one run)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    # The floor receiver process: python -m bench.wal_acceptor --floor MODE DIR START BYTES
    _parser = argparse.ArgumentParser()
    configure(_parser)
    sys.exit(run(_parser.parse_args()))
