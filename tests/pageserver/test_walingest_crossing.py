"""The fused path's record crossing into the next page (``WalStreamDecoder.crossing_record``
-> ``WalIngest._fused_crossing``, then the next page's records in the same loop) stores exactly
what the batch path (``decode_into`` + ``ingest_records``) stores.

- A bulk load (and HOT updates, other resource managers, records at nextXid or with a VM bit
  crossing a page) with the page header after any page corrupted in every way the decoder
  checks, any chunking (a piece boundary anywhere inside a crossing record), a timeline already
  past part of it: the same puts in the same order, ``last_record_lsn``, statistics, sizes and
  end of WAL (tests/pageserver/test_walingest_fused.py's harness).
- Not vacuous: on a bulk load fed in one piece every record crossing a page is taken by
  ``take_crossing`` and ``next_record`` is called only for the records a page header precedes.
"""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from pageserver.walingest import WalIngest
from protocol.lsn import Lsn
from protocol.wal.encoder import BlockSpec
from protocol.wal.reader import WalStreamDecoder
from protocol.wal.record import record_crc
from protocol.wal.rmgr import RmgrId
from tests.pageserver import test_walingest_fused as fz
from tests.protocol.test_wal_crossing import _HEADER_CHANGES


def _odd(spec: dict[str, Any], kind: str) -> dict[str, Any]:
    """One record of the bulk load made to leave the fused path (or to stay on it)."""
    block = spec["blocks"][0]
    if kind == "vm":
        return {**spec, "main_data": spec["main_data"][:2] + b"\x01"}
    if kind == "xid_at_next":
        return {**spec, "xid": fz.NEXT_XID}
    if kind == "btree":
        return {**spec, "rmid": RmgrId.BTREE}
    if kind == "standby":  # resource managers the fused path does not take
        return {**spec, "rmid": RmgrId.STANDBY}
    if kind == "clog":  # CLOG ZEROPAGE (of page 0) with a block: the general path's own values
        return {**spec, "rmid": RmgrId.CLOG, "info": 0x00, "main_data": struct.pack("<i", 0)}
    if kind == "hot_update":
        return {"rmid": RmgrId.HEAP, "info": 0x40, "xid": 900, "blocks": [BlockSpec(fz.A, 0, data=fz._tuple(100))],
                "main_data": struct.pack("<IHBBIH", 900, 2, 0, 0, 0, 3)}
    if kind == "past_end":
        return {**spec, "blocks": [BlockSpec(block.rnode, block.blkno + 5, data=block.data)]}
    if kind == "long":
        return {**spec, "blocks": [BlockSpec(block.rnode, block.blkno, data=fz._tuple(9000), will_init=block.will_init)]}
    return spec


_AT_CROSSING = ["vm", "xid_at_next", "btree", "standby", "clog", "past_end", "stale_prev", "byte", "byte", "no_data_flag"]


def _record_at(wal: bytes, lsn: int, tot_len: int) -> list[int]:
    """Where each byte of the record at ``lsn`` is in ``wal`` (its pieces around page headers)."""
    out = []
    at = lsn
    for _ in range(tot_len):
        if at & 8191 == 0:
            at += 40 if at % fz.SEG == 0 else 24
        out.append(at - fz.WAL_START)
        at += 1
    return out


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(60, 400),
    change=st.sampled_from([None, *_HEADER_CHANGES, "byte"]),
    where=st.integers(0, 2**31),
    odd=st.lists(st.tuples(st.integers(0, 2**31), st.sampled_from(["vm", "xid_at_next", "btree", "hot_update", "past_end", "long"])), max_size=3),
    at_crossing=st.lists(st.tuples(st.integers(0, 2**31), st.sampled_from(_AT_CROSSING), st.sampled_from([0, 0, -1])), max_size=3),
    split=st.integers(0, 2**31),
    sizes=st.lists(st.sampled_from([977, 8192, 20000, 131072]), min_size=1, max_size=3),
    skip=st.none() | st.none() | st.integers(0, 2**31),
)
def test_crossing_records_store_what_the_batch_path_stores(
    n: int,
    change: str | None,
    where: int,
    odd: list[tuple[int, str]],
    at_crossing: list[tuple[int, str, int]],
    split: int,
    sizes: list[int],
    skip: int | None,
) -> None:
    """Also: a record crossing a page, or the one before it (so that it waits for the general
    path), made to leave the fused path, a CRC-valid stale ``xl_prev`` or a flipped byte on a
    crossing record; the first piece ending anywhere in a crossing record, or just after it."""
    specs = fz._bulk_load(n, every=40)
    _wal, plain = fz.encode(specs)
    crossing_at = [i for i, (s, e) in enumerate(plain) if s >> 13 != (e - 1) >> 13]
    hostile = None
    flips = []
    for pick, kind, delta in at_crossing:
        i = max(0, crossing_at[pick % len(crossing_at)] + delta)
        if kind == "stale_prev":
            hostile = ("stale_prev", i)
        elif kind in ("byte", "no_data_flag"):
            flips.append((i, pick if kind == "byte" else -1))
        else:
            specs[i] = _odd(specs[i], kind)
    for at, kind in odd:
        specs[at % n] = _odd(specs[at % n], kind)
    wal, spans = fz.encode(specs, hostile)
    buf = bytearray(wal)
    for i, pick in flips:
        s, e = spans[i]
        if pick >= 0:
            buf[s - fz.WAL_START + pick % (e - s)] ^= 1 + pick % 255
            continue
        # block 0 keeps its data but loses BKPBLOCK_HAS_DATA, CRC made right: undecodable
        where_ = _record_at(wal, s, struct.unpack_from("<I", wal, s - fz.WAL_START)[0])
        raw = bytearray(buf[j] for j in where_)
        raw[25] &= ~0x20
        struct.pack_into("<I", raw, 20, record_crc(bytes(raw)))
        for j, b in zip(where_, raw, strict=True):
            buf[j] = b
    end = fz.WAL_START + len(wal)
    pages = [p for p in range((fz.WAL_START | 8191) + 1, end, 8192) if p + 40 <= end]
    if change == "byte":
        buf[where % len(buf)] ^= 1 + where % 255
    elif change is not None and pages:
        if change in ("seg_size", "blcksz"):
            pages = [p for p in pages if p % fz.SEG == 0] or pages
        page = pages[where % len(pages)]
        off, fmt, how = _HEADER_CHANGES[change]
        o = page - fz.WAL_START + off
        (value,) = struct.unpack_from(fmt, buf, o)
        struct.pack_into(fmt, buf, o, how(value) & ((1 << (8 * struct.calcsize(fmt))) - 1))
    wal = bytes(buf)
    crossing = [(s, e) for s, e in spans if s >> 13 != (e - 1) >> 13]
    # (odd records may end exactly at the page ends: then no record crosses)
    s, e = crossing[split % len(crossing)] if crossing else (Lsn(fz.WAL_START), Lsn(fz.WAL_START))
    first = s - fz.WAL_START + (e - s if split & 1 else split % (e - s + 1))
    if split & 6 == 6 and crossing:  # the WAL ends with that crossing record
        wal = wal[: e - fz.WAL_START]
        first = min(first, len(wal))
    pieces = ([first] if first else []) + fz.chunking(len(wal) - first, sizes)
    skip_to = None if skip is None else Lsn(spans[skip % len(spans)][1])
    batch, fused = fz.both(wal, pieces, skip_to)
    fz.assert_same(batch, fused)


def test_every_crossing_record_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    wal, spans = fz.encode(fz._bulk_load(3000))
    taken: list[int] = []
    reads: list[int] = []
    real_take, real_next = WalStreamDecoder.take_crossing, WalStreamDecoder.next_record

    def take(self: WalStreamDecoder) -> None:
        taken.append(self._pos)
        real_take(self)

    def next_record(self: WalStreamDecoder) -> Any:
        reads.append(self._pos)
        return real_next(self)

    batch, _ = fz.both(wal, [len(wal)])
    monkeypatch.setattr(WalStreamDecoder, "take_crossing", take)
    monkeypatch.setattr(WalStreamDecoder, "next_record", next_record)
    with tempfile.TemporaryDirectory() as d:
        fused = trio.run(fz.ingest, wal, [len(wal)], True, None, Path(d))
    fz.assert_same(batch, fused)
    crossing = [s for s, e in spans if s >> 13 != (e - 1) >> 13]
    after_header = [s for s, _e in spans if s & 8191 in (24, 40)]
    # each crossing record is taken by a fused path: the walk kernel (which crosses pages
    # itself) or take_crossing, never read by next_record
    assert set(taken) <= set(crossing)
    assert not set(crossing) & set(reads)
    assert len(crossing) > 50
    # the records a page header precedes, the start, the end of the input
    assert len(reads) <= len(after_header) + 2


def test_fused_crossing_checks_the_record() -> None:
    """``_fused_crossing`` refuses a record whose ``xl_prev`` is not the record before (the
    in-page loop never hands it one when it stops on the link, but does when the record starts
    in the page's last bytes), a bad CRC, block data without its flag (CRC right), and takes
    the record as it is."""
    wal, _spans = fz.encode(fz._bulk_load(200))
    dec = WalStreamDecoder(fz.WAL_START)
    dec.feed(wal)
    cross = None
    while cross is None:
        assert dec.next_record() is not None
        cross = dec.crossing_record()
    raw, lsn, end, prev = cross

    class Writer:
        def __init__(self) -> None:
            self.checkpoint = fz._checkpoint()
            self.rel_sizes = {(fz.SPC, fz.DB, fz.A.rel, 0): 100}

    ing = object.__new__(WalIngest)
    ing.w = Writer()  # type: ignore[assignment]
    items: list[object] = []
    assert not ing._fused_crossing(raw, lsn, end, prev ^ 0x10, 0, items.append)
    bad_crc = bytearray(raw)
    bad_crc[60] ^= 4
    assert not ing._fused_crossing(bytes(bad_crc), lsn, end, prev, 0, items.append)
    no_flag = bytearray(raw)
    no_flag[25] &= ~0x20  # block data without BKPBLOCK_HAS_DATA (CRC right): undecodable
    struct.pack_into("<I", no_flag, 20, record_crc(bytes(no_flag)))
    assert not ing._fused_crossing(bytes(no_flag), lsn, end, prev, 0, items.append)
    assert not items
    assert ing._fused_crossing(raw, lsn, end, prev, 0, items.append)
    assert len(items) == 1
