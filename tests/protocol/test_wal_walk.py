"""The minimal WAL walk (``protocol.wal.walk.walk_crc``, the ``walk-crc-min`` floor of
``pagestore bench bulk-ingest``) does the real work: on the same WAL it finds exactly the
records the production decoder finds (count and end LSN, across pages, segments and an
XLOG_SWITCH), stops at the same record when a byte of one is corrupted (its CRC), and stops
where a truncated input stops. A walk that skipped the CRC would fail the corruption test."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.wal.encoder import BlockSpec, WalEncoder
from protocol.wal.reader import EndOfWal, WalStreamDecoder
from protocol.wal.record import RelFileNode
from protocol.wal.walk import walk_crc
from tests.protocol.wal_strategies import SEG, encode, record_specs, simple_record_specs

# the stream starts on a page boundary (the encoder writes that page's header), records
# cross a segment boundary
START = 2 * SEG - 8 * 8192


def _decoder(data: bytes, start: int) -> tuple[int, EndOfWal]:
    dec = WalStreamDecoder(start)
    got: list[object] = []
    count = 0
    for i in range(0, len(data), 131072):  # the receiver's XLogData size
        dec.feed(data[i : i + 131072])
        dec.decode_into(got)  # type: ignore[arg-type]
        count += len(got)
        got.clear()
    return count, dec.finish()


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(st.one_of(simple_record_specs(), record_specs()), min_size=1, max_size=40),
    cut=st.none() | st.floats(0.0, 1.0),
)
def test_walk_finds_what_the_decoder_finds(specs: list[dict[str, object]], cut: float | None) -> None:
    data, spans = encode(START, specs)
    first = spans[0][0]
    if cut is not None:
        data = data[: max(24, int(len(data) * cut))]  # (the first page header: where both start)
    count, end = _decoder(data, START)
    walked = walk_crc(data, START, first)
    assert walked.error is None
    assert (walked.records, walked.end_lsn) == (count, end.lsn)
    if cut is None:
        assert walked.records == len(specs)
        assert walked.end_lsn == spans[-1][1]


@settings(max_examples=80, deadline=None)
@given(
    specs=st.lists(st.one_of(simple_record_specs(), record_specs()), min_size=1, max_size=30),
    which=st.integers(0, 10**6),
    at=st.integers(4, 10**6),
    flip=st.integers(1, 255),
)
def test_a_corrupted_record_stops_both_at_that_record(
    specs: list[dict[str, object]], which: int, at: int, flip: int
) -> None:
    data, spans = encode(START, specs)
    i = which % len(specs)
    lsn = spans[i][0]
    # a byte of record i: its header after xl_tot_len (the bytes the CRC covers first) or
    # its body, as long as it lies on the record's first page (no page header in between)
    page_rem = 8192 - lsn % 8192
    tot_len = int.from_bytes(data[lsn - START : lsn - START + 4], "little")  # (not the padding)
    length = min(tot_len, page_rem)
    if length <= 4:
        return
    off = lsn + 4 + at % (length - 4)
    buf = bytearray(data)
    buf[off - START] ^= flip
    corrupted = bytes(buf)
    count, stop = _decoder(corrupted, START)
    walked = walk_crc(corrupted, START, spans[0][0])
    assert walked.records == count == i
    assert walked.end_lsn == stop.lsn == (spans[i - 1][1] if i else spans[0][0])
    assert walked.error is not None


def _bulk(n: int, *, switch_at: int | None = None) -> tuple[bytes, list[tuple[int, int]]]:
    """A bulk INSERT's shape: heap inserts of 140 bytes, one block each."""
    enc = WalEncoder(START)
    rnode = RelFileNode(1663, 5, 16384)
    spans: list[tuple[int, int]] = []
    for i in range(n):
        if i == switch_at:
            spans.append(enc.switch())
        blk = BlockSpec(rnode=rnode, blkno=i // 60, data=bytes(range(90)))
        spans.append(enc.append(10, 0, xid=7, blocks=[blk], main_data=b"\x01\x00\x03"))
    return enc.take(), spans


def test_walk_on_bulk_load_records_with_a_switch_and_a_stop() -> None:
    data, spans = _bulk(3000, switch_at=1000)
    count, end = _decoder(data, START)
    walked = walk_crc(data, START, spans[0][0])
    assert (walked.records, walked.end_lsn, walked.error) == (count, end.lsn, None) == (3001, spans[-1][1], None)
    # stop_lsn: the walk ends at the first record starting at or past it
    stopped = walk_crc(data, START, spans[0][0], spans[2000][0])
    assert (stopped.records, stopped.end_lsn) == (2000, spans[2000][0])
    # the last record's CRC field flipped: every record before it, not it
    bad = bytearray(data)
    bad[spans[-1][0] - START + 20] ^= 1
    walked = walk_crc(bytes(bad), START, spans[0][0])
    assert (walked.records, walked.end_lsn) == (3000, spans[-1][0])
    assert walked.error is not None and "CRC" in walked.error


def test_walk_refuses_a_stale_page() -> None:
    # a page whose xlp_pageaddr names another page (a recycled segment's old content) ends
    # the walk at that page, as the decoder's page check ends valid WAL there
    data, spans = _bulk(1000)
    bad = bytearray(data)
    page = 3 * 8192
    bad[page + 8] ^= 0x20  # xlp_pageaddr
    count, end = _decoder(bytes(bad), START)
    walked = walk_crc(bytes(bad), START, spans[0][0])
    assert (walked.records, walked.end_lsn) == (count, end.lsn)
    assert walked.error is not None and "page header" in walked.error
