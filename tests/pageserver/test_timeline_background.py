"""Background jobs (``Tenant.run_background_jobs``: flush of old layers, compaction, GC) against
the tenant's other work: timelines being created (and discarded on failure), branches created
while GC runs, and timelines appearing while a GC round iterates."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing

from pageserver.storage.config import StorageConfig
from pageserver.storage.key import Key, rel_block_key
from pageserver.storage.value import Image
from pageserver.tenant import Tenant
from pageserver.timeline import Timeline
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn


def k(i: int) -> Key:
    return rel_block_key(1663, 5, 1000, 0, i)


async def _write(tl: Timeline, lsn: int, key: Key, data: bytes) -> None:
    await tl.put(key, Lsn(lsn), Image(data))
    tl.finish_write(Lsn(lsn))


async def test_background_jobs_leave_a_timeline_being_created_alone(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A timeline being bootstrapped or imported (uninit marker) belongs to its creator: a
    failed creation shuts it down and removes its directory while a background flush or
    compaction of it would still be writing there. The jobs take it up once it is complete."""
    cfg = StorageConfig(validate_get=True, double_buffering=False, checkpoint_timeout_s=60,
                        compaction_period_s=20, gc_period_s=20, gc_horizon=0, pitr_interval_s=0)
    tenant = Tenant(tmp_path, TenantId.generate(), cfg)
    tid = TimelineId.generate()
    tenant.timelines_dir.mkdir(parents=True)
    await tenant.mark_uninit(tid)
    tl = await tenant.create_timeline(tid)
    await tl.put(k(0), Lsn(0x10), Image(b"a"))
    tl.finish_write(Lsn(0x10))
    assert tl.open_layer is not None
    tl.open_layer.opened_at -= 3600  # time.monotonic's clock, not trio's: backdate it
    async with trio.open_nursery() as nursery:
        await nursery.start(tenant.run_background_jobs)
        await trio.sleep(45)
        assert tl.in_memory_layers() and tl.disk_consistent_lsn == 0, "flushed while uninit"
        await tenant.clear_uninit(tid)
        await trio.sleep(21)
        assert not tl.in_memory_layers() and tl.disk_consistent_lsn == 0x10
        nursery.cancel_scope.cancel()
    assert tenant.background_failures == 0
    await tenant.shutdown()


async def test_gc_round_survives_a_timeline_created_meanwhile(tmp_path: Path) -> None:
    cfg = StorageConfig(validate_get=True, double_buffering=False, gc_horizon=0, pitr_interval_s=0)
    tenant = Tenant(tmp_path, TenantId.generate(), cfg)
    for _ in range(8):
        tl = await tenant.create_timeline(TimelineId.generate())
        await _write(tl, 0x10, k(0), b"a")
        await tl.flush()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tenant.gc)  # awaits inside each timeline's GC
        nursery.start_soon(tenant.create_timeline, TimelineId.generate())
    assert len(tenant.timelines) == 9
    await tenant.shutdown()


async def _branch(tenant: Tenant, tid: TimelineId, main: Timeline, refused: list[ValueError]) -> None:
    try:
        await tenant.create_timeline(tid, ancestor=main, ancestor_lsn=Lsn(0x10))
    except ValueError as exc:
        refused.append(exc)


async def test_branch_created_during_gc_keeps_its_branch_point(tmp_path: Path) -> None:
    # create_timeline checks the ancestor's GC cutoff, then awaits (index_part, fsync); a GC
    # running meanwhile must count the branch point, or it removes what the branch reads.
    # Either the branch is counted or it is refused (its point fell below the new cutoff).
    # threadpool: file operations really yield, as on a busy disk; trio picks the order of the
    # two tasks at random, so a few rounds.
    cfg = StorageConfig(validate_get=True, double_buffering=False, gc_horizon=0, pitr_interval_s=0,
                        compaction_threshold=2, image_creation_threshold=1, io_engine="threadpool")
    for round_ in range(8):
        tenant = Tenant(tmp_path / str(round_), TenantId.generate(), cfg)
        main = await tenant.create_timeline(TimelineId.generate())
        await _write(main, 0x10, k(0), b"old")
        await main.flush()
        await _write(main, 0x20, k(0), b"new")
        await main.flush()
        await main.compact(force_image=True)
        await _write(main, 0x30, k(0), b"newer")
        await main.flush()
        await main.compact(force_image=True)  # an image at 0x30: what holds 0x10 is garbage
        branch_id = TimelineId.generate()
        refused: list[ValueError] = []

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_branch, tenant, branch_id, main, refused)
            nursery.start_soon(tenant.gc)
        if not refused:
            assert await tenant.timelines[branch_id].get(k(0), Lsn(0x10)) == b"old"
            # Without the branch, GC does remove layers: the test exercises something.
            del tenant.timelines[branch_id]
            assert (await tenant.gc())[main.timeline_id]
        await tenant.shutdown()
