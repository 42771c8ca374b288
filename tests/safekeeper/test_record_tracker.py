"""RecordTracker: corrupting any byte of a record is caught before the record is counted.

The tracker's fast path checks each record's CRC through the CRC-32C residue and positions
are derived from buffer indexes; these properties pin that down against single-byte damage
anywhere in a record, any record size and any chunking. Every test runs against both
implementations (the compiled kernel and its pure-Python twin: the ``impl`` fixture).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.lsn import XLOG_BLCKSZ, Lsn
from protocol.wal.encoder import WalEncoder
from protocol.wal.page import XLP_FIRST_IS_OVERWRITE_CONTRECORD
from protocol.wal.reader import WalStreamDecoder
from protocol.wal.record import DecodedRecord
from protocol.wal.rmgr import XLOG_NOOP, XLOG_OVERWRITE_CONTRECORD, RmgrId
from safekeeper.record_tracker import InvalidWal
from safekeeper.record_tracker import RecordTracker as SelectedTracker
from safekeeper.testing import synthetic_wal
from tests.conftest import kernel

WALS: dict[int, tuple[bytes, list[tuple[Lsn, Lsn]]]] = {}
# the implementation under test (set per module run by the fixture below)
RecordTracker: type[SelectedTracker] = SelectedTracker


@pytest.fixture(autouse=True, scope="module")
def _each_implementation(impl: str) -> Iterator[None]:
    """Run this module's tests with the ``impl`` fixture's tracker (module scope, because
    hypothesis tests may not take function-scoped fixtures)."""
    global RecordTracker
    RecordTracker = kernel(impl, "protocol._wal_c").RecordTracker
    try:
        yield
    finally:
        RecordTracker = SelectedTracker


def _wal(record_size: int) -> tuple[bytes, list[tuple[Lsn, Lsn]]]:
    if record_size not in WALS:
        data = synthetic_wal(Lsn(0x2000000), 40_000, record_size=record_size)
        decoder = WalStreamDecoder(Lsn(0x2000000))
        decoder.feed(data)
        spans = [(rec.lsn, rec.end_lsn) for rec in decoder.records()]
        WALS[record_size] = (data, spans)
    return WALS[record_size]


def _feed(data: bytes, seed: int, max_chunk: int) -> tuple[SelectedTracker, bool]:
    tracker = RecordTracker(Lsn(0x2000000))
    rng = random.Random(seed)
    i = 0
    try:
        while i < len(data):
            n = rng.randint(1, max_chunk)
            chunk = data[i : i + n]
            tracker.feed(chunk if rng.random() < 0.5 else memoryview(bytearray(chunk)))
            i += n
    except InvalidWal:
        return tracker, True
    return tracker, False


@settings(max_examples=150, deadline=None)
@given(
    record_size=st.sampled_from([26, 64, 200, 1000, 8000, 9000]),
    which=st.integers(min_value=0),
    offset=st.integers(min_value=0),
    bit=st.integers(min_value=0, max_value=7),
    seed=st.integers(min_value=0, max_value=1 << 30),
    max_chunk=st.sampled_from([1, 7, 300, 5000, 200_000]),
)
def test_a_damaged_record_is_never_counted(
    record_size: int, which: int, offset: int, bit: int, seed: int, max_chunk: int
) -> None:
    data, spans = _wal(record_size)
    start, _end = spans[which % len(spans)]
    # A byte of the record proper: not a page header inside a long record, and not the
    # MAXALIGN padding after it (neither is covered by the record's CRC).
    tot_len = int.from_bytes(data[start - 0x2000000 : start - 0x2000000 + 4], "little")
    k = offset % tot_len
    pos = _record_byte_pos(start, k)
    damaged = bytearray(data)
    damaged[pos - 0x2000000] ^= 1 << bit
    tracker, raised = _feed(bytes(damaged), seed, max_chunk)
    assert tracker.record_end <= start
    if k >= 4:
        # xl_tot_len intact: the record is complete in the stream, so its CRC must fail.
        assert raised


def _record_byte_pos(start: int, k: int) -> int:
    """Where the ``k``-th byte of the record starting at ``start`` is (page headers skipped)."""
    pos = start
    while True:
        page = pos - pos % 8192
        header = 40 if page % 0x1000000 == 0 else 24
        pos = max(pos, page + header)
        room = page + 8192 - pos
        if k < room:
            return pos + k
        k -= room
        pos = page + 8192


@pytest.mark.parametrize("record_size", [26, 200, 8000, 9000])
def test_clean_wal_gives_the_decoders_record_ends(record_size: int) -> None:
    data, spans = _wal(record_size)
    for seed, max_chunk in ((1, 1), (2, 333), (3, 200_000)):
        tracker, raised = _feed(data, seed, max_chunk)
        assert not raised
        assert tracker.record_end == spans[-1][1]


# Bits of a short page header the tracker checks: magic, the info flags that must be exactly
# "continuation, short header" plus unknown bits, the page address and xlp_rem_len. (The
# timeline id, XLP_BKP_REMOVABLE, XLP_FIRST_IS_OVERWRITE_CONTRECORD and the padding are not
# checked, by PostgreSQL's reader neither.)
_CHECKED_HEADER_BITS = (
    [(0, b) for b in range(8)]
    + [(1, b) for b in range(8)]
    + [(2, b) for b in (0, 1, 4, 5, 6, 7)]
    + [(3, b) for b in range(8)]
    + [(o, b) for o in range(8, 20) for b in range(8)]
)


@settings(max_examples=150, deadline=None)
@given(
    record_size=st.sampled_from([3000, 8000, 9000, 20000]),
    which=st.integers(min_value=0),
    where=st.sampled_from(_CHECKED_HEADER_BITS),
    seed=st.integers(min_value=0, max_value=1 << 30),
    max_chunk=st.sampled_from([1, 7, 300, 5000, 200_000]),
)
def test_a_damaged_page_header_inside_a_record_is_caught(
    record_size: int, which: int, where: tuple[int, int], seed: int, max_chunk: int
) -> None:
    """The header of a page a record continues on (the fast path checks these inline):
    any damage to a checked field stops the tracker before that record is counted."""
    data, spans = _wal(record_size)
    spanning = [
        (s, e)
        for s, e in spans
        if s // 8192 != (e - 1) // 8192 and (s // 8192 + 1) * 8192 % 0x1000000
    ]
    start, _end = spanning[which % len(spanning)]
    page = (start // 8192 + 1) * 8192
    offset, bit = where
    damaged = bytearray(data)
    damaged[page + offset - 0x2000000] ^= 1 << bit
    tracker, raised = _feed(bytes(damaged), seed, max_chunk)
    assert raised
    assert tracker.record_end <= start


def _crash_recovered_wal(record_size: int, page_no: int) -> tuple[bytes, Lsn]:
    """WAL as PostgreSQL 15 leaves it after crashing with a record cut at a page boundary:
    the bytes before the boundary kept, then (``CreateOverwriteContrecordRecord``) the page
    flagged XLP_FIRST_IS_OVERWRITE_CONTRECORD, starting with an OVERWRITE_CONTRECORD record
    that names the aborted one, then new records. Also the end of the last record."""
    start = Lsn(0x2000000)
    enc = WalEncoder(start, system_identifier=1)
    body = bytes(range(256)) * (record_size // 256 + 1)
    spans: list[tuple[int, int]] = []
    while enc.insert_lsn <= start + (page_no + 8) * XLOG_BLCKSZ:
        enc.append(RmgrId.XLOG, XLOG_NOOP, main_data=body[: record_size - 26])
        spans.append((enc.prev_lsn, enc.insert_lsn))
    # The first page boundary from ``page_no`` on that cuts a record with one before it.
    page, k = next(
        (p, k)
        for p in range(start + page_no * XLOG_BLCKSZ, enc.insert_lsn, XLOG_BLCKSZ)
        for k, (b, e) in enumerate(spans)
        if k and b < p < e
    )
    page = Lsn(page)
    before = enc.take()[: page - start]
    after = WalEncoder(page, prev_lsn=spans[k - 1][0], system_identifier=1)
    after.append(
        RmgrId.XLOG, XLOG_OVERWRITE_CONTRECORD, main_data=struct.pack("<Qq", spans[k][0], 0)
    )
    for _ in range(5):
        after.append(RmgrId.XLOG, XLOG_NOOP, main_data=body[:100])
    end = after.insert_lsn
    tail = bytearray(after.take())
    (info,) = struct.unpack_from("<H", tail, 2)
    struct.pack_into("<H", tail, 2, info | XLP_FIRST_IS_OVERWRITE_CONTRECORD)
    return before + bytes(tail), end


@settings(max_examples=60, deadline=None)
@given(
    record_size=st.sampled_from([60, 5000, 8000, 20_000]),
    page_no=st.integers(min_value=1, max_value=6),
    seed=st.integers(0, 2**32 - 1),
    max_chunk=st.sampled_from([7, 300, 9000, 1 << 20]),
)
def test_an_overwrite_contrecord_page_drops_the_unfinished_record(
    record_size: int, page_no: int, seed: int, max_chunk: int
) -> None:
    """After a crash of PostgreSQL inside a record, the tracker reads on past the aborted
    record, as PostgreSQL's reader and our decoder do: the acceptor keeps accepting the
    compute's WAL (before, every append after such a crash was refused and commits hung)."""
    data, end = _crash_recovered_wal(record_size, page_no)
    decoder = WalStreamDecoder(Lsn(0x2000000))
    decoder.feed(data)
    decoded_end = [rec.end_lsn for rec in decoder.records()][-1]
    assert (decoded_end + 7) & ~7 == (end + 7) & ~7
    tracker, failed = _feed(data, seed, max_chunk)
    assert not failed
    assert tracker.record_end == (end + 7) & ~7


def test_an_overwrite_flag_without_a_record_in_progress_changes_nothing() -> None:
    """PostgreSQL only looks at the flag while it is reading a continuation; so do we."""
    data = bytearray(synthetic_wal(Lsn(0x2000000), 40_000, record_size=100))
    ends = [rec.end_lsn for rec in _decoded(bytes(data))]
    page = next(
        p for p in range(XLOG_BLCKSZ, len(data), XLOG_BLCKSZ) if not data[p + 2] & 0x1
    )  # a page whose first record starts right after its header
    (info,) = struct.unpack_from("<H", data, page + 2)
    struct.pack_into("<H", data, page + 2, info | XLP_FIRST_IS_OVERWRITE_CONTRECORD)
    tracker, failed = _feed(bytes(data), 1, 1 << 20)
    assert not failed
    assert tracker.record_end == (ends[-1] + 7) & ~7


def _decoded(data: bytes) -> list[DecodedRecord]:
    decoder = WalStreamDecoder(Lsn(0x2000000))
    decoder.feed(data)
    return list(decoder.records())
