"""Timeline behaviour: ancestors and GC, the cached-LSN rule, wait_lsn, validation, restarts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import structlog
import trio
import trio.lowlevel
import trio.testing
from prometheus_client import REGISTRY

from pageserver.storage.config import StorageConfig
from pageserver.storage.delta_layer import ReadContext
from pageserver.storage.inmemory_layer import InMemoryLayer
from pageserver.storage.key import Key, KeyRange, rel_block_key
from pageserver.storage.layer_file import LayerDesc
from pageserver.storage.reconstruct import KeyState, MissingKeyError, TestRedoManager
from pageserver.storage.value import Image, TestRecord, WalRecordValue
from pageserver.tenant import Tenant
from pageserver.timeline import GetValidationError, LsnBelowGcCutoffError, LsnTimeoutError, Timeline
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn

CFG = StorageConfig(
    validate_get=True,
    double_buffering=False,
    compaction_threshold=2,
    compaction_target_size=8192 * 4,
    image_creation_threshold=1,
    gc_horizon=0,
    pitr_interval_s=0,
)


def k(i: int) -> Key:
    return rel_block_key(1663, 5, 1000, 0, i)


async def _write(tl: Timeline, lsn: int, key: Key, value: Image | TestRecord) -> None:
    await tl.put(key, Lsn(lsn), value)
    tl.finish_write(Lsn(lsn))


async def test_branch_reads_cross_ancestor_and_gc_keeps_branch_data(tmp_path: Path) -> None:
    tenant = Tenant(tmp_path, TenantId.generate(), CFG)
    main = await tenant.create_timeline(TimelineId.generate())
    await _write(main, 10, k(0), Image(b"a"))
    await _write(main, 20, k(1), Image(b"b"))
    await _write(main, 30, k(0), TestRecord.wal_append(",30"))
    await main.flush()
    child = await tenant.create_timeline(TimelineId.generate(), ancestor=main, ancestor_lsn=Lsn(30))
    # the parent moves on; the child must not see it
    await _write(main, 40, k(0), Image(b"new"))
    await _write(main, 50, k(1), TestRecord.wal_append(",50"))
    await main.flush()
    await _write(child, 35, k(1), TestRecord.wal_append(",child"))
    await _write(child, 45, k(2), Image(b"c"))
    assert await child.get_vectored([k(0), k(1), k(2)], Lsn(45)) == {
        k(0): b"a,30",
        k(1): b"b,child",
        k(2): b"c",
    }
    assert await child.get(k(1), Lsn(34)) == b"b"  # below the child's write, via the ancestor
    res = await child.get_vectored_results([k(2)], Lsn(40))
    assert isinstance(res[k(2)], MissingKeyError)
    # image layers on the parent above the branch point, then GC with the horizon at the top
    await main.compact(force_image=True)
    await _write(main, 60, k(0), TestRecord.wal_append(",60"))
    await main.flush()
    await main.compact(force_image=True)
    removed = await tenant.gc()
    assert removed[main.timeline_id], "GC removed nothing: the test does not exercise it"
    assert main.latest_gc_cutoff_lsn == 60
    # everything the child reads below its branch point survived
    assert await child.get_vectored([k(0), k(1)], Lsn(45)) == {k(0): b"a,30", k(1): b"b,child"}
    assert await child.get(k(1), Lsn(34)) == b"b"
    assert await child.get(k(0), Lsn(30)) == b"a,30"
    assert await main.get(k(0), Lsn(60)) == b"new,60"
    with pytest.raises(LsnBelowGcCutoffError):
        await main.get(k(0), Lsn(50))
    # and still after a restart
    await tenant.shutdown()
    tenant = await Tenant.load(tmp_path, tenant.tenant_id, CFG)
    child = tenant.timelines[child.timeline_id]
    assert child.ancestor is tenant.timelines[main.timeline_id]
    assert await child.get(k(0), Lsn(30)) == b"a,30"
    await tenant.shutdown()


class CountingRedo(TestRedoManager):
    def __init__(self) -> None:
        self.applied = 0

    def apply(self, key: Key, base_image: bytes | None, records: list[tuple[Lsn, WalRecordValue]]) -> bytes:
        self.applied += len(records)
        return super().apply(key, base_image, records)


async def test_cached_page_completes_key_when_walk_passes_it(tmp_path: Path) -> None:
    """PR #7477: a cached page at LSN C must end the walk once it passes C, even with an older
    image layer below; only the records above C are replayed."""
    redo = CountingRedo()
    tenant = Tenant(tmp_path, TenantId.generate(), CFG, redo=redo)
    tl = await tenant.create_timeline(TimelineId.generate())
    await _write(tl, 10, k(0), Image(b"img"))
    await tl.flush()
    await tl.compact(force_image=True)  # image layer at 10
    await _write(tl, 20, k(0), TestRecord.wal_append(",20"))
    await _write(tl, 30, k(0), TestRecord.wal_append(",30"))
    await tl.flush()
    assert await tl.get(k(0), Lsn(35)) == b"img,20,30"  # memorized at 30
    assert tenant.page_cache.lookup(tl.timeline_id.raw, k(0), Lsn(35)) == (30, b"img,20,30")
    await _write(tl, 40, k(0), TestRecord.wal_append(",40"))
    await tl.flush()
    # the walk over the vectored path alone: seeded with the cache, it must stop at 30
    st = KeyState(30, b"img,20,30")
    states = {k(0): st}
    from pageserver.storage import read_path

    await read_path.get_vectored(tl, [k(0)], Lsn(45), states, ReadContext())
    assert st.complete and st.img is None
    assert [lsn for lsn, _ in st.records] == [40]
    redo.applied = 0
    tl.config = StorageConfig(validate_get=False, double_buffering=False)
    assert await tl.get(k(0), Lsn(45)) == b"img,20,30,40"
    assert redo.applied == 1
    await tenant.shutdown()


async def test_wait_lsn_wakes_and_times_out(tmp_path: Path) -> None:
    tenant = Tenant(tmp_path, TenantId.generate(), CFG)
    tl = await tenant.create_timeline(TimelineId.generate())
    woke: list[int] = []

    async def waiter(lsn: int) -> None:
        await tl.wait_lsn(Lsn(lsn), timeout_s=10)
        woke.append(lsn)

    async with trio.open_nursery() as nursery:
        for lsn in (30, 10, 20):
            nursery.start_soon(waiter, lsn)
        await trio.testing.wait_all_tasks_blocked()
        await _write(tl, 20, k(0), Image(b"x"))
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(woke) == [10, 20]
        await _write(tl, 35, k(0), Image(b"y"))
    assert sorted(woke) == [10, 20, 30]
    with pytest.raises(LsnTimeoutError):
        await tl.wait_lsn(Lsn(100), timeout_s=0.01)
    await tenant.shutdown()


async def test_validate_get_fails_loudly_on_a_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = Tenant(tmp_path, TenantId.generate(), CFG)
    tl = await tenant.create_timeline(TimelineId.generate())
    await _write(tl, 10, k(0), Image(b"a"))
    await _write(tl, 20, k(0), TestRecord.wal_append(",b"))
    original = InMemoryLayer.get_values_vectored

    async def lossy(self: InMemoryLayer, keys: Sequence[Key], floor: int, cont: int,
                    states: dict[Key, KeyState], ctx: ReadContext) -> None:
        # the bug: the newest record is skipped
        await original(self, keys, floor, min(cont, 20), states, ctx)

    monkeypatch.setattr(InMemoryLayer, "get_values_vectored", lossy)
    before = REGISTRY.get_sample_value("pageserver_get_validation_mismatches_total") or 0.0
    with structlog.testing.capture_logs() as logs, pytest.raises(GetValidationError, match="disagree"):
        await tl.get(k(0), Lsn(25))
    after = REGISTRY.get_sample_value("pageserver_get_validation_mismatches_total")
    assert after == before + 1
    assert any(e["event"] == "get validation mismatch" and e["diff"] for e in logs)
    await tenant.shutdown()


async def test_restart_loads_exactly_the_listed_layers(tmp_path: Path) -> None:
    tenant = Tenant(tmp_path, TenantId.generate(), CFG)
    tl = await tenant.create_timeline(TimelineId.generate())
    for i in range(5):
        await _write(tl, 10 + i, k(i), Image(b"v%d" % i))
    await tl.flush()
    listed = {x.path.name for x in tl.layer_map}
    await _write(tl, 20, k(0), Image(b"lost"))  # in memory only
    stray = tl.path / LayerDesc(KeyRange.full(), Lsn(100), Lsn(200), True).file_name()
    (tl.path / "junk.___temp").write_bytes(b"half written")
    stray.write_bytes(b"not listed")
    await tenant.shutdown()
    tenant = await Tenant.load(tmp_path, tenant.tenant_id, CFG)
    tl = tenant.timelines[tl.timeline_id]
    assert {x.path.name for x in tl.layer_map} == listed
    assert sorted(p.name for p in tl.path.iterdir()) == sorted([*listed, "index_part.json"])
    assert tl.disk_consistent_lsn == tl.last_record_lsn == 14
    assert await tl.get(k(0), Lsn(14)) == b"v0"
    await tenant.shutdown()


async def test_double_buffered_timeline_in_a_nursery(tmp_path: Path) -> None:
    cfg = StorageConfig(validate_get=True, double_buffering=True, write_buffer_size=4096,
                        checkpoint_distance=64 * 1024, io_engine="threadpool")
    async with trio.open_nursery() as nursery:
        tenant = Tenant(tmp_path, TenantId.generate(), cfg, nursery=nursery)
        tl = await tenant.create_timeline(TimelineId.generate())
        for lsn in range(1, 400):
            await _write(tl, lsn, k(lsn % 50), Image(bytes([lsn % 256]) * 500))
        assert len(tl.layer_map) >= 2  # rolled at checkpoint_distance
        got = await tl.get_vectored([k(i) for i in range(50)], Lsn(399))
        assert got[k(49)] == bytes([399 % 256]) * 500
        assert got[k(0)] == bytes([350 % 256]) * 500
        await tenant.shutdown()


async def test_background_jobs_flush_old_layers_compact_and_gc(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    cfg = StorageConfig(validate_get=True, double_buffering=False, checkpoint_timeout_s=60,
                        compaction_period_s=20, compaction_threshold=2, gc_period_s=100,
                        gc_horizon=0, pitr_interval_s=0, image_creation_threshold=1)
    tenant = Tenant(tmp_path, TenantId.generate(), cfg)
    tl = await tenant.create_timeline(TimelineId.generate())
    async with trio.open_nursery() as nursery:
        await nursery.start(tenant.run_background_jobs)
        for round_ in range(3):
            await _write(tl, 10 + round_, k(round_), Image(b"r%d" % round_))
            # the open layer's clock is time.monotonic, not trio's: backdate it
            assert tl.open_layer is not None
            tl.open_layer.opened_at -= 3600
            await trio.sleep(21)
            assert not tl.in_memory_layers()
            assert tl.disk_consistent_lsn == 10 + round_
        # compacted once two L0s waited; the third is alone below the threshold
        assert len(tl.layer_map.l0_layers()) == 1
        assert any(x.desc.is_delta and not x.desc.is_l0 for x in tl.layer_map)
        await trio.sleep(100)
        assert tl.latest_gc_cutoff_lsn == 12
        nursery.cancel_scope.cancel()
    assert await tl.get_vectored([k(0), k(1), k(2)], Lsn(12)) == {k(0): b"r0", k(1): b"r1", k(2): b"r2"}
    await tenant.shutdown()


async def test_reads_race_with_flushes_and_compactions(tmp_path: Path) -> None:
    """Readers run while puts roll layers and compaction/GC replace them (threadpool engine, so
    every IO await really yields to the other tasks)."""
    cfg = StorageConfig(validate_get=True, double_buffering=True, io_engine="threadpool",
                        write_buffer_size=1024, checkpoint_distance=8 * 1024,
                        compaction_threshold=3, compaction_target_size=8192 * 4,
                        image_creation_threshold=2, gc_horizon=400, pitr_interval_s=0)
    model: dict[Key, list[tuple[int, bytes]]] = {}
    done = trio.Event()
    checked = 0

    def expected(key: Key, lsn: int) -> bytes | None:
        page = None
        for at, data in model.get(key, []):
            if at <= lsn:
                page = data
        return page

    async with trio.open_nursery() as nursery:
        tenant = Tenant(tmp_path, TenantId.generate(), cfg, nursery=nursery)
        tl = await tenant.create_timeline(TimelineId.generate())

        async def writer() -> None:
            for lsn in range(1, 1500):
                key = k(lsn % 37)
                data = b"%d:" % lsn + bytes(150)
                await tl.put(key, Lsn(lsn), Image(data))
                model.setdefault(key, []).append((lsn, data))
                tl.finish_write(Lsn(lsn))
                if lsn % 200 == 0:
                    await tl.compact(force_image=lsn % 400 == 0)
                    await tenant.gc()
            done.set()

        async def reader(seed: int) -> None:
            nonlocal checked
            i = seed
            while not done.is_set():
                lsn = tl.last_record_lsn
                keys = [k((i + j) % 37) for j in range(8)]
                got = await tl.get_vectored_results(keys, lsn)
                for key in keys:
                    want = expected(key, lsn)
                    assert got[key] == want if want is not None else isinstance(got[key], MissingKeyError)
                checked += 1
                i += 5
                await trio.lowlevel.checkpoint()

        nursery.start_soon(writer)
        for seed in range(3):
            nursery.start_soon(reader, seed)
    assert checked > 50
    assert tl.layer_map.l0_layers() != list(tl.layer_map)  # compaction/images happened
    await tenant.shutdown()


async def test_puts_race_with_background_flushes(tmp_path: Path) -> None:
    """A flush (background job) freezing the open layer while a put is inside its append must
    neither lose the value nor put it into a layer already being written."""
    cfg = StorageConfig(validate_get=True, double_buffering=True, io_engine="threadpool",
                        write_buffer_size=512, checkpoint_distance=1 << 30)
    async with trio.open_nursery() as nursery:
        tenant = Tenant(tmp_path, TenantId.generate(), cfg, nursery=nursery)
        tl = await tenant.create_timeline(TimelineId.generate())
        done = trio.Event()

        async def writer() -> None:
            for lsn in range(1, 600):
                await _write(tl, lsn, k(lsn % 20), Image(b"%d:" % lsn + bytes(100)))
            done.set()

        async def flusher() -> None:
            while not done.is_set():
                await tl.flush()
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as racers:
            racers.start_soon(writer)
            racers.start_soon(flusher)
        await tl.flush()
        assert len(tl.layer_map) >= 2
        got = await tl.get_vectored([k(i) for i in range(20)], Lsn(599))
        for i in range(20):
            last = max(lsn for lsn in range(1, 600) if lsn % 20 == i)
            assert got[k(i)] == b"%d:" % last + bytes(100)
        await tenant.shutdown()
