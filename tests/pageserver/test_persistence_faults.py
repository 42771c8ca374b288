"""Fault injection around index_part: a write of it that fails at each of its steps.

``write_index_part`` makes the new list durable in steps (temp file fsynced, renamed over the
old one, directory fsynced). A failure before the rename leaves the old list on disk; one at the
directory fsync leaves the new list *visible* (and, after a crash, quite possibly durable)
although the caller got an error. Whatever the step, the process must then keep:

- ``disk_consistent_lsn`` (what the WAL receiver tells the safekeepers they may forget) at a
  value some durable index_part holds, never above it;
- every file that either the old or the new list names, so that a restart (``Tenant.load`` on
  the directory, without a clean shutdown) finds a consistent timeline that reads like the
  model.

And a load that finds index_part naming a missing file stops with an error naming it before it
deletes anything (the unlisted files may be what a repair needs).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import trio

import pageserver.storage.index_part as index_part_mod
import pageserver.storage.layer_file as layer_file_mod
import pageserver.tenant as tenant_mod
import pageserver.tenant_manager as tenant_manager_mod
from pageserver.config import PageserverConfig
from pageserver.storage.index_part import read_index_part
from pageserver.storage.io_engine import IoEngine, durable_rename
from pageserver.storage.io_engine import fsync_dir as real_fsync_dir
from pageserver.storage.layer_file import LayerCorruptionError
from pageserver.tenant import Tenant
from pageserver.tenant_manager import TenantManager
from pageserver.timeline import Timeline, TimelineShutdownError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from tests.pageserver.test_compaction_concurrency import (
    CFG,
    KEYS,
    STEP,
    Model,
    check,
    new_timeline,
    write,
    write_l0,
)

real_durable_rename = durable_rename


class IndexWriteFault:
    """Makes the next ``arm``-ed index_part write fail at ``step``: ``"fsync"`` (the temp file's
    fsync: nothing renamed) or ``"dir_fsync"`` (renamed, the directory fsync fails)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.step: str | None = None
        self.hits = 0
        monkeypatch.setattr(index_part_mod, "durable_rename", self)

    def arm(self, step: str) -> None:
        self.step = step

    async def __call__(self, engine: IoEngine, tmp: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
        step, self.step = self.step, None
        if step is None:
            await real_durable_rename(engine, tmp, final)
            return
        self.hits += 1
        if step == "dir_fsync":
            os.replace(tmp, final)
        raise OSError(5, f"injected EIO at {step} of {final}")


async def crash_and_load(tmp_path: Path, tenant: Tenant, tl: Timeline) -> tuple[Tenant, Timeline]:
    """Load the tenant from its directory as a restarted process would: the running one is
    not shut down first (its files are only closed afterwards, by the caller)."""
    reloaded = await Tenant.load(tmp_path, tenant.tenant_id, CFG)
    again = reloaded.timelines[tl.timeline_id]
    part = await read_index_part(again.engine, again.path)
    assert set(part.layers) == {x.path.name for x in again.layer_map}
    assert again.last_record_lsn == again.disk_consistent_lsn == part.disk_consistent_lsn
    return reloaded, again


def durable_model(model: Model, lsn: int) -> Model:
    kept = Model()
    kept.ops = [op for op in model.ops if op[0] <= lsn]
    return kept


@pytest.mark.parametrize("step", ["fsync", "dir_fsync"])
async def test_flush_whose_index_part_write_fails_keeps_disk_consistent_lsn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    fault = IndexWriteFault(monkeypatch)
    tenant, tl, model = await new_timeline(tmp_path)
    durable = tl.disk_consistent_lsn
    for _ in range(3):
        await write(tl, model, model.last_lsn + STEP, KEYS[::2])
    fault.arm(step)
    with pytest.raises(OSError, match="injected"):
        await tl.flush()
    assert fault.hits == 1
    # The safekeepers are told disk_consistent_lsn: it must not name WAL no durable
    # index_part covers (after "fsync" nothing new is on disk at all).
    assert tl.disk_consistent_lsn == durable
    await check(tl, model)  # nothing ingested is lost to readers either

    # A crash now: the restarted timeline is one of the two lists, whole.
    reloaded, again = await crash_and_load(tmp_path, tenant, tl)
    assert again.disk_consistent_lsn in (durable, model.last_lsn)
    if step == "fsync":
        assert again.disk_consistent_lsn == durable
    await check(again, durable_model(model, again.disk_consistent_lsn))
    await reloaded.shutdown()

    # Or no crash: the next flush writes it all, and a restart finds everything.
    await write(tl, model, model.last_lsn + STEP, KEYS[1::2])
    await tl.flush()
    assert tl.disk_consistent_lsn == model.last_lsn
    await check(tl, model)
    await tenant.shutdown()
    reloaded, again = await crash_and_load(tmp_path, tenant, tl)
    assert again.disk_consistent_lsn == model.last_lsn
    await check(again, model)
    await reloaded.shutdown()


@pytest.mark.parametrize("step", ["fsync", "dir_fsync"])
async def test_compaction_whose_index_part_write_fails_leaves_a_loadable_timeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    fault = IndexWriteFault(monkeypatch)
    tenant, tl, model = await new_timeline(tmp_path)
    l0s = {x.path.name for x in tl.layer_map.l0_layers()}
    fault.arm(step)
    with pytest.raises(OSError, match="injected"):
        await tl.compact()
    assert fault.hits == 1
    assert {x.path.name for x in tl.layer_map} == l0s  # the round changed nothing in memory
    await check(tl, model)  # reads (which also empty the graveyard) still see everything

    reloaded, again = await crash_and_load(tmp_path, tenant, tl)
    assert again.disk_consistent_lsn == model.last_lsn
    await check(again, model)
    await reloaded.shutdown()

    # The round can be retried (its outputs have the same names), and a restart agrees.
    await tl.compact()
    assert not tl.layer_map.l0_layers()
    await check(tl, model)
    await tenant.shutdown()
    reloaded, again = await crash_and_load(tmp_path, tenant, tl)
    await check(again, model)
    await reloaded.shutdown()


@pytest.mark.parametrize("step", ["fsync", "dir_fsync"])
async def test_image_creation_whose_index_part_write_fails_leaves_a_loadable_timeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    fault = IndexWriteFault(monkeypatch)
    tenant, tl, model = await new_timeline(tmp_path)
    await tl.compact()  # L1s now; the next forced round only makes images
    before = {x.path.name for x in tl.layer_map}
    fault.arm(step)
    with pytest.raises(OSError, match="injected"):
        await tl.compact(force_image=True)
    assert fault.hits == 1
    assert {x.path.name for x in tl.layer_map} == before
    await check(tl, model)

    reloaded, again = await crash_and_load(tmp_path, tenant, tl)
    await check(again, model)
    await reloaded.shutdown()

    await tl.compact(force_image=True)
    assert any(not x.desc.is_delta for x in tl.layer_map)
    await write_l0(tl, model, 2)
    await check(tl, model)
    await tenant.shutdown()
    reloaded, again = await crash_and_load(tmp_path, tenant, tl)
    await check(again, model)
    await reloaded.shutdown()


async def test_load_deletes_nothing_when_a_listed_layer_is_missing(tmp_path: Path) -> None:
    tenant, tl, model = await new_timeline(tmp_path)
    await write(tl, model, model.last_lsn + STEP, KEYS)
    await tl.flush()
    await tenant.shutdown()
    listed = sorted(x.name for x in tl.path.iterdir() if x.name != "index_part.json")
    # An unlisted layer (e.g. what a crash left) and a listed one gone missing.
    stray = tl.path / (listed[0] + ".___temp")
    stray.write_bytes(b"leftover")
    missing = tl.path / listed[-1]
    moved = tmp_path / "moved-away"
    os.rename(missing, moved)
    before = sorted(x.name for x in tl.path.iterdir())
    with pytest.raises(LayerCorruptionError, match=missing.name):
        await Tenant.load(tmp_path, tenant.tenant_id, CFG)
    assert sorted(x.name for x in tl.path.iterdir()) == before

    # Put back, the timeline loads whole and the leftover goes.
    os.rename(moved, missing)
    reloaded, again = await crash_and_load(tmp_path, tenant, tl)
    assert not stray.exists()
    await check(again, model)
    assert again.disk_consistent_lsn == Lsn(model.last_lsn)
    await reloaded.shutdown()


async def test_a_branch_point_is_durable_in_the_ancestor_before_the_branch(tmp_path: Path) -> None:
    """A branch at the ancestor's ``last_record_lsn`` while the WAL below it is only in the
    ancestor's in-memory layer: after a crash the branch (durable on return) must not read
    the ancestor as of its older ``disk_consistent_lsn`` (a stale page, no error)."""
    tenant, main, model = await new_timeline(tmp_path)
    await write(main, model, model.last_lsn + STEP, KEYS)  # in memory only
    branch_lsn = Lsn(model.last_lsn)
    assert main.disk_consistent_lsn < branch_lsn
    child = await tenant.create_timeline(TimelineId.generate(), ancestor=main, ancestor_lsn=branch_lsn)
    assert main.disk_consistent_lsn >= branch_lsn
    await tenant.shutdown()  # drops in-memory layers, as a crash would

    reloaded = await Tenant.load(tmp_path, tenant.tenant_id, CFG)
    again = reloaded.timelines[child.timeline_id]
    assert again.ancestor is not None and again.ancestor.last_record_lsn >= branch_lsn
    for key in KEYS:
        assert await again.get(key, branch_lsn) == model.value(key, branch_lsn)
    await reloaded.shutdown()


@pytest.mark.parametrize("where", [layer_file_mod, index_part_mod])
async def test_shutdown_during_a_flush_never_writes_an_index_part_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: ModuleType
) -> None:
    """``Timeline.shutdown`` closes the layers and empties the layer map; a flush that was
    already writing an L0 (another task, not cancelled) must not then write an index_part:
    built from the emptied map, it would list that L0 alone, and the next load would delete
    every other layer file of the timeline as unlisted. Nor may one whose index_part write
    was under way when shutdown came put its L0 in the emptied map (a file left open)."""
    tenant, tl, model = await new_timeline(tmp_path)
    listed = set((await read_index_part(tl.engine, tl.path)).layers)
    await write(tl, model, model.last_lsn + STEP, KEYS)
    reached, release = trio.Event(), trio.Event()

    async def paused_rename(engine: IoEngine, tmp: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
        # The L0 is written whole (its data read from the in-memory layer): only its rename
        # into place, or index_part's, is left when shutdown comes.
        reached.set()
        await release.wait()
        await real_durable_rename(engine, tmp, final)

    monkeypatch.setattr(where, "durable_rename", paused_rename)
    failure: list[BaseException] = []

    async def flush() -> None:
        try:
            await tl.flush()
        except Exception as exc:
            failure.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(flush)
        await reached.wait()
        await tl.shutdown()
        release.set()
    # A clear error (not whatever the flush trips over in the closed timeline next).
    assert [type(x) for x in failure] == [TimelineShutdownError], failure
    part = await read_index_part(tl.engine, tl.path)
    assert listed <= set(part.layers)
    assert len(part.layers) == len(listed) + (where is index_part_mod)
    await tenant.shutdown()
    reloaded = await Tenant.load(tmp_path, tenant.tenant_id, CFG)
    again = reloaded.timelines[tl.timeline_id]
    await check(again, durable_model(model, again.disk_consistent_lsn))
    await reloaded.shutdown()


@pytest.mark.parametrize("step", ["fsync", "dir_fsync"])
async def test_gc_whose_index_part_write_fails_leaves_a_loadable_timeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    fault = IndexWriteFault(monkeypatch)
    tenant, tl, model = await new_timeline(tmp_path)
    await tl.compact(force_image=True)
    await write_l0(tl, model, 2)
    await tl.compact(force_image=True)  # newer images: the older layers are GC victims
    before = {x.path.name for x in tl.layer_map}
    fault.arm(step)
    with pytest.raises(OSError, match="injected"):
        await tl.gc()
    assert fault.hits == 1
    assert {x.path.name for x in tl.layer_map} == before
    reloaded, again = await crash_and_load(tmp_path, tenant, tl)
    await check(again, model)
    await reloaded.shutdown()

    assert await tl.gc()
    await check(tl, model)
    await tenant.shutdown()
    reloaded, again = await crash_and_load(tmp_path, tenant, tl)
    await check(again, model)
    await reloaded.shutdown()


class FsJournal:
    """Records the directory removals, fsyncs and unlinks of the code under test, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ops: list[tuple[str, Path]] = []
        real_rmtree, real_unlink = shutil.rmtree, Path.unlink

        def rmtree(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> None:
            self.ops.append(("rmtree", Path(path)))
            real_rmtree(path, *args, **kwargs)

        def unlink(path: Path, missing_ok: bool = False) -> None:
            self.ops.append(("unlink", path))
            real_unlink(path, missing_ok=missing_ok)

        async def fsync_dir(engine: IoEngine, directory: str | os.PathLike[str]) -> None:
            self.ops.append(("fsync", Path(directory)))
            await real_fsync_dir(engine, directory)

        monkeypatch.setattr(shutil, "rmtree", rmtree)
        monkeypatch.setattr(Path, "unlink", unlink)
        monkeypatch.setattr(tenant_mod, "fsync_dir", fsync_dir)
        monkeypatch.setattr(tenant_manager_mod, "fsync_dir", fsync_dir)

    def assert_removed_durably_before(self, removed: Path, marker: Path) -> None:
        """``removed``'s removal was made durable (its parent fsynced) before ``marker`` was
        unlinked: else a crash may keep the unlink and lose the removal, and the next load
        takes the half-made timeline, marker gone, for a complete one."""
        r = self.ops.index(("rmtree", removed))
        m = self.ops.index(("unlink", marker))
        assert ("fsync", removed.parent) in self.ops[r:m], self.ops


async def test_load_makes_the_removal_of_an_unfinished_timeline_durable_before_its_marker_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = Tenant(tmp_path, TenantId.generate(), CFG)
    tid = TimelineId.generate()
    tenant.timelines_dir.mkdir(parents=True)
    await tenant.mark_uninit(tid)
    tl = await tenant.create_timeline(tid)
    await write(tl, Model(), STEP, KEYS)
    await tl.flush()  # a half import with a durable index_part, as a rolled flush leaves
    await tenant.shutdown()

    journal = FsJournal(monkeypatch)
    reloaded = await Tenant.load(tmp_path, tenant.tenant_id, CFG)
    assert reloaded.timelines == {} and not tl.path.exists() and not tenant.uninit_marker(tid).exists()
    journal.assert_removed_durably_before(tl.path, tenant.uninit_marker(tid))
    await reloaded.shutdown()


async def test_a_failed_import_is_removed_durably_before_its_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "pgdata"
    source.mkdir()

    async def failing_import(tl: Timeline, src: Path, *, wal_tar: Path | None = None) -> None:
        await write(tl, Model(), STEP, KEYS)
        await tl.flush()
        raise OSError(5, "injected: the import fails half-way")

    monkeypatch.setattr(tenant_manager_mod, "import_datadir", failing_import)
    manager = TenantManager(PageserverConfig(workdir=tmp_path / "ps", tenant_config=CFG))
    tenant = await manager.create_tenant()
    tid = TimelineId.generate()
    journal = FsJournal(monkeypatch)
    with pytest.raises(OSError, match="injected"):
        await manager.import_timeline(tenant.tenant_id, tid, source)
    path = tenant.timelines_dir / tid.hex
    assert not path.exists() and not tenant.uninit_marker(tid).exists()
    journal.assert_removed_durably_before(path, tenant.uninit_marker(tid))
    await manager.shutdown()
