"""The node's tenants: loading them from the workdir, creating tenants and timelines, the WAL
receiver of each timeline, and shutting everything down.

Layout: ``<workdir>/tenants/<tenant id>/`` is one ``Tenant`` (``pageserver.tenant``, which owns
what is inside). A tenant is created in ``<workdir>/tenants/.tmp-<id>/`` and renamed into place,
so a directory with a tenant id as its name always holds a complete tenant; leftovers of an
interrupted creation are removed at start.

Timelines are created by bootstrap (``initdb`` imported by ``pageserver.import_datadir``), by
importing a stopped data directory or a tar of one, or as a branch of an existing timeline at
an LSN. A bootstrap or import that fails leaves no timeline behind; one the process dies in
the middle of is marked unfinished (``Tenant.mark_uninit``) and removed at the next start.
Every tenant runs its background jobs (flush of old open layers, compaction, GC) in the node's
nursery until shutdown. When the node has safekeepers configured, every timeline gets a ``TimelineWalIngest`` task that pulls
its WAL from them, starting at ``last_record_lsn``.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import structlog
import trio

from common.tls import client_context
from pageserver import remote_layout
from pageserver.config import PageserverConfig, split_addr
from pageserver.control_plane_client import ControlPlaneClient
from pageserver.deletion_queue import DeletionQueue
from pageserver.import_datadir import DatadirImportError, bootstrap_timeline, import_datadir
from pageserver.remote_tenant import TenantRemote, highest_generation, list_remote_tenants
from pageserver.remote_timeline import always_valid
from pageserver.storage.io_engine import fsync_dir
from pageserver.tenant import Tenant, TimelineExistsError
from pageserver.timeline import Timeline
from pageserver.wal_receiver import RemoteWal, WalReceiverConfig
from pageserver.walingest import TimelineWalIngest, WalIngest
from pageserver.walredo.manager import PostgresRedoManager
from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn, format_lsn
from remote_storage import RemoteStorage, make_remote_storage
from remote_storage.prefix_delete import delete_prefix

log = structlog.get_logger("pageserver.tenant_manager")

TMP_PREFIX = ".tmp-"


class TenantNotFoundError(LookupError):
    pass


class TimelineNotFoundError(LookupError):
    pass


class AlreadyExistsError(Exception):
    pass


class BadTimelineRequestError(ValueError):
    """The request cannot be served as asked (branch point above the ancestor's end...)."""


class ShuttingDownError(Exception):
    pass


class HasChildrenError(Exception):
    """A timeline with branches cannot be deleted: they read its layers below their start."""


def _fresh_dir(path: Path) -> None:
    """``path`` created empty, with whatever an interrupted attempt left at its parent removed."""
    shutil.rmtree(path.parent, ignore_errors=True)
    path.mkdir(parents=True)


class TenantManager:
    def __init__(
        self,
        conf: PageserverConfig,
        *,
        safekeeper_token: str | None = None,
        control_plane_token: str | None = None,
    ) -> None:
        self.conf = conf
        # The WAL receivers' safekeeperdata token (the node's PAGESTORE_AUTH_TOKEN).
        self.safekeeper_token = safekeeper_token
        self.tenants: dict[TenantId, Tenant] = {}
        self._locks: dict[TenantId, trio.Lock] = {}
        self._ingests: dict[tuple[TenantId, TimelineId], tuple[TimelineWalIngest, trio.CancelScope]] = {}
        self._jobs: dict[TenantId, trio.CancelScope] = {}
        # Timelines being bootstrapped or imported: in their tenant already (the import writes
        # through it) but not served: a basebackup or GetPage there would see half the data.
        self._unfinished: set[tuple[TenantId, TimelineId]] = set()
        # Timelines whose WAL ingest stopped on an error that is not the connection's (a bug,
        # or WAL it cannot apply): why, for the HTTP API. The others, and reads of what this
        # one has ingested, go on; a restart retries.
        self.ingest_failures: dict[tuple[TenantId, TimelineId], str] = {}
        self._nursery: trio.Nursery | None = None
        self.shutting_down = trio.Event()
        self.remote_storage: RemoteStorage | None = (
            None if conf.remote_storage is None else make_remote_storage(conf.remote_storage)
        )
        self.control_plane: ControlPlaneClient | None = (
            None if conf.control_plane_api is None else ControlPlaneClient(
                conf.control_plane_api, conf.id, token=control_plane_token,
                ssl_context=None if conf.ssl_ca_path is None else client_context(conf.ssl_ca_path))
        )
        # Remote deletions persisted across restarts (opened in ``start``).
        self.deletions: DeletionQueue | None = None

    @property
    def tenants_dir(self) -> Path:
        return self.conf.tenants_dir

    def _lock(self, tenant_id: TenantId) -> trio.Lock:
        return self._locks.setdefault(tenant_id, trio.Lock())

    def _new_redo(self) -> PostgresRedoManager:
        return PostgresRedoManager(validate=self.conf.validate_redo)

    # -- start and stop -----------------------------------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        """Load every tenant of the workdir and start WAL receivers."""
        self._nursery = nursery
        self.tenants_dir.mkdir(parents=True, exist_ok=True)
        if self.remote_storage is not None:
            self.deletions = await trio.to_thread.run_sync(DeletionQueue, self.conf.workdir / "deletion")
        found: list[TenantId] = []
        for entry in sorted(self.tenants_dir.iterdir()):
            if entry.name.startswith(TMP_PREFIX):
                await trio.to_thread.run_sync(shutil.rmtree, entry)
                continue
            try:
                found.append(TenantId.parse(entry.name))
            except RemoteProtocolError:
                log.warning("ignoring a directory that is not a tenant", path=str(entry))
        generations: dict[TenantId, int] = {}
        if self.control_plane is not None:
            # The controller says which tenants are mine, each in a new generation.
            generations = await self.control_plane.re_attach()
            for tenant_id in found:
                if tenant_id not in generations:
                    log.warning("not loading a local tenant the storage controller does not attach here",
                                tenant_id=tenant_id.hex)
            found = sorted(generations, key=lambda t: t.hex)
        elif self.remote_storage is not None:
            # Without a control plane this node owns every tenant of the bucket: a node that
            # lost its disk gets them all back.
            found += [t for t in await list_remote_tenants(self.remote_storage) if t not in found]
        for tenant_id in found:
            entry = self.tenants_dir / tenant_id.hex
            tenant = await Tenant.load(
                entry, tenant_id, self.conf.storage_config(), redo=self._new_redo(), nursery=nursery,
                remote=await self._tenant_remote(tenant_id, generations.get(tenant_id)),
            )
            self.tenants[tenant_id] = tenant
            log.info("tenant loaded", tenant_id=tenant_id.hex, timelines=len(tenant.timelines))
        if self.deletions is not None:
            await trio.to_thread.run_sync(self.deletions.drop_except, list(self.tenants))
        for tenant in self.tenants.values():
            self._start_background_jobs(tenant)
            for tl in tenant.timelines.values():
                self._start_ingest(tl)

    async def shutdown(self) -> None:
        """Stop WAL receivers and background jobs, flush every timeline (index_part
        persisted), close files."""
        self.shutting_down.set()
        # Stop each ingest between two records before cancelling it: cancelled mid-record it
        # would leave a partly put record, which the flush below must not make durable (it
        # would wait for it, then give up: the WAL is re-ingested after the restart).
        with trio.move_on_after(self.conf.shutdown_timeout_s):
            async with trio.open_nursery() as nursery:
                for ingest, _ in self._ingests.values():
                    nursery.start_soon(ingest.pause)
        for _, scope in self._ingests.values():
            scope.cancel()
        self._ingests.clear()
        for scope in self._jobs.values():
            scope.cancel()
        self._jobs.clear()
        for tenant in self.tenants.values():
            for tl in tenant.timelines.values():
                try:
                    with trio.move_on_after(self.conf.shutdown_timeout_s * 4) as scope:
                        await tl.flush()
                except Exception:
                    log.error("flush at shutdown failed", timeline_id=tl.timeline_id.hex, exc_info=True)
                # Nothing is lost (WAL above disk_consistent_lsn is streamed again after the
                # restart), but the operator should know the restart will re-ingest it.
                if scope.cancelled_caught:
                    log.warning(
                        "flush at shutdown timed out; WAL above disk_consistent_lsn will be re-ingested",
                        timeline_id=tl.timeline_id.hex,
                        disk_consistent_lsn=format_lsn(tl.disk_consistent_lsn),
                        last_record_lsn=format_lsn(tl.last_record_lsn),
                    )
            for tl in tenant.timelines.values() if self.remote_storage is not None else ():
                # Let the upload queue drain for a while: the next start (here or elsewhere)
                # then has less to re-ingest. Not for ever: the store may be down.
                with trio.move_on_after(self.conf.shutdown_timeout_s * 2) as scope:
                    await self.wait_remote(tl)
                if scope.cancelled_caught:
                    log.warning("uploads not finished at shutdown; the next attach re-ingests from "
                                "remote_consistent_lsn", timeline_id=tl.timeline_id.hex,
                                remote_consistent_lsn=format_lsn(tl.remote_consistent_lsn))
            await tenant.shutdown()

    async def _tenant_remote(self, tenant_id: TenantId, generation: int | None = None) -> TenantRemote | None:
        """The tenant's remote storage context with this attachment's generation: the one
        given (by the controller or the attach request), else the controller's for a new
        tenant, else one above any the tenant has used (the node issues its own)."""
        if self.remote_storage is None:
            return None
        cp = self.control_plane
        if generation is None:
            if cp is not None:
                generation = await cp.attach(tenant_id)
            else:
                generation = await highest_generation(self.remote_storage, tenant_id) + 1
        rs = self.conf.remote_storage
        assert rs is not None
        validate = always_valid if cp is None else functools.partial(cp.validate, tenant_id, generation)
        return TenantRemote(self.remote_storage, generation, validate, deletions=self.deletions,
                            compression=rs.compression, compression_level=rs.compression_level)

    # -- attach and detach ----------------------------------------------------------------------

    async def attach_tenant(self, tenant_id: TenantId, generation: int | None = None) -> Tenant:
        """Load a tenant from remote storage (layers come down as its index names them) and
        start serving it, in ``generation`` (the controller's; None: see ``_tenant_remote``)."""
        if self.shutting_down.is_set():
            raise ShuttingDownError("the pageserver is shutting down")
        if self.remote_storage is None:
            raise BadTimelineRequestError("attach needs remote storage (remote_storage in the config)")
        async with self._lock(tenant_id):
            if tenant_id in self.tenants:
                raise AlreadyExistsError(f"tenant {tenant_id} is already attached here")
            remote = await self._tenant_remote(tenant_id, generation)
            assert remote is not None
            tenant = await Tenant.load(
                self.tenants_dir / tenant_id.hex, tenant_id, self.conf.storage_config(),
                redo=self._new_redo(), nursery=self._nursery, remote=remote,
            )
            self.tenants[tenant_id] = tenant
            self._start_background_jobs(tenant)
            for tl in tenant.timelines.values():
                self._start_ingest(tl)
            log.info("tenant attached", tenant_id=tenant_id.hex, generation=remote.generation,
                     timelines=len(tenant.timelines))
            return tenant

    async def detach_tenant(self, tenant_id: TenantId) -> None:
        """Stop serving a tenant: ingest stopped, layers flushed and uploaded (for up to
        ``shutdown_timeout_s * 4``), files closed, the local directory removed. Remote objects
        stay: the next attachment loads them."""
        async with self._lock(tenant_id):
            tenant = self.get_tenant(tenant_id)
            for tid in list(tenant.timelines):
                got = self._ingests.pop((tenant_id, tid), None)
                if got is not None:
                    with trio.move_on_after(self.conf.shutdown_timeout_s):
                        await got[0].pause()
                    got[1].cancel()
            scope = self._jobs.pop(tenant_id, None)
            if scope is not None:
                scope.cancel()
            with trio.move_on_after(self.conf.shutdown_timeout_s * 4):
                for tl in tenant.timelines.values():
                    await tl.flush()
                    await self.wait_remote(tl)
            del self.tenants[tenant_id]
            await tenant.shutdown()
            await trio.to_thread.run_sync(functools.partial(shutil.rmtree, tenant.path, ignore_errors=True))
            if self.deletions is not None:
                # What the drain above did not delete leaks: the next attachment is elsewhere.
                await trio.to_thread.run_sync(self.deletions.drop_tenant, tenant_id, "detached")
            log.info("tenant detached", tenant_id=tenant_id.hex)

    # -- deletion --------------------------------------------------------------------------

    async def _stop_ingest(self, tenant_id: TenantId, timeline_id: TimelineId) -> None:
        got = self._ingests.pop((tenant_id, timeline_id), None)
        if got is not None:
            with trio.move_on_after(self.conf.shutdown_timeout_s):
                await got[0].pause()
            got[1].cancel()
        self.ingest_failures.pop((tenant_id, timeline_id), None)

    async def delete_timeline(self, tenant_id: TenantId, timeline_id: TimelineId) -> int:
        """Delete a timeline here and in remote storage (every generation's objects); the
        number of remote objects deleted. Refused while it has branches. Order: ingest and
        the upload queue stopped (no request of theirs in flight); the local directory marked
        unfinished (durable: a crash from here on makes the next load remove it, and it is
        never uploaded again); the remote indexes deleted, then the layers (a crash between
        leaves unnamed layers, leaks); the local directory, then its marker. A repeated
        request after a failure in the remote part finishes it. The safekeepers' WAL of the
        timeline is theirs to delete (``pagestore timeline delete`` asks them too)."""
        if self.shutting_down.is_set():
            raise ShuttingDownError("the pageserver is shutting down")
        async with self._lock(tenant_id):
            tenant = self.get_tenant(tenant_id)
            tl = tenant.timelines.get(timeline_id)
            marker = tenant.uninit_marker(timeline_id)
            if tl is None and not (timeline_id in tenant.creating and marker.exists()):
                raise TimelineNotFoundError(f"timeline {tenant_id}/{timeline_id} not found")
            if tl is not None:
                if (tenant_id, timeline_id) in self._unfinished:
                    raise BadTimelineRequestError(f"timeline {tenant_id}/{timeline_id} is still being created")
                children = sorted(t.timeline_id.hex for t in tenant.timelines.values() if t.ancestor is tl)
                if children:
                    raise HasChildrenError(
                        f"timeline {tenant_id}/{timeline_id} has branches ({', '.join(children)}): delete them first"
                    )
                await self._stop_ingest(tenant_id, timeline_id)
                if tl.remote is not None:
                    await tl.remote.shutdown()
                await tenant.mark_uninit(timeline_id)  # background jobs skip it from now on
                del tenant.timelines[timeline_id]
                await tl.shutdown()
            removed = 0
            if self.remote_storage is not None:
                removed = await delete_prefix(self.remote_storage, remote_layout.timeline_prefix(tenant_id, timeline_id),
                                              first=lambda key: remote_layout.index_generation(key) is not None)
            await trio.to_thread.run_sync(
                lambda: shutil.rmtree(tenant.timelines_dir / timeline_id.hex, ignore_errors=True))
            await fsync_dir(tenant.engine, tenant.timelines_dir)
            await tenant.clear_uninit(timeline_id)
            log.info("timeline deleted", tenant_id=tenant_id.hex, timeline_id=timeline_id.hex,
                     remote_objects=removed)
            return removed

    async def delete_tenant(self, tenant_id: TenantId) -> int:
        """Delete a tenant here and in remote storage (``tenants/<tenant>/``, indexes first);
        the number of remote objects deleted. Its local directory is first renamed to a
        temporary name (durable), which the next start removes, so a crash half-way never
        brings the tenant back from local disk. The storage controller's record and the
        safekeepers' WAL are for the caller (``pagestore tenant delete``)."""
        if self.shutting_down.is_set():
            raise ShuttingDownError("the pageserver is shutting down")
        async with self._lock(tenant_id):
            tenant = self.get_tenant(tenant_id)
            for tid in list(tenant.timelines):
                await self._stop_ingest(tenant_id, tid)
            scope = self._jobs.pop(tenant_id, None)
            if scope is not None:
                scope.cancel()
            for tl in tenant.timelines.values():
                if tl.remote is not None:
                    await tl.remote.shutdown()
            del self.tenants[tenant_id]
            await tenant.shutdown()
            doomed = self.tenants_dir / f"{TMP_PREFIX}deleted-{tenant_id.hex}"
            await trio.to_thread.run_sync(os.rename, tenant.path, doomed)
            await fsync_dir(tenant.engine, self.tenants_dir)
            removed = 0
            if self.remote_storage is not None:
                removed = await delete_prefix(self.remote_storage, remote_layout.tenant_prefix(tenant_id),
                                              first=lambda key: remote_layout.index_generation(key) is not None)
            if self.deletions is not None:
                await trio.to_thread.run_sync(self.deletions.drop_tenant, tenant_id, "deleted")
            await trio.to_thread.run_sync(functools.partial(shutil.rmtree, doomed, ignore_errors=True))
            log.info("tenant deleted", tenant_id=tenant_id.hex, remote_objects=removed)
            return removed

    async def wait_remote(self, tl: Timeline) -> None:
        """Return once everything the timeline queued for remote storage is uploaded."""
        if tl.remote is not None:
            await tl.remote.wait_uploaded()

    def _start_background_jobs(self, tenant: Tenant) -> None:
        """Compaction, flushing of old open layers and GC (``Tenant.run_background_jobs``),
        until shutdown."""
        if self._nursery is None:
            return
        scope = trio.CancelScope()

        async def run() -> None:
            with scope:
                await tenant.run_background_jobs()

        self._jobs[tenant.tenant_id] = scope
        self._nursery.start_soon(run, name=f"tenant.jobs.{tenant.tenant_id.hex[:8]}")

    def _start_ingest(self, tl: Timeline) -> None:
        if not self.conf.safekeepers or self._nursery is None:
            return
        cfg = WalReceiverConfig(
            safekeepers=tuple(split_addr(a) for a in self.conf.safekeepers),
            tenant_id=tl.tenant_id,
            timeline_id=tl.timeline_id,
            application_name=f"pageserver-{self.conf.id}",
            auth_token=self.safekeeper_token,
            ssl_ca_file=None if self.conf.ssl_ca_file is None else str(self.conf.ssl_ca_path),
        )
        # WAL the safekeepers trimmed after their backup is read back from the same store.
        remote_wal = None if self.remote_storage is None else RemoteWal(
            self.remote_storage, tl.tenant_id, tl.timeline_id
        )
        ingest = TimelineWalIngest(tl, cfg, ingest=WalIngest(tl), remote_wal=remote_wal)
        scope = trio.CancelScope()

        key = (tl.tenant_id, tl.timeline_id)

        async def run() -> None:
            with scope:
                try:
                    await ingest.run()
                except Exception as exc:
                    # Not a lost connection (the receiver retries those): retrying would fail
                    # the same way. It must not end the node (every tenant's service) either.
                    self.ingest_failures[key] = f"ingest stopped at {format_lsn(tl.last_record_lsn)}: {exc!r}"
                    log.error("WAL ingest failed; the timeline stays at its last_record_lsn until restart",
                              tenant_id=tl.tenant_id.hex, timeline_id=tl.timeline_id.hex,
                              last_record_lsn=format_lsn(tl.last_record_lsn), exc_info=True)

        self._ingests[key] = (ingest, scope)
        self._nursery.start_soon(run)

    def ingest_of(self, tenant_id: TenantId, timeline_id: TimelineId) -> TimelineWalIngest | None:
        got = self._ingests.get((tenant_id, timeline_id))
        return None if got is None else got[0]

    def prev_record_lsn(self, tl: Timeline, lsn: Lsn) -> Lsn | None:
        """Start of the record ending at ``lsn``, when this node ingested it (else None: the
        timeline does not keep it, and after a restart or for a past LSN it is unknown)."""
        ingest = self.ingest_of(tl.tenant_id, tl.timeline_id)
        if ingest is None:
            return None
        last = ingest.ingest.last_record
        if last is None or last[1] != lsn:
            return None
        return last[0]

    # -- lookups --------------------------------------------------------------------------------

    def get_tenant(self, tenant_id: TenantId) -> Tenant:
        tenant = self.tenants.get(tenant_id)
        if tenant is None:
            raise TenantNotFoundError(f"tenant {tenant_id} not found")
        return tenant

    def get_timeline(self, tenant_id: TenantId, timeline_id: TimelineId) -> Timeline:
        tl = self.get_tenant(tenant_id).timelines.get(timeline_id)
        if tl is None:
            raise TimelineNotFoundError(f"timeline {tenant_id}/{timeline_id} not found")
        if (tenant_id, timeline_id) in self._unfinished:
            raise TimelineNotFoundError(f"timeline {tenant_id}/{timeline_id} is still being created")
        return tl

    def is_unfinished(self, tl: Timeline) -> bool:
        """Being bootstrapped or imported: not served, not listed."""
        return (tl.tenant_id, tl.timeline_id) in self._unfinished

    def iter_timelines(self) -> Iterator[Timeline]:
        for tenant in self.tenants.values():
            yield from tenant.timelines.values()

    # -- creation ---------------------------------------------------------------------------

    async def create_tenant(self, tenant_id: TenantId | None = None) -> Tenant:
        if self.shutting_down.is_set():
            raise ShuttingDownError("the pageserver is shutting down")
        tenant_id = tenant_id or TenantId.generate()
        async with self._lock(tenant_id):
            if tenant_id in self.tenants:
                raise AlreadyExistsError(f"tenant {tenant_id} already exists")
            final = self.tenants_dir / tenant_id.hex
            tmp = self.tenants_dir / f"{TMP_PREFIX}{tenant_id.hex}"
            # Directory work can stall on a busy disk: keep it off the trio thread.
            await trio.to_thread.run_sync(_fresh_dir, tmp / "timelines")
            tenant = Tenant(tmp, tenant_id, self.conf.storage_config(), redo=self._new_redo(),
                            nursery=self._nursery, remote=await self._tenant_remote(tenant_id))
            await fsync_dir(tenant.engine, tmp)
            await trio.to_thread.run_sync(os.rename, tmp, final)
            await fsync_dir(tenant.engine, self.tenants_dir)
            tenant.path = final
            self.tenants[tenant_id] = tenant
            self._start_background_jobs(tenant)
            log.info("tenant created", tenant_id=tenant_id.hex)
            return tenant

    async def create_timeline(
        self,
        tenant_id: TenantId,
        timeline_id: TimelineId | None = None,
        *,
        ancestor_timeline_id: TimelineId | None = None,
        ancestor_start_lsn: Lsn | None = None,
    ) -> Timeline:
        """Bootstrap (no ancestor) or branch; starts the WAL receiver. Durable on return."""
        if self.shutting_down.is_set():
            raise ShuttingDownError("the pageserver is shutting down")
        tenant = self.get_tenant(tenant_id)
        timeline_id = timeline_id or TimelineId.generate()
        async with self._lock(tenant_id):
            if timeline_id in tenant.timelines:
                raise AlreadyExistsError(f"timeline {tenant_id}/{timeline_id} already exists")
            if ancestor_timeline_id is None:
                if ancestor_start_lsn is not None:
                    raise BadTimelineRequestError("ancestor_start_lsn needs ancestor_timeline_id")
                tl = await self._bootstrap(tenant, timeline_id)
            else:
                ancestor = tenant.timelines.get(ancestor_timeline_id)
                if ancestor is None:
                    raise TimelineNotFoundError(f"ancestor timeline {tenant_id}/{ancestor_timeline_id} not found")
                if ancestor_start_lsn is not None:
                    if ancestor_start_lsn % 8:
                        raise BadTimelineRequestError(
                            f"ancestor_start_lsn {format_lsn(ancestor_start_lsn)} is not a record boundary"
                        )
                    # A branch point just ingested elsewhere may still be arriving.
                    if ancestor_start_lsn > ancestor.last_record_lsn:
                        try:
                            await ancestor.wait_lsn(ancestor_start_lsn, min(self.conf.wait_lsn_timeout_s, 10.0))
                        except TimeoutError:
                            pass  # create_timeline below refuses a branch point above the end
                try:
                    tl = await tenant.create_timeline(
                        timeline_id, ancestor=ancestor, ancestor_lsn=ancestor_start_lsn
                    )
                except TimelineExistsError as exc:
                    raise AlreadyExistsError(str(exc)) from None
                except ValueError as exc:
                    raise BadTimelineRequestError(str(exc)) from None
            # Durable on return means in remote storage too (a new node would not find it else).
            await self.wait_remote(tl)
            log.info("timeline created", tenant_id=tenant_id.hex, timeline_id=timeline_id.hex,
                     ancestor=ancestor_timeline_id.hex if ancestor_timeline_id else None,
                     last_record_lsn=format_lsn(tl.last_record_lsn))
        self._start_ingest(tl)
        return tl

    async def _bootstrap(self, tenant: Tenant, timeline_id: TimelineId) -> Timeline:
        self._unfinished.add((tenant.tenant_id, timeline_id))
        try:
            await tenant.mark_uninit(timeline_id)
            try:
                tl, _ = await bootstrap_timeline(tenant, timeline_id)
                await tenant.clear_uninit(timeline_id)
            except BaseException:
                await self._discard(tenant, timeline_id)
                raise
        finally:
            self._unfinished.discard((tenant.tenant_id, timeline_id))
        return tl

    async def import_timeline(
        self,
        tenant_id: TenantId,
        timeline_id: TimelineId | None,
        source: Path,
        *,
        wal_tar: Path | None = None,
    ) -> Timeline:
        """A new timeline from a stopped PostgreSQL 15 data directory or a tar of one
        (``pageserver.import_datadir``); flushed, so durable on return."""
        if self.shutting_down.is_set():
            raise ShuttingDownError("the pageserver is shutting down")
        if not source.exists():
            raise BadTimelineRequestError(f"{source} does not exist")
        if wal_tar is not None and not wal_tar.exists():
            raise BadTimelineRequestError(f"{wal_tar} does not exist")
        tenant = self.get_tenant(tenant_id)
        timeline_id = timeline_id or TimelineId.generate()
        async with self._lock(tenant_id):
            if timeline_id in tenant.timelines:
                raise AlreadyExistsError(f"timeline {tenant_id}/{timeline_id} already exists")
            self._unfinished.add((tenant_id, timeline_id))
            try:
                tl = await self._import(tenant, timeline_id, source, wal_tar)
                await self.wait_remote(tl)
            finally:
                self._unfinished.discard((tenant_id, timeline_id))
            log.info("timeline imported", tenant_id=tenant_id.hex, timeline_id=timeline_id.hex,
                     source=str(source), last_record_lsn=format_lsn(tl.last_record_lsn))
        self._start_ingest(tl)
        return tl

    async def _import(
        self, tenant: Tenant, timeline_id: TimelineId, source: Path, wal_tar: Path | None
    ) -> Timeline:
        await tenant.mark_uninit(timeline_id)
        try:
            tl = await tenant.create_timeline(timeline_id)
        except BaseException:
            await tenant.clear_uninit(timeline_id)
            raise
        try:
            await import_datadir(tl, source, wal_tar=wal_tar)
            await tl.flush()
            await tenant.clear_uninit(timeline_id)
        except BaseException as exc:
            await self._discard(tenant, timeline_id)
            if isinstance(exc, DatadirImportError):
                raise BadTimelineRequestError(f"cannot import {source}: {exc}") from None
            raise
        return tl

    async def _discard(self, tenant: Tenant, timeline_id: TimelineId) -> None:
        """Forget a timeline whose creation failed half-way (its directory goes too)."""
        tl = tenant.timelines.pop(timeline_id, None)
        with trio.CancelScope(shield=True):
            if tl is not None:
                await tl.shutdown()
            # A bootstrapped timeline holds many layer files: remove them off the trio thread.
            await trio.to_thread.run_sync(
                lambda: shutil.rmtree(tenant.timelines_dir / timeline_id.hex, ignore_errors=True)
            )
            # The removal durable first (else a crash could keep the marker's unlink only and
            # leave the half-made timeline to be loaded as complete); only then the marker: had
            # we crashed before, it makes the next load remove the rest.
            await fsync_dir(tenant.engine, tenant.timelines_dir)
            await tenant.clear_uninit(timeline_id)
