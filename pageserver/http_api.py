"""The pageserver's HTTP management API (JSON via cattrs; paths close to neon's).

Routes (``docs/http-api.md`` documents bodies and answers):

- ``GET  /v1/status``
- ``POST /v1/tenant`` (create; body may name ``tenant_id``), ``GET /v1/tenant``,
  ``GET /v1/tenant/{tenant_id}``, ``DELETE /v1/tenant/{tenant_id}`` (here and its
  ``tenants/<tenant>/`` objects in remote storage)
- ``POST /v1/tenant/{tenant_id}/timeline`` (bootstrap, or branch with ``ancestor_timeline_id``
  and optional ``ancestor_start_lsn``), ``POST /v1/tenant/{tenant_id}/timeline/import``
  (a data directory or tar on this machine), ``GET /v1/tenant/{tenant_id}/timeline``,
  ``GET /v1/tenant/{tenant_id}/timeline/{timeline_id}``,
  ``DELETE /v1/tenant/{tenant_id}/timeline/{timeline_id}`` (here and in remote storage; 412
  while it has branches)
- ``GET  /v1/tenant/{tenant_id}/timeline/{timeline_id}/keyspace[?at_lsn=X/Y]``
- ``GET  /v1/tenant/{tenant_id}/timeline/{timeline_id}/relations[?at_lsn=X/Y]``: databases,
  relation forks and their sizes in blocks (what a lazy endpoint's page filesystem lists)
- ``PUT  /v1/tenant/{tenant_id}/timeline/{timeline_id}/checkpoint`` (freeze + flush + upload),
  ``.../compact``, ``PUT /v1/tenant/{tenant_id}/timeline/{timeline_id}/do_gc``
- ``GET  /metrics``

Errors are ``{"msg": ...}``: 400 for a malformed id, LSN or body, 404 for an unknown tenant or
timeline, 409 when creating something that exists, 412 when deleting a timeline with branches,
503 while shutting down.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

import attrs
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from common.http import HttpError, Request, Response, Router
from common.metrics import metrics_text
from pageserver.basebackup import (
    RelationListing,
    TimelineBackupSource,
    collect_keyspace,
    relation_listing,
)
from pageserver.storage.key import key_hex
from pageserver.storage.reconstruct import MissingKeyError
from pageserver.tenant import Tenant
from pageserver.tenant_manager import (
    AlreadyExistsError,
    BadTimelineRequestError,
    HasChildrenError,
    ShuttingDownError,
    TenantManager,
    TenantNotFoundError,
    TimelineNotFoundError,
)
from pageserver.timeline import Timeline
from protocol import _native
from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import INVALID_LSN, Lsn, format_lsn, parse_lsn
from remote_storage.errors import RemoteStorageError

PG_VERSION = 15


# -- bodies ------------------------------------------------------------------------------------


@attrs.frozen
class TenantCreateRequest:
    tenant_id: str | None = None
    new_tenant_id: str | None = None  # neon's name for the same thing


@attrs.frozen
class TenantCreateResponse:
    tenant_id: str


@attrs.frozen
class TenantInfo:
    id: str
    state: Literal["Active"]
    timelines: list[str]


@attrs.frozen
class TimelineCreateRequest:
    new_timeline_id: str | None = None
    ancestor_timeline_id: str | None = None
    ancestor_start_lsn: str | None = None
    pg_version: int | None = None


@attrs.frozen
class TenantAttachRequest:
    generation: int | None = None  # the storage controller's; None: the node chooses (see docs)


@attrs.frozen
class TimelineImportRequest:
    source: str  # a data directory or a tar of one, on the pageserver's machine
    new_timeline_id: str | None = None
    wal_tar: str | None = None  # pg_basebackup -Ft's pg_wal.tar next to base.tar


@attrs.frozen
class TimelineInfo:
    tenant_id: str
    timeline_id: str
    ancestor_timeline_id: str | None
    ancestor_lsn: str | None
    last_record_lsn: str
    disk_consistent_lsn: str
    remote_consistent_lsn: str
    latest_gc_cutoff_lsn: str
    pg_version: int
    state: Literal["Active"]
    wal_receiver_safekeeper: str | None
    wal_receiver_error: str | None
    # WAL segments the receiver read back from the safekeepers' WAL backup (remote storage)
    wal_receiver_remote_segments: int = 0


@attrs.frozen
class KeyRangeJson:
    start: str
    end: str


@attrs.frozen
class KeySpaceResponse:
    at_lsn: str
    keys: list[KeyRangeJson]


@attrs.frozen
class StatusResponse:
    id: int
    tenants: int
    timelines: int
    # which kernels run: "native" (Cython) or "python" (PAGESTORE_PURE_PYTHON=1), and the CRC
    # kernel ("sse4.2", "table", ...): protocol._native.describe()
    impl: str
    crc32c: str


@attrs.frozen
class GcResponse:
    layers_removed: int


# -- helpers ------------------------------------------------------------------------------------


def _tenant_id(text: str) -> TenantId:
    try:
        return TenantId.parse(text)
    except RemoteProtocolError as exc:
        raise HttpError(400, exc.msg) from None


def _timeline_id(text: str) -> TimelineId:
    try:
        return TimelineId.parse(text)
    except RemoteProtocolError as exc:
        raise HttpError(400, exc.msg) from None


def _lsn(text: str, what: str) -> Lsn:
    try:
        return parse_lsn(text)
    except RemoteProtocolError as exc:
        raise HttpError(400, f"{what}: {exc.msg}") from None


async def _require_datadir(tl: Timeline, lsn: Lsn, what: str) -> None:
    """400 unless ``tl`` holds a data directory at ``lsn``: below its first record (an LSN
    mistyped by a digit, say) there is nothing to branch from or list, and a branch made there
    would only fail later, when an endpoint asks it for a basebackup."""
    try:
        await TimelineBackupSource(tl).get_control_file(lsn)
    except MissingKeyError:
        raise HttpError(
            400,
            f"{what} {format_lsn(lsn)}: timeline {tl.timeline_id.hex} holds no data directory at "
            f"that LSN (it starts later)",
        ) from None


def timeline_info(tl: Timeline, manager: TenantManager) -> TimelineInfo:
    ingest = manager.ingest_of(tl.tenant_id, tl.timeline_id)
    receiver = ingest.receiver if ingest is not None else None
    current = receiver.current if receiver is not None else None
    return TimelineInfo(
        tenant_id=tl.tenant_id.hex,
        timeline_id=tl.timeline_id.hex,
        ancestor_timeline_id=tl.ancestor.timeline_id.hex if tl.ancestor is not None else None,
        ancestor_lsn=format_lsn(tl.ancestor_lsn) if tl.ancestor is not None else None,
        last_record_lsn=format_lsn(tl.last_record_lsn),
        disk_consistent_lsn=format_lsn(tl.disk_consistent_lsn),
        # Without remote storage: what is durable locally is all there is.
        remote_consistent_lsn=format_lsn(tl.remote_consistent_lsn),
        latest_gc_cutoff_lsn=format_lsn(tl.latest_gc_cutoff_lsn),
        pg_version=PG_VERSION,
        state="Active",
        wal_receiver_safekeeper=f"{current[0]}:{current[1]}" if current is not None else None,
        wal_receiver_error=manager.ingest_failures.get(
            (tl.tenant_id, tl.timeline_id), receiver.last_error if receiver is not None else None
        ),
        wal_receiver_remote_segments=receiver.remote_segments if receiver is not None else 0,
    )


def _tenant_info(tenant: Tenant) -> TenantInfo:
    return TenantInfo(tenant.tenant_id.hex, "Active", sorted(t.hex for t in tenant.timelines))


Handler = Callable[[Request], Awaitable[object]]


def _errors(handler: Handler) -> Handler:
    """Map the tenant manager's errors to statuses."""

    async def wrapped(req: Request) -> object:
        try:
            return await handler(req)
        except (TenantNotFoundError, TimelineNotFoundError) as exc:
            raise HttpError(404, str(exc)) from None
        except AlreadyExistsError as exc:
            raise HttpError(409, str(exc)) from None
        except BadTimelineRequestError as exc:
            raise HttpError(400, str(exc)) from None
        except ShuttingDownError as exc:
            raise HttpError(503, str(exc)) from None
        except HasChildrenError as exc:
            raise HttpError(412, str(exc)) from None
        except RemoteStorageError as exc:
            # a deletion's remote part: what was deleted stays deleted, the request can be repeated
            raise HttpError(503, f"remote storage: {exc}") from None

    return wrapped


def build_router(manager: TenantManager, registry: CollectorRegistry) -> Router:
    router = Router()

    def route(method: str, pattern: str) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            router.add(method, pattern, _errors(handler))
            return handler

        return register

    def timeline_of(req: Request) -> Timeline:
        return manager.get_timeline(_tenant_id(req.params["tenant_id"]), _timeline_id(req.params["timeline_id"]))

    @route("GET", "/v1/status")
    async def status(_: Request) -> StatusResponse:
        native = _native.describe()
        return StatusResponse(
            manager.conf.id,
            len(manager.tenants),
            sum(1 for _ in manager.iter_timelines()),
            native["impl"],
            native["crc32c"],
        )

    @route("POST", "/v1/tenant")
    async def create_tenant(req: Request) -> Response:
        body = req.structure(TenantCreateRequest) if req.body.strip() else TenantCreateRequest()
        if body.tenant_id and body.new_tenant_id and body.tenant_id != body.new_tenant_id:
            raise HttpError(400, "tenant_id and new_tenant_id differ")
        text = body.tenant_id or body.new_tenant_id
        tenant = await manager.create_tenant(_tenant_id(text) if text else None)
        return Response.json(TenantCreateResponse(tenant.tenant_id.hex), status=201)

    @route("POST", "/v1/tenant/{tenant_id}/attach")
    async def attach_tenant(req: Request) -> Response:
        body = req.structure(TenantAttachRequest) if req.body.strip() else TenantAttachRequest()
        if body.generation is not None and not 0 < body.generation < 1 << 32:
            raise HttpError(400, f"generation {body.generation} out of range")
        tenant = await manager.attach_tenant(_tenant_id(req.params["tenant_id"]), body.generation)
        return Response.json(_tenant_info(tenant), status=201)

    @route("POST", "/v1/tenant/{tenant_id}/detach")
    async def detach_tenant(req: Request) -> object:
        await manager.detach_tenant(_tenant_id(req.params["tenant_id"]))
        return {}

    @route("DELETE", "/v1/tenant/{tenant_id}")
    async def delete_tenant(req: Request) -> object:
        removed = await manager.delete_tenant(_tenant_id(req.params["tenant_id"]))
        return {"remote_objects_deleted": removed}

    @route("DELETE", "/v1/tenant/{tenant_id}/timeline/{timeline_id}")
    async def delete_timeline(req: Request) -> object:
        removed = await manager.delete_timeline(_tenant_id(req.params["tenant_id"]),
                                                _timeline_id(req.params["timeline_id"]))
        return {"remote_objects_deleted": removed}

    @route("GET", "/v1/tenant")
    async def list_tenants(_: Request) -> list[TenantInfo]:
        return [_tenant_info(t) for _, t in sorted(manager.tenants.items())]

    @route("GET", "/v1/tenant/{tenant_id}")
    async def get_tenant(req: Request) -> TenantInfo:
        return _tenant_info(manager.get_tenant(_tenant_id(req.params["tenant_id"])))

    @route("POST", "/v1/tenant/{tenant_id}/timeline")
    async def create_timeline(req: Request) -> Response:
        tenant_id = _tenant_id(req.params["tenant_id"])
        body = req.structure(TimelineCreateRequest) if req.body.strip() else TimelineCreateRequest()
        if body.pg_version is not None and body.pg_version != PG_VERSION:
            raise HttpError(400, f"pg_version {body.pg_version} is not supported (only {PG_VERSION})")
        if body.ancestor_start_lsn is not None and body.ancestor_timeline_id is None:
            raise HttpError(400, "ancestor_start_lsn needs ancestor_timeline_id")
        manager.get_tenant(tenant_id)
        start_lsn = _lsn(body.ancestor_start_lsn, "ancestor_start_lsn") if body.ancestor_start_lsn else None
        if body.ancestor_timeline_id and start_lsn is not None and start_lsn % 8 == 0:
            ancestor = manager.get_timeline(tenant_id, _timeline_id(body.ancestor_timeline_id))
            if ancestor.ancestor is not None and start_lsn < ancestor.ancestor_lsn:
                # The new branch would read the grandparent there, whose GC keeps only its own
                # children's branch points below its cutoff: the pages could go at any time.
                raise HttpError(
                    400,
                    f"ancestor_start_lsn {format_lsn(start_lsn)} is below the branch point "
                    f"{format_lsn(ancestor.ancestor_lsn)} of timeline {ancestor.timeline_id.hex} "
                    f"(branch from its ancestor {ancestor.ancestor.timeline_id.hex} instead)",
                )
            # Points above the end or below the GC cutoff are the tenant manager's to refuse.
            if ancestor.latest_gc_cutoff_lsn <= start_lsn <= ancestor.last_record_lsn:
                await _require_datadir(ancestor, start_lsn, "ancestor_start_lsn")
        tl = await manager.create_timeline(
            tenant_id,
            _timeline_id(body.new_timeline_id) if body.new_timeline_id else None,
            ancestor_timeline_id=_timeline_id(body.ancestor_timeline_id) if body.ancestor_timeline_id else None,
            ancestor_start_lsn=start_lsn,
        )
        return Response.json(timeline_info(tl, manager), status=201)

    @route("POST", "/v1/tenant/{tenant_id}/timeline/import")
    async def import_timeline(req: Request) -> Response:
        tenant_id = _tenant_id(req.params["tenant_id"])
        body = req.structure(TimelineImportRequest)
        source = Path(body.source)
        if not source.is_absolute():
            raise HttpError(400, f"source must be an absolute path, got {body.source!r}")
        manager.get_tenant(tenant_id)
        tl = await manager.import_timeline(
            tenant_id,
            _timeline_id(body.new_timeline_id) if body.new_timeline_id else None,
            source,
            wal_tar=Path(body.wal_tar) if body.wal_tar else None,
        )
        return Response.json(timeline_info(tl, manager), status=201)

    @route("GET", "/v1/tenant/{tenant_id}/timeline")
    async def list_timelines(req: Request) -> list[TimelineInfo]:
        tenant = manager.get_tenant(_tenant_id(req.params["tenant_id"]))
        return [
            timeline_info(tl, manager)
            for _, tl in sorted(tenant.timelines.items())
            if not manager.is_unfinished(tl)
        ]

    @route("GET", "/v1/tenant/{tenant_id}/timeline/{timeline_id}")
    async def get_timeline(req: Request) -> TimelineInfo:
        return timeline_info(timeline_of(req), manager)

    async def listing_lsn(req: Request, tl: Timeline) -> Lsn:
        at = req.query.get("at_lsn")
        lsn = _lsn(at, "at_lsn") if at else tl.last_record_lsn
        if lsn > tl.last_record_lsn or lsn == INVALID_LSN:
            raise HttpError(400, f"at_lsn {format_lsn(lsn)} is not in 0/1..{format_lsn(tl.last_record_lsn)}")
        if lsn < tl.latest_gc_cutoff_lsn:
            raise HttpError(400, f"at_lsn {format_lsn(lsn)} is below the GC cutoff {format_lsn(tl.latest_gc_cutoff_lsn)}")
        await _require_datadir(tl, lsn, "at_lsn")
        return lsn

    @route("GET", "/v1/tenant/{tenant_id}/timeline/{timeline_id}/relations")
    async def relations(req: Request) -> RelationListing:
        tl = timeline_of(req)
        return await relation_listing(TimelineBackupSource(tl), await listing_lsn(req, tl))

    @route("GET", "/v1/tenant/{tenant_id}/timeline/{timeline_id}/keyspace")
    async def keyspace(req: Request) -> KeySpaceResponse:
        tl = timeline_of(req)
        lsn = await listing_lsn(req, tl)
        space = await collect_keyspace(TimelineBackupSource(tl), lsn)
        return KeySpaceResponse(
            format_lsn(lsn), [KeyRangeJson(key_hex(r.start), key_hex(r.end)) for r in space.ranges]
        )

    @route("PUT", "/v1/tenant/{tenant_id}/timeline/{timeline_id}/checkpoint")
    async def checkpoint(req: Request) -> TimelineInfo:
        tl = timeline_of(req)
        await tl.flush()
        if req.query.get("compact") in ("true", "1"):
            await tl.compact()
        # As Neon's: on return the flushed layers and their index are in remote storage too
        # (a migration checkpoints first so that the new pageserver replays less WAL).
        await manager.wait_remote(tl)
        return timeline_info(tl, manager)

    @route("PUT", "/v1/tenant/{tenant_id}/timeline/{timeline_id}/compact")
    async def compact(req: Request) -> TimelineInfo:
        tl = timeline_of(req)
        await tl.compact(force_image=req.query.get("force_image") in ("true", "1"))
        return timeline_info(tl, manager)

    @route("PUT", "/v1/tenant/{tenant_id}/timeline/{timeline_id}/do_gc")
    async def do_gc(req: Request) -> GcResponse:
        tenant = manager.get_tenant(_tenant_id(req.params["tenant_id"]))
        timeline_of(req)
        removed = await tenant.gc()
        return GcResponse(sum(len(v) for v in removed.values()))

    @router.route("GET", "/metrics")
    async def metrics(_: Request) -> Response:
        # The node's registry (page service) and the process-wide default one, where the
        # storage engine and redo count (page cache, redo records, get validation).
        body = metrics_text(registry) + metrics_text(REGISTRY)
        return Response(200, body, CONTENT_TYPE_LATEST)

    return router
