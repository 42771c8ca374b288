"""Coalesced index uploads (``RemoteTimelineClient.coalesce_indexes``, the default): when L0s
are flushed faster than the store takes them, or within ``index_upload_interval_s`` of the last
index PUT, only the newest index goes up, after every layer it names. Under injected failures
of layer and index uploads, and with the state audited after every remote operation (a crash
could come at any of them): every index names only objects that are there,
``remote_consistent_lsn`` never passes the ``disk_consistent_lsn`` of an index the store has,
deletions still wait for an index without their layers, and the remote loads into an empty
directory with every page equal to the model. The same workload without coalescing sends one
index per flush (the counts differ, the remote ends the same).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from prometheus_client import REGISTRY

from pageserver import remote_layout
from pageserver.remote_tenant import TenantRemote, find_index
from pageserver.tenant import Tenant
from protocol.ids import TenantId, TimelineId
from remote_storage import LocalStorageConfig, make_remote_storage
from tests.pageserver.remote_helpers import FaultyStorage, check_remote_invariant
from tests.pageserver.test_compaction_concurrency import CFG, Model, check, write_l0
from tests.pageserver.test_remote_upload import load_from_remote

INTERVAL = 0.2


class SlowStorage(FaultyStorage):
    """Each layer upload takes ``delay`` seconds: flushes come faster than the store takes
    them, so indexes queue up behind layer uploads."""

    delay = 0.03

    async def upload_file(self, key: str, path: Path) -> int:
        await trio.sleep(self.delay)
        return await super().upload_file(key, path)


def coalesced() -> float:
    return REGISTRY.get_sample_value("pageserver_remote_coalesced_indexes_total") or 0.0


def index_puts(store: FaultyStorage) -> int:
    return sum(1 for op, key in store.calls if op == "upload" and remote_layout.INDEX_PART in key)


@pytest.mark.parametrize("coalesce", [True, False], ids=["coalesce", "fifo"])
async def test_coalesced_indexes_keep_the_invariant_under_failures(tmp_path: Path, coalesce: bool) -> None:
    store = SlowStorage(make_remote_storage(LocalStorageConfig(path=tmp_path / "remote")), audit=True)
    store.fail("upload", "*index_part.json-*", times=3)
    store.fail("upload", "*/0000*-00000001", times=3)
    store.fail("delete", times=1)
    tenant_id, timeline_id = TenantId.generate(), TimelineId.generate()
    model = Model()
    coalesced0 = coalesced()
    flushes = 0
    async with trio.open_nursery() as nursery:
        remote = TenantRemote(store, 1, coalesce_indexes=coalesce, index_upload_interval_s=INTERVAL)
        tenant = Tenant(tmp_path / "a", tenant_id, CFG, nursery=nursery, remote=remote)
        tl = await tenant.create_timeline(timeline_id)
        assert tl.remote is not None
        client = tl.remote
        await client.wait_uploaded()
        puts0 = index_puts(store)
        violations: list[str] = []

        async def watch() -> None:
            # remote_consistent_lsn only from an index the store has: read it first, then the
            # newest index (which only moves forward)
            while True:
                seen = client.remote_consistent_lsn
                chosen = await find_index(store.inner, tenant_id, timeline_id, 1)
                have = 0 if chosen is None else chosen[1].disk_consistent_lsn
                if seen > have:
                    violations.append(f"remote_consistent_lsn {seen:x} above the remote index's {have:x}")
                await trio.sleep(0.005)

        nursery.start_soon(watch)
        for _ in range(2):
            for _ in range(6):  # L0s much faster than the slow store takes them
                await write_l0(tl, model, 3)
                flushes += 1
            await tl.compact()  # unlinks the L0s: an index, then deletions
            await tl.compact(force_image=True)
            await tl.gc()
        with trio.fail_after(60):
            await client.wait_uploaded()
        assert violations == []
        assert tl.remote_consistent_lsn == tl.disk_consistent_lsn == model.last_lsn
        sent = index_puts(store) - puts0
        superseded = coalesced() - coalesced0
        if coalesce:
            # far fewer index PUTs than flushes (each flush, compaction and GC wrote an index)
            assert superseded >= flushes // 2, (superseded, flushes)
            assert sent <= flushes, (sent, flushes)
        else:
            assert sent > flushes, (sent, flushes)
        assert store.audits > 20  # the invariant held after every one of these operations
        assert {op for op, _ in store.calls} >= {"upload", "delete"}
        await tenant.shutdown()
        nursery.cancel_scope.cancel()

    assert await check_remote_invariant(store.inner) >= 1
    async with trio.open_nursery() as nursery:
        restored = await load_from_remote(tmp_path / "b", store.inner, tenant_id, 2, nursery)
        await check(restored.timelines[timeline_id], model)
        await restored.shutdown()
        nursery.cancel_scope.cancel()


async def test_an_index_waits_at_most_the_interval(tmp_path: Path) -> None:
    """Flushes within the interval: one index PUT for all of them, and it goes up about one
    interval after the previous one (remote_consistent_lsn lags by no more than that)."""
    store = FaultyStorage(make_remote_storage(LocalStorageConfig(path=tmp_path / "remote")))
    model = Model()
    async with trio.open_nursery() as nursery:
        tenant = Tenant(tmp_path / "a", TenantId.generate(), CFG, nursery=nursery,
                        remote=TenantRemote(store, 1, index_upload_interval_s=1.0))
        tl = await tenant.create_timeline(TimelineId.generate())
        assert tl.remote is not None
        await tl.remote.wait_uploaded()  # an index PUT just now: the next waits ~1 s
        puts0 = index_puts(store)
        started = trio.current_time()
        for _ in range(3):
            await write_l0(tl, model, 1)
        with trio.fail_after(5):
            while tl.remote_consistent_lsn < model.last_lsn:
                await trio.sleep(0.01)
        took = trio.current_time() - started
        assert index_puts(store) - puts0 == 1
        assert 0.5 < took < 3.0, took
        await tenant.shutdown()
        nursery.cancel_scope.cancel()
