"""A vanilla PostgreSQL 15 standby streams from the safekeeper and answers like the primary.

The primary's WAL (read from its pg_wal) is pushed into a safekeeper process by the test
proposer; the standby is a pg_basebackup of the primary whose ``primary_conninfo`` points at
the safekeeper. After replaying what the safekeeper streams, it must return the primary's
query results.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio

from compute.postgres import (
    PostgresError,
    PostgresInstance,
    chown_to_postgres,
    make_postgres_dir,
    pg_binary,
    run_as_postgres,
)
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn, segment_file_name
from safekeeper.record_tracker import InvalidWal, RecordTracker
from safekeeper.testing import SafekeeperProcess, TestProposer
from tests.safekeeper.test_integration import TENANT, TIMELINE, commit_all

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

QUERY = "select count(*), sum(a), md5(string_agg(b, ',' order by a)) from t"


def read_wal(wal_dir: Path) -> tuple[bytes, Lsn]:
    """The primary's WAL from segment 1 up to the end of its last valid record."""
    tracker = RecordTracker(Lsn(WAL_SEGMENT_SIZE))
    data = bytearray()
    segno = 1
    try:
        while (wal_dir / segment_file_name(segno)).exists():
            seg = (wal_dir / segment_file_name(segno)).read_bytes()
            data += seg
            tracker.feed(seg)
            segno += 1
    except InvalidWal:
        pass
    end = tracker.record_end
    return bytes(data[: end - WAL_SEGMENT_SIZE]), end


async def test_vanilla_standby_streams_from_safekeeper(pg_tmp_path: Path) -> None:
    primary = PostgresInstance.create(pg_tmp_path / "primary", {"wal_keep_size": "1GB"})
    primary.start()
    standby: PostgresInstance | None = None
    sk = SafekeeperProcess(pg_tmp_path / "sk", no_sync=True)
    try:
        primary.psql("create table t(a int primary key, b text)")
        primary.psql("insert into t select g, md5(g::text) from generate_series(1, 5000) g")
        backup = make_postgres_dir(pg_tmp_path / "standby")
        run_as_postgres(
            [pg_binary("pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
             "-D", str(backup), "-X", "none", "--no-sync", "-c", "fast"]
        )
        # Changes after the backup reach the standby only through the safekeeper.
        primary.psql("insert into t select g, md5(g::text) from generate_series(5001, 20000) g")
        primary.psql("update t set b = 'changed' where a % 7 = 0")
        primary.psql("delete from t where a % 11 = 0")
        expected = primary.psql(QUERY)
        system_id = int(
            next(
                line.split(":")[1]
                for line in run_as_postgres([pg_binary("pg_controldata"), str(primary.datadir)])
                .stdout.decode()
                .splitlines()
                if line.startswith("Database system identifier")
            )
        )
        primary.stop()
        wal, end = read_wal(primary.wal_dir())

        sk.start(timeout=90)
        chunk = 128 * 1024
        with trio.fail_after(60):
            async with await TestProposer.connect("127.0.0.1", sk.pg_port, TENANT, TIMELINE) as p:
                await p.greet(system_id=system_id)
                await p.elect(Lsn(WAL_SEGMENT_SIZE))
                pushed = await p.append_many(
                    Lsn(WAL_SEGMENT_SIZE), [wal[i : i + chunk] for i in range(0, len(wal), chunk)]
                )
                assert pushed == end
                await commit_all(p, end)

        standby = PostgresInstance(
            datadir=backup,
            settings={
                "primary_conninfo": (
                    f"host=127.0.0.1 port={sk.pg_port} user=postgres "
                    f"options=''-c tenant_id={TENANT} timeline_id={TIMELINE}''"
                ),
                "hot_standby": "on",
                "wal_keep_size": "0",
            },
        )
        (backup / "standby.signal").write_text("")
        (backup / "server.log").unlink(missing_ok=True)  # the primary's, copied by the backup
        chown_to_postgres(backup)
        backup.chmod(0o700)
        try:
            standby.start()
        except PostgresError as exc:
            raise PostgresError(f"{exc}\n{(backup / 'server.log').read_text()[-3000:]}") from None
        deadline = time.monotonic() + 60
        got = ""
        while time.monotonic() < deadline:
            got = standby.psql(QUERY)
            if got == expected:
                break
            await trio.sleep(0.2)
        assert got == expected
        assert standby.psql("select pg_is_in_recovery()") == "t"
        # The standby reports its position back: the safekeeper records it.
        # (the standby reports every wal_receiver_status_interval = 10 s: leave room for load)
        deadline = time.monotonic() + 60
        replicas: list[dict[str, str]] = []
        while time.monotonic() < deadline:
            replicas = sk.timeline_status(TENANT, TIMELINE)["replicas"]
            if replicas and replicas[0]["flush_lsn"] != "0/0":
                break
            await trio.sleep(0.2)
        assert replicas and replicas[0]["flush_lsn"] != "0/0"
    finally:
        if standby is not None:
            standby.stop("immediate")
        primary.stop("immediate")
        sk.kill()
