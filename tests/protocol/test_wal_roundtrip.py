"""Encoder -> stream decoder round trips: random records, pages, segments, chunked input."""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.lsn import XLOG_BLCKSZ
from protocol.wal.encoder import BlockSpec, WalEncoder, standard_hole
from protocol.wal.page import record_end_lsn
from protocol.wal.reader import NEED_DATA, EndOfWal, WalStreamDecoder
from protocol.wal.record import DecodedRecord, RelFileNode, decode_record
from protocol.wal.rmgr import RmgrId
from tests.protocol.wal_strategies import SEG, encode, record_specs


def decode_all(start: int, data: bytes, chunks: list[int] | None = None) -> tuple[list[DecodedRecord], EndOfWal]:
    dec = WalStreamDecoder(start)
    out: list[DecodedRecord] = []
    pos = 0
    for size in chunks or [len(data)]:
        dec.feed(data[pos : pos + size])
        pos += size
        out.extend(dec.records())
    dec.feed(data[pos:])
    out.extend(dec.records())
    return out, dec.finish()


def expected_image(spec: BlockSpec) -> bytes:
    assert spec.image is not None
    off, length = standard_hole(spec.image) if spec.hole is None else spec.hole
    page = bytearray(spec.image)
    page[off : off + length] = bytes(length)
    return bytes(page)


def check_record(rec: DecodedRecord, spec: dict[str, object], span: tuple[int, int]) -> None:
    assert (rec.lsn, rec.end_lsn) == span
    assert rec.xl_rmid == spec["rmid"] and rec.xl_info == spec["info"] and rec.xl_xid == spec["xid"]
    assert rec.main_data == spec["main_data"]
    assert rec.origin == spec["origin"] and rec.toplevel_xid == spec["toplevel_xid"]
    specs = spec["blocks"]
    assert isinstance(specs, list)
    assert len(rec.blocks) == len(specs)
    for blk, bs in zip(rec.blocks, specs, strict=True):
        assert blk.block_id == bs.block_id
        assert blk.rnode == bs.rnode and blk.forknum == bs.forknum and blk.blkno == bs.blkno
        assert blk.data == bs.data and blk.has_data == bool(bs.data)
        assert blk.will_init == bs.will_init
        assert blk.has_image == (bs.image is not None)
        if bs.image is not None:
            assert blk.apply_image == bs.apply_image
            assert blk.compression == bs.compression
            assert blk.image == expected_image(bs)
        else:
            assert blk.image is None and not blk.apply_image
    # A stored raw record decodes to the same thing, end LSN recomputed from its length.
    assert decode_record(rec.raw, rec.lsn) == rec
    assert record_end_lsn(rec.lsn, rec.xl_tot_len) == rec.end_lsn


@settings(max_examples=60)
@given(
    specs=st.lists(record_specs(), min_size=1, max_size=12),
    start_back=st.integers(0, 3 * XLOG_BLCKSZ // 8),
    seed=st.integers(0, 2**32),
)
def test_roundtrip_across_pages_and_segments(
    specs: list[dict[str, object]], start_back: int, seed: int
) -> None:
    # Start a little before a segment boundary so records cross it.
    start = 2 * SEG - start_back * 8
    data, spans = encode(start, specs)
    rng = random.Random(seed)
    chunks = [rng.randint(1, 5000) for _ in range(rng.randint(0, 30))]
    for feed in (None, chunks):
        records, end = decode_all(start, data, feed)
        assert len(records) == len(specs)
        for rec, spec, span in zip(records, specs, spans, strict=True):
            check_record(rec, spec, span)
        assert end.truncated and end.lsn == spans[-1][1]
        assert end.last_record_lsn == spans[-1][0]
    # xl_prev chains every record to the one before it.
    for a, b in itertools.pairwise(records):
        assert b.xl_prev == a.lsn


def test_byte_at_a_time() -> None:
    rn = RelFileNode(1663, 5, 16384)
    enc = WalEncoder(SEG - 3 * XLOG_BLCKSZ)
    spans = [
        enc.append(10, 0, xid=i, blocks=[BlockSpec(rn, i, data=bytes([i]) * (i * 37))],
                   main_data=b"m" * (i * 101))
        for i in range(40)
    ]
    data = enc.take()
    dec = WalStreamDecoder(SEG - 3 * XLOG_BLCKSZ)
    got = []
    for i in range(len(data)):
        dec.feed(data[i : i + 1])
        while True:
            item = dec.next_record()
            if item is NEED_DATA:
                break
            assert isinstance(item, DecodedRecord)
            got.append((item.lsn, item.end_lsn))
    assert got == spans


def _sized_main(tot_len: int) -> bytes:
    """Main data that makes a block-less record exactly ``tot_len`` bytes (long header)."""
    return bytes(tot_len - 24 - 5)


def test_record_header_split_across_pages() -> None:
    # First record fills the page up to its last 8 bytes, so the second record's 24-byte
    # header starts there and continues after the next page header.
    page = 5 * XLOG_BLCKSZ
    enc = WalEncoder(page)
    first = enc.append(0, 0x20, main_data=_sized_main(XLOG_BLCKSZ - 24 - 8))
    assert first[1] == page + XLOG_BLCKSZ - 8
    second = enc.append(1, 0x00, xid=77, main_data=b"x" * 300)
    third = enc.append(0, 0x20, main_data=b"y")
    data = enc.take()
    for step in (len(data), 1, 7, 8, 13):
        dec = WalStreamDecoder(page)
        recs: list[DecodedRecord] = []
        for i in range(0, len(data), step):
            dec.feed(data[i : i + step])
            recs.extend(dec.records())
        assert [(r.lsn, r.end_lsn) for r in recs] == [first, second, third]
        assert recs[1].xl_xid == 77 and recs[1].main_data == b"x" * 300


def test_record_ending_exactly_at_page_boundary() -> None:
    page = 9 * XLOG_BLCKSZ
    enc = WalEncoder(page)
    first = enc.append(0, 0x20, main_data=_sized_main(XLOG_BLCKSZ - 24))
    assert first[1] == page + XLOG_BLCKSZ
    second = enc.append(0, 0x20, main_data=b"z" * 9)
    assert second[0] == page + XLOG_BLCKSZ + 24  # after the next (non-continuation) header
    data = enc.take()
    records, _ = decode_all(page, data)
    assert [(r.lsn, r.end_lsn) for r in records] == [first, second]


def test_xlog_switch_jumps_to_next_segment() -> None:
    start = 3 * SEG - 2 * XLOG_BLCKSZ
    enc = WalEncoder(start)
    a = enc.append(0, 0x20, main_data=b"a")
    sw = enc.switch()
    assert sw[1] == 3 * SEG
    b = enc.append(0, 0x20, main_data=b"b" * 20000)
    data = enc.take()
    assert len(data) == b[1] - start
    records, end = decode_all(start, data, [4096] * 10)
    assert [(r.lsn, r.end_lsn) for r in records] == [a, sw, b]
    assert records[1].is_switch and records[2].xl_prev == sw[0]
    assert b[0] == 3 * SEG + 40  # the long header of the new segment
    assert end.lsn == b[1]


def test_find_first_record_from_a_continuation_page() -> None:
    """Starting at a page whose data begins with a continuation, like pg_waldump --start."""
    start = 7 * SEG
    enc = WalEncoder(start)
    spans = [enc.append(0, 0x20, main_data=bytes(i * 3000)) for i in range(1, 12)]
    data = enc.take()
    for page in range(start, start + len(data) - XLOG_BLCKSZ, XLOG_BLCKSZ):
        dec = WalStreamDecoder(page)
        dec.feed(data[page - start :])
        got = [(r.lsn, r.end_lsn) for r in dec.records()]
        assert got == [s for s in spans if s[0] >= page]


def test_mid_page_start_with_page_header_checked() -> None:
    start = 4 * SEG
    enc = WalEncoder(start)
    spans = [enc.append(0, 0x20, main_data=bytes(100 + i)) for i in range(30)]
    data = enc.take()
    # Start at the 10th record; feed from the segment start so its page header is checked.
    lsn = spans[10][0]
    dec = WalStreamDecoder(lsn, data_start=start, prev_lsn=spans[9][0])
    dec.feed(data)
    assert [(r.lsn, r.end_lsn) for r in dec.records()] == spans[10:]
    # A wrong expected prev is the end of WAL, reported at that record.
    dec = WalStreamDecoder(lsn, prev_lsn=spans[8][0])
    dec.feed(data[lsn - start :])
    end = dec.next_record()
    assert isinstance(end, EndOfWal)
    assert end.error_lsn == lsn and "incorrect prev-link" in end.reason


def test_switch_record_then_zeros_is_end_of_wal_after_fill() -> None:
    start = SEG
    enc = WalEncoder(start)
    a = enc.append(int(RmgrId.XLOG), 0x20, main_data=b"q")
    enc.zero_fill_to_segment_end()
    data = enc.take()
    assert len(data) == SEG
    records, end = decode_all(start, data)
    assert [(r.lsn, r.end_lsn) for r in records] == [a]
    assert not end.truncated and end.lsn == a[1]
    assert end.reason == f"invalid record length at 0/{a[1]:X}: wanted 24, got 0"
