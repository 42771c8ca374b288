"""On-demand download and eviction: an attached tenant has its layers in remote storage only
until a read needs them; under a tiny ``max_local_layer_bytes`` local files are evicted and
fetched back when read (``validate_get`` on: both read paths agree throughout); a layer that
cannot be downloaded fails that read with a clear error, and the next read works again."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import trio
import trio.lowlevel

from pageserver.remote_tenant import TenantRemote
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
