"""A tenant's side of remote storage: its generation, finding its timelines' indexes, and making
the local directory agree with them before the tenant loads (the remote index wins).

At attach (every start of the node, and ``attach`` on the HTTP API) for each timeline that has
an index in remote storage:

- the index chosen is the one of the highest generation not above ours (a newer generation's
  index belongs to an attachment that superseded us: never read it);
- local files the index does not name, or names with another size, are deleted (work done
  after that index was uploaded: it is redone from the WAL the safekeepers kept, since they
  remove WAL only below the uploaded ``disk_consistent_lsn``);
- layers the index names and the directory lacks are downloaded (to a temp file, size-checked,
  renamed, the directory fsynced) with bounded retries;
- the local ``index_part.json`` is rewritten as the remote one.

Then the deletion lists an earlier process of this node persisted for the tenant are run or
dropped (``recover_deletions``, ``pageserver.deletion_queue``), and ``Tenant.load`` opens the
directory as usual. Timelines only the local directory has (the
node ran without remote storage, or it crashed before their first upload) are kept and
uploaded whole. The generation comes from the control plane when the node has one
(``pageserver.control_plane_client``); a node without one issues its own: one above every
generation found in the tenant's remote objects (safe only while one pageserver uses the bucket).
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import structlog
import trio

from common.fsync import fsync_dir
from pageserver import remote_layout
from pageserver.deletion_queue import DROPPED_LIST_KEYS, RECOVERED_KEYS, DeletionList, DeletionQueue
from pageserver.remote_timeline import (
    Pins,
    RemoteTimelineClient,
    Validator,
    always_valid,
)
from pageserver.storage.index_part import INDEX_PART, IndexPart
from pageserver.storage.layer_file import LayerCorruptionError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import format_lsn
from remote_storage import RemoteStorage
from remote_storage.config import Compression
from remote_storage.retry import retry

log = structlog.get_logger("pageserver.remote_tenant")



@attrs.define
class TenantRemote:
    """What a tenant's timelines need to build their upload queues."""

    storage: RemoteStorage
    generation: int
    validate: Validator = always_valid
    parallel_uploads: int = 8
    # The node's persisted deletion queue (None: deletions are not persisted; a crash between
    # an index and its deletions leaks the objects).
    deletions: DeletionQueue | None = None
    # How layer files are stored remotely (``remote_storage.compression``; the index records
    # it per layer, so either setting reads every object)
    compression: Compression = "zstd"
    compression_level: int = 1
    # Index PUTs: coalesced over the layers queued behind one, at most one per interval
    # (``RemoteTimelineClient``)
    coalesce_indexes: bool = True
    index_upload_interval_s: float = 0.5
    # A layer whose sample does not compress is stored as it is (``remote_compression``)
    compression_probe: bool = True
    # The L0 writer process compresses the L0s it writes and their uploads send that object
    # (``RemoteTimelineClient.stage_spec``). Off by default: in `bench remote` (256 MiB L0s,
    # 4 runs of 5 rounds) the ingest with uploads was 0.82-0.87 of no uploads with it and
    # 0.91-0.92 without (docs/benchmarks.md): the worker's compression competes for the same
    # two cores and delays the upload behind its claim.
    stage_in_l0_writer: bool = False


async def list_remote_tenants(storage: RemoteStorage) -> list[TenantId]:
    listing = await retry(lambda: storage.list(remote_layout.tenants_prefix(), "/"), what="list tenants")
    out = []
    for prefix in listing.prefixes:
        name = prefix.rstrip("/").rpartition("/")[2]
        try:
            out.append(TenantId.parse(name))
        except Exception:
            log.warning("ignoring a remote prefix that is not a tenant", prefix=prefix)
    return out


async def list_remote_timelines(storage: RemoteStorage, tenant_id: TenantId) -> list[TimelineId]:
    listing = await retry(
        lambda: storage.list(remote_layout.timelines_prefix(tenant_id), "/"), what="list timelines"
    )
    out = []
    for prefix in listing.prefixes:
        name = prefix.rstrip("/").rpartition("/")[2]
        try:
            out.append(TimelineId.parse(name))
        except Exception:
            log.warning("ignoring a remote prefix that is not a timeline", prefix=prefix)
    return out


async def highest_generation(storage: RemoteStorage, tenant_id: TenantId) -> int:
    """The highest generation of any index of the tenant (0: none)."""
    listing = await retry(
        lambda: storage.list(remote_layout.timelines_prefix(tenant_id)), what="list tenant indexes"
    )
    gens = [g for k in listing.keys if (g := remote_layout.index_generation(k)) is not None]
    return max(gens, default=0)


async def find_index(
    storage: RemoteStorage, tenant_id: TenantId, timeline_id: TimelineId, generation: int
) -> tuple[int, IndexPart] | None:
    """The index of the highest generation ``<= generation`` (and that generation), or None."""
    prefix = remote_layout.timeline_prefix(tenant_id, timeline_id) + remote_layout.INDEX_PART
    listing = await retry(lambda: storage.list(prefix), what=f"list {prefix}")
    gens = sorted(
        (g for k in listing.keys if (g := remote_layout.index_generation(k)) is not None and g <= generation),
        reverse=True,
    )
    if not gens:
        return None
    key = remote_layout.index_key(tenant_id, timeline_id, gens[0])
    raw = await retry(lambda: storage.download(key), what=f"download {key}")
    return gens[0], IndexPart.from_json(Path(key), raw)


def _write_local_index(directory: Path, part: IndexPart) -> None:
    local = attrs.evolve(part, generations={}, stored={})
    tmp = directory / (INDEX_PART + ".___temp")
    with open(tmp, "wb") as f:
        f.write(local.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / INDEX_PART)
    fsync_dir(directory)


def _reconcile(directory: Path, part: IndexPart) -> list[str]:
    """Delete what the remote index does not name as it is; return the names to download."""
    directory.mkdir(parents=True, exist_ok=True)
    present: set[str] = set()
    for entry in sorted(directory.iterdir()):
        name = entry.name
        if name == INDEX_PART:
            continue
        if entry.is_dir():
            shutil.rmtree(entry)
            continue
        if part.layers.get(name) == entry.stat().st_size:
            present.add(name)
            continue
        entry.unlink()  # local-only, a different size, a temp or ephemeral file
    fsync_dir(directory)
    return sorted(set(part.layers) - present)


async def prepare_tenant_dir(
    remote: TenantRemote, tenant_id: TenantId, tenant_dir: Path
) -> tuple[dict[TimelineId, IndexPart], dict[TimelineId, set[str]]]:
    """Make ``<tenant_dir>/timelines`` agree with the remote indexes (see the module docstring);
    returns each remote timeline's index (with its layers' generations), and the layers it
    names that are not on local disk (loaded as evicted: downloaded on first use)."""
    timelines_dir = tenant_dir / "timelines"
    await trio.to_thread.run_sync(lambda: timelines_dir.mkdir(parents=True, exist_ok=True))
    found: dict[TimelineId, IndexPart] = {}
    remote_only: dict[TimelineId, set[str]] = {}
    for timeline_id in await list_remote_timelines(remote.storage, tenant_id):
        chosen = await find_index(remote.storage, tenant_id, timeline_id, remote.generation)
        if chosen is None:
            continue
        index_gen, part = chosen
        directory = timelines_dir / timeline_id.hex
        # A half-made local timeline of the same id cannot be: the remote one is complete.
        marker = timelines_dir / (timeline_id.hex + ".___uninit")
        await trio.to_thread.run_sync(functools.partial(marker.unlink, missing_ok=True))
        missing = await trio.to_thread.run_sync(_reconcile, directory, part)
        for name in missing:
            if name not in part.generations:
                raise LayerCorruptionError(directory / name, "the remote index names it without a generation")
        await trio.to_thread.run_sync(_write_local_index, directory, part)
        found[timeline_id] = part
        remote_only[timeline_id] = set(missing)
        log.info("timeline prepared from remote storage", tenant_id=tenant_id.hex,
                 timeline_id=timeline_id.hex, index_generation=index_gen, generation=remote.generation,
                 layers=len(part.layers), remote_only=len(missing),
                 disk_consistent_lsn=format_lsn(part.disk_consistent_lsn))
    if remote.deletions is not None:
        await recover_deletions(remote, remote.deletions, tenant_id, found)
    return found, remote_only


def _named_keys(tenant_id: TenantId, timeline_id: TimelineId, part: IndexPart) -> set[str]:
    return {remote_layout.layer_key(tenant_id, timeline_id, name, gen) for name, gen in part.generations.items()}


async def recover_deletions(
    remote: TenantRemote, queue: DeletionQueue, tenant_id: TenantId, indexes: dict[TimelineId, IndexPart]
) -> int:
    """Run the deletion lists a previous process of this node left for the tenant
    (``pageserver.deletion_queue``): only those of the generation just before ours, only once
    ours is validated, and never a key the timeline's current index (``indexes``) names.
    Returns how many objects were deleted."""
    lists: list[DeletionList] = await trio.to_thread.run_sync(queue.lists, tenant_id)
    if not lists:
        return 0
    mine = [dl for dl in lists if dl.generation + 1 == remote.generation and dl.timeline_id in indexes]
    drop = [dl for dl in lists if dl not in mine]
    if mine and not await remote.validate():
        drop, mine = lists, []
    deleted = 0
    for dl in mine:
        named = _named_keys(tenant_id, dl.timeline_id, indexes[dl.timeline_id])
        # Named still: the index that dropped them never went up (a crash before its upload).
        keys = tuple(k for k in dl.keys if k not in named)
        if keys:
            await retry(functools.partial(remote.storage.delete_objects, keys),
                        what=f"delete {len(keys)} objects of a recovered deletion list")
            RECOVERED_KEYS.inc(len(keys))
        log.info("recovered deletion list executed", tenant_id=tenant_id.hex, timeline_id=dl.timeline_id.hex,
                 list_generation=dl.generation, generation=remote.generation, deleted=len(keys),
                 still_named=len(dl.keys) - len(keys))
        deleted += len(keys)
        await trio.to_thread.run_sync(queue.done, dl)
    for dl in drop:
        DROPPED_LIST_KEYS.inc(len(dl.keys))
        log.warning("deletion list dropped (objects leak): not written in the previous generation "
                    "of this attachment, or ours is not valid", tenant_id=tenant_id.hex,
                    timeline_id=dl.timeline_id.hex, list_generation=dl.generation,
                    generation=remote.generation, keys=len(dl.keys))
        await trio.to_thread.run_sync(queue.done, dl)
    return deleted


def make_client(
    remote: TenantRemote,
    tenant_id: TenantId,
    timeline_id: TimelineId,
    local_dir: Path,
    remote_index: IndexPart | None,
    *,
    pins: Pins,
    on_unpinned: Callable[[], Awaitable[None]],
) -> RemoteTimelineClient:
    return RemoteTimelineClient(
        remote.storage, tenant_id, timeline_id, remote.generation, local_dir,
        remote_index=remote_index, validate=remote.validate, pins=pins, on_unpinned=on_unpinned,
        parallel_uploads=remote.parallel_uploads, deletions=remote.deletions,
        compression=remote.compression, compression_level=remote.compression_level,
        coalesce_indexes=remote.coalesce_indexes, index_upload_interval_s=remote.index_upload_interval_s,
        compression_probe=remote.compression_probe, stage_in_l0_writer=remote.stage_in_l0_writer,
    )
