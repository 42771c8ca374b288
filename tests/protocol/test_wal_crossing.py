"""``WalStreamDecoder.crossing_record`` (the fused ingest's record crossing into the next page,
handed over as joined bytes) agrees with ``next_record``.

A consumer that asks ``crossing_record`` first, checks the record as the fused path does
(``xl_prev``, length, resource manager, CRC-32C, a body that decodes) and takes it with
``take_crossing``, and otherwise calls ``next_record``, must see exactly the records, end LSNs
and end of WAL that ``next_record`` alone gives, and leave the decoder in the same state after
each record taken (position, ``xl_prev`` link, the page and timeline last checked, the system
identifier): on synthetic WAL with small segments (long page headers often), XLOG_SWITCH
records, records over many pages, any chunking (a chunk boundary at any byte of a crossing
record), and a corrupted next page header of every kind (magic, info bits, no
XLP_FIRST_IS_CONTRECORD, XLP_FIRST_IS_OVERWRITE_CONTRECORD, the long-header flag, segment size
and page size of a long header, pageaddr, timeline out of sequence, ``xlp_rem_len``) or a
corrupted byte anywhere. A deterministic test shows that every record crossing one page
boundary is taken this way (with its header split by the boundary, into a segment's first
page), so the property is not vacuous.
"""

from __future__ import annotations

import copy
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import RemoteProtocolError
from protocol.wal.encoder import BlockSpec, WalEncoder
from protocol.wal.reader import EndOfWal, NeedData, WalStreamDecoder
from protocol.wal.record import (
    XLOG_RECORD_HEADER,
    DecodedRecord,
    RelFileNode,
    decode_body,
    record_crc,
)
from protocol.wal.rmgr import rmgr_id_is_valid
from tests.protocol.wal_strategies import simple_record_specs

SEG = 32768  # four pages: a long page header every fourth page
START = 3 * SEG - 3 * 8192 - 1000  # mid-page, a segment start two pages on
_REL = RelFileNode(1663, 5, 16384)


def _accepts(raw: bytes, lsn: int, prev: int) -> bool:
    """The fused path's checks of a record ``crossing_record`` gave."""
    tot_len, _xid, xprev, _info, rmid, crc = XLOG_RECORD_HEADER.unpack_from(raw)
    if xprev != prev or tot_len != len(raw) or not rmgr_id_is_valid(rmid) or record_crc(raw) != crc:
        return False
    try:
        decode_body(raw, lsn)
    except RemoteProtocolError:
        return False
    return True


def _state(dec: WalStreamDecoder) -> tuple[object, ...]:
    return (
        dec._pos, dec._prev, dec._last_lsn, dec._last_end, dec._latest_page, dec._latest_tli,
        dec.system_identifier, dec._ended, dec._partial,
    )


def _by_next_record(data: bytes, chunks: list[int]) -> tuple[list[tuple[int, int, bytes]], EndOfWal]:
    dec = WalStreamDecoder(START, segment_size=SEG)
    got: list[tuple[int, int, bytes]] = []
    at = 0
    for size in chunks:
        dec.feed(data[at : at + size])
        at += size
        got.extend((r.lsn, r.end_lsn, r.raw) for r in dec.records())
    return got, dec.finish()


def _with_crossing(
    data: bytes, chunks: list[int]
) -> tuple[list[tuple[int, int, bytes]], EndOfWal, int]:
    """Records through ``crossing_record`` where it gives one the checks accept, each checked
    against ``next_record`` on a copy of the decoder."""
    dec = WalStreamDecoder(START, segment_size=SEG)
    got: list[tuple[int, int, bytes]] = []
    taken = 0
    at = 0
    for size in chunks:
        dec.feed(data[at : at + size])
        at += size
        while True:
            before = copy.copy(dec)
            cross = dec.crossing_record()
            assert _state(dec) == _state(before)  # nothing changes before take_crossing
            if cross is not None:
                raw, lsn, end, prev = cross
                ref = copy.copy(dec)
                item = ref.next_record()
                if _accepts(raw, lsn, prev):
                    assert isinstance(item, DecodedRecord)
                    assert (item.lsn, item.end_lsn, item.raw) == (lsn, end, raw)
                    dec.take_crossing()
                    assert _state(dec) == _state(ref)
                    got.append((lsn, end, raw))
                    taken += 1
                    continue
            nxt = dec.next_record()
            if not isinstance(nxt, DecodedRecord):
                assert isinstance(nxt, NeedData | EndOfWal)
                break
            got.append((nxt.lsn, nxt.end_lsn, nxt.raw))
    return got, dec.finish(), taken


def _specs(draw: st.DrawFn) -> list[dict[str, Any] | None]:
    """Records (``None``: an XLOG_SWITCH): mostly heap records of any size, so that records
    cross page boundaries at every offset."""
    out: list[dict[str, Any] | None] = []
    for _ in range(draw(st.integers(1, 70))):
        kind = draw(st.integers(0, 19))
        if kind == 0:
            out.append(None)
        elif kind < 4:
            out.append(draw(simple_record_specs()))
        else:
            out.append({
                "rmid": 10, "info": 0, "xid": 7,
                "blocks": [BlockSpec(_REL, draw(st.integers(0, 9)), data=bytes(draw(st.integers(0, 400))))],
                "main_data": b"\x01\x00\x00" + bytes(draw(st.integers(0, 12))),
            })
    return out


def _encode(specs: list[dict[str, Any] | None]) -> tuple[bytes, list[tuple[int, int]]]:
    enc = WalEncoder(START, segment_size=SEG)
    spans: list[tuple[int, int]] = [enc.switch() if spec is None else enc.append(**spec) for spec in specs]
    return enc.take(), spans


# offset in the page header, struct format, how to change the value
_HEADER_CHANGES: dict[str, tuple[int, str, Any]] = {
    "magic": (0, "<H", lambda v: v ^ 1),
    "info_bits": (2, "<H", lambda v: v | 0x10),
    "no_contrecord": (2, "<H", lambda v: v & ~1),
    "overwrite_contrecord": (2, "<H", lambda v: v | 8),
    "long_flag": (2, "<H", lambda v: v ^ 2),
    "tli_lower": (4, "<I", lambda v: 0),
    "tli_higher": (4, "<I", lambda v: 2),
    "pageaddr": (8, "<Q", lambda v: v + 8192),
    "rem_len_plus": (16, "<I", lambda v: v + 1),
    "rem_len_minus": (16, "<I", lambda v: v - 1 if v else 5),
    "rem_len_zero": (16, "<I", lambda v: 0),
    "seg_size": (32, "<I", lambda v: v * 2),
    "blcksz": (36, "<I", lambda v: v // 2),
}


@settings(max_examples=300, deadline=None)
@given(
    specs=st.composite(_specs)(),
    change=st.sampled_from([None, *_HEADER_CHANGES, "byte"]),
    where=st.integers(0, 2**31),
    split=st.integers(0, 2**31),
    sizes=st.lists(st.sampled_from([100, 977, 8192, 20000, 131072]), min_size=1, max_size=3),
)
def test_crossing_record_equals_next_record(
    specs: list[dict[str, Any] | None], change: str | None, where: int, split: int, sizes: list[int]
) -> None:
    data, spans = _encode(specs)
    buf = bytearray(data)
    pages = [p for p in range((START | 8191) + 1, START + len(data), 8192) if p + 40 <= START + len(data)]
    # mostly a page a record crosses into and ends on (the pages crossing_record reads)
    into = [(e - 1) & ~8191 for s, e in spans if (s >> 13) + 1 == (e - 1) >> 13]
    if into and where & 3:
        pages = into
    if change == "byte":
        buf[where % len(buf)] ^= 1 + where % 255
    elif change is not None and pages:
        if change in ("seg_size", "blcksz"):
            pages = [p for p in pages if p % SEG == 0] or pages
        page = pages[where % len(pages)]
        off, fmt, how = _HEADER_CHANGES[change]
        o = page - START + off
        (value,) = struct.unpack_from(fmt, buf, o)
        struct.pack_into(fmt, buf, o, how(value) & ((1 << (8 * struct.calcsize(fmt))) - 1))
    data = bytes(buf)
    # the first chunk ends at any byte of a record crossing a page boundary (or anywhere)
    crossing = [(s, e) for s, e in spans if s >> 13 != (e - 1) >> 13]
    s, e = crossing[split % len(crossing)] if crossing else (START, START + len(data))
    first = s - START + split % max(1, e - s + 1)
    chunks = [first] if first else []
    rest = len(data) - first
    i = 0
    while rest > 0:
        n = min(rest, sizes[i % len(sizes)])
        chunks.append(n)
        rest -= n
        i += 1
    want, want_end = _by_next_record(data, chunks)
    got, got_end, _taken = _with_crossing(data, chunks)
    assert got == want
    assert got_end == want_end
    if change is None:
        assert [(lsn, end) for lsn, end, _raw in got] == spans


def test_every_single_crossing_is_taken() -> None:
    """Not vacuous: fed whole, every record that crosses exactly one page boundary and is no
    XLOG record comes from ``crossing_record``, among them records whose header the boundary
    splits and records crossing into a segment's first page (long header)."""
    specs: list[dict[str, Any] | None] = [
        {"rmid": 10, "info": 0, "xid": 7, "blocks": [BlockSpec(_REL, 1, data=bytes(80 + i * 5 % 97))],
         "main_data": b"\x01\x00\x00"}
        for i in range(900)
    ]
    data, spans = _encode(specs)
    got, end, taken = _with_crossing(data, [len(data)])
    assert [(lsn, e) for lsn, e, _raw in got] == spans
    assert end.truncated
    once = [(s, e) for s, e in spans if (s >> 13) + 1 == (e - 1) >> 13]
    assert taken == len(once) > 15
    assert any(8192 - (s & 8191) < 24 for s, _e in once)  # the header split by the boundary
    assert any(((e - 1) & ~8191) % SEG == 0 for _s, e in once)  # into a long header


def _filler(size: int) -> dict[str, Any]:
    """A heap record of exactly ``size`` bytes (``size`` >= 52)."""
    return {"rmid": 10, "info": 0, "xid": 7, "blocks": [BlockSpec(_REL, 1, data=bytes(size - 49))],
            "main_data": b"\x01\x00\x00"}


def _ending_at(
    offset: int, then: list[dict[str, Any] | None], page: int = 0
) -> tuple[bytes, list[tuple[int, int]]]:
    """Heap records up to page offset ``offset`` of the page ``page`` pages after the one
    after START's, then ``then``."""
    enc = WalEncoder(START, segment_size=SEG)
    target = (START | 8191) + 1 + page * 8192 + offset
    spans: list[tuple[int, int]] = []
    while True:
        left = target - enc.insert_lsn
        if enc.insert_lsn >> 13 == target >> 13 and 52 <= left <= 452:
            spans.append(enc.append(**_filler(left)))
            break
        assert left > 452
        spans.append(enc.append(**_filler(200)))
    spans += [enc.switch() if spec is None else enc.append(**spec) for spec in then]
    return enc.take(), spans


@pytest.mark.parametrize("offset", [8176, 8184])
@pytest.mark.parametrize(
    "case", ["switch", "short_len", "long_len", "ok", "no_contrecord", "rem_len_plus"]
)
def test_header_split_by_the_boundary(offset: int, case: str) -> None:
    """A record whose header the page boundary splits (8 or 16 bytes on the first page): an
    XLOG_SWITCH (its end moves to the segment's end), an ``xl_tot_len`` below a record header
    or above the maximum, a valid heap record, a next page header without the contrecord flag
    or with the wrong remaining length: ``crossing_record`` agrees with ``next_record``."""
    then: list[dict[str, Any] | None] = [None if case == "switch" else _filler(60), _filler(100)]
    data, spans = _ending_at(offset, then)
    at = spans[-2][0] - START
    assert spans[-2][0] & 8191 == offset
    buf = bytearray(data)
    if case == "short_len":  # (and the next page's xlp_rem_len to match it)
        struct.pack_into("<I", buf, at, 20)
        struct.pack_into("<I", buf, at + 8192 - offset + 16, 20 - (8192 - offset))
    elif case == "long_len":
        struct.pack_into("<I", buf, at, 0x3FFF_FFFF)
    elif case == "no_contrecord":
        buf[at + 8192 - offset + 2] &= ~1
    elif case == "rem_len_plus":
        buf[at + 8192 - offset + 16] += 1
    data = bytes(buf)
    want, want_end = _by_next_record(data, [len(data)])
    got, got_end, taken = _with_crossing(data, [len(data)])
    assert got == want
    assert got_end == want_end
    assert taken == (case == "ok")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("magic", "invalid magic number D111 in log segment 000000010000000000000003, offset 0"),
        ("info_bits", "invalid info bits 0017 in log segment 000000010000000000000003, offset 0"),
        ("long_flag", "invalid info bits 0005 in log segment 000000010000000000000003, offset 0"),
        ("pageaddr", "unexpected pageaddr 0/1A000 in log segment 000000010000000000000003, offset 0"),
        ("seg_size", "WAL file is from different database system: incorrect segment size in page header"),
    ],
)
def test_page_header_messages(change: str, reason: str) -> None:
    """The shared page header check (``page_fields_error``, its message formatted only on a
    failure) names the page as before: a record crossing into a segment's first page."""
    data, spans = _ending_at(8192 - 64, [_filler(300), _filler(100)], page=2)
    page = spans[-2][0] | 8191
    page += 1
    assert page % SEG == 0
    buf = bytearray(data)
    off, fmt, how = _HEADER_CHANGES[change]
    (value,) = struct.unpack_from(fmt, buf, page - START + off)
    struct.pack_into(fmt, buf, page - START + off, how(value))
    data = bytes(buf)
    got, got_end, taken = _with_crossing(data, [len(data)])
    assert (got, got_end) == _by_next_record(data, [len(data)])
    assert taken >= 1  # the records crossing the pages before it
    assert got_end.reason == reason
    assert got_end.error_lsn == page
