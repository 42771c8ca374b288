"""WAL storage: segment files, boundaries, truncation, restart scan, over real PostgreSQL WAL."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compute.postgres import pg_binary
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn, format_lsn, segment_file_name
from protocol.wal.reader import WalStreamDecoder
from safekeeper.record_tracker import InvalidWal, RecordTracker
from safekeeper.wal_storage import WalStorage, WalStorageError, split_at_segments
from tests.safekeeper.conftest import RealWal

SEG = WAL_SEGMENT_SIZE


@pytest.fixture(params=[False, True], ids=["buffered", "direct"])
def direct(request: pytest.FixtureRequest) -> bool:
    """The storage's write mode: page-cache writes, or O_DIRECT through the aligned stage."""
    return bool(request.param)


def _chunks(data: bytes, seed: int, max_len: int = 200_000) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    i = 0
    while i < len(data):
        n = rng.randint(1, max_len)
        out.append(data[i : i + n])
        i += n
    return out


def _write_all(storage: WalStorage, start: Lsn, data: bytes, seed: int = 1) -> None:
    pos = start
    chunks = _chunks(data, seed)
    # Groups of several chunks, like the ingest loop's coalesced writes.
    for g in range(0, len(chunks), 7):
        group = chunks[g : g + 7]
        storage.write(pos, group)
        pos = Lsn(pos + sum(len(c) for c in group))
        storage.flush()


def test_tracker_finds_every_record_end(real_wal: RealWal) -> None:
    tracker = RecordTracker(real_wal.start)
    ends = set()
    for chunk in _chunks(real_wal.data, 7, 3000):
        ends.add(tracker.feed(chunk))
    assert tracker.record_end == real_wal.end
    # Every reported end is the start of the next record, or the page boundary before it
    # (or a segment end after a switch).
    starts = set(real_wal.record_starts)
    assert all(
        e in starts or e + 24 in starts or e % SEG == 0 or e == real_wal.end for e in ends
    )
    assert len(ends) > 1000


def test_tracker_rejects_corrupt_record(real_wal: RealWal) -> None:
    data = bytearray(real_wal.data[:200_000])
    victim = real_wal.record_starts[100] - real_wal.start
    data[victim + 30] ^= 0xFF
    tracker = RecordTracker(real_wal.start)
    with pytest.raises(InvalidWal):
        tracker.feed(data)
    assert tracker.record_end <= real_wal.record_starts[101]


def test_write_segments_and_restart_scan(direct: bool, real_wal: RealWal, tmp_path: Path) -> None:
    storage = WalStorage(tmp_path, direct_io=direct)
    storage.truncate(real_wal.start)
    _write_all(storage, real_wal.start, real_wal.data)
    assert storage.flush_record_lsn == real_wal.end
    storage.close()
    assert (tmp_path / segment_file_name(1)).exists()
    assert (tmp_path / segment_file_name(2)).exists()
    assert (tmp_path / (segment_file_name(3) + ".partial")).exists()
    on_disk = b"".join((tmp_path / n).read_bytes() for n in sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("0000")))
    assert on_disk[: len(real_wal.data)] == real_wal.data
    assert len((tmp_path / (segment_file_name(3) + ".partial")).read_bytes()) == SEG

    reopened = WalStorage(tmp_path, direct_io=direct)
    assert reopened.open(real_wal.record_starts[5]) == real_wal.end
    # Writing continues where the scan ended.
    with pytest.raises(WalStorageError):
        reopened.write(Lsn(real_wal.end + 8), [b"x"])


def test_write_rejects_invalid_wal_after_valid_part(direct: bool, real_wal: RealWal, tmp_path: Path) -> None:
    storage = WalStorage(tmp_path, direct_io=direct)
    storage.truncate(real_wal.start)
    good = real_wal.data[:100_000]
    with pytest.raises(InvalidWal):
        storage.write(real_wal.start, [good, b"\x00" * 8192])
    # The valid prefix was kept up to its last complete record; the partial record after it
    # was cut so that the next write continues on a record boundary.
    last = max(s for s in real_wal.record_starts if s <= real_wal.start + len(good))
    assert storage.write_lsn == storage.flush_record_lsn
    assert storage.write_lsn in (last, last - last % 8192)
    assert WalStorage(tmp_path, direct_io=direct).open(real_wal.start) == storage.write_lsn


def test_truncate_removes_later_segments_and_zeroes_tail(direct: bool, real_wal: RealWal, tmp_path: Path) -> None:
    storage = WalStorage(tmp_path, direct_io=direct)
    storage.truncate(real_wal.start)
    _write_all(storage, real_wal.start, real_wal.data, seed=3)
    cut = next(s for s in real_wal.record_starts if s > real_wal.start + SEG // 2 and s % 8192)
    storage.truncate(cut)
    storage.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("0000")) == [
        segment_file_name(1) + ".partial"
    ]
    seg = (tmp_path / (segment_file_name(1) + ".partial")).read_bytes()
    assert len(seg) == SEG
    assert seg[: cut - SEG] == real_wal.data[: cut - SEG]
    assert seg[cut - SEG :] == bytes(2 * SEG - cut)
    assert WalStorage(tmp_path, direct_io=direct).open(real_wal.start) == cut

    # The rest can be written again from the cut.
    storage = WalStorage(tmp_path, direct_io=direct)
    storage.open(real_wal.start)
    _write_all(storage, cut, real_wal.data[cut - real_wal.start :], seed=4)
    assert storage.flush_record_lsn == real_wal.end


def test_first_segment_mid_segment_is_readable_by_pg_waldump(
    direct: bool, real_wal: RealWal, pg_tmp_path: Path
) -> None:
    start = next(s for s in real_wal.record_starts if s > real_wal.start + 3 * 8192 + 100 and s % 8192 > 24)
    storage = WalStorage(pg_tmp_path, direct_io=direct)
    storage.init_first_segment(start, real_wal.system_id)
    storage.truncate(start)
    end = real_wal.record_starts[real_wal.record_starts.index(start) + 2000]
    _write_all(storage, start, real_wal.data[start - real_wal.start : end - real_wal.start])
    assert storage.flush_record_lsn == end
    storage.close()
    # pg_waldump does not read ``.partial`` files: give it the open segment under its name.
    view = pg_tmp_path / "view"
    view.mkdir()
    name = segment_file_name(1)
    shutil.copy(pg_tmp_path / (name + ".partial"), view / name)
    proc = subprocess.run(
        [pg_binary("pg_waldump"), "-p", str(view), "-s", format_lsn(start)],
        capture_output=True,
        check=False,
    )
    out = proc.stdout.decode()
    assert f"lsn: {start >> 32:X}/{start & 0xFFFFFFFF:08X}," in out
    assert out.count("rmgr:") == 2000
    assert f"invalid record length at {format_lsn(end)}" in proc.stderr.decode()
    # Without -s pg_waldump starts at the segment's first page and still finds ``start``.
    whole = subprocess.run(
        [pg_binary("pg_waldump"), str(view / name)], capture_output=True, check=False
    )
    assert whole.stdout.decode() == out


def test_tracker_agrees_with_the_wal_decoder(real_wal: RealWal) -> None:
    """The oracle: protocol.wal's full record decoder finds the same record ends."""
    decoder = WalStreamDecoder(real_wal.start)
    decoder.feed(real_wal.data)
    decoded_ends = [rec.end_lsn for rec in decoder.records()]
    tracker = RecordTracker(real_wal.start)
    tracker_ends = []
    for chunk in _chunks(real_wal.data, 11, 5000):
        before = tracker.record_end
        if tracker.feed(chunk) != before:
            tracker_ends.append(tracker.record_end)
    assert decoder.finish().lsn == tracker.record_end == real_wal.end
    # The tracker reports the latest end per chunk: each must be one of the decoder's.
    assert set(tracker_ends) <= set(decoded_ends)


@settings(max_examples=200, deadline=None)
@given(
    pos=st.integers(0, 10_000),
    sizes=st.lists(st.integers(0, 300), max_size=12),
    seg_size=st.sampled_from([64, 100, 512]),
)
def test_split_at_segments_cuts_views_at_segment_ends(
    pos: int, sizes: list[int], seg_size: int
) -> None:
    data = bytes(i % 251 for i in range(sum(sizes)))
    views, at = [], 0
    for n in sizes:
        views.append(memoryview(data)[at : at + n])
        at += n
    out = list(split_at_segments(pos, views, seg_size))
    assert b"".join(b"".join(iov) for _, _, iov, _ in out) == data
    for segno, offset, iov, size in out:
        assert segno * seg_size + offset == pos
        assert size == sum(len(v) for v in iov) > 0
        assert offset + size <= seg_size
        pos += size


def test_read_finds_a_segment_renamed_while_it_looks(
    direct: bool, real_wal: RealWal, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer renames a completed segment from ``.partial`` to its full name in another
    thread while a walsender reads it: the read must find it under either name (it answered
    "WAL segment ... is not here" to pg_receivewal when the rename fell between its looks)."""
    storage = WalStorage(tmp_path, direct_io=direct)
    storage.truncate(real_wal.start)
    _write_all(storage, real_wal.start, real_wal.data[:100_000], seed=5)
    partial = tmp_path / (segment_file_name(1) + ".partial")
    assert partial.exists()
    real_open = os.open

    def open_racing_the_rename(path: str | os.PathLike[str], flags: int, *args: int) -> int:
        if Path(path) == partial and partial.exists():
            os.rename(partial, tmp_path / segment_file_name(1))  # the writer completes it now
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_racing_the_rename)
    assert storage.read(real_wal.start, 4096) == real_wal.data[:4096]


def _partial(directory: Path, segno: int) -> Path:
    return directory / (segment_file_name(segno) + ".partial")


def _segment_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("0000"))


def test_segments_are_taken_from_spares_made_ahead_and_a_stale_spare_is_never_trusted(
    direct: bool, real_wal: RealWal, tmp_path: Path
) -> None:
    storage = WalStorage(tmp_path, direct_io=direct)
    storage.truncate(real_wal.start)
    _write_all(storage, real_wal.start, real_wal.data)
    # Segments 2 and 3 were spares made in the background while 1 and 2 were written; the
    # spare for the one after the WAL's end is there (no segment's name: not WAL, not listed).
    assert storage.spares_used == 2
    storage.join_spare()
    assert (tmp_path / "waltmp.spare").read_bytes() == bytes(SEG)
    last = (real_wal.end - 1) // SEG
    assert _segment_files(tmp_path)[-1] == segment_file_name(last) + ".partial"
    assert storage.segments() == list(range(1, last + 1))
    # What a kill -9 leaves: no close, and a spare that may be half made. A new process
    # makes its own spare (never renames one it did not make and sync).
    survivor = tmp_path.parent / (tmp_path.name + "-after-crash")
    shutil.copytree(tmp_path, survivor)
    (survivor / "waltmp.spare").write_bytes(b"stale WAL?" * 1000)
    reopened = WalStorage(survivor, direct_io=direct)
    assert reopened.open(real_wal.record_starts[3]) == real_wal.end
    cut = max(s for s in real_wal.record_starts if s < real_wal.end - SEG // 4)
    reopened.truncate(cut)
    assert _segment_files(survivor)[-1] == segment_file_name(cut // SEG) + ".partial"
    _write_all(reopened, cut, real_wal.data[cut - real_wal.start :], seed=9)
    assert reopened.flush_record_lsn == real_wal.end
    reopened.close()
    assert (survivor / "waltmp.spare").read_bytes() == bytes(SEG)
    assert WalStorage(survivor, direct_io=direct).open(real_wal.start) == real_wal.end
    on_disk = b"".join((survivor / n).read_bytes() for n in _segment_files(survivor))
    assert on_disk[: len(real_wal.data)] == real_wal.data
    assert on_disk[len(real_wal.data) :] == bytes(len(on_disk) - len(real_wal.data))


def test_a_failed_spare_is_made_inline_and_breaks_nothing(
    direct: bool, real_wal: RealWal, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_make = WalStorage.make_zeroed_file
    failed: list[str] = []

    def make(self: WalStorage, name: str) -> None:
        if name == "waltmp.spare":
            real_make(self, name)  # as if its fsync failed: the file is there
            failed.append(name)
            raise OSError(5, "injected")
        real_make(self, name)

    monkeypatch.setattr(WalStorage, "make_zeroed_file", make)
    storage = WalStorage(tmp_path, direct_io=direct)
    storage.truncate(real_wal.start)
    _write_all(storage, real_wal.start, real_wal.data)
    storage.close()
    assert len(failed) >= 2 and storage.spares_used == 0 and storage.broken is None
    assert storage.flush_record_lsn == real_wal.end
    assert not (tmp_path / "waltmp.spare").exists()
    assert WalStorage(tmp_path, direct_io=direct).open(real_wal.start) == real_wal.end


def _wal_files(directory: Path) -> dict[str, bytes]:
    return {n: (directory / n).read_bytes() for n in _segment_files(directory)}


def test_direct_writes_leave_the_files_a_buffered_storage_leaves(
    real_wal: RealWal, tmp_path: Path
) -> None:
    """O_DIRECT through the aligned stage: unaligned groups, a piece bigger than the stage,
    a restart inside a block (the block's head read back from the file) and a truncation
    inside a block give byte for byte the segments the buffered writes give."""
    cut = next(s for s in real_wal.record_starts if s > real_wal.start + SEG // 3 and s % 4096)
    results = {}
    for direct in (False, True):
        d = tmp_path / ("direct" if direct else "buffered")
        d.mkdir()
        storage = WalStorage(d, direct_io=direct)
        storage.truncate(real_wal.start)
        first = SEG // 2 + 12_345  # not a multiple of 4 KiB
        _write_all(storage, real_wal.start, real_wal.data[:first], seed=11)
        storage.close()
        # A new process continues in the middle of a 4 KiB block.
        storage = WalStorage(d, direct_io=direct)
        resumed = storage.open(real_wal.start)
        assert resumed % 4096
        rest = real_wal.data[resumed - real_wal.start :]
        # One piece of 3 MiB in a single chunk (more than the 1 MiB stage), then the rest.
        storage.write(resumed, [rest[: 3 << 20]])
        _write_all(storage, Lsn(resumed + (3 << 20)), rest[3 << 20 :], seed=12)
        assert storage.flush_record_lsn == real_wal.end
        storage.truncate(cut)
        _write_all(storage, cut, real_wal.data[cut - real_wal.start :], seed=13)
        assert storage.flush_record_lsn == real_wal.end
        if direct:
            flags = int((Path("/proc/self/fdinfo") / str(storage._fd)).read_text().split()[3], 8)
            assert flags & os.O_DIRECT, "the open segment is not written with O_DIRECT"
        storage.close()
        results[direct] = _wal_files(d)
        assert WalStorage(d, direct_io=direct).open(real_wal.start) == real_wal.end
    assert results[True].keys() == results[False].keys()
    for name, data in results[False].items():
        assert results[True][name] == data, name


def test_direct_io_refused_by_the_filesystem_fails_with_the_reason(
    tmp_path: Path, refuse_direct_io: None
) -> None:
    with pytest.raises(WalStorageError, match=r"refuses O_DIRECT.*wal_direct_io"):
        WalStorage(tmp_path, direct_io=True)
    assert list(tmp_path.iterdir()) == []  # no probe left behind
    WalStorage(tmp_path)  # buffered is not affected
    with pytest.raises(WalStorageError, match="multiple of 4096"):
        WalStorage(tmp_path, seg_size=1000, direct_io=True)
