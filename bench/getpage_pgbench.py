"""``pagestore bench getpage-pgbench``: the seed's own getpage table, on timelines ingested from
real pgbench databases.

What Neon's ``test_pageserver_max_throughput_getpage_at_latest_lsn`` measured (storage.md §5.2):
a pgbench database at scale 6 and 13 (``pgbench -i -s N -I dtGvp``), its timeline duplicated
into 1 and 10 tenants, then ``pagebench get-page-latest-lsn``: one connection per tenant, one
request in flight, keys uniform over every block of every relation of the timeline, request
count, mean and p95/p99/p99.9/p99.99 latency. The seed's figures (PR #7477's "vectored, hot
page cache" block: 1 tenant, scale 6, 30 s: 360,067 requests, mean 82 µs) are printed beside
ours as ``seed`` lines and in ``docs/benchmarks.md``.

Per scale, one run:

1. **Load.** A cluster (``init --free-ports --no-sync --no-auth``, three safekeepers), one
   tenant, a full endpoint, ``pgbench -i -s N -I dtGvp``; ``--update-rounds R`` then runs R
   rounds of ``pgbench -N -c 1 -t --update-transactions`` (each followed by a checkpoint: the
   seed's 17 rounds left a stack of small L0 layers on top). The pageserver ingests it all
   through the safekeepers; the endpoint stops; the timeline is checkpointed and compacted
   with image layers. The relation listing of the timeline at its last LSN (``GET
   .../relations``: every fork of every relation of every database, with its size) is the key
   space the clients read. The cluster stops.
2. **Tenants.** The tenant's directory is copied (real copies, not links) into ``max(--tenants)
   - 1`` new tenant ids, as the seed's test duplicated its template tenant.
3. **Rows.** For every ``--tenants`` x ``--get-impl`` x ``--cache`` x ``--impl`` (rounds
   outermost), a fresh pageserver process of this cluster's config serves the tenants
   (``pagestore pageserver -c``; WAL receivers off, compaction and GC off, page cache 128 MiB
   as the seed's override; ``tenant_config.get_impl`` is the read path a user picks), and
   ``--clients`` processes per tenant drive it for ``--duration`` seconds with the native
   load generator (``protocol._getpage_load_c``: closed loop, ``--queue-depth`` in flight, every
   answer checked against its request's relation and block).

   - ``hot``: a warm-up window of ``--warmup`` seconds with the same clients first (the
     pageserver's page cache, layer-index cache and the OS page cache then hold what random
     reads touch), then the measured window on the same process.
   - ``cold``: every file of the tenants' directories is dropped from the OS page cache
     (``posix_fadvise(DONTNEED)`` per file: only this bench's files, not the machine's whole
     cache as ``drop_caches`` would) before the pageserver starts, and the window starts at
     its first request: its page cache, index cache and the OS cache all start empty.
   - ``--impl python``: the pageserver and the client processes run with
     ``PAGESTORE_PURE_PYTHON=1`` (every kernel's pure-Python twin).

Each row: request_count, pages/s, latency mean, p50/p95/p99/p99.9/p99.99 (µs, HdrHistogram, 3
significant digits), server CPU per request (the pageserver process's user+sys over the
measured window, from /proc), its sys share, and the clients' CPU per request. JSON lines; a
plot with ``--plot``. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import tomli_w

from common.ports import free_port
from compute.postgres import PostgresInstance, postgres_tmpdir
from control_plane import process

MiB = 1024 * 1024
# The seed's pageserver override: page_cache_size = 16384 slots of 8 KiB.
PAGE_CACHE_BYTES = 128 * MiB

# The seed's figures (neondatabase/neon PR #7477, "pageserver: coalesce read paths": the
# get_impl = vectored rows of test_pageserver_max_throughput_getpage_at_latest_lsn, 30 s,
# hardware not stated; latencies in µs). Only these two blocks were readable; the legacy rows
# of that thread were not (storage.md §7).
SEED: dict[tuple[int, int, str, str], dict[str, float]] = {
    (6, 1, "vectored", "hot"): {"request_count": 360_067, "latency_mean_us": 82,
                                "latency_p95_us": 130, "latency_p99_us": 425,
                                "latency_p99.9_us": 492, "latency_p99.99_us": 921},
    (13, 1, "vectored", "cold"): {"request_count": 136_567, "latency_mean_us": 218,
                                  "latency_p95_us": 516, "latency_p99_us": 747,
                                  "latency_p99.9_us": 1307, "latency_p99.99_us": 2443},
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scales", default="6,13", help="comma list of pgbench scales")
    parser.add_argument("--tenants", default="1,10", help="comma list of tenant counts")
    parser.add_argument("--cache", default="hot,cold", help="comma list: hot, cold")
    parser.add_argument("--get-impl", default="vectored,legacy",
                        help="comma list: vectored, legacy (tenant_config.get_impl)")
    parser.add_argument("--impl", default="native,python",
                        help="comma list: native (compiled kernels), python "
                        "(PAGESTORE_PURE_PYTHON=1 in the pageserver and the clients)")
    parser.add_argument("--clients", default="1", help="comma list of connections per tenant")
    parser.add_argument("--queue-depth", type=int, default=1, help="requests in flight per client")
    parser.add_argument("--duration", type=float, default=30.0, help="measured seconds per row")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds of warm-up before a hot row (default: --duration)")
    parser.add_argument("--rounds", type=int, default=1, help="measure every row this many times")
    parser.add_argument("--update-rounds", type=int, default=0,
                        help="rounds of pgbench -N after the load, each followed by a checkpoint")
    parser.add_argument("--update-transactions", type=int, default=1000,
                        help="pgbench -t of each update round")
    parser.add_argument("--plot", type=Path, default=None, help="write a latency/throughput PNG")
    parser.add_argument("--from", dest="from_file", type=Path, default=None,
                        help="with --plot: draw the rows of an earlier run's JSON lines (no run)")


def emit(line: dict[str, Any]) -> None:
    print(json.dumps({"bench": "getpage-pgbench", **line}), flush=True)


def _csv(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


# ---------------------------------------------------------------------------------------------
# 1. The load


def cli(workdir: Path, *args: str) -> str:
    proc = subprocess.run(process.cli_command(*args, "--workdir", str(workdir)), cwd=process.ROOT,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"pagestore {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def _http_json(method: str, url: str, timeout: float = 1800) -> Any:
    req = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def load_template(wd: Path, scale: int, args: argparse.Namespace, safekeepers: int = 3) -> dict[str, Any]:
    """A cluster in ``wd`` with one tenant holding a pgbench database at ``scale``, ingested,
    checkpointed and compacted with image layers; the cluster is stopped on return. Returns
    the tenant, timeline, pageserver config path and the relation listing's key space."""
    cli(wd, "init", "--free-ports", "--no-sync", "--no-auth", "--safekeepers", str(safekeepers))
    cli(wd, "start")
    try:
        created = json.loads(cli(wd, "tenant", "create", "--set-default", "--json"))
        tenant, timeline = created["tenant_id"], created["timeline_id"]
        port = free_port()
        cli(wd, "endpoint", "start", "load", "--storage", "full", "--port", str(port))
        pg = PostgresInstance(Path("/nonexistent"), port=port, started=True)
        t0 = time.monotonic()
        pg.pgbench("-i", "-s", str(scale), "-I", "dtGvp", "-q")
        load_s = time.monotonic() - t0
        db_bytes = int(pg.psql("SELECT pg_database_size('postgres')"))
        ps_http = _pageserver_http(wd)
        url = f"{ps_http}/v1/tenant/{tenant}/timeline/{timeline}"
        for _ in range(args.update_rounds):
            pg.pgbench("-n", "-N", "-c", "1", "-t", str(args.update_transactions))
            _wait_caught_up(pg, url)
            _http_json("PUT", f"{url}/checkpoint")
        cli(wd, "endpoint", "stop", "load")
        t1 = time.monotonic()
        _http_json("PUT", f"{url}/checkpoint")
        _http_json("PUT", f"{url}/compact?force_image=true")
        compact_s = time.monotonic() - t1
        listing = _http_json("GET", f"{url}/relations")
    finally:
        subprocess.run(process.cli_command("stop", "--workdir", str(wd)), cwd=process.ROOT,
                       capture_output=True, check=False)
    rels, sizes = keyspace_of(listing)
    ps_config = wd / "pageserver" / "pageserver.toml"
    emit({"setup": "template", "scale": scale, "db_bytes": db_bytes, "load_s": round(load_s, 1),
          "compact_s": round(compact_s, 1), "relations": len(rels), "blocks": sum(sizes),
          "update_rounds": args.update_rounds, "at_lsn": listing["lsn"]})
    return {"tenant": tenant, "timeline": timeline, "config": ps_config, "rels": rels,
            "sizes": sizes, "db_bytes": db_bytes}


def _wait_caught_up(pg: PostgresInstance, timeline_url: str, timeout: float = 600) -> None:
    """Until the pageserver's last_record_lsn reaches the endpoint's current WAL position."""
    from protocol.lsn import parse_lsn

    target = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()").strip())
    deadline = time.monotonic() + timeout
    while parse_lsn(_http_json("GET", timeline_url)["last_record_lsn"]) < target:
        if time.monotonic() > deadline:
            raise RuntimeError("the pageserver did not catch up with the endpoint")
        time.sleep(0.1)


def keyspace_of(listing: dict[str, Any]) -> tuple[list[tuple[int, int, int, int]], list[int]]:
    """Every non-empty fork of every relation of the listing: (spc, db, rel, fork), nblocks."""
    from pageserver.basebackup import FORK_NAMES

    fork_numbers = {name: num for num, name in FORK_NAMES.items()}
    rels: list[tuple[int, int, int, int]] = []
    sizes: list[int] = []
    for db in listing["databases"]:
        for rel in db["relations"]:
            for fork, nblocks in sorted(rel["forks"].items()):
                if nblocks > 0:
                    rels.append((db["spcnode"], db["dbnode"], rel["relnode"], fork_numbers[fork]))
                    sizes.append(nblocks)
    if not rels:
        raise RuntimeError("the timeline has no relation blocks to read")
    return rels, sizes


def _pageserver_http(wd: Path) -> str:
    cfg = tomllib.loads((wd / "pageserver" / "pageserver.toml").read_text())
    return f"http://{cfg['listen_http_addr']}"


# ---------------------------------------------------------------------------------------------
# 2. The tenants


def duplicate_tenant(tenants_dir: Path, tenant: str, copies: int) -> list[str]:
    """``copies`` new tenant ids, each a real copy of ``tenant``'s directory (its own files,
    so its own OS page-cache pages). Returns every tenant id, the template first."""
    from protocol.ids import TenantId

    ids = [tenant]
    for _ in range(copies):
        new = TenantId.generate().hex
        shutil.copytree(tenants_dir / tenant, tenants_dir / new)
        ids.append(new)
    return ids


def drop_os_cache(root: Path) -> int:
    """Drop every file under ``root`` from the OS page cache (fsync first: dirty pages stay
    cached otherwise). Returns the bytes advised."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


# ---------------------------------------------------------------------------------------------
# 3. A row: a pageserver process and its clients


def serving_config(template: Path, out: Path, get_impl: str) -> tuple[Path, int, int]:
    """The cluster's pageserver config with fresh ports, no WAL receivers, no background
    compaction or GC, the seed's page cache size and ``get_impl``."""
    cfg = tomllib.loads(template.read_text())
    pg_port, http_port = free_port(), free_port()
    cfg.update(listen_pg_addr=f"127.0.0.1:{pg_port}", listen_http_addr=f"127.0.0.1:{http_port}",
               safekeepers=[], log_level="warning")
    tenant_config = dict(cfg.get("tenant_config", {}))
    tenant_config.update(get_impl=get_impl, page_cache_size=PAGE_CACHE_BYTES,
                         compaction_period_s=0.0, gc_period_s=0.0, validate_get=False)
    cfg["tenant_config"] = tenant_config
    out.write_text(tomli_w.dumps(cfg))
    return out, pg_port, http_port


class Pageserver:
    """``pagestore pageserver -c CONFIG`` as a child process of this bench."""

    def __init__(self, config: Path, http_port: int, env: dict[str, str], log: Path) -> None:
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            process.cli_command("pageserver", "-c", str(config)), cwd=process.ROOT, env=env,
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
        )
        self.http = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the pageserver exited ({self.proc.returncode}): {process.tail(log)}")
            try:
                self.status = _http_json("GET", f"{self.http}/v1/status", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the pageserver did not answer: {process.tail(log)}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _client_process(argv: list[Any]) -> dict[str, Any]:
    """One client process: a ``BlockingPageClient`` in a closed loop, the load generator
    kernel over the key space in ``keyspace`` (a JSON file), for ``duration`` s. Connected, it
    prints a ``ready`` line and reads the window's start (``time.monotonic``, shared by every
    process on Linux) from stdin. Returns ``bench.getpage.closed_loop``'s summary."""
    from bench.getpage import closed_loop
    from compute.page_client import BlockingPageClient
    from protocol._native import require
    from protocol.ids import TenantId, TimelineId

    port, tenant, timeline, keyspace, queue_depth, duration, seed = argv
    space = json.loads(Path(keyspace).read_text())
    rels = [tuple(r) for r in space["rels"]]
    loads = require("protocol._getpage_load_c")
    client = BlockingPageClient.connect("127.0.0.1", port, TenantId.parse(tenant),
                                        TimelineId.parse(timeline))
    load = loads.GetPageLoad(rels, space["sizes"], seed, first_reqid=client.next_reqid())

    def window() -> float:
        print(json.dumps({"ready": True}), flush=True)
        return float(sys.stdin.readline())

    return closed_loop(client, load, queue_depth, duration, window)


def drive(port: int, targets: list[tuple[str, str]], clients: int, keyspace: Path, qd: int,
          duration: float, env: dict[str, str], seed0: int,
          on_start: Callable[[], None] | None = None) -> tuple[int, Any, float, float]:
    """``clients`` processes per target; returns count, merged histogram, window s, client CPU s."""
    from bench.getpage import merge_client_results

    procs = []
    for i, (tenant, timeline) in enumerate(targets):
        for c in range(clients):
            argv = [port, tenant, timeline, str(keyspace), qd, duration, seed0 + i * 1000 + c]
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "bench.getpage_pgbench", "--client-process", json.dumps(argv)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=process.ROOT, env=env,
            ))
    # every client connected (imports, connection start-up) before the window opens
    for proc in procs:
        assert proc.stdout is not None and proc.stdin is not None
        if "ready" not in proc.stdout.readline():
            for other in procs:
                other.kill()
            raise RuntimeError(f"a benchmark client process failed to connect (exit {proc.wait()})")
    start_at = time.monotonic() + 0.05
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(f"{start_at}\n")
        proc.stdin.close()
    if on_start is not None:
        time.sleep(max(0.0, start_at - time.monotonic()))
        on_start()
    results, failed = [], []
    for proc in procs:
        assert proc.stdout is not None
        out = proc.stdout.read()  # to its end: the process's one result line
        proc.stdout.close()
        if proc.wait(timeout=60) != 0:
            failed.append(proc.returncode)
            continue
        results.append(json.loads(out.strip().splitlines()[-1]))
    if failed:
        raise RuntimeError(f"{len(failed)} benchmark client process(es) failed (exit {failed})")
    return merge_client_results(results, start_at)


def run_row(base: Path, template: dict[str, Any], tenant_ids: list[str], keyspace: Path,
            args: argparse.Namespace, *, scale: int, tenants: int, clients: int, get_impl: str,
            cache: str, kernels: str, round_no: int,
            probe: Callable[[int], None] | None = None) -> dict[str, Any]:
    """One row (see the module docstring); ``probe`` is called with the page service's port
    once the pageserver answers, before anything is measured."""
    from bench.getpage import _kernel_env, _measured_fields, _process_cpu_s

    config, pg_port, http_port = serving_config(template["config"], base / "bench-pageserver.toml",
                                                get_impl)
    tenants_dir = template["config"].parent / "tenants"
    dropped = drop_os_cache(tenants_dir) if cache == "cold" else 0
    env = _kernel_env(kernels)
    ps = Pageserver(config, http_port, env, base / "bench-pageserver.log")
    try:
        if ps.status.get("impl") != kernels:
            raise RuntimeError(f"the pageserver runs {ps.status.get('impl')!r}, not {kernels!r}")
        if probe is not None:
            probe(pg_port)
        targets = [(t, template["timeline"]) for t in tenant_ids[:tenants]]
        warmup = args.duration if args.warmup is None else args.warmup
        if cache == "hot" and warmup > 0:
            drive(pg_port, targets, clients, keyspace, args.queue_depth, warmup, env, 10_000_000)
        cpu = {"before": _process_cpu_s(ps.proc.pid)}

        def window_opens() -> None:
            cpu["before"] = _process_cpu_s(ps.proc.pid)

        count, hist, elapsed, client_cpu_s = drive(
            pg_port, targets, clients, keyspace, args.queue_depth, args.duration, env,
            round_no * 100_000, window_opens)
        after = _process_cpu_s(ps.proc.pid)
    finally:
        ps.stop()
    before = cpu["before"]
    row: dict[str, Any] = {
        "target": "pagestore", "round": round_no, "scale": scale, "tenants": tenants,
        "clients_per_tenant": clients, "queue_depth": args.queue_depth, "get_impl": get_impl,
        "cache": cache, "impl": kernels, "blocks_per_tenant": sum(template["sizes"]),
        **_measured_fields(count, hist, elapsed, (after[0] - before[0], after[1] - before[1])),
        "client_cpu_us_per_request": round(client_cpu_s / count * 1e6, 1) if count else None,
    }
    if cache == "cold":
        row["os_cache_dropped_bytes"] = dropped
    return row


# ---------------------------------------------------------------------------------------------
# Summary and plot

_MEDIAN = ("request_count", "pages_per_s", "latency_mean_us", "latency_p50_us", "latency_p95_us",
           "latency_p99_us", "latency_p99.9_us", "latency_p99.99_us", "server_cpu_us_per_request",
           "server_sys_us_per_request", "client_cpu_us_per_request")
_KEY = ("scale", "tenants", "clients_per_tenant", "queue_depth", "get_impl", "cache", "impl")


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The median of every measured field per configuration (over its rounds)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in _KEY), []).append(r)
    out = []
    for key, rs in groups.items():
        med: dict[str, Any] = {"summary": f"median of {len(rs)} rounds", **dict(zip(_KEY, key, strict=True))}
        for f in _MEDIAN:
            vals = [r[f] for r in rs if r.get(f) is not None]
            if vals:
                med[f] = round(statistics.median(vals), 1)
        out.append(med)
    return out


def seed_lines(summary: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The seed's figures for the configurations this run measured, with our ratio to them."""
    for row in summary:
        seed = SEED.get((row["scale"], row["tenants"], row["get_impl"], row["cache"]))
        if seed is None or row["clients_per_tenant"] != 1 or row["queue_depth"] != 1:
            continue
        yield {"target": "seed (neon PR #7477)", "scale": row["scale"], "tenants": row["tenants"],
               "get_impl": row["get_impl"], "cache": row["cache"], "impl": row["impl"],
               "seed": seed, "ours_mean_over_seed": round(row["latency_mean_us"] / seed["latency_mean_us"], 2),
               # the seed's 30 s count: requests per second
               "ours_rate_over_seed": round(row["pages_per_s"] / (seed["request_count"] / 30.0), 3)}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Left: latency percentiles (log) per configuration, the seed's beside the rows it has.
    Right: pages/s per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: tuple(str(r[k]) for k in _KEY))
    labels = [f"s{r['scale']} {r['tenants']}t {r['clients_per_tenant']}c {r['get_impl'][:3]} "
              f"{r['cache']} {r['impl'][:2]}" for r in rows]
    fields = (("latency_mean_us", "mean"), ("latency_p95_us", "p95"), ("latency_p99_us", "p99"),
              ("latency_p99.9_us", "p99.9"), ("latency_p99.99_us", "p99.99"))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(16, max(4.0, 0.42 * len(rows) + 1.5)))
    for name_i, (field, name) in enumerate(fields):
        ax.scatter([r.get(field) or 0 for r in rows], range(len(rows)), label=name, s=22,
                   marker="os^vD"[name_i])
    for y, r in enumerate(rows):
        seed = SEED.get((r["scale"], r["tenants"], r["get_impl"], r["cache"]))
        if seed is not None and r["clients_per_tenant"] == 1 and r["queue_depth"] == 1:
            ax.scatter([seed[f] for f, _ in fields], [y] * len(fields), color="k", marker="|", s=90)
            ax.annotate("seed", (seed["latency_mean_us"], y), fontsize=6, xytext=(0, 5),
                        textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("GetPage latency, µs (log); black ticks: the seed's figures")
    ax.legend(fontsize=7)
    ax.set_title("latency")
    bx.barh(range(len(rows)), [r["pages_per_s"] for r in rows], color="tab:blue")
    bx.set_yticks(range(len(rows)), labels, fontsize=7)
    bx.invert_yaxis()
    bx.set_xlabel("pages/s (all tenants)")
    bx.set_title("throughput")
    fig.suptitle("pagestore bench getpage-pgbench: GetPage@latest over pgbench timelines")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if args.from_file is not None:
        if args.plot is None:
            print("pagestore bench getpage-pgbench: --from needs --plot", file=sys.stderr)
            return 2
        lines = [json.loads(x) for x in args.from_file.read_text().splitlines() if x.startswith("{")]
        summ = [x for x in lines if x.get("summary")] or summarize(
            [x for x in lines if x.get("target") == "pagestore"])
        plot(summ, args.plot)
        return 0
    from bench.getpage import _kernel_env

    scales = [int(s) for s in _csv(args.scales)]
    tenant_counts = [int(t) for t in _csv(args.tenants)]
    client_counts = [int(c) for c in _csv(args.clients)]
    caches, get_impls, impls = _csv(args.cache), _csv(args.get_impl), _csv(args.impl)
    if bad := set(caches) - {"hot", "cold"}:
        raise SystemExit(f"--cache: unknown {sorted(bad)}; use hot, cold")
    if bad := set(get_impls) - {"vectored", "legacy"}:
        raise SystemExit(f"--get-impl: unknown {sorted(bad)}; use vectored, legacy")
    for kernels in impls:
        _kernel_env(kernels)  # an unknown name fails before anything runs
    with open("/proc/loadavg") as f:
        emit({"setup": "machine", "loadavg": f.read().split()[:3], "cpus": os.cpu_count()})
    rows: list[dict[str, Any]] = []
    with postgres_tmpdir("bench-getpage-pgbench-") as root:
        for scale in scales:
            wd = root / f"scale{scale}"
            template = load_template(wd, scale, args)
            keyspace = wd / "keyspace.json"
            keyspace.write_text(json.dumps({"rels": template["rels"], "sizes": template["sizes"]}))
            t0 = time.monotonic()
            tenant_ids = duplicate_tenant(wd / "pageserver" / "tenants", template["tenant"],
                                          max(tenant_counts) - 1)
            emit({"setup": "tenants", "scale": scale, "tenants": len(tenant_ids),
                  "copy_s": round(time.monotonic() - t0, 1)})
            # Rounds outermost: a burst of load elsewhere on the machine hits every row alike.
            for round_no in range(args.rounds):
                for tenants in tenant_counts:
                    for clients in client_counts:
                        for get_impl in get_impls:
                            for cache in caches:
                                for kernels in impls:
                                    row = run_row(wd, template, tenant_ids, keyspace, args,
                                                  scale=scale, tenants=tenants, clients=clients,
                                                  get_impl=get_impl, cache=cache, kernels=kernels,
                                                  round_no=round_no)
                                    emit(row)
                                    rows.append(row)
            shutil.rmtree(wd, ignore_errors=True)  # the next scale's disk
    summary = summarize(rows)
    for line in summary:
        emit(line)
    for line in seed_lines(summary):
        emit(line)
    if args.plot is not None:
        plot(summary, args.plot)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--client-process":
        print(json.dumps(_client_process(json.loads(sys.argv[2]))), flush=True)
    else:
        parser = argparse.ArgumentParser()
        configure(parser)
        sys.exit(run(parser.parse_args()))
