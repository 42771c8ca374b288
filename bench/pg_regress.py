"""``pagestore verify pg-regress``: PostgreSQL's own regression suite as the test of ingest and redo.

The suite (``src/test/regress`` of the installed postgresql-15's Debian source, and its C
modules built with PGXS: ``scripts/setup-pg-regress`` puts both in ``.cache/pg-regress``) runs
its whole ``parallel_schedule`` twice, at the same time:

- against a primary endpoint of a fresh local cluster (one pageserver with ``validate_redo``
  on, safekeepers, the walproposer bridge), ``lazy`` by default (its relation files are its
  page filesystem over the page service; ``--storage full`` for a copy of them), with
  ``wal_consistency_checking = all`` so that every record carries the image PostgreSQL's own
  redo would be checked against;
- against a plain PostgreSQL of the same build (initdb, same settings but no standby).

The source may be older than the installed binaries, so some expected outputs may differ:
what must hold is that both sides fail the same tests.

Then, on the endpoint, autovacuum off and a CHECKPOINT at the insert LSN L. The oracle is
PostgreSQL's own files: a lazy endpoint's are the pageserver's pages (or its cache's), so
there they are those of the reference standby (``bench.standby``: PostgreSQL's redo of the
endpoint's WAL, streamed from the endpoint itself, not through pagestore; started from the
data directory the endpoint started from), replayed to L and restartpointed; a full
endpoint's are its own, with the standby as the reference for what redo cannot rebuild.
What the standby's files hold that a primary's would not, and back:

- the same WAL, from the endpoint's walsender: a record lost or changed on pagestore's way
  (walproposer, safekeepers, the pageserver's ingest) shows as a difference;
- what PostgreSQL does not WAL-log it lacks: pages extended without WAL past the logged end,
  hint bits (masked either way), FSM contents (not compared), the nextval cache (it holds the
  logged tuple, as the pageserver does), VM bits in the hole of a standard full-page image;
  those are exactly the bits no redo can rebuild, so the pageserver must equal it there too;
- unlogged relations only as init forks (only they are compared either way);
- a fork PostgreSQL created without WAL (a VM or FSM fork never logged) it does not have, so
  the comparison does not ask for it; the forks the catalogs name are all there.

Every page of every relation fork (base/, global/, pg_tblspc/) is asked for
through pagestream GetPage@L and compared with the file's page, masked as the resource
manager's ``rm_mask`` (``bench.oracle.compare_snapshot``: FSM not compared, pages past the
pageserver's end must be new, sequences compared on what ``nextval`` WAL-logs). The pageserver's
``validate_redo`` counters say how many replayed pages were checked against PostgreSQL's
verification images, and how many differed. Last, a branch at L boots from its basebackup and
must answer a catalog query over the ``regression`` database exactly as the endpoint does.

It prints JSON lines while it runs and a summary line at the end: tests passed and failed on
both sides, pages compared / equal / unreadable / different by access method, the reasons of
unreadable pages, validation checks and failures, and the branch check.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import psycopg
import trio

from bench.oracle import Snapshot, SnapshotResult, catalog_rels, compare_snapshot, oracle_cluster
from bench.standby import Standby
from compute import postgres
from compute.page_client import PageClient
from control_plane import cluster, endpoint
from control_plane.local_env import LocalEnv
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn, format_lsn, parse_lsn

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "pg-regress"
PG_REGRESS = Path("/usr/lib/postgresql/15/lib/pgxs/src/test/regress/pg_regress")
SUITE_FILES = ("sql", "expected", "data", "parallel_schedule", "resultmap")
_RESULT = re.compile(r"^(?:test\s+|\s+)(\S+)\s+\.\.\.\s+(ok|FAILED|failed \(ignored\))", re.M)

# Compared between the endpoint and the branch booted from its basebackup: every relation,
# attribute, function and type of the regression database, as one digest each.
CATALOG_QUERY = """
SELECT (SELECT count(*) || ' ' || md5(string_agg(concat_ws(' ', oid, relname, relnamespace, relkind,
            relam, relfilenode, reltablespace, relnatts, relpersistence), ',' ORDER BY oid)) FROM pg_class),
       (SELECT count(*) || ' ' || md5(string_agg(concat_ws(' ', attrelid, attnum, attname, atttypid,
            attnotnull, attisdropped), ',' ORDER BY attrelid, attnum)) FROM pg_attribute),
       (SELECT count(*) || ' ' || md5(string_agg(concat_ws(' ', oid, proname, prorettype, prosrc),
            ',' ORDER BY oid)) FROM pg_proc),
       (SELECT count(*) || ' ' || md5(string_agg(concat_ws(' ', oid, typname, typtype, typrelid),
            ',' ORDER BY oid)) FROM pg_type),
       (SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid)
"""


class PgRegressError(RuntimeError):
    """The suite could not be run (not set up, a server did not start); the message says why."""


def suite_dir() -> tuple[Path, Path]:
    """(``src/test/regress`` of the source, the directory with regress.so, autoinc.so, refint.so)."""
    src, lib = CACHE / "src" / "src" / "test" / "regress", CACHE / "lib"
    if not (CACHE / "READY").exists() or not (lib / "regress.so").exists() or not (src / "parallel_schedule").exists():
        raise PgRegressError(f"PostgreSQL's regression suite is not set up in {CACHE}: run ./scripts/setup")
    if not PG_REGRESS.exists():
        raise PgRegressError(f"{PG_REGRESS} not found: install postgresql-15 (./scripts/setup does)")
    return src, lib


def stage_suite(dest: Path) -> Path:
    """A copy of the suite's inputs and modules the postgres user owns (the server reads the
    data files and writes results under it): ``dest/suite`` with ``lib/`` inside."""
    src, lib = suite_dir()
    stage = dest / "suite"
    stage.mkdir(parents=True)
    for name in SUITE_FILES:
        (shutil.copytree if (src / name).is_dir() else shutil.copy)(src / name, stage / name)
    shutil.copytree(lib, stage / "lib")
    postgres.chown_to_postgres(dest)
    return stage


@attrs.define
class RegressRun:
    """One run of a schedule: which tests passed and failed, pg_regress's exit code."""

    side: str
    passed: list[str] = attrs.field(factory=list)
    failed: list[str] = attrs.field(factory=list)
    returncode: int | None = None
    seconds: float = 0.0
    outdir: Path = Path()
    output: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"side": self.side, "passed": len(self.passed), "failed": sorted(self.failed),
                "returncode": self.returncode, "seconds": self.seconds}


def parse_results(output: str) -> tuple[list[str], list[str]]:
    """(passed, failed) test names from pg_regress's output (an ignored failure counts as failed)."""
    passed: list[str] = []
    failed: list[str] = []
    for name, verdict in _RESULT.findall(output):
        (passed if verdict == "ok" else failed).append(name)
    return passed, failed


class ScheduleRunner:
    """pg_regress over one server, started in the background (both sides run at once)."""

    def __init__(self, side: str, stage: Path, port: int, schedule: Path) -> None:
        self.run = RegressRun(side, outdir=stage.parent / f"out-{side}")
        postgres.make_postgres_dir(self.run.outdir)
        cmd = [str(PG_REGRESS), f"--inputdir={stage}", f"--outputdir={self.run.outdir}",
               f"--bindir={postgres.PG_BIN}", f"--dlpath={stage / 'lib'}", f"--schedule={schedule}",
               "--host=127.0.0.1", f"--port={port}", f"--user={postgres.PG_USER}"]
        self.log = self.run.outdir / "pg_regress.log"
        self._log_f = open(self.log, "wb")  # noqa: SIM115 - closed in wait()
        self._started = time.monotonic()
        full = ["runuser", "-u", postgres.PG_USER, "--", *cmd] if _is_root() else cmd
        self.proc = subprocess.Popen(full, stdout=self._log_f, stderr=subprocess.STDOUT, cwd=self.run.outdir)

    def poll(self) -> bool:
        """True once pg_regress has exited (its end time taken then)."""
        if self.run.returncode is None:
            rc = self.proc.poll()
            if rc is None:
                return False
            self.run.returncode = rc
            self.run.seconds = round(time.monotonic() - self._started, 1)
        return True

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log_f.close()

    def finish(self) -> RegressRun:
        self._log_f.close()
        self.run.output = self.log.read_text(errors="replace")
        self.run.passed, self.run.failed = parse_results(self.run.output)
        if not self.run.passed and not self.run.failed:
            raise PgRegressError(f"pg_regress on the {self.run.side} side ran no test (exit "
                                 f"{self.run.returncode}):\n{self.run.output[-3000:]}")
        return self.run


def wait_all(runners: list[ScheduleRunner], timeout: float) -> list[RegressRun]:
    """Wait for every run (each one's time is its own), killing all after ``timeout``."""
    deadline = time.monotonic() + timeout
    try:
        while sum(r.poll() for r in runners) < len(runners):  # every one polled: each notes its own end
            if time.monotonic() > deadline:
                late = [r.run.side for r in runners if not r.poll()]
                raise PgRegressError(f"pg_regress on the {' and '.join(late)} side did not finish in "
                                     f"{timeout:.0f} s")
            time.sleep(0.2)
    finally:
        for r in runners:
            r.kill()
    return [r.finish() for r in runners]


def _is_root() -> bool:
    return os.geteuid() == 0


@attrs.frozen
class PgRegressOptions:
    workdir: Path  # a directory the postgres user can traverse; the cluster and the runs go here
    schedule: str = "parallel_schedule"  # a schedule file of the suite
    safekeepers: int = 1
    consistency_checking: bool = True
    # Full-page images compressed: wal_consistency_checking puts one on every block of every
    # record (~10 GB of WAL for the suite uncompressed, ~2 GB with zstd), and it exercises the
    # decompression of images on the way.
    wal_compression: str = "zstd"
    plain: bool = True  # also run the schedule against a plain PostgreSQL
    storage: str = "lazy"  # the endpoint's: lazy (the standby's files are the oracle) or full
    standby: bool = True  # PostgreSQL's own redo of the endpoint's WAL, the reference for VM bits
    branch_check: bool = True
    timeout_s: float = 1800.0


@attrs.define
class PgRegressResult:
    endpoint_run: RegressRun | None = None
    plain_run: RegressRun | None = None
    lsn: str = ""
    pages: SnapshotResult | None = None
    validation: dict[str, float] = attrs.field(factory=dict)
    branch_catalog: list[str] | None = None
    main_catalog: list[str] | None = None
    seconds: float = 0.0
    storage: str = "lazy"

    def summary(self) -> dict[str, Any]:
        pages = self.pages
        out: dict[str, Any] = {"lsn": self.lsn, "storage": self.storage,
                               "oracle": "endpoint files" if self.storage == "full" else "standby files"}
        ep, plain = self.endpoint_run, self.plain_run
        out["tests"] = {
            "pagestore": {"passed": len(ep.passed), "failed": sorted(ep.failed)} if ep else None,
            "postgres": {"passed": len(plain.passed), "failed": sorted(plain.failed)} if plain else None,
            "same_failures": (set(ep.failed) == set(plain.failed)) if ep and plain else None,
        }
        if pages is not None:
            kinds = sorted(set(pages.pages) | set(pages.unreadable) | set(pages.different))
            out["pages"] = {
                "compared": sum(pages.pages.values()), "equal": sum(pages.equal.values()),
                "unreadable": sum(pages.unreadable.values()), "different": sum(pages.different.values()),
                "by_am": {k: {"compared": pages.pages[k], "equal": pages.equal[k],
                              "unreadable": pages.unreadable[k], "different": pages.different[k]}
                          for k in kinds},
                "unreadable_reasons": dict(pages.unreadable_reasons.most_common(20)),
                "forks": pages.forks, "fsm_pages": pages.fsm_pages,
                "vm_bits_lost_as_postgres": pages.vm_bits_lost_as_postgres,
                "spgist_meta_as_postgres": pages.spgist_meta_as_postgres,
                "other_mismatches": len(pages.mismatches) - sum(pages.unreadable.values())
                - sum(pages.different.values()),
            }
        out["validation"] = {
            "checks": self.validation.get("pageserver_walredo_validation_checks_total"),
            "mismatches": self.validation.get("pageserver_walredo_validation_failures_total"),
        }
        if self.branch_catalog is not None:
            out["branch"] = {"catalog_equal": self.branch_catalog == self.main_catalog}
        out["seconds"] = self.seconds
        return out

    def ok(self) -> bool:
        s = self.summary()
        p = s.get("pages") or {}
        return bool(s["tests"]["same_failures"] is not False and p.get("compared")
                    and p["unreadable"] == 0 and p["different"] == 0 and p["other_mismatches"] == 0
                    and s["validation"]["mismatches"] == 0
                    and (self.branch_catalog is None or self.branch_catalog == self.main_catalog))


class PgRegress:
    def __init__(self, opts: PgRegressOptions, emit: Callable[[dict[str, Any]], None]) -> None:
        self.opts = opts
        self.emit = emit
        self.result = PgRegressResult(storage=opts.storage)
        self.env: LocalEnv | None = None
        self.tenant = self.timeline = ""
        self.port = 0
        self.pgdata = Path()
        self.standby: Standby | None = None

    def dsn(self, db: str = "postgres", port: int | None = None) -> str:
        return f"host=127.0.0.1 port={port or self.port} user={postgres.PG_USER} dbname={db}"

    @contextmanager
    def cluster(self) -> Iterator[LocalEnv]:
        with oracle_cluster(self.opts.workdir / "cluster", self.opts.safekeepers, self.opts.storage) as oc:
            self.env, self.tenant, self.timeline = oc.env, oc.tenant, oc.timeline
            self.port, self.pgdata = oc.port, oc.pgdata
            yield oc.env

    @contextmanager
    def plain_postgres(self) -> Iterator[postgres.PostgresInstance | None]:
        if not self.opts.plain:
            yield None
            return
        pg = postgres.PostgresInstance.create(self.opts.workdir / "plain", settings={
            "wal_level": "replica", "shared_buffers": "128MB", "fsync": "off",
            "log_line_prefix": "%m [%p] "})
        pg.start()
        try:
            yield pg
        finally:
            pg.stop("immediate")

    def run(self) -> PgRegressResult:
        if self.opts.storage == "lazy" and not self.opts.standby:
            raise PgRegressError("a lazy endpoint's files are the pageserver's own pages, no oracle: the "
                                 "comparison needs the reference standby (or --storage full)")
        started = time.monotonic()
        stage = stage_suite(self.opts.workdir)
        schedule = stage / self.opts.schedule
        with self.cluster(), self.plain_postgres() as plain:
            with psycopg.connect(self.dsn(), autocommit=True) as conn:
                wcc = "all" if self.opts.consistency_checking else ""
                conn.execute(f"ALTER SYSTEM SET wal_consistency_checking = '{wcc}'")
                conn.execute(f"ALTER SYSTEM SET wal_compression = '{self.opts.wal_compression}'")
                conn.execute("SELECT pg_reload_conf()")
            if self.opts.standby:
                self.standby = self.start_standby()
            try:
                snap = self.run_suite_and_compare(stage, schedule, plain)
            finally:  # also when a step fails: no standby is left running
                if self.standby is not None:
                    self.standby.stop()
            if self.opts.branch_check:
                self.branch_check(snap.lsn)
        self.result.seconds = round(time.monotonic() - started, 1)
        return self.result

    def start_standby(self) -> Standby:
        """PostgreSQL's own redo of the endpoint's WAL: ``pg_basebackup`` of a full endpoint; a
        lazy one's links to its page filesystem are what pg_basebackup skips, so its standby
        starts from the full basebackup of the endpoint's own start LSN."""
        assert self.env is not None
        if self.opts.storage == "full":
            return Standby.start(self.opts.workdir / "standby", self.port)
        lsn = parse_lsn(endpoint.load_endpoint(self.env, "main").spec.basebackup_lsn)
        tar = self.opts.workdir / "standby.tar"
        endpoint.fetch_basebackup(self.env, self.tenant, self.timeline, lsn, tar)
        try:
            return Standby.start(self.opts.workdir / "standby", self.port, from_tar=tar)
        finally:
            tar.unlink()

    def run_suite_and_compare(self, stage: Path, schedule: Path,
                              plain: postgres.PostgresInstance | None) -> Snapshot:
        runners = [ScheduleRunner("pagestore", stage, self.port, schedule)]
        if plain is not None:
            runners.append(ScheduleRunner("postgres", stage, plain.port, schedule))
        self.emit({"phase": "pg_regress", "schedule": self.opts.schedule,
                   "sides": [r.run.side for r in runners]})
        runs = wait_all(runners, self.opts.timeout_s)
        for r in runs:
            self.emit(r.as_json())
        self.result.endpoint_run = runs[0]
        self.result.plain_run = runs[1] if len(runs) > 1 else None
        snap = self.quiesce_and_checkpoint()
        self.result.lsn = format_lsn(snap.lsn)
        trio.run(self.compare, snap)
        return snap

    def quiesce_and_checkpoint(self) -> Snapshot:
        """Autovacuum off and idle, the catalogs read, CHECKPOINT: the files equal the WAL to L."""
        assert self.env is not None
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET autovacuum = off")
            conn.execute("SELECT pg_reload_conf()")
            deadline = time.monotonic() + 120
            while _busy_backends(conn):
                if time.monotonic() > deadline:
                    raise PgRegressError("autovacuum workers or client sessions still running 120 s after the suite")
                time.sleep(0.2)
            conn.execute("ALTER DATABASE template0 ALLOW_CONNECTIONS true")  # to read its pg_class
            rels = catalog_rels(self.dsn)  # before the CHECKPOINT: catalog reads may prune pages
            conn.execute("ALTER DATABASE template0 ALLOW_CONNECTIONS false")
            conn.execute("CHECKPOINT")
            row = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()
            assert row is not None
            lsn = parse_lsn(str(row[0]))
        t0 = time.monotonic()
        wait_for_ingest(self.env, self.tenant, self.timeline, lsn, timeout=self.opts.timeout_s)
        self.emit({"checkpoint": format_lsn(lsn), "relations": len(rels),
                   "ingest_wait_s": round(time.monotonic() - t0, 1)})
        reference = None
        if self.standby is not None:
            t0 = time.monotonic()
            self.standby.replay_to(lsn, timeout=self.opts.timeout_s)
            reference = self.standby.root
            self.emit({"standby_replayed": format_lsn(lsn), "wait_s": round(time.monotonic() - t0, 1)})
        # a lazy endpoint's files are the pageserver's: the standby's are PostgreSQL's own
        root = self.pgdata if self.opts.storage == "full" else reference
        assert root is not None
        return Snapshot("pg-regress", lsn, root, rels, latest=False, reference=reference)

    async def compare(self, snap: Snapshot) -> None:
        assert self.env is not None
        async with await PageClient.connect("127.0.0.1", self.env.config.pageserver.pg,
                                            TenantId.parse(self.tenant), TimelineId.parse(self.timeline),
                                            **self.env.page_client_auth(self.tenant)) as client:
            res = await compare_snapshot(client, snap)
        self.result.pages = res
        out = res.as_json()
        out["first_mismatches"] = res.mismatches[:10]
        self.emit(out)
        self.result.validation = await trio.to_thread.run_sync(self.validation_counts)

    def validation_counts(self) -> dict[str, float]:
        assert self.env is not None
        with urllib.request.urlopen(f"{self.env.pageserver_http}/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("pageserver_walredo_validation_") and "_total " in line:
                name, value = line.split()
                out[name] = float(value)
        return out

    def branch_check(self, lsn: Lsn) -> None:
        """A branch at ``lsn`` boots from its basebackup and shows the same catalogs."""
        assert self.env is not None
        quiet: Callable[[str], None] = lambda _msg: None  # noqa: E731
        self.result.main_catalog = catalog_digest(self.dsn("regression"))
        t0 = time.monotonic()
        cluster.branch(self.env, self.tenant, "regress-branch", "main", format_lsn(lsn))
        try:
            ep = endpoint.start_endpoint(self.env, "branch", branch="regress-branch", log=quiet)
        except Exception as exc:
            self.result.branch_catalog = [f"the branch did not boot: {exc}"]
            self.emit({"branch": "failed to boot", "error": str(exc)[:2000]})
            return
        try:
            self.result.branch_catalog = catalog_digest(self.dsn("regression", ep.spec.port))
        finally:
            endpoint.stop_endpoint(self.env, "branch", mode="immediate", log=quiet)
        self.emit({"branch": format_lsn(lsn), "boot_and_query_s": round(time.monotonic() - t0, 1),
                   "catalog_equal": self.result.branch_catalog == self.result.main_catalog,
                   "main": self.result.main_catalog, "branch_catalog": self.result.branch_catalog})


def wait_for_ingest(env: LocalEnv, tenant: str, timeline: str, lsn: Lsn, timeout: float) -> None:
    """``cluster.wait_for_lsn`` that outlives a slow answer: a pageserver busy ingesting the
    suite's WAL may not answer one status request in time; only the deadline ends the wait."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            cluster.wait_for_lsn(env, tenant, timeline, lsn, timeout=max(1.0, deadline - time.monotonic()))
            return
        except cluster.ClusterError as exc:
            if time.monotonic() > deadline or "timed out" not in str(exc):
                raise
            time.sleep(1)


def catalog_digest(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(CATALOG_QUERY).fetchone()
    assert row is not None
    return [str(v) for v in row]


def _busy_backends(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND "
                       "(backend_type = 'autovacuum worker' OR (backend_type = 'client backend' "
                       "AND state <> 'idle'))").fetchone()
    return int(row[0]) if row else 0


def run_pg_regress(opts: PgRegressOptions, emit: Callable[[dict[str, Any]], None] | None = None) -> PgRegressResult:
    return PgRegress(opts, emit or (lambda d: print(json.dumps(d), flush=True))).run()


# -- CLI -------------------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schedule", default="parallel_schedule",
                        help="schedule file of src/test/regress (default parallel_schedule)")
    parser.add_argument("--safekeepers", type=int, default=1, help="safekeepers of the cluster (default 1)")
    parser.add_argument("--no-plain", action="store_true",
                        help="do not run the schedule against a plain PostgreSQL too")
    parser.add_argument("--no-branch", action="store_true", help="skip the branch boot check")
    parser.add_argument("--storage", choices=["lazy", "full"], default="lazy",
                        help="the endpoint's storage (default lazy: the reference standby's files are then "
                             "the oracle; full: the endpoint's own files)")
    parser.add_argument("--no-standby", action="store_true",
                        help="no reference standby (VM pages with bits PostgreSQL's redo loses then differ)")
    parser.add_argument("--no-consistency-checking", action="store_true",
                        help="the endpoint without wal_consistency_checking (no redo validation)")
    parser.add_argument("--wal-compression", default="zstd",
                        help="the endpoint's wal_compression (default zstd; off, pglz, lz4, zstd)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the throwaway cluster and runs live (default: a new directory in /tmp)")


def run(args: argparse.Namespace) -> int:
    with postgres.postgres_tmpdir("pagestore-pg-regress-") as base:
        workdir = args.workdir or base
        postgres.make_postgres_dir(workdir)
        opts = PgRegressOptions(workdir=workdir, schedule=args.schedule, safekeepers=args.safekeepers,
                                consistency_checking=not args.no_consistency_checking,
                                wal_compression=args.wal_compression,
                                plain=not args.no_plain, branch_check=not args.no_branch, storage=args.storage,
                                standby=not args.no_standby)
        try:
            result = run_pg_regress(opts)
        except PgRegressError as exc:
            print(f"pagestore verify pg-regress: {exc}", file=sys.stderr)
            return 2
        summary = result.summary()
        summary["result"] = "ok" if result.ok() else "FAIL"
        print(json.dumps(summary), flush=True)
        if result.pages is not None:
            for m in result.pages.mismatches[:50]:
                print(f"MISMATCH {m}", file=sys.stderr)
        ep, plain = result.endpoint_run, result.plain_run
        only_ep = sorted(set(ep.failed) - set(plain.failed if plain else ())) if ep else []
        if ep is not None and only_ep:
            diffs = ep.outdir / "regression.diffs"
            print(f"failed on the endpoint only: {' '.join(only_ep)}", file=sys.stderr)
            if diffs.exists():
                print(diffs.read_text(errors="replace")[:20000], file=sys.stderr)
    return 0 if result.ok() else 1

