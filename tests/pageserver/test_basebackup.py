"""Basebackup: the pg_wal segment and pg_control it writes, the tar layout, and (marked
``postgres``) a vanilla PostgreSQL 15 booting from it with no other WAL."""

from __future__ import annotations

import gzip
import io
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from compute.postgres import PostgresInstance, initdb, pg_binary, run_as_postgres
from pageserver.basebackup import (
    CHUNK_BYTES,
    BackupResult,
    RelFork,
    checkpoint_record_lsn,
    read_datadir_block,
    wal_segment_with_checkpoint,
    write_basebackup,
)
from pageserver.pg_control import CheckPoint, DBState, parse_control_file
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn, format_lsn, segment_file_name
from protocol.wal.page import record_end_lsn
from protocol.wal.reader import WalStreamDecoder
from protocol.wal.record import DecodedRecord
from protocol.wal.rmgr import XLOG_CHECKPOINT_SHUTDOWN, RmgrId
from tests.pageserver.basebackup_helpers import DirectorySource, unpack_tar
from tests.tmpdirs import pg_tmpdir

SYSID = 0x7312_3456_789A_BCDE


def _ckpt(redo: int) -> CheckPoint:
    return CheckPoint(redo, 1, 1, True, 741, 24576, 1, 0, 716, 1, 1, 1, 1_700_000_000, 0, 0, 0)


@pytest.mark.parametrize(
    "lsn, expected",
    [
        (0x0100_0000, 0x0100_0028),  # segment start: after the long header
        (0x0100_2000, 0x0100_2018),  # page start: after the short header
        (0x0100_2A38, 0x0100_2A38),  # inside a page: right there
        (0x0100_3FF8, 0x0100_3FF8),  # last 8 bytes of a page: the record header is split
    ],
)
def test_checkpoint_record_placement_and_decoding(lsn: int, expected: int) -> None:
    rec_lsn = checkpoint_record_lsn(lsn)
    assert rec_lsn == expected
    name, seg, start, end = wal_segment_with_checkpoint(
        Lsn(lsn), _ckpt(rec_lsn), system_identifier=SYSID, prev_lsn=0x0100_0000 - 0x100
    )
    assert name == "000000010000000000000001"
    assert len(seg) == WAL_SEGMENT_SIZE
    assert start == rec_lsn
    assert end == record_end_lsn(rec_lsn, 24 + 2 + 88)
    seg_start = 0x0100_0000
    # Read it the way PostgreSQL does at startup: random access at the checkpoint location,
    # with the page header of its page checked.
    page = rec_lsn - rec_lsn % 8192
    dec = WalStreamDecoder(rec_lsn, data_start=page)
    dec.feed(seg[page - seg_start :])
    rec = dec.next_record()
    assert isinstance(rec, DecodedRecord), rec
    assert (rec.lsn, rec.end_lsn) == (start, end)
    assert rec.xl_rmid == RmgrId.XLOG and rec.xl_info & 0xF0 == XLOG_CHECKPOINT_SHUTDOWN
    assert CheckPoint.decode(rec.main_data) == _ckpt(rec_lsn)
    assert rec.xl_prev == 0x0100_0000 - 0x100
    # The segment's first page carries the long header with our system identifier.
    assert seg[0:2] == b"\x10\xd1" and int.from_bytes(seg[24:32], "little") == SYSID
    # Nothing after the record: end of WAL.
    assert not any(seg[end - seg_start : end - seg_start + 64])


def test_unaligned_lsn_is_refused() -> None:
    from pageserver.basebackup import BasebackupError

    with pytest.raises(BasebackupError, match="not a record boundary"):
        checkpoint_record_lsn(0x0100_0004)


async def _backup(
    datadir: Path, lsn: Lsn, *, gzip_: bool = False, now: int | None = None
) -> tuple[bytes, BackupResult]:
    chunks: list[bytes] = []

    async def send(b: bytes) -> None:
        chunks.append(b)

    result = await write_basebackup(DirectorySource(datadir), lsn, send, gzip=gzip_, now=now)
    assert all(0 < len(c) <= CHUNK_BYTES for c in chunks)
    return b"".join(chunks), result


def _initdb_end_lsn(datadir: Path) -> Lsn:
    control = parse_control_file((datadir / "global" / "pg_control").read_bytes())
    return record_end_lsn(control.checkpoint, 24 + 2 + 88)


@pytest.fixture(scope="module")
def initdb_dir() -> Iterator[Path]:
    with pg_tmpdir("pagestore-bb-") as base:
        datadir = base / "initdb"
        initdb(datadir)
        yield datadir


@pytest.mark.postgres
def test_read_datadir_block_reads_the_relation_file(initdb_dir: Path) -> None:
    # the largest relation file of template1, so it has several blocks to tell apart
    path = max((f for f in (initdb_dir / "base" / "1").iterdir() if f.name.isdigit()), key=lambda f: f.stat().st_size)
    raw = path.read_bytes()
    nblocks = len(raw) // 8192
    assert nblocks >= 2
    rel = RelFork(1663, 1, int(path.name), 0)
    for blkno in (0, 1, nblocks - 1):
        assert read_datadir_block(initdb_dir, rel, blkno) == raw[blkno * 8192 : (blkno + 1) * 8192]
    with pytest.raises(EOFError):
        read_datadir_block(initdb_dir, rel, nblocks)


@pytest.mark.postgres
async def test_tar_layout_and_control_file(initdb_dir: Path) -> None:
    lsn = _initdb_end_lsn(initdb_dir)
    data, result = await _backup(initdb_dir, lsn)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        names = set(tf.getnames())
        control = parse_control_file(tf.extractfile("global/pg_control").read())  # type: ignore[union-attr]
        wal = tf.extractfile(f"pg_wal/{segment_file_name(result.checkpoint_lsn // WAL_SEGMENT_SIZE)}")
        assert wal is not None and len(wal.read()) == WAL_SEGMENT_SIZE
    for needed in ("PG_VERSION", "pg_hba.conf", "postgresql.conf", "pg_ident.conf", "global/pg_filenode.map",
                   "base/1/PG_VERSION", "base/1/pg_filenode.map", "pg_xact/0000", "pg_notify",
                   "pg_logical/snapshots", "pg_tblspc", "global/1262"):
        assert needed in names, needed
    assert control.state == DBState.SHUTDOWNED
    assert control.checkpoint == result.checkpoint_lsn == checkpoint_record_lsn(lsn)
    assert control.checkpoint_copy.redo == control.checkpoint
    src = parse_control_file((initdb_dir / "global" / "pg_control").read_bytes())
    assert control.checkpoint_copy.next_xid == src.checkpoint_copy.next_xid
    assert control.checkpoint_copy.next_oid == src.checkpoint_copy.next_oid
    assert control.system_identifier == src.system_identifier
    # Relation files are byte-identical to the source directory.
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        for name in ("global/1262", "base/1/1259", "base/1/1259_fsm", "base/1/2662"):
            member = tf.extractfile(name)
            assert member is not None
            assert member.read() == (initdb_dir / name).read_bytes(), name


@pytest.mark.postgres
async def test_gzip_variant_is_the_same_tar(initdb_dir: Path) -> None:
    lsn = _initdb_end_lsn(initdb_dir)
    plain, _ = await _backup(initdb_dir, lsn, now=1_700_000_000)
    packed, _ = await _backup(initdb_dir, lsn, gzip_=True, now=1_700_000_000)
    assert packed[:2] == b"\x1f\x8b"
    assert len(packed) < len(plain) // 4
    assert gzip.decompress(packed) == plain


@pytest.mark.postgres
async def test_postgres_boots_from_directory_backup(initdb_dir: Path, pg_tmp_path: Path) -> None:
    lsn = _initdb_end_lsn(initdb_dir)
    data, result = await _backup(initdb_dir, lsn)
    target = pg_tmp_path / "restored"
    unpack_tar(data, target)
    # pg_waldump agrees the segment holds exactly our checkpoint record.
    seg = next((target / "pg_wal").glob("0000000100000000000000*"))
    dump = run_as_postgres(
        [pg_binary("pg_waldump"), "-s", format_lsn(result.checkpoint_lsn), str(seg)], check=False
    )
    out = dump.stdout.decode()
    assert "CHECKPOINT_SHUTDOWN" in out, out + dump.stderr.decode()
    lsn_text = f"{result.checkpoint_lsn >> 32:X}/{result.checkpoint_lsn & 0xFFFFFFFF:08X}"
    assert f"lsn: {lsn_text}" in out
    pg = PostgresInstance(datadir=target)
    pg.start()
    try:
        assert int(pg.psql("SELECT count(*) FROM pg_class")) > 300
        assert pg.psql("SELECT pg_is_in_recovery()") == "f"
        pg.psql("CREATE TABLE t AS SELECT generate_series(1, 1000) AS x")
        assert pg.psql("SELECT sum(x) FROM t") == "500500"
        # PostgreSQL continued writing right after our checkpoint record.
        end = format_lsn(result.wal_end_lsn)
        assert pg.psql(f"SELECT pg_current_wal_lsn() > '{end}'::pg_lsn") == "t"
    finally:
        pg.stop()
