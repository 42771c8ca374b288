"""Compaction and image creation against WAL ingest, flushes, GC and shutdown.

A compaction round builds its outputs without the timeline's layers lock and takes it only for
the swap, so the WAL ingest's roll (which needs that lock) never waits for a round; rounds and
GC exclude each other with the timeline's background lock. The rounds are held at known points
with ``Timeline.compaction_hook`` and ``trio.Event``s (no sleeps): the blocking IO engine makes
``wait_all_tasks_blocked`` mean "nothing can run any more". After each scenario, ``get`` and
``get_vectored`` (``validate_get`` on: the legacy path too) must equal a plain model, also after
a restart.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import trio
import trio.testing

from pageserver.storage.config import StorageConfig
from pageserver.storage.index_part import read_index_part
from pageserver.storage.key import Key, rel_block_key
from pageserver.storage.reconstruct import MissingKeyError
from pageserver.storage.value import Image
from pageserver.tenant import Tenant
from pageserver.timeline import Timeline
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn

KEYS = [rel_block_key(1663, 5, 1000, 0, i) for i in range(24)]
STEP = 0x10
DISTANCE = 0x10000  # checkpoint_distance: a put this far above the open layer's start rolls it

CFG = StorageConfig(
    checkpoint_distance=DISTANCE,
    compaction_threshold=3,
    compaction_target_size=8192 * 2,  # several L1s per round
    image_creation_threshold=2,
    gc_horizon=0,
    pitr_interval_s=0,
    validate_get=True,
    double_buffering=False,
    write_buffer_size=256,
    io_engine="blocking",
)


class Model:
    """(lsn, key, page) in LSN order; every value is a full image."""

    def __init__(self) -> None:
        self.ops: list[tuple[int, Key, bytes]] = []

    def value(self, key: Key, lsn: int) -> bytes | None:
        found = None
        for op_lsn, k, page in self.ops:
            if k == key and op_lsn <= lsn:
                found = page
        return found

    @property
    def last_lsn(self) -> int:
        return self.ops[-1][0] if self.ops else 0


async def write(tl: Timeline, model: Model, lsn: int, keys: list[Key]) -> None:
    """One record at ``lsn`` putting an image of each of ``keys``."""
    for key in keys:
        page = f"{key.hex()}@{lsn:x}".encode() * 16
        await tl.put(key, Lsn(lsn), Image(page))
        model.ops.append((lsn, key, page))
    tl.finish_write(Lsn(lsn))


async def write_l0(tl: Timeline, model: Model, n: int) -> None:
    """Write records over every key at ``n`` LSNs, then flush them into one L0."""
    for _ in range(n):
        lsn = model.last_lsn + STEP
        await write(tl, model, lsn, KEYS[(lsn // STEP) % 3 :: 3])
    await tl.flush()


async def check(tl: Timeline, model: Model) -> None:
    """get == get_vectored == model at every written LSN above the GC cutoff."""
    lsns = sorted({lsn for lsn, _, _ in model.ops if lsn >= tl.latest_gc_cutoff_lsn})
    for lsn in lsns:
        present = [k for k in KEYS if model.value(k, lsn) is not None]
        got = await tl.get_vectored(present, Lsn(lsn))
        for key in KEYS:
            expected = model.value(key, lsn)
            if expected is None:
                try:
                    await tl.get(key, Lsn(lsn))
                except MissingKeyError:
                    continue
                raise AssertionError(f"{key.hex()} at {lsn:x} should not exist")
            assert await tl.get(key, Lsn(lsn)) == expected, (key.hex(), hex(lsn))
            assert got[key] == expected, (key.hex(), hex(lsn))


async def check_index_part(tl: Timeline) -> None:
    """index_part lists exactly the layer map, and no other layer file is left behind."""
    part = await read_index_part(tl.engine, tl.path)
    listed = set(part.layers)
    assert listed == {x.path.name for x in tl.layer_map}
    assert part.disk_consistent_lsn == tl.disk_consistent_lsn
    on_disk = {p.name for p in tl.path.iterdir() if p.name != "index_part.json" and "ephemeral" not in p.name}
    assert on_disk == listed, on_disk ^ listed


async def new_timeline(tmp_path: Path) -> tuple[Tenant, Timeline, Model]:
    tenant = Tenant(tmp_path, TenantId.generate(), CFG)
    tl = await tenant.create_timeline(TimelineId.generate())
    model = Model()
    for _ in range(3):
        await write_l0(tl, model, 4)
    assert len(tl.layer_map.l0_layers()) == 3
    return tenant, tl, model


class Pause:
    """A compaction hook that holds the round at ``point`` (its first time) until released."""

    def __init__(self, point: str) -> None:
        self.point = point
        self.reached = trio.Event()
        self.release = trio.Event()
        self.seen: list[str] = []

    async def __call__(self, point: str) -> None:
        self.seen.append(point)
        if point == self.point and not self.reached.is_set():
            self.reached.set()
            await self.release.wait()


async def restart_and_check(tmp_path: Path, tenant: Tenant, tl: Timeline, model: Model) -> None:
    await tl.flush()  # in-memory layers are dropped at shutdown (the WAL would be re-ingested)
    await tenant.shutdown()
    reloaded = await Tenant.load(tmp_path, tenant.tenant_id, CFG)
    again = reloaded.timelines[tl.timeline_id]
    await check_index_part(again)
    await check(again, model)
    await reloaded.shutdown()


async def test_roll_completes_while_compaction_is_mid_merge(tmp_path: Path) -> None:
    tenant, tl, model = await new_timeline(tmp_path)
    pause = Pause("l0_merge")
    tl.compaction_hook = pause
    inputs = tl.layer_map.l0_layers()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tl.compact)
        await pause.reached.wait()
        # The round is mid-build (an L1 writer open, inputs being read): the lock is free.
        assert not tl.layers_lock.locked(), "compaction holds the layers lock while it builds"
        before = tl.disk_consistent_lsn
        # A guard, not a synchronisation: with the lock held for the whole round this put
        # would wait for a release that comes only after it.
        with trio.fail_after(30):
            start = model.last_lsn + STEP
            await write(tl, model, start, KEYS[:4])
            await write(tl, model, start + DISTANCE, KEYS[4:8])  # rolls the layer holding ``start``
        assert tl.disk_consistent_lsn > before, "the put did not roll and flush the open layer"
        assert len(tl.layer_map.l0_layers()) == 4
        assert not pause.release.is_set()
        await check(tl, model)  # reads during the round see inputs plus the new L0
        pause.release.set()
    l0s = tl.layer_map.l0_layers()
    assert [x.desc.lsn_start for x in l0s] == [inputs[-1].desc.lsn_end], "only the snapshot is compacted"
    l1s = [x for x in tl.layer_map if x.desc.is_delta and not x.desc.is_l0]
    assert len(l1s) >= 2
    assert {(x.desc.lsn_start, x.desc.lsn_end) for x in l1s} == {(inputs[0].desc.lsn_start, inputs[-1].desc.lsn_end)}
    await check(tl, model)
    await check_index_part(tl)
    await restart_and_check(tmp_path, tenant, tl, model)


async def test_images_are_made_at_the_snapshot_lsn_while_flushes_go_on(tmp_path: Path) -> None:
    tenant, tl, model = await new_timeline(tmp_path)
    pause = Pause("image")
    tl.compaction_hook = pause
    snapshot = tl.disk_consistent_lsn
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: tl.compact(force_image=True))
        await pause.reached.wait()
        assert not tl.layers_lock.locked()
        with trio.fail_after(30):
            await write_l0(tl, model, 2)
            start = model.last_lsn + STEP
            await write(tl, model, start, KEYS[:2])
            await write(tl, model, start + DISTANCE, KEYS[2:4])  # a roll too
        assert tl.disk_consistent_lsn > snapshot
        pause.release.set()
    images = [x for x in tl.layer_map if not x.desc.is_delta]
    assert images and {x.desc.image_lsn for x in images} == {snapshot}
    await check(tl, model)
    await check_index_part(tl)
    await restart_and_check(tmp_path, tenant, tl, model)


async def test_gc_waits_for_a_running_compaction(tmp_path: Path) -> None:
    tenant, tl, model = await new_timeline(tmp_path)
    pause = Pause("l0_merge")
    tl.compaction_hook = pause
    order: list[str] = []

    async def compact() -> None:
        await tl.compact(force_image=True)
        order.append("compaction")

    removed: list[str] = []

    async def gc() -> None:
        removed.extend(await tl.gc())
        order.append("gc")

    inputs = {x.path.name for x in tl.layer_map.l0_layers()}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(compact)
        await pause.reached.wait()
        # An L0 above the snapshot moves the GC cutoff past the L1s' end: once the images at
        # the snapshot LSN exist, GC removes the L1s (and, let in now, could remove the inputs).
        with trio.fail_after(30):  # a guard: the flush must not wait for the round
            await write_l0(tl, model, 2)
        newest = tl.layer_map.l0_layers()[-1]
        nursery.start_soon(gc)
        await trio.testing.wait_all_tasks_blocked()
        assert order == [], "GC ran while a compaction was reading its inputs"
        assert tl.latest_gc_cutoff_lsn == 0
        pause.release.set()
    assert order == ["compaction", "gc"]
    assert tl.latest_gc_cutoff_lsn == tl.disk_consistent_lsn
    assert removed and not inputs & set(removed), "GC removed nothing, or the compacted L0s twice"
    assert [x for x in tl.layer_map if x.desc.is_delta] == [newest]
    await check(tl, model)
    await check_index_part(tl)
    await restart_and_check(tmp_path, tenant, tl, model)


async def test_compaction_waits_for_a_running_gc(tmp_path: Path) -> None:
    tenant, tl, model = await new_timeline(tmp_path)
    pause = Pause("never")
    tl.compaction_hook = pause
    order: list[str] = []

    async def compact() -> None:
        await tl.compact()
        order.append("compaction")

    async def gc() -> None:
        await tl.gc()
        order.append("gc")

    # GC holds the background lock while it waits for the layers lock, held here.
    await tl.layers_lock.acquire()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gc)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(compact)
        await trio.testing.wait_all_tasks_blocked()
        assert pause.seen == [] and order == [], "compaction started while GC ran"
        tl.layers_lock.release()
    assert order == ["gc", "compaction"]
    assert "l0_merge" in pause.seen
    await check(tl, model)
    await check_index_part(tl)
    await restart_and_check(tmp_path, tenant, tl, model)


async def test_flushes_during_compaction_leave_a_consistent_layer_map(tmp_path: Path) -> None:
    tenant, tl, model = await new_timeline(tmp_path)
    merge, swap = Pause("l0_merge"), Pause("swap")

    async def hook(point: str) -> None:
        await merge(point)
        await swap(point)

    tl.compaction_hook = hook
    inputs = tl.layer_map.l0_layers()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tl.compact)
        await merge.reached.wait()
        with trio.fail_after(30):  # a guard: flushes must not wait for the round
            await write_l0(tl, model, 3)  # flushed while the inputs are read
        merge.release.set()
        await swap.reached.wait()
        with trio.fail_after(30):
            await write_l0(tl, model, 2)  # and while the outputs wait to be swapped in
            await write_l0(tl, model, 1)
        await check(tl, model)
        swap.release.set()
    l0s = tl.layer_map.l0_layers()
    assert len(l0s) == 3
    assert l0s[0].desc.lsn_start == inputs[-1].desc.lsn_end
    assert all(a.desc.lsn_end == b.desc.lsn_start for a, b in itertools.pairwise(l0s))
    assert not set(map(id, inputs)) & set(map(id, tl.layer_map)), "an input stayed listed"
    await check(tl, model)
    await check_index_part(tl)
    # A second round takes the new L0s: LSN ranges stay equal or disjoint.
    await tl.compact()
    assert tl.layer_map.l0_layers() == []
    await check(tl, model)
    await check_index_part(tl)
    await restart_and_check(tmp_path, tenant, tl, model)


async def test_cancelled_round_deletes_its_outputs_and_changes_nothing(tmp_path: Path) -> None:
    tenant, tl, model = await new_timeline(tmp_path)
    for point in ("l0_merge", "swap"):
        pause = Pause(point)
        tl.compaction_hook = pause
        before = {x.path.name for x in tl.layer_map}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tl.compact)
            await pause.reached.wait()
            nursery.cancel_scope.cancel()
        assert {x.path.name for x in tl.layer_map} == before
        await check_index_part(tl)
        await check(tl, model)
    await restart_and_check(tmp_path, tenant, tl, model)


async def test_shutdown_during_compaction_cancels_and_waits_for_it(tmp_path: Path) -> None:
    tenant, tl, model = await new_timeline(tmp_path)
    pause = Pause("l0_merge")
    tl.compaction_hook = pause
    done: list[str] = []

    async def compact() -> None:
        await tl.compact()
        done.append("compaction")  # ends quietly: shutdown is not a failure

    async with trio.open_nursery() as nursery:
        nursery.start_soon(compact)
        await pause.reached.wait()
        await tenant.shutdown()  # not released: shutdown itself must end the round
        assert done == ["compaction"]
        assert len(tl.layer_map) == 0
    await tl.compact()  # after shutdown: nothing (no reads of closed layers)
    assert await tl.gc() == []
    reloaded = await Tenant.load(tmp_path, tenant.tenant_id, CFG)
    again = reloaded.timelines[tl.timeline_id]
    assert len(again.layer_map.l0_layers()) == 3, "the cancelled round changed index_part"
    await check_index_part(again)
    await check(again, model)
    await reloaded.shutdown()


async def test_branch_created_during_compaction_keeps_its_branch_point(tmp_path: Path) -> None:
    """A branch created while a round runs on its ancestor (between the L1 swap and the
    images) is counted by the GC that follows: it still reads its branch point."""
    tenant, tl, model = await new_timeline(tmp_path)
    point = Lsn(0x80)  # inside the compacted L0s, below the images' LSN
    pause = Pause("image")
    tl.compaction_hook = pause
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: tl.compact(force_image=True))
        await pause.reached.wait()
        with trio.fail_after(30):
            branch = await tenant.create_timeline(TimelineId.generate(), ancestor=tl, ancestor_lsn=point)
            await write_l0(tl, model, 2)  # moves the GC cutoff above the L1s
        pause.release.set()
    removed = (await tenant.gc())[tl.timeline_id]
    expected = {k: model.value(k, point) for k in KEYS}
    assert await branch.get_vectored(KEYS, point) == expected
    for key in KEYS:
        assert await branch.get(key, point) == expected[key]
    await check(tl, model)
    await check_index_part(tl)
    # Without the branch, the same GC does remove layers: the test exercises something.
    assert not removed
    del tenant.timelines[branch.timeline_id]
    assert (await tenant.gc())[tl.timeline_id]
    await check(tl, model)
    await tenant.shutdown()
