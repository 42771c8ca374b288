"""The staged O_DIRECT write kernel (safekeeper/_direct_write_c.pyx) against its pure-Python
twin (safekeeper/_direct_write_py.py, the reference), on real files opened with O_DIRECT;
and the record tracker's ``feed_many`` against ``feed`` chunk by chunk.

Both write kernels must leave the same bytes in the file and return the same count of kept
tail bytes for any chunking, head and stage size; both refuse the same bad arguments with
ValueError and report the same errno for a failing pwrite or fdatasync.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.lsn import WAL_SEGMENT_SIZE, Lsn
from protocol.wal.errors import InvalidWal
from safekeeper.testing import synthetic_wal
from tests.conftest import kernel

WRITE = "safekeeper._direct_write_c"
WAL = "protocol._wal_c"
ALIGN = 4096


def _direct_file(path: Path, size: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, size)
    return fd


def _read(path: Path) -> bytes:
    return path.read_bytes()


def _model(file: bytearray, head_bytes: bytes, chunks: list[bytes], start: int, stage: int) -> int:
    """What the contract says the file holds afterwards; returns the kept count."""
    data = head_bytes + b"".join(chunks)
    pos = start
    kept = 0
    while data:
        step, data = data[:stage], data[stage:]
        padded = step + bytes(-len(step) % ALIGN)
        file[pos : pos + len(padded)] = padded
        kept = len(step) % ALIGN
        pos += len(step)
    return kept


@pytest.fixture
def mod(impl: str) -> ModuleType:
    return kernel(impl, WRITE)


@pytest.fixture
def stage() -> mmap.mmap:
    # Not closed by the test: a raised error's traceback may still hold a view of it.
    return mmap.mmap(-1, 4 * ALIGN)


def test_both_twins_name_the_same_alignment(mod: ModuleType) -> None:
    assert mod.ALIGN == ALIGN


def test_a_write_over_several_stages_leaves_the_bytes_and_keeps_the_tail(
    mod: ModuleType, stage: mmap.mmap, tmp_path: Path
) -> None:
    path = tmp_path / "seg"
    fd = _direct_file(path, 64 * ALIGN)
    try:
        chunks = [os.urandom(n) for n in (100, 5000, 0, 9000, 3)]
        stage[:10] = b"H" * 10  # the file's bytes before the write, in its block
        kept = mod.write_staged(fd, stage, 10, chunks, 2 * ALIGN, True)
    finally:
        os.close(fd)
    want = bytearray(64 * ALIGN)
    assert kept == _model(want, b"H" * 10, chunks, 2 * ALIGN, len(stage))
    assert kept == (10 + 14103) % ALIGN
    assert _read(path) == bytes(want)
    # The tail is at the stage's start: the next write's head.
    tail = (b"H" * 10 + b"".join(chunks))[-kept:]
    assert stage[:kept] == tail


@pytest.mark.native
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(0, 3 * ALIGN + 7), max_size=8),
    head=st.integers(0, ALIGN - 1),
    block=st.integers(0, 8),
    blocks=st.sampled_from([2, 3, 5]),
    sync=st.booleans(),
)
def test_native_and_twin_leave_the_same_file(
    tmp_path: Path, sizes: list[int], head: int, block: int, blocks: int, sync: bool
) -> None:
    chunks = [bytes((i * 7 + j) % 251 for j in range(n)) for i, n in enumerate(sizes)]
    results = []
    for impl in ("native", "python"):
        mod = kernel(impl, WRITE)
        path = tmp_path / f"seg-{impl}"
        fd = _direct_file(path, 32 * ALIGN)
        stage = mmap.mmap(-1, blocks * ALIGN)
        try:
            stage[:head] = b"\xee" * head
            kept = mod.write_staged(fd, stage, head, chunks, block * ALIGN, sync)
            results.append((kept, _read(path), bytes(stage[:kept])))
        finally:
            os.close(fd)
            stage.close()
    assert results[0] == results[1]
    want = bytearray(32 * ALIGN)
    assert results[0][0] == _model(want, b"\xee" * head, chunks, block * ALIGN, blocks * ALIGN)
    assert results[0][1] == bytes(want)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({"head": ALIGN}, "head"),
        ({"head": -1}, "head"),
        ({"start": 100}, "offset"),
        ({"start": -ALIGN}, "offset"),
        ({"stage": bytearray(ALIGN)}, "length"),
        ({"stage": "odd"}, "length"),
        ({"stage": "unaligned"}, "aligned"),
        ({"stage": b"\0" * (2 * ALIGN)}, "read-only"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(
    mod: ModuleType, tmp_path: Path, args: dict[str, object], words: str
) -> None:
    path = tmp_path / "seg"
    fd = _direct_file(path, 8 * ALIGN)
    big = mmap.mmap(-1, 4 * ALIGN)
    try:
        call: dict[str, object] = {"stage": big, "head": 0, "start": 0}
        call.update(args)
        if call["stage"] == "odd":
            call["stage"] = memoryview(big)[: 3 * ALIGN - 512]
        elif call["stage"] == "unaligned":
            call["stage"] = memoryview(big)[512 : 512 + 2 * ALIGN]
        with pytest.raises(ValueError, match=words):
            mod.write_staged(fd, call["stage"], call["head"], [b"x" * 10], call["start"], False)
    finally:
        os.close(fd)
    assert _read(path) == bytes(8 * ALIGN)


def test_a_failing_write_reports_its_errno(mod: ModuleType, stage: mmap.mmap) -> None:
    read, write = os.pipe()
    try:
        with pytest.raises(OSError) as info:
            mod.write_staged(write, stage, 0, [b"x" * 10], 0, False)  # pwrite on a pipe
        assert info.value.errno == errno.ESPIPE
        os.close(write)
        with pytest.raises(OSError) as closed:
            mod.write_staged(write, stage, 0, [b"x" * 10], 0, False)
        assert closed.value.errno == errno.EBADF
    finally:
        os.close(read)


def test_a_failing_sync_reports_its_errno(mod: ModuleType, stage: mmap.mmap) -> None:
    read, write = os.pipe()
    try:
        # Nothing to write (no head, no bytes): only the fdatasync runs, which a pipe refuses.
        with pytest.raises(OSError) as info:
            mod.write_staged(write, stage, 0, [], 0, True)
        assert info.value.errno == errno.EINVAL
    finally:
        os.close(read)
        os.close(write)


# -- feed_many: the tracker's many-chunk call ---------------------------------------------------


START = Lsn(WAL_SEGMENT_SIZE)


def _by_feed(mod: ModuleType, chunks: list[bytes]) -> tuple[int, int, str | None]:
    tracker = mod.RecordTracker(START)
    fed = 0
    for chunk in chunks:
        good_end = tracker.record_end
        try:
            tracker.feed(chunk)
        except InvalidWal as exc:
            return fed, good_end, str(exc)
        fed += 1
    return fed, tracker.record_end, None


def _by_feed_many(mod: ModuleType, chunks: list[bytes]) -> tuple[int, int, str | None]:
    tracker = mod.RecordTracker(START)
    fed, good_end, error = tracker.feed_many(chunks)
    return fed, good_end, None if error is None else str(error)


WAL_BYTES = synthetic_wal(START, 200_000, system_id=3)


@pytest.mark.native
@settings(max_examples=80, deadline=None)
@given(
    cuts=st.lists(st.integers(0, len(WAL_BYTES)), max_size=12),
    flips=st.lists(st.integers(0, len(WAL_BYTES) - 1), max_size=2),
)
def test_feed_many_answers_what_feed_chunk_by_chunk_does(cuts: list[int], flips: list[int]) -> None:
    data = bytearray(WAL_BYTES)
    for at in flips:
        data[at] ^= 0x5A
    bounds = [0, *sorted(cuts), len(data)]
    chunks = [bytes(data[a:b]) for a, b in itertools.pairwise(bounds)]
    answers = set()
    for impl in ("native", "python"):
        mod = kernel(impl, WAL)
        one, many = _by_feed(mod, chunks), _by_feed_many(mod, chunks)
        assert one == many
        answers.add(many)
    assert len(answers) == 1
    if not flips:
        assert answers.pop() == (len(chunks), _by_feed(kernel("python", WAL), [bytes(data)])[1], None)


def test_feed_many_of_nothing_changes_nothing(impl: str) -> None:
    tracker = kernel(impl, WAL).RecordTracker(START)
    assert tracker.feed_many([]) == (0, START, None)
    assert tracker.pos == START
