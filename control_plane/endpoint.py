"""Endpoints: vanilla PostgreSQL 15 computes booted from the pageserver's basebackup.

``start_endpoint`` fetches ``basebackup <tenant> <timeline> <lsn>`` from the pageserver's libpq
port, untars it into ``endpoints/<name>/pgdata`` (owned by postgres), configures it and starts
PostgreSQL as the postgres user (``compute.postgres``). A primary endpoint (no ``--lsn``) gets
``synchronous_standby_names = 'walproposer'`` and the walproposer bridge beside it, pushing its WAL
to the safekeepers: a commit returns only once a quorum of safekeepers has it. A read-only
endpoint (``--lsn``) is a snapshot of the branch at that LSN: no bridge, and every transaction
read-only by default; what it writes anyway stays in its own data directory.

Storage. A ``full`` endpoint has its own copy of every relation file (the basebackup holds them
all; it grows with the database). A ``lazy`` endpoint boots from ``basebackup --lazy`` (no
relation data) and its ``base/``, ``global/`` and ``pg_tblspc/`` are symbolic links into the
mount of its page filesystem (``pagestore pagefs``, ``compute.pagefs``): relation pages are read from the page
service when PostgreSQL needs them and written pages stay in a bounded local cache. The page
filesystem is supervised like the bridge: started before PostgreSQL, stopped after it
(``endpoint stop`` unmounts); if it dies, PostgreSQL gets I/O errors, and ``endpoint start``
again starts over with an empty cache (every commit is on the safekeepers). Lazy endpoints run
with ``wal_log_hints = on`` (hazard H1 of ``docs/compute.md``).

Where a primary starts: at the pageserver's ``last_record_lsn`` of the timeline, after waiting
until the pageserver has every record the safekeepers hold. The compute's WAL then continues
exactly where the timeline's WAL ends (the bridge's ``--start-lsn`` for a fresh timeline; the
election decides for a timeline the safekeepers already know).
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import attrs
import cattrs

from common.auth import TOKEN_ENV, Scope
from compute import postgres
from control_plane import cluster, process
from control_plane.http_client import ApiError, get_json, post_json
from control_plane.local_env import LocalEnv, LocalEnvError
from protocol.errors import RemoteProtocolError
from protocol.lsn import Lsn, format_lsn, parse_lsn

BRIDGE_START_TIMEOUT_S = 60.0
SYNC_TIMEOUT_S = 30.0


class EndpointError(Exception):
    """An endpoint could not be started or stopped; the message names the step."""


@attrs.frozen(kw_only=True)
class EndpointSpec:
    """``endpoint.json``: what an endpoint is (its directory holds the rest)."""

    name: str
    tenant_id: str
    timeline_id: str
    branch: str | None
    port: int
    # The LSN of the basebackup it booted from; for a read-only endpoint also what it shows.
    basebackup_lsn: str
    read_only: bool
    storage: str = "full"  # "full": relation files copied; "lazy": the page filesystem
    start_seconds: float | None = None  # `endpoint start` until PostgreSQL answered
    # seconds per step of the start: prepare (safekeepers, pageserver LSN), basebackup,
    # pagefs (lazy: mounted), postgres (pg_ctl start -w), bridge (elected)
    start_phases: dict[str, float] | None = None
    # The pageserver its pages come from (basebackup; a lazy endpoint's page filesystem),
    # moved by `pagestore tenant migrate`.
    pageserver: str | None = None


@attrs.define
class Endpoint:
    env: LocalEnv
    spec: EndpointSpec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def dir(self) -> Path:
        return endpoint_dir(self.env, self.spec.name)

    @property
    def pgdata(self) -> Path:
        return self.dir / "pgdata"

    @property
    def bridge_pid_path(self) -> Path:
        return self.dir / "bridge.pid"

    @property
    def bridge_status_path(self) -> Path:
        return self.dir / "bridge-status.json"

    @property
    def bridge_log(self) -> Path:
        return self.dir / "bridge.log"

    @property
    def pagefs_dir(self) -> Path:
        return self.dir / "pagefs"

    @property
    def pagefs_mount(self) -> Path:
        return self.pagefs_dir / "mnt"

    @property
    def pagefs_pid_path(self) -> Path:
        return self.dir / "pagefs.pid"

    @property
    def pagefs_status_path(self) -> Path:
        return self.dir / "pagefs-status.json"

    @property
    def pagefs_log(self) -> Path:
        return self.dir / "pagefs.log"

    def pagefs_left(self) -> bool:
        """Its page filesystem runs, or its mount is still there (alive or with a dead daemon)."""
        mnt = self.pagefs_mount
        return (process.running_pid(self.pagefs_pid_path) is not None or os.path.ismount(mnt)
                or _is_dead_mount(mnt))

    def pagefs_status(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.pagefs_status_path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def instance(self) -> postgres.PostgresInstance:
        return postgres.PostgresInstance(datadir=self.pgdata, port=self.spec.port, started=True)

    def pg_pid(self) -> int | None:
        try:
            pid = int((self.pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None
        return pid if process.is_alive(pid) else None

    def running(self) -> bool:
        return self.pg_pid() is not None

    def bridge_status(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.bridge_status_path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def describe(self) -> dict[str, Any]:
        bridge = self.bridge_status()
        return {
            **cattrs.unstructure(self.spec),
            "pg_pid": self.pg_pid(),
            "running": self.running(),
            "bridge_pid": process.running_pid(self.bridge_pid_path),
            "bridge_commit_lsn": bridge.get("commit_lsn") if bridge else None,
            "pagefs_pid": process.running_pid(self.pagefs_pid_path),
            "pagefs": self.pagefs_status() if self.spec.storage == "lazy" else None,
            "dsn": f"postgresql://postgres@127.0.0.1:{self.spec.port}/postgres",
        }


def endpoint_dir(env: LocalEnv, name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise LocalEnvError(f"bad endpoint name {name!r}")
    return env.endpoints_dir / name


def load_endpoint(env: LocalEnv, name: str) -> Endpoint:
    path = endpoint_dir(env, name) / "endpoint.json"
    try:
        spec = cattrs.structure(json.loads(path.read_text()), EndpointSpec)
    except FileNotFoundError:
        raise LocalEnvError(f"no endpoint {name!r} (see `pagestore endpoint list`)") from None
    except (OSError, ValueError, cattrs.BaseValidationError) as exc:
        raise LocalEnvError(f"cannot read {path}: {exc}") from None
    return Endpoint(env, spec)


def list_endpoints(env: LocalEnv) -> list[Endpoint]:
    if not env.endpoints_dir.exists():
        return []
    return [load_endpoint(env, d.name) for d in sorted(env.endpoints_dir.iterdir())
            if (d / "endpoint.json").exists()]


def _pick_port(env: LocalEnv, name: str) -> int:
    if env.config.endpoint_base_port == 0:
        return postgres.free_port()
    taken = {ep.spec.port for ep in list_endpoints(env) if ep.name != name}
    i = 1
    while env.config.endpoint_base_port + i in taken:
        i += 1
    return env.config.endpoint_base_port + i


# -- basebackup -----------------------------------------------------------------------------------


def fetch_basebackup(env: LocalEnv, tenant_id: str, timeline_id: str, lsn: Lsn, out: Path,
                     *, lazy: bool = False) -> int:
    """Write the pageserver's basebackup tar at ``lsn`` to ``out``; returns its size."""
    # trio and the libpq client are imported here, not at the top: a lazy start never needs
    # them in this process (its page filesystem fetches the lazy basebackup).
    import trio

    from compute import basebackup

    try:
        with open(out, "wb") as f:
            return trio.run(functools.partial(
                basebackup.fetch, "127.0.0.1", cluster.tenant_pg_port(env, tenant_id), tenant_id, timeline_id, lsn, f,
                lazy=lazy, params=env.pg_client_params(env.token(Scope.TENANT, tenant_id))))
    except Exception as exc:
        raise EndpointError(f"basebackup {tenant_id} {timeline_id} {format_lsn(lsn)} failed: {exc}") from exc


def _untar(tar_path: Path, pgdata: Path) -> None:
    from compute import basebackup

    with open(tar_path, "rb") as f:
        try:
            basebackup.unpack(f, pgdata)
        except basebackup.BasebackupError as exc:
            raise EndpointError(str(exc)) from None


# -- start / stop -------------------------------------------------------------------------------


def _safekeeper_flush(env: LocalEnv, tenant_id: str, timeline_id: str) -> Lsn | None:
    """The highest flush_lsn any reachable safekeeper reports for the timeline."""
    states = _safekeeper_states(env, tenant_id, timeline_id)
    return max((parse_lsn(st["flush_lsn"]) for st in states), default=None)


def _safekeeper_states(env: LocalEnv, tenant_id: str, timeline_id: str) -> list[dict[str, Any]]:
    """The timeline status of every reachable safekeeper that holds the timeline.

    A quorum must answer: every commit is on a quorum, so any quorum holds every committed
    record and the highest flush among it is at or above the commit position. With fewer
    answers a primary started now could begin below committed WAL (its clients would miss
    committed data and the safekeepers would receive a forked history): a clear error instead.
    """
    ids = env.safekeeper_ids
    states: list[dict[str, Any]] = []
    answered = 0
    unreachable: list[str] = []
    for sk_id in ids:
        try:
            st = get_json(f"{env.safekeeper_http(sk_id)}/v1/tenant/{tenant_id}/timeline/{timeline_id}",
                          timeout=5.0)
        except ApiError as exc:
            if exc.status == 404:
                answered += 1  # reachable, and holds nothing of this timeline
                continue
            raise EndpointError(f"safekeeper_{sk_id}: {exc}") from None
        except OSError as exc:
            unreachable.append(f"safekeeper_{sk_id} ({exc})")
            continue
        answered += 1
        states.append(st)
    if ids and answered < len(ids) // 2 + 1:
        raise EndpointError(
            f"only {answered} of {len(ids)} safekeepers answered (a quorum is {len(ids) // 2 + 1}): "
            f"cannot tell where committed WAL ends, so a primary cannot start; unreachable: "
            + ", ".join(unreachable)
        )
    return states


def _bridge_env(env: LocalEnv, tenant_id: str) -> dict[str, str]:
    """The bridge's tenant token goes in its environment: ``ps`` shows arguments to everyone."""
    token = env.token(Scope.TENANT, tenant_id)
    return {} if token is None else {TOKEN_ENV: token}


def _bridge_tls_args(env: LocalEnv) -> list[str]:
    return [] if env.ca_file is None else ["--ssl-ca-file", str(env.ca_file)]


def _sync_safekeepers(env: LocalEnv, ep_dir: Path, tenant_id: str, timeline_id: str,
                      states: list[dict[str, Any]]) -> Lsn:
    """Commit what the safekeepers hold (``pagestore walproposer --sync-safekeepers``, Neon's
    ``postgres --sync-safekeepers``); returns where the timeline's WAL ends."""
    log_path = ep_dir / "sync-safekeepers.log"
    cmd = process.cli_command(
        "walproposer", "--sync-safekeepers", "--safekeepers", ",".join(env.safekeeper_pg_addrs),
        "--tenant-id", tenant_id, "--timeline-id", timeline_id,
        "--system-id", str(states[0].get("system_id") or 0),
        "--pg-version", str(states[0].get("pg_version") or 150000),
        "--sync-timeout", str(SYNC_TIMEOUT_S), "--log-file", str(log_path),
        *_bridge_tls_args(env),
    )
    proc = subprocess.run(cmd, cwd=process.ROOT, capture_output=True, text=True, check=False,
                          timeout=SYNC_TIMEOUT_S + 30, env={**os.environ, **_bridge_env(env, tenant_id)})
    if proc.returncode != 0:
        raise EndpointError(
            f"the safekeepers hold WAL of {tenant_id}/{timeline_id} that is not committed (a compute "
            f"died before it sent the commit position) and it could not be committed: "
            f"{proc.stderr.strip()}\n--- {log_path} ---\n{process.tail(log_path)}"
        )
    try:
        return parse_lsn(proc.stdout.strip().splitlines()[-1])
    except (IndexError, RemoteProtocolError):
        raise EndpointError(f"sync-safekeepers printed {proc.stdout!r}, not an LSN") from None


def _settings(spec: EndpointSpec) -> dict[str, str]:
    s = _base_settings(spec)
    if spec.storage == "lazy":
        # H1: PD_ALL_VISIBLE then carries a WAL position, so evicted heap pages keep it.
        s["wal_log_hints"] = "on"
    return s


def _base_settings(spec: EndpointSpec) -> dict[str, str]:
    s = {
        "listen_addresses": "127.0.0.1",
        "wal_level": "replica",
        "max_wal_senders": "10",
        "max_replication_slots": "10",
        "wal_keep_size": "256MB",
        "shared_buffers": "128MB",
        "fsync": "on",
        "log_line_prefix": "%m [%p] ",
    }
    if spec.read_only:
        s["default_transaction_read_only"] = "on"
    else:
        s["synchronous_standby_names"] = "walproposer"
        s["synchronous_commit"] = "on"
    return s


def _start_lsn(env: LocalEnv, tenant: str, timeline: str, lsn: str | None, ep_dir: Path, log: Any) -> Lsn:
    """Where the compute starts: ``lsn`` for a read-only endpoint (once the pageserver has
    it); for a primary, where the timeline's committed WAL ends, once the pageserver has
    ingested it."""
    if lsn is not None:
        try:
            at = parse_lsn(lsn)
        except RemoteProtocolError as exc:
            raise LocalEnvError(f"--lsn {lsn!r}: {exc}") from None
        info = cluster.timeline_info(env, tenant, timeline)
        if at > parse_lsn(info["last_record_lsn"]):
            cluster.wait_for_lsn(env, tenant, timeline, at, timeout=30)
    else:
        states = _safekeeper_states(env, tenant, timeline)
        sk_flush = max((parse_lsn(st["flush_lsn"]) for st in states), default=None)
        sk_commit = max((parse_lsn(st["commit_lsn"]) for st in states), default=None)
        if sk_flush is not None and sk_commit is not None and sk_flush > sk_commit:
            # Only committed WAL reaches the pageserver: without a new term committing this
            # tail the wait below could never end.
            log(f"the safekeepers hold uncommitted WAL up to {format_lsn(sk_flush)} (committed: "
                f"{format_lsn(sk_commit)}): committing it in a new term")
            ep_dir.mkdir(parents=True, exist_ok=True)
            sk_flush = _sync_safekeepers(env, ep_dir, tenant, timeline, states)
        info = cluster.timeline_info(env, tenant, timeline)
        if sk_flush is not None and sk_flush > parse_lsn(info["last_record_lsn"]):
            log(f"waiting for the pageserver to ingest the safekeepers' WAL up to {format_lsn(sk_flush)}")
            info = cluster.wait_for_lsn(env, tenant, timeline, sk_flush, timeout=120)
        at = parse_lsn(info["last_record_lsn"])
    if at % 8:
        raise EndpointError(f"LSN {format_lsn(at)} is not a record boundary (not 8-byte aligned)")
    return at


def start_endpoint(
    env: LocalEnv,
    name: str,
    *,
    tenant_id: str | None = None,
    branch: str = "main",
    lsn: str | None = None,
    port: int | None = None,
    storage: str = "lazy",
    settings: dict[str, str] | None = None,
    log: Any = print,
) -> Endpoint:
    """``settings``: more PostgreSQL settings for this start (e.g. track_commit_timestamp),
    over the endpoint's own."""
    t0 = time.monotonic()
    if storage not in ("full", "lazy"):
        raise LocalEnvError(f"--storage {storage!r}: use lazy or full")
    if storage == "lazy" and not os.path.exists("/dev/fuse"):
        raise EndpointError(
            "a lazy endpoint needs FUSE, and /dev/fuse does not exist on this machine: "
            "start it with --storage full (a copy of every relation file)"
        )
    cluster.require_running(env)
    tenant = env.resolve_tenant(tenant_id)
    timeline = env.timeline_of_branch(tenant, branch)
    ep_dir = endpoint_dir(env, name)
    if (ep_dir / "endpoint.json").exists():
        existing = load_endpoint(env, name)
        if existing.running():
            raise LocalEnvError(f"endpoint {name!r} is already running on port {existing.spec.port}")
        # Its PostgreSQL died but its bridge may live on: removing the directory would lose the
        # bridge's pid file, and the old bridge would then fight the new one over terms.
        stale = process.running_pid(existing.bridge_pid_path)
        if stale is not None:
            process.stop_pid(stale, timeout=5, what="walproposer bridge")
            log(f"stopped the walproposer bridge (pid {stale}) left by the earlier run of {name}")
        # Its page filesystem may live on, or be dead and still mounted: the directory must not
        # be removed through a mount.
        _stop_pagefs(existing, log)
    elif ep_dir.exists():
        _unmount(ep_dir / "pagefs" / "mnt")
    # A stopped endpoint starts over from a fresh basebackup: its pages live on the pageserver.
    shutil.rmtree(ep_dir, ignore_errors=True)
    read_only = lsn is not None
    if not read_only:
        for ep in list_endpoints(env):
            if ep.spec.timeline_id == timeline and not ep.spec.read_only and ep.running():
                raise LocalEnvError(
                    f"endpoint {ep.name!r} already writes to branch {branch!r}; one primary per branch "
                    "(stop it, or start a read-only endpoint with --lsn)"
                )

    spec = EndpointSpec(name=name, tenant_id=tenant, timeline_id=timeline, branch=branch,
                        port=port or _pick_port(env, name), basebackup_lsn="",
                        read_only=read_only, storage=storage,
                        pageserver=env.pageserver_name(cluster.tenant_pageserver(env, tenant)))
    ep_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(ep_dir, 0o755)
    ep = Endpoint(env, spec)
    # A lazy endpoint's page filesystem starts first: its Python start-up (the longest step)
    # overlaps finding the start LSN; it then fetches the lazy basebackup and the relation
    # listing itself, unpacks the data directory and mounts.
    pagefs = _spawn_pagefs(env, ep) if storage == "lazy" else None
    try:
        at = _start_lsn(env, tenant, timeline, lsn, ep_dir, log)
    except BaseException:
        if pagefs is not None:
            _stop_pagefs(ep, lambda _m: None)
        raise
    spec = attrs.evolve(spec, basebackup_lsn=format_lsn(at))
    ep = Endpoint(env, spec)
    started = time.monotonic()
    phases = {"prepare": started - t0}
    if pagefs is not None:
        _mount_pagefs(ep, pagefs, at)
        st = ep.pagefs_status() or {}
        phases["pagefs"] = time.monotonic() - started
        phases.update({f"pagefs_{k}": v for k, v in (st.get("start_phases") or {}).items()})
        log(f"basebackup --lazy of {branch} at {format_lsn(at)}: {st.get('basebackup_bytes', 0) / 1e6:.1f} MB; "
            f"page filesystem mounted in {phases['pagefs']:.2f} s")
    else:
        tar_path = ep_dir / "basebackup.tar"
        size = fetch_basebackup(env, tenant, timeline, at, tar_path)
        postgres.make_postgres_dir(ep.pgdata)
        _untar(tar_path, ep.pgdata)
        tar_path.unlink()
        log(f"basebackup of {branch} at {format_lsn(at)}: {size / 1e6:.1f} MB in {time.monotonic() - started:.1f} s")
        phases["basebackup"] = time.monotonic() - started
    (ep_dir / "endpoint.json").write_text(json.dumps(cattrs.unstructure(spec), indent=2) + "\n")
    mark = time.monotonic()

    pg = postgres.PostgresInstance(datadir=ep.pgdata, port=spec.port, settings={**_settings(spec), **(settings or {})})
    try:
        pg.start()
    except postgres.PostgresError as exc:
        _stop_pagefs(ep, lambda _m: None)
        raise EndpointError(
            f"PostgreSQL of endpoint {name!r} did not start: {exc}\n--- server.log ---\n"
            f"{process.tail(ep.pgdata / 'server.log')}"
            + (f"\n--- pagefs.log ---\n{process.tail(ep.pagefs_log)}" if storage == "lazy" else "")
        ) from None
    phases["postgres"] = time.monotonic() - mark
    mark = time.monotonic()
    if not read_only:
        try:
            _start_bridge(env, ep, at)
        except Exception:
            pg.stop("immediate")
            _stop_pagefs(ep, lambda _m: None)
            raise
        phases["bridge"] = time.monotonic() - mark
    spec = attrs.evolve(spec, start_seconds=round(time.monotonic() - t0, 3),
                        start_phases={k: round(v, 3) for k, v in phases.items()})
    ep.spec = spec
    (ep_dir / "endpoint.json").write_text(json.dumps(cattrs.unstructure(spec), indent=2) + "\n")
    log(f"endpoint {name} ({'read-only at ' + spec.basebackup_lsn if read_only else 'primary'}, "
        f"{storage} storage) on branch {branch}: postgresql://postgres@127.0.0.1:{spec.port}/postgres "
        f"(started in {spec.start_seconds:.2f} s)")
    return ep


# -- the page filesystem of a lazy endpoint ------------------------------------------------------

PAGEFS_START_TIMEOUT_S = 60.0


def _spawn_pagefs(env: LocalEnv, ep: Endpoint) -> subprocess.Popen[bytes]:
    """Start ``pagestore pagefs`` before the start LSN is known: it reads it from its stdin
    (``_mount_pagefs``) and exits if the pipe closes first (this command failed or died)."""
    backing, mnt = ep.pagefs_dir / "backing", ep.pagefs_mount
    backing.mkdir(parents=True)
    mnt.mkdir()
    os.chmod(ep.pagefs_dir, 0o755)
    ep.pagefs_status_path.unlink(missing_ok=True)
    cmd = process.cli_command(
        "pagefs", "--mountpoint", str(mnt), "--backing", str(backing), "--pgdata", str(ep.pgdata),
        "--cache-file", str(ep.pagefs_dir / "cache.pages"),
        "--local-cache-size", str(env.config.local_cache_size),
        "--pageserver", f"127.0.0.1:{cluster.tenant_pg_port(env, ep.spec.tenant_id)}",
        "--pageserver-http", cluster.tenant_http(env, ep.spec.tenant_id),
        "--tenant-id", ep.spec.tenant_id, "--timeline-id", ep.spec.timeline_id,
        "--start-lsn", "-", "--status-file", str(ep.pagefs_status_path),
        "--log-file", str(ep.pagefs_log), "--spawned-at", repr(time.time()),
        *(["--ca-file", str(env.ca_file)] if env.ca_file is not None else []),
        *(["--read-only"] if ep.spec.read_only else ["--bridge-status", str(ep.bridge_status_path)]),
    )
    (ep.dir / "pagefs.cmd").write_text(shlex.join(cmd) + "\n")
    # Its tenant token in its environment (never argv); the name is compute.pagefs.main's
    # TOKEN_ENV (importing that module here would load pyfuse3).
    token = env.token(Scope.TENANT, ep.spec.tenant_id)
    return process.spawn_piped(cmd, log_path=ep.pagefs_log, pid_path=ep.pagefs_pid_path,
                               env={} if token is None else {"PAGESTORE_PAGEFS_TOKEN": token})


def _mount_pagefs(ep: Endpoint, proc: subprocess.Popen[bytes], start_lsn: Lsn) -> None:
    """Hand the page filesystem its start LSN and wait until it has unpacked the lazy
    basebackup into the data directory and mounted."""
    try:
        assert proc.stdin is not None
        try:
            proc.stdin.write(f"{format_lsn(start_lsn)}\n".encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died: the wait below reports its log
        process.wait_until(f"page filesystem of endpoint {ep.name!r} mounted",
                           lambda: bool((ep.pagefs_status() or {}).get("mounted")),
                           timeout=PAGEFS_START_TIMEOUT_S, pid=proc.pid, log_path=ep.pagefs_log, interval=0.005)
    except BaseException as exc:
        process.stop_pid(proc.pid, timeout=2, what="page filesystem")
        _unmount(ep.pagefs_mount)
        if isinstance(exc, process.ProcessError):
            raise EndpointError(str(exc)) from None
        raise


def _unmount(mnt: Path) -> None:
    """Detach a mount whose daemon is gone (the kernel answers ENOTCONN until then)."""
    if os.path.ismount(mnt) or _is_dead_mount(mnt):
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


def _is_dead_mount(mnt: Path) -> bool:
    try:
        os.stat(mnt)
    except OSError as exc:
        return exc.errno == 107  # ENOTCONN: the FUSE daemon died
    return False


def _stop_pagefs(ep: Endpoint, log: Any) -> None:
    pid = process.running_pid(ep.pagefs_pid_path)
    if pid is not None:
        process.stop_pid(pid, timeout=10, what="page filesystem")
        log(f"stopped the page filesystem of endpoint {ep.name}")
    _unmount(ep.pagefs_mount)


def _start_bridge(env: LocalEnv, ep: Endpoint, start_lsn: Lsn) -> None:
    ep.bridge_status_path.unlink(missing_ok=True)
    cmd = process.cli_command(
        "walproposer", "--pg-port", str(ep.spec.port), "--safekeepers", ",".join(env.safekeeper_pg_addrs),
        "--tenant-id", ep.spec.tenant_id, "--timeline-id", ep.spec.timeline_id,
        "--start-lsn", format_lsn(start_lsn), "--status-file", str(ep.bridge_status_path),
        *_bridge_tls_args(env),
    )
    # Kept for operators: how to restart the bridge alone (docs/operations.md; with auth on
    # it needs $PAGESTORE_AUTH_TOKEN, a tenant token: `pagestore token --tenant-id T`).
    (ep.dir / "bridge.cmd").write_text(shlex.join(cmd) + "\n")
    pid = process.spawn(cmd, log_path=ep.bridge_log, pid_path=ep.bridge_pid_path,
                        env=_bridge_env(env, ep.spec.tenant_id))

    def elected() -> bool:
        st = ep.bridge_status()
        return bool(st and st.get("elected"))

    try:
        process.wait_until(f"walproposer bridge of endpoint {ep.name!r} elected by the safekeepers",
                           elected, timeout=BRIDGE_START_TIMEOUT_S, pid=pid, log_path=ep.bridge_log)
    except process.ProcessError as exc:
        process.stop_pid(pid, timeout=2, what="walproposer bridge")
        raise EndpointError(str(exc)) from None


def stop_endpoint(env: LocalEnv, name: str, *, mode: str = "fast", log: Any = print) -> None:
    """Stop PostgreSQL (its shutdown checkpoint still goes to the safekeepers), then the bridge."""
    ep = load_endpoint(env, name)
    if ep.running():
        ep.instance().stop(mode)
        if ep.running():
            raise EndpointError(f"PostgreSQL of endpoint {name!r} did not stop:\n{process.tail(ep.pgdata / 'server.log')}")
        log(f"stopped PostgreSQL of endpoint {name}")
    else:
        log(f"endpoint {name} is not running")
    pid = process.running_pid(ep.bridge_pid_path)
    if pid is not None:
        process.stop_pid(pid, timeout=5, what="walproposer bridge")
        log(f"stopped the walproposer bridge of endpoint {name}")
    _stop_pagefs(ep, log)


def remove_endpoint(env: LocalEnv, name: str) -> dict[str, Any]:
    """Remove a stopped endpoint: its directory (data directory, logs, page filesystem cache)
    and so its entry in ``endpoint list``. Its pages and WAL are the timeline's, on the
    pageserver and the safekeepers: nothing of the branch goes. Refused while its PostgreSQL,
    its walproposer bridge or its page filesystem runs (or the mount is left): the directory
    is never removed under a live process or through a mount."""
    ep = load_endpoint(env, name)
    left = []
    if (pid := ep.pg_pid()) is not None:
        left.append(f"PostgreSQL (pid {pid})")
    if (pid := process.running_pid(ep.bridge_pid_path)) is not None:
        left.append(f"its walproposer bridge (pid {pid})")
    if ep.pagefs_left():
        left.append("its page filesystem")
    if left:
        raise EndpointError(f"endpoint {name!r} is running ({', '.join(left)}): "
                            f"`pagestore endpoint stop {name}` first")
    # The spec goes first: a removal cut short leaves a directory no command lists, which the
    # next `endpoint start` of that name clears.
    (ep.dir / "endpoint.json").unlink()
    shutil.rmtree(ep.dir)
    return {"name": name, "tenant_id": ep.spec.tenant_id, "timeline_id": ep.spec.timeline_id,
            "branch": ep.spec.branch, "removed": str(ep.dir)}


def follow_tenant(env: LocalEnv, tenant_id: str, ps_id: int, *, log: Any = print) -> list[str]:
    """Point the tenant's endpoints at pageserver ``ps_id`` (after a migration): a running
    lazy endpoint's page filesystem reads from it from now on; every endpoint records it (a
    restart takes its basebackup there anyway). Returns the names of the endpoints moved."""
    name = env.pageserver_name(ps_id)
    addr = f"127.0.0.1:{env.pageserver_ports(ps_id).pg}"
    moved = []
    for ep in list_endpoints(env):
        if ep.spec.tenant_id != tenant_id:
            continue
        status = ep.pagefs_status() if ep.spec.storage == "lazy" else None
        if status is not None and process.running_pid(ep.pagefs_pid_path) is not None:
            try:
                post_json(f"http://127.0.0.1:{status['http_port']}/v1/pageserver", {"pageserver": addr}, timeout=30)
            except (ApiError, OSError, KeyError) as exc:
                raise EndpointError(f"the page filesystem of endpoint {ep.name!r} did not move to {name}: "
                                    f"{exc}") from None
            log(f"endpoint {ep.name}: page filesystem reads from {name} ({addr})")
        ep.spec = attrs.evolve(ep.spec, pageserver=name)
        (ep.dir / "endpoint.json").write_text(json.dumps(cattrs.unstructure(ep.spec), indent=2) + "\n")
        moved.append(ep.name)
    return moved
