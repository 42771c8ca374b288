"""Our libpq client against the real PostgreSQL 15: queries, errors, physical replication."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from common.pgclient import connect, format_options
from compute.postgres import PostgresInstance
from protocol.lsn import format_lsn, parse_lsn
from protocol.pgwire.errors import PgError

pytestmark = pytest.mark.postgres

XLOG_DATA_HEADER = struct.Struct("!cQQq")  # 'w', dataStart, walEnd, sendTime
STANDBY_STATUS = struct.Struct("!cQQQqB")  # 'r', write, flush, apply, clock, reply


@pytest.fixture
async def postgres(pg_tmp_path: Path) -> AsyncIterator[PostgresInstance]:
    def start() -> PostgresInstance:
        pg = PostgresInstance.create(
            pg_tmp_path / "data", {"wal_level": "replica", "max_wal_senders": "4", "fsync": "off"}
        )
        pg.start()
        return pg

    pg = await trio.to_thread.run_sync(start)
    try:
        yield pg
    finally:
        await trio.to_thread.run_sync(pg.destroy)


async def test_query_error_and_replication(postgres: PostgresInstance) -> None:
    with trio.fail_after(120):
        async with await connect("127.0.0.1", postgres.port, user="postgres") as conn:
            assert conn.server_params["server_version"].startswith("15.")
            rows = await conn.query("select 1 as a, null::text as b, 'x y' as c")
            assert rows == [("1", None, "x y")]
            results = await conn.execute("create table t(x int); insert into t values (1), (2)")
            assert [r.command_tag for r in results] == ["CREATE TABLE", "INSERT 0 2"]
            with pytest.raises(PgError) as info:
                await conn.query("select * from no_such_table")
            assert info.value.sqlstate == "42P01"
            assert "no_such_table" in info.value.message
            # The connection is still usable after the error.
            assert await conn.query("select count(*) from t") == [("2",)]

            repl = await connect(
                "127.0.0.1", postgres.port, user="postgres", params={"replication": "true"}
            )
            systemid, timeline, xlogpos, dbname = await repl.query_one("IDENTIFY_SYSTEM")
            assert systemid is not None and int(systemid) > 0
            assert timeline == "1" and dbname is None
            assert xlogpos is not None
            start = parse_lsn(xlogpos)
            copy = await repl.copy_both(f"START_REPLICATION PHYSICAL {format_lsn(start)}")
            await conn.execute("insert into t select generate_series(1, 1000)")
            received = 0
            next_start = start

            async def pump(until: int) -> None:
                nonlocal received, next_start
                while received < until:
                    payload = await copy.receive()
                    assert payload is not None
                    if payload[:1] == b"w":
                        _, data_start, wal_end, _ = XLOG_DATA_HEADER.unpack_from(payload)
                        assert data_start == next_start  # contiguous WAL, in order
                        next_start = data_start + len(payload) - XLOG_DATA_HEADER.size
                        assert wal_end >= data_start
                        received += len(payload) - XLOG_DATA_HEADER.size
                        await copy.send(STANDBY_STATUS.pack(b"r", next_start, next_start, 0, 0, 0))
                    else:
                        assert payload[:1] == b"k"  # keepalive

            with trio.move_on_after(3):
                await pump(50_000)
            # On a loaded machine the walsender may not have sent anything within 3 s: give
            # it longer to deliver the first WAL before judging.
            with trio.move_on_after(30):
                await pump(1)
            assert received > 0
            await repl.finish_copy()
            await repl.aclose()


async def test_startup_options_reach_postgres(postgres: PostgresInstance) -> None:
    with trio.fail_after(60):
        async with await connect(
            "127.0.0.1", postgres.port, user="postgres", options={"application_name": "has space"}
        ) as conn:
            assert await conn.query("show application_name") == [("has space",)]


def test_format_options_escapes() -> None:
    assert format_options({"a": "x y", "b": "c\\d"}) == r"-c a=x\ y -c b=c\\d"
