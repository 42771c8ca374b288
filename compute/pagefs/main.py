"""``pagestore pagefs``: the page filesystem of one lazy endpoint, as a process the control
plane supervises (like the walproposer bridge). ``endpoint start`` spawns it first, before it
knows the start LSN S (``--start-lsn -``: S is the first line of stdin), so that its Python
start-up overlaps the control plane's; then, at once, it fetches the relation listing at S
from the pageserver's HTTP API and the lazy basebackup at S from the page service, which it
unpacks into the new data directory (``--pgdata``: its ``base/``, ``global/`` and ``pg_tblspc/``
become the backing directory and links to the mount). It builds the tree, mounts it,
writes ``--status-file`` (``"mounted": true`` once PostgreSQL may start) every second, and
serves ``/metrics`` and ``/v1/status`` (and ``POST /v1/evict``: drop every page the rules allow;
``POST /v1/pageserver {"pageserver": "host:port"}``: read from another page service from now on,
when the tenant moved to another pageserver) on ``--http-port``. SIGTERM or SIGINT unmounts and exits.

A tenant token for the page service (when auth is on) comes from the environment
(``PAGESTORE_PAGEFS_TOKEN``), never from the command line.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pwd
import signal
import ssl
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pyfuse3
import structlog
import trio
from prometheus_client import CollectorRegistry

from common.logging import LEVELS, setup_logging
from compute import basebackup, postgres
from compute.pagefs.cache_file import LocalPageFile
from compute.pagefs.fs import Listing, PageFs
from compute.pagefs.page_header import BLCKSZ
from compute.pagefs.remote import RECONNECT_TIMEOUT_S, PageFetcher
from compute.pagefs.store import Keep, PageStore
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn, format_lsn, parse_lsn

log = structlog.get_logger("compute.pagefs")
TOKEN_ENV = "PAGESTORE_PAGEFS_TOKEN"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mountpoint", required=True, help="where the tree (base/, global/) is mounted")
    parser.add_argument("--backing", required=True, help="directory of the ordinary files (the lazy basebackup's base/ and global/)")
    parser.add_argument("--cache-file", required=True, help="the local page file (truncated at start)")
    parser.add_argument("--local-cache-size", type=int, default=1 << 30,
                        help="bytes of written pages kept before eviction (default 1 GiB)")
    parser.add_argument("--pageserver", required=True, help="host:port of the page service (libpq)")
    parser.add_argument("--pageserver-http", required=True, help="http(s)://host:port of the pageserver's API")
    parser.add_argument("--ca-file", default=None, help="the CA certificate when the nodes use TLS")
    parser.add_argument("--tenant-id", required=True)
    parser.add_argument("--timeline-id", required=True)
    parser.add_argument("--start-lsn", required=True,
                        help="S: the endpoint's start LSN; '-': read it from the first line of stdin (the control "
                             "plane starts this process before it knows S; EOF first: exit)")
    parser.add_argument("--pgdata", default=None,
                        help="fetch the lazy basebackup at S and unpack it into this (new) data directory; its "
                             "base/ and global/ move into --backing and become links to the mount")
    parser.add_argument("--read-only", action="store_true", help="a read-only endpoint: every read at S")
    parser.add_argument("--bridge-status", default=None,
                        help="the walproposer bridge's status file: its commit_lsn is what the safekeepers hold")
    parser.add_argument("--no-wal-log-hints", action="store_true",
                        help="PostgreSQL runs without wal_log_hints: keep PD_ALL_VISIBLE heap pages local (H1)")
    parser.add_argument("--connections", type=int, default=4, help="pagestream connections")
    parser.add_argument("--reconnect-timeout", type=float, default=RECONNECT_TIMEOUT_S,
                        help="seconds a read waits for a page service that cannot be reached before it "
                             f"fails with EIO (default {RECONNECT_TIMEOUT_S:.0f})")
    parser.add_argument("--read-ahead-kb", type=int, default=1024,
                        help="the kernel's readahead on the mount: a sequential scan's reads are this large "
                             "(one GetPage batch each); 0 leaves the kernel's default (128)")
    parser.add_argument("--spawned-at", type=float, default=None,
                        help="wall-clock time this process was started (the status's start_phases count from it)")
    parser.add_argument("--status-file", default=None)
    parser.add_argument("--http-port", type=int, default=0)
    parser.add_argument("--user", default="postgres", help="owner of every file (PostgreSQL's user)")
    parser.add_argument("--log-file", default=None)
    parser.add_argument("--log-level", default="info", choices=sorted(LEVELS, key=LEVELS.__getitem__))


def status(fs: PageFs, http_port: int | None, started: float, start: dict[str, Any]) -> dict[str, object]:
    """``start``: how the start went (``start_phases`` in seconds, ``basebackup_bytes``)."""
    s, m, f = fs.store, fs.store.metrics, fs.fetcher
    return {
        "pid": os.getpid(),
        "mounted": True,
        "mounted_in_s": round(started, 3),
        **start,
        "http_port": http_port,
        "start_lsn": format_lsn(s.start_lsn),
        "durable_lsn": format_lsn(s.durable_lsn()),
        "hits": m.hits,
        "misses": m.misses,
        "zero_reads": m.zero_reads,
        "writes": m.writes,
        "evictions": m.evictions,
        "over_capacity": m.over_capacity,
        "bytes_cached": s.bytes_cached,
        "kept": {k.name.lower(): v for k, v in s.kept.items() if k != Keep.NO},
        "getpage_batches": f.batches,
        "getpage_pages": f.pages,
        "getpage_errors": f.errors,
        "getpage_reconnects": f.reconnects,
        "pageserver": f"{f.host}:{f.port}",
        "read_errors": fs.read_errors,
    }


def _replace(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _bridge_commit_lsn(path: str | None) -> Lsn:
    if path is None:
        return Lsn(0)
    try:
        return parse_lsn(json.loads(Path(path).read_text())["commit_lsn"])
    except (OSError, ValueError, KeyError, TypeError, Exception):
        return Lsn(0)  # not written yet: nothing beyond S is known to be durable


def set_read_ahead(mountpoint: str, kb: int) -> None:
    """``/sys/class/bdi/<major>:<minor>/read_ahead_kb`` of the mount (libfuse has no option for
    it); a failure leaves the kernel's default and is logged."""
    dev = os.stat(mountpoint).st_dev
    path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(kb))
    except OSError as exc:
        log.warning("readahead left at the kernel's default", path=path, error=str(exc))


def fetch_listing(url: str, token: str | None, ca_file: str | None = None) -> Listing:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    ctx = ssl.create_default_context(cafile=ca_file) if ca_file else None
    with urllib.request.urlopen(req, timeout=30, context=ctx) as resp:
        return Listing.from_json(json.loads(resp.read()))


# The directories of the data directory that are the page filesystem's: the relation files of
# every database and every tablespace (in place, ``pg_tblspc/<spc>``: CREATE TABLESPACE makes
# its directory through the link).
PAGEFS_DIRS = ("base", "global", "pg_tblspc")


async def read_start_lsn() -> Lsn:
    """The first line of stdin (``--start-lsn -``)."""
    line = await trio.to_thread.run_sync(sys.stdin.readline)
    if not line.strip():
        raise StartError("stdin closed before the start LSN came (the endpoint start gave up)")
    return parse_lsn(line.strip())


class StartError(Exception):
    """The page filesystem could not start; the message says why."""


def prepare_pgdata(tar: io.BytesIO, pgdata: Path, backing: Path, mountpoint: Path) -> None:
    """Unpack the lazy basebackup into the new data directory, move its ``base/``, ``global/``
    and ``pg_tblspc/`` (the ordinary files there: PG_VERSION, relmapper files, pg_control, the init
    forks of unlogged relations) into the backing directory, and link them to the mount."""
    postgres.make_postgres_dir(pgdata)
    tar.seek(0)
    basebackup.unpack(tar, pgdata)
    for sub in PAGEFS_DIRS:
        (pgdata / sub).rename(backing / sub)
        (pgdata / sub).symlink_to(mountpoint / sub)


async def amain(args: argparse.Namespace) -> None:
    started = time.monotonic()
    phases: dict[str, float] = {}
    if args.spawned_at is not None:  # interpreter start-up and imports
        phases["imports"] = round(time.time() - args.spawned_at, 3)
    token = os.environ.get(TOKEN_ENV) or None
    tenant, timeline = TenantId.parse(args.tenant_id), TimelineId.parse(args.timeline_id)
    start_lsn = await read_start_lsn() if args.start_lsn == "-" else parse_lsn(args.start_lsn)
    phases["wait_lsn"] = round(time.monotonic() - started, 3)
    pw = pwd.getpwnam(args.user)
    host, _, port = args.pageserver.rpartition(":")
    # libpq keywords of the page service connections (and the basebackup's): the token as
    # password, TLS verified against the cluster's CA
    params = {**({"password": token} if token else {}), **({"sslrootcert": args.ca_file} if args.ca_file else {})}
    tar = io.BytesIO()
    got: dict[str, Listing] = {}

    async def listing_task() -> None:
        t = time.monotonic()
        got["listing"] = await trio.to_thread.run_sync(
            fetch_listing,
            f"{args.pageserver_http}/v1/tenant/{tenant.hex}/timeline/{timeline.hex}/relations"
            f"?at_lsn={format_lsn(start_lsn)}",
            token,
            args.ca_file,
        )
        phases["listing"] = round(time.monotonic() - t, 3)

    async def basebackup_task() -> None:
        t = time.monotonic()
        await basebackup.fetch(host, int(port), tenant.hex, timeline.hex, start_lsn, tar, lazy=True, params=params)
        phases["basebackup"] = round(time.monotonic() - t, 3)
        t = time.monotonic()
        await trio.to_thread.run_sync(prepare_pgdata, tar, Path(args.pgdata), Path(args.backing),
                                      Path(args.mountpoint))
        phases["unpack"] = round(time.monotonic() - t, 3)

    # The listing and the lazy basebackup at once: both only read at S.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(listing_task)
        if args.pgdata:
            nursery.start_soon(basebackup_task)
    listing = got["listing"]
    durable = Lsn(0)
    cache = LocalPageFile(Path(args.cache_file), max(1, args.local_cache_size // BLCKSZ))
    store = PageStore(cache, start_lsn=start_lsn, primary=not args.read_only, durable_lsn=lambda: durable,
                      wal_log_hints=not args.no_wal_log_hints)
    registry = CollectorRegistry()
    fetcher = PageFetcher(host, int(port), tenant, timeline, connections=args.connections, token=token,
                          ca_file=args.ca_file, registry=registry, reconnect_timeout_s=args.reconnect_timeout)
    fs = PageFs(store, fetcher, Path(args.backing), uid=pw.pw_uid, gid=pw.pw_gid)
    t = time.monotonic()
    fs.load(listing)
    phases["tree"] = round(time.monotonic() - t, 3)
    options = set(pyfuse3.default_options) | {"fsname=pagefs", "allow_other"}
    t = time.monotonic()
    pyfuse3.init(fs, args.mountpoint, options)
    phases["mount"] = round(time.monotonic() - t, 3)
    mounted_in = time.monotonic() - started
    start = {"start_phases": phases, "basebackup_bytes": tar.tell() if args.pgdata else 0}
    if args.status_file:  # PostgreSQL may start now
        _replace(args.status_file, json.dumps(status(fs, None, mounted_in, start)))
    log.info("mounted", mountpoint=args.mountpoint, start_lsn=format_lsn(start_lsn), seconds=round(mounted_in, 3),
             phases=phases,
             relations=sum(len(r) for _, _, r in listing.databases))
    # The HTTP API (metrics, status, evict) is imported and built only now: PostgreSQL may
    # start meanwhile, and its first requests wait in the kernel for pyfuse3.main below.
    from compute.pagefs.http_api import build_http

    http = build_http(fs, registry, args.http_port, lambda port: status(fs, port, mounted_in, start))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pyfuse3.main)
            if args.read_ahead_kb:  # in a thread: the stat is a FUSE request this loop answers
                await trio.to_thread.run_sync(set_read_ahead, args.mountpoint, args.read_ahead_kb)
            await nursery.start(http.serve)

            async def durable_loop() -> None:
                nonlocal durable
                while True:
                    durable = _bridge_commit_lsn(args.bridge_status)
                    await trio.sleep(0.2)

            async def status_loop() -> None:
                while True:
                    if args.status_file:
                        await trio.to_thread.run_sync(_replace, args.status_file,
                                                      json.dumps(status(fs, http.port, mounted_in, start)))
                    await trio.sleep(1)

            nursery.start_soon(durable_loop)
            nursery.start_soon(status_loop)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    log.info("stopping")
                    pyfuse3.terminate()
                    nursery.cancel_scope.cancel()
                    break
    finally:
        pyfuse3.close(unmount=True)
        await fetcher.aclose()
        cache.close()
        if args.status_file:
            Path(args.status_file).unlink(missing_ok=True)


def run(args: argparse.Namespace) -> int:
    setup_logging(log_file=Path(args.log_file) if args.log_file else None, level=args.log_level)
    if not os.path.exists("/dev/fuse"):
        print("pagestore pagefs: /dev/fuse does not exist (no FUSE on this machine)", file=sys.stderr)
        return 1
    try:
        trio.run(amain, args)
    except StartError as exc:
        log.error("not started", reason=str(exc))
        print(f"pagestore pagefs: {exc}", file=sys.stderr)
        return 1
    return 0
