"""``TimelineWalIngest`` over W's fake safekeepers (no PostgreSQL): streams cut at random
points, a crash that loses the unflushed in-memory layer, a resume from
``disk_consistent_lsn``; the result equals ingesting the same records directly."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import trio
import trio.testing

from pageserver.pgdatadir import Datadir, RelTag
from pageserver.storage.config import StorageConfig
from pageserver.storage.key import SLRU_CLOG, rel_block_key
from pageserver.storage.value import Image
from pageserver.tenant import Tenant
from pageserver.timeline import Timeline
from pageserver.wal_receiver import WalReceiverConfig
from pageserver.walingest import TimelineWalIngest, WalIngest
from pageserver.walredo.manager import PostgresRedoManager
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from protocol.wal.encoder import BlockSpec, WalEncoder
from protocol.wal.reader import WalStreamDecoder
from protocol.wal.record import DecodedRecord
from protocol.wal.rmgr import RmgrId
from tests.pageserver.test_wal_receiver import START, FakeSafekeeper, connector
from tests.pageserver.test_walingest import DB, HEAP, SPC, _seed


async def _seed_at(tl: Timeline) -> WalIngest:
    """Seed exactly at the fake safekeepers' WAL start, so streaming begins there."""
    return await _seed(tl, START)


CONFIG = StorageConfig(double_buffering=False, validate_get=True)
HEAP2 = type(HEAP)(SPC, DB, 16390)


def make_wal(seed: int) -> bytes:
    """Two tables filled by small transactions, each committed; ~60 heap pages."""
    rng = random.Random(seed)
    enc = WalEncoder(START, prev_lsn=START - 100)
    for rel in (HEAP, HEAP2):
        enc.append(RmgrId.SMGR, 0x10, main_data=struct.pack("<IIIi", rel.spc, rel.db, rel.rel, 0))
    fill = {HEAP: [0, 0], HEAP2: [0, 0]}  # rel -> [blkno, items on it]
    xid = 1001
    for _ in range(400):
        for _ in range(rng.randint(1, 4)):
            rel = rng.choice([HEAP, HEAP2])
            blk, items = fill[rel]
            if items == 20:
                blk, items = blk + 1, 0
            payload = rng.randbytes(rng.randint(8, 300))
            data = struct.pack("<HHB", 1, 0x0800, 24) + b"\x00" + payload
            init = items == 0
            enc.append(
                RmgrId.HEAP, 0x80 if init else 0x00, xid=xid,
                blocks=[BlockSpec(rel, blk, data=data, will_init=init)],
                main_data=struct.pack("<HB", items + 1, 0),
            )
            fill[rel] = [blk, items + 1]
        enc.append(RmgrId.XACT, 0x00, xid=xid, main_data=struct.pack("<q", xid))
        xid += 1
    return enc.take()


async def _snapshot(tl: Timeline) -> dict[str, bytes]:
    dd = Datadir(tl)
    lsn = tl.last_record_lsn
    out: dict[str, bytes] = {"clog": await dd.get_slru_page(SLRU_CLOG, 0, 0, lsn)}
    out["checkpoint"] = (await dd.get_checkpoint(lsn)).encode()
    for rel in (HEAP, HEAP2):
        tag = RelTag(rel.spc, rel.db, rel.rel, 0)
        n = await dd.get_rel_size(tag, lsn)
        out[f"{rel} size"] = n.to_bytes(4, "little")
        for b, page in enumerate(await dd.get_pages(tag, list(range(n)), lsn)):
            out[f"{rel} {b}"] = page
    return out


async def _stream_until(tl: Timeline, ing: TimelineWalIngest, target: Lsn, nursery: trio.Nursery) -> trio.CancelScope:
    scope = trio.CancelScope()

    async def run() -> None:
        with scope:
            await ing.run()

    nursery.start_soon(run)
    with trio.fail_after(60):
        await tl.wait_lsn(target, timeout_s=60)
    return scope


async def test_stream_crash_resume_equals_direct_ingest(tmp_path: Path) -> None:
    wal = make_wal(7)
    dec = WalStreamDecoder(START)
    dec.feed(wal)
    records = list(dec.records())
    end = records[-1].end_lsn
    middle = records[len(records) // 2].end_lsn
    redo = PostgresRedoManager()

    # the reference: the same records handed to the ingest directly
    ref_tenant = Tenant(tmp_path / "ref", TenantId.generate(), CONFIG, redo=redo)
    ref = await ref_tenant.create_timeline(TimelineId.generate())
    ref_ing = await _seed_at(ref)
    assert ref.last_record_lsn == START
    for rec in records:
        assert await ref_ing.ingest_record(rec)
    want = await _snapshot(ref)
    assert len(want) > 50

    rng = random.Random(3)
    sks = {1: FakeSafekeeper(wal, rng, cut=30_000), 2: FakeSafekeeper(wal, rng, cut=70_000)}
    cfg = WalReceiverConfig(safekeepers=(("sk", 1), ("sk", 2)), min_backoff_s=0.001, max_backoff_s=0.01)
    tid, tl_id = TenantId.generate(), TimelineId.generate()
    async with trio.open_nursery() as nursery:
        tenant = Tenant(tmp_path / "t", tid, CONFIG, redo=redo)
        tl = await tenant.create_timeline(tl_id)
        await _seed_at(tl)
        await tl.flush()
        ing = TimelineWalIngest(tl, cfg, connect=connector(sks))
        scope = await _stream_until(tl, ing, middle, nursery)
        flushed = await ing.flush()
        assert flushed >= middle
        # more WAL into the in-memory layer only, then the crash loses it
        sks[1].cut = sks[2].cut = None
        with trio.fail_after(60):
            await tl.wait_lsn(end, timeout_s=60)
        scope.cancel()
        assert ing.receiver is not None and ing.receiver.sessions > 1  # the cuts made it reconnect
        await tenant.shutdown()

        tenant = await Tenant.load(tmp_path / "t", tid, CONFIG, redo=redo)
        tl = tenant.timelines[tl_id]
        assert tl.last_record_lsn == flushed < end
        ing2 = TimelineWalIngest(tl, cfg, connect=connector(sks))
        scope = await _stream_until(tl, ing2, end, nursery)
        scope.cancel()
        # the second stream restarted exactly at disk_consistent_lsn: nothing skipped or repeated
        assert sks[1].starts[-1] == flushed or sks[2].starts[-1] == flushed
        assert ing2.ingest.stats.skipped == 0
        assert ing2.ingest.stats.records == sum(1 for r in records if r.end_lsn > flushed)
        assert tl.last_record_lsn == end
        got = await _snapshot(tl)
        assert got == want
        await tenant.shutdown()
    await ref_tenant.shutdown()


async def test_overlapping_stream_is_skipped(tmp_path: Path) -> None:
    wal = make_wal(11)
    dec = WalStreamDecoder(START)
    dec.feed(wal)
    records = list(dec.records())
    tenant = Tenant(tmp_path, TenantId.generate(), CONFIG, redo=PostgresRedoManager())
    tl = await tenant.create_timeline(TimelineId.generate())
    ing = await _seed_at(tl)
    for rec in records[:50]:
        await ing.ingest_record(rec)
    # a stream that starts earlier than what the timeline has: the first 50 are skipped
    applied = [await ing.ingest_record(rec) for rec in records]
    assert applied == [False] * 50 + [True] * (len(records) - 50)
    assert ing.stats.skipped == 50
    assert tl.last_record_lsn == records[-1].end_lsn
    await tenant.shutdown()


class _BlockingIngest(WalIngest):
    """Stops inside ``ingest_record`` until released, to catch a flush in between."""

    def __init__(self, tl: Timeline) -> None:
        super().__init__(tl)
        self.release = trio.Event()
        self.inside = trio.Event()
        self.events: list[str] = []

    async def ingest_record(self, rec: DecodedRecord) -> bool:
        self.events.append("record start")
        self.inside.set()
        await self.release.wait()
        self.events.append("record end")
        return True


async def test_flush_waits_for_the_record_in_progress(tmp_path: Path) -> None:
    tenant = Tenant(tmp_path, TenantId.generate(), CONFIG)
    tl = await tenant.create_timeline(TimelineId.generate())
    blocking = _BlockingIngest(tl)
    ing = TimelineWalIngest(tl, WalReceiverConfig(safekeepers=(("sk", 1),)), ingest=blocking)
    orig_flush = tl.flush
    flush_release = trio.Event()

    async def flush() -> None:
        blocking.events.append("flush start")
        await flush_release.wait()
        await orig_flush()
        blocking.events.append("flush end")

    tl.flush = flush  # type: ignore[method-assign]
    rec = WalStreamDecoder(START)
    rec.feed(make_wal(1))
    first, second = next(rec.records()), next(rec.records())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ing._on_record, first)
        await blocking.inside.wait()
        nursery.start_soon(ing.flush)
        await trio.testing.wait_all_tasks_blocked()
        assert blocking.events == ["record start"]  # the flush waits for the record
        blocking.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert blocking.events == ["record start", "record end", "flush start"]
        nursery.start_soon(ing._on_record, second)
        await trio.testing.wait_all_tasks_blocked()
        assert blocking.events[-1] == "flush start"  # the next record waits for the flush
        flush_release.set()
    assert blocking.events == [
        "record start", "record end", "flush start", "flush end", "record start", "record end"
    ]
    await tenant.shutdown()


class _HalfwayIngest(WalIngest):
    """Puts the first of a record's two values, stops until released, then the second."""

    def __init__(self, tl: Timeline) -> None:
        super().__init__(tl)
        self.release = trio.Event()
        self.inside = trio.Event()
        self.started: list[Lsn] = []

    async def ingest_record(self, rec: DecodedRecord) -> bool:
        end = rec.end_lsn
        self.started.append(end)
        await self.tl.put(rel_block_key(SPC, DB, HEAP.rel, 0, 0), end, Image(b"first half"))
        self.inside.set()
        await self.release.wait()
        await self.tl.put(rel_block_key(SPC, DB, HEAP.rel, 0, 1), end, Image(b"second half"))
        self.tl.finish_write(end)
        return True


async def test_pause_stops_the_ingest_between_two_records(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Shutdown pauses each ingest before cancelling it: cancelled mid-record, the record would
    be partly put and the final flush could not make anything durable."""
    tenant = Tenant(tmp_path, TenantId.generate(), CONFIG)
    tl = await tenant.create_timeline(TimelineId.generate())
    halfway = _HalfwayIngest(tl)
    ing = TimelineWalIngest(tl, WalReceiverConfig(safekeepers=(("sk", 1),)), ingest=halfway)
    rec = WalStreamDecoder(START)
    rec.feed(make_wal(1))
    first, second = next(rec.records()), next(rec.records())
    paused = trio.Event()

    async def pause() -> None:
        await ing.pause()
        paused.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ing._on_record, first)
        await halfway.inside.wait()
        nursery.start_soon(pause)
        await trio.testing.wait_all_tasks_blocked()
        assert not paused.is_set()  # the record in progress is finished first
        halfway.release.set()
        await paused.wait()
        nursery.start_soon(ing._on_record, second)
        await trio.testing.wait_all_tasks_blocked()
        assert halfway.started == [first.end_lsn]  # held back
        nursery.cancel_scope.cancel()  # what shutdown does next
    with trio.fail_after(1):
        await tl.flush()
    assert tl.disk_consistent_lsn == first.end_lsn
    await tenant.shutdown()
