"""The upload queue: layers before the index that names them, deletions only after an index
without them, ``remote_consistent_lsn`` only from an uploaded index; and after a crash at any
step (a layer upload, an index upload, a deletion) the remote state loads into an empty
directory and every page equals the model up to the remote ``disk_consistent_lsn``.

Over the local kind and a real SeaweedFS. The workload (``workload``) flushes L0s, compacts
(L1s and image layers replace them) and GCs (deletions), so every kind of queue operation runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from pageserver import remote_layout
from pageserver.remote_tenant import TenantRemote, find_index
from pageserver.tenant import Tenant
from pageserver.timeline import Timeline
from protocol.ids import TenantId, TimelineId
from protocol.lsn import INVALID_LSN, Lsn
from remote_storage import LocalStorageConfig, RemoteStorage, make_remote_storage
from tests.pageserver.remote_helpers import FaultyStorage, check_remote_invariant
from tests.pageserver.test_compaction_concurrency import CFG, Model, check, write_l0


@pytest.fixture
async def store(remote_store: RemoteStorage) -> RemoteStorage:
    return remote_store


def upto(model: Model, lsn: int) -> Model:
    out = Model()
    out.ops = [op for op in model.ops if op[0] <= lsn]
    return out


async def workload(tl: Timeline, model: Model, rounds: int = 2) -> None:
    """L0 flushes, compaction into L1s and image layers, GC: uploads and deletions."""
    for _ in range(rounds):
        for _ in range(3):
            await write_l0(tl, model, 3)
        await tl.compact()
        await tl.compact(force_image=True)
        await tl.gc()


async def load_from_remote(
    tmp: Path, store: RemoteStorage, tenant_id: TenantId, generation: int, nursery: trio.Nursery
) -> Tenant:
    """A fresh node's view: an empty tenant directory, then attach from remote storage."""
    return await Tenant.load(
        tmp, tenant_id, CFG, nursery=nursery, remote=TenantRemote(store, generation)
    )


async def test_flush_compact_gc_upload_and_restore(store: RemoteStorage, tmp_path: Path) -> None:
    tenant_id, timeline_id = TenantId.generate(), TimelineId.generate()
    model = Model()
    async with trio.open_nursery() as nursery:
        tenant = Tenant(tmp_path / "a", tenant_id, CFG, nursery=nursery, remote=TenantRemote(store, 1))
        tl = await tenant.create_timeline(timeline_id)
        await workload(tl, model)
        assert tl.remote is not None
        await tl.remote.wait_uploaded()
        assert tl.remote_consistent_lsn == tl.disk_consistent_lsn == model.last_lsn
        # The remote index is the local one, with generations; nothing else is left remotely.
        chosen = await find_index(store, tenant_id, timeline_id, 1)
        assert chosen is not None
        gen, part = chosen
        assert gen == 1
        assert set(part.layers) == {x.path.name for x in tl.layer_map}
        assert set(part.generations.values()) == {1}
        listing = await store.list(remote_layout.timeline_prefix(tenant_id, timeline_id))
        assert sorted(listing.keys) == sorted(
            [remote_layout.index_key(tenant_id, timeline_id, 1)]
            + [remote_layout.layer_key(tenant_id, timeline_id, n, 1) for n in part.layers]
        ), "GC'd and compacted-away layers are deleted remotely"
        assert await check_remote_invariant(store) == 1
        await tenant.shutdown()

        restored = await load_from_remote(tmp_path / "b", store, tenant_id, 2, nursery)
        rtl = restored.timelines[timeline_id]
        assert rtl.disk_consistent_lsn == model.last_lsn
        await check(rtl, model)
        # The next generation writes its own keys; the old generation's layers stay named.
        await write_l0(rtl, model, 3)
        assert rtl.remote is not None
        await rtl.remote.wait_uploaded()
        _, part2 = await find_index(store, tenant_id, timeline_id, 2) or (0, part)
        assert 2 in part2.generations.values() and 1 in part2.generations.values()
        assert await check_remote_invariant(store) == 2
        await restored.shutdown()
        nursery.cancel_scope.cancel()


async def test_remote_consistent_lsn_waits_for_the_store(tmp_path: Path) -> None:
    """Store down: flushes go on locally, remote_consistent_lsn stays; back up: catches up."""
    store = FaultyStorage(make_remote_storage(LocalStorageConfig(path=tmp_path / "remote")))
    model = Model()
    async with trio.open_nursery() as nursery:
        tenant = Tenant(tmp_path / "a", TenantId.generate(), CFG, nursery=nursery, remote=TenantRemote(store, 1))
        tl = await tenant.create_timeline(TimelineId.generate())
        await write_l0(tl, model, 3)
        assert tl.remote is not None
        await tl.remote.wait_uploaded()
        before = tl.remote_consistent_lsn
        assert before == tl.disk_consistent_lsn
        store.fail("upload", times=None)
        for _ in range(3):
            await write_l0(tl, model, 3)
        await trio.sleep(1.0)  # the queue retries meanwhile
        assert tl.disk_consistent_lsn == model.last_lsn > before
        assert tl.remote_consistent_lsn == before
        assert tl.remote.queued > 0 and tl.remote.last_error is not None
        assert tl.remote.failed_attempts >= 2
        store.heal()
        with trio.fail_after(30):
            await tl.remote.wait_uploaded()
        assert tl.remote_consistent_lsn == model.last_lsn
        await tenant.shutdown()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("op", ["upload", "delete"])
async def test_transient_failures_are_retried(tmp_path: Path, op: str) -> None:
    store = FaultyStorage(make_remote_storage(LocalStorageConfig(path=tmp_path / "remote")))
    store.fail(op, times=3)
    model = Model()
    tenant_id = TenantId.generate()
    async with trio.open_nursery() as nursery:
        tenant = Tenant(tmp_path / "a", tenant_id, CFG, nursery=nursery, remote=TenantRemote(store, 1))
        tl = await tenant.create_timeline(TimelineId.generate())
        await workload(tl, model, rounds=1)
        assert tl.remote is not None
        with trio.fail_after(30):
            await tl.remote.wait_uploaded()
        assert tl.remote.failed_attempts == 3
        assert tl.remote_consistent_lsn == model.last_lsn
        await check_remote_invariant(store)
        await tenant.shutdown()
        restored = await load_from_remote(tmp_path / "b", store, tenant_id, 2, nursery)
        await check(restored.timelines[tl.timeline_id], model)
        await restored.shutdown()
        nursery.cancel_scope.cancel()


async def test_remote_is_consistent_between_any_two_operations(tmp_path: Path) -> None:
    """A crash can come between any two remote operations: after each one, every index of
    the remote names only objects that are there (with their sizes)."""
    store = FaultyStorage(make_remote_storage(LocalStorageConfig(path=tmp_path / "remote")), audit=True)
    model = Model()
    async with trio.open_nursery() as nursery:
        tenant = Tenant(tmp_path / "a", TenantId.generate(), CFG, nursery=nursery, remote=TenantRemote(store, 1))
        tl = await tenant.create_timeline(TimelineId.generate())
        await workload(tl, model, rounds=3)
        assert tl.remote is not None
        await tl.remote.wait_uploaded()
        kinds = {op for op, _ in store.calls}
        assert kinds == {"upload", "delete"}
        assert store.audits > 30
        await tenant.shutdown()
        nursery.cancel_scope.cancel()


# (operation, key pattern) where the node "crashes": the call hangs, the node is cancelled.
CRASH_POINTS = [
    ("upload", "*/0000*-00000001"),  # a layer upload (layer names start with the key range)
    ("upload", "*index_part.json-*"),  # an index upload
    ("delete", "*"),  # a deletion (after the index that dropped the layers)
]


@pytest.mark.parametrize(("op", "pattern"), CRASH_POINTS, ids=["layer", "index", "delete"])
@pytest.mark.parametrize("after", [0, 3])
async def test_crash_at_every_step_leaves_a_loadable_remote(
    store: RemoteStorage, tmp_path: Path, op: str, pattern: str, after: int
) -> None:
    faulty = FaultyStorage(store)
    faulty.hang(op, pattern, after=after)
    tenant_id, timeline_id = TenantId.generate(), TimelineId.generate()
    model = Model()
    remote_lsn = INVALID_LSN
    async with trio.open_nursery() as crashed:
        tenant = Tenant(tmp_path / "a", tenant_id, CFG, nursery=crashed, remote=TenantRemote(faulty, 1))
        tl = await tenant.create_timeline(timeline_id)

        drained = trio.Event()

        async def run() -> None:
            await workload(tl, model, rounds=3)
            assert tl.remote is not None
            await tl.remote.wait_uploaded()  # never returns once the queue hangs
            drained.set()

        async def hung() -> None:
            await faulty.hung.wait()
            drained.set()

        crashed.start_soon(run)
        crashed.start_soon(hung)
        with trio.fail_after(120):  # (a store that fails for ever would hang the queue)
            await drained.wait()
        assert faulty.hung.is_set(), f"the workload never reached {op} {pattern} #{after}"
        assert tl.remote is not None
        remote_lsn = tl.remote_consistent_lsn
        crashed.cancel_scope.cancel()  # kill -9: no flush, no drain, local disk gone too

    assert await check_remote_invariant(store) >= 0
    async with trio.open_nursery() as nursery:
        chosen = await find_index(store, tenant_id, timeline_id, 2)
        if chosen is None:
            # crashed before the first index: the timeline does not exist remotely
            assert remote_lsn == INVALID_LSN
        else:
            restored = await load_from_remote(tmp_path / "b", store, tenant_id, 2, nursery)
            rtl = restored.timelines[timeline_id]
            dcl = rtl.disk_consistent_lsn
            assert dcl == chosen[1].disk_consistent_lsn >= remote_lsn
            await check(rtl, upto(model, dcl))
            # and the new generation goes on from there
            more = upto(model, dcl)
            await write_l0(rtl, more, 3)
            assert rtl.remote is not None
            await rtl.remote.wait_uploaded()
            await check_remote_invariant(store)
            await restored.shutdown()
        nursery.cancel_scope.cancel()


async def test_local_only_timeline_is_uploaded_at_load(tmp_path: Path) -> None:
    """A node that ran without remote storage: its timelines go up whole at the next start."""
    model = Model()
    tenant_id = TenantId.generate()
    tenant = Tenant(tmp_path / "a", tenant_id, CFG)
    tl = await tenant.create_timeline(TimelineId.generate())
    await workload(tl, model, rounds=1)
    await tenant.shutdown()
    store = make_remote_storage(LocalStorageConfig(path=tmp_path / "remote"))
    async with trio.open_nursery() as nursery:
        loaded = await Tenant.load(tmp_path / "a", tenant_id, CFG, nursery=nursery, remote=TenantRemote(store, 1))
        ltl = loaded.timelines[tl.timeline_id]
        assert ltl.remote is not None
        await ltl.remote.wait_uploaded()
        assert ltl.remote_consistent_lsn == Lsn(model.last_lsn)
        await loaded.shutdown()
        restored = await load_from_remote(tmp_path / "b", store, tenant_id, 2, nursery)
        await check(restored.timelines[tl.timeline_id], model)
        await restored.shutdown()
        nursery.cancel_scope.cancel()
