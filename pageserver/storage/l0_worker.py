"""The background L0 writer: a worker process that writes a frozen in-memory layer's L0 file.

Writing the L0 of a rolled in-memory layer (``InMemoryLayer.write_l0``: cut the values out of
the ephemeral file, CRC them, build the index, fsync, rename) is CPU time the WAL ingest's core
should not pay: the packing kernel (``_l0_c``) releases the GIL, but the sort, the writes' own
kernel time and, with the pure-Python twin, all of it hold a core. A worker *process* takes it
off (Neon's flush is a background task too; here it is a process because of the GIL). ``Timeline`` decides when (``l0_writer = "process"``, layers of at least
``l0_writer_min_bytes``); this module only does the hand-off:

- ``L0Worker`` (pageserver side): one long-lived ``python -m pageserver.storage.l0_worker``
  child, started on first use, one job at a time. A job is the frozen layer's ephemeral file
  (its path: the tail must already be written, ``freeze`` does that) and its index, sent
  compactly: the keys joined, the per-key triple counts as one ``array('Q')``, then the index
  arrays' own bytes (no per-value pickling). The answer is the L0's path once it is durable
  (the worker ran ``write_l0`` itself, so the file is the one the in-process writer writes, byte
  for byte), or the worker's error. An answer that names anything but this job's L0 in the
  job's directory (``_check_answer``) is a protocol error: nothing is published from it.
- Failure: an error the worker reports (an ``OSError`` such as EIO: the worker aborted its temp
  files) becomes ``L0WorkerError`` with the worker's errno and message; a worker that dies or
  is killed mid-job, a broken pipe or a cancelled job (the process is then killed and reaped,
  so it never writes behind the caller's back) becomes ``L0WorkerError`` too, and the next job
  starts a new worker. The caller keeps its frozen layer (nothing advanced) either way.
- Staging (the job's ``stage``, given when the timeline uploads to remote storage): once the
  L0 is durable, the worker claims its staging (``remote_compression.begin_staging``: a locked
  temp file) and answers; a staging thread then compresses the L0 into its staged remote object
  beside it (``stage_layer``: the file's pages are still in the page cache, and the codec's CPU
  is spent here, at the worker's niceness, instead of in the pageserver's process under its
  GIL) and lets the lock go. So the roll that waits for the L0 does not wait for the codec, and
  the upload, which waits for the lock, sends that object after its own checks
  (``RemoteTimelineClient._prepare``). One staging at a time, in job order; a failed staging is
  not a failed job (the upload compresses the layer itself). At EOF the worker finishes the
  stagings it has before it exits.
- Priority: the worker runs at niceness ``WORKER_NICE`` (background work: when the two compete
  for a core, the WAL ingest wins; the roll's backpressure bounds how far the worker lags).
- Shutdown: ``aclose`` closes the pipe (the worker exits on EOF), waits a moment, then kills;
  a worker whose parent dies without that sees EOF on its stdin too and exits, and a watchdog
  thread ends it within ``WATCHDOG_S`` (``common.child_io``) if the parent dies in the middle of a job (a restarted
  pageserver must not find a left-over writer renaming files into its timeline directory).

Wire format (little-endian, same machine: the arrays travel in native order):
request ``"L0Rq" u32 meta_len u64 body_len``, JSON meta, body (``iter_index_body``); answer
``"L0Rs" u32 len``, JSON ``{"path": str | null}`` or ``{"error", "errno", "message"}``.

Test seams (worker command-line flags, ``L0Worker(worker_args=...)``): ``--stall-s S`` sleeps
before every job's write; ``--eio-jobs N`` makes the first N jobs' second write fail with EIO;
``--big-layer-path`` writes small layers through the big-layer path (mapped, in small pieces);
``--stage-stall-s S`` sleeps before every staging (after the job's answer).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import mmap
import os
import queue
import struct
import sys
import threading
import time
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from common.child_io import open_pipes, read_exact, start_watchdog
from common.children import reap, spawn, stop
from pageserver.remote_compression import (
    StageSpec,
    begin_staging,
    codec_of,
    discard_staged,
    stage_layer,
)
from pageserver.storage.ephemeral_file import map_readonly
from pageserver.storage.inmemory_layer import FlatIndex, InMemoryLayer
from pageserver.storage.io_engine import BlockingIoEngine, IoFile
from pageserver.storage.key import KEY_SIZE, Key
from pageserver.storage.layer_file import WriteOptions
from protocol.errors import INTERNAL_ERROR, RemoteProtocolError
from protocol.lsn import Lsn

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from pageserver.storage.io_engine import SyncMode

REQUEST_MAGIC = b"L0Rq"
ANSWER_MAGIC = b"L0Rs"
_REQUEST = struct.Struct("<4sIQ")
_ANSWER = struct.Struct("<4sI")
# Index arrays are sent in pieces of about this many bytes (one join, one send each).
_SEND_CHUNK = 1 << 20
# The worker's niceness: background work, below the WAL ingest when they compete for a core
# (on a busy machine the ingest keeps its core; the worker catches up when the writer waits
# for it at the next roll). Measured at load ~3 on 2 cores, against writing the L0 inline: at
# nice 0 the worker competes with the ingest and cuts its wall time by ~6 %, at nice 10 by about
# a third, the L0 write then mostly after the ingest's end (docs/benchmarks.md, "bench
# bulk-ingest").
WORKER_NICE = 10
# A worker asked to stop (its pipe closed) gets this long before it is killed.
_EXIT_GRACE_S = 2.0
_MAX_META = 1 << 20

if array("Q").itemsize != 8:  # pragma: no cover - every platform we run on
    raise ImportError("array('Q') is not 8 bytes here: the L0 worker's index format needs it")


class L0WorkerError(OSError):
    """The L0 worker did not write the layer: its own error (errno kept), or it died."""


class L0WorkerProtocolError(RemoteProtocolError):
    """A malformed request or answer from the other side of the pageserver / L0 worker pipe
    (one of our own processes: a bug, hence SQLSTATE XX000)."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg, sqlstate=INTERNAL_ERROR)


# -- the index on the wire -----------------------------------------------------------------


def index_body_size(index: dict[Key, array[int]]) -> int:
    """The length of ``iter_index_body(index)``'s pieces together."""
    return len(index) * (KEY_SIZE + 8) + 8 * sum(map(len, index.values()))


def iter_index_body(index: dict[Key, array[int]]) -> Iterator[bytes]:
    """The body: the keys sorted and joined, the per-key counts, then the arrays' bytes in the
    same order, in pieces of about ``_SEND_CHUNK`` bytes made one at a time (C loops, no
    per-value object; the sender never holds more than a piece besides the index itself): the
    worker takes it as the flat index ``write_l0`` packs, without a dict or a sort of its own.
    ``index`` must not change meanwhile."""
    keys = sorted(index)
    yield b"".join(keys)
    arrays = [index[key] for key in keys]
    yield array("Q", map(len, arrays)).tobytes()
    group: list[array[int]] = []
    size = 0
    for entries in arrays:
        group.append(entries)
        size += len(entries)
        if size * 8 >= _SEND_CHUNK:
            yield b"".join(group)
            group = []
            size = 0
    if group:
        yield b"".join(group)


def decode_index(n_keys: int, body: bytes | bytearray | memoryview) -> FlatIndex:
    """The inverse of ``iter_index_body`` (for ``n_keys`` keys), as the flat index ``write_l0``
    packs (``flat_index``); ``L0WorkerProtocolError`` for a body that does not add up (wrong
    length, a count not a positive multiple of three, keys not strictly rising)."""
    view = memoryview(body)
    keys_end = n_keys * KEY_SIZE
    at = keys_end + 8 * n_keys
    if n_keys < 0 or len(view) < at:
        raise L0WorkerProtocolError(f"index body of {len(view)} bytes is too short for {n_keys} keys")
    counts: array[int] = array("Q")
    counts.frombytes(view[keys_end:at])
    if sum(counts) * 8 != len(view) - at:
        raise L0WorkerProtocolError(
            f"index body of {len(view)} bytes does not hold the {sum(counts)} entries its counts say"
        )
    for i, count in enumerate(counts):
        if count == 0 or count % 3:
            raise L0WorkerProtocolError(f"index key {i} has {count} entries, not triples")
    keys = bytes(view[:keys_end])
    for i in range(1, n_keys):
        if keys[(i - 1) * KEY_SIZE : i * KEY_SIZE] >= keys[i * KEY_SIZE : (i + 1) * KEY_SIZE]:
            raise L0WorkerProtocolError(f"index repeats a key or is out of order at key {i}")
    triples: array[int] = array("Q")
    triples.frombytes(view[at:])
    return keys, array("Q", [count // 3 for count in counts]), triples


def _check_answer(answer: dict[str, Any], layer: InMemoryLayer, directory: Path) -> Path | L0WorkerError:
    """The L0 the answer names, or the worker's own error (to raise once the job is done);
    ``L0WorkerProtocolError`` for an answer that is neither exactly this job's L0 in
    ``directory`` (as the worker builds it from the request) nor a well-formed error. Only
    this keeps ``disk_consistent_lsn`` from passing a layer whose file is elsewhere, someone
    else's (an earlier job's), or missing."""
    if "error" in answer:
        error, code, message = answer["error"], answer.get("errno"), answer.get("message")
        if not isinstance(error, str) or not isinstance(message, str) or not (code is None or type(code) is int):
            raise L0WorkerProtocolError(f"malformed error answer {answer!r}")
        return L0WorkerError(
            code or errno.EIO, f"the L0 worker failed writing {layer} to {directory}: {error}: {message}"
        )
    path = answer.get("path")
    want = os.fspath(directory / layer.l0_desc().file_name())
    if path != want:
        # (a layer with values always has an L0: ``write_l0`` returns None only without any)
        raise L0WorkerProtocolError(f"the answer names {path!r}, not this job's L0 {want!r}")
    return Path(want)


def _answer(obj: dict[str, Any]) -> bytes:
    payload = json.dumps(obj).encode()
    return _ANSWER.pack(ANSWER_MAGIC, len(payload)) + payload


# -- the pageserver side -------------------------------------------------------------------


class L0Worker:
    """A long-lived L0 writer process (started on first use; see the module docstring)."""

    def __init__(self, *, worker_args: Sequence[str] = (), nice: int = WORKER_NICE) -> None:
        self._args = (f"--nice={nice}", *worker_args)
        self._proc: trio.Process | None = None
        self._lock: trio.Lock | None = None
        self._closed = False
        self.jobs = 0  # answered jobs (for tests and benchmarks)
        self.starts = 0  # processes started

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def busy(self) -> bool:
        """A job is being sent or written."""
        return self._lock is not None and self._lock.locked()

    async def write_l0(
        self,
        layer: InMemoryLayer,
        directory: Path,
        *,
        buffer_size: int,
        write_sync_mode: SyncMode,
        stage: StageSpec | None = None,
    ) -> Path | None:
        """What ``layer.write_l0(engine, directory, WriteOptions(buffer_size))`` returns, the
        file written by the worker (durable: fsynced, renamed, directory fsynced). ``layer``
        must be frozen with its tail in the file (``InMemoryLayer.freeze`` returned).
        ``stage``: the worker also compresses the L0 into its staged remote object
        (``remote_compression.stage_layer``) before it answers."""
        if layer.end_lsn is None or not layer.file.writer.closed:
            raise AssertionError(f"{layer}: only a frozen layer whose tail is written goes to the L0 worker")
        if not layer.index:
            return None  # (write_l0's answer for a layer without values; no process needed)
        if self._lock is None:
            self._lock = trio.Lock()
        async with self._lock:
            index = layer.index  # (frozen: it does not change while it is sent)
            meta = json.dumps({
                "ephemeral": os.fspath(layer.file.path),
                "length": layer.size,
                "start_lsn": layer.start_lsn,
                "end_lsn": layer.end_lsn,
                "directory": os.fspath(directory),
                "buffer_size": buffer_size,
                "write_sync_mode": write_sync_mode,
                "n_keys": len(index),
                "stage": None if stage is None else attrs.asdict(stage),
            }).encode()
            header = _REQUEST.pack(REQUEST_MAGIC, len(meta), index_body_size(index))
            proc = await self._start()
            answer: dict[str, Any] | None = None
            try:
                assert proc.stdin is not None and proc.stdout is not None
                await proc.stdin.send_all(header + meta)
                for piece in iter_index_body(index):
                    await proc.stdin.send_all(piece)
                answer = await self._receive(proc.stdout)
                # (a malformed answer is a protocol error: the worker is killed below)
                result = _check_answer(answer, layer, directory)
            except (trio.BrokenResourceError, trio.ClosedResourceError, L0WorkerProtocolError) as exc:
                died = await self._kill()
                raise L0WorkerError(
                    errno.EIO, f"the L0 worker (pid {proc.pid}) failed while writing {layer} to "
                    f"{directory}: {died}; {type(exc).__name__}: {exc}",
                ) from exc
            finally:
                if answer is None:
                    # cancelled, or failed above: the worker may still be writing this layer;
                    # it must not do so behind our back (the next job restarts it)
                    await self._kill()
            self.jobs += 1
        if isinstance(result, L0WorkerError):
            raise result
        return result

    async def _start(self) -> trio.Process:
        self._check_open()
        proc = self._proc
        if proc is not None and proc.returncode is None:
            return proc
        if proc is not None:
            # it ended between jobs: nothing was lost, a new one takes the next job
            self._proc = None
            await reap(proc)
        proc = await spawn("pageserver.storage.l0_worker", self._args)
        try:
            self._check_open()  # closed while it started: it must not outlive its owner
        except L0WorkerError:
            await reap(proc)
            raise
        self._proc = proc
        self.starts += 1
        return proc

    def _check_open(self) -> None:
        if self._closed:
            raise L0WorkerError(errno.ESHUTDOWN, "the L0 worker is closed (its timeline is shut down)")

    async def _receive(self, stream: trio.abc.ReceiveStream) -> dict[str, Any]:
        buf = bytearray()
        need = _ANSWER.size
        header_done = False
        while True:
            while len(buf) < need:
                data = await stream.receive_some()
                if not data:
                    raise trio.BrokenResourceError("the L0 worker closed its answer pipe")
                buf += data
            if header_done:
                break
            magic, length = _ANSWER.unpack_from(buf)
            if magic != ANSWER_MAGIC or length > _MAX_META:
                raise L0WorkerProtocolError(f"bad answer header {bytes(buf[: _ANSWER.size])!r}")
            need += length
            header_done = True
        if len(buf) != need:
            raise L0WorkerProtocolError(f"{len(buf) - need} unexpected bytes after the answer")
        try:
            answer = json.loads(bytes(buf[_ANSWER.size :]))
        except (ValueError, RecursionError) as exc:  # (hostile nesting: RecursionError)
            raise L0WorkerProtocolError(f"answer is not JSON: {exc}") from None
        if not isinstance(answer, dict):
            raise L0WorkerProtocolError(f"answer is not an object: {answer!r}")
        return answer

    async def _kill(self) -> str:
        """Kill and reap the worker; says how it ended."""
        proc, self._proc = self._proc, None
        if proc is None:
            return "no worker"
        await reap(proc)
        rc = proc.returncode
        return f"exit status {rc}" if rc is None or rc >= 0 else f"killed by signal {-rc}"

    async def aclose(self) -> None:
        """Stop the worker for good (timeline shutdown): EOF on its pipe, then kill after
        ``_EXIT_GRACE_S``; reaped before this returns. Later jobs are refused."""
        self._closed = True
        proc, self._proc = self._proc, None
        if proc is not None:
            await stop(proc, _EXIT_GRACE_S)


# -- the worker process --------------------------------------------------------------------


class _FrozenFile:
    """The read side of a frozen ephemeral file, what ``write_l0`` reads (``FrozenData``)."""

    def __init__(self, file: IoFile, length: int) -> None:
        self._file = file
        self.length = length

    async def read_all(self) -> bytes:
        return await self._file.read_exact_at(0, self.length)

    def mapped(self) -> mmap.mmap | None:
        return map_readonly(self._file.fd, self.length)

    async def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        for offset, size in ranges:
            if offset < 0 or size < 0 or offset + size > self.length:
                raise ValueError(f"read of {size} bytes at {offset} outside the layer's {self.length} bytes")
        return await self._file.read_many_exact_at(ranges)


class _EioEngine(BlockingIoEngine):
    """``--eio-jobs``: from the job's second write on, writes fail as on a dying disk."""

    def __init__(self, write_sync_mode: SyncMode) -> None:
        super().__init__(write_sync_mode=write_sync_mode)
        self.writes = 0

    def _maybe_fail(self) -> None:
        self.writes += 1
        if self.writes >= 2:
            raise OSError(errno.EIO, "injected EIO (--eio-jobs)")

    async def pwrite(self, fd: int, data: Buffer, offset: int) -> None:
        self._maybe_fail()
        await super().pwrite(fd, data, offset)

    async def pwritev(self, fd: int, buffers: Sequence[Buffer], offset: int) -> None:
        self._maybe_fail()
        await super().pwritev(fd, buffers, offset)


def _stage_spec(raw: object) -> StageSpec | None:
    """The request's ``stage`` (from our own pageserver; a malformed one is its bug)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("level"), int) or not isinstance(raw.get("probe"), bool):
        raise L0WorkerProtocolError(f"malformed stage {raw!r}")
    return StageSpec(codec_of(str(raw.get("codec"))), raw["level"], raw["probe"])


class _Stager:
    """The staging thread: the staged objects of answered jobs' L0s, one at a time, in order
    (``remote_compression.stage_layer``). Each job's claim (``begin_staging``) is taken before
    its answer and let go here once its object is renamed into place or given up. A failure
    is not the job's: the L0 is durable, and the upload compresses the layer itself when it
    finds no staged object."""

    def __init__(self, stall_s: float = 0.0) -> None:
        self._stall_s = stall_s  # (test seam: ``--stage-stall-s``)
        self._jobs: queue.SimpleQueue[tuple[Path, StageSpec, int] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, path: Path, spec: StageSpec, claim: int) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="l0-stager")
            self._thread.start()
        self._jobs.put((path, spec, claim))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            path, spec, claim = job
            try:
                if self._stall_s:
                    time.sleep(self._stall_s)
                stage_layer(path, spec)
            except OSError as exc:
                print(f"l0_worker: staging {path.name} failed ({exc}); the upload compresses it", file=sys.stderr)
            finally:
                os.close(claim)  # (the upload waits for this)

    def close(self) -> None:
        """Finish what was submitted, then stop the thread."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None


async def _write_job(meta: dict[str, Any], index: FlatIndex, eio: bool, stager: _Stager) -> str | None:
    sync_mode: SyncMode = meta["write_sync_mode"]
    stage = _stage_spec(meta.get("stage"))
    engine = _EioEngine(sync_mode) if eio else BlockingIoEngine(write_sync_mode=sync_mode)
    file = await engine.open_file(Path(meta["ephemeral"]), "r")
    try:
        if await file.size() < meta["length"]:
            raise OSError(errno.EIO, f"{meta['ephemeral']} is shorter than the layer's {meta['length']} bytes")
        layer = InMemoryLayer.frozen_view(
            _FrozenFile(file, meta["length"]), index, Lsn(meta["start_lsn"]), Lsn(meta["end_lsn"])
        )
        directory = Path(meta["directory"])
        # A staged object left by an earlier attempt at this L0 must not pass for the new one's
        # (the upload's checks would refuse it too: older than the layer).
        with contextlib.suppress(OSError):
            discard_staged(directory / layer.l0_desc().file_name())
        path = await layer.write_l0(engine, directory, WriteOptions(buffer_size=meta["buffer_size"]))
    finally:
        await file.aclose()
    if path is not None and stage is not None:
        try:
            claim = begin_staging(path)
        except OSError as exc:
            print(f"l0_worker: staging {path.name} failed ({exc}); the upload compresses it", file=sys.stderr)
        else:
            stager.submit(path, stage, claim)
    return None if path is None else os.fspath(path)


def _serve(args: argparse.Namespace) -> int:
    start_watchdog(args.parent_pid, "l0-watchdog")
    stdin, out = open_pipes()
    stager = _Stager(args.stage_stall_s)
    try:
        return _serve_jobs(args, stdin, out, stager)
    finally:
        stager.close()


def _serve_jobs(args: argparse.Namespace, stdin: io.FileIO, out: int, stager: _Stager) -> int:
    jobs = 0
    while True:
        header = read_exact(stdin, _REQUEST.size)
        if header is None:
            return 0  # the pageserver closed the pipe: done
        magic, meta_len, body_len = _REQUEST.unpack(header)
        if magic != REQUEST_MAGIC or meta_len > _MAX_META:
            print(f"l0_worker: bad request header {bytes(header)!r}", file=sys.stderr)
            return 2
        raw_meta = read_exact(stdin, meta_len)
        body = read_exact(stdin, body_len) if body_len else bytearray()
        if raw_meta is None or body is None:
            return 1
        jobs += 1
        try:
            meta = json.loads(bytes(raw_meta))
            index = decode_index(meta["n_keys"], body)
            del body
            if args.stall_s:
                time.sleep(args.stall_s)
            path = trio.run(_write_job, meta, index, jobs <= args.eio_jobs, stager)
            answer = _answer({"path": path})
        except Exception as exc:  # every failure of a job is the caller's failed flush
            answer = _answer({
                "error": type(exc).__name__,
                "errno": exc.errno if isinstance(exc, OSError) else None,
                "message": str(exc),
            })
        view = memoryview(answer)
        while view:
            view = view[os.write(out, view) :]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pageserver.storage.l0_worker")
    parser.add_argument("--nice", type=int, default=0, help="niceness increment (below the WAL ingest)")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when no longer this process's child")
    parser.add_argument("--stall-s", type=float, default=0.0, help="test seam: sleep before each write")
    parser.add_argument("--stage-stall-s", type=float, default=0.0,
                        help="test seam: sleep before each staging (after the job's answer)")
    parser.add_argument("--eio-jobs", type=int, default=0, help="test seam: the first N jobs fail with EIO")
    parser.add_argument("--big-layer-path", action="store_true",
                        help="test seam: write every layer through the big-layer path, in small pieces")
    args = parser.parse_args(argv)
    if args.nice:
        os.nice(args.nice)
    if args.big_layer_path:
        from pageserver.storage import inmemory_layer

        inmemory_layer._READ_WHOLE_MAX = 0
        inmemory_layer._PACK_BYTES = 20_000
    try:
        return _serve(args)
    except (BrokenPipeError, EOFError, KeyboardInterrupt):
        return 1


if __name__ == "__main__":
    sys.exit(main())
