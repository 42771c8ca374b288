"""``pagestore bench compute``: lazy endpoints (the page filesystem over the page service) vs
full endpoints (a copy of every relation file) vs a plain local PostgreSQL, side by side in one
run. One JSON line per measurement:

- ``start``: per pgbench scale and storage, ``endpoint start`` (the CLI run in a child process)
  until the first query (``SELECT count(*) FROM pgbench_branches``) is answered, polled from
  outside: ``first_query_s``; also the command's own ``start_seconds`` and ``start_phases``
  (a primary's command returns after the walproposer bridge is elected, which reads do not wait
  for) and the basebackup size. The median of ``--repeat`` starts.
- ``tps``: at ``--tps-scale``, pgbench select-only and tpcb-like on a lazy endpoint cold (just
  started: every page comes from the page service) and warm (after ``pg_prewarm`` of the pgbench
  tables and indexes), on a full endpoint (cold and warm) and on a plain local PostgreSQL (warm;
  no walproposer, no safekeepers). The lazy endpoint (on main) and the full one (on a branch of
  main at the same LSN) run at the same time and their warm runs alternate, ``--tps-repeat``
  rounds; ``tps_ratio`` is the lazy/full ratio of the medians.
- ``seqscan``: at the largest scale, a cold ``sum(abalance)`` of ``pgbench_accounts`` on a fresh lazy
  endpoint: MB/s, and the GetPage batch sizes the page filesystem sent and the page service
  executed; twice: right after the load (``pages: wal``: the page service rebuilds every page
  from the load's WAL records) and after the pageserver compacted main with image layers
  (``pages: images``: its steady state). ``--scan-impl native,python`` runs the scan right
  after the load once per kernel implementation on the same layers (``--scan-rounds``
  rounds, alternating), the storage nodes restarted on that implementation before each scan
  (``pageserver_impl`` in the line is what the pageserver's ``/v1/status`` reports).
  ``--repeat 0`` skips the start measurements.

Each scale gets its own cluster (``init --free-ports --no-sync``: the safekeepers skip fsync, so
the safekeeper disk is not what is measured). The data is loaded through a full endpoint
(``pgbench -i``), which is then stopped, and the pageserver's in-memory layer is flushed
(``flush``; the pages stay WAL records) before anything is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import psycopg

from bench.impl_rows import add_impl_option, parse_impls, run_per_impl
from common.ports import free_port
from compute.postgres import PostgresInstance, postgres_tmpdir
from control_plane import process
from protocol import _native


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scales", default="1,10,50", help="pgbench scales for the start times")
    parser.add_argument("--tps-scale", type=int, default=10, help="the scale of the TPS runs (0: none)")
    parser.add_argument("--seconds", type=int, default=10, help="pgbench -T of each TPS run")
    parser.add_argument("--clients", type=int, default=2, help="pgbench -c")
    parser.add_argument("--repeat", type=int, default=3, help="starts per scale and storage")
    parser.add_argument("--tps-repeat", type=int, default=3,
                        help="rounds of the warm TPS runs, lazy and full alternating")
    parser.add_argument("--no-seqscan", action="store_true")
    parser.add_argument("--scan-impl", default=None,
                        help="native,python: the scan right after the load once per kernel implementation on "
                             "the same cluster and layers, the storage nodes restarted with or without "
                             "PAGESTORE_PURE_PYTHON=1 before each (default: the nodes as started, no restart)")
    parser.add_argument("--scan-rounds", type=int, default=1,
                        help="rounds of the scan right after the load (with --scan-impl: the implementations alternate)")
    parser.add_argument("--plot", type=Path, default=None,
                        help="with --from: draw the start times of a saved run as this PNG (no run)")
    parser.add_argument("--from", dest="from_file", type=Path, default=None, help="JSON lines of an earlier run")
    add_impl_option(parser)


def emit(line: dict[str, Any]) -> None:
    print(json.dumps({"bench": "compute", **line}), flush=True)


def cli(workdir: Path, *args: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(process.cli_command(*args, "--workdir", str(workdir)), cwd=process.ROOT,
                          capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"pagestore {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def query(port: int, sql: str) -> Any:
    with psycopg.connect(f"host=127.0.0.1 port={port} user=postgres dbname=postgres connect_timeout=2") as conn:
        cur = conn.execute(sql)
        row = cur.fetchone() if cur.description is not None else None
    return row[0] if row else None


def timed_start(workdir: Path, name: str, storage: str, probe: str = "SELECT count(*) FROM pgbench_branches",
                branch: str = "main") -> dict[str, Any]:
    """Start an endpoint from a child process; the first answered ``probe`` is polled meanwhile."""
    port = free_port()
    t0 = time.monotonic()
    child = subprocess.Popen(
        process.cli_command("endpoint", "start", name, "--storage", storage, "--port", str(port), "--json",
                            "--branch-name", branch, "--workdir", str(workdir)),
        cwd=process.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = None
    while first is None:
        try:
            query(port, probe)
            first = time.monotonic() - t0
        except psycopg.Error:
            if child.poll() is not None and child.returncode != 0:
                raise RuntimeError(f"endpoint start failed: {child.stderr.read() if child.stderr else ''}") from None
            time.sleep(0.01)
    out, err = child.communicate(timeout=600)
    if child.returncode != 0:
        raise RuntimeError(f"endpoint start failed: {err}")
    cli_s = time.monotonic() - t0
    desc = json.loads(out)
    return {"first_query_s": round(first, 3), "cli_s": round(cli_s, 3), "start_seconds": desc["start_seconds"],
            "phases": desc["start_phases"], "port": port}


def prewarm(port: int) -> None:
    """Warm: every page of the pgbench tables and indexes read once (pg_prewarm reads them
    into shared buffers; what does not fit stays in the kernel's page cache)."""
    query(port, "CREATE EXTENSION IF NOT EXISTS pg_prewarm")
    query(port, "SELECT sum(pg_prewarm(c.oid)) FROM pg_class c WHERE c.relname LIKE 'pgbench_%' "
                "AND c.relkind IN ('r', 'i')")


def pgbench_tps(port: int, *args: str) -> float:
    pg = PostgresInstance(Path("/nonexistent"), port=port, started=True)
    out = pg.pgbench(*args)
    m = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out)
    if m is None:
        raise RuntimeError(f"pgbench printed no tps:\n{out}")
    return float(m.group(1))


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return str(resp.read().decode())


def histogram(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram in exposition text."""
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_sum"):
            total = float(line.split()[-1])
        elif line.startswith(f"{name}_count"):
            count = float(line.split()[-1])
    return total, count


def pagefs_url(workdir: Path, name: str) -> str:
    st = json.loads((workdir / "endpoints" / name / "pagefs-status.json").read_text())
    return f"http://127.0.0.1:{st['http_port']}"


def run_scale(root: Path, scale: int, args: argparse.Namespace, seqscan: bool) -> None:
    wd = root / f"scale{scale}"
    cli(wd, "init", "--free-ports", "--no-sync")
    cli(wd, "start")
    try:
        cli(wd, "tenant", "create")
        load = timed_start(wd, "load", "full", probe="SELECT 1")
        t = time.monotonic()
        PostgresInstance(Path("/nonexistent"), port=load["port"], started=True).pgbench("-i", "-s", str(scale), "-q")
        db_bytes = int(query(load["port"], "SELECT pg_database_size('postgres')"))
        emit({"metric": "load", "scale": scale, "seconds": round(time.monotonic() - t, 1), "db_bytes": db_bytes})
        cli(wd, "endpoint", "stop", "load")
        emit({"metric": "flush", "scale": scale, "seconds": round(flush_layers(wd), 1)})
        for storage in ("lazy", "full") if args.repeat > 0 else ():
            runs = []
            for i in range(args.repeat):
                r = timed_start(wd, f"{storage}{i}", storage)
                cli(wd, "endpoint", "stop", f"{storage}{i}")
                runs.append(r)
            emit({"metric": "start", "scale": scale, "storage": storage, "db_bytes": db_bytes,
                  "first_query_s": statistics.median(r["first_query_s"] for r in runs),
                  "start_seconds": statistics.median(r["start_seconds"] for r in runs),
                  "runs": [{k: v for k, v in r.items() if k != "port"} for r in runs]})
        if scale == args.tps_scale:
            tps_runs(wd, scale, args)
        if seqscan:
            impls: list[str | None] = list(parse_impls(args.scan_impl)) if args.scan_impl else [None]
            for i in range(args.scan_rounds):
                for impl in impls:
                    if impl is not None:
                        restart_nodes(wd, impl)
                    seqscan_run(wd, scale, "wal", scan_round=i)
            if impls != [None]:  # the compaction and the images scan on this process's kernels
                restart_nodes(wd, _native.IMPL)
            emit({"metric": "compaction", "scale": scale, "seconds": round(compact_with_images(wd), 1)})
            seqscan_run(wd, scale, "images")
    finally:
        subprocess.run(process.cli_command("stop", "--workdir", str(wd), "--immediate"), cwd=process.ROOT,
                       capture_output=True, check=False)


def tps_runs(wd: Path, scale: int, args: argparse.Namespace) -> None:
    """A lazy endpoint on main and a full endpoint on a branch of it at the same LSN run side
    by side: their pgbench runs alternate (``--tps-repeat`` rounds), so that the machine's
    load changes both alike; the medians and the lazy/full ratio are printed."""
    t, c = str(args.seconds), str(args.clients)
    common = ["-n", "-T", t, "-c", c]

    def line(target: str, mode: str, tps: float, **extra: Any) -> None:
        emit({"metric": "tps", "scale": scale, "target": target, "mode": mode, "tps": round(tps, 1),
              "clients": args.clients, "seconds": args.seconds, **extra})

    lazy = timed_start(wd, "tps-lazy", "lazy")
    line("lazy-cold", "select-only", pgbench_tps(lazy["port"], *common, "-S"))
    prewarm(lazy["port"])
    cli(wd, "timeline", "branch", "--branch-name", "tps-full", "--ancestor-branch-name", "main")
    full = timed_start(wd, "tps-full", "full", branch="tps-full")
    line("full-cold", "select-only", pgbench_tps(full["port"], *common, "-S"))
    prewarm(full["port"])
    for mode, flags in (("select-only", ["-S"]), ("tpcb-like", [])):
        got: dict[str, list[float]] = {"lazy-warm": [], "full": []}
        for i in range(args.tps_repeat):
            for target, ep in (("lazy-warm", lazy), ("full", full)):
                tps = pgbench_tps(ep["port"], *common, *flags)
                got[target].append(tps)
                line(target, mode, tps, round=i)
        med = {k: statistics.median(v) for k, v in got.items()}
        emit({"metric": "tps_ratio", "scale": scale, "mode": mode, "lazy_warm_tps": round(med["lazy-warm"], 1),
              "full_tps": round(med["full"], 1), "lazy_over_full": round(med["lazy-warm"] / med["full"], 3),
              "rounds": args.tps_repeat})
    st = json.loads(http_get(pagefs_url(wd, "tps-lazy") + "/v1/status"))
    emit({"metric": "pagefs", "scale": scale, **{k: st[k] for k in ("hits", "misses", "writes", "evictions",
                                                                   "bytes_cached", "getpage_batches")}})
    cli(wd, "endpoint", "stop", "tps-lazy")
    cli(wd, "endpoint", "stop", "tps-full")
    with postgres_tmpdir("bench-compute-plain-") as tmp:
        pg = PostgresInstance.create(tmp / "pg", {"wal_level": "replica", "shared_buffers": "128MB"})
        pg.start()
        try:
            pg.pgbench("-i", "-s", str(scale), "-q")
            prewarm(pg.port)
            line("plain", "select-only", pgbench_tps(pg.port, *common, "-S"))
            line("plain", "tpcb-like", pgbench_tps(pg.port, *common))
        finally:
            pg.stop("immediate")


def _timeline_url(wd: Path) -> str:
    from control_plane.local_env import LocalEnv

    env = LocalEnv.load(wd)  # also registers the cluster's token for these URLs
    tenant = env.resolve_tenant(None)
    return f"{env.pageserver_http}/v1/tenant/{tenant}/timeline/{env.timeline_of_branch(tenant, 'main')}"


def flush_layers(wd: Path) -> float:
    """Write the pageserver's in-memory layer of main to disk (the load's WAL stays WAL
    records: no image layers): the starts are then measured on a pageserver at rest, not
    one still busy with the load. Returns seconds."""
    from control_plane.http_client import request_json

    t = time.monotonic()
    request_json("PUT", f"{_timeline_url(wd)}/checkpoint", timeout=1800)
    return time.monotonic() - t


def compact_with_images(wd: Path) -> float:
    """Flush and compact main with image layers: the pages are then materialized, as a
    pageserver has them in its steady state. Returns seconds."""
    from control_plane.http_client import request_json

    url = _timeline_url(wd)
    t = time.monotonic()
    request_json("PUT", f"{url}/checkpoint", timeout=1800)
    request_json("PUT", f"{url}/compact?force_image=true", timeout=1800)
    return time.monotonic() - t


def restart_nodes(wd: Path, impl: str) -> None:
    """Stop the storage nodes and start them again on the kernels ``impl`` names (``python``:
    with ``PAGESTORE_PURE_PYTHON=1``), so that both implementations rebuild the same pages
    from the same layers; the pageserver's page cache starts empty either way."""
    env = {k: v for k, v in os.environ.items() if k != "PAGESTORE_PURE_PYTHON"}
    if impl == "python":
        env["PAGESTORE_PURE_PYTHON"] = "1"
    cli(wd, "stop", env=env)
    cli(wd, "start", env=env)


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux ``/proc/PID/stat``), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def seqscan_run(wd: Path, scale: int, pages: str, scan_round: int = 0) -> None:
    """``pages``: ``wal`` (right after the load: the page service rebuilds each page from
    WAL records) or ``images`` (after ``compact_with_images``). The line names the kernel
    implementation the pageserver runs (its ``/v1/status``)."""
    ep = timed_start(wd, "scan", "lazy")
    ps_http = _pageserver_http(wd)
    before_ps = histogram(http_get(ps_http + "/metrics"), "pageserver_page_service_batch_size")
    before_fs = histogram(http_get(pagefs_url(wd, "scan") + "/metrics"), "pagefs_getpage_batch_size")
    size = int(query(ep["port"], "SELECT pg_relation_size('pgbench_accounts')"))
    ps_pid = int((wd / "pageserver" / "pid").read_text().split()[0])
    fs_pid = int(json.loads((wd / "endpoints" / "scan" / "pagefs-status.json").read_text())["pid"])
    cpu0 = (_cpu_seconds(ps_pid), _cpu_seconds(fs_pid))
    t = time.monotonic()
    # sum(abalance) needs every heap page (count(*) could be an index-only scan)
    query(ep["port"], "SELECT sum(abalance) FROM pgbench_accounts")
    secs = time.monotonic() - t
    ps_cpu, fs_cpu = _cpu_seconds(ps_pid) - cpu0[0], _cpu_seconds(fs_pid) - cpu0[1]
    after_ps = histogram(http_get(ps_http + "/metrics"), "pageserver_page_service_batch_size")
    after_fs = histogram(http_get(pagefs_url(wd, "scan") + "/metrics"), "pagefs_getpage_batch_size")
    fs_batches = after_fs[1] - before_fs[1]
    ps_batches = after_ps[1] - before_ps[1]
    emit({"metric": "seqscan", "scale": scale, "pages": pages, "pageserver_impl": _pageserver_impl(wd), "round": scan_round,
          "table_bytes": size, "seconds": round(secs, 3),
          "mb_per_s": round(size / secs / 1e6, 1),
          # CPU per 8 KiB page of the scan: where the time goes when the machine is shared
          "pageserver_cpu_us_per_page": round(ps_cpu / (size / 8192) * 1e6, 1),
          "pagefs_cpu_us_per_page": round(fs_cpu / (size / 8192) * 1e6, 1),
          "pagefs_batches": int(fs_batches),
          "pagefs_mean_batch": round((after_fs[0] - before_fs[0]) / fs_batches, 1) if fs_batches else None,
          "page_service_batches": int(ps_batches),
          "page_service_mean_batch": round((after_ps[0] - before_ps[0]) / ps_batches, 1) if ps_batches else None})
    cli(wd, "endpoint", "stop", "scan")


def _pageserver_http(wd: Path) -> str:
    cfg = tomllib.loads((wd / "pagestore.toml").read_text())
    return f"http://127.0.0.1:{cfg['pageserver']['http']}"


def _pageserver_impl(wd: Path) -> str:
    return str(json.loads(http_get(_pageserver_http(wd) + "/v1/status"))["impl"])


def plot(lines: list[dict[str, Any]], out: Path) -> None:
    """Left: start to first query, lazy vs full, per scale, and the 1 s goal. Right: warm
    pgbench TPS (medians, log scale) of the lazy, full and plain targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    starts = [x for x in lines if x.get("metric") == "start"]
    scales = sorted({x["scale"] for x in starts})
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.35
    for i, storage in enumerate(("lazy", "full")):
        ys = [next((x["first_query_s"] for x in starts if x["scale"] == sc and x["storage"] == storage), 0.0)
              for sc in scales]
        bars = ax.bar([j + (i - 0.5) * width for j in range(len(scales))], ys, width, label=f"{storage} endpoint")
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(scales)), [f"scale {sc}" for sc in scales])
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="goal (lazy): 1 s")
    ax.set_ylabel("endpoint start -> first query answered (s)")
    ax.set_title("start time (median)")
    ax.legend()
    tps = [x for x in lines if x.get("metric") == "tps"]
    modes = ("select-only", "tpcb-like")
    targets = ("lazy-warm", "full", "plain")
    width = 0.27
    for i, target in enumerate(targets):
        ys = []
        for mode in modes:
            vals = [x["tps"] for x in tps if x["target"] == target and x["mode"] == mode]
            ys.append(statistics.median(vals) if vals else 0.0)
        bars = bx.bar([j + (i - 1) * width for j in range(len(modes))], ys, width, label=target)
        bx.bar_label(bars, fmt="%.0f", fontsize=8)
    bx.set_xticks(range(len(modes)), modes)
    bx.set_yscale("log")
    bx.set_ylabel("pgbench TPS (median of the rounds, log)")
    bx.set_title(f"warm TPS at scale {tps[0]['scale'] if tps else '?'}")
    bx.legend()
    fig.suptitle("pagestore bench compute")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def run(args: argparse.Namespace) -> int:
    if args.plot is not None:
        if args.from_file is None:
            print("pagestore bench compute: --plot needs --from FILE", file=sys.stderr)
            return 2
        lines = [json.loads(x) for x in args.from_file.read_text().splitlines() if x.startswith("{")]
        plot(lines, args.plot)
        return 0
    if args.impl is not None:  # --impl native,python: the whole bench once per implementation
        return run_per_impl("bench.compute", args, "compute")
    scales = [int(s) for s in args.scales.split(",") if s]
    with open("/proc/loadavg") as f:
        emit({"metric": "machine", "loadavg": f.read().split()[:3], "cpus": os.cpu_count()})
    with postgres_tmpdir("bench-compute-") as root:
        for scale in scales:
            run_scale(root, scale, args, seqscan=not args.no_seqscan and scale == max(scales))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    configure(parser)
    sys.exit(run(parser.parse_args()))
