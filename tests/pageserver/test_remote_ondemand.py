"""On-demand download and eviction: an attached tenant has its layers in remote storage only
until a read needs them; under a tiny ``max_local_layer_bytes`` local files are evicted and
fetched back when read (``validate_get`` on: both read paths agree throughout); a layer that
cannot be downloaded fails that read with a clear error, and the next read works again; a
downloaded layer's bytes are fsynced before its rename."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest
import trio
import trio.lowlevel

from pageserver.remote_tenant import TenantRemote
from pageserver.remote_timeline import download_layer
from pageserver.storage.index_part import INDEX_PART
from pageserver.tenant import Tenant
from pageserver.timeline import LayerDownloadError, Timeline
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from remote_storage import LocalStorageConfig, make_remote_storage
from tests.pageserver.remote_helpers import FaultyStorage
from tests.pageserver.test_compaction_concurrency import CFG, KEYS, Model, check
from tests.pageserver.test_remote_upload import workload

TINY = attrs.evolve(CFG, max_local_layer_bytes=1, eviction_period_s=0.01)
assert TINY.validate_get


def layer_files(tl: Timeline) -> set[str]:
    return {p.name for p in tl.path.iterdir() if p.name != INDEX_PART and "ephemeral" not in p.name}


async def test_evicted_layers_come_back_when_read(tmp_path: Path) -> None:
    store = FaultyStorage(make_remote_storage(LocalStorageConfig(path=tmp_path / "remote")))
    model = Model()
    async with trio.open_nursery() as nursery:
        tenant = Tenant(tmp_path / "a", TenantId.generate(), TINY, nursery=nursery, remote=TenantRemote(store, 1))
        tl = await tenant.create_timeline(TimelineId.generate())
        await workload(tl, model, rounds=2)
        assert tl.remote is not None
        await tl.remote.wait_uploaded()
        total = tenant.resident_layer_bytes()
        assert await tenant.evict_to_budget() == total > 0
        assert layer_files(tl) == set()
        assert tenant.resident_layer_bytes() == 0
        assert all(not x.resident for x in tl.layer_map)

        await check(tl, model)  # every read downloads what it needs
        assert layer_files(tl) == {x.path.name for x in tl.layer_map if x.resident} != set()
        downloads = sum(1 for op, _ in store.calls if op == "download")
        assert downloads > 0

        # the store is down: the read fails with a clear error, nothing else does
        await tenant.evict_to_budget()
        store.fail("download", times=None)
        with pytest.raises(LayerDownloadError, match="could not be downloaded from remote storage"):
            await tl.get(KEYS[0], Lsn(model.last_lsn))
        store.heal()
        await check(tl, model)
        await tenant.shutdown()
        nursery.cancel_scope.cancel()


async def test_reads_race_the_eviction_loop(tmp_path: Path) -> None:
    store = make_remote_storage(LocalStorageConfig(path=tmp_path / "remote"))
    model = Model()
    async with trio.open_nursery() as nursery:
        # threadpool IO: reads yield to the eviction task in the middle of a walk
        cfg = attrs.evolve(TINY, io_engine="threadpool")
        tenant = Tenant(tmp_path / "a", TenantId.generate(), cfg, nursery=nursery, remote=TenantRemote(store, 1))
        tl = await tenant.create_timeline(TimelineId.generate())
        await workload(tl, model, rounds=2)
        assert tl.remote is not None
        await tl.remote.wait_uploaded()
        evicted = 0

        async def evict_forever() -> None:
            nonlocal evicted
            while True:
                evicted += await tenant.evict_to_budget()
                await trio.lowlevel.checkpoint()

        nursery.start_soon(evict_forever)
        for _ in range(3):
            await check(tl, model)
            await tl.compact(force_image=True)  # compaction reads evicted layers too
        assert evicted > 0
        await tenant.shutdown()
        nursery.cancel_scope.cancel()


async def test_attach_downloads_on_first_use(tmp_path: Path) -> None:
    store = FaultyStorage(make_remote_storage(LocalStorageConfig(path=tmp_path / "remote")))
    model = Model()
    tenant_id, timeline_id = TenantId.generate(), TimelineId.generate()
    async with trio.open_nursery() as nursery:
        tenant = Tenant(tmp_path / "a", tenant_id, CFG, nursery=nursery, remote=TenantRemote(store, 1))
        tl = await tenant.create_timeline(timeline_id)
        await workload(tl, model, rounds=2)
        assert tl.remote is not None
        await tl.remote.wait_uploaded()
        n_layers = len(list(tl.layer_map))
        await tenant.shutdown()

        attached = await Tenant.load(tmp_path / "b", tenant_id, CFG, nursery=nursery, remote=TenantRemote(store, 2))
        atl = attached.timelines[timeline_id]
        assert layer_files(atl) == set(), "attach downloaded layers before any read"
        assert len(list(atl.layer_map)) == n_layers
        await atl.get(KEYS[0], Lsn(model.last_lsn))
        fetched = layer_files(atl)
        assert 0 < len(fetched) < len(list(atl.layer_map)), "one read fetched only what it needed"
        await check(atl, model)
        await attached.shutdown()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("kind", ["local", "s3"])
async def test_eviction_under_constant_reads(tmp_path: Path, kind: str, request: pytest.FixtureRequest) -> None:
    """Readers that never pause all at once (some read is in progress at every moment): the
    eviction loop still evicts under the tiny budget (layers no read in progress may visit go,
    and come back from the store when read), and every read equals the model (``validate_get``:
    both read paths). Over the local kind and a real SeaweedFS."""
    store = make_remote_storage(LocalStorageConfig(path=tmp_path / "remote") if kind == "local"
                                else request.getfixturevalue("s3_config"))
    model = Model()
    async with trio.open_nursery() as nursery:
        cfg = attrs.evolve(TINY, io_engine="threadpool")  # reads yield in the middle of a walk
        tenant = Tenant(tmp_path / "a", TenantId.generate(), cfg, nursery=nursery, remote=TenantRemote(store, 1))
        tl = await tenant.create_timeline(TimelineId.generate())
        await workload(tl, model, rounds=2)
        assert tl.remote is not None
        await tl.remote.wait_uploaded()
        lsns = sorted({lsn for lsn, _, _ in model.ops if lsn >= tl.latest_gc_cutoff_lsn})
        reads = 0
        in_flight = 0
        idle_moments = 0
        evictions_seen = 0
        done = trio.Event()

        async def reader(offset: int) -> None:
            nonlocal reads, in_flight, idle_moments
            i = offset
            while not done.is_set():
                i += 1
                key, lsn = KEYS[(i * 7) % len(KEYS)], lsns[(i * 5) % len(lsns)]
                in_flight += 1
                try:
                    expected = model.value(key, lsn)
                    if expected is not None:
                        assert await tl.get(key, Lsn(lsn)) == expected
                    got = await tl.get_vectored([k for k in KEYS[:6] if model.value(k, lsn) is not None], Lsn(lsn))
                    for k, page in got.items():
                        assert page == model.value(k, lsn)
                finally:
                    in_flight -= 1
                if in_flight == 0:
                    idle_moments += 1
                reads += 1

        async def watch_evictions() -> None:
            nonlocal evictions_seen
            while not done.is_set():
                before = sum(1 for x in tl.layer_map if not x.resident)
                await trio.sleep(0.005)
                if sum(1 for x in tl.layer_map if not x.resident) > before:
                    evictions_seen += 1

        async def eviction_loop() -> None:  # as Tenant.run_background_jobs runs it
            while not done.is_set():
                await trio.sleep(cfg.eviction_period_s)
                await tenant.evict_to_budget()

        async with trio.open_nursery() as readers:
            for n in range(4):
                readers.start_soon(reader, n * 3)
            readers.start_soon(watch_evictions)
            readers.start_soon(eviction_loop)
            with trio.move_on_after(20):
                while evictions_seen < 5 or reads < 200:
                    await trio.sleep(0.05)
            done.set()
        assert idle_moments <= reads // 10, "the reads overlapped (some read in progress nearly always)"
        assert evictions_seen >= 5, f"the eviction loop evicted under constant reads ({reads} reads)"
        await check(tl, model)
        await tenant.shutdown()
        await store.aclose()
        nursery.cancel_scope.cancel()


async def test_a_downloaded_layer_is_fsynced_before_its_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes durable, then the name, then the directory entry: a crash can leave a temp file
    (removed at start) or the complete layer, never the layer's name over unwritten bytes."""
    storage = make_remote_storage(LocalStorageConfig(path=tmp_path / "remote"))
    await storage.upload("tenants/t/layer-00000001", b"L" * 100_000)
    local = tmp_path / "local"
    local.mkdir()
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(("rename", os.fspath(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    path = local / "layer"
    await download_layer(storage, "tenants/t/layer-00000001", path, 100_000)
    monkeypatch.undo()
    mine = [e for e in events if str(local) in e[1]]
    assert mine == [("fsync", str(path) + ".___temp_download"), ("rename", str(path)), ("fsync", str(local))], mine
    assert path.read_bytes() == b"L" * 100_000
    await storage.aclose()
