"""The storage controller: the one authority on which pageserver holds each tenant, and in
which generation (remote-storage.md §3; Neon's ``storage_controller``, much reduced).

State: ``{tenant id: (generation, node id)}`` in a JSON file, written atomically (temp file,
fsync, rename, directory fsync) *before* any answer that hands out a generation, so a
generation is never handed out twice, even across a crash of the controller.

HTTP API (JSON):

- ``POST /upcall/v1/re-attach {node_id}`` → ``{tenants: [{id, gen}]}``: a pageserver starting.
  Every tenant attached to that node gets a new generation (its previous process may still be
  running somewhere, half-dead: its writes must lose).
- ``POST /upcall/v1/validate {tenants: [{id, gen}]}`` → ``{tenants: [{id, valid}]}``: is this
  still the tenant's current generation? A pageserver asks before it deletes remote objects
  or reports ``remote_consistent_lsn``. Unknown tenants are answered ``valid: false``.
- ``POST /upcall/v1/attach {tenant_id, node_id}`` → ``{gen}``: a pageserver creating a new
  tenant registers it (409 if another node holds it).
- ``POST /control/v1/tenant/{tenant_id}/attach {node_id}`` → ``{gen}``: move the tenant to
  ``node_id`` with a new generation (the CLI then tells that pageserver to attach with it).
- ``DELETE /control/v1/tenant/{tenant_id}``: the tenant was deleted; it keeps a tombstone
  (node 0, its generation advanced past every one it had).
- ``GET /control/v1/tenant`` → ``{tenants: [{id, gen, node_id}]}`` (node 0: deleted).

Auth (``http_auth_type = "NeonJWT"``, docs/auth.md; Neon's scopes): ``/upcall/v1/*`` needs a
``generations_api`` token (what the pageservers hold), every other route an ``admin`` token
(what the CLI holds); ``admin`` passes everywhere; only ``/v1/status`` is open. Without it
anyone who reaches the port could hand out generations, move tenants or tombstone them.
TLS (``ssl_cert_file``/``ssl_key_file``): the port speaks HTTPS.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
from pathlib import Path

import attrs
import structlog
import trio

from common.auth import AuthKeyError, Scope, Service
from common.config import ConfigError, load_config
from common.http import HttpError, HttpServer, HttpServerConfig, Request, Router
from common.logging import setup_logging
from common.security import NodeSecurity
from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId

log = structlog.get_logger("storage_controller")


@attrs.frozen(kw_only=True)
class StorageControllerConfig:
    workdir: Path
    listen_http_addr: str = "127.0.0.1:1234"
    log_file: Path | None = None
    log_level: str = "info"
    # "NeonJWT": every route but /v1/status needs a token (``route_scope``); "Trust": none.
    http_auth_type: str = attrs.field(default="Trust", validator=attrs.validators.in_(("Trust", "NeonJWT")))
    auth_validation_public_key_path: Path | None = None
    ssl_cert_file: Path | None = None
    ssl_key_file: Path | None = None

    def __attrs_post_init__(self) -> None:
        if (self.ssl_cert_file is None) != (self.ssl_key_file is None):
            raise ValueError("ssl_cert_file and ssl_key_file go together: set both or neither")

    def security(self) -> NodeSecurity:
        """Keys and certificate loaded (``AuthKeyError``/``OSError``/``ssl.SSLError`` name a
        file that does not load)."""
        ssl_files = None if self.ssl_cert_file is None or self.ssl_key_file is None else (
            self.ssl_cert_file, self.ssl_key_file)
        return NodeSecurity.build(
            Service.STORAGE_CONTROLLER, pg_auth_type="Trust", http_auth_type=self.http_auth_type,
            key_path=self.auth_validation_public_key_path, ssl_files=ssl_files, scope_of=route_scope,
        )


UPCALL_PREFIX = "/upcall/v1/"


def route_scope(path: str) -> Scope:
    """The scope a route needs: the pageservers' upcalls ``generations_api``, everything else
    (the control API, key and certificate reloads, and any route added later) ``admin``."""
    return Scope.GENERATIONS_API if path.startswith(UPCALL_PREFIX) else Scope.ADMIN


@attrs.frozen
class NodeRequest:
    node_id: int


@attrs.frozen
class AttachUpcall:
    tenant_id: str
    node_id: int


@attrs.frozen
class TenantGen:
    id: str
    gen: int


@attrs.frozen
class ValidateRequest:
    tenants: list[TenantGen]


class GenerationStore:
    """Tenant -> (generation, node), persisted before every change is answered."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tenants: dict[str, tuple[int, int]] = {}
        if path.exists():
            doc = json.loads(path.read_text())
            self.tenants = {t: (int(v["gen"]), int(v["node_id"])) for t, v in doc["tenants"].items()}
        self.lock = trio.Lock()

    def _persist(self) -> None:
        doc = {"tenants": {t: {"gen": g, "node_id": n} for t, (g, n) in sorted(self.tenants.items())}}
        tmp = self.path.with_name(self.path.name + ".___temp")
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    async def persist(self) -> None:
        await trio.to_thread.run_sync(self._persist)

    async def attach(self, tenant_id: str, node_id: int, *, only_new: bool = False) -> int:
        async with self.lock:
            current = self.tenants.get(tenant_id)
            # (node 0: a deleted tenant's tombstone; the id may be created again, above it)
            if only_new and current is not None and current[1] not in (node_id, 0):
                raise HttpError(409, f"tenant {tenant_id} is attached to pageserver {current[1]}")
            gen = 1 if current is None else current[0] + 1
            self.tenants[tenant_id] = (gen, node_id)
            await self.persist()
            return gen

    async def re_attach(self, node_id: int) -> dict[str, int]:
        async with self.lock:
            out = {}
            for tenant_id, (gen, node) in self.tenants.items():
                if node == node_id:
                    self.tenants[tenant_id] = (gen + 1, node)
                    out[tenant_id] = gen + 1
            await self.persist()
            return out

    async def forget(self, tenant_id: str) -> bool:
        """A deleted tenant: no node holds it, and no generation it had is valid any more (a
        tombstone: the next attach of the same id continues above it, never reuses one)."""
        async with self.lock:
            current = self.tenants.get(tenant_id)
            if current is None:
                return False
            self.tenants[tenant_id] = (current[0] + 1, 0)
            await self.persist()
            return True

    def valid(self, tenant_id: str, gen: int) -> bool:
        current = self.tenants.get(tenant_id)
        return current is not None and current[0] == gen


def _tenant(raw: str) -> str:
    try:
        return TenantId.parse(raw).hex
    except RemoteProtocolError as exc:
        raise HttpError(400, f"bad tenant id {raw!r}: {exc}") from None


def build_router(store: GenerationStore, security: NodeSecurity | None = None) -> Router:
    router = Router()
    if security is not None:
        security.add_reload_route(router)

    @router.route("GET", "/v1/status")
    async def status(_req: Request) -> object:
        return {"tenants": len(store.tenants)}

    @router.route("POST", "/upcall/v1/re-attach")
    async def re_attach(req: Request) -> object:
        body = req.structure(NodeRequest)
        tenants = await store.re_attach(body.node_id)
        log.info("re-attach", node_id=body.node_id, tenants=len(tenants))
        return {"tenants": [{"id": t, "gen": g} for t, g in sorted(tenants.items())]}

    @router.route("POST", "/upcall/v1/validate")
    async def validate(req: Request) -> object:
        body = req.structure(ValidateRequest)
        return {"tenants": [{"id": t.id, "valid": store.valid(_tenant(t.id), t.gen)} for t in body.tenants]}

    @router.route("POST", "/upcall/v1/attach")
    async def attach_new(req: Request) -> object:
        body = req.structure(AttachUpcall)
        gen = await store.attach(_tenant(body.tenant_id), body.node_id, only_new=True)
        log.info("tenant registered", tenant_id=body.tenant_id, node_id=body.node_id, gen=gen)
        return {"gen": gen}

    @router.route("POST", "/control/v1/tenant/{tenant_id}/attach")
    async def attach(req: Request) -> object:
        body = req.structure(NodeRequest)
        tenant_id = _tenant(req.params["tenant_id"])
        gen = await store.attach(tenant_id, body.node_id)
        log.info("tenant attached", tenant_id=tenant_id, node_id=body.node_id, gen=gen)
        return {"gen": gen}

    @router.route("DELETE", "/control/v1/tenant/{tenant_id}")
    async def forget(req: Request) -> object:
        tenant_id = _tenant(req.params["tenant_id"])
        if not await store.forget(tenant_id):
            raise HttpError(404, f"tenant {tenant_id} not found")
        log.info("tenant deleted", tenant_id=tenant_id)
        return {}

    @router.route("GET", "/control/v1/tenant")
    async def tenants(_req: Request) -> object:
        return {"tenants": [{"id": t, "gen": g, "node_id": n} for t, (g, n) in sorted(store.tenants.items())]}

    return router


async def serve(
    config: StorageControllerConfig, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    config.workdir.mkdir(parents=True, exist_ok=True)
    store = GenerationStore(config.workdir / "generations.json")
    security = config.security()
    host, _, port = config.listen_http_addr.rpartition(":")
    server = HttpServer(build_router(store, security), HttpServerConfig(host=host, port=int(port)),
                        auth=security.http_auth, ssl_context=security.ssl_context)
    async with trio.open_nursery() as nursery:
        bound: int = await nursery.start(server.serve)
        log.info("storage controller started", port=bound, tenants=len(store.tenants),
                 auth=security.http_auth is not None, tls=security.ssl_context is not None)
        task_status.started(bound)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", type=Path, required=True, help="storage controller TOML config")


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(StorageControllerConfig, args.config)
    except ConfigError as exc:
        print(f"storage-controller: {exc}", file=sys.stderr)
        return 2
    setup_logging(log_file=config.log_file, level=config.log_level)
    try:
        config.security()  # a key or certificate that does not load: say so, exit 2
    except (AuthKeyError, OSError, ValueError, ssl.SSLError) as exc:
        print(f"storage-controller: cannot start: {exc}", file=sys.stderr)
        return 2
    trio.run(serve, config)
    return 0
