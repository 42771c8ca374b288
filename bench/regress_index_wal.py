"""PostgreSQL's regression suite as a redo check, offline: ``pagestore verify regress-wal``.

A plain PostgreSQL 15 (no pagestore) with ``wal_consistency_checking`` set to the chosen
resource managers runs the whole ``parallel_schedule`` (from ``scripts/setup-pg-regress``'s
cache). Then the WAL of the run is read back and every record of those resource managers is
replayed by ``PostgresRedoManager`` (``verify.verify_records``: each block's result against
the page PostgreSQL logged for verification, after the rmgr's mask); XLOG full-page images go
along so pages written by index builds have their base. Prints one JSON line with the
suite's result and the checks/failures per record type. Needs a few GB of disk for the WAL.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from compute.postgres import PostgresInstance, chown_to_postgres, postgres_tmpdir, run_as_postgres
from pageserver.walredo.verify import VERIFY_SETTINGS, read_wal, verify_records
from protocol.lsn import parse_lsn
from protocol.wal.rmgr import RMGR_NAMES, RmgrId

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "pg-regress"
PG_REGRESS = "/usr/lib/postgresql/15/lib/pgxs/src/test/regress/pg_regress"
# names wal_consistency_checking takes -> rmgr ids
RMGRS = {"hash": RmgrId.HASH, "gin": RmgrId.GIN, "gist": RmgrId.GIST, "spgist": RmgrId.SPGIST,
         "brin": RmgrId.BRIN, "generic": RmgrId.GENERIC, "btree": RmgrId.BTREE, "heap": RmgrId.HEAP}


def _suite_dir() -> Path:
    found = sorted(CACHE.glob("download/postgresql-15-*/src/test/regress"))
    if not found or not (CACHE / "lib" / "regress.so").exists():
        raise SystemExit("the regression suite is not set up: run ./scripts/setup-pg-regress")
    return found[-1]


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.rmgrs.split(",") if n.strip()]
    rmids = {int(RMGRS[n]) for n in names}
    suite = _suite_dir()
    settings = {
        **VERIFY_SETTINGS, "wal_consistency_checking": ",".join(names), "shared_buffers": "128MB",
        "autovacuum": "on", "max_prepared_transactions": "10", "wal_keep_size": "40GB", "max_wal_size": "40GB",
    }
    with postgres_tmpdir("pagestore-regress-wal-") as base:
        pg = PostgresInstance.create(base / "data", settings=settings)
        try:
            pg.start()
            start = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
            out = base / "out"
            out.mkdir()
            chown_to_postgres(out)
            t0 = time.monotonic()
            proc = run_as_postgres(
                [PG_REGRESS, f"--inputdir={suite}", f"--outputdir={out}", "--bindir=/usr/lib/postgresql/15/bin",
                 f"--dlpath={CACHE / 'lib'}", "--host=127.0.0.1", f"--port={pg.port}", "--user=postgres",
                 f"--schedule={suite / 'parallel_schedule'}", f"--max-connections={args.max_connections}"],
                check=False, timeout=7200,
            )
            suite_s = time.monotonic() - t0
            tail = proc.stdout.decode(errors="replace").strip().splitlines()[-3:]
            end = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
            t0 = time.monotonic()
            records = (
                r for r in read_wal(pg.wal_dir(), start, end)
                if r.xl_rmid in rmids or (r.xl_rmid == RmgrId.XLOG and r.blocks)
            )
            report = verify_records(records, max_failures=args.max_failures)
            verify_s = time.monotonic() - t0
        finally:
            pg.destroy()
    wanted = tuple(RMGR_NAMES[i] + "/" for i in sorted(rmids))
    print(json.dumps({
        "bench": "regress_index_wal", "rmgrs": names, "pg_regress_exit": proc.returncode,
        "pg_regress": " ".join(t.strip() for t in tail), "suite_s": round(suite_s), "wal_gib": round((end - start) / 2**30, 2),
        "records_replayed": report.records, "verify_s": round(verify_s),
        "checked": {k: v for k, v in sorted(report.checked.items()) if k.startswith(wanted)},
        "restored": {k: v for k, v in sorted(report.restored.items()) if k.startswith(wanted)},
        "failures": len(report.failures), "first_failures": report.failures[:20],
    }))
    return 0 if not report.failures else 1


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rmgrs", default="gist,spgist", help=f"comma-separated, of {', '.join(RMGRS)}")
    parser.add_argument("--max-connections", type=int, default=4, help="pg_regress --max-connections")
    parser.add_argument("--max-failures", type=int, default=200)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    configure(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
