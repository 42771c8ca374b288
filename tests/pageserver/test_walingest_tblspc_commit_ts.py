"""Ingest of Tablespace, CommitTs, PARAMETER_CHANGE, LogicalMessage and ReplicationOrigin
records on synthetic WAL (the real-WAL tests: tests/integration/test_tablespaces_and_no_page_records.py
and test_commit_ts.py)."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pageserver.pgdatadir import Datadir
from pageserver.storage.key import SLRU_COMMIT_TS
from pageserver.tenant import Tenant
from pageserver.walredo import commit_ts
from pageserver.walredo.manager import PostgresRedoManager
from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.wal.record import RelFileNode
from protocol.wal.rmgr import (
    COMMIT_TS_TRUNCATE,
    COMMIT_TS_ZEROPAGE,
    XACT_XINFO_HAS_SUBXACTS,
    XLOG_LOGICAL_MESSAGE,
    XLOG_PARAMETER_CHANGE,
    XLOG_REPLORIGIN_DROP,
    XLOG_REPLORIGIN_SET,
    XLOG_TBLSPC_CREATE,
    XLOG_TBLSPC_DROP,
    XLOG_XACT_COMMIT,
    XLOG_XACT_HAS_INFO,
    RmgrId,
)
from tests.pageserver.test_walingest import CONFIG, DB, Wal, _seed, _smgr_create

TS = 16500


@pytest.fixture
async def wal(tmp_path: Path) -> AsyncIterator[Wal]:
    tenant = Tenant(tmp_path, TenantId.generate(), CONFIG, redo=PostgresRedoManager())
    tl = await tenant.create_timeline(TimelineId.generate())
    yield Wal(await _seed(tl))
    await tenant.shutdown()


async def test_tablespace_create_relation_drop(wal: Wal) -> None:
    dd = Datadir(wal.tl)
    await wal(RmgrId.TBLSPC, XLOG_TBLSPC_CREATE, main=struct.pack("<I", TS) + b"/srv/ts\0")
    assert (TS, 0) in await dd.list_dbs(wal.tl.last_record_lsn)
    await wal(RmgrId.SMGR, 0x10, main=_smgr_create(RelFileNode(TS, DB, 30000)))
    dbs = await dd.list_dbs(wal.tl.last_record_lsn)
    assert (TS, 0) in dbs and (TS, DB) in dbs
    await wal(RmgrId.TBLSPC, XLOG_TBLSPC_DROP, main=struct.pack("<I", TS))
    lsn = wal.tl.last_record_lsn
    assert not {k for k in await dd.list_dbs(lsn) if k[0] == TS}
    assert not await dd.list_rels(TS, DB, lsn)


@pytest.mark.parametrize("main", [b"", b"\x01\x02", struct.pack("<I", 1663) + b"\0"])
async def test_tablespace_records_hostile(wal: Wal, main: bytes) -> None:
    rec = wal.make(RmgrId.TBLSPC, XLOG_TBLSPC_CREATE, main=main)
    with pytest.raises(RemoteProtocolError, match=r"Tablespace|built-in"):
        await wal.ingest.ingest_record(rec)


async def test_records_without_page_effects(wal: Wal) -> None:
    dd = Datadir(wal.tl)
    before = await dd.list_dbs(wal.tl.last_record_lsn)
    message = struct.pack("<IIQQ", DB, 1, 5, 3) + b"pfx\0" + b"abc"  # xl_logical_message
    await wal(RmgrId.LOGICALMSG, XLOG_LOGICAL_MESSAGE, xid=1001, main=message)
    await wal(RmgrId.REPLORIGIN, XLOG_REPLORIGIN_SET, main=struct.pack("<QHxxxxxx?", 0xAB, 1, True))
    await wal(RmgrId.REPLORIGIN, XLOG_REPLORIGIN_DROP, main=struct.pack("<H", 1))
    assert await dd.list_dbs(wal.tl.last_record_lsn) == before


def _parameter_change(track: bool) -> bytes:
    return struct.pack("<6i??", 100, 8, 10, 0, 64, 1, False, track)


async def test_commit_timestamps(wal: Wal) -> None:
    dd = Datadir(wal.tl)
    commit = struct.pack("<qIi2I", 777_000_000, XACT_XINFO_HAS_SUBXACTS, 2, 1002, 1700)
    # tracking off: a commit writes no commit_ts page
    await wal(RmgrId.XACT, XLOG_XACT_COMMIT | XLOG_XACT_HAS_INFO, xid=1001, main=commit)
    assert not await dd.list_slru_segments(SLRU_COMMIT_TS, wal.tl.last_record_lsn)
    await wal(RmgrId.XLOG, XLOG_PARAMETER_CHANGE, main=_parameter_change(True))
    await wal(RmgrId.XACT, XLOG_XACT_COMMIT | XLOG_XACT_HAS_INFO, xid=1001, main=commit)
    await wal(RmgrId.COMMIT_TS, COMMIT_TS_ZEROPAGE, main=struct.pack("<i", 3))
    lsn = wal.tl.last_record_lsn
    assert await dd.list_slru_segments(SLRU_COMMIT_TS, lsn) == {0}
    assert await dd.get_slru_segment_size(SLRU_COMMIT_TS, 0, lsn) == 4
    page1 = await dd.get_slru_page(SLRU_COMMIT_TS, 0, 1, lsn)  # xids 819..1637: 1001, 1002
    assert commit_ts.get_entry(page1, 1001) == (777_000_000, 0) == commit_ts.get_entry(page1, 1002)
    assert commit_ts.get_entry(page1, 1003) == (0, 0)
    page2 = await dd.get_slru_page(SLRU_COMMIT_TS, 0, 2, lsn)  # 1700 lives here
    assert commit_ts.get_entry(page2, 1700) == (777_000_000, 0)
    assert await dd.get_slru_page(SLRU_COMMIT_TS, 0, 3, lsn) == bytes(8192)
    cp = await dd.get_checkpoint(lsn)
    assert cp.oldest_commit_ts_xid == 1001
    # a segment wholly before the truncation point goes
    await wal(RmgrId.COMMIT_TS, COMMIT_TS_TRUNCATE, main=struct.pack("<iI", 40, 32760))
    assert not await dd.list_slru_segments(SLRU_COMMIT_TS, wal.tl.last_record_lsn)
    assert (await dd.get_checkpoint(wal.tl.last_record_lsn)).oldest_commit_ts_xid == 32760
    with pytest.raises(RemoteProtocolError, match="CommitTs/TRUNCATE"):
        await wal.ingest.ingest_record(wal.make(RmgrId.COMMIT_TS, COMMIT_TS_TRUNCATE, main=b"\x01"))
