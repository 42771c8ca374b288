"""The fused ingest path (``WalIngest.ingest_decoder``) stores exactly what the batch path
(``decode_into`` + ``ingest_records``) stores, on synthetic WAL (no PostgreSQL).

Hypothesis writes WAL mixing the records the fused path takes from the bytes (heap INSERTs,
new-page INSERTs, btree inserts, HOT updates with one block and a short main data) with
everything that must leave it: records whose flags clear VM bits, an xid at or above nextXid,
a block past its fork's end (or a fork that does not exist), a main data too short to hold the
flags, two blocks, full-page images, XLOG records over several pages, Standby records; then
feeds it in any chunking, optionally corrupted (one byte changed anywhere, or one record
CRC-valid but with a stale ``xl_prev`` or trailing bytes), optionally with the
timeline already past some of it (the records that ends at or below ``last_record_lsn`` are
skipped). Both paths run on timelines seeded alike, with layers rolling and write buffers
filling inside batches; they must store the same values in the same order (key, LSN, bytes,
will_init, and the layer each went to), and end with the same ``last_record_lsn``, statistics,
relation sizes, checkpoint, ``last_record``, the same records taken per XLogData piece and the
same end of WAL (or the same error). tests/pageserver/test_walingest_fast.py does the same on
real PostgreSQL 15 WAL.
"""

from __future__ import annotations

import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from pageserver.pg_control import CheckPoint
from pageserver.storage.config import StorageConfig
from pageserver.storage.inmemory_layer import InMemoryLayer
from pageserver.storage.key import SLRU_CLOG, Key
from pageserver.storage.value import Image
from pageserver.tenant import Tenant
from pageserver.walingest import WalIngest
from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from protocol.wal import encoder as encoder_mod
from protocol.wal.encoder import BlockSpec, WalEncoder
from protocol.wal.reader import EndOfWal, WalStreamDecoder
from protocol.wal.record import DecodedRecord, RelFileNode, record_crc
from protocol.wal.rmgr import XLOG_FPI, XLOG_NOOP, RmgrId

SEG = 16 * 1024 * 1024
SPC, DB = 1663, 5
A = RelFileNode(SPC, DB, 16384)  # main fork of 3 blocks, VM fork of 1
B = RelFileNode(SPC, DB, 16385)  # main fork of 0 blocks
C = RelFileNode(SPC, DB, 16386)  # no fork at all
SEED_LSN = Lsn(0x100_0000)
WAL_START = 2 * SEG - 9000  # crosses a segment boundary (a long page header)
NEXT_XID = 1000
CONFIG = StorageConfig(
    checkpoint_distance=48 * 1024, write_buffer_size=4096, double_buffering=False,
    compaction_period_s=0, gc_period_s=0,
)

Put = tuple[bytes, int, bytes, bool, int]  # key, lsn, value, will_init, layer start


@contextmanager
def capture_puts() -> Iterator[list[Put]]:
    """Every value stored in an in-memory layer, in order, however it got there."""
    puts: list[Put] = []
    put, try_put = InMemoryLayer.put, InMemoryLayer.try_put

    async def put_(self: InMemoryLayer, key: Key, lsn: Lsn, blob: bytes, will_init: bool) -> None:
        await put(self, key, lsn, blob, will_init)
        puts.append((bytes(key), lsn, bytes(blob), will_init, self.start_lsn))

    def try_put_(self: InMemoryLayer, key: Key, lsn: Lsn, blob: bytes, will_init: bool, *a: Any) -> bool:
        ok = try_put(self, key, lsn, blob, will_init, *a)
        if ok:
            puts.append((bytes(key), lsn, bytes(blob), will_init, self.start_lsn))
        return ok

    def try_put_mixed_(self: InMemoryLayer, items: Any, start: int, sub: int, *a: Any) -> tuple[int, int]:
        i, v = try_put_mixed(self, items, start, sub, *a)
        # the values from (start, sub) up to (i, v): single values and runs of values
        for at in range(start, min(i + 1, len(items))):
            item = items[at]
            first = sub if at == start else 0
            if len(item) == 4:
                if at < i:
                    key, lsn, blob, will_init = item
                    puts.append((bytes(key), lsn, bytes(blob), will_init, self.start_lsn))
                continue
            if len(item) == 6:  # a packed run (the walk kernel's): value x at blob[at0 + x * vlen]
                key, ends, packed, at0, vlen, will_init = item
                for x in range(first, len(ends) if at < i else v):
                    value = bytes(packed[at0 + x * vlen : at0 + (x + 1) * vlen])
                    puts.append((bytes(key), ends[x], value, will_init, self.start_lsn))
                continue
            key, lsns, head, raws, will_init = item
            for x in range(first, len(raws) if at < i else v):
                puts.append((bytes(key), lsns[x], head + raws[x], will_init, self.start_lsn))
        return i, v

    try_put_mixed = InMemoryLayer.try_put_mixed
    with pytest.MonkeyPatch.context() as m:
        m.setattr(InMemoryLayer, "put", put_)
        m.setattr(InMemoryLayer, "try_put", try_put_)
        m.setattr(InMemoryLayer, "try_put_mixed", try_put_mixed_)
        yield puts


@attrs.frozen
class Run:
    puts: list[Put]
    per_piece: list[tuple[int, int]]  # records taken, end of the last, per piece fed
    end: object  # the EndOfWal (or the error) that stopped it, then finish()
    last_record_lsn: Lsn
    stats: object
    rel_sizes: dict[tuple[int, int, int, int], int]
    checkpoint: object
    last_record: object


def _checkpoint() -> CheckPoint:
    return CheckPoint(
        redo=SEED_LSN, this_timeline_id=1, prev_timeline_id=1, full_page_writes=True,
        next_xid=NEXT_XID, next_oid=16384, next_multi=1, next_multi_offset=0, oldest_xid=3,
        oldest_xid_db=1, oldest_multi=1, oldest_multi_db=1, time=0, oldest_commit_ts_xid=0,
        newest_commit_ts_xid=0, oldest_active_xid=0,
    )


async def ingest(
    wal: bytes, pieces: list[int], fused: bool, skip_to: Lsn | None, root: Path,
) -> Run:
    """Seed a timeline, then feed ``wal`` (from WAL_START) in ``pieces`` to one path."""
    tenant = Tenant(root, TenantId.generate(), CONFIG)
    try:
        tl = await tenant.create_timeline(TimelineId.generate())
        ing = WalIngest(tl)
        mod = ing.w.begin(SEED_LSN)
        mod.put_checkpoint(_checkpoint())
        await mod.put_dbdir_creation(SPC, DB)
        await mod.put_slru_segment_creation(SLRU_CLOG, 0, 1)
        await mod.put_slru_page(SLRU_CLOG, 0, 0, Image(bytes(8192)))
        await mod.put_rel_creation((SPC, DB, A.rel, 0), 3)
        await mod.put_rel_creation((SPC, DB, A.rel, 2), 1)
        for blk in range(3):
            await mod.put_rel_page((SPC, DB, A.rel, 0), blk, Image(bytes(8192)))
        await mod.put_rel_page((SPC, DB, A.rel, 2), 0, Image(bytes(8192)))
        await mod.put_rel_creation((SPC, DB, B.rel, 0), 0)
        await mod.commit()
        if skip_to is not None:
            tl.finish_write(skip_to)  # as if the timeline already had the WAL up to there
        with capture_puts() as puts:
            dec = WalStreamDecoder(WAL_START)
            per_piece: list[tuple[int, int]] = []
            end: object = None
            at = 0
            for size in pieces:
                piece = wal[at : at + size]
                dec.feed(piece)
                at += size
                try:
                    if fused:
                        n, end_lsn, stop = await ing.ingest_decoder(dec)
                        last = int(end_lsn)
                    else:
                        batch: list[DecodedRecord] = []
                        stop = dec.decode_into(batch)
                        n, last = len(batch), int(batch[-1].end_lsn) if batch else 0
                        if batch:
                            await ing.ingest_records(batch)
                except RemoteProtocolError as exc:
                    end = ("error", type(exc), exc.sqlstate, str(exc))
                    break
                per_piece.append((n, last))
                if isinstance(stop, EndOfWal):
                    end = stop
                    break
            if end is None:
                end = dec.finish()
        return Run(
            list(puts), per_piece, end, tl.last_record_lsn, attrs.evolve(ing.stats),
            dict(ing.w.rel_sizes), ing.w.checkpoint, ing.last_record,
        )
    finally:
        await tenant.shutdown()


def both(wal: bytes, pieces: list[int], skip_to: Lsn | None = None) -> tuple[Run, Run]:
    """The batch and the fused path's runs (the callers compare them)."""
    with tempfile.TemporaryDirectory() as d:
        batch = trio.run(ingest, wal, pieces, False, skip_to, Path(d) / "batch")
        fused = trio.run(ingest, wal, pieces, True, skip_to, Path(d) / "fused")
    return batch, fused


# -- the WAL ------------------------------------------------------------------------------------

xids = st.sampled_from([0, 0, 7, 500, NEXT_XID - 1, NEXT_XID - 1, NEXT_XID, NEXT_XID + 3000, 2**32 - 5])


def _tuple(size: int) -> bytes:
    return struct.pack("<HHB", 1, 0x0800, 24) + bytes(range(size % 200)) + bytes(max(0, size - 200))


@st.composite
def hot_records(draw: st.DrawFn) -> dict[str, Any]:
    """Records of the fused path's layouts (one block, block id 0, short main data), with
    every test it makes answered both ways now and then."""
    kind = draw(st.sampled_from(["insert", "insert", "insert", "newpage", "btree", "hot_update", "heap2"]))
    rnode = draw(st.sampled_from([A, A, A, A, B, C]))
    blkno = draw(st.sampled_from([0, 1, 2, 2, 3, 4]))
    xid = draw(xids)
    data = _tuple(draw(st.sampled_from([60, 100, 100, 100, 300])))
    if kind in ("insert", "newpage"):
        flags = draw(st.sampled_from([0, 0, 0, 0x01, 0x02]))  # 0x01: ALL_VISIBLE_CLEARED
        main = struct.pack("<HB", 3, flags)
        if draw(st.integers(0, 20)) == 0:
            main = main[:2]  # too short to hold the flags: conservative, general path
        init = kind == "newpage"
        return {"rmid": RmgrId.HEAP, "info": 0x80 if init else 0x00, "xid": xid,
                "blocks": [BlockSpec(rnode, blkno, data=data, will_init=init)], "main_data": main}
    if kind == "btree":
        return {"rmid": RmgrId.BTREE, "info": 0x00, "xid": 0,
                "blocks": [BlockSpec(rnode, blkno, data=data[:20])], "main_data": b"\x05\x00"}
    if kind == "hot_update":
        flags = draw(st.sampled_from([0, 0, 0x01, 0x02, 0x04]))
        main = struct.pack("<IHBBIH", xid, 2, 0, flags, 0, 3)[:draw(st.sampled_from([14, 14, 6]))]
        return {"rmid": RmgrId.HEAP, "info": 0x40, "xid": xid,
                "blocks": [BlockSpec(rnode, blkno, data=data)], "main_data": main}
    flags = draw(st.sampled_from([0, 0x01]))  # HEAP2 MULTI_INSERT: flags at 0
    return {"rmid": RmgrId.HEAP2, "info": 0x50, "xid": xid,
            "blocks": [BlockSpec(rnode, blkno, data=data)], "main_data": bytes([flags, 0, 1, 0, 1, 0])}


@st.composite
def other_records(draw: st.DrawFn) -> dict[str, Any]:
    """Records that leave the fused path by their layout or resource manager."""
    kind = draw(st.sampled_from(["two_blocks", "fpi", "noop", "standby", "image_insert"]))
    if kind == "two_blocks":
        return {"rmid": RmgrId.HEAP, "info": 0x20, "xid": draw(xids),
                "blocks": [BlockSpec(A, 1, data=_tuple(80)), BlockSpec(A, 0)],
                "main_data": struct.pack("<IHBBIH", 9, 2, 0, 0, 0, 3)}
    if kind == "fpi":
        blkno = draw(st.integers(0, 4))
        return {"rmid": RmgrId.XLOG, "info": XLOG_FPI, "xid": 0, "main_data": b"",
                "blocks": lambda: [BlockSpec(A, blkno, image=bytes(range(256)) * 32)]}
    if kind == "image_insert":
        return {"rmid": RmgrId.HEAP, "info": 0x00, "xid": 5, "main_data": b"\x01\x00\x00",
                "blocks": lambda: [BlockSpec(A, 0, data=_tuple(40), image=bytes(8192))]}
    if kind == "noop":
        size = draw(st.sampled_from([0, 30, 5000, 20000]))
        return {"rmid": RmgrId.XLOG, "info": XLOG_NOOP, "xid": 0, "blocks": [], "main_data": bytes(size)}
    return {"rmid": RmgrId.STANDBY, "info": 0x10, "xid": 0, "blocks": [],
            "main_data": bytes(draw(st.integers(0, 300)))}


_BUILD = encoder_mod.build_record


def _padded(**kw: Any) -> bytes:
    raw = bytearray(_BUILD(**kw) + bytes(8))
    struct.pack_into("<I", raw, 0, len(raw))
    struct.pack_into("<I", raw, 20, record_crc(bytes(raw)))
    return bytes(raw)


def encode(
    specs: list[dict[str, Any]], hostile: tuple[str, int] | None = None
) -> tuple[bytes, list[tuple[Lsn, Lsn]]]:
    """The WAL of ``specs``; ``hostile`` makes one record CRC-valid but wrong, as a writer
    that is not PostgreSQL or an old record in a recycled segment would: ``stale_prev``
    (``xl_prev`` not the record before: where PostgreSQL's WAL ends) or ``trailing``
    (8 bytes after the main data, ``xl_tot_len`` and CRC to match: undecodable)."""
    enc = WalEncoder(WAL_START)
    spans = []
    kind, at = hostile if hostile is not None else ("", -1)
    at %= len(specs)
    for i, spec in enumerate(specs):
        blocks = spec["blocks"]
        # (full-page images are built here: a failing example's repr stays readable)
        spec = {**spec, "blocks": blocks() if callable(blocks) else blocks}
        with pytest.MonkeyPatch.context() as m:
            if i == at and kind == "stale_prev":
                enc._prev ^= 0x10
            elif i == at and kind == "trailing":
                m.setattr(encoder_mod, "build_record", _padded)
            spans.append(enc.append(**spec))
    return enc.take(), spans


def chunking(total: int, sizes: list[int]) -> list[int]:
    out: list[int] = []
    at = i = 0
    while at < total:
        out.append(sizes[i % len(sizes)])
        at += out[-1]
        i += 1
    return out


def assert_same(batch: Run, fused: Run) -> None:
    assert fused.puts == batch.puts
    assert fused.per_piece == batch.per_piece
    assert fused.end == batch.end
    assert fused.last_record_lsn == batch.last_record_lsn
    assert fused.stats == batch.stats
    assert fused.rel_sizes == batch.rel_sizes
    assert fused.checkpoint == batch.checkpoint
    assert fused.last_record == batch.last_record


@st.composite
def wal_specs(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Runs of one record repeated (a bulk load fills a page with INSERTs into one block: the
    fused path's shortcut for a record like the one before) among single records."""
    specs: list[dict[str, Any]] = []
    for spec, times in draw(st.lists(st.tuples(
        st.one_of(hot_records(), hot_records(), hot_records(), other_records()),
        st.sampled_from([1, 1, 1, 2, 5, 40, 120]),
    ), min_size=1, max_size=40)):
        specs.extend([spec] * times)
    return specs


@settings(max_examples=100, deadline=None)
@given(
    specs=wal_specs(),
    sizes=st.lists(st.sampled_from([1, 61, 977, 8192, 20000, 131072]), min_size=1, max_size=4),
    corrupt=st.none() | st.none() | st.tuples(st.integers(0, 2**31), st.integers(1, 255)),
    hostile=st.none() | st.tuples(st.sampled_from(["stale_prev", "trailing"]), st.integers(1, 2**31)),
    skip=st.none() | st.none() | st.integers(0, 2**31),
)
def test_fused_path_stores_what_the_batch_path_stores(
    specs: list[dict[str, Any]],
    sizes: list[int],
    corrupt: tuple[int, int] | None,
    hostile: tuple[str, int] | None,
    skip: int | None,
) -> None:
    wal, spans = encode(specs, hostile)
    if corrupt is not None:
        where, flip = corrupt
        buf = bytearray(wal)
        buf[where % len(buf)] ^= flip
        wal = bytes(buf)
    skip_to = None if skip is None else Lsn(spans[skip % len(spans)][1])
    batch, fused = both(wal, chunking(len(wal), sizes), skip_to)
    assert_same(batch, fused)


def _bulk_load(n: int, *, every: int = 50) -> list[dict[str, Any]]:
    """A bulk load into A from its end: INSERTs, a new-page INSERT every ``every``."""
    specs = []
    for i in range(n):
        blkno = 3 + i // every
        init = i % every == 0
        specs.append({"rmid": RmgrId.HEAP, "info": 0x80 if init else 0x00, "xid": 900,
                      "blocks": [BlockSpec(A, blkno, data=_tuple(100), will_init=init)],
                      "main_data": struct.pack("<HB", 1 + i % every, 0)})
    return specs


def test_fused_path_takes_the_bulk_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison is not vacuous: on a bulk load all but the records that cross a page
    go through the fused path (not through ``ingest_records``), and it stores the same."""
    wal, spans = encode(_bulk_load(3000))
    general: list[int] = []
    real = WalIngest.ingest_records

    async def counting(self: WalIngest, recs: list[DecodedRecord]) -> None:
        general.append(len(recs))
        await real(self, recs)

    batch, _ = both(wal, chunking(len(wal), [131072]))
    monkeypatch.setattr(WalIngest, "ingest_records", counting)
    with tempfile.TemporaryDirectory() as d:
        fused = trio.run(ingest, wal, chunking(len(wal), [131072]), True, None, Path(d))
    assert_same(batch, fused)
    assert fused.last_record_lsn == spans[-1][1]
    assert len(batch.puts) == 3000 + 3000 // 50  # the records and the new sizes
    pages = len(wal) // 8192
    assert sum(general) <= pages + 2  # about one record per page: the one crossing into it



@pytest.mark.parametrize("kind", ["stale_prev", "trailing"])
def test_hostile_record_inside_a_bulk_load(kind: str) -> None:
    """A CRC-valid record that is wrong in a way only its ``xl_prev`` or its length shows,
    right after records of the same layout and block (the fused path's shortcut): both paths
    stop at it, with the same end of WAL, having stored the same records before it."""
    specs = _bulk_load(200, every=1000)
    wal, spans = encode(specs, (kind, 120))
    batch, fused = both(wal, chunking(len(wal), [131072]))
    assert_same(batch, fused)
    assert isinstance(batch.end, EndOfWal)
    assert batch.end.lsn == spans[119][1]  # valid WAL ends before the hostile record
    assert batch.last_record_lsn == spans[119][1]
