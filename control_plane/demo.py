"""``pagestore demo``: the main job, end to end, on a fresh local cluster.

Steps (each one timed; the first that fails ends the demo with its name and the error):

1. init a cluster directory and start one pageserver and three safekeepers;
2. create a tenant (its first timeline, branch ``main``, is an initdb imported by the pageserver);
3. start endpoint ``main``: a vanilla PostgreSQL 15 booted from the pageserver's basebackup, its
   WAL pushed to the safekeepers by the walproposer bridge (synchronous: commits need a quorum);
4. ``pgbench -i -s 5``;
5. ``pgbench`` for 20 s with a progress bar; half way, under a lock that holds writers of
   ``pgbench_accounts`` and ``pgbench_history`` for a moment, read ``sum(abalance)``,
   ``count(*)`` and the WAL insert LSN in one transaction: the data as of that LSN;
6. branch ``half`` at that LSN (copies nothing);
7. start endpoint ``half`` on the branch and check it returns exactly those two numbers, while
   ``main`` has moved on;
8. start a read-only endpoint on ``main`` at an LSN noted (the same way) a quarter of the way
   into the run, and check it sees exactly the data of then;
9. read pages of ``pgbench_accounts`` and its index through pagestream from the pageserver and
   compare them, masked as PostgreSQL's ``wal_consistency_checking`` masks them, with the blocks
   in ``main``'s own data files after a CHECKPOINT;
10. print a summary; leave the cluster running (or stop it with ``--stop``).

Nothing is faked: every number printed was read from a PostgreSQL or the pageserver.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import trio
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from common.auth import Scope
from compute import postgres
from compute.page_client import PageClient
from control_plane import cluster, endpoint
from control_plane.local_env import LocalEnv, LocalEnvError, default_workdir, plan_ports
from pageserver.basebackup import read_datadir_block
from pageserver.pgdatadir import BLCKSZ, DEFAULTTABLESPACE_OID
from pageserver.walredo.mask import MaskFn, btree_mask, heap_mask, masked
from protocol.ids import TenantId, TimelineId
from protocol.lsn import format_lsn, parse_lsn
from protocol.pagestream import RelTag

DEMO_MARKER = ".pagestore-demo"


class DemoFailed(Exception):
    def __init__(self, step: str, error: BaseException | str) -> None:
        super().__init__(f"step '{step}': {error}")
        self.step = step


@attrs.frozen(kw_only=True)
class DemoOptions:
    workdir: Path
    scale: int = 5
    duration_s: int = 20
    clients: int = 4
    port_offset: int = 0
    free_ports: bool = False
    stop_at_end: bool = False
    safekeepers: int = 3
    auth: bool = True
    tls: bool = False
    # The branch and read-only endpoints; main stays full: the page check compares the
    # pageserver's pages with files PostgreSQL wrote itself.
    storage: str = "lazy"


@attrs.define
class Snapshot:
    lsn: str
    sum_abalance: int
    history_count: int


@attrs.define
class PageCheck:
    relation: str
    blkno: int
    equal: bool
    differing_bytes: int


@attrs.define
class DemoResult:
    workdir: str
    tenant_id: str = ""
    main_timeline_id: str = ""
    branch_timeline_id: str = ""
    after_init: Snapshot | None = None
    quarter_way: Snapshot | None = None
    half_way: Snapshot | None = None
    main_at_end: Snapshot | None = None
    branch_sees: Snapshot | None = None
    read_only_sees: Snapshot | None = None
    tps: float | None = None
    transactions: int | None = None
    pages: list[PageCheck] = attrs.field(factory=list)
    steps: list[tuple[str, float]] = attrs.field(factory=list)
    endpoints: dict[str, str] = attrs.field(factory=dict)


def _as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", postgres.PG_USER, "--", *cmd] if os.geteuid() == 0 else cmd


class Demo:
    def __init__(self, opts: DemoOptions, console: Console) -> None:
        self.opts = opts
        self.console = console
        self.result = DemoResult(workdir=str(opts.workdir.absolute()))
        self.env: LocalEnv | None = None

    # -- plumbing -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        self.console.print(f"[bold cyan]▶[/] {name}", soft_wrap=True)
        started = time.monotonic()
        try:
            yield
        except DemoFailed:
            raise
        except Exception as exc:
            raise DemoFailed(name, exc) from exc
        took = time.monotonic() - started
        self.result.steps.append((name, took))
        self.console.print(f"  [green]✓[/] {name} [dim]({took:.1f} s)[/]", soft_wrap=True)

    def say(self, text: str) -> None:
        self.console.print(f"    {text}", highlight=False, soft_wrap=True)

    def log(self, text: str) -> None:
        self.console.print(f"    [dim]{text}[/]", highlight=False, soft_wrap=True)

    def pg(self, name: str) -> postgres.PostgresInstance:
        assert self.env is not None
        return endpoint.load_endpoint(self.env, name).instance()

    def snapshot(self, name: str, *, locked: bool) -> Snapshot:
        """sum(abalance), count(history) and an LSN at which exactly that data is visible.

        ``locked``: take EXCLUSIVE locks first (readers go on, writers wait a moment), so every
        transaction that changed the tables has committed before the LSN is read and none can
        commit until after it."""
        lock = "LOCK TABLE pgbench_accounts, pgbench_history IN EXCLUSIVE MODE; " if locked else ""
        out = self.pg(name).psql(
            f"BEGIN; {lock}SELECT (SELECT sum(abalance) FROM pgbench_accounts), "
            "(SELECT count(*) FROM pgbench_history), pg_current_wal_insert_lsn(); COMMIT;"
        )
        total, count, lsn = out.strip().splitlines()[-1].split("|")
        return Snapshot(lsn=lsn, sum_abalance=int(total), history_count=int(count))

    def counts(self, name: str) -> Snapshot:
        out = self.pg(name).psql(
            "SELECT (SELECT sum(abalance) FROM pgbench_accounts), (SELECT count(*) FROM pgbench_history), "
            "CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_insert_lsn() END"
        )
        total, count, lsn = out.strip().split("|")
        return Snapshot(lsn=lsn, sum_abalance=int(total), history_count=int(count))

    # -- the steps ------------------------------------------------------------------------------

    def run(self) -> DemoResult:
        opts = self.opts
        with self.step("initialize the cluster directory"):
            self.env = self._init()
            self.say(f"{self.env.workdir}: 1 pageserver (libpq {self.env.config.pageserver.pg}, HTTP "
                     f"{self.env.config.pageserver.http}), {opts.safekeepers} safekeepers")
        env = self.env
        with self.step("start the pageserver and the safekeepers"):
            cluster.start(env, log=self.log)
        with self.step("create a tenant (initdb imported as branch main)"):
            t = cluster.create_tenant(env, None, None, set_default=True)
            self.result.tenant_id = t["tenant_id"]
            self.result.main_timeline_id = t["timeline_id"]
            self.say(f"tenant {t['tenant_id']}, branch main = timeline {t['timeline_id']} at {t['last_record_lsn']}")
        if opts.auth:
            with self.step("tokens: the tenant's admitted by the pageserver, another tenant's refused"):
                self._check_tokens()
        with self.step("start endpoint main (PostgreSQL 15 + walproposer bridge, full storage)"):
            endpoint.start_endpoint(env, "main", branch="main", storage="full", log=self.log)
            self.result.endpoints["main"] = self._dsn("main")
            self.say(f"synchronous_standby_names = {self.pg('main').psql('SHOW synchronous_standby_names')}")
        with self.step(f"pgbench -i -s {opts.scale}"):
            started = time.monotonic()
            with self.console.status(f"loading {opts.scale * 100_000} rows into pgbench_accounts ..."):
                self.pg("main").pgbench("-i", "-s", str(opts.scale), "-q", timeout=1800)
            self.result.after_init = self.snapshot("main", locked=False)
            self.say(f"loaded in {time.monotonic() - started:.1f} s; WAL at {self.result.after_init.lsn}")
        with self.step(f"pgbench for {opts.duration_s} s ({opts.clients} clients), branch half way"):
            self._run_pgbench()
            self.result.main_at_end = self.counts("main")
            half = self.result.half_way
            assert half is not None
            self.say(f"{self.result.transactions} transactions, {self.result.tps:.0f} tps; half way at "
                     f"{half.lsn}: sum(abalance) = {half.sum_abalance}, history rows = {half.history_count}")
        with self.step("start endpoint half on the branch and compare with main at the branch LSN"):
            self._check_branch()
        with self.step("start a read-only endpoint on main as of the quarter-way LSN"):
            self._check_read_only()
        with self.step("read pages through pagestream and compare them with main's data files"):
            trio.run(self._compare_pages)
        self._summary()
        if opts.stop_at_end:
            with self.step("stop the cluster"):
                cluster.stop(env, log=self.log)
        return self.result

    def _check_tokens(self) -> None:
        """What a user does with a token: ``PGPASSWORD=$(pagestore token ...) psql ...``; psql
        runs ``basebackup`` on the pageserver's libpq port (the tar goes to /dev/null)."""
        assert self.env is not None
        env = self.env
        tenant, timeline = self.result.tenant_id, self.result.main_timeline_id
        ssl = f" sslmode=verify-full sslrootcert={env.ca_file}" if env.ca_file else ""
        dsn = f"host=localhost port={env.config.pageserver.pg} user=demo{ssl}"
        query = f"basebackup {tenant} {timeline}"

        def psql(token: str | None) -> subprocess.CompletedProcess[str]:
            env_vars = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PGCONNECT_TIMEOUT": "10"}
            if token is not None:
                env_vars["PGPASSWORD"] = token
            return subprocess.run([str(postgres.PG_BIN / "psql"), dsn, "-XAtq", "-o", "/dev/null",
                                   "-v", "VERBOSITY=verbose",
                                   "-c", query], capture_output=True, text=True, env=env_vars,
                                  timeout=60, check=False)

        cmd = _pagestore_command()
        wd = "" if env.workdir == default_workdir().absolute() else f" --workdir {env.workdir}"
        own = psql(env.token(Scope.TENANT, tenant, ttl_s=600))
        if own.returncode != 0:
            raise RuntimeError(f"the tenant's own token was refused: {own.stderr.strip()}")
        self.say(f"PGPASSWORD=$({cmd} token{wd} --tenant-id {tenant}) psql '{dsn}' -c '{query}' "
                 "-o /dev/null: admitted")
        other = psql(env.token(Scope.TENANT, "ff" * 16, ttl_s=600))
        if other.returncode == 0 or "28000" not in other.stderr:
            raise RuntimeError(f"another tenant's token was not refused: rc {other.returncode}, "
                               f"{other.stderr.strip()!r}")
        self.say(f"another tenant's token: refused ({other.stderr.strip().splitlines()[-1]})")
        nothing = psql(None)
        if nothing.returncode == 0:
            raise RuntimeError("a connection without a token was admitted")
        self.say("no token: refused")

    def _dsn(self, name: str) -> str:
        assert self.env is not None
        ep = endpoint.load_endpoint(self.env, name)
        self.say(f"endpoint {name}: {ep.spec.storage} storage, started in {ep.spec.start_seconds} s "
                 f"({', '.join(f'{k} {v:.2f}' for k, v in (ep.spec.start_phases or {}).items())})")
        return str(ep.describe()["dsn"])

    def _init(self) -> LocalEnv:
        workdir = self.opts.workdir.absolute()
        if workdir.exists() and any(workdir.iterdir()):
            if not (workdir / DEMO_MARKER).exists():
                raise LocalEnvError(
                    f"{workdir} exists and was not made by `pagestore demo`; pass --workdir DIR")
            # A previous demo's cluster: stop whatever still runs there, then start over.
            with contextlib.suppress(LocalEnvError):
                cluster.stop(LocalEnv.load(workdir), immediate=True, log=self.log)
            shutil.rmtree(workdir)
        cfg = plan_ports(self.opts.safekeepers, port_offset=self.opts.port_offset,
                         free_ports=self.opts.free_ports)
        cfg = attrs.evolve(cfg, auth=self.opts.auth, tls=self.opts.tls)
        env = LocalEnv.create(workdir, cfg)
        (workdir / DEMO_MARKER).write_text("made by pagestore demo; `pagestore demo` may delete it\n")
        return env

    def _run_pgbench(self) -> None:
        opts = self.opts
        pg = self.pg("main")
        cmd = _as_postgres([
            postgres.pg_binary("pgbench"), "-h", "127.0.0.1", "-p", str(pg.port), "-U", postgres.PG_USER,
            "-c", str(opts.clients), "-j", str(min(opts.clients, 2)), "-T", str(opts.duration_s),
            "-P", "1", "postgres",
        ])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        lines: queue.Queue[str] = queue.Queue()
        collected: list[str] = []

        def pump(stream: Any) -> None:
            for raw in stream:
                lines.put(raw.decode(errors="replace").rstrip())

        readers = [threading.Thread(target=pump, args=(s,), daemon=True) for s in (proc.stdout, proc.stderr)]
        for r in readers:
            r.start()
        half_at = opts.duration_s / 2
        progress = Progress(TextColumn("    pgbench"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} s"),
                            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=self.console,
                            transient=False)
        started = time.monotonic()
        tps = ""
        try:
            with progress:
                task = progress.add_task("pgbench", total=opts.duration_s, info="")
                while proc.poll() is None:
                    elapsed = time.monotonic() - started
                    while True:
                        try:
                            line = lines.get_nowait()
                        except queue.Empty:
                            break
                        collected.append(line)
                        if line.startswith("progress:"):
                            tps = line.split(",")[1].strip()
                    if self.result.quarter_way is None and elapsed >= half_at / 2:
                        self.result.quarter_way = self.snapshot("main", locked=True)
                        progress.console.print(
                            f"    [yellow]quarter way[/]: LSN {self.result.quarter_way.lsn} (for a read-only endpoint)",
                            highlight=False, soft_wrap=True)
                    if self.result.half_way is None and elapsed >= half_at:
                        self.result.half_way = self.snapshot("main", locked=True)
                        br = cluster.branch(self.env, None, "half", "main", self.result.half_way.lsn)  # type: ignore[arg-type]
                        self.result.branch_timeline_id = br["timeline_id"]
                        progress.console.print(
                            f"    [yellow]half way[/]: LSN {self.result.half_way.lsn}, branch half = timeline "
                            f"{br['timeline_id']}", highlight=False, soft_wrap=True)
                    progress.update(task, completed=min(elapsed, opts.duration_s), info=tps)
                    time.sleep(0.2)
                progress.update(task, completed=opts.duration_s)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        for r in readers:
            r.join(timeout=5)
        while not lines.empty():
            collected.append(lines.get_nowait())
        if proc.returncode != 0:
            raise RuntimeError(f"pgbench exited {proc.returncode}:\n" + "\n".join(collected[-20:]))
        if self.result.half_way is None or self.result.quarter_way is None:
            raise RuntimeError("pgbench ended before half way")
        for line in collected:
            if line.startswith("number of transactions actually processed:"):
                self.result.transactions = int(line.split(":")[1].split("/")[0])
            if line.startswith("tps ="):
                self.result.tps = float(line.split()[2])
        if not self.result.transactions or self.result.tps is None:
            raise RuntimeError("pgbench printed no totals:\n" + "\n".join(collected[-20:]))

    def _check_branch(self) -> None:
        assert self.env is not None
        half = self.result.half_way
        assert half is not None
        endpoint.start_endpoint(self.env, "half", branch="half", storage=self.opts.storage, log=self.log)
        self.result.endpoints["half"] = self._dsn("half")
        seen = self.counts("half")
        self.result.branch_sees = seen
        end = self.result.main_at_end
        assert end is not None
        self.say(f"main now:          sum(abalance) = {end.sum_abalance:>10}, history rows = {end.history_count}")
        self.say(f"main at {half.lsn:<10}: sum(abalance) = {half.sum_abalance:>10}, history rows = {half.history_count}")
        self.say(f"branch half:       sum(abalance) = {seen.sum_abalance:>10}, history rows = {seen.history_count}")
        if (seen.sum_abalance, seen.history_count) != (half.sum_abalance, half.history_count):
            raise RuntimeError(
                f"branch half shows sum(abalance)={seen.sum_abalance}, count={seen.history_count}; main had "
                f"sum(abalance)={half.sum_abalance}, count={half.history_count} at {half.lsn}")
        if (end.sum_abalance, end.history_count) == (half.sum_abalance, half.history_count):
            raise RuntimeError("main did not change after the branch point: the check would prove nothing")

    def _check_read_only(self) -> None:
        assert self.env is not None
        after = self.result.quarter_way
        assert after is not None
        endpoint.start_endpoint(self.env, "static", branch="main", lsn=after.lsn, storage=self.opts.storage,
                                log=self.log)
        self.result.endpoints["static"] = self._dsn("static")
        seen = self.counts("static")
        self.result.read_only_sees = seen
        self.say(f"static at {after.lsn}: sum(abalance) = {seen.sum_abalance}, history rows = {seen.history_count} "
                 f"(main had {after.sum_abalance}, {after.history_count})")
        if (seen.sum_abalance, seen.history_count) != (after.sum_abalance, after.history_count):
            raise RuntimeError(f"the read-only endpoint at {after.lsn} shows {seen}, main had {after}")
        half = self.result.half_way
        assert half is not None
        if (half.sum_abalance, half.history_count) == (after.sum_abalance, after.history_count):
            raise RuntimeError("main did not change between quarter and half way: the check would prove nothing")

    async def _compare_pages(self) -> None:
        pg = self.pg("main")
        # Autovacuum would change pages between our CHECKPOINT and reading the files; it is
        # switched off only for the comparison and restored whatever happens.
        await trio.to_thread.run_sync(pg.psql, "ALTER SYSTEM SET autovacuum = off")
        await trio.to_thread.run_sync(pg.psql, "SELECT pg_reload_conf()")
        try:
            await self._compare_pages_quiesced(pg)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(pg.psql, "ALTER SYSTEM RESET autovacuum")
                await trio.to_thread.run_sync(pg.psql, "SELECT pg_reload_conf()")

    async def _compare_pages_quiesced(self, pg: postgres.PostgresInstance) -> None:
        assert self.env is not None
        env = self.env
        deadline = time.monotonic() + 60
        while (await trio.to_thread.run_sync(
                pg.psql, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'")) != "0":
            if time.monotonic() > deadline:
                raise RuntimeError("autovacuum workers still running after 60 s")
            await trio.sleep(0.2)
        await trio.to_thread.run_sync(pg.psql, "CHECKPOINT")
        lsn = parse_lsn(await trio.to_thread.run_sync(pg.psql, "SELECT pg_current_wal_insert_lsn()"))
        tenant, timeline = self.result.tenant_id, self.result.main_timeline_id
        await trio.to_thread.run_sync(lambda: cluster.wait_for_lsn(env, tenant, timeline, lsn, timeout=120))
        ep = endpoint.load_endpoint(env, "main")
        relations: list[tuple[str, MaskFn]] = [("pgbench_accounts", heap_mask), ("pgbench_branches", heap_mask),
                                               ("pgbench_accounts_pkey", btree_mask)]
        async with await PageClient.connect(
            "127.0.0.1", env.config.pageserver.pg, TenantId.parse(tenant), TimelineId.parse(timeline),
            **env.page_client_auth(tenant),
        ) as client:
            for relname, mask in relations:
                path = await trio.to_thread.run_sync(pg.psql, f"SELECT pg_relation_filepath('{relname}')")
                parts = path.split("/")
                if len(parts) != 3 or parts[0] != "base":
                    raise RuntimeError(f"{relname} is at {path!r}, not base/<db>/<relfilenode>")
                rel = RelTag(DEFAULTTABLESPACE_OID, int(parts[1]), int(parts[2]), 0)
                file_blocks = sum(
                    (f.stat().st_size // BLCKSZ) for f in (ep.pgdata / "base" / parts[1]).glob(f"{parts[2]}*")
                    if f.name == parts[2] or (f.name.startswith(parts[2] + ".") and f.name[len(parts[2]) + 1:].isdigit())
                )
                nblocks = await client.nblocks(rel, lsn)
                if nblocks != file_blocks:
                    raise RuntimeError(f"{relname}: the pageserver has {nblocks} blocks at {format_lsn(lsn)}, "
                                       f"the data files {file_blocks}")
                blocks = sorted({0, 1, nblocks // 3, nblocks // 2, (2 * nblocks) // 3, nblocks - 1} & set(range(nblocks)))
                for blkno in blocks:
                    served = await client.get_page(rel, blkno, lsn)
                    local = read_datadir_block(ep.pgdata, rel, blkno)
                    a, b = masked(served, blkno, mask), masked(local, blkno, mask)
                    diff = sum(1 for x, y in zip(a, b, strict=True) if x != y)
                    self.result.pages.append(PageCheck(relname, blkno, diff == 0, diff))
        bad = [p for p in self.result.pages if not p.equal]
        self.say(f"{len(self.result.pages)} pages at {format_lsn(lsn)} compared: "
                 f"{len(self.result.pages) - len(bad)} equal after masking")
        if bad:
            raise RuntimeError("pages differ between the pageserver and main's data files: " + ", ".join(
                f"{p.relation} block {p.blkno} ({p.differing_bytes} bytes)" for p in bad))

    def _summary(self) -> None:
        r = self.result
        assert self.env is not None and r.half_way is not None and r.branch_sees is not None
        table = Table(title="pagestore demo: summary", show_lines=False)
        table.add_column("what")
        table.add_column("result", overflow="fold")
        table.add_row("pgbench", f"scale {self.opts.scale}, {self.opts.duration_s} s, {r.transactions} transactions, "
                      f"{r.tps:.0f} tps (every commit on a quorum of safekeepers)")
        table.add_row("branch point", f"{r.half_way.lsn} (branch half = timeline {r.branch_timeline_id})")
        table.add_row("main at branch point", f"sum(abalance) {r.half_way.sum_abalance}, history {r.half_way.history_count}")
        table.add_row("branch half sees", f"sum(abalance) {r.branch_sees.sum_abalance}, history {r.branch_sees.history_count}  ✓ equal")
        if r.read_only_sees and r.quarter_way:
            table.add_row("read-only endpoint", f"at {r.quarter_way.lsn}: sum(abalance) {r.read_only_sees.sum_abalance}, "
                          f"history {r.read_only_sees.history_count}  ✓ equal to main then")
        table.add_row("pagestream", f"{sum(p.equal for p in r.pages)}/{len(r.pages)} pages equal to main's files (masked)")
        for name, dsn in r.endpoints.items():
            table.add_row(f"endpoint {name}", dsn)
        self.console.print(table)
        cmd = _pagestore_command()
        wd = "" if self.env.workdir == default_workdir().absolute() else f" --workdir {self.env.workdir}"
        if not self.opts.stop_at_end:
            self.console.print(
                "The cluster keeps running. Explore it with:\n"
                f"  {cmd} status{wd}\n"
                f"  {cmd} timeline list{wd}\n"
                f"  psql '{r.endpoints.get('half', '')}' -c 'SELECT count(*) FROM pgbench_history'\n"
                f"  {cmd} timeline branch{wd} --branch-name mine --ancestor-lsn {r.half_way.lsn}\n"
                f"  {cmd} endpoint start{wd} mine --branch-name mine\n"
                f"Stop it with:\n  {cmd} stop{wd}",
                highlight=False, soft_wrap=True,
            )


def _pagestore_command() -> str:
    """How the user can run ``pagestore`` from here: bare if it is on PATH, else its path."""
    argv0 = Path(sys.argv[0])
    on_path = shutil.which("pagestore")
    if argv0.name == "pagestore":
        if on_path and Path(on_path).resolve() == argv0.resolve():
            return "pagestore"
        return os.path.relpath(argv0) if not argv0.is_absolute() else str(argv0)
    return "pagestore" if on_path else f"{sys.executable} -m control_plane.cli"


def result_json(result: DemoResult) -> str:
    import cattrs

    return json.dumps(cattrs.unstructure(result), indent=2)


def run_demo(opts: DemoOptions, console: Console | None = None,
             on_failure: Callable[[LocalEnv | None], None] | None = None) -> DemoResult:
    demo = Demo(opts, console or Console())
    try:
        return demo.run()
    except BaseException:
        if on_failure is not None:
            on_failure(demo.env)
        raise


__all__ = ["DemoFailed", "DemoOptions", "DemoResult", "result_json", "run_demo"]
