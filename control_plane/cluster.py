"""Starting, stopping and inspecting the storage nodes of a local cluster, and the tenant and
timeline operations the CLI runs against the pageserver's HTTP API.

Everything here is synchronous: the CLI is a short-lived process that talks HTTP and spawns
processes; the nodes themselves are the trio programs.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import attrs

from common.auth import CONTROL_PLANE_TOKEN_ENV, TOKEN_ENV, Scope
from control_plane import process
from control_plane.http_client import ApiError, get_json, post_json, request_json
from control_plane.local_env import LocalEnv, LocalEnvError, port_free
from remote_storage.seaweedfs import s3_ready, weed_argv

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
PORT_GRACE_S = 5.0


class ClusterError(Exception):
    """A cluster operation failed; the message names the node or the call."""


def _pid_path(node_dir: Path) -> Path:
    return node_dir / "pid"


def _is_pageserver(name: str) -> bool:
    return name == "pageserver" or name.startswith("pageserver_")


def _node_cmd(env: LocalEnv, name: str) -> tuple[list[str], str]:
    if name == "seaweedfs":
        assert env.config.seaweedfs is not None
        return weed_argv(env.seaweedfs_dir / "data", env.config.seaweedfs), env.config.seaweedfs.endpoint
    if name == "storage_controller":
        assert env.storage_controller_url is not None
        return (process.cli_command("storage-controller", "-c", str(env.storage_controller_config_path)),
                env.storage_controller_url)
    if _is_pageserver(name):
        ps_id = env.pageserver_id(name)
        return (process.cli_command("pageserver", "-c", str(env.pageserver_config_path_of(ps_id))),
                env.pageserver_http_of(ps_id))
    sk_id = int(name.removeprefix("safekeeper_"))
    return (
        process.cli_command("safekeeper", "-c", str(env.safekeeper_config_path(sk_id))),
        env.safekeeper_http(sk_id),
    )


def _node_env(env: LocalEnv, name: str) -> dict[str, str]:
    """The pageserver's token for the safekeepers (its WAL receivers) and for its upcalls to
    the storage controller, and a safekeeper's for its peers' HTTP (safekeeper.peers), in the
    node's environment (never on its command line)."""
    out: dict[str, str] = {}
    token = (env.token(Scope.SAFEKEEPERDATA)
             if _is_pageserver(name) or name.startswith("safekeeper_") else None)
    if token is not None:
        out[TOKEN_ENV] = token
    if _is_pageserver(name) and env.storage_controller_url is not None:
        upcalls = env.token(Scope.GENERATIONS_API)
        if upcalls is not None:
            out[CONTROL_PLANE_TOKEN_ENV] = upcalls
    return out


def _node_ports(env: LocalEnv, name: str) -> list[int]:
    if name == "seaweedfs":
        assert env.config.seaweedfs is not None
        return list(attrs.astuple(env.config.seaweedfs))
    if name == "storage_controller":
        return [env.config.storage_controller_port]
    if _is_pageserver(name):
        ps = env.pageserver_ports(env.pageserver_id(name))
        return [ps.pg, ps.http]
    ports = env.safekeeper_ports(int(name.removeprefix("safekeeper_")))
    return [ports.pg, ports.http]


def _busy_ports(ports: list[int], grace_s: float = PORT_GRACE_S) -> list[int]:
    """The ports still in use after ``grace_s``: a node killed a moment ago holds its ports
    until its last thread has exited, which can be after its pid already shows as a zombie."""
    deadline = time.monotonic() + grace_s
    while True:
        busy = [p for p in ports if not port_free(p)]
        if not busy or time.monotonic() >= deadline:
            return busy
        time.sleep(0.05)


def start(env: LocalEnv, *, log: Any = print) -> None:
    """Start every node that is not running; wait until each one's HTTP port answers.

    All or nothing: when a node does not come up, the nodes this call started are stopped
    again and their pid files removed, so nothing is left running unaccounted for and the
    next ``start`` begins from the same state.
    """
    # Safekeepers (and the storage controller) first: the pageservers' WAL receivers connect
    # to them right away, and a pageserver asks the controller for its tenants at start.
    order = ([n for n in env.node_dirs() if not _is_pageserver(n[0])]
             + [n for n in env.node_dirs() if _is_pageserver(n[0])])
    started: list[tuple[str, Path, int]] = []
    try:
        for name, node_dir in order:
            cmd, http = _node_cmd(env, name)
            pid = process.running_pid(_pid_path(node_dir))
            if pid is not None and process.is_exiting(pid):
                # Killed or stopped a moment ago and not yet gone (its last threads still exit,
                # holding its ports): wait for it rather than take it for a running node.
                if not process.wait_gone(pid, timeout=STOP_TIMEOUT_S):
                    raise ClusterError(f"{name} (pid {pid}) is exiting but has not gone in {STOP_TIMEOUT_S} s")
                pid = None
            if pid is not None:
                log(f"{name} is already running (pid {pid})")
                continue
            # Another process on a node's port would fail the node's bind, and if it speaks
            # HTTP it would even answer the readiness check in the node's place.
            busy = _busy_ports(_node_ports(env, name))
            if busy:
                raise ClusterError(
                    f"cannot start {name}: port {', '.join(map(str, busy))} is in use by another "
                    f"process (another cluster? see `ss -ltnp`)"
                )
            stdout = node_dir / "stdout.log"
            if name == "seaweedfs":
                (node_dir / "data").mkdir(parents=True, exist_ok=True)
            pid = process.spawn(cmd, log_path=stdout, pid_path=_pid_path(node_dir),
                                env=_node_env(env, name))
            started.append((name, node_dir, pid))
            ready = (functools.partial(s3_ready, http) if name == "seaweedfs"
                     else process.http_answers(f"{http}/v1/status"))
            try:
                process.wait_until(f"starting {name}", ready, timeout=START_TIMEOUT_S, pid=pid, log_path=stdout)
            except process.ProcessError as exc:
                raise ClusterError(str(exc)) from None
            log(f"started {name} (pid {pid}, HTTP {http})")
    except BaseException:
        for name, node_dir, pid in reversed(started):
            how = process.stop_pid(pid, timeout=STOP_TIMEOUT_S, what=name)
            _pid_path(node_dir).unlink(missing_ok=True)
            log(f"{name} (pid {pid}) {how}: the start failed")
        raise


def stop(env: LocalEnv, *, immediate: bool = False, log: Any = print) -> None:
    """Stop endpoints, then the pageserver, then the safekeepers (SIGTERM, SIGKILL later)."""
    from control_plane import endpoint

    for ep in endpoint.list_endpoints(env):
        # A bridge outlives its PostgreSQL when that one crashed or was killed: stop it too.
        if ep.running() or process.running_pid(ep.bridge_pid_path) is not None or ep.pagefs_left():
            endpoint.stop_endpoint(env, ep.name, log=log)
    for name, node_dir in env.node_dirs():
        pid = process.running_pid(_pid_path(node_dir))
        if pid is None:
            log(f"{name} is not running")
            continue
        how = process.stop_pid(pid, timeout=0.5 if immediate else STOP_TIMEOUT_S, what=name)
        log(f"{name} (pid {pid}) {how}")


def require_running(env: LocalEnv) -> None:
    down = [name for name, d in env.node_dirs() if process.running_pid(_pid_path(d)) is None]
    if down:
        raise ClusterError(f"not running: {', '.join(down)}; run `pagestore start` first")


# -- status -----------------------------------------------------------------------------------


def _try_get(url: str) -> tuple[Any, str | None]:
    try:
        return get_json(url, timeout=5.0), None
    except ApiError as exc:
        return None, str(exc)
    except OSError as exc:
        return None, f"{url}: {exc}"


def status(env: LocalEnv) -> dict[str, Any]:
    """Nodes (pid, ports, up), timelines (pageserver and safekeeper LSNs), endpoints."""
    from control_plane import endpoint

    nodes: list[dict[str, Any]] = []
    for name, node_dir in env.node_dirs():
        pid = process.running_pid(_pid_path(node_dir))
        if name == "seaweedfs":
            sw = env.config.seaweedfs
            assert sw is not None
            up = pid is not None and s3_ready(sw.endpoint)
            nodes.append({"name": name, "pid": pid, "running": pid is not None, "pg_port": sw.s3,
                          "http_port": sw.master, "http_ok": up,
                          "error": None if up or pid is None else f"S3 at {sw.endpoint} does not answer"})
            continue
        if name == "storage_controller":
            assert env.storage_controller_url is not None
            answer, error = _try_get(f"{env.storage_controller_url}/v1/status") if pid is not None else (None, None)
            nodes.append({"name": name, "pid": pid, "running": pid is not None, "pg_port": None,
                          "http_port": env.config.storage_controller_port, "http_ok": answer is not None,
                          "error": error})
            continue
        if _is_pageserver(name):
            ports = env.pageserver_ports(env.pageserver_id(name))
            http = env.pageserver_http_of(env.pageserver_id(name))
        else:
            sk_id = int(name.removeprefix("safekeeper_"))
            ports = env.safekeeper_ports(sk_id)
            http = env.safekeeper_http(sk_id)
        answer, error = _try_get(f"{http}/v1/status") if pid is not None else (None, None)
        nodes.append({
            "name": name, "pid": pid, "running": pid is not None, "pg_port": ports.pg,
            "http_port": ports.http, "http_ok": answer is not None, "error": error,
        })

    node_up = {n["name"]: n["http_ok"] for n in nodes}
    sk_timelines: dict[tuple[str, str], dict[str, dict[str, str]]] = {}
    for sk_id in env.safekeeper_ids:
        if not node_up[f"safekeeper_{sk_id}"]:
            continue
        answer, _ = _try_get(f"{env.safekeeper_http(sk_id)}/v1/timelines")
        for tl in answer or []:
            key = (tl["tenant_id"], tl["timeline_id"])
            sk_timelines.setdefault(key, {})[f"safekeeper_{sk_id}"] = {
                "flush_lsn": tl["flush_lsn"], "commit_lsn": tl["commit_lsn"],
                # WAL below it is in remote storage (the safekeepers' WAL backup)
                "backup_lsn": tl.get("backup_lsn"),
            }

    placement = _placement(env) if node_up.get("storage_controller", True) else {}
    timelines: list[dict[str, Any]] = []
    for ps_id in env.pageserver_ids:
        ps_name = env.pageserver_name(ps_id)
        if not node_up[ps_name]:
            continue
        ps_http = env.pageserver_http_of(ps_id)
        tenants, _ = _try_get(f"{ps_http}/v1/tenant")
        for tenant in tenants or []:
            if placement and placement.get(tenant["id"], (0, ps_id))[1] != ps_id:
                continue  # a stale attachment the migration has not detached yet
            infos, _ = _try_get(f"{ps_http}/v1/tenant/{tenant['id']}/timeline")
            for info in infos or []:
                key = (info["tenant_id"], info["timeline_id"])
                timelines.append({
                    "tenant_id": info["tenant_id"],
                    "timeline_id": info["timeline_id"],
                    "pageserver": ps_name,
                    "branch": env.branch_of_timeline(info["tenant_id"], info["timeline_id"]),
                    "ancestor_timeline_id": info.get("ancestor_timeline_id"),
                    "ancestor_lsn": info.get("ancestor_lsn"),
                    "last_record_lsn": info["last_record_lsn"],
                    "disk_consistent_lsn": info["disk_consistent_lsn"],
                    "remote_consistent_lsn": info.get("remote_consistent_lsn"),
                    "wal_receiver_error": info.get("wal_receiver_error"),
                    "safekeepers": sk_timelines.pop(key, {}),
                })
    # Timelines only the safekeepers know (the pageserver is down, say).
    for (tenant_id, timeline_id), sks in sorted(sk_timelines.items()):
        timelines.append({
            "tenant_id": tenant_id, "timeline_id": timeline_id,
            "branch": env.branch_of_timeline(tenant_id, timeline_id),
            "pageserver": None, "ancestor_timeline_id": None, "ancestor_lsn": None, "last_record_lsn": None,
            "disk_consistent_lsn": None, "remote_consistent_lsn": None, "wal_receiver_error": None,
            "safekeepers": sks,
        })
    if placement:
        held = [{"tenant_id": t, "pageserver": env.pageserver_name(n), "generation": g}
                for t, (g, n) in sorted(placement.items())]
    else:
        held = sorted(({"tenant_id": t["tenant_id"], "pageserver": t["pageserver"], "generation": None}
                       for t in timelines if t["pageserver"]), key=lambda d: str(d["tenant_id"]))
        held = [d for i, d in enumerate(held) if i == 0 or held[i - 1]["tenant_id"] != d["tenant_id"]]
    return {
        "workdir": str(env.workdir),
        "nodes": nodes,
        "tenants": held,
        "timelines": timelines,
        "endpoints": [ep.describe() for ep in endpoint.list_endpoints(env)],
    }


# -- which pageserver holds a tenant ----------------------------------------------------------


def _placement(env: LocalEnv) -> dict[str, tuple[int, int]]:
    """tenant id -> (generation, pageserver id), as the storage controller has it ({}: no
    controller, every tenant is on pageserver 1)."""
    url = env.storage_controller_url
    if url is None:
        return {}
    try:
        doc = get_json(f"{url}/control/v1/tenant", timeout=10.0)
    except (ApiError, OSError) as exc:
        raise ClusterError(f"the storage controller at {url} does not answer: {exc} "
                           "(`pagestore start` starts it)") from None
    # (node 0: a deleted tenant's tombstone, held by no pageserver)
    return {t["id"]: (int(t["gen"]), int(t["node_id"])) for t in doc["tenants"] if int(t["node_id"]) != 0}


def tenant_pageserver(env: LocalEnv, tenant_id: str) -> int:
    """The id of the pageserver that holds ``tenant_id`` (1 without a storage controller, or
    for a tenant the controller does not know yet)."""
    return _placement(env).get(tenant_id, (0, 1))[1]


def tenant_http(env: LocalEnv, tenant_id: str) -> str:
    return env.pageserver_http_of(tenant_pageserver(env, tenant_id))


def tenant_pg_port(env: LocalEnv, tenant_id: str) -> int:
    """The page service (libpq) port of the pageserver that holds ``tenant_id``."""
    return env.pageserver_ports(tenant_pageserver(env, tenant_id)).pg


# -- tenants and timelines --------------------------------------------------------------------


def create_tenant(env: LocalEnv, tenant_id: str | None, timeline_id: str | None,
                  *, set_default: bool = False, pageserver: int = 1) -> dict[str, Any]:
    """A tenant with its first timeline bootstrapped (initdb), named branch ``main``, on
    ``pageserver`` (which registers it with the storage controller, if there is one)."""
    require_running(env)
    http = env.pageserver_http_of(pageserver)
    try:
        answer = post_json(f"{http}/v1/tenant", {"tenant_id": tenant_id} if tenant_id else {})
        tenant = str(answer["tenant_id"])
        info = post_json(
            f"{http}/v1/tenant/{tenant}/timeline",
            {"new_timeline_id": timeline_id} if timeline_id else {},
        )
    except (ApiError, OSError) as exc:
        raise ClusterError(f"creating the tenant: {exc}") from None
    env.add_branch(tenant, "main", str(info["timeline_id"]), make_default=set_default)
    return {"tenant_id": tenant, "timeline_id": info["timeline_id"], "branch": "main",
            "pageserver": env.pageserver_name(pageserver), "last_record_lsn": info["last_record_lsn"]}


def list_tenants(env: LocalEnv) -> list[dict[str, Any]]:
    require_running(env)
    placement = _placement(env)
    default = env.default_tenant()
    out = []
    for ps_id in env.pageserver_ids:
        try:
            tenants = get_json(f"{env.pageserver_http_of(ps_id)}/v1/tenant")
        except (ApiError, OSError) as exc:
            raise ClusterError(f"listing tenants of {env.pageserver_name(ps_id)}: {exc}") from None
        out += [{"tenant_id": t["id"], "timelines": t["timelines"], "default": t["id"] == default,
                 "pageserver": env.pageserver_name(ps_id)}
                for t in tenants if placement.get(t["id"], (0, ps_id))[1] == ps_id]
    return sorted(out, key=lambda t: str(t["tenant_id"]))


def timeline_info(env: LocalEnv, tenant_id: str, timeline_id: str) -> dict[str, Any]:
    try:
        info: dict[str, Any] = get_json(f"{tenant_http(env, tenant_id)}/v1/tenant/{tenant_id}/timeline/{timeline_id}")
    except (ApiError, OSError) as exc:
        raise ClusterError(f"timeline {tenant_id}/{timeline_id}: {exc}") from None
    return info


def branch(env: LocalEnv, tenant_id: str | None, name: str, ancestor: str,
           ancestor_lsn: str | None) -> dict[str, Any]:
    require_running(env)
    tenant = env.resolve_tenant(tenant_id)
    if name in env.branches(tenant):
        raise LocalEnvError(f"branch {name!r} already exists in tenant {tenant}")
    ancestor_tl = env.timeline_of_branch(tenant, ancestor)
    body: dict[str, str] = {"ancestor_timeline_id": ancestor_tl}
    if ancestor_lsn:
        body["ancestor_start_lsn"] = ancestor_lsn
    try:
        info = post_json(f"{tenant_http(env, tenant)}/v1/tenant/{tenant}/timeline", body)
    except (ApiError, OSError) as exc:
        raise ClusterError(f"branching {name!r} from {ancestor!r}: {exc}") from None
    env.add_branch(tenant, name, str(info["timeline_id"]))
    return {"tenant_id": tenant, "timeline_id": info["timeline_id"], "branch": name,
            "ancestor_branch": ancestor, "ancestor_lsn": info.get("ancestor_lsn"),
            "last_record_lsn": info["last_record_lsn"]}


def list_timelines(env: LocalEnv, tenant_id: str | None) -> list[dict[str, Any]]:
    require_running(env)
    tenant = env.resolve_tenant(tenant_id)
    try:
        infos = get_json(f"{tenant_http(env, tenant)}/v1/tenant/{tenant}/timeline")
    except (ApiError, OSError) as exc:
        raise ClusterError(f"listing timelines of {tenant}: {exc}") from None
    out = []
    for info in infos:
        out.append({
            "tenant_id": tenant, "timeline_id": info["timeline_id"],
            "branch": env.branch_of_timeline(tenant, info["timeline_id"]),
            "ancestor_timeline_id": info.get("ancestor_timeline_id"),
            "ancestor_lsn": info.get("ancestor_lsn"),
            "last_record_lsn": info["last_record_lsn"],
            "disk_consistent_lsn": info["disk_consistent_lsn"],
        })
    return out


def import_timeline(env: LocalEnv, tenant_id: str | None, name: str, *, pgdata: Path | None,
                    tar: Path | None, timeline_id: str | None,
                    wal_tar: Path | None = None) -> dict[str, Any]:
    """A new timeline from a stopped PostgreSQL 15 data directory or a tar of one."""
    require_running(env)
    tenant = env.resolve_tenant(tenant_id)
    if name in env.branches(tenant):
        raise LocalEnvError(f"branch {name!r} already exists in tenant {tenant}")
    source = pgdata if pgdata is not None else tar
    assert source is not None
    if not source.exists():
        raise LocalEnvError(f"{source} does not exist")
    body: dict[str, str] = {"source": str(source.absolute())}
    if timeline_id:
        body["new_timeline_id"] = timeline_id
    if wal_tar is not None:
        if not wal_tar.exists():
            raise LocalEnvError(f"{wal_tar} does not exist")
        body["wal_tar"] = str(wal_tar.absolute())
    try:
        info = request_json("POST", f"{tenant_http(env, tenant)}/v1/tenant/{tenant}/timeline/import", body,
                            timeout=3600)
    except ApiError as exc:
        if exc.status == 405 or (exc.status == 404 and exc.msg.startswith("no route")):
            raise ClusterError(
                "the pageserver has no import route (POST /v1/tenant/{t}/timeline/import): "
                f"timeline import is not available in this build ({exc.msg})"
            ) from None
        raise ClusterError(f"importing {source}: {exc}") from None
    except OSError as exc:
        raise ClusterError(f"importing {source}: {exc}") from None
    env.add_branch(tenant, name, str(info["timeline_id"]))
    return {"tenant_id": tenant, "timeline_id": info["timeline_id"], "branch": name,
            "last_record_lsn": info["last_record_lsn"]}


def wait_for_lsn(env: LocalEnv, tenant_id: str, timeline_id: str, lsn: int, *,
                 timeout: float = 60.0) -> dict[str, Any]:
    """Wait until the pageserver has ingested WAL up to ``lsn`` on the timeline."""
    from protocol.lsn import format_lsn, parse_lsn

    deadline = time.monotonic() + timeout
    while True:
        info = timeline_info(env, tenant_id, timeline_id)
        if parse_lsn(info["last_record_lsn"]) >= lsn:
            return info
        if time.monotonic() > deadline:
            raise ClusterError(
                f"the pageserver's timeline {timeline_id} is at {info['last_record_lsn']} after "
                f"{timeout:.0f} s, waiting for {format_lsn(lsn)} (streaming from "
                f"{info.get('wal_receiver_safekeeper')}; its receiver's last error, possibly "
                f"from an earlier session: {info.get('wal_receiver_error')})"
            )
        time.sleep(0.1)


# -- moving a tenant between pageservers ------------------------------------------------------

MIGRATE_CATCH_UP_TIMEOUT_S = 300.0


def migrate_tenant(env: LocalEnv, tenant_id: str | None, to: str, *, log: Any = print) -> dict[str, Any]:
    """Move a tenant to another pageserver (Neon's migration, reduced to its safe core):

    1. the old pageserver checkpoints each timeline (layers flushed and uploaded: less WAL for
       the new one to replay; skipped if it is down);
    2. the storage controller gives the tenant a new generation on the new pageserver: from
       then on the old one's index uploads are ignored by every later attachment and its
       deletions and ``remote_consistent_lsn`` fail validation;
    3. the new pageserver attaches in that generation (the remote index, on-demand layers) and
       streams from the safekeepers; we wait until every timeline has what the old one had;
    4. the endpoints follow (``endpoint.follow_tenant``): lazy endpoints' page filesystems read
       from the new one; the safekeepers' pageserver feedback, which the walproposer bridges
       see, now comes from the new pageserver only;
    5. the old pageserver detaches (stops ingest, drops the tenant's local files).
    """
    from control_plane import endpoint
    from protocol.lsn import format_lsn, parse_lsn

    require_running(env)
    if env.storage_controller_url is None:
        raise LocalEnvError("this cluster has one pageserver: `pagestore init --pageservers N` (N > 1) "
                            "for tenant migration")
    tenant = env.resolve_tenant(tenant_id)
    target = env.pageserver_id(to)
    placement = _placement(env)
    if tenant not in placement:
        raise ClusterError(f"the storage controller does not know tenant {tenant}")
    source = placement[tenant][1]
    if source == target:
        raise ClusterError(f"tenant {tenant} is already on {env.pageserver_name(target)}")
    src_http, dst_http = env.pageserver_http_of(source), env.pageserver_http_of(target)
    src_name, dst_name = env.pageserver_name(source), env.pageserver_name(target)
    started = time.monotonic()

    wanted: dict[str, int] = {}
    try:
        infos = get_json(f"{src_http}/v1/tenant/{tenant}/timeline", timeout=30)
    except (ApiError, OSError) as exc:
        log(f"{src_name} does not answer for tenant {tenant} ({exc}): migrating without its checkpoint")
        infos = []
    for info in infos:
        try:
            info = request_json("PUT", f"{src_http}/v1/tenant/{tenant}/timeline/{info['timeline_id']}/checkpoint",
                                timeout=300)
        except (ApiError, OSError) as exc:
            log(f"checkpoint of {info['timeline_id']} on {src_name} failed ({exc}); the new pageserver "
                "replays more WAL")
        wanted[str(info["timeline_id"])] = parse_lsn(info["last_record_lsn"])

    try:
        gen = int(post_json(f"{env.storage_controller_url}/control/v1/tenant/{tenant}/attach",
                            {"node_id": target}, timeout=30)["gen"])
        post_json(f"{dst_http}/v1/tenant/{tenant}/attach", {"generation": gen}, timeout=600)
    except (ApiError, OSError) as exc:
        raise ClusterError(f"attaching tenant {tenant} to {dst_name}: {exc}") from None
    log(f"tenant {tenant} attached to {dst_name} in generation {gen}")

    deadline = time.monotonic() + MIGRATE_CATCH_UP_TIMEOUT_S
    for timeline_id, lsn in wanted.items():
        while True:
            info = get_json(f"{dst_http}/v1/tenant/{tenant}/timeline/{timeline_id}", timeout=30)
            if parse_lsn(info["last_record_lsn"]) >= lsn:
                break
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{dst_name} has timeline {timeline_id} at {info['last_record_lsn']} after "
                    f"{MIGRATE_CATCH_UP_TIMEOUT_S:.0f} s, {src_name} had {format_lsn(lsn)} (the tenant "
                    f"is attached to {dst_name}; {src_name} still serves it: rerun the migration)")
            time.sleep(0.05)
    moved = endpoint.follow_tenant(env, tenant, target, log=log)
    detached = True
    try:
        post_json(f"{src_http}/v1/tenant/{tenant}/detach", {}, timeout=600)
    except (ApiError, OSError) as exc:
        # Safe: its generation is stale; on its next start the controller does not give it back.
        detached = False
        log(f"{src_name} did not detach tenant {tenant} ({exc}); its generation is stale, its "
            "next start drops it")
    return {"tenant_id": tenant, "from": src_name, "to": dst_name, "generation": gen,
            "endpoints": moved, "detached": detached, "seconds": round(time.monotonic() - started, 3)}


# -- deletion ---------------------------------------------------------------------------------


def _refuse_running_endpoints(env: LocalEnv, tenant: str, timelines: set[str] | None) -> list[str]:
    """Names of the stopped endpoints on these timelines (None: any of the tenant's); a
    running one is an error (its compute would lose its storage under it)."""
    from control_plane.endpoint import list_endpoints  # (endpoint imports this module)

    stale = []
    for ep in list_endpoints(env):
        if ep.spec.tenant_id != tenant or (timelines is not None and ep.spec.timeline_id not in timelines):
            continue
        if ep.running():
            raise ClusterError(f"endpoint {ep.name} runs on timeline {ep.spec.timeline_id}: "
                               f"`pagestore endpoint stop {ep.name}` first")
        stale.append(ep.name)
    return stale


def _delete_on_safekeepers(env: LocalEnv, path: str) -> dict[str, Any]:
    """``DELETE path`` on every safekeeper (each deletes its copy and the WAL backup's objects
    under the prefix; a 404 means it had nothing)."""
    out: dict[str, Any] = {}
    for sk_id in env.safekeeper_ids:
        try:
            out[f"safekeeper_{sk_id}"] = request_json("DELETE", f"{env.safekeeper_http(sk_id)}{path}", timeout=300.0)
        except ApiError as exc:
            if exc.status != 404:
                raise ClusterError(f"safekeeper {sk_id}: {exc} (the deletion can be repeated)") from None
            out[f"safekeeper_{sk_id}"] = None
        except OSError as exc:
            raise ClusterError(f"safekeeper {sk_id}: {exc} (the deletion can be repeated)") from None
    return out


def delete_timeline(env: LocalEnv, tenant_id: str | None, *, branch: str | None = None,
                    timeline_id: str | None = None) -> dict[str, Any]:
    """Delete a timeline everywhere: on its pageserver (local and ``tenants/.../timelines/<tl>/``
    in remote storage; refused while it has branches) and on every safekeeper (local WAL and
    the backup ``wal/<tenant>/<tl>/``); its branch names go. Refused while an endpoint runs on
    it. The pageserver goes first: its WAL receiver would otherwise keep asking the
    safekeepers for the timeline."""
    require_running(env)
    tenant = env.resolve_tenant(tenant_id)
    if timeline_id is None:
        if branch is None:
            raise LocalEnvError("name the timeline: --branch-name or --timeline-id")
        timeline_id = env.timeline_of_branch(tenant, branch)
    stale = _refuse_running_endpoints(env, tenant, {timeline_id})
    url = f"{tenant_http(env, tenant)}/v1/tenant/{tenant}/timeline/{timeline_id}"
    try:
        ps: Any = request_json("DELETE", url, timeout=600.0)
    except ApiError as exc:
        if exc.status != 404:
            raise ClusterError(f"deleting timeline {timeline_id}: {exc.msg}") from None
        ps = None  # not on the pageserver (any more): the safekeepers may still have it
    except OSError as exc:
        raise ClusterError(f"deleting timeline {timeline_id}: {exc}") from None
    sks = _delete_on_safekeepers(env, f"/v1/tenant/{tenant}/timeline/{timeline_id}")
    if ps is None and not any(sks.values()):
        raise ClusterError(f"timeline {tenant}/{timeline_id} not found")
    names = env.remove_timeline_branches(tenant, {timeline_id})
    return {"tenant_id": tenant, "timeline_id": timeline_id, "branches": names, "pageserver": ps,
            "safekeepers": sks, "stopped_endpoints_left": stale}


def delete_tenant(env: LocalEnv, tenant_id: str) -> dict[str, Any]:
    """Delete a tenant everywhere: its pageserver (local and ``tenants/<tenant>/``), every
    safekeeper (local and ``wal/<tenant>/``), its storage controller record (a tombstone that
    keeps its generations from being reused) and its branch names."""
    require_running(env)
    stale = _refuse_running_endpoints(env, tenant_id, None)
    url = f"{tenant_http(env, tenant_id)}/v1/tenant/{tenant_id}"
    try:
        ps: Any = request_json("DELETE", url, timeout=600.0)
    except ApiError as exc:
        if exc.status != 404:
            raise ClusterError(f"deleting tenant {tenant_id}: {exc.msg}") from None
        ps = None
    except OSError as exc:
        raise ClusterError(f"deleting tenant {tenant_id}: {exc}") from None
    sks = _delete_on_safekeepers(env, f"/v1/tenant/{tenant_id}")
    if ps is None and not any(sks.values()):
        raise ClusterError(f"tenant {tenant_id} not found")
    controller = env.storage_controller_url
    if controller is not None:
        try:
            request_json("DELETE", f"{controller}/control/v1/tenant/{tenant_id}")
        except ApiError as exc:
            if exc.status != 404:
                raise ClusterError(f"storage controller: {exc}") from None
        except OSError as exc:
            raise ClusterError(f"storage controller: {exc}") from None
    names = env.remove_timeline_branches(tenant_id, None)
    return {"tenant_id": tenant_id, "branches": names, "pageserver": ps, "safekeepers": sks,
            "stopped_endpoints_left": stale}
