"""``pagestore walproposer``: run the bridge beside a vanilla PostgreSQL until interrupted, or
(``--sync-safekeepers``) commit what the safekeepers hold before a compute starts."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import structlog
import trio

from common.auth import TOKEN_ENV
from common.logging import LEVELS, setup_logging
from compute.walproposer.bridge import (
    Bridge,
    BridgeConfig,
    PostgresInfo,
    SafekeeperAddr,
    pgclient_connect,
)
from protocol.ids import TenantId, TimelineId
from protocol.lsn import INVALID_LSN, WAL_SEGMENT_SIZE, Lsn, format_lsn, parse_lsn


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pg-host", default="127.0.0.1", help="PostgreSQL host (default 127.0.0.1)")
    parser.add_argument("--pg-port", type=int, default=None,
                        help="PostgreSQL port (required, except with --sync-safekeepers)")
    parser.add_argument("--pg-user", default="postgres", help="a role with REPLICATION")
    parser.add_argument(
        "--safekeepers", required=True, help="comma-separated host:port list of safekeepers"
    )
    parser.add_argument("--tenant-id", required=True, help="32 hex chars")
    parser.add_argument("--timeline-id", required=True, help="32 hex chars")
    parser.add_argument(
        "--start-lsn",
        default=None,
        help="X/Y where a fresh timeline's WAL starts (a record start); "
        "default: the physical slot's restart_lsn (the last checkpoint's redo point)",
    )
    parser.add_argument(
        "--application-name",
        default="walproposer",
        help="the name synchronous_standby_names lists (default walproposer)",
    )
    parser.add_argument("--slot-name", default="walproposer", help="physical slot (created if missing)")
    parser.add_argument("--buffer-mb", type=int, default=64, help="WAL window kept in memory")
    parser.add_argument(
        "--max-slot-lag-mb",
        type=int,
        default=1024,
        help="the slot keeps WAL for lagging safekeepers, at most this far behind the quorum",
    )
    parser.add_argument("--ssl-ca-file", default=None,
                        help="connect to the safekeepers with TLS, verifying them against this CA "
                        f"(the tenant token, if auth is on, comes from ${TOKEN_ENV})")
    parser.add_argument("--log-file", default=None, help="JSON log lines here (default stderr)")
    parser.add_argument("--log-level", default="info", choices=sorted(LEVELS, key=LEVELS.__getitem__))
    parser.add_argument(
        "--sync-safekeepers",
        action="store_true",
        help="no PostgreSQL: win a term and commit the WAL the safekeepers hold (what a compute "
        "that died left uncommitted), print the LSN where it ends and exit (before a compute starts)",
    )
    parser.add_argument("--system-id", type=int, default=0,
                        help="with --sync-safekeepers: the timeline's system id (0: keep theirs)")
    parser.add_argument("--pg-version", type=int, default=150000,
                        help="with --sync-safekeepers: PostgreSQL version number (default 150000)")
    parser.add_argument("--sync-timeout", type=float, default=30.0,
                        help="with --sync-safekeepers: give up after this many seconds")
    parser.add_argument(
        "--status-file",
        default=None,
        help="write statistics() as JSON to this file every second (for tests and tools)",
    )


def config_from_args(args: argparse.Namespace) -> BridgeConfig:
    return BridgeConfig(
        pg_host=args.pg_host,
        pg_port=args.pg_port or 0,
        pg_user=args.pg_user,
        safekeepers=tuple(SafekeeperAddr.parse(s) for s in args.safekeepers.split(",") if s.strip()),
        tenant_id=TenantId.parse(args.tenant_id),
        timeline_id=TimelineId.parse(args.timeline_id),
        start_lsn=None if args.start_lsn is None else parse_lsn(args.start_lsn),
        application_name=args.application_name,
        slot_name=args.slot_name,
        buffer_bytes=args.buffer_mb * 1024 * 1024,
        max_slot_lag_bytes=args.max_slot_lag_mb * 1024 * 1024,
        auth_token=os.environ.get(TOKEN_ENV) or None,
        ssl_ca_file=args.ssl_ca_file,
    )


def _replace_file(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


async def _write_status(bridge: Bridge, path: str) -> None:
    while True:
        # The snapshot is taken on the trio thread; the file IO runs off it.
        await trio.to_thread.run_sync(_replace_file, path, json.dumps(bridge.statistics()))
        await trio.sleep(1)


async def amain(cfg: BridgeConfig, status_file: str | None) -> None:
    structlog.contextvars.bind_contextvars(
        tenant_id=cfg.tenant_id.hex, timeline_id=cfg.timeline_id.hex
    )
    bridge = Bridge(cfg, pgclient_connect)
    async with trio.open_nursery() as nursery:
        if status_file:
            nursery.start_soon(_write_status, bridge, status_file)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            nursery.start_soon(bridge.run)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


async def sync_main(cfg: BridgeConfig, info: PostgresInfo, timeout: float) -> Lsn:
    structlog.contextvars.bind_contextvars(
        tenant_id=cfg.tenant_id.hex, timeline_id=cfg.timeline_id.hex
    )
    with trio.fail_after(timeout):
        return await Bridge(cfg, pgclient_connect).sync_safekeepers(info)


def run(args: argparse.Namespace) -> int:
    if args.pg_port is None and not args.sync_safekeepers:
        print("pagestore walproposer: error: --pg-port is required", file=sys.stderr)
        return 2
    setup_logging(log_file=Path(args.log_file) if args.log_file else None, level=args.log_level)
    cfg = config_from_args(args)
    if args.sync_safekeepers:
        info = PostgresInfo(args.system_id, args.pg_version, WAL_SEGMENT_SIZE, INVALID_LSN)
        try:
            lsn = trio.run(sync_main, cfg, info, args.sync_timeout)
        except trio.TooSlowError:
            print(f"pagestore walproposer: error: sync-safekeepers: no quorum committed the "
                  f"safekeepers' WAL within {args.sync_timeout:g} s (see the log)", file=sys.stderr)
            return 1
        except Exception as exc:  # one line for the caller; the log has the traceback
            structlog.get_logger("walproposer").error("sync-safekeepers failed", exc_info=exc)
            leaves = exc.exceptions if isinstance(exc, ExceptionGroup) else (exc,)
            print(f"pagestore walproposer: error: sync-safekeepers failed: "
                  f"{'; '.join(repr(e) for e in leaves)}", file=sys.stderr)
            return 1
        print(format_lsn(lsn))
        return 0
    trio.run(amain, cfg, args.status_file)
    return 0
