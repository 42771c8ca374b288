"""``pagestore bench bulk-ingest``: a bulk INSERT's WAL, ingested by the pageserver vs replayed
by PostgreSQL's own crash recovery (Neon's test_bulk_insert, issue 7).

One run, one JSON line per phase and a final result line:

1. ``initdb`` (as the postgres user) into a scratch directory; a PostgreSQL 15 starts on a copy
   (no checkpoint during the run: ``max_wal_size`` and ``checkpoint_timeout`` are large);
2. ``CREATE TABLE bulk (id int, v text)`` and ``INSERT ... SELECT generate_series`` in batches
   until at least ``--mb`` MB of WAL were written since start-up;
3. ``pg_ctl stop -m immediate``, then ``pg_ctl start -w``: PostgreSQL replays all of that WAL
   (its last checkpoint is initdb's); **pg_recovery_s** is the time until it accepts
   connections;
4. a fresh pageserver timeline imported from the same initdb directory; its ``WalReceiver``
   streams ``START_REPLICATION PHYSICAL`` straight from the recovered PostgreSQL (a safekeeper
   speaks the same protocol) and the ingest runs until ``last_record_lsn`` reaches the end of
   the bulk load: **ingest_s** (decode + ingest into the in-memory layer, which rolls to L0
   files at ``checkpoint_distance``), then **flush_s** for the final flush to an L0 file.

``ratio`` = ingest_s / pg_recovery_s (the issue's goal: at most 1).

PostgreSQL's crash recovery ends with an end-of-recovery checkpoint it waits for before it
accepts connections (every replayed page written and fsynced), while ``ingest_s`` ends when the
last record is in the in-memory layer, before the layers are durable. So each run also reports
**durable_s** = ingest_s + background_flush_wait_s + flush_s (until the rolled layers' L0 files
and the final flush are on disk, ``disk_consistent_lsn`` at the end) and ``ratio_durable`` =
durable_s / pg_server_s: the like-for-like figure. The recovery line also reports PostgreSQL's
time as its own server log gives it (``log_checkpoints`` is on by default; the log's
millisecond timestamps): **pg_server_s**, from "starting PostgreSQL" to "ready to accept
connections" (``pg_recovery_s`` also holds ``pg_ctl``'s and ``pg_isready``'s process starts
through ``runuser``, a large share on a loaded machine), **pg_redo_s** (the replay, "redo done
... elapsed") and **pg_checkpoint_s** (the end-of-recovery checkpoint's "checkpoint complete
... total") and **pg_redo_mb**, the WAL it replayed ("redo starts at" to "redo done at");
``ratio_redo`` = the ingest's seconds per MB of WAL over PostgreSQL's replay's seconds per MB
compares the two replays before either is durable. The regression suite runs ``CHECKPOINT``s,
so with ``--workload regress`` PostgreSQL replays only the WAL after the suite's last one
while the ingest takes all of it: the bench then says so (a ``note`` line), ``ratio`` and
``ratio_durable`` compare different amounts of WAL and only ``ratio_redo`` (per MB) is a
comparison. Where the ingest's wall
time went: ``ingest_cpu_s`` is this process's CPU time, ``ingest_runq_wait_s`` the time its
threads were runnable but waiting for a core (``/proc/self/task/*/schedstat``: on a shared
2-core machine that is the other processes' load), the rest (``ingest_idle_s``) blocked, e.g.
waiting for the stream; ``walsender_cpu_s`` is what PostgreSQL's walsender used meanwhile (it
shares the cores), ``loadavg`` the 1-minute load average at the start and the end.

Memory (issue 3's goal: pageserver RSS below ``page_cache_size`` + 300 MiB while ingesting
1 GiB): the peak-RSS mark (``VmHWM``) is reset (``/proc/self/clear_refs``) after the import, so
**peak_rss_mib** is this process's peak over the ingest and its final flush;
``rss_before_ingest_mib`` is the RSS at the reset; ``rss_goal_mib`` = ``page_cache_size_mib`` +
300. The walredo process is not counted (a separate process, as in Neon).

Floors (one ``bulk_ingest_floor`` JSON line each, after the ingest, over the same WAL: the
segment files the recovered PostgreSQL still holds, read into memory first, from the record
the ingest started at to the end of the bulk load; in-process, nothing stored), each with its
time, CPU per record and its ratio to ``pg_recovery_s``:

- ``decode-only``: the production decoder (``WalStreamDecoder.decode_into``, fed the receiver's
  128 KiB pieces) decodes and CRC-checks every record; the records are dropped.
- ``walk-crc-min``: ``protocol.wal.walk.walk_crc``, the least any Python ingest must do per
  record: unpack its header, follow page boundaries, check its CRC-32C. If this alone were
  near 2x PostgreSQL's recovery, the goal would be out of reach for a Python pageserver.

``--floor-runs N`` repeats each floor (the line reports the median run); ``--floor-runs 0``
skips them.

The L0 writer (``--l0-writer inline,process``, ``--rounds N``): the ingest phase runs once
per configuration and round, interleaved (A, B, A, B, ...), each into a fresh tenant, over
the same recovered PostgreSQL; one result line per run (``l0_writer``, ``round``), then one
``bulk_ingest_summary`` line per configuration with the medians. With ``process`` the rolled
layer's L0 is written by the timeline's worker process in the background: ``l0_worker_cpu_s``
is that process's CPU time from the start to the end of the ingest (``_final``: to the end of
the final flush),
``l0_pending_at_ingest_end`` whether the rolled layer was still being written when
``last_record_lsn`` reached the end, and ``background_flush_wait_s`` how long after that it
was done (the final ``flush_s`` excludes it). ``--l0-worker-nice N`` sets the worker's
niceness (default ``WORKER_NICE``).

The WAL (``--workload``): ``insert`` (default) is the bulk INSERT above; ``regress`` runs the
first ``--regress-groups`` test lines of PostgreSQL's regression suite (``parallel_schedule``,
from ``.cache/pg-regress``) against the PostgreSQL with ``wal_consistency_checking = all`` and
``wal_compression = zstd``, as ``tests/integration/test_pg_regress.py`` does: nearly every
record carries a compressed full-page image, and thousands of relations come and go (the
suite's ~2 GB of WAL is the ingest that test waits for). PostgreSQL's crash recovery of it
then also checks every image (consistency checking is on); the floors are skipped.

The kernels (``--impl native,python``): each run of the ingest goes into a fresh spawned
process whose ``PAGESTORE_PURE_PYTHON`` selects the compiled kernels or their pure-Python twins
(``impl`` in the result and summary lines; the CPU and RSS figures are that process's), every
implementation times every other setting, interleaved in each round. Without the option the
ingest runs in this process, with whatever it imported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import trio

from compute.postgres import PostgresInstance, chown_to_postgres
from pageserver.import_datadir import import_datadir, run_initdb
from pageserver.storage.config import StorageConfig
from pageserver.storage.l0_worker import WORKER_NICE, L0Worker
from pageserver.tenant import Tenant
from pageserver.wal_receiver import WalReceiverConfig
from pageserver.walingest import TimelineWalIngest
from pageserver.walredo.manager import PostgresRedoManager
from protocol import _native
from protocol.ids import TenantId, TimelineId
from protocol.lsn import (
    WAL_SEGMENT_SIZE,
    XLOG_BLCKSZ,
    Lsn,
    format_lsn,
    parse_lsn,
    segment_file_name,
)
from protocol.wal.reader import NeedData, WalStreamDecoder
from protocol.wal.record import DecodedRecord
from protocol.wal.walk import walk_crc

MB = 1_000_000
XLOGDATA_BYTES = 128 * 1024  # what one XLogData message of the walsender carries
SETTINGS = {
    "wal_level": "replica",
    "full_page_writes": "on",
    "max_wal_size": "8GB",
    "min_wal_size": "1GB",
    "checkpoint_timeout": "1h",
    "wal_keep_size": "8GB",  # the end-of-recovery checkpoint must not remove what we stream
    "autovacuum": "off",
    "max_wal_senders": "4",
    "wal_sender_timeout": "30s",
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mb", type=int, default=300, help="MB of WAL the bulk INSERT writes (default 300)")
    parser.add_argument("--batch-rows", type=int, default=500_000, help="rows per INSERT statement")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: under /tmp)")
    parser.add_argument("--io-engine", choices=("blocking", "threadpool"), default="blocking")
    parser.add_argument("--floor-runs", type=int, default=1,
                        help="runs of each floor configuration (median reported; 0: none)")
    parser.add_argument("--l0-writer", default=StorageConfig().l0_writer,
                        help="comma-separated L0 writers to compare (inline, process)")
    parser.add_argument("--l0-worker-nice", type=int, default=WORKER_NICE,
                        help=f"niceness of the L0 worker process (default {WORKER_NICE})")
    parser.add_argument("--rounds", type=int, default=1,
                        help="ingest runs per configuration, interleaved (default 1)")
    parser.add_argument("--workload", choices=("insert", "regress"), default="insert",
                        help="the WAL: a bulk INSERT (default), or PostgreSQL's regression suite with "
                             "wal_consistency_checking = all and wal_compression = zstd (an image on "
                             "nearly every record, as tests/integration/test_pg_regress.py makes)")
    parser.add_argument("--regress-groups", type=int, default=1000,
                        help="with --workload regress: the first N test lines of parallel_schedule (default all)")
    parser.add_argument("--impl", default=None,
                        help="comma-separated kernel implementations to compare (native, python): "
                             "each run in a fresh process with PAGESTORE_PURE_PYTHON set to match "
                             "(default: this process's, in-process)")
    parser.add_argument("--plot", type=Path, default=None,
                        help="draw the runs' ingest and durable seconds per implementation against "
                             "PostgreSQL's recovery as this PNG (after the run, or of --from's run)")
    parser.add_argument("--from", dest="from_file", type=Path, default=None,
                        help="with --plot: the JSON lines of an earlier run (no run)")


def plot(lines: list[dict[str, Any]], out: Path) -> None:
    """Per implementation (and L0 writer): each round's ingest_s and durable_s as bars, beside
    PostgreSQL's crash recovery of the same WAL (its start-to-ready, which ends with the
    end-of-recovery checkpoint, and its replay alone) as lines: the goal is durable_s at or
    below the first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [x for x in lines if x.get("bench") == "bulk_ingest"]
    if not results:
        raise SystemExit("pagestore bench bulk-ingest --plot: no bulk_ingest result lines")
    configs = list(dict.fromkeys((r["impl"], r["l0_writer"]) for r in results))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.38
    for j, (impl, writer) in enumerate(configs):
        mine = [r for r in results if (r["impl"], r["l0_writer"]) == (impl, writer)]
        for i, (field, label) in enumerate((("ingest_s", "ingest (in memory)"), ("durable_s", "until durable"))):
            xs = [j + (i - 0.5) * width + (k - (len(mine) - 1) / 2) * width / max(len(mine), 1)
                  for k in range(len(mine))]
            bars = ax.bar(xs, [r[field] for r in mine], width / max(len(mine), 1),
                          color=("tab:blue", "tab:orange")[i], label=label if j == 0 else None)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
    first = results[0]
    server = first.get("pg_server_s") or first["pg_recovery_s"]
    ax.axhline(server, color="black", linestyle="--", linewidth=1,
               label=f"PostgreSQL crash recovery, start to ready: {server:.2f} s (the goal)")
    if first.get("pg_redo_s"):
        ax.axhline(first["pg_redo_s"], color="grey", linestyle=":", linewidth=1,
                   label=f"PostgreSQL replay alone: {first['pg_redo_s']:.2f} s")
    ax.set_xticks(range(len(configs)), [f"{impl}\n(L0 writer {writer})" for impl, writer in configs])
    ax.set_ylabel("seconds (each bar one round)")
    loads = sorted({x for r in results for x in r.get("loadavg", [])})
    ax.set_title(f"bench bulk-ingest: {first['wal_mb']} MB of WAL, load {loads[0]}-{loads[-1]}"
                 if loads else f"bench bulk-ingest: {first['wal_mb']} MB of WAL")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def _runq_wait_s() -> float:
    """Seconds this process's threads have spent runnable but not running (schedstat)."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just exited
    return total / 1e9


def _reset_peak_rss() -> None:
    """Make VmHWM restart from the current RSS (Linux clear_refs, value 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status_mib(field: str) -> float:
    """A ``/proc/self/status`` memory field (VmRSS, VmHWM) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of another process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _lsn(pg: PostgresInstance, fn: str) -> Lsn:
    return parse_lsn(pg.psql(f"SELECT {fn}()"))


def _prepare(
    root: Path, args: argparse.Namespace
) -> tuple[PostgresInstance, Lsn, Lsn, tuple[float, dict[str, float | None]]]:
    """Bulk load, crash, recover: (pg, start lsn, end lsn, (recovery seconds, its split))."""
    pgdata = root / "pg"
    shutil.copytree(root / "init", pgdata, symlinks=True)
    chown_to_postgres(pgdata)
    os.chmod(pgdata, 0o700)
    regress = args.workload == "regress"
    settings = dict(SETTINGS, wal_consistency_checking="all", wal_compression="zstd") if regress else dict(SETTINGS)
    pg = PostgresInstance(datadir=pgdata, settings=settings)
    pg.start()
    start = _lsn(pg, "pg_current_wal_insert_lsn")
    if regress:
        end = _regress_load(root, pg, start, args.regress_groups)
        return pg, start, end, _crash_and_recover(pg)
    pg.psql("CREATE TABLE bulk (id int, v text)")
    t0 = time.perf_counter()
    done = 0
    while True:
        pg.psql(
            f"INSERT INTO bulk SELECT g, repeat('x', 80) FROM generate_series({done + 1}, {done + args.batch_rows}) g"
        )
        done += args.batch_rows
        end = _lsn(pg, "pg_current_wal_insert_lsn")
        if end - start >= args.mb * MB:
            break
    load_s = time.perf_counter() - t0
    _emit({"phase": "bulk_insert", "rows": done, "wal_mb": round((end - start) / MB, 1),
           "start": format_lsn(start), "end": format_lsn(end), "seconds": round(load_s, 2)})
    return pg, start, end, _crash_and_recover(pg)


# PostgreSQL 15's server log: the end of the replay, and the end-of-recovery checkpoint
_REDO_DONE = re.compile(r"redo done at (\S+) system usage: .*elapsed: ([0-9.]+) s")
_REDO_STARTS = re.compile(r"redo starts at (\S+)")
_CHECKPOINT_DONE = re.compile(r"checkpoint complete: .*write=([0-9.]+) s, sync=([0-9.]+) s, total=([0-9.]+) s")
# (log_line_prefix '%m [%p] ': "2026-12-02 00:58:01.123 UTC [1234] LOG:  ...")
_STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) \S+ \[\d+\] LOG:  "
_STARTING = re.compile(_STAMP + "starting PostgreSQL", re.M)
_READY = re.compile(_STAMP + "database system is ready to accept connections", re.M)


def _stamp_s(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f").timestamp()


def _recovery_split(log_text: str) -> dict[str, float | None]:
    """The last recovery's replay and checkpoint seconds from the server log (None: not
    logged, e.g. a log format this parser does not know)."""
    redo = _REDO_DONE.findall(log_text)
    redo_from = _REDO_STARTS.findall(log_text)
    tail = log_text[log_text.rfind("redo done at"):] if redo else ""
    ckpt = _CHECKPOINT_DONE.findall(tail)
    starts = list(_STARTING.finditer(log_text))
    ready = _READY.search(log_text, starts[-1].end()) if starts else None
    return {
        "pg_server_s": (
            round(_stamp_s(ready.group(1)) - _stamp_s(starts[-1].group(1)), 3) if ready else None
        ),
        "pg_redo_s": float(redo[-1][1]) if redo else None,
        "pg_redo_mb": (
            round((parse_lsn(redo[-1][0]) - parse_lsn(redo_from[-1])) / MB, 1) if redo and redo_from else None
        ),
        "pg_checkpoint_s": float(ckpt[0][2]) if ckpt else None,
        "pg_checkpoint_write_s": float(ckpt[0][0]) if ckpt else None,
        "pg_checkpoint_sync_s": float(ckpt[0][1]) if ckpt else None,
    }


def _crash_and_recover(pg: PostgresInstance) -> tuple[float, dict[str, float | None]]:
    """``pg_ctl stop -m immediate``, then start: the seconds until it accepts connections,
    and the replay / checkpoint split its log gives."""
    pg.stop("immediate")
    t0 = time.perf_counter()
    pg.start(timeout=600)
    pg.wait_ready()
    recovery_s = time.perf_counter() - t0
    split = _recovery_split((pg.datadir / "server.log").read_text(errors="replace"))
    _emit({"phase": "pg_crash_recovery", "seconds": round(recovery_s, 2), **split})
    return recovery_s, split


def _regress_load(root: Path, pg: PostgresInstance, start: Lsn, groups: int) -> Lsn:
    """The first ``groups`` test lines of the regression suite's parallel_schedule against
    ``pg`` (scripts/setup puts the suite in .cache/pg-regress): the end LSN of its WAL."""
    from bench import pg_regress

    stage = pg_regress.stage_suite(root)
    lines = [line for line in (stage / "parallel_schedule").read_text().splitlines() if line.startswith("test:")]
    schedule = stage / "bench_schedule"
    schedule.write_text("\n".join(lines[:groups]) + "\n")
    chown_to_postgres(schedule)
    t0 = time.perf_counter()
    runner = pg_regress.ScheduleRunner("bench", stage, pg.port, schedule)
    while not runner.poll():
        time.sleep(0.5)
    end = _lsn(pg, "pg_current_wal_insert_lsn")
    _emit({"phase": "regress_load", "groups": min(groups, len(lines)), "returncode": runner.run.returncode,
           "wal_mb": round((end - start) / MB, 1), "start": format_lsn(start), "end": format_lsn(end),
           "seconds": round(time.perf_counter() - t0, 2)})
    return end


def _l0_writers(text: str) -> list[Literal["inline", "process"]]:
    out: list[Literal["inline", "process"]] = []
    for name in text.split(","):
        if name == "inline":
            out.append("inline")
        elif name == "process":
            out.append("process")
        else:
            raise SystemExit(f"--l0-writer: unknown writer {name!r} (inline, process)")
    return out


def _impls(text: str | None) -> list[str | None]:
    if text is None:
        return [None]
    out: list[str | None] = []
    for name in text.split(","):
        if name not in ("native", "python"):
            raise SystemExit(f"--impl: unknown implementation {name!r} (native, python)")
        out.append(name)
    return out


def _ingest_child(queue: Any, *args: Any) -> None:
    """A spawned process's run of ``_ingest`` (its imports chose the kernels from the
    environment it was started with): the result dict, or the error's text, on ``queue``."""
    try:
        queue.put(trio.run(_ingest, *args))
    except BaseException as exc:
        queue.put(f"{type(exc).__name__}: {exc}")
        raise


def _ingest_in(impl: str | None, *args: Any) -> dict[str, Any]:
    """``_ingest`` in this process (``impl`` None), or in a fresh spawned process whose
    ``PAGESTORE_PURE_PYTHON`` selects ``impl``: its CPU and RSS figures are that process's."""
    if impl is None:
        result: dict[str, Any] = trio.run(_ingest, *args)
        return result
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    saved = os.environ.get(_native.ENV_VAR)
    if impl == "python":
        os.environ[_native.ENV_VAR] = "1"
    else:
        os.environ.pop(_native.ENV_VAR, None)
    try:
        child = ctx.Process(target=_ingest_child, args=(queue, *args))
        child.start()
    finally:
        if saved is None:
            os.environ.pop(_native.ENV_VAR, None)
        else:
            os.environ[_native.ENV_VAR] = saved
    got = queue.get()
    child.join()
    if isinstance(got, str):
        raise RuntimeError(f"the {impl} ingest failed: {got}")
    if got["impl"] != impl:
        raise RuntimeError(f"asked for the {impl} kernels, the child ran {got['impl']}")
    return dict(got)


def _worker_cpu_s(pid: int | None) -> float:
    return 0.0 if pid is None else _proc_cpu_s(pid)


async def _ingest(
    root: Path, pg: PostgresInstance, end: Lsn, args: argparse.Namespace,
    l0_writer: Literal["inline", "process"] = "process", tenant_dir: str = "tenant",
) -> dict[str, Any]:
    config = StorageConfig(io_engine=args.io_engine, compaction_period_s=0, gc_period_s=0,
                           l0_writer=l0_writer)
    async with trio.open_nursery() as nursery:
        tenant = Tenant(root / tenant_dir, TenantId.generate(), config, redo=PostgresRedoManager(),
                        nursery=nursery)
        tl = await tenant.create_timeline(TimelineId.generate())
        tl.l0_worker = L0Worker(nice=args.l0_worker_nice)
        imported = await import_datadir(tl, root / "init")
        await tl.flush()
        cfg = WalReceiverConfig(safekeepers=(("127.0.0.1", pg.port),), idle_timeout_s=60)
        ing = TimelineWalIngest(tl, cfg)
        load0 = os.getloadavg()[0]
        _reset_peak_rss()
        rss0 = _status_mib("VmRSS")
        t0 = time.perf_counter()
        c0 = time.process_time()
        w0 = _runq_wait_s()
        worker0 = _worker_cpu_s(tl.l0_worker.pid)  # (started by the import's flush, or not yet)
        nursery.start_soon(ing.run)
        await tl.wait_lsn(end, timeout_s=3600)
        ingest_s = time.perf_counter() - t0
        ingest_cpu_s = time.process_time() - c0
        runq_s = _runq_wait_s() - w0
        load1 = os.getloadavg()[0]
        worker_cpu_s = _worker_cpu_s(tl.l0_worker.pid) - worker0
        pending = bool(tl.frozen_layers)
        t1 = time.perf_counter()
        await tl.wait_background_flush()
        background_wait_s = time.perf_counter() - t1
        # the walsender started with this ingest, so its whole CPU time counts
        pids = await trio.to_thread.run_sync(pg.psql, "SELECT pid FROM pg_stat_replication")
        walsender_cpu_s = sum(_proc_cpu_s(int(p)) for p in pids.split())
        t1 = time.perf_counter()
        await ing.flush()
        flush_s = time.perf_counter() - t1
        worker_cpu_final_s = _worker_cpu_s(tl.l0_worker.pid) - worker0
        worker_jobs = tl.l0_worker.jobs
        peak_rss = _status_mib("VmHWM")
        nursery.cancel_scope.cancel()
    stats = ing.ingest.stats
    durable_lsn = tl.disk_consistent_lsn
    await tenant.shutdown()
    if durable_lsn < end:
        raise RuntimeError(f"the final flush left disk_consistent_lsn at {format_lsn(durable_lsn)}, "
                           f"before the load's end {format_lsn(end)}")
    wal_bytes = end - imported.end_lsn
    return {
        "ingest_start": format_lsn(imported.end_lsn),
        "ingest_s": round(ingest_s, 2),
        "ingest_cpu_s": round(ingest_cpu_s, 2),
        "ingest_runq_wait_s": round(runq_s, 2),
        "ingest_idle_s": round(max(0.0, ingest_s - ingest_cpu_s - runq_s), 2),
        "walsender_cpu_s": round(walsender_cpu_s, 2),
        "loadavg": [round(load0, 1), round(load1, 1)],
        "flush_s": round(flush_s, 2),
        "durable_s": round(ingest_s + background_wait_s + flush_s, 2),
        "l0_writer": l0_writer,
        "l0_worker_nice": args.l0_worker_nice,
        "l0_worker_cpu_s": round(worker_cpu_s, 2),
        "l0_worker_cpu_final_s": round(worker_cpu_final_s, 2),
        "l0_worker_jobs": worker_jobs,
        "l0_pending_at_ingest_end": pending,
        "background_flush_wait_s": round(background_wait_s, 2),
        "impl": _native.IMPL,
        "records": stats.records,
        "values": stats.values,
        "ingest_mb_per_s": round(wal_bytes / MB / ingest_s, 2),
        "us_per_record_cpu": round(ingest_cpu_s / max(1, stats.records) * 1e6, 2),
        "records_per_s": round(stats.records / ingest_s),
        "rss_before_ingest_mib": round(rss0, 1),
        "peak_rss_mib": round(peak_rss, 1),
        "page_cache_size_mib": round(config.page_cache_size / (1 << 20), 1),
        "rss_goal_mib": round(config.page_cache_size / (1 << 20) + 300, 1),
    }


def _read_wal(pg_wal: Path, start: Lsn, end: Lsn) -> tuple[Lsn, bytes]:
    """The WAL from ``start``'s segment up to ``end``, from PostgreSQL's segment files."""
    first = start // WAL_SEGMENT_SIZE
    last = (end - 1) // WAL_SEGMENT_SIZE
    parts = []
    for seg in range(first, last + 1):
        path = pg_wal / segment_file_name(seg, 1, WAL_SEGMENT_SIZE)
        parts.append(path.read_bytes())  # (FileNotFoundError names a missing segment)
    base = Lsn(first * WAL_SEGMENT_SIZE)
    # up to the end of the page holding ``end``: the decoder never needs more (cut before the
    # join: one copy of the WAL in memory, not two)
    parts[-1] = parts[-1][: -(-end // XLOG_BLCKSZ) * XLOG_BLCKSZ - last * WAL_SEGMENT_SIZE]
    return base, b"".join(parts)


def _decode_only(wal: bytes, base: Lsn, start: Lsn, end: Lsn) -> tuple[int, int]:
    """The production decoder over the WAL in the receiver's XLogData pieces: (records, end)."""
    page = start & ~(XLOG_BLCKSZ - 1)
    dec = WalStreamDecoder(start, data_start=page)
    out: list[DecodedRecord] = []
    records = 0
    for at in range(page - base, len(wal), XLOGDATA_BYTES):
        dec.feed(wal[at : at + XLOGDATA_BYTES])
        stop = dec.decode_into(out)
        if dec.position >= end:
            # the last piece may hold records past the bulk load's end: not counted
            records += sum(1 for r in out if r.lsn < end)
            return records, max(r.end_lsn for r in out if r.lsn < end)
        records += len(out)
        out.clear()
        if not isinstance(stop, NeedData):
            raise RuntimeError(f"decode-only floor: WAL ended early: {stop}")
    raise RuntimeError(f"decode-only floor: the WAL stops at {format_lsn(dec.position)}")


def _floors(root: Path, start: Lsn, end: Lsn, recovery_s: float, runs: int) -> None:
    base, wal = _read_wal(root / "pg" / "pg_wal", start, end)

    def walk() -> tuple[int, int]:
        result = walk_crc(wal, base, start, end)
        if result.error is not None:
            raise RuntimeError(f"walk-crc-min floor: {result.error}")
        return result.records, result.end_lsn

    configs: list[tuple[str, Callable[[], tuple[int, int]]]] = [
        ("decode-only", lambda: _decode_only(wal, base, start, end)),
        ("walk-crc-min", walk),
    ]
    for name, fn in configs:
        samples = []
        for _ in range(runs):
            load0 = os.getloadavg()[0]
            t0 = time.perf_counter()
            c0 = time.process_time()
            records, stopped_at = fn()
            samples.append((time.process_time() - c0, time.perf_counter() - t0, records, stopped_at, load0))
        cpu_s, wall_s, records, stopped_at, load0 = sorted(samples)[len(samples) // 2]
        _emit({
            "bench": "bulk_ingest_floor",
            "config": name,
            "wal_mb": round((stopped_at - start) / MB, 1),
            "records": records,
            "end": format_lsn(Lsn(stopped_at)),
            "seconds": round(wall_s, 2),
            "cpu_s": round(cpu_s, 2),
            "us_per_record_cpu": round(cpu_s / max(1, records) * 1e6, 3),
            "pg_recovery_s": round(recovery_s, 2),
            "ratio": round(wall_s / recovery_s, 2),
            "ratio_cpu": round(cpu_s / recovery_s, 2),
            "runs": runs,
            "loadavg": [round(load0, 1), round(os.getloadavg()[0], 1)],
        })


def run(args: argparse.Namespace) -> int:
    if args.from_file is not None:
        if args.plot is None:
            raise SystemExit("pagestore bench bulk-ingest: --from needs --plot")
        plot([json.loads(x) for x in args.from_file.read_text().splitlines() if x.startswith("{")], args.plot)
        return 0
    emitted: list[dict[str, Any]] = []
    code = _run(args, emitted)
    if args.plot is not None:
        plot(emitted, args.plot)
    return code


def _run(args: argparse.Namespace, emitted: list[dict[str, Any]]) -> int:
    base = args.dir or Path("/tmp")
    root = Path(tempfile.mkdtemp(prefix="bench-bulk-ingest-", dir=base))
    os.chmod(root, 0o755)
    pg: PostgresInstance | None = None
    try:
        trio.run(run_initdb, root / "init")
        pg, start, end, (recovery_s, split) = _prepare(root, args)
        redo_s, server_s, redo_mb = split["pg_redo_s"], split["pg_server_s"], split["pg_redo_mb"]
        if redo_mb is not None and redo_mb < 0.9 * (end - start) / MB:
            _emit({"note": f"PostgreSQL replayed {redo_mb} of the load's {(end - start) / MB:.1f} MB of WAL "
                           "(checkpoints during the load): ratio and ratio_durable compare different "
                           "amounts of WAL, ratio_redo (per MB) does not"})
        configs = [(w, i) for i in _impls(args.impl) for w in _l0_writers(args.l0_writer)]
        runs: dict[tuple[str, str | None], list[dict[str, Any]]] = {c: [] for c in configs}
        for round_no in range(max(1, args.rounds)):
            for writer, impl in configs:
                tenant_dir = f"tenant-{writer}-{impl}-{round_no}"
                result = _ingest_in(impl, root, pg, end, args, writer, tenant_dir)
                shutil.rmtree(root / tenant_dir, ignore_errors=True)
                result = {
                    "bench": "bulk_ingest",
                    "wal_mb": round((end - start) / MB, 1),
                    "pg_recovery_s": round(recovery_s, 2),
                    "pg_us_per_record": round(recovery_s / max(1, result["records"]) * 1e6, 3),
                    **split,
                    **result,
                    "ratio": round(result["ingest_s"] / recovery_s, 2),
                    "ratio_durable": round(result["durable_s"] / server_s, 2) if server_s else None,
                    "ratio_redo": (
                        round((result["ingest_s"] / ((end - parse_lsn(result["ingest_start"])) / MB))
                              / (redo_s / redo_mb), 2) if redo_s and redo_mb else None
                    ),
                    "io_engine": args.io_engine,
                    "round": round_no,
                }
                runs[writer, impl].append(result)
                emitted.append(result)
                _emit(result)
        if args.floor_runs > 0 and args.workload == "regress":
            _emit({"note": "floors skipped: they read the whole WAL into memory (--workload insert only)"})
        elif args.floor_runs > 0:
            first = runs[configs[0]][0]
            _floors(root, parse_lsn(first["ingest_start"]), end, recovery_s, args.floor_runs)
        for (name, _impl), results in runs.items():
            summary: dict[str, Any] = {"bench": "bulk_ingest_summary", "impl": results[0]["impl"],
                                       "l0_writer": name, "runs": len(results),
                                       "pg_recovery_s": round(recovery_s, 2), **split}
            for field in ("ingest_s", "ingest_cpu_s", "us_per_record_cpu",
                          "l0_worker_cpu_s", "l0_worker_cpu_final_s", "background_flush_wait_s",
                          "flush_s", "durable_s", "ratio"):
                summary[field] = round(statistics.median(r[field] for r in results), 3)
            for field, known in (("ratio_durable", server_s), ("ratio_redo", redo_s)):
                if known:
                    summary[field] = round(statistics.median(r[field] for r in results), 3)
            summary["loadavg"] = [r["loadavg"] for r in results]
            _emit(summary)
    finally:
        if pg is not None:
            pg.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)
    return 0
