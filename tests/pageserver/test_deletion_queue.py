"""The persisted deletion queue (``pageserver.deletion_queue``): a layer leaves the remote only
after an index without it is uploaded; deletions are validated against the current generation;
and a crash at any step (the list written, the index upload, the DELETE, the list's removal)
neither leaks the objects nor deletes one a newer index names, when the same node (same disk)
comes back in the next generation. In any other generation, or when the generation is not
valid, the lists are dropped (the objects leak: safe)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from pageserver import remote_layout
from pageserver.deletion_queue import DeletionList, DeletionListError, DeletionQueue
from pageserver.remote_tenant import TenantRemote, find_index
from pageserver.tenant import Tenant
from protocol.ids import TenantId, TimelineId
from remote_storage import LocalStorageConfig, RemoteStorage, make_remote_storage
from tests.pageserver.remote_helpers import FaultyStorage, check_remote_invariant
from tests.pageserver.test_compaction_concurrency import CFG, Model, check, write_l0
from tests.pageserver.test_remote_upload import upto, workload


async def _never_valid() -> bool:
    return False


async def remote_keys(store: RemoteStorage, tenant_id: TenantId, timeline_id: TimelineId) -> set[str]:
    listing = await store.list(remote_layout.timeline_prefix(tenant_id, timeline_id))
    return set(listing.keys)


async def named_keys(store: RemoteStorage, tenant_id: TenantId, timeline_id: TimelineId, gen: int) -> set[str]:
    """The keys of the newest index with generation <= gen, and the layers it names."""
    chosen = await find_index(store, tenant_id, timeline_id, gen)
    assert chosen is not None
    index_gen, part = chosen
    return {remote_layout.index_key(tenant_id, timeline_id, index_gen)} | {
        remote_layout.layer_key(tenant_id, timeline_id, n, g) for n, g in part.generations.items()
    }


async def crash_when(
    tmp_path: Path, store: FaultyStorage, queue: DeletionQueue, reached: Callable[[], Awaitable[None]],
    coalesce_indexes: bool = True,
) -> tuple[TenantId, TimelineId, Model]:
    """Run the workload in generation 1 until ``reached`` returns, then "kill -9" the node
    (cancel everything; the local disk, with the deletion lists, stays)."""
    tenant_id, timeline_id = TenantId.generate(), TimelineId.generate()
    model = Model()
    async with trio.open_nursery() as crashed:
        tenant = Tenant(tmp_path / "a", tenant_id, CFG, nursery=crashed,
                        remote=TenantRemote(store, 1, deletions=queue,
                                            coalesce_indexes=coalesce_indexes))
        tl = await tenant.create_timeline(timeline_id)
        stop = trio.Event()

        async def run() -> None:
            await workload(tl, model, rounds=3)
            assert tl.remote is not None
            await tl.remote.wait_uploaded()
            stop.set()

        async def watch() -> None:
            await reached()
            stop.set()

        crashed.start_soon(run)
        crashed.start_soon(watch)
        with trio.fail_after(120):
            await stop.wait()
        crashed.cancel_scope.cancel()
    return tenant_id, timeline_id, model


async def restart(tmp_path: Path, store: RemoteStorage, queue: DeletionQueue, tenant_id: TenantId,
                  timeline_id: TimelineId, model: Model, gen: int, nursery: trio.Nursery,
                  validate: Callable[[], Awaitable[bool]] | None = None) -> Tenant:
    """The same node (same disk) starts again, in generation ``gen``; pages equal the model."""
    remote = TenantRemote(store, gen, deletions=queue) if validate is None else TenantRemote(
        store, gen, validate, deletions=queue)
    tenant = await Tenant.load(tmp_path / "a", tenant_id, CFG, nursery=nursery, remote=remote)
    rtl = tenant.timelines[timeline_id]
    await check(rtl, upto(model, rtl.disk_consistent_lsn))
    return tenant


async def test_crash_after_the_index_before_the_delete_does_not_leak(tmp_path: Path) -> None:
    store = FaultyStorage(make_remote_storage(LocalStorageConfig(path=tmp_path / "remote")))
    queue = DeletionQueue(tmp_path / "deletion")
    store.hang("delete")
    tenant_id, timeline_id, model = await crash_when(tmp_path, store, queue, store.hung.wait)
    lists = queue.lists()
    assert lists and all(dl.generation == 1 for dl in lists)
    pending = {k for dl in lists for k in dl.keys}
    present = await remote_keys(store, tenant_id, timeline_id)
    assert pending <= present, "the crash came before the DELETE"
    assert not pending & await named_keys(store, tenant_id, timeline_id, 1), "the index dropped them"
    store.heal()

    async with trio.open_nursery() as nursery:
        tenant = await restart(tmp_path, store, queue, tenant_id, timeline_id, model, 2, nursery)
        assert queue.lists() == []
        present = await remote_keys(store, tenant_id, timeline_id)
        assert not pending & present, "recovered in the next generation: deleted, nothing leaks"
        assert present == await named_keys(store, tenant_id, timeline_id, 1)
        assert await check_remote_invariant(store) == 1
        await tenant.shutdown()
        nursery.cancel_scope.cancel()


async def test_crash_before_the_index_deletes_nothing_it_names(tmp_path: Path) -> None:
    """The list is written, the index that drops its layers never goes up: the remote's newest
    index still names them, and recovery must not delete them."""
    queue = DeletionQueue(tmp_path / "deletion")

    class HangIndexOnceListed(FaultyStorage):
        async def upload(self, key: str, data: bytes) -> None:
            if remote_layout.index_generation(key) is not None and queue.lists():
                self.hung.set()
                await trio.sleep_forever()
            await super().upload(key, data)

    store = HangIndexOnceListed(make_remote_storage(LocalStorageConfig(path=tmp_path / "remote")))
    # Every index goes up: coalesced, the index naming the first layers is superseded by the
    # compaction's queued right behind it, so no uploaded index ever names the list's layers
    # (deleting them is then safe, but that is not the case this test is about: a list whose
    # layers the remote's newest index still names). Recovery does not depend on coalescing.
    tenant_id, timeline_id, model = await crash_when(
        tmp_path, store, queue, store.hung.wait, coalesce_indexes=False)
    (dl,) = queue.lists()
    named = await named_keys(store, tenant_id, timeline_id, 1)
    assert set(dl.keys) <= named, "the uploaded index still names every key of the list"

    async with trio.open_nursery() as nursery:
        plain = store.inner
        tenant = await restart(tmp_path, plain, queue, tenant_id, timeline_id, model, 2, nursery)
        assert queue.lists() == []
        assert set(dl.keys) <= await remote_keys(plain, tenant_id, timeline_id)
        assert await check_remote_invariant(plain) == 1
        # the new generation goes on; its own compactions later delete them properly
        rtl = tenant.timelines[timeline_id]
        more = upto(model, rtl.disk_consistent_lsn)
        await workload(rtl, more, rounds=1)
        assert rtl.remote is not None
        await rtl.remote.wait_uploaded()
        left = await remote_keys(plain, tenant_id, timeline_id)
        assert not set(dl.keys) & left, "gen 2 compacted them away and deleted them"
        # what else is left: gen 2's index and layers, gen 1's index, and gen 1's layer PUTs
        # the crash left unindexed (accepted leaks, remote-storage.md §2.3)
        orphans = left - await named_keys(plain, tenant_id, timeline_id, 2) - {
            remote_layout.index_key(tenant_id, timeline_id, 1)}
        assert all(k.endswith("-00000001") for k in orphans)
        assert not orphans & named, "every one of them was never named by an index"
        assert queue.lists() == []
        await tenant.shutdown()
        nursery.cancel_scope.cancel()


async def test_crash_after_the_delete_before_the_list_is_removed(tmp_path: Path) -> None:
    """The DELETE went through, the list stayed: recovery deletes again (a no-op) and forgets it."""
    store = FaultyStorage(make_remote_storage(LocalStorageConfig(path=tmp_path / "remote")))
    queue = DeletionQueue(tmp_path / "deletion")
    store.hang("delete")
    tenant_id, timeline_id, model = await crash_when(tmp_path, store, queue, store.hung.wait)
    lists = queue.lists()
    await store.inner.delete_objects([k for dl in lists for k in dl.keys])
    async with trio.open_nursery() as nursery:
        tenant = await restart(tmp_path, store.inner, queue, tenant_id, timeline_id, model, 2, nursery)
        assert queue.lists() == []
        assert await remote_keys(store.inner, tenant_id, timeline_id) == await named_keys(
            store.inner, tenant_id, timeline_id, 1)
        await tenant.shutdown()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("how", ["later-generation", "not-valid"])
async def test_lists_of_another_lineage_are_dropped(tmp_path: Path, how: str) -> None:
    """Back in a generation that is not the successor (another node held the tenant in
    between), or not valid: nothing of the lists is deleted, they are forgotten."""
    store = FaultyStorage(make_remote_storage(LocalStorageConfig(path=tmp_path / "remote")))
    queue = DeletionQueue(tmp_path / "deletion")
    store.hang("delete")
    tenant_id, timeline_id, model = await crash_when(tmp_path, store, queue, store.hung.wait)
    pending = {k for dl in queue.lists() for k in dl.keys}
    assert pending
    gen, validate = (3, None) if how == "later-generation" else (2, _never_valid)
    async with trio.open_nursery() as nursery:
        tenant = await restart(tmp_path, store.inner, queue, tenant_id, timeline_id, model, gen, nursery,
                               validate)
        assert queue.lists() == []
        assert pending <= await remote_keys(store.inner, tenant_id, timeline_id), "leaked, not deleted"
        assert await check_remote_invariant(store.inner) == 1
        await tenant.shutdown()
        nursery.cancel_scope.cancel()


async def test_list_is_durable_before_the_index_and_deleted_after(tmp_path: Path) -> None:
    """Order of every step, with the list's write failing twice (disk error: retried, and the
    index waits for it): persist < index upload < DELETE < list removed; a stale generation at
    run time drops the deletion and its list."""
    events: list[tuple[str, object]] = []

    class Recording(DeletionQueue):
        failures = 2

        def persist(self, tenant_id: TenantId, timeline_id: TimelineId, generation: int,
                    keys: object) -> DeletionList:
            if self.failures:
                self.failures -= 1
                raise OSError("injected: no space left on device")
            dl = super().persist(tenant_id, timeline_id, generation, keys)  # type: ignore[arg-type]
            events.append(("persist", dl.sequence))
            return dl

        def done(self, dl: DeletionList) -> None:
            events.append(("done", dl.sequence))
            super().done(dl)

    class Logged(FaultyStorage):
        async def upload(self, key: str, data: bytes) -> None:
            await super().upload(key, data)
            if remote_layout.index_generation(key) is not None:
                events.append(("index", None))

        async def delete_objects(self, keys: object) -> None:
            await super().delete_objects(keys)  # type: ignore[arg-type]
            events.append(("delete", None))

    store = Logged(make_remote_storage(LocalStorageConfig(path=tmp_path / "remote")))
    queue = Recording(tmp_path / "deletion")
    model = Model()
    valid = True

    async def validate() -> bool:
        return valid

    async with trio.open_nursery() as nursery:
        tenant = Tenant(tmp_path / "a", TenantId.generate(), CFG, nursery=nursery,
                        remote=TenantRemote(store, 1, validate, deletions=queue))
        tl = await tenant.create_timeline(TimelineId.generate())
        await workload(tl, model, rounds=2)
        assert tl.remote is not None
        await tl.remote.wait_uploaded()
        assert queue.failures == 0 and queue.lists() == []
        seqs = [s for e, s in events if e == "persist"]
        assert len(seqs) >= 2
        for seq in seqs:
            at = events.index(("persist", seq))
            after = [e for e, _ in events[at + 1:]]
            assert after[0] == "index", events[at:at + 3]
            i_delete = after.index("delete")
            assert "index" in after[:i_delete]
            assert ("done", seq) in events[at + 1 + i_delete:], "forgotten only after its DELETE"
        await check_remote_invariant(store)

        # stale: the deletion is dropped, its list too, the objects stay
        valid = False
        events.clear()
        before = set((await store.list(remote_layout.tenants_prefix())).keys)
        await write_l0(tl, model, 3)
        await tl.compact()
        await tl.gc()
        await tl.remote.wait_uploaded()
        assert ("delete", None) not in events and any(e == "persist" for e, _ in events)
        assert queue.lists() == []
        after_keys = set((await store.list(remote_layout.tenants_prefix())).keys)
        assert before - after_keys == set(), "nothing deleted in a stale generation"
        await check(tl, model)
        await tenant.shutdown()
        nursery.cancel_scope.cancel()


def test_hostile_list_files(tmp_path: Path) -> None:
    queue = DeletionQueue(tmp_path)
    dl = queue.persist(TenantId.generate(), TimelineId.generate(), 7, ["a", "b"])
    assert DeletionList.from_file(dl.path) == dl
    (tmp_path / "0000000000000099.list.___temp").write_text("half")
    for body in [b"", b"{", b"[]", b'{"version": 2}', dl.to_json()[:-5],
                 dl.to_json().replace(b'"keys": ["a", "b"]', b'"keys": "ab"'),
                 dl.to_json().replace(b'"generation": 7', b'"generation": "7"')]:
        dl.path.write_bytes(body)
        with pytest.raises(DeletionListError, match=str(dl.path)):
            queue.lists()
    dl.path.unlink()
    again = DeletionQueue(tmp_path)
    assert not list(tmp_path.glob("*.___temp")), "an interrupted write is cleaned up"
    kept = again.persist(TenantId.generate(), TimelineId.generate(), 1, ["c"])
    assert DeletionQueue(tmp_path).persist(TenantId.generate(), TimelineId.generate(), 1, []).sequence > kept.sequence
