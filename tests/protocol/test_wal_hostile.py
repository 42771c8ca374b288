"""Hostile WAL: random bytes, flipped bits, truncation, bad headers. The decoder reports the
end of valid WAL (``EndOfWal``) or raises ``RemoteProtocolError``, never anything else."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import RemoteProtocolError
from protocol.lsn import XLOG_BLCKSZ
from protocol.wal.encoder import BlockSpec, WalEncoder, build_record
from protocol.wal.page import XLP_FIRST_IS_OVERWRITE_CONTRECORD, encode_page_header
from protocol.wal.reader import NEED_DATA, EndOfWal, WalStreamDecoder
from protocol.wal.record import DecodedRecord, RelFileNode, decode_record, record_crc
from tests.protocol.wal_strategies import SEG, encode, make_page, record_specs

RN = RelFileNode(1663, 5, 16384)


def drain(dec: WalStreamDecoder) -> tuple[list[DecodedRecord], EndOfWal | None]:
    out = []
    while True:
        item = dec.next_record()
        if isinstance(item, DecodedRecord):
            out.append(item)
            continue
        return out, (item if isinstance(item, EndOfWal) else None)


def sample_stream(start: int = SEG) -> tuple[bytes, list[tuple[int, int]]]:
    enc = WalEncoder(start)
    page = make_page(7, 200, 6000)
    spans: list[tuple[int, int]] = []
    for i in range(60):
        blocks = [BlockSpec(RN, i, data=bytes([i % 251]) * (i * 13 % 500))]
        if i % 7 == 0:
            blocks.append(BlockSpec(RN, i + 1, image=page, compression=[None, "lz4", "pglz"][i % 3]))
        spans.append(enc.append(10, 0, xid=i, blocks=blocks, main_data=bytes(i * 61 % 3000)))
    return enc.take(), spans


STREAM, SPANS = sample_stream()


@settings(max_examples=200)
@given(data=st.binary(min_size=0, max_size=20000), start_page=st.booleans())
def test_random_bytes_never_raise(data: bytes, start_page: bool) -> None:
    start = SEG + (0 if start_page else 24 * 8)
    dec = WalStreamDecoder(start)
    dec.feed(data)
    drain(dec)
    end = dec.finish()
    assert isinstance(end, EndOfWal)


@settings(max_examples=150)
@given(pos=st.integers(0, len(STREAM) - 1), bit=st.integers(0, 7))
def test_flipped_bit_gives_a_prefix(pos: int, bit: int) -> None:
    data = bytearray(STREAM)
    data[pos] ^= 1 << bit
    dec = WalStreamDecoder(SEG)
    dec.feed(data)
    records, _ = drain(dec)
    end = dec.finish()
    spans = [(r.lsn, r.end_lsn) for r in records]
    assert spans == SPANS[: len(spans)]
    # The record holding the flipped byte is never returned: its CRC covers every byte.
    for rec in records:
        lo = rec.lsn - SEG
        assert not (lo <= pos < lo + rec.xl_tot_len and _no_page_break(rec.lsn, rec.xl_tot_len))
    if len(spans) < len(SPANS):
        assert not end.truncated
        # Without a good record: the start, or the first record's place if the page was fine.
        assert end.lsn in ((spans[-1][1],) if spans else (SEG, SEG + 40))


def _no_page_break(lsn: int, tot_len: int) -> bool:
    return lsn // XLOG_BLCKSZ == (lsn + tot_len - 1) // XLOG_BLCKSZ


@settings(max_examples=100)
@given(cut=st.integers(0, len(STREAM)))
def test_truncated_stream(cut: int) -> None:
    dec = WalStreamDecoder(SEG)
    dec.feed(STREAM[:cut])
    records, ended = drain(dec)
    assert ended is None
    assert [(r.lsn, r.end_lsn) for r in records] == [s for s in SPANS if _fully_fed(s, cut)]
    end = dec.finish()
    assert end.lsn == (records[-1].end_lsn if records else SEG) or (
        not records and end.lsn == SEG + 40
    )
    # Only a stream cut exactly after the last record leaves nothing pending.
    assert end.truncated


def _fully_fed(span: tuple[int, int], cut: int) -> bool:
    lsn, _end = span
    # A record is available once its last byte arrived; its padding need not.
    return _last_byte_offset(lsn, len(_raw_at(lsn))) < cut


_RAW: dict[int, bytes] = {}


def _raw_at(lsn: int) -> bytes:
    if not _RAW:
        dec = WalStreamDecoder(SEG)
        dec.feed(STREAM)
        for r in dec.records():
            _RAW[r.lsn] = r.raw
    return _RAW[lsn]


def _last_byte_offset(lsn: int, tot_len: int) -> int:
    """Stream offset of a record's last byte, skipping page headers."""
    pos = lsn
    left = tot_len
    while True:
        room = XLOG_BLCKSZ - pos % XLOG_BLCKSZ
        if left <= room:
            return pos + left - 1 - SEG
        left -= room
        pos += room
        pos += 40 if pos % SEG == 0 else 24


@settings(max_examples=300)
@given(raw=st.binary(min_size=0, max_size=600), crc_ok=st.booleans())
def test_decode_record_hostile(raw: bytes, crc_ok: bool) -> None:
    buf = bytearray(raw)
    if len(buf) >= 24:
        struct.pack_into("<I", buf, 0, len(buf))
        if crc_ok:
            struct.pack_into("<I", buf, 20, record_crc(buf))
    try:
        rec = decode_record(bytes(buf), SEG + 40)
    except RemoteProtocolError:
        return
    for blk in rec.blocks:
        try:
            blk.image  # noqa: B018 - restoring the image is the point
        except RemoteProtocolError:
            pass


@settings(max_examples=200)
@given(pos=st.integers(24, 200), value=st.integers(0, 255), which=st.integers(0, 2))
def test_mutated_body_with_valid_crc(pos: int, value: int, which: int) -> None:
    page = make_page(3, 100, 7000)
    raw = bytearray(
        build_record(
            prev=0,
            rmid=10,
            info=0,
            blocks=[
                BlockSpec(RN, 1, data=b"abc", image=page, compression=[None, "lz4", "zstd"][which]),
                BlockSpec(RN, 2, data=b"x" * 10),
            ],
            main_data=b"hello",
        )
    )
    raw[pos % len(raw)] = value
    struct.pack_into("<I", raw, 0, len(raw))
    struct.pack_into("<I", raw, 20, record_crc(raw))
    try:
        rec = decode_record(bytes(raw), SEG + 40)
        for blk in rec.blocks:
            img = blk.image
            assert img is None or len(img) == XLOG_BLCKSZ
    except RemoteProtocolError:
        pass


def test_zero_length_and_bad_crc_and_bad_page() -> None:
    # xl_tot_len = 0 after the last record.
    data = STREAM + bytes(64)
    dec = WalStreamDecoder(SEG)
    dec.feed(data)
    records, end = drain(dec)
    assert len(records) == len(SPANS) and end is not None
    assert end.lsn == SPANS[-1][1]
    assert end.reason == f"invalid record length at 0/{SPANS[-1][1]:X}: wanted 24, got 0"
    assert end.last_record_lsn == SPANS[-1][0]
    # The end is sticky.
    assert dec.next_record() is end

    # A corrupted CRC on record 5.
    bad = bytearray(STREAM)
    off = SPANS[5][0] - SEG
    bad[off + 20] ^= 0xFF
    dec = WalStreamDecoder(SEG)
    dec.feed(bad)
    records, end = drain(dec)
    assert len(records) == 5 and end is not None
    assert end.reason == f"incorrect resource manager data checksum in record at 0/{SPANS[5][0]:X}"
    assert end.lsn == SPANS[4][1] and end.error_lsn == SPANS[5][0]

    # A bad magic on the second page.
    bad = bytearray(STREAM)
    bad[XLOG_BLCKSZ] ^= 0x01
    dec = WalStreamDecoder(SEG)
    dec.feed(bad)
    records, end = drain(dec)
    assert end is not None and end.reason.startswith("invalid magic number D111 in log segment")
    assert end.error_lsn == SEG + XLOG_BLCKSZ

    # A page with a wrong pageaddr (a recycled segment).
    bad = bytearray(STREAM)
    struct.pack_into("<Q", bad, 2 * XLOG_BLCKSZ + 8, 2 * XLOG_BLCKSZ)
    dec = WalStreamDecoder(SEG)
    dec.feed(bad)
    records, end = drain(dec)
    assert end is not None and end.reason.startswith("unexpected pageaddr")
    assert all(r.end_lsn <= SEG + 2 * XLOG_BLCKSZ for r in records)


def test_missing_contrecord_flag_and_wrong_rem_len() -> None:
    enc = WalEncoder(SEG)
    a = enc.append(0, 0x20, main_data=bytes(100))
    b = enc.append(0, 0x20, main_data=bytes(20000))  # crosses two page boundaries
    data = bytearray(enc.take())
    for fmt, offset, value, message in (
        ("<H", XLOG_BLCKSZ + 2, 0x0004, "there is no contrecord flag at 0/1002000"),
        ("<I", XLOG_BLCKSZ + 16, 5, "invalid contrecord length 5 (expected "),
    ):
        bad = bytearray(data)
        struct.pack_into(fmt, bad, offset, value)
        dec = WalStreamDecoder(SEG)
        dec.feed(bad)
        records, end = drain(dec)
        assert [(r.lsn, r.end_lsn) for r in records] == [a]
        assert end is not None and end.reason.startswith(message)
        assert end.lsn == a[1] and end.last_record_lsn == a[0]
    assert b[1] > SEG + 2 * XLOG_BLCKSZ


def test_contrecord_where_a_record_should_start() -> None:
    enc = WalEncoder(SEG)
    enc.append(0, 0x20, main_data=_exact(XLOG_BLCKSZ - 40))
    enc.append(0, 0x20, main_data=b"n")
    data = bytearray(enc.take())
    struct.pack_into("<H", data, XLOG_BLCKSZ + 2, 0x0005)  # CONTRECORD on a fresh page
    dec = WalStreamDecoder(SEG)
    dec.feed(data)
    records, end = drain(dec)
    assert len(records) == 1 and end is not None
    assert end.reason == f"contrecord is requested by 0/{SEG + XLOG_BLCKSZ + 24:X}"


def _exact(tot_len: int) -> bytes:
    return bytes(tot_len - 24 - 5)


def test_invalid_rmid_and_huge_length() -> None:
    for rmid, fragment in ((22, "invalid resource manager ID 22"), (200, None)):
        enc = WalEncoder(SEG)
        enc.append(0, 0x20, main_data=b"a")
        enc.append(rmid, 0x00, main_data=b"b")
        dec = WalStreamDecoder(SEG)
        dec.feed(enc.take())
        records, end = drain(dec)
        if fragment is None:  # custom resource managers (128..255) are valid
            assert len(records) == 2 and end is None
        else:
            assert len(records) == 1 and end is not None and end.reason.startswith(fragment)
    data = bytearray(encode_page_header(SEG, info=0)) + struct.pack("<I", 0x7FFF_FFFF) + bytes(100)
    dec = WalStreamDecoder(SEG)
    dec.feed(data)
    _, end = drain(dec)
    assert end is None or "invalid" in end.reason or "too long" in end.reason


def test_overwrite_contrecord_restarts_the_read() -> None:
    """An aborted record followed by a page flagged XLP_FIRST_IS_OVERWRITE_CONTRECORD."""
    enc = WalEncoder(SEG)
    a = enc.append(0, 0x20, main_data=bytes(100))
    good = bytearray(enc.take())
    # Start a record that would span into the next page, but write only its first part.
    raw = build_record(prev=a[0], rmid=0, info=0x20, main_data=bytes(9000))
    room = XLOG_BLCKSZ - len(good)
    good += raw[:room]
    # Recovery then wrote an OVERWRITE_CONTRECORD record on the next page.
    over = WalEncoder(SEG + XLOG_BLCKSZ, prev_lsn=a[0])
    ov = over.append(0, 0xD0, main_data=struct.pack("<Qq", a[1], 0))
    tail = bytearray(over.take())
    struct.pack_into("<H", tail, 2, 0x0004 | XLP_FIRST_IS_OVERWRITE_CONTRECORD)
    dec = WalStreamDecoder(SEG)
    dec.feed(bytes(good) + bytes(tail))
    records, _ = drain(dec)
    assert [(r.lsn, r.end_lsn) for r in records] == [a, ov]
    assert records[1].record_type == "OVERWRITE_CONTRECORD"


def test_need_data_until_complete() -> None:
    dec = WalStreamDecoder(SEG)
    assert dec.next_record() is NEED_DATA
    dec.feed(STREAM[:10])
    assert dec.next_record() is NEED_DATA


def test_start_must_be_aligned() -> None:
    from protocol.errors import LocalProtocolError

    with pytest.raises(LocalProtocolError):
        WalStreamDecoder(SEG + 3)


@settings(max_examples=30)
@given(specs=st.lists(record_specs(), min_size=1, max_size=4), cut=st.integers(0, 10**6))
def test_random_truncation_of_random_records(specs: list[dict[str, object]], cut: int) -> None:
    data, spans = encode(SEG - 3 * XLOG_BLCKSZ, specs)
    cut %= len(data) + 1
    dec = WalStreamDecoder(SEG - 3 * XLOG_BLCKSZ)
    dec.feed(data[:cut])
    records, _ = drain(dec)
    assert [(r.lsn, r.end_lsn) for r in records] == spans[: len(records)]
    end = dec.finish()
    assert end.truncated
    assert end.lsn == (spans[len(records) - 1][1] if records else spans[0][0]) or (
        not records and end.lsn == SEG - 3 * XLOG_BLCKSZ
    )


def test_mid_page_start_on_a_contrecord_page() -> None:
    enc = WalEncoder(SEG)
    enc.append(0, 0x20, main_data=bytes(9000))  # continues on the second page
    b = enc.append(0, 0x20, main_data=b"b")
    data = enc.take()
    # Claiming a record starts right after the second page's header is wrong: that page
    # begins with the rest of the first record.
    dec = WalStreamDecoder(SEG + XLOG_BLCKSZ + 24, data_start=SEG + XLOG_BLCKSZ)
    dec.feed(data[XLOG_BLCKSZ:])
    end = dec.next_record()
    assert isinstance(end, EndOfWal)
    assert end.reason == f"contrecord is requested by 0/{SEG + XLOG_BLCKSZ + 24:X}"
    # A start inside the page header is refused too.
    dec = WalStreamDecoder(SEG + XLOG_BLCKSZ + 16, data_start=SEG + XLOG_BLCKSZ)
    dec.feed(data[XLOG_BLCKSZ:])
    end = dec.next_record()
    assert isinstance(end, EndOfWal) and end.reason.startswith("invalid record offset")
    # The real record start on that page works, with its page header checked.
    dec = WalStreamDecoder(b[0], data_start=SEG + XLOG_BLCKSZ)
    dec.feed(data[XLOG_BLCKSZ:])
    rec = dec.next_record()
    assert isinstance(rec, DecodedRecord) and (rec.lsn, rec.end_lsn) == b


def test_timeline_going_backwards_and_sysid() -> None:
    enc = WalEncoder(SEG, timeline=3, system_identifier=0xABCDEF)
    for _ in range(5):
        enc.append(0, 0x20, main_data=bytes(3000))
    data = bytearray(enc.take())
    dec = WalStreamDecoder(SEG)
    dec.feed(data)
    records, _ = drain(dec)
    assert len(records) == 5 and dec.system_identifier == 0xABCDEF
    struct.pack_into("<I", data, XLOG_BLCKSZ + 4, 2)  # second page claims timeline 2
    dec = WalStreamDecoder(SEG)
    dec.feed(data)
    records, end = drain(dec)
    assert end is not None and end.reason.startswith("out-of-sequence timeline ID 2 (after 3)")


def test_decode_record_length_mismatch() -> None:
    raw = build_record(prev=0, rmid=0, info=0x20, main_data=b"abc")
    with pytest.raises(RemoteProtocolError):
        decode_record(raw + b"\x00", SEG + 40)
    with pytest.raises(RemoteProtocolError):
        decode_record(raw[:10], SEG + 40)
    bad = bytearray(raw)
    bad[-1] ^= 1
    with pytest.raises(RemoteProtocolError, match="checksum"):
        decode_record(bytes(bad), SEG + 40)
    assert decode_record(bytes(bad), SEG + 40, verify_crc=False).main_data == b"abb"
