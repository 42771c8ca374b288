"""BufferedWriter: byte-exact files for every knob combination, reads during flushes, errors."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from pageserver.storage.buffered_writer import (
    BufferedWriter,
    FlushFailedError,
    open_buffered_writer,
)
from pageserver.storage.io_engine import (
    IO_ENGINE_KINDS,
    SYNC_MODES,
    BlockingIoEngine,
    IoFile,
    make_io_engine,
)

_T = TypeVar("_T")

# Tiny sizes force a flush every few bytes; 4096/8192 are the ones O_DIRECT accepts.
BUFFER_SIZES = [1, 3, 64, 4096, 8192]


def _payload(seed: int, n: int) -> bytes:
    return bytes((seed * 31 + i) & 0xFF for i in range(n))


@pytest.mark.parametrize("double_buffering", [False, True])
@pytest.mark.parametrize("sync_mode", SYNC_MODES)
@pytest.mark.parametrize("kind", IO_ENGINE_KINDS)
@settings(max_examples=15)
@given(
    # Tiny buffers with small writes (a flush every few bytes, ~1000 flushes at most), big
    # buffers with writes larger than a buffer (pass-through in several chunks).
    sized=st.sampled_from(BUFFER_SIZES).flatmap(
        lambda b: st.tuples(st.just(b), st.lists(st.integers(0, min(9000, 40 * b)), max_size=25))
    ),
    start_offset=st.sampled_from([0, 8192]),
    reads=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), max_size=8),
)
async def test_file_equals_plain_write_reference(
    kind: str,
    sync_mode: str,
    double_buffering: bool,
    sized: tuple[int, list[int]],
    start_offset: int,
    reads: list[tuple[float, float]],
) -> None:
    buffer_size, sizes = sized
    if sync_mode == "direct" and buffer_size % 4096:
        buffer_size = 4096  # O_DIRECT refuses other sizes (tested separately)
    if sync_mode == "dsync" and buffer_size < 64:
        buffer_size = 64  # one O_DSYNC write per byte would only make the test slow
    directory = Path(tempfile.mkdtemp(prefix="bw-"))
    try:
        engine = make_io_engine(kind)
        f = await engine.open_file(directory / "w", "w+", sync_mode=sync_mode)  # type: ignore[arg-type]
        summary = b"S" * start_offset  # written last, like a layer file's summary block
        reference = bytearray(summary)
        async with open_buffered_writer(
            f, buffer_size=buffer_size, double_buffering=double_buffering, start_offset=start_offset
        ) as writer:
            for i, n in enumerate(sizes):
                data = _payload(i, n)
                assert await writer.write(data) == len(reference)
                reference += data
                assert writer.length == len(reference)
                # Reads at any moment see everything written so far, wherever it is.
                ranges = []
                for a, b in reads[i % 3 :: 3]:
                    lo = start_offset + int(a * (len(reference) - start_offset))
                    size = int(b * (len(reference) - lo))
                    assert await writer.read_at(lo, size) == reference[lo : lo + size]
                    ranges.append((lo, size))
                assert await writer.read_many(ranges) == [reference[o : o + n] for o, n in ranges]
            assert writer.stats.max_in_flight <= 1
        assert writer.closed
        assert writer.length == len(reference)
        await f.write_at(0, summary)
        got = (directory / "w").read_bytes()
        assert got == reference
        # After close, reads come from the file.
        if len(reference) > start_offset:
            assert await writer.read_at(start_offset, len(reference) - start_offset) == reference[
                start_offset:
            ]
        await f.aclose()
        # The plain-write reference file is byte-identical.
        with open(directory / "ref", "wb") as plain:
            plain.write(summary)
            for i, n in enumerate(sizes):
                plain.write(_payload(i, n))
        assert (directory / "ref").read_bytes() == got
    finally:
        shutil.rmtree(directory)


# -- fakes -------------------------------------------------------------------------------


class GatedEngine(BlockingIoEngine):
    """Writes wait for ``gate`` to be set (a slow disk); counts concurrent writes."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = trio.Event()
        self.in_flight = 0
        self.peak_in_flight = 0
        self.started_writes = 0

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        if fn.__name__ == "_pwrite_all":
            self.in_flight += 1
            self.started_writes += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            try:
                await self.gate.wait()
                return fn(*args)
            finally:
                self.in_flight -= 1
        return fn(*args)


class FailingEngine(BlockingIoEngine):
    """The ``fail_on``-th pwrite (1-based) raises ENOSPC."""

    def __init__(self, fail_on: int) -> None:
        super().__init__()
        self.fail_on = fail_on
        self.writes = 0

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        if fn.__name__ == "_pwrite_all":
            self.writes += 1
            await trio.lowlevel.checkpoint()
            if self.writes == self.fail_on:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return fn(*args)


async def _open(engine: BlockingIoEngine, path: Path) -> IoFile:
    return await engine.open_file(path, "w+")


# -- reads while flushes are pending -----------------------------------------------------


async def test_reads_during_pending_background_flush(tmp_path: Path) -> None:
    engine = GatedEngine()
    f = await _open(engine, tmp_path / "g")
    reference = bytearray()
    async with trio.open_nursery() as nursery:
        writer = BufferedWriter(f, buffer_size=100, double_buffering=True, nursery=nursery)
        for i, n in enumerate([70, 70, 50]):
            chunk = _payload(i, n)
            await writer.write(chunk)
            reference += chunk
        # 190 bytes: buffer [0,100) is being written (blocked on the gate), [100,190) is in
        # the second buffer.
        await trio.testing.wait_all_tasks_blocked()
        assert engine.in_flight == 1
        assert writer.flush_in_flight
        # Everything is readable: in-flight buffer, current buffer, and across both.
        spans = [(0, 190), (0, 100), (95, 105), (150, 190), (99, 100), (0, 0)]
        for lo, hi in spans:
            assert await writer.read_at(lo, hi - lo) == reference[lo:hi]
        assert await writer.read_many([(lo, hi - lo) for lo, hi in spans]) == [
            reference[lo:hi] for lo, hi in spans
        ]
        assert (tmp_path / "g").read_bytes() == b""  # really nothing on disk yet

        # Filling the second buffer must wait: at most one flush in flight.
        progressed = trio.Event()

        async def write_more() -> None:
            await writer.write(_payload(9, 50))
            progressed.set()

        nursery.start_soon(write_more)
        await trio.testing.wait_all_tasks_blocked()
        assert not progressed.is_set()
        assert engine.in_flight == 1 and engine.started_writes == 1
        reference += _payload(9, 50)
        # The parked write has copied what fits so far; all of it is readable.
        assert writer.length == 200
        assert await writer.read_at(0, 200) == reference[:200]
        engine.gate.set()
        await progressed.wait()
        await writer.close()
    assert engine.peak_in_flight == 1
    assert writer.stats.max_in_flight == 1
    assert (tmp_path / "g").read_bytes() == reference
    await f.aclose()


async def test_reads_during_inline_flush_without_double_buffering(tmp_path: Path) -> None:
    engine = GatedEngine()
    f = await _open(engine, tmp_path / "s")
    writer = BufferedWriter(f, buffer_size=64, double_buffering=False)
    await writer.write(_payload(1, 40))
    reference = bytearray(_payload(1, 40))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.write, _payload(2, 40))  # fills the buffer: blocks in pwrite
        await trio.testing.wait_all_tasks_blocked()
        reference += _payload(2, 40)
        assert engine.in_flight == 1
        # The parked write has filled the buffer (64 bytes); all of that is readable.
        assert writer.length == 64
        assert await writer.read_at(0, 64) == reference[:64]
        assert await writer.read_at(30, 34) == reference[30:64]
        # A second writer while the first is parked is a bug, and says so.
        with pytest.raises(trio.BusyResourceError):
            await writer.write(b"x" * 100)
        engine.gate.set()
    assert await writer.read_at(0, 80) == reference
    assert await writer.close() == 80
    assert (tmp_path / "s").read_bytes() == reference
    await f.aclose()


# -- errors ----------------------------------------------------------------------------


async def test_background_flush_error_surfaces_on_next_write(tmp_path: Path) -> None:
    engine = FailingEngine(fail_on=2)
    f = await _open(engine, tmp_path / "e")
    async with trio.open_nursery() as nursery:
        writer = BufferedWriter(f, buffer_size=10, double_buffering=True, nursery=nursery)
        await writer.write(b"a" * 10)  # flush 1 in the background: fine
        await writer.write(b"b" * 10)  # waits for flush 1, hands over flush 2 (will fail)
        await trio.testing.wait_all_tasks_blocked()
        assert engine.writes == 2
        # The owner's nursery is not crashed; the writer raises, with the real cause.
        with pytest.raises(FlushFailedError, match="No space left") as info:
            await writer.write(b"c")
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == errno.ENOSPC
        # ... and keeps raising: the file has a hole.
        with pytest.raises(FlushFailedError):
            await writer.flush()
        with pytest.raises(FlushFailedError):
            await writer.close()
        with pytest.raises(FlushFailedError):
            await writer.read_at(0, 1)
    await f.aclose()


@pytest.mark.parametrize("double_buffering", [False, True])
async def test_error_in_final_flush_surfaces_on_close(tmp_path: Path, double_buffering: bool) -> None:
    engine = FailingEngine(fail_on=1)
    f = await _open(engine, tmp_path / "c")
    with pytest.raises(FlushFailedError, match="injected"):
        async with open_buffered_writer(
            f, buffer_size=1000, double_buffering=double_buffering
        ) as writer:
            await writer.write(b"tail only")
    await f.aclose()


async def test_inline_flush_error_raises_from_write_and_poisons(tmp_path: Path) -> None:
    engine = FailingEngine(fail_on=1)
    f = await _open(engine, tmp_path / "i")
    writer = BufferedWriter(f, buffer_size=4, double_buffering=False)
    with pytest.raises(FlushFailedError, match="injected"):
        await writer.write(b"12345")
    with pytest.raises(FlushFailedError):
        await writer.write(b"6")
    await f.aclose()


async def test_cancelled_background_flush_is_recorded(tmp_path: Path) -> None:
    engine = GatedEngine()
    f = await _open(engine, tmp_path / "x")
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            writer = BufferedWriter(f, buffer_size=8, double_buffering=True, nursery=nursery)
            await writer.write(b"12345678")  # handed over, blocked on the gate
            # Cancel once the flush is parked on the gate, not after a wall-clock interval
            # that a loaded machine might exceed before the handover.
            await trio.testing.wait_all_tasks_blocked()
            assert engine.started_writes == 1
            scope.cancel()
            await trio.sleep_forever()
    with pytest.raises(FlushFailedError, match="cancelled"):
        await writer.write(b"more")
    await f.aclose()


# -- knobs and misc ---------------------------------------------------------------------


async def test_double_buffering_needs_a_nursery(tmp_path: Path) -> None:
    f = await _open(BlockingIoEngine(), tmp_path / "n")
    with pytest.raises(ValueError, match="needs a nursery"):
        BufferedWriter(f, double_buffering=True)
    with pytest.raises(ValueError, match="must be positive"):
        BufferedWriter(f, buffer_size=0, double_buffering=False)
    await f.aclose()


async def test_direct_io_knob_checks_and_truncates(tmp_path: Path) -> None:
    engine = make_io_engine("blocking")
    f = await engine.open_file(tmp_path / "d", "w+", sync_mode="direct")
    with pytest.raises(ValueError, match="multiples of 4096"):
        BufferedWriter(f, buffer_size=1000, double_buffering=False)
    with pytest.raises(ValueError, match="multiples of 4096"):
        BufferedWriter(f, buffer_size=4096, double_buffering=False, start_offset=100)
    writer = BufferedWriter(f, buffer_size=4096, double_buffering=False)
    await writer.write(b"x" * 5000)
    await writer.flush()
    # Mid-stream the tail is zero-padded on disk ...
    assert os.path.getsize(tmp_path / "d") == 8192
    await writer.write(b"y" * 10)
    assert await writer.pad_to_alignment(512) == 5120
    await writer.close()
    # ... and the file ends at its true length once closed.
    assert (tmp_path / "d").read_bytes() == b"x" * 5000 + b"y" * 10 + bytes(110)
    await f.aclose()


async def test_closed_writer_refuses_writes(tmp_path: Path) -> None:
    f = await _open(BlockingIoEngine(), tmp_path / "cl")
    writer = BufferedWriter(f, buffer_size=16, double_buffering=False)
    await writer.write(b"abc")
    assert await writer.close() == 3
    assert await writer.close() == 3
    with pytest.raises(trio.ClosedResourceError):
        await writer.write(b"d")
    with pytest.raises(ValueError, match="outside"):
        await writer.read_at(2, 2)
    await f.aclose()


async def test_stats_count_flushes(tmp_path: Path) -> None:
    engine = make_io_engine("threadpool")
    f = await engine.open_file(tmp_path / "st", "w+")
    async with open_buffered_writer(f, buffer_size=1024, double_buffering=True) as writer:
        for _ in range(100):
            await writer.write(b"z" * 100)
    # 10000 bytes: 9 full buffers in the background, then the tail on close.
    assert writer.stats.background_flushes == 9
    assert writer.stats.flushes == 10
    assert engine.stats.pwrites == 10
    assert writer.stats.max_in_flight == 1
    await f.aclose()


async def test_closed_nursery_fails_the_writer_cleanly(tmp_path: Path) -> None:
    f = await _open(BlockingIoEngine(), tmp_path / "cn")
    async with trio.open_nursery() as nursery:
        writer = BufferedWriter(f, buffer_size=8, double_buffering=True, nursery=nursery)
    # The owner's nursery is gone: the handover cannot start a flush, says so, and leaves the
    # writer failed but not stuck (abort returns, nothing is in flight).
    with pytest.raises(RuntimeError, match="closed"):
        await writer.write(b"12345678")
    assert not writer.flush_in_flight
    with pytest.raises(FlushFailedError):
        await writer.write(b"x")
    await writer.abort()
    await f.aclose()


async def test_read_many_reads_the_file_part_in_one_engine_call(tmp_path: Path) -> None:
    engine = make_io_engine("threadpool")
    f = await engine.open_file(tmp_path / "rm", "w+")
    async with trio.open_nursery() as nursery:
        writer = BufferedWriter(f, buffer_size=100, double_buffering=True, nursery=nursery)
        reference = bytearray()
        for i in range(12):
            chunk = _payload(i, 45)
            await writer.write(chunk)
            reference += chunk
        await writer.flush()
        engine.stats.reset()
        # Spans in the file, across file and buffer, and in the buffer only.
        spans = [(0, 10), (120, 200), (400, 140), (530, 10), (7, 1)]
        assert await writer.read_many(spans) == [reference[o : o + n] for o, n in spans]
        assert engine.stats.run_syncs == 1
        assert engine.stats.preads == 4
        await writer.close()
    await f.aclose()
