"""Basebackup of real timelines (bootstrapped by initdb import, then WAL ingested):
vanilla PostgreSQL 15 boots from the tar with no other WAL and sees the data."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from compute.postgres import PostgresInstance
from pageserver.basebackup import TimelineBackupSource, write_basebackup
from pageserver.config import PageserverConfig
from pageserver.import_datadir import bootstrap_timeline
from pageserver.tenant_manager import TenantManager
from pageserver.timeline import Timeline
from pageserver.walingest import WalIngest, ingest_wal_dir
from protocol.ids import TimelineId
from protocol.lsn import Lsn, parse_lsn
from tests.pageserver.basebackup_helpers import unpack_tar

pytestmark = pytest.mark.postgres


async def _tar(tl: Timeline, lsn: Lsn, *, replica: bool = False) -> bytes:
    chunks: list[bytes] = []

    async def send(b: bytes) -> None:
        chunks.append(b)

    await write_basebackup(TimelineBackupSource(tl), lsn, send, replica=replica)
    return b"".join(chunks)


async def _boot(data: bytes, target: Path) -> PostgresInstance:
    unpack_tar(data, target)
    pg = PostgresInstance(datadir=target)
    await trio.to_thread.run_sync(pg.start)
    return pg


async def test_bootstrap_then_pgbench_wal_then_basebackup_boots(pg_tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        manager = TenantManager(PageserverConfig(workdir=pg_tmp_path / "ps"))
        await manager.start(nursery)
        tenant = await manager.create_tenant()
        pgdata = pg_tmp_path / "initdb"
        tl, _ = await bootstrap_timeline(tenant, TimelineId.generate(), pgdata=pgdata)
        boot_lsn = tl.last_record_lsn

        # 2. Run pgbench on a copy of initdb's directory, ingest its WAL, back up again.
        src = PostgresInstance(datadir=pgdata, settings={"wal_keep_size": "1GB"})
        await trio.to_thread.run_sync(src.start)
        try:
            await trio.to_thread.run_sync(lambda: src.pgbench("-i", "-s", "1", "-q"))
            mid = parse_lsn(src.psql("SELECT pg_current_wal_insert_lsn()"))
            await trio.to_thread.run_sync(lambda: src.pgbench("-c", "2", "-t", "200", "-n"))
            want_sum = src.psql("SELECT sum(abalance) FROM pgbench_accounts")
            want_hist = src.psql("SELECT count(*) FROM pgbench_history")
        finally:
            await trio.to_thread.run_sync(src.stop)
        end = await ingest_wal_dir(WalIngest(tl), pgdata / "pg_wal", boot_lsn)
        assert end > mid > boot_lsn

        pg = await _boot(await _tar(tl, end), pg_tmp_path / "pg2")
        try:
            assert pg.psql("SELECT sum(abalance) FROM pgbench_accounts") == want_sum
            assert pg.psql("SELECT count(*) FROM pgbench_history") == want_hist
            pg.psql("INSERT INTO pgbench_history VALUES (1, 1, 1, 1, now(), 'x')")
        finally:
            await trio.to_thread.run_sync(pg.stop)

        # 3. A past LSN, read-only: pgbench's tables exist only after initialization.
        old = await _boot(await _tar(tl, boot_lsn, replica=True), pg_tmp_path / "pg3")
        try:
            assert old.psql("SELECT pg_is_in_recovery()") == "t"
            assert old.psql("SELECT count(*) FROM pg_class WHERE relname = 'pgbench_accounts'") == "0"
        finally:
            await trio.to_thread.run_sync(old.stop)
        # 4. Between pgbench's initialization and its run: loaded tables, no history yet.
        at_mid = await _boot(await _tar(tl, mid, replica=True), pg_tmp_path / "pg4")
        try:
            assert at_mid.psql("SELECT count(*) FROM pgbench_accounts") == "100000"
            assert at_mid.psql("SELECT sum(abalance) FROM pgbench_accounts") == "0"
            assert at_mid.psql("SELECT count(*) FROM pgbench_history") == "0"
        finally:
            await trio.to_thread.run_sync(at_mid.stop)
        # 5. A branch at that point boots read-write and diverges on its own.
        branch = await manager.create_timeline(tenant.tenant_id, ancestor_timeline_id=tl.timeline_id,
                                               ancestor_start_lsn=mid)
        assert branch.last_record_lsn == mid
        on_branch = await _boot(await _tar(branch, mid), pg_tmp_path / "pg5")
        try:
            assert on_branch.psql("SELECT count(*) FROM pgbench_history") == "0"
            on_branch.psql("UPDATE pgbench_accounts SET abalance = 7 WHERE aid = 1")
            assert on_branch.psql("SELECT sum(abalance) FROM pgbench_accounts") == "7"
        finally:
            await trio.to_thread.run_sync(on_branch.stop)
        await manager.shutdown()
        nursery.cancel_scope.cancel()
