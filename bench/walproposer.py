"""``pagestore bench walproposer``: what synchronous commit through the bridge costs.

For each mode it starts a vanilla PostgreSQL 15 (``fsync = off``: PostgreSQL's own disk is not
what is measured), and in the bridge modes three safekeeper processes and the walproposer
bridge with ``synchronous_standby_names = 'walproposer'``; then it times a bulk
``CREATE TABLE AS`` (one transaction, WAL streamed through the bridge, the commit waits for the
quorum) and a pgbench TPC-B run. One JSON line per mode:

- ``plain``: no bridge, no synchronous standby (the baseline);
- ``bridge``: safekeepers fsync every write group (the durable setup);
- ``bridge-nosync``: safekeepers with ``no_sync`` (isolates the bridge's own cost).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from compute.postgres import PostgresInstance, postgres_tmpdir
from protocol.ids import TenantId, TimelineId
from protocol.lsn import parse_lsn
from safekeeper.testing import SafekeeperProcess

MODES = ("plain", "bridge", "bridge-nosync")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    parser.add_argument("--rows", type=int, default=500_000, help="rows of the bulk CREATE TABLE AS")
    parser.add_argument("--seconds", type=int, default=5, help="pgbench -T")
    parser.add_argument("--clients", type=int, default=4, help="pgbench -c")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_mode(mode: str, rows: int, seconds: int, clients: int) -> dict[str, object]:
    with postgres_tmpdir("bench-walproposer-") as root:
        settings = {"wal_level": "replica", "fsync": "off", "max_wal_size": "4GB"}
        if mode != "plain":
            settings.update({"synchronous_standby_names": "walproposer", "synchronous_commit": "on"})
        pg = PostgresInstance.create(root / "pg", settings)
        sks: list[SafekeeperProcess] = []
        bridge: subprocess.Popen[bytes] | None = None
        try:
            pg.start()
            if mode != "plain":
                sks = [
                    SafekeeperProcess(root / f"sk{i}", node_id=i + 1, no_sync=mode == "bridge-nosync")
                    for i in range(3)
                ]
                for sk in sks:
                    sk.start()
                bridge = subprocess.Popen(
                    [sys.executable, "-m", "control_plane.cli", "walproposer",
                     "--pg-port", str(pg.port),
                     "--safekeepers", ",".join(f"127.0.0.1:{s.pg_port}" for s in sks),
                     "--tenant-id", TenantId.generate().hex,
                     "--timeline-id", TimelineId.generate().hex,
                     "--log-file", str(root / "bridge.log")],
                    cwd=Path(__file__).resolve().parents[1],
                )
                # The first commit waits for the election: do it before timing anything.
                pg.psql("create table warmup(x int)", timeout=60)
            start = parse_lsn(pg.psql("select pg_current_wal_flush_lsn()"))
            t0 = time.perf_counter()
            pg.psql(
                f"create table big as select g, repeat('x', 100) as pad from generate_series(1, {rows}) g",
                timeout=3600,
            )
            bulk_s = time.perf_counter() - t0
            end = parse_lsn(pg.psql("select pg_current_wal_flush_lsn()"))
            pg.pgbench("-i", "-s", "1", "-q")
            out = pg.pgbench("-T", str(seconds), "-c", str(clients), "-j", "2")
            m = re.search(r"tps = ([\d.]+)", out)
            mb = (end - start) / 2**20
            result: dict[str, object] = {
                "bench": "walproposer",
                "mode": mode,
                "bulk_wal_mb": round(mb, 1),
                "bulk_s": round(bulk_s, 2),
                "bulk_mb_s": round(mb / bulk_s, 1),
                "pgbench_clients": clients,
                "pgbench_tps": float(m.group(1)) if m else None,
            }
            if bridge is not None:
                result["bridge_cpu_s"] = _cpu_seconds(bridge.pid)
                result["safekeeper_cpu_s"] = [_cpu_seconds(s.proc.pid) for s in sks if s.proc]
            return result
        finally:
            if bridge is not None:
                bridge.kill()
                bridge.wait()
            for sk in sks:
                sk.kill()
            pg.stop("immediate")


def run(args: argparse.Namespace) -> int:
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        print(json.dumps(run_mode(mode, args.rows, args.seconds, args.clients)), flush=True)
    return 0
