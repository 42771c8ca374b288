"""The walproposer bridge with real processes: a vanilla PostgreSQL 15 in synchronous
replication with the bridge, three safekeeper nodes, pgbench, kill -9.

What is checked:

- PostgreSQL treats the bridge as its synchronous standby, and pgbench commits;
- the safekeepers' flush and commit LSNs reach PostgreSQL's flush LSN;
- with one safekeeper killed, pgbench still commits; with two down a commit waits until one
  comes back (commits need a quorum of fsyncs), and the returning one catches up;
- the bridge killed with -9 and restarted elects a higher term and goes on;
- pg_waldump reads a safekeeper's segment files and finds the same records as in PostgreSQL's
  own pg_wal;
- the pageserver's WAL receiver pulls the WAL from the safekeepers and decodes the same records
  pg_waldump lists.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest
import trio

from compute.postgres import PostgresInstance, pg_binary, run_as_postgres
from control_plane.process import wait_until
from pageserver.wal_receiver import WalReceiver, WalReceiverConfig
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn, format_lsn, parse_lsn
from protocol.wal.record import DecodedRecord
from safekeeper.testing import SafekeeperProcess, TestProposer

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


@attrs.define
class BridgeProcess:
    pg_port: int
    safekeepers: list[SafekeeperProcess]
    tenant: TenantId
    timeline: TimelineId
    workdir: Path
    buffer_mb: int = 64
    proc: subprocess.Popen[bytes] | None = None

    @property
    def status_path(self) -> Path:
        return self.workdir / "bridge-status.json"

    def start(self) -> None:
        self.status_path.unlink(missing_ok=True)
        addrs = ",".join(f"127.0.0.1:{s.pg_port}" for s in self.safekeepers)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "control_plane.cli", "walproposer",
             "--pg-port", str(self.pg_port), "--safekeepers", addrs,
             "--tenant-id", self.tenant.hex, "--timeline-id", self.timeline.hex,
             "--status-file", str(self.status_path), "--buffer-mb", str(self.buffer_mb)],
            cwd=ROOT,
            stdout=open(self.workdir / "bridge.log", "ab"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )

    def status(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.poll() is None, self.log_tail()
        try:
            result: dict[str, Any] = json.loads(self.status_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return result

    def log_tail(self, n: int = 3000) -> str:
        return (self.workdir / "bridge.log").read_text()[-n:]

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@attrs.define
class Cluster:
    pg: PostgresInstance
    safekeepers: list[SafekeeperProcess]
    bridge: BridgeProcess
    tenant: TenantId
    timeline: TimelineId

    def flush_lsn(self) -> Lsn:
        return parse_lsn(self.pg.psql("select pg_current_wal_flush_lsn()"))

    def slot_lsn(self) -> Lsn:
        return parse_lsn(
            self.pg.psql("select restart_lsn from pg_replication_slots where slot_name = 'walproposer'")
        )

    def sk_status(self, i: int) -> dict[str, Any]:
        return self.safekeepers[i].timeline_status(self.tenant, self.timeline)

    def sk_reached(self, i: int, lsn: Lsn, field: str = "flush_lsn") -> Callable[[], bool]:
        def check() -> bool:
            try:
                return parse_lsn(self.sk_status(i)[field]) >= lsn
            except OSError:
                return False

        return check


@pytest.fixture
def cluster(pg_tmp_path: Path) -> Iterator[Cluster]:
    pg = PostgresInstance.create(
        pg_tmp_path / "pg",
        {
            "wal_level": "replica",
            "max_wal_senders": "10",
            "synchronous_standby_names": "walproposer",
            "synchronous_commit": "on",
            "fsync": "off",  # PostgreSQL's own durability is not under test; the quorum is
        },
    )
    sks = [SafekeeperProcess(pg_tmp_path / f"sk{i}", node_id=i + 1) for i in range(3)]
    tenant, timeline = TenantId.generate(), TimelineId.generate()
    # A small window, so a safekeeper that was away must catch up from PostgreSQL.
    bridge = BridgeProcess(pg.port, sks, tenant, timeline, pg_tmp_path, buffer_mb=2)
    try:
        pg.start()
        for s in sks:
            s.start(timeout=90)  # Python subprocesses start slowly on a loaded machine
        bridge.start()
        c = Cluster(pg, sks, bridge, tenant, timeline)
        wait_until("the bridge's election", lambda: bool(bridge.status().get("elected")), timeout=90)
        yield c
    finally:
        bridge.kill()
        for s in sks:
            s.kill()
        pg.stop("immediate")


def pgbench_tps(pg: PostgresInstance, *args: str) -> int:
    out = pg.pgbench(*args, timeout=120)
    m = re.search(r"number of transactions actually processed: (\d+)", out)
    assert m, out
    return int(m.group(1))


def waldump_lsns(dir_: Path, start: Lsn, end: Lsn) -> list[Lsn]:
    proc = subprocess.run(
        [pg_binary("pg_waldump"), "-p", str(dir_), "-s", format_lsn(start), "-e", format_lsn(end)],
        capture_output=True, text=True, check=False, timeout=120,
    )
    lsns = [parse_lsn(m.group(1)) for m in re.finditer(r" lsn: ([0-9A-F]+/[0-9A-F]+),", proc.stdout)]
    assert lsns, proc.stderr
    return lsns


def copy_segments(sk_dir: Path, dest: Path) -> None:
    """Safekeeper segments, the open one renamed without ``.partial`` so pg_waldump finds it."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in sk_dir.iterdir():
        if re.fullmatch(r"[0-9A-F]{24}(\.partial)?", f.name):
            shutil.copyfile(f, dest / f.name.removesuffix(".partial"))


def test_bridge_quorum_commit_failover_and_restart(cluster: Cluster, pg_tmp_path: Path) -> None:
    pg, sks, bridge = cluster.pg, cluster.safekeepers, cluster.bridge
    rows = pg.psql(
        "select application_name, sync_state from pg_stat_replication "
        "where application_name = 'walproposer'"
    )
    assert rows == "walproposer|sync", rows
    start_lsn = parse_lsn(sks[0].timeline_status(cluster.tenant, cluster.timeline)["timeline_start_lsn"])

    # 1. pgbench commits; every safekeeper's flush and commit LSN reaches PostgreSQL's flush.
    pg.pgbench("-i", "-s", "1", "-q")
    assert pgbench_tps(pg, "-T", "3", "-c", "4", "-j", "2") > 0
    target = cluster.flush_lsn()
    for i in range(3):
        wait_until(f"sk{i} flush", cluster.sk_reached(i, target), timeout=30)
        wait_until(f"sk{i} commit", cluster.sk_reached(i, target, "commit_lsn"), timeout=30)
    wait_until("bridge commit", lambda: parse_lsn(bridge.status()["commit_lsn"]) >= target, timeout=30)
    # The slot follows the safekeepers (the lowest flush).
    wait_until("slot advance", lambda: cluster.slot_lsn() >= target, timeout=30)

    # 2. kill -9 one safekeeper: the other two are a quorum, pgbench still commits.
    sk2_flush = parse_lsn(cluster.sk_status(2)["flush_lsn"])
    sks[2].kill()
    assert pgbench_tps(pg, "-T", "2", "-c", "4", "-j", "2") > 0
    # PostgreSQL keeps the WAL the missing safekeeper will need.
    time.sleep(1.5)
    assert cluster.slot_lsn() <= sk2_flush < cluster.flush_lsn()

    # 3. With two down, a commit waits for a quorum; it completes once one returns.
    sks[1].kill()
    waiting = subprocess.Popen(
        ["runuser", "-u", "postgres", "--", pg_binary("psql"), "-X", "-h", "127.0.0.1",
         "-p", str(pg.port), "-U", "postgres", "-d", "postgres",
         "-c", "create table durable(x int); insert into durable values (42)"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    time.sleep(2.5)
    assert waiting.poll() is None, "a commit returned without a quorum of safekeepers"
    sks[1].start(timeout=90)
    assert waiting.wait(timeout=90) == 0, waiting.stdout.read() if waiting.stdout else ""
    # The returning safekeeper catches up, and so does the one that was away longer.
    sks[2].start(timeout=90)
    target = cluster.flush_lsn()
    for i in range(3):
        wait_until(f"sk{i} catch-up", cluster.sk_reached(i, target), timeout=60)
    assert "catching up from postgres" in bridge.log_tail(100_000)
    wait_until("slot advance after catch-up", lambda: cluster.slot_lsn() >= target, timeout=30)

    # 4. kill -9 the bridge and restart it: a new, higher term; commits go on.
    term_before = bridge.status()["term"]
    bridge.kill()
    bridge.start()
    wait_until("re-election", lambda: bridge.status().get("term", 0) > term_before, timeout=90)
    assert pgbench_tps(pg, "-T", "2", "-c", "2") > 0
    target = cluster.flush_lsn()
    for i in range(3):
        wait_until(f"sk{i} after restart", cluster.sk_reached(i, target), timeout=30)
        status = cluster.sk_status(i)
        assert status["term"] > term_before and status["last_log_term"] == status["term"]

    # A rival proposer takes a higher term on one safekeeper: the bridge sees its appends
    # refused with that term and wins a new election above it.
    st = cluster.sk_status(1)
    rival_term = int(st["term"]) + 10

    async def rival() -> None:
        async with await TestProposer.connect(
            "127.0.0.1", sks[1].pg_port, cluster.tenant, cluster.timeline
        ) as tp:
            await tp.greet(system_id=int(st["system_id"]), pg_version=int(st["pg_version"]))
            assert (await tp.vote(rival_term)).vote_given

    trio.run(rival)
    wait_until(
        "a term above the rival's",
        lambda: bridge.status().get("term", 0) > rival_term and bool(bridge.status().get("elected")),
        timeout=30,
    )
    assert pgbench_tps(pg, "-T", "1", "-c", "2") > 0
    assert "term lost, starting over" in bridge.log_tail(10**8)

    # 5. pg_waldump reads a safekeeper's segments: the same records as PostgreSQL's pg_wal.
    end = parse_lsn(cluster.sk_status(0)["commit_lsn"])
    seg_dir = pg_tmp_path / "waldump"
    copy_segments(sks[0].timeline_dir(cluster.tenant, cluster.timeline), seg_dir)
    from_sk = waldump_lsns(seg_dir, start_lsn, end)
    pg_wal = pg_tmp_path / "pg_wal_copy"
    shutil.copytree(pg.wal_dir(), pg_wal, ignore=shutil.ignore_patterns("archive_status"))
    from_pg = waldump_lsns(pg_wal, start_lsn, end)
    assert from_sk == from_pg
    assert len(from_sk) > 3000  # pgbench -i -s 1 and the runs write thousands of records

    # 6. A clean PostgreSQL shutdown waits until its shutdown checkpoint is on a quorum (the
    # walsender waits for the bridge's flush report); after a restart the bridge streams again.
    pg.stop("fast")
    control = run_as_postgres([pg_binary("pg_controldata"), str(pg.datadir)]).stdout.decode()
    m = re.search(r"Latest checkpoint location:\s+(\S+)", control)
    assert m, control
    checkpoint = parse_lsn(m.group(1))
    assert sum(cluster.sk_reached(i, Lsn(checkpoint + 1))() for i in range(3)) >= 2
    pg.start()
    assert pgbench_tps(pg, "-T", "1", "-c", "2") > 0

    # 7. The pageserver's WAL receiver decodes the same records from the safekeepers.
    # sk0 first refuses (it is down): the receiver must move on to another safekeeper.
    sks[0].kill()
    got: list[DecodedRecord] = []

    async def receive() -> WalReceiver:
        async def on_record(rec: DecodedRecord) -> None:
            if rec.end_lsn <= end:
                got.append(rec)

        cfg = WalReceiverConfig(
            safekeepers=tuple(("127.0.0.1", s.pg_port) for s in sks),
            tenant_id=cluster.tenant,
            timeline_id=cluster.timeline,
        )
        recv = WalReceiver(cfg, start_lsn=start_lsn, on_record=on_record)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(recv.run)
            with trio.fail_after(60):
                await recv.wait_for_lsn(end)
            nursery.cancel_scope.cancel()
        return recv

    recv = trio.run(receive)
    assert [r.lsn for r in got] == from_sk
    assert recv.sessions >= 1 and recv.current is None
    assert recv.last_error is not None and str(sks[0].pg_port) in recv.last_error
    # No term ended in an unexpected error along the way.
    assert "term failed" not in bridge.log_tail(10**8)


def waldump_commits(dir_: Path, start: Lsn, end: Lsn) -> set[int]:
    proc = subprocess.run(
        [pg_binary("pg_waldump"), "-p", str(dir_), "-r", "Transaction",
         "-s", format_lsn(start), "-e", format_lsn(end)],
        capture_output=True, text=True, check=False, timeout=120,
    )
    return {int(m.group(1)) for m in re.finditer(r"tx: +(\d+), .*desc: COMMIT", proc.stdout)}


def test_acknowledged_commits_survive_losing_a_safekeeper_and_the_bridge(
    cluster: Cluster, pg_tmp_path: Path
) -> None:
    """kill -9 one safekeeper, then the bridge, then PostgreSQL itself, mid-workload: every
    commit a client saw acknowledged is in the WAL the two surviving safekeepers hold."""
    pg, sks, bridge = cluster.pg, cluster.safekeepers, cluster.bridge
    start_lsn = parse_lsn(cluster.sk_status(0)["timeline_start_lsn"])
    pg.psql("create table acked(x int)")
    acked: list[int] = []
    stop = threading.Event()

    def workload() -> None:
        try:
            with psycopg.connect(
                f"host=127.0.0.1 port={pg.port} user=postgres dbname=postgres", autocommit=True
            ) as conn:
                while not stop.is_set():
                    row = conn.execute(
                        "insert into acked values (1) returning txid_current()"
                    ).fetchone()
                    assert row is not None
                    acked.append(int(row[0]))  # the commit returned: acknowledged
        except psycopg.Error:
            pass  # PostgreSQL was killed under us

    worker = threading.Thread(target=workload)
    worker.start()
    def bridge_attached() -> bool:
        return pg.psql(
            "select count(*) from pg_stat_replication where application_name = 'walproposer'"
        ) != "0"

    try:
        # Conditions, not fixed sleeps: a loaded 2-core CI box commits slowly.
        wait_until("workload commits", lambda: len(acked) >= 20, timeout=60)
        sks[2].kill()
        # Two of three safekeepers are a quorum: commits keep being acknowledged.
        n_after_sk_kill = len(acked)
        wait_until("commits without sk2", lambda: len(acked) >= n_after_sk_kill + 10, timeout=60)
        bridge.kill()
        # Once PostgreSQL has dropped the bridge's walsender nothing can release a commit;
        # a client may still be recording one released just before, so wait for the count
        # to settle before sampling it.
        wait_until("walsender gone", lambda: not bridge_attached(), timeout=60)
        settled = [len(acked), time.monotonic()]

        def stable() -> bool:
            if len(acked) != settled[0]:
                settled[:] = [len(acked), time.monotonic()]
            return time.monotonic() - settled[1] >= 2.0  # room for a slow client thread

        wait_until("acknowledgements settle", stable, timeout=30)
        n_before_pg_kill = len(acked)
        # Give a (wrongly) acknowledging PostgreSQL time to show it.
        time.sleep(1.0)
        n_at_pg_kill = len(acked)
        pg.stop("immediate")
    finally:
        stop.set()
        worker.join(timeout=30)
    assert not worker.is_alive()
    # Without the bridge no commit can be acknowledged (there is no synchronous standby).
    assert n_at_pg_kill == n_before_pg_kill
    assert len(acked) == n_before_pg_kill
    for i in (0, 1):
        flush = parse_lsn(cluster.sk_status(i)["flush_lsn"])
        seg_dir = pg_tmp_path / f"waldump{i}"
        copy_segments(sks[i].timeline_dir(cluster.tenant, cluster.timeline), seg_dir)
        in_wal = waldump_commits(seg_dir, start_lsn, flush)
        missing = [x for x in acked if x not in in_wal]
        assert not missing, f"sk{i}: acknowledged commits missing from its WAL: {missing[:10]}"
