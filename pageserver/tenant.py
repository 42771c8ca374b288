"""A tenant: its directory, its timelines (with their ancestry), and loading them on restart.

Layout: ``<tenant dir>/timelines/<timeline id>/`` holds ``index_part.json``, the layer files it
lists and, while running, ephemeral files. A timeline exists once its first ``index_part.json``
is durable; a directory without one is the leftover of an interrupted creation and is removed at
load (if it holds anything but temp files, loading stops with an error instead: deleting layer
files nothing lists is not a guess to make). A timeline whose contents are filled after it is
created (bootstrap, import) is marked ``<timeline id>.___uninit`` next to its directory until
it is complete and durable; at load a marked timeline is removed with its marker, as Neon
does, so a crash in the middle of an import leaves no half-imported timeline behind. Loading opens exactly the layers index_part lists (checking each file's size and summary)
and deletes every other file in the directory (temp files, ephemeral files, layers that a
compaction or GC had already unlisted). Timelines load ancestors first.

The materialized page cache and the layer-index block cache are shared by the tenant's
timelines; so is the graveyard that defers deleting replaced layers until no read is running.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Set as AbstractSet
from pathlib import Path

import structlog
import trio

from pageserver.remote_tenant import TenantRemote, make_client, prepare_tenant_dir
from pageserver.storage.config import StorageConfig
from pageserver.storage.delta_layer import PersistentLayer
from pageserver.storage.index_part import INDEX_PART, IndexPart, read_index_part
from pageserver.storage.io_engine import IoEngine, fsync_dir, make_io_engine
from pageserver.storage.layer_file import IndexBlockCache, LayerCorruptionError
from pageserver.storage.page_cache import PageCache
from pageserver.storage.reconstruct import RedoManager, TestRedoManager
from pageserver.timeline import LayerGraveyard, Timeline
from protocol.ids import TenantId, TimelineId
from protocol.lsn import INVALID_LSN, Lsn, format_lsn

log = structlog.get_logger("pageserver.tenant")

UNINIT_SUFFIX = ".___uninit"
_TEMP_MARK = ".___temp"  # index_part.json.___temp, <layer>.___temp, <layer>.___temp.index


class TimelineExistsError(Exception):
    pass


class Tenant:
    def __init__(
        self,
        path: Path,
        tenant_id: TenantId,
        config: StorageConfig,
        *,
        engine: IoEngine | None = None,
        redo: RedoManager | None = None,
        nursery: trio.Nursery | None = None,
        remote: TenantRemote | None = None,
    ) -> None:
        if remote is not None and nursery is None:
            raise ValueError("a tenant with remote storage needs a nursery for its upload queues")
        self.path = path
        self.remote = remote
        self.tenant_id = tenant_id
        self.config = config
        self.engine = engine if engine is not None else make_io_engine(config.io_engine, write_sync_mode=config.io_sync_mode)
        self.redo: RedoManager = redo if redo is not None else TestRedoManager()
        self.nursery = nursery
        self.page_cache = PageCache(config.page_cache_size)
        self.index_cache = IndexBlockCache(config.index_cache_blocks)
        # A tenant that evicts pins layers per read, so that constant reads do not stop eviction.
        self.graveyard = LayerGraveyard(per_layer=config.max_local_layer_bytes > 0 and remote is not None)
        self.timelines: dict[TimelineId, Timeline] = {}
        self.background_failures = 0  # failed compaction / GC rounds (each one logged)
        # Timelines between mark_uninit and clear_uninit: their creator's alone (a failed
        # creation shuts one down and removes its directory), so background jobs skip them.
        self.creating: set[TimelineId] = set()

    @property
    def timelines_dir(self) -> Path:
        return self.path / "timelines"

    def uninit_marker(self, timeline_id: TimelineId) -> Path:
        """While this file exists the timeline is not complete (see the module docstring)."""
        return self.timelines_dir / (timeline_id.hex + UNINIT_SUFFIX)

    async def mark_uninit(self, timeline_id: TimelineId) -> None:
        """Durably mark ``timeline_id`` as being filled; call before creating it."""
        marker = self.uninit_marker(timeline_id)
        self.creating.add(timeline_id)
        await self.engine.run_sync(_create_marker, marker)
        await fsync_dir(self.engine, self.timelines_dir)

    async def clear_uninit(self, timeline_id: TimelineId) -> None:
        """Durably declare ``timeline_id`` complete; call once it is flushed."""
        await self.engine.run_sync(lambda: self.uninit_marker(timeline_id).unlink(missing_ok=True))
        await fsync_dir(self.engine, self.timelines_dir)
        self.creating.discard(timeline_id)
        tl = self.timelines.get(timeline_id)
        if tl is not None and tl.remote is not None:
            tl.remote.activate()  # complete now: the remote may see it

    def _new_timeline(
        self,
        timeline_id: TimelineId,
        ancestor: Timeline | None,
        ancestor_lsn: Lsn,
        start_lsn: Lsn,
        remote_index: IndexPart | None = None,
    ) -> Timeline:
        tl = Timeline(
            tenant_id=self.tenant_id,
            timeline_id=timeline_id,
            path=self.timelines_dir / timeline_id.hex,
            config=self.config,
            engine=self.engine,
            redo=self.redo,
            page_cache=self.page_cache,
            index_cache=self.index_cache,
            graveyard=self.graveyard,
            ancestor=ancestor,
            ancestor_lsn=ancestor_lsn,
            start_lsn=start_lsn,
            nursery=self.nursery,
        )
        if self.remote is not None:
            assert self.nursery is not None
            tl.remote = make_client(
                self.remote, self.tenant_id, timeline_id, tl.path, remote_index,
                pins=self.graveyard.pins, on_unpinned=self.graveyard.collect,
            )
            self.nursery.start_soon(tl.remote.run, name=f"remote.{timeline_id.hex[:8]}")
        return tl

    async def create_timeline(
        self,
        timeline_id: TimelineId,
        *,
        ancestor: Timeline | None = None,
        ancestor_lsn: Lsn | None = None,
        start_lsn: Lsn = INVALID_LSN,
    ) -> Timeline:
        """A new empty timeline, or a branch of ``ancestor`` at ``ancestor_lsn`` (default: its
        ``last_record_lsn``). Durable when this returns."""
        if timeline_id in self.timelines:
            raise TimelineExistsError(f"timeline {timeline_id} already exists")
        if ancestor is not None:
            lsn = ancestor.last_record_lsn if ancestor_lsn is None else ancestor_lsn
            if lsn > ancestor.last_record_lsn:
                raise ValueError(
                    f"branch point {format_lsn(lsn)} is above the ancestor's last_record_lsn "
                    f"{format_lsn(ancestor.last_record_lsn)}"
                )
            if lsn < ancestor.latest_gc_cutoff_lsn:
                raise ValueError(
                    f"branch point {format_lsn(lsn)} is below the ancestor's GC cutoff "
                    f"{format_lsn(ancestor.latest_gc_cutoff_lsn)}"
                )
            start_lsn = lsn
        else:
            lsn = INVALID_LSN
        tl = self._new_timeline(timeline_id, ancestor, lsn, start_lsn)
        tl.path.mkdir(parents=True, exist_ok=False)
        # Listed before the first await: a GC of the ancestor running meanwhile must keep
        # what the branch point needs (``children_branch_points``).
        self.timelines[timeline_id] = tl
        try:
            if ancestor is not None and ancestor.disk_consistent_lsn < lsn:
                # The branch is durable on return, so its branch point must be too: else a
                # restart loads the ancestor at its older disk_consistent_lsn and the branch
                # reads it there (stale pages, no error) until its WAL is ingested again.
                await ancestor.flush()
            # Listed already, so a GC round may be writing its index_part too: take turns.
            await tl.write_index_part_locked()
            await fsync_dir(self.engine, self.timelines_dir)
            if tl.remote is not None and timeline_id not in self.creating:
                tl.remote.activate()
        except BaseException:
            if tl.remote is not None:
                tl.remote.stop()
            del self.timelines[timeline_id]
            # No index_part: nothing to keep (a load would remove it too); a retry may mkdir.
            with trio.CancelScope(shield=True):
                await self.engine.run_sync(shutil.rmtree, tl.path, True)
            raise
        return tl

    def children_branch_points(self, timeline: Timeline) -> list[Lsn]:
        return sorted(
            t.ancestor_lsn for t in self.timelines.values() if t.ancestor is timeline
        )

    async def gc(self) -> dict[TimelineId, list[str]]:
        """GC every timeline, keeping what child branches read below their branch points."""
        removed: dict[TimelineId, list[str]] = {}
        # A snapshot: timelines come and go during the awaits (a dict changing size under
        # the iteration would fail the round).
        for tid, tl in list(self.timelines.items()):
            if tid in self.creating or self.timelines.get(tid) is not tl:
                continue
            # Evaluated under the timeline's lock (see Timeline.gc), not now: a branch created
            # while this waits for the lock must count.
            removed[tid] = await tl.gc(functools.partial(self.children_branch_points, tl))
        return removed

    @classmethod
    async def load(
        cls,
        path: Path,
        tenant_id: TenantId,
        config: StorageConfig,
        *,
        engine: IoEngine | None = None,
        redo: RedoManager | None = None,
        nursery: trio.Nursery | None = None,
        remote: TenantRemote | None = None,
    ) -> Tenant:
        """Load the tenant from ``path``; with ``remote``, first make the directory agree with
        the remote indexes (``pageserver.remote_tenant``: the remote wins)."""
        tenant = cls(path, tenant_id, config, engine=engine, redo=redo, nursery=nursery, remote=remote)
        tdir = tenant.timelines_dir
        tdir.mkdir(parents=True, exist_ok=True)
        remote_indexes: dict[TimelineId, IndexPart] = {}
        remote_only: dict[TimelineId, set[str]] = {}
        if remote is not None:
            remote_indexes, remote_only = await prepare_tenant_dir(remote, tenant_id, path)
        parts = {}
        entries = sorted(tdir.iterdir())
        unfinished = {e.name.removesuffix(UNINIT_SUFFIX) for e in entries if e.name.endswith(UNINIT_SUFFIX)}
        for entry in entries:
            if entry.name.endswith(UNINIT_SUFFIX):
                continue
            if entry.name in unfinished:
                log.warning("removing a timeline whose creation did not finish",
                            tenant_id=tenant_id.hex, timeline_id=entry.name)
                shutil.rmtree(entry)
                continue
            if not (entry / INDEX_PART).exists():
                others = sorted(p.name for p in entry.iterdir() if _TEMP_MARK not in p.name)
                if others:
                    raise LayerCorruptionError(
                        entry, f"no {INDEX_PART}, but {len(others)} other files ({others[0]}, ...): "
                        "not deleting what nothing lists"
                    )
                shutil.rmtree(entry)  # an interrupted create_timeline
                continue
            parts[TimelineId.parse(entry.name)] = await read_index_part(tenant.engine, entry)
        # Markers go only after their directories, durably removed (an fsync between): else
        # a crash could keep a marker's unlink and lose a directory's removal, and the next
        # load would take that half-made timeline for a complete one. A crash in between
        # leaves a marker alone, which the next load removes.
        if unfinished:
            await fsync_dir(tenant.engine, tdir)
        for name in unfinished:
            (tdir / (name + UNINIT_SUFFIX)).unlink()
        if unfinished:
            await fsync_dir(tenant.engine, tdir)
        remaining = dict(parts)
        while remaining:
            progressed = False
            for tid, part in list(remaining.items()):
                ancestor: Timeline | None = None
                if part.ancestor_timeline_id is not None:
                    aid = TimelineId.parse(part.ancestor_timeline_id)
                    if aid not in parts:
                        raise LayerCorruptionError(tdir / tid.hex / INDEX_PART, f"ancestor {aid} is missing")
                    if aid not in tenant.timelines:
                        continue
                    ancestor = tenant.timelines[aid]
                tl = tenant._new_timeline(
                    tid, ancestor, part.ancestor_lsn, part.disk_consistent_lsn, remote_indexes.get(tid)
                )
                tl.latest_gc_cutoff_lsn = part.latest_gc_cutoff_lsn
                try:
                    await _load_layers(tl, part.layers, remote_only.get(tid, set()))
                except BaseException:
                    if tl.remote is not None:
                        tl.remote.stop()
                    raise
                tenant.timelines[tid] = tl
                if tl.remote is not None:
                    if tid not in remote_indexes:
                        # Only here (never uploaded): the remote gets all of it.
                        tl.remote.schedule_index_upload(tl.index_part())
                    tl.remote.activate()
                del remaining[tid]
                progressed = True
            if not progressed:
                raise LayerCorruptionError(tdir, "timeline ancestry has a cycle")
        return tenant

    async def run_background_jobs(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run until cancelled: every ``compaction_period_s`` flush layers older than
        ``checkpoint_timeout_s`` and compact every timeline; every ``gc_period_s`` GC the tenant.
        A period of 0 disables that job (Neon's convention).

        A failed round (a page that cannot be reconstructed for an image layer, a full disk) is
        logged with its traceback, counted, and tried again next period, as Neon does: one
        timeline's trouble must not end the jobs of the others, nor take the node down with
        it. Nothing is lost by a failed round: its outputs are discarded and the layers it
        would have replaced stay listed. A compaction round does not stop the timeline's WAL
        ingest: it holds the timeline's layers lock only to swap its outputs in
        (``Timeline.compact``); it and GC take turns on the timeline's background lock."""
        cfg = self.config

        async def compaction_loop() -> None:
            while True:
                await trio.sleep(cfg.compaction_period_s)
                for tl in list(self.timelines.values()):
                    if tl.timeline_id in self.creating or tl.timeline_id not in self.timelines:
                        continue  # being created, or removed since the round began
                    try:
                        await tl.flush_if_old()
                        await tl.compact()
                    except Exception:
                        self.background_failures += 1
                        log.error("compaction failed; retrying next period", tenant_id=self.tenant_id.hex,
                                  timeline_id=tl.timeline_id.hex, exc_info=True)

        async def gc_loop() -> None:
            while True:
                await trio.sleep(cfg.gc_period_s)
                try:
                    await self.gc()
                except Exception:
                    self.background_failures += 1
                    log.error("gc failed; retrying next period", tenant_id=self.tenant_id.hex, exc_info=True)

        async def eviction_loop() -> None:
            while True:
                await trio.sleep(cfg.eviction_period_s)
                try:
                    await self.evict_to_budget()
                except Exception:
                    self.background_failures += 1
                    log.error("eviction failed; retrying next period", tenant_id=self.tenant_id.hex, exc_info=True)

        async with trio.open_nursery() as nursery:
            if cfg.max_local_layer_bytes > 0 and self.remote is not None:
                nursery.start_soon(eviction_loop, name="tenant.eviction")
            if cfg.compaction_period_s > 0:
                nursery.start_soon(compaction_loop, name="tenant.compaction")
            if cfg.gc_period_s > 0:
                nursery.start_soon(gc_loop, name="tenant.gc")
            task_status.started()

    def resident_layer_bytes(self) -> int:
        return sum(x.file_size for tl in self.timelines.values() for x in tl.layer_map if x.resident)

    async def evict_to_budget(self) -> int:
        """Evict local layer files, least recently used first, until the resident ones fit in
        ``max_local_layer_bytes`` (layers not uploaded yet, or in use right now, stay: the
        budget is then exceeded until the next round). Returns the bytes evicted."""
        budget = self.config.max_local_layer_bytes
        if budget <= 0 or self.remote is None:
            return 0
        resident = [(x.last_access, x.layer_id, tl, x) for tl in list(self.timelines.values())
                    if tl.timeline_id not in self.creating for x in tl.layer_map if x.resident]
        total = sum(x.file_size for *_, x in resident)
        freed = 0
        for _, _, tl, layer in sorted(resident, key=lambda r: (r[0], r[1])):
            if total <= budget:
                break
            if await tl.evict(layer):
                total -= layer.file_size
                freed += layer.file_size
        return freed

    async def shutdown(self) -> None:
        for tl in self.timelines.values():
            if tl.remote is not None:
                tl.remote.stop()
            await tl.shutdown()
        self.graveyard.readers = 0
        await self.graveyard.collect()


async def _load_layers(tl: Timeline, listed: dict[str, int], remote_only: AbstractSet[str] = frozenset()) -> None:
    """Open and check every listed layer, and only then delete the unlisted files: an
    index_part that names a missing or damaged file stops the load with an error naming it,
    and leaves the directory as it found it (the unlisted files may be what a repair needs).
    Layers in ``remote_only`` are in remote storage only: loaded evicted (downloaded on use)."""
    opened: list[PersistentLayer] = []
    try:
        for name, size in listed.items():
            if name in remote_only:
                opened.append(PersistentLayer.evicted(tl.path / name, size))
                tl.graveyard.evicted += 1
                continue
            layer = await PersistentLayer.open(tl.engine, tl.path / name, tl.index_cache)
            opened.append(layer)
            if layer.file_size != size:
                raise LayerCorruptionError(layer.path, f"size {layer.file_size} but index_part says {size}")
    except BaseException:
        for layer in opened:
            await layer.aclose()
        raise
    for entry in sorted(tl.path.iterdir()):
        name = entry.name
        if name != INDEX_PART and name not in listed:
            os.unlink(entry)  # temp, ephemeral, or a layer index_part no longer lists
    tl.layer_map.replace([], opened)
    await fsync_dir(tl.engine, tl.path)


def _create_marker(path: Path) -> None:
    with open(path, "xb") as f:
        os.fsync(f.fileno())
