"""The pageserver node process: ``pagestore pageserver -c FILE``.

One trio program: the tenant manager (every tenant and timeline of the workdir loaded at
start, one WAL receiver + ingest per timeline when safekeepers are configured), the libpq
listener (``pagestream_v2``/``pagestream_v3`` from the page service, ``basebackup``,
``fullbackup``, ``set``) and the HTTP listener (management API and ``/metrics``).

Shutdown (SIGTERM, SIGINT or ``PageserverNode.stop()``): both listeners stop accepting;
open pagestreams and other libpq connections end with a FATAL 57P01 ErrorResponse; WAL
receivers stop; every timeline is flushed, so ``index_part.json`` holds all ingested WAL and
a restart resumes at ``last_record_lsn``.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from pathlib import Path

import structlog
import trio

from common.auth import CONTROL_PLANE_TOKEN_ENV, TOKEN_ENV, AuthKeyError, Service
from common.config import ConfigError
from common.http import HttpServer, HttpServerConfig
from common.logging import setup_logging
from common.malloc_tuning import keep_freed_heap
from common.metrics import new_registry
from common.pgserver import PgServer, PgServerConfig
from common.security import NodeSecurity
from common.signals import stop_on_signal
from pageserver.basebackup import BackupCommandHandler
from pageserver.config import PageserverConfig, load_pageserver_config
from pageserver.http_api import build_router
from pageserver.page_service.handler import PageServiceHandler
from pageserver.page_service.metrics import PageServiceMetrics
from pageserver.page_service.reader import NotFound, PageReader, Shutdown
from pageserver.page_service.timeline_adapter import TimelinePageReader
from pageserver.tenant_manager import TenantManager
from protocol import _native
from protocol.ids import TenantId, TimelineId

log = structlog.get_logger("pageserver.node")


class NodeTimelineLookup:
    """The page service's ``TimelineLookup`` over the tenant manager."""

    def __init__(self, manager: TenantManager) -> None:
        self.manager = manager

    def get_reader(self, tenant_id: TenantId, timeline_id: TimelineId) -> PageReader:
        if self.manager.shutting_down.is_set():
            raise Shutdown()
        try:
            tl = self.manager.get_timeline(tenant_id, timeline_id)
        except LookupError as exc:
            raise NotFound(str(exc)) from None
        return TimelinePageReader(tl, shutdown=self.manager.shutting_down)


class PageserverNode:
    def __init__(
        self,
        conf: PageserverConfig,
        *,
        handle_signals: bool = False,
        safekeeper_token: str | None = None,
        control_plane_token: str | None = None,
    ) -> None:
        """``safekeeper_token``: the WAL receivers' token for safekeepers with auth on
        (``run`` takes it from ``$PAGESTORE_AUTH_TOKEN``: never a command-line argument);
        ``control_plane_token``: the ``generations_api`` token of the upcalls to the storage
        controller (``$PAGESTORE_CONTROL_PLANE_API_TOKEN``)."""
        self.conf = conf
        self.handle_signals = handle_signals
        self.registry = new_registry()
        # Fails start-up (before any listener) when the keys or certificates do not load.
        self.security = NodeSecurity.build(
            Service.PAGESERVER,
            pg_auth_type=conf.pg_auth_type,
            http_auth_type=conf.http_auth_type,
            key_path=conf.auth_key_path if conf.auth_enabled else None,
            ssl_files=conf.ssl_paths,
        )
        self.manager = TenantManager(conf, safekeeper_token=safekeeper_token,
                                     control_plane_token=control_plane_token)
        self.page_metrics = PageServiceMetrics.register(self.registry)
        self.pg_port: int | None = None
        self.http_port: int | None = None
        self._stop = trio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self, *, task_status: trio.TaskStatus[tuple[int, int]] = trio.TASK_STATUS_IGNORED) -> None:
        conf = self.conf
        conf.workdir.mkdir(parents=True, exist_ok=True)
        backups = BackupCommandHandler(
            self.manager.get_timeline,
            wait_lsn_timeout_s=conf.wait_lsn_timeout_s,
            prev_record_lsn=self.manager.prev_record_lsn,
        )
        handler = PageServiceHandler(
            NodeTimelineLookup(self.manager),
            conf.page_service_config(),
            self.page_metrics,
            extra_commands={"basebackup": backups.basebackup, "fullbackup": backups.fullbackup},
        )
        pg_host, pg_port = conf.pg_addr
        http_host, http_port = conf.http_addr
        pg = PgServer(
            handler,
            PgServerConfig(host=pg_host, port=pg_port, server_version="15.0 (pagestore pageserver)",
                           shutdown_timeout_s=conf.shutdown_timeout_s),
            authenticator=self.security.pg_authenticator,
            ssl_context=self.security.ssl_context,
        )
        router = build_router(self.manager, self.registry)
        self.security.add_reload_route(router)
        http = HttpServer(
            router,
            HttpServerConfig(host=http_host, port=http_port, shutdown_timeout_s=conf.shutdown_timeout_s),
            auth=self.security.http_auth,
            ssl_context=self.security.ssl_context,
        )
        async with trio.open_nursery() as background:
            if self.handle_signals:
                background.start_soon(stop_on_signal, self.stop)
            await self.manager.start(background)
            async with trio.open_nursery() as servers:
                self.pg_port = await servers.start(pg.serve)
                self.http_port = await servers.start(http.serve)
                log.info("pageserver started", id=conf.id, pg_port=self.pg_port, http_port=self.http_port,
                         workdir=str(conf.workdir), tenants=len(self.manager.tenants), **_native.describe())
                task_status.started((self.pg_port, self.http_port))
                await self._stop.wait()
                log.info("pageserver stopping")
                # Timelines report shutdown first, so streams end with 57P01 from the page
                # service; then the listeners close whatever connections remain.
                self.manager.shutting_down.set()
                pg.shutdown()
                http.shutdown()
                servers.cancel_scope.deadline = trio.current_time() + conf.shutdown_timeout_s * 2
            await self.manager.shutdown()
            background.cancel_scope.cancel()
        log.info("pageserver stopped")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", type=Path, required=True, help="pageserver TOML config file")


def run(args: argparse.Namespace) -> int:
    try:
        conf = load_pageserver_config(args.config)
    except ConfigError as exc:
        print(f"pageserver: {exc}", file=sys.stderr)
        return 2
    setup_logging(log_file=conf.log_path, level=conf.log_level)
    # per-batch response and read buffers: keep freed heap instead of brk churn (the module)
    keep_freed_heap()
    try:
        node = PageserverNode(conf, handle_signals=True,
                              safekeeper_token=os.environ.get(TOKEN_ENV) or None,
                              control_plane_token=os.environ.get(CONTROL_PLANE_TOKEN_ENV) or None)
    except (AuthKeyError, OSError, ValueError, ssl.SSLError) as exc:
        print(f"pageserver: cannot start: {exc}", file=sys.stderr)
        return 2
    trio.run(node.run)
    return 0
