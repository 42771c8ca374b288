"""The safekeeper node process: ``pagestore safekeeper -c FILE``.

Owns the timelines of one node (loaded from ``data_dir/<tenant>/<timeline>/`` at start-up,
created on a proposer's greeting), the libpq port (walproposers push, replicas pull) and the
HTTP port (status, metrics), and per timeline the WAL removal and (with ``remote_storage``)
the WAL backup tasks; with ``peer_http``, the sharing of ``remote_consistent_lsn`` with the
other safekeepers (``safekeeper.peers``). SIGTERM / SIGINT: stop accepting, tell clients 57P01, save every
timeline's control file, exit 0.

Commands on the libpq port (tenant and timeline come from the startup ``options``:
``-c tenant_id=<hex> timeline_id=<hex>``; aliases ``ztenantid`` / ``ztimelineid``):
``START_WAL_PUSH [(proto_version '3', allow_timeline_creation 'true')]``,
``START_REPLICATION [SLOT s] [PHYSICAL] X/Y [TIMELINE 1] [(term='N')]``, ``IDENTIFY_SYSTEM``,
``TIMELINE_STATUS``, ``TIMELINE_HISTORY n``, ``SHOW wal_segment_size``,
``SHOW data_directory_mode``, ``READ_REPLICATION_SLOT s`` (no slots here), ``SET ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import ssl
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path

import structlog
import trio

from common.auth import TOKEN_ENV, AuthKeyError, Service
from common.fsync import fsync_dir
from common.logging import setup_logging
from common.pgserver import PgConnection, PgServer, PgServerConfig
from common.security import NodeSecurity
from common.signals import stop_on_signal
from common.tls import client_context
from protocol import _native
from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import format_lsn
from protocol.pgwire import sqlstate
from protocol.pgwire.errors import PgError
from protocol.replication import (
    CreateReplicationSlot,
    IdentifySystem,
    ReadReplicationSlot,
    SetCommand,
    Show,
    StartReplication,
    StartWalPush,
    TimelineHistory,
    TimelineStatus,
    parse_replication_command,
)
from remote_storage import RemoteStorage, make_remote_storage
from remote_storage.prefix_delete import delete_prefix
from remote_storage.wal_layout import wal_tenant_prefix, wal_timeline_prefix
from safekeeper.config import ConfigError, SafekeeperConfig, load_config
from safekeeper.control_file import CONTROL_FILE_NAME, ControlFileError
from safekeeper.http_api import build_http_server
from safekeeper.peers import run_peer_sync
from safekeeper.receive_wal import IngestConfig, serve_wal_push
from safekeeper.send_wal import check_start, serve_replication
from safekeeper.timeline import Timeline, has_wal_segments
from safekeeper.wal_backup import BackupSettings, run_wal_backup
from safekeeper.wal_removal import run_wal_removal
from safekeeper.wal_storage import WalStorageError

log = structlog.get_logger("safekeeper")

DELETE_WAIT_S = 30.0  # for a deleted timeline's tasks and connections to end


class SafekeeperNode:
    def __init__(self, cfg: SafekeeperConfig) -> None:
        self.cfg = cfg
        self.timelines: dict[tuple[TenantId, TimelineId], Timeline] = {}
        self._create_lock = trio.Lock()
        self.pg_port: int | None = None
        self.http_port: int | None = None
        # Fails start-up (before any listener) when the keys or certificates do not load.
        self.security = NodeSecurity.build(
            Service.SAFEKEEPER,
            pg_auth_type=cfg.pg_auth_type,
            http_auth_type=cfg.http_auth_type,
            key_path=Path(cfg.auth_validation_public_key_path)
            if cfg.auth_validation_public_key_path else None,
            ssl_files=(Path(cfg.ssl_cert_file), Path(cfg.ssl_key_file))
            if cfg.ssl_cert_file and cfg.ssl_key_file else None,
        )
        self.pg_server = PgServer(
            SafekeeperHandler(self),
            PgServerConfig(host=cfg.pg_addr[0], port=cfg.pg_addr[1], idle_timeout_s=None),
            authenticator=self.security.pg_authenticator,
            ssl_context=self.security.ssl_context,
        )
        self.ingest = IngestConfig(cfg.ingest_queue, cfg.max_write_bytes, cfg.ingest_queue_bytes)
        self._stop = trio.Event()
        # WAL backup (safekeeper.wal_backup): None without remote_storage in the config.
        self.remote: RemoteStorage | None = (
            None if cfg.remote_storage is None else make_remote_storage(cfg.remote_storage)
        )
        self.backup_settings = BackupSettings(
            node_id=cfg.id,
            peers=tuple(cfg.wal_backup_peers),
            period_s=cfg.wal_backup_period_s,
            takeover_bytes=cfg.wal_backup_takeover_bytes,
        )
        # Where the per-timeline background tasks (WAL removal, backup) run; set by run().
        self._tasks: trio.Nursery | None = None
        # Per timeline, the cancel scopes of everything working on it (background tasks and
        # connections): a deletion cancels them and waits until they are gone.
        self._scopes: dict[tuple[TenantId, TimelineId], set[trio.CancelScope]] = {}
        self._scopes_changed = trio.Event()

    def stop(self) -> None:
        """Begin a graceful shutdown (what SIGTERM does)."""
        self._stop.set()

    def timeline_dir(self, tenant_id: TenantId, timeline_id: TimelineId) -> Path:
        return self.cfg.data_path / tenant_id.hex / timeline_id.hex

    def load_timelines(self) -> None:
        root = self.cfg.data_path
        root.mkdir(parents=True, exist_ok=True)
        for tenant_dir in sorted(root.iterdir()):
            if not tenant_dir.is_dir():
                continue
            for tl_dir in sorted(tenant_dir.iterdir()):
                if not tl_dir.is_dir():
                    continue
                if not (tl_dir / CONTROL_FILE_NAME).exists():
                    if has_wal_segments(tl_dir):
                        # Skipping it would let the next proposer create the timeline afresh
                        # at term 0 over this WAL.
                        raise ControlFileError(
                            f"{tl_dir}: holds WAL segments but no {CONTROL_FILE_NAME}"
                        )
                    continue
                tl = Timeline.load(
                    tl_dir, self.cfg.id, no_sync=self.cfg.no_sync,
                    wal_io_engine=self.cfg.wal_io_engine, direct_io=self.cfg.direct_io,
                )
                if (tl.tenant_id.hex, tl.timeline_id.hex) != (tenant_dir.name, tl_dir.name):
                    # A copied directory: two timelines would claim one id, one silently lost.
                    raise ControlFileError(
                        f"{tl_dir}: its control file is for {tl.tenant_id.hex}/"
                        f"{tl.timeline_id.hex}"
                    )
                self.timelines[(tl.tenant_id, tl.timeline_id)] = tl

    def find_timeline(self, tenant_hex: str, timeline_hex: str) -> Timeline | None:
        try:
            key = (TenantId.parse(tenant_hex), TimelineId.parse(timeline_hex))
        except RemoteProtocolError:
            return None
        return self.timelines.get(key)

    async def get_timeline(
        self, tenant_id: TenantId, timeline_id: TimelineId, create: bool
    ) -> Timeline | None:
        key = (tenant_id, timeline_id)
        async with self._create_lock:
            tl = self.timelines.get(key)
            if tl is None and create:
                tl = await trio.to_thread.run_sync(
                    lambda: Timeline.create(
                        self.timeline_dir(tenant_id, timeline_id),
                        self.cfg.id,
                        tenant_id,
                        timeline_id,
                        no_sync=self.cfg.no_sync,
                        wal_io_engine=self.cfg.wal_io_engine,
                        direct_io=self.cfg.direct_io,
                    )
                )
                self.timelines[key] = tl
                self._start_background(tl)
                log.info("timeline created", tenant_id=tenant_id.hex, timeline_id=timeline_id.hex)
            return tl

    @contextlib.contextmanager
    def timeline_scope(self, tenant_id: TenantId, timeline_id: TimelineId) -> Iterator[trio.CancelScope]:
        """A cancel scope for work on one timeline, cancelled when the timeline is deleted."""
        key = (tenant_id, timeline_id)
        scope = trio.CancelScope()
        scopes = self._scopes.setdefault(key, set())
        scopes.add(scope)
        try:
            with scope:
                yield scope
        finally:
            scopes.discard(scope)
            if not scopes and self._scopes.get(key) is scopes:
                del self._scopes[key]
            self._scopes_changed.set()

    async def _for_timeline(self, tl: Timeline, fn: Callable[..., Awaitable[None]], *args: object) -> None:
        with self.timeline_scope(tl.tenant_id, tl.timeline_id):
            await fn(tl, *args)

    def _start_background(self, tl: Timeline) -> None:
        if self._tasks is None:
            return
        if self.remote is not None:
            # Before removal starts: from now on removal waits for the backup.
            tl.backup.enabled = True
            self._tasks.start_soon(self._for_timeline, tl, run_wal_backup, self.remote, self.backup_settings)
        period = self.cfg.wal_removal_period_s
        if period > 0:
            self._tasks.start_soon(self._for_timeline, tl, run_wal_removal, period)

    async def _cancel_timeline_work(self, keys: list[tuple[TenantId, TimelineId]]) -> None:
        """Cancel every task and connection on these timelines and wait until they are gone
        (a WAL write or upload in a worker thread finishes first: then nothing of theirs is
        in flight)."""
        for key in keys:
            for scope in self._scopes.get(key, ()):
                scope.cancel()
        with trio.fail_after(DELETE_WAIT_S):
            while any(self._scopes.get(key) for key in keys):
                self._scopes_changed = trio.Event()
                await self._scopes_changed.wait()

    async def delete_timeline(self, tenant_id: TenantId, timeline_id: TimelineId) -> dict[str, object]:
        """Delete a timeline: its tasks and connections stopped, its local directory, and its
        WAL backup ``wal/<tenant>/<timeline>/`` in remote storage. Idempotent: a repeated
        request (after a failure in the remote part, or on another safekeeper first) deletes
        what is left; 404 only when nothing was there."""
        return await self._delete([(tenant_id, timeline_id)], self.cfg.data_path / tenant_id.hex / timeline_id.hex,
                                  wal_timeline_prefix(tenant_id, timeline_id))

    async def delete_tenant(self, tenant_id: TenantId) -> dict[str, object]:
        """Delete every timeline of a tenant here and its whole ``wal/<tenant>/`` tree."""
        keys = [k for k in self.timelines if k[0] == tenant_id]
        return await self._delete(keys, self.cfg.data_path / tenant_id.hex, wal_tenant_prefix(tenant_id))

    async def _delete(self, keys: list[tuple[TenantId, TimelineId]], directory: Path, prefix: str) -> dict[str, object]:
        async with self._create_lock:  # no timeline of theirs is created meanwhile
            timelines = [self.timelines.pop(k) for k in keys if k in self.timelines]
            await self._cancel_timeline_work(keys)
            for tl in timelines:
                # A write its cancelled connection submitted may still be queued in the WAL
                # IO engine: after it (calls run in order), close the segment, so nothing
                # writes into the directory while it is removed.
                await tl.io.run(tl.storage.close)
            existed = directory.exists()

            def remove() -> None:
                shutil.rmtree(directory, ignore_errors=False)
                fsync_dir(directory.parent)

            if existed:
                await trio.to_thread.run_sync(remove)
            removed = 0
            if self.remote is not None:
                removed = await delete_prefix(self.remote, prefix)
        for key in keys:
            log.info("timeline deleted", tenant_id=key[0].hex, timeline_id=key[1].hex, remote_objects=removed)
        return {"timelines": len(timelines), "dir_existed": existed, "remote_objects_deleted": removed}

    def status(self) -> dict[str, object]:
        return {
            "id": self.cfg.id,
            "pg_port": self.pg_port,
            "http_port": self.http_port,
            "timelines": len(self.timelines),
            "no_sync": self.cfg.no_sync,
            "ingest_queue": self.cfg.ingest_queue,
            "max_write_bytes": self.cfg.max_write_bytes,
            "wal_io_engine": self.cfg.wal_io_engine,
            "wal_direct_io": self.cfg.wal_direct_io,
            "direct_io": self.cfg.direct_io,
            "wal_removal_period_s": self.cfg.wal_removal_period_s,
            "wal_backup": self.remote is not None,
            "wal_backup_peers": list(self.cfg.wal_backup_peers),
            # which kernels run (native or python) and the CRC-32C kernel
            **_native.describe(),
        }

    async def run(self, *, task_status: trio.TaskStatus[tuple[int, int]] = trio.TASK_STATUS_IGNORED) -> None:
        await trio.to_thread.run_sync(self.load_timelines)
        http = build_http_server(self)
        async with trio.open_nursery() as nursery:
            self.pg_port = await nursery.start(self.pg_server.serve)
            self.http_port = await nursery.start(http.serve)
            self._tasks = nursery
            for tl in self.timelines.values():
                self._start_background(tl)
            if self.cfg.peer_http:
                context = None if self.cfg.ssl_ca_file is None else client_context(Path(self.cfg.ssl_ca_file))
                nursery.start_soon(functools.partial(
                    run_peer_sync, self.timelines, self.cfg.peer_http, self.cfg.peer_sync_period_s,
                    token=os.environ.get(TOKEN_ENV) or None, context=context,
                ))
            log.info("safekeeper started", pg_port=self.pg_port, http_port=self.http_port, id=self.cfg.id, **_native.describe())
            task_status.started((self.pg_port, self.http_port))
            if threading.current_thread() is threading.main_thread():
                nursery.start_soon(stop_on_signal, self.stop)
            await self._stop.wait()
            self.pg_server.shutdown()
            with trio.move_on_after(self.pg_server.config.shutdown_timeout_s + 1):
                while self.pg_server.connection_count:
                    await trio.sleep(0.05)
            for tl in self.timelines.values():
                await tl.persist()
            http.shutdown()
            nursery.cancel_scope.cancel()
        if self.remote is not None:
            await self.remote.aclose()


def _conn_ids(conn: PgConnection) -> tuple[TenantId, TimelineId]:
    opts = conn.options
    tenant = opts.get("tenant_id") or opts.get("ztenantid")
    timeline = opts.get("timeline_id") or opts.get("ztimelineid")
    if not tenant or not timeline:
        raise PgError(
            "tenant_id and timeline_id are required in the startup options "
            "(options='-c tenant_id=<hex> timeline_id=<hex>')",
            sqlstate.INVALID_PARAMETER_VALUE,
        )
    return TenantId.parse(tenant), TimelineId.parse(timeline)


class SafekeeperHandler:
    def __init__(self, node: SafekeeperNode) -> None:
        self.node = node

    async def _existing(self, conn: PgConnection) -> Timeline:
        tenant_id, timeline_id = _conn_ids(conn)
        tl = await self.node.get_timeline(tenant_id, timeline_id, False)
        if tl is None:
            raise PgError(f"timeline {tenant_id}/{timeline_id} not found", sqlstate.INTERNAL_ERROR)
        return tl

    async def handle_query(self, conn: PgConnection, query: str) -> None:
        cmd = parse_replication_command(query)
        if isinstance(cmd, SetCommand):
            await conn.send_command_complete("SELECT 1")
            return
        tenant_id, timeline_id = _conn_ids(conn)
        conn.bind_log(tenant_id=tenant_id.hex, timeline_id=timeline_id.hex)
        # Every command below acts on the connection's tenant (or needs it named).
        conn.authorize(tenant_id)
        with self.node.timeline_scope(tenant_id, timeline_id) as scope:
            await self._serve(conn, cmd, tenant_id, timeline_id)
        if scope.cancelled_caught:
            raise PgError(f"timeline {tenant_id}/{timeline_id} was deleted", sqlstate.ADMIN_SHUTDOWN,
                          severity="FATAL")

    async def _serve(self, conn: PgConnection, cmd: object, tenant_id: TenantId, timeline_id: TimelineId) -> None:
        match cmd:
            case StartWalPush():
                copy = await conn.enter_copy_both()
                try:
                    await serve_wal_push(
                        copy,
                        3 if cmd.proto_version == 3 else 2,
                        (tenant_id, timeline_id),
                        self.node.get_timeline,
                        cmd.allow_timeline_creation,
                        self.node.ingest,
                        partial(conn.copy_receive_views, copy),
                        partial(conn.copy_receive_scan, copy),
                    )
                except RemoteProtocolError as exc:
                    # Neon closes the stream on any proposer error: FATAL ends the connection.
                    raise PgError(exc.msg, exc.sqlstate, severity="FATAL") from None
                except WalStorageError as exc:
                    # An IO error (58030) or WAL that is not ours: nothing of the failed group
                    # was acknowledged; the proposer must go elsewhere or wait for a restart.
                    log.error("WAL storage error", error=str(exc), sqlstate=exc.sqlstate)
                    raise PgError(str(exc), exc.sqlstate, severity="FATAL") from None
            case IdentifySystem():
                tl = await self._existing(conn)
                recovery = conn.startup_params.get("application_name", "").startswith(
                    ("safekeeper", "wal_proposer_recovery")
                )
                pos = tl.acceptor.flush_lsn if recovery else tl.acceptor.commit_lsn
                await conn.send_rows(
                    ["systemid", "timeline", "xlogpos", "dbname"],
                    [(str(tl.acceptor.state.system_id), "1", format_lsn(pos), None)],
                    command_tag="IDENTIFY_SYSTEM",
                )
            case TimelineStatus():
                tl = await self._existing(conn)
                await conn.send_rows(
                    ["flush_lsn", "commit_lsn"],
                    [(format_lsn(tl.acceptor.flush_lsn), format_lsn(tl.acceptor.commit_lsn))],
                    command_tag="TIMELINE_STATUS",
                )
            case Show():
                await self._show(conn, cmd.name)
            case TimelineHistory():
                raise PgError(
                    f"could not open file \"{cmd.timeline:08X}.history\": only timeline 1 exists",
                    "58P01",  # undefined_file, as PostgreSQL answers
                )
            case ReadReplicationSlot():
                await conn.send_rows(
                    ["slot_type", "restart_lsn", "restart_tli"], [(None, None, None)],
                    command_tag="READ_REPLICATION_SLOT",
                )
            case CreateReplicationSlot():
                raise PgError(
                    "replication slots are not supported by the safekeeper",
                    sqlstate.FEATURE_NOT_SUPPORTED,
                )
            case StartReplication():
                tl = await self._existing(conn)
                if cmd.timeline not in (None, 1):
                    raise PgError(f"requested timeline {cmd.timeline} is not in this server's history", "58P01")
                check_start(tl, cmd.start_lsn, cmd.term)
                copy = await conn.enter_copy_both("START_STREAMING")
                name = conn.startup_params.get("application_name", "") or conn.peer
                await serve_replication(copy, tl, cmd.start_lsn, name=name, term=cmd.term)

    async def _show(self, conn: PgConnection, name: str) -> None:
        values = {
            "wal_segment_size": "16MB",
            "data_directory_mode": "0700",
            "server_version": "15.0",
            "server_version_num": "150000",
            "integer_datetimes": "on",
        }
        if name not in values:
            raise PgError(f'unrecognized configuration parameter "{name}"', sqlstate.UNDEFINED_OBJECT)
        await conn.send_rows([name], [(values[name],)], command_tag="SHOW")


# -- CLI ---------------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", required=True, type=Path, help="safekeeper TOML config")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"safekeeper: {exc}", file=sys.stderr)
        return 2
    setup_logging(log_file=Path(cfg.log_file) if cfg.log_file else None, level=cfg.log_level)
    try:
        node = SafekeeperNode(cfg)
    except (AuthKeyError, OSError, ValueError, ssl.SSLError) as exc:
        print(f"safekeeper: cannot start: {exc}", file=sys.stderr)
        return 2
    # Process-wide: the WAL writer threads get the GIL back sooner (see the config key).
    sys.setswitchinterval(cfg.gil_switch_interval_s)
    try:
        trio.run(node.run)
    except (ControlFileError, WalStorageError) as exc:
        # Never started afresh over a damaged timeline: terms would go back to 0. A WAL
        # directory whose filesystem refuses wal_direct_io stops start-up the same way.
        print(f"safekeeper: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0
