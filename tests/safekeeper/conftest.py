"""Fixtures for the safekeeper tests: real PostgreSQL 15 WAL, made once per session."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from compute.postgres import PostgresInstance, pg_binary, run_as_postgres
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn, parse_lsn, segment_file_name


@attrs.frozen
class RealWal:
    """WAL bytes from ``start`` (a segment start) to ``end`` (end of the last record)."""

    start: Lsn
    end: Lsn
    data: bytes
    record_starts: tuple[Lsn, ...]
    system_id: int


@pytest.fixture(scope="session")
def real_wal() -> Iterator[RealWal]:
    base = Path(tempfile.mkdtemp(prefix="pagestore-sk-wal-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        pg = PostgresInstance.create(base / "pg", {"wal_keep_size": "1GB"})
        pg.start()
        try:
            pg.psql(
                "create table t(a int, b text);"
                "insert into t select g, repeat('x', g % 700) from generate_series(1, 40000) g;"
                "select pg_switch_wal();"
                "insert into t values (1, 'after switch');"
            )
        finally:
            pg.stop()
        wal_dir = pg.wal_dir()
        out = run_as_postgres(
            [pg_binary("pg_waldump"), "-p", str(wal_dir), "-s", "0/1000028"], check=False
        ).stdout.decode()
        starts = tuple(parse_lsn(m) for m in re.findall(r"lsn: ([0-9A-F]+/[0-9A-F]+),", out))
        ctl = run_as_postgres([pg_binary("pg_controldata"), str(pg.datadir)]).stdout.decode()
        system_id = int(re.search(r"Database system identifier:\s+(\d+)", ctl).group(1))  # type: ignore[union-attr]
        # The end of WAL is the end of the last record: the shutdown checkpoint (114 bytes).
        last = starts[-1]
        data = bytearray()
        segno = 1
        while segno * WAL_SEGMENT_SIZE <= last:
            data += (wal_dir / segment_file_name(segno)).read_bytes()
            segno += 1
        end = Lsn((last + 114 + 7) & ~7)
        yield RealWal(
            start=Lsn(WAL_SEGMENT_SIZE),
            end=end,
            data=bytes(data[: end - WAL_SEGMENT_SIZE]),
            record_starts=starts,
            system_id=system_id,
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)
