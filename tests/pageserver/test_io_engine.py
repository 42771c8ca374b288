"""IoEngine and IoFile: every syscall wrapper, both engines, the sync modes, durability helpers."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from pathlib import Path

import pytest
import trio

from pageserver.storage.io_engine import (
    DIRECT_IO_ALIGN,
    IO_ENGINE_KINDS,
    SYNC_MODES,
    DirectIoNotSupportedError,
    IoEngine,
    ShortReadError,
    ThreadpoolIoEngine,
    alloc_aligned,
    durable_rename,
    fsync_file_and_dir,
    is_aligned_buffer,
    make_io_engine,
)

engines = pytest.mark.parametrize("kind", IO_ENGINE_KINDS)


@engines
async def test_pwrite_pread_roundtrip_and_stats(kind: str, tmp_path: Path) -> None:
    engine = make_io_engine(kind)
    assert engine.kind == kind
    f = await engine.open_file(tmp_path / "f", "w+")
    await engine.pwrite(f.fd, b"hello world", 0)
    await engine.pwrite(f.fd, memoryview(b"XY"), 6)
    assert await engine.pread(f.fd, 11, 0) == b"hello XYrld"
    # Short only at end of file; pread_exact refuses it.
    assert await engine.pread(f.fd, 100, 6) == b"XYrld"
    with pytest.raises(ShortReadError, match="wanted 100 bytes at offset 6"):
        await engine.pread_exact(f.fd, 100, 6)
    await engine.fsync(f.fd)
    await engine.fdatasync(f.fd)
    await f.aclose()
    s = engine.stats
    assert (s.opens, s.pwrites, s.preads, s.fsyncs, s.fdatasyncs) == (1, 2, 3, 1, 1)
    assert s.bytes_written == 13
    assert s.bytes_read == 11 + 5 + 5
    assert (tmp_path / "f").read_bytes() == b"hello XYrld"
    engine.stats.reset()
    assert engine.stats.snapshot() == dict.fromkeys(engine.stats.snapshot(), 0)


@engines
async def test_pwritev_preadv(kind: str, tmp_path: Path) -> None:
    engine = make_io_engine(kind)
    f = await engine.open_file(tmp_path / "v", "w+")
    await engine.pwritev(f.fd, [b"abc", bytearray(b"defg"), memoryview(b"hi")], 10)
    assert (tmp_path / "v").read_bytes() == bytes(10) + b"abcdefghi"
    bufs = [bytearray(4), bytearray(3), bytearray(10)]
    n = await engine.preadv(f.fd, bufs, 8)
    # 11 bytes exist from offset 8: the last buffer is filled only partly (EOF).
    assert n == 11
    assert bytes(bufs[0]) == b"\0\0ab"
    assert bytes(bufs[1]) == b"cde"
    assert bytes(bufs[2][:4]) == b"fghi"
    assert engine.stats.preadvs == 1 and engine.stats.pwritevs == 1
    await f.aclose()


async def test_short_writes_and_reads_are_completed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pwrite/pwritev loop on short writes (the kernel may return less), preadv on short reads."""
    real_pwrite, real_pwritev, real_preadv = os.pwrite, os.pwritev, os.preadv

    def dribble_pwrite(fd: int, data: memoryview, offset: int) -> int:
        return real_pwrite(fd, data[:3], offset)

    def dribble_pwritev(fd: int, bufs: list[memoryview], offset: int) -> int:
        return real_pwrite(fd, bufs[0][:2], offset)

    def dribble_preadv(fd: int, bufs: list[memoryview], offset: int) -> int:
        return real_preadv(fd, [bufs[0][:1]], offset)

    monkeypatch.setattr(os, "pwrite", dribble_pwrite)
    monkeypatch.setattr(os, "pwritev", dribble_pwritev)
    monkeypatch.setattr(os, "preadv", dribble_preadv)
    engine = make_io_engine("blocking")
    f = await engine.open_file(tmp_path / "s", "w+")
    await engine.pwrite(f.fd, b"0123456789", 0)
    await engine.pwritev(f.fd, [b"abcde", b"", b"fgh"], 10)
    assert (tmp_path / "s").read_bytes() == b"0123456789abcdefgh"
    bufs = [bytearray(5), bytearray(0), bytearray(7)]
    assert await engine.preadv(f.fd, bufs, 3) == 12
    assert bytes(bufs[0]) + bytes(bufs[2]) == b"3456789abcde"
    monkeypatch.setattr(os, "pwritev", real_pwritev)
    await f.aclose()


async def test_pwrite_without_progress_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: 0)
    engine = make_io_engine("blocking")
    f = await engine.open_file(tmp_path / "z", "w")
    with pytest.raises(OSError, match="no progress"):
        await engine.pwrite(f.fd, b"abc", 0)
    await f.aclose()


async def test_open_modes_and_bad_knobs(tmp_path: Path) -> None:
    engine = make_io_engine("blocking")
    f = await engine.open_file(tmp_path / "x", "x")
    await f.write_at(0, b"one")
    await f.aclose()
    with pytest.raises(FileExistsError):
        await engine.open_file(tmp_path / "x", "x+")
    r = await engine.open_file(tmp_path / "x", "r")
    assert await r.read_exact_at(0, 3) == b"one"
    with pytest.raises(OSError, match="Bad file descriptor"):
        await r.write_at(0, b"no")
    with pytest.raises(ShortReadError, match=r"short read in .*x: wanted 4"):
        await r.read_exact_at(0, 4)
    assert await r.size() == 3
    await r.aclose()
    await r.aclose()  # idempotent
    w = await engine.open_file(tmp_path / "x", "w")
    assert await w.size() == 0  # truncated
    await w.aclose()
    with pytest.raises(ValueError, match="unknown open mode"):
        await engine.open_file(tmp_path / "x", "rw")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown sync mode"):
        await engine.open_file(tmp_path / "x", "r", sync_mode="fsync")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown io_engine 'io_uring'"):
        make_io_engine("io_uring")
    with pytest.raises(ValueError, match="at least 1 thread"):
        make_io_engine("threadpool", max_threads=0)


@engines
@pytest.mark.parametrize("sync_mode", SYNC_MODES)
async def test_sync_modes_on_the_real_tmp_dir(kind: str, sync_mode: str, tmp_path: Path) -> None:
    """Each sync mode either works on this filesystem (the data round-trips, including
    unaligned reads under O_DIRECT) or fails with the one clear error."""
    engine = make_io_engine(kind)
    try:
        f = await engine.open_file(tmp_path / "m", "w+", sync_mode=sync_mode)  # type: ignore[arg-type]
    except DirectIoNotSupportedError as exc:
        assert sync_mode == "direct"
        assert str(tmp_path / "m") in str(exc)
        return
    assert f.sync_mode == sync_mode
    payload = bytes(range(256)) * (2 * DIRECT_IO_ALIGN // 256)
    await f.write_at(DIRECT_IO_ALIGN, payload)  # aligned, and an unaligned source address
    await f.write_at(0, payload[:DIRECT_IO_ALIGN])
    assert await f.read_exact_at(DIRECT_IO_ALIGN + 5, 5000) == payload[5:5005]
    assert await f.read_at(3 * DIRECT_IO_ALIGN - 10, 100) == payload[-10:]  # short at EOF
    assert await f.read_at(0, 0) == b""
    flags = fcntl.fcntl(f.fd, fcntl.F_GETFL)
    assert bool(flags & os.O_DIRECT) == (sync_mode == "direct")
    assert bool(flags & os.O_DSYNC) == (sync_mode == "dsync")
    if sync_mode == "direct":
        with pytest.raises(ValueError, match="must start 4096-aligned"):
            await f.write_at(1, b"x" * DIRECT_IO_ALIGN)
        # An unaligned length inside the file would need a read-modify-write: refused.
        with pytest.raises(ValueError, match="nor at the end of the file"):
            await f.write_at(0, b"x" * 100)
    await f.aclose()
    assert (tmp_path / "m").read_bytes() == payload[:DIRECT_IO_ALIGN] + payload
    # An unaligned length that ends the file works in every mode (index_part.json, say).
    g = await engine.open_file(tmp_path / "small", "x", sync_mode=sync_mode)
    await g.write_at(0, b'{"json": 1}')
    await g.aclose()
    assert (tmp_path / "small").read_bytes() == b'{"json": 1}'


@pytest.mark.parametrize("sync_mode", SYNC_MODES)
async def test_engine_write_sync_mode_is_the_default_for_writable_opens(
    sync_mode: str, tmp_path: Path
) -> None:
    engine = make_io_engine("blocking", write_sync_mode=sync_mode)  # type: ignore[arg-type]
    w = await engine.open_file(tmp_path / "w", "w+")
    assert w.sync_mode == sync_mode
    await w.write_at(0, b"abc")
    r = await engine.open_file(tmp_path / "w", "r")
    assert r.sync_mode == "none"  # reads of finished files stay plain
    explicit = await engine.open_file(tmp_path / "w", "r+", sync_mode="none")
    assert explicit.sync_mode == "none"
    for f in (w, r, explicit):
        await f.aclose()
    with pytest.raises(ValueError, match="unknown sync mode"):
        make_io_engine("threadpool", write_sync_mode="osync")  # type: ignore[arg-type]


async def test_direct_io_refused_gives_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a filesystem without O_DIRECT does (EINVAL from open) becomes our error type."""
    real_open = os.open

    def no_direct(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", no_direct)
    engine = make_io_engine("blocking")
    with pytest.raises(DirectIoNotSupportedError, match=r"refuses O_DIRECT.*/nodirect"):
        await engine.open_file(tmp_path / "nodirect", "w", sync_mode="direct")
    # Other modes are unaffected, and EINVAL without O_DIRECT stays a plain OSError.
    f = await engine.open_file(tmp_path / "fine", "w", sync_mode="dsync")
    await f.aclose()


def test_aligned_buffers() -> None:
    buf = alloc_aligned(2 * DIRECT_IO_ALIGN)
    assert is_aligned_buffer(buf)
    assert not is_aligned_buffer(memoryview(buf)[1 : DIRECT_IO_ALIGN + 1])
    assert not is_aligned_buffer(memoryview(buf)[: DIRECT_IO_ALIGN - 1])
    assert not is_aligned_buffer(b"x" * DIRECT_IO_ALIGN)  # read-only: address unknown
    with pytest.raises(ValueError, match="must be positive"):
        alloc_aligned(0)


async def test_threadpool_runs_off_the_trio_thread_within_its_limit() -> None:
    engine = ThreadpoolIoEngine(max_threads=2)
    trio_thread = threading.get_ident()
    lock = threading.Lock()
    running = 0
    peak = 0
    seen: set[int] = set()

    def work() -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
            seen.add(threading.get_ident())
        # Stay until a second worker has overlapped (a loaded machine may start it late), so
        # the peak measures the limit, not the scheduler; bounded in case the limit is 1.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with lock:
                if peak >= 2:
                    break
            time.sleep(0.001)
        time.sleep(0.02)
        with lock:
            running -= 1

    async with trio.open_nursery() as nursery:
        for _ in range(6):
            nursery.start_soon(engine.run_sync, work)
    assert peak == 2
    assert trio_thread not in seen
    assert engine.stats.run_syncs == 6


async def test_blocking_engine_runs_inline() -> None:
    engine = make_io_engine("blocking")
    assert await engine.run_sync(threading.get_ident) == threading.get_ident()


@engines
async def test_durable_rename_and_fsync_helpers(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine: IoEngine = make_io_engine(kind)
    synced: list[str] = []
    real_fsync = os.fsync

    def spy_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    f = await engine.open_file(tmp_path / "layer.tmp", "x")
    await f.write_at(0, b"layer bytes")
    await f.aclose()
    await durable_rename(engine, tmp_path / "layer.tmp", tmp_path / "layer")
    assert not (tmp_path / "layer.tmp").exists()
    assert (tmp_path / "layer").read_bytes() == b"layer bytes"
    # The file is fsynced under its temp name before the rename, the directory after it.
    assert synced == [str(tmp_path / "layer.tmp"), str(tmp_path)]
    synced.clear()
    await fsync_file_and_dir(engine, tmp_path / "layer")
    assert synced == [str(tmp_path / "layer"), str(tmp_path)]
    assert engine.stats.fsyncs == 4


@engines
@pytest.mark.parametrize("sync_mode", ["none", "direct"])
async def test_read_many_exact_at(kind: str, sync_mode: str, tmp_path: Path) -> None:
    engine = make_io_engine(kind)
    payload = bytes(range(256)) * 64
    (tmp_path / "rm").write_bytes(payload)
    f = await engine.open_file(tmp_path / "rm", "r+", sync_mode=sync_mode)  # type: ignore[arg-type]
    ranges = [(0, 1), (4095, 2), (10, 5000), (len(payload) - 3, 3), (100, 0)]
    assert await f.read_many_exact_at(ranges) == [payload[o : o + n] for o, n in ranges]
    assert await f.read_many_exact_at([]) == []
    assert engine.stats.run_syncs == 1 and engine.stats.preads == len(ranges)
    with pytest.raises(ShortReadError, match="wanted 10 bytes at offset 16380"):
        await f.read_many_exact_at([(0, 4), (len(payload) - 4, 10)])
    await f.aclose()
