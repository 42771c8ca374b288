"""Import of an initdb data directory: every relation's size and every block equal the files.

Also: pg_control parses and re-encodes byte for byte, the directories list what is on disk,
SLRU segments and relmapper files come back unchanged, and a tar of the same directory
imports to the same values.
"""

from __future__ import annotations

import os
import re
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pageserver.import_datadir import DatadirImportError, bootstrap_timeline, import_datadir
from pageserver.pg_control import (
    PG_CONTROL_FILE_SIZE,
    CheckPoint,
    DBState,
    encode_control_file,
    parse_control_file,
)
from pageserver.pgdatadir import (
    DEFAULTTABLESPACE_OID,
    GLOBALTABLESPACE_OID,
    Datadir,
    RelTag,
    decode_db_dir,
    decode_rel_dir,
    decode_u32_set,
    encode_db_dir,
    encode_rel_dir,
    encode_u32_set,
)
from pageserver.storage.config import StorageConfig
from pageserver.storage.key import SLRU_CLOG, SLRU_MULTIXACT_MEMBERS, SLRU_MULTIXACT_OFFSETS
from pageserver.tenant import Tenant
from pageserver.walredo.manager import PostgresRedoManager
from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from tests.tmpdirs import pg_tmpdir

CONFIG = StorageConfig(validate_get=True, double_buffering=False)
_REL = re.compile(r"^(\d+)(?:_(fsm|vm|init))?$")
_FORK = {None: 0, "fsm": 1, "vm": 2, "init": 3}


# --- codecs (no PostgreSQL needed) ---------------------------------------------------------------


@given(st.dictionaries(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)), st.booleans()))
def test_db_dir_roundtrip(dbs: dict[tuple[int, int], bool]) -> None:
    assert decode_db_dir(encode_db_dir(dbs)) == dbs


@given(st.sets(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 3))))
def test_rel_dir_roundtrip(rels: set[tuple[int, int]]) -> None:
    assert decode_rel_dir(encode_rel_dir(rels)) == rels


@given(st.sets(st.integers(0, 2**32 - 1)))
def test_u32_set_roundtrip(items: set[int]) -> None:
    assert decode_u32_set(encode_u32_set(items)) == items


@given(st.binary(max_size=64))
def test_hostile_directory_values(data: bytes) -> None:
    for decode in (decode_db_dir, decode_rel_dir, decode_u32_set):
        try:
            decode(data)
        except RemoteProtocolError as exc:
            assert exc.sqlstate == "XX001"


@given(st.binary(min_size=0, max_size=400))
def test_hostile_control_file(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        parse_control_file(data)


_u32 = st.integers(0, 2**32 - 1)
_u64 = st.integers(0, 2**64 - 1)


@given(
    st.builds(
        CheckPoint, _u64, _u32, _u32, st.booleans(), _u64, _u32, _u32, _u32, _u32, _u32, _u32,
        _u32, st.integers(-(2**63), 2**63 - 1), _u32, _u32, _u32,
    )
)
def test_checkpoint_roundtrip(cp: CheckPoint) -> None:
    raw = cp.encode()
    assert len(raw) == 88
    assert CheckPoint.decode(raw) == cp


# --- against a real initdb ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def initdb_dir() -> Iterator[Path]:
    from compute.postgres import initdb

    with pg_tmpdir("pagestore-import-") as root:
        initdb(root / "pgdata")
        yield root / "pgdata"


def _files_of(pgdata: Path) -> dict[RelTag, bytes]:
    """Relation forks on disk (no segment files in an initdb directory)."""
    out: dict[RelTag, bytes] = {}
    for sub, spc, db in [("global", GLOBALTABLESPACE_OID, 0)] + [
        (f"base/{d}", DEFAULTTABLESPACE_OID, int(d)) for d in os.listdir(pgdata / "base")
    ]:
        for name in os.listdir(pgdata / sub):
            m = _REL.match(name)
            if m:
                out[RelTag(spc, db, int(m.group(1)), _FORK[m.group(2)])] = (pgdata / sub / name).read_bytes()
    return out


async def _check_matches_files(tenant: Tenant, tl_id: TimelineId, pgdata: Path) -> None:
    tl = tenant.timelines[tl_id]
    dd = Datadir(tl)
    lsn = tl.last_record_lsn
    files = _files_of(pgdata)
    dbs = await dd.list_dbs(lsn)
    want_dbs = {(DEFAULTTABLESPACE_OID, int(d)) for d in os.listdir(pgdata / "base")}
    want_dbs.add((GLOBALTABLESPACE_OID, 0))
    assert set(dbs) == want_dbs
    assert all(dbs.values())  # every database has a relmapper file
    listed: set[RelTag] = set()
    for spc, db in dbs:
        listed |= await dd.list_rels(spc, db, lsn)
    assert listed == set(files)
    nblocks = 0
    for rel, data in sorted(files.items()):
        n = len(data) // 8192
        assert await dd.get_rel_size(rel, lsn) == n, rel
        assert await dd.rel_exists(rel, lsn)
        pages = await dd.get_pages(rel, list(range(n + 1)), lsn)
        for b in range(n):
            assert pages[b] == data[b * 8192 : (b + 1) * 8192], (rel, b)
        assert pages[n] == bytes(8192)  # past the end: zeros
        nblocks += n
    assert nblocks > 1000
    for spc, db in dbs:
        sub = "global" if spc == GLOBALTABLESPACE_OID else f"base/{db}"
        assert await dd.get_relmap_file(spc, db, lsn) == (pgdata / sub / "pg_filenode.map").read_bytes()
    for kind, sub in [
        (SLRU_CLOG, "pg_xact"),
        (SLRU_MULTIXACT_OFFSETS, "pg_multixact/offsets"),
        (SLRU_MULTIXACT_MEMBERS, "pg_multixact/members"),
    ]:
        segs = await dd.list_slru_segments(kind, lsn)
        assert segs == {int(n, 16) for n in os.listdir(pgdata / sub)}
        for segno in segs:
            assert await dd.get_slru_segment(kind, segno, lsn) == (pgdata / sub / f"{segno:04X}").read_bytes()
    control = (pgdata / "global/pg_control").read_bytes()
    assert await dd.get_control_file(lsn) == control
    cf = parse_control_file(control)
    cp = await dd.get_checkpoint(lsn)
    assert cp.redo == cf.checkpoint_copy.redo
    assert cp.next_oid == cf.checkpoint_copy.next_oid
    assert await dd.get_db_size(DEFAULTTABLESPACE_OID, 1, lsn) == sum(
        len(d) for r, d in files.items() if r.db == 1
    )


@pytest.mark.postgres
def test_control_file_roundtrip(initdb_dir: Path) -> None:
    raw = (initdb_dir / "global/pg_control").read_bytes()
    cf = parse_control_file(raw)
    assert cf.state == DBState.SHUTDOWNED
    assert cf.checkpoint == cf.checkpoint_copy.redo
    assert cf.blcksz == 8192 and cf.xlog_seg_size == 16 * 1024 * 1024
    assert encode_control_file(cf) == raw
    changed = attrs.evolve(cf, checkpoint=cf.checkpoint + 8, state=DBState.IN_PRODUCTION)
    enc = encode_control_file(changed)
    assert len(enc) == PG_CONTROL_FILE_SIZE
    assert parse_control_file(enc) == changed
    corrupt = bytearray(raw)
    corrupt[40] ^= 1
    with pytest.raises(RemoteProtocolError, match="checksum"):
        parse_control_file(corrupt)


@pytest.mark.postgres
async def test_import_initdb_matches_files(initdb_dir: Path, tmp_path: Path) -> None:
    tenant = Tenant(tmp_path / "t", TenantId.generate(), CONFIG, redo=PostgresRedoManager())
    tl_id = TimelineId.generate()
    tl = await tenant.create_timeline(tl_id)
    result = await import_datadir(tl, initdb_dir)
    cf = parse_control_file((initdb_dir / "global/pg_control").read_bytes())
    assert result.base_lsn == cf.checkpoint
    # the shutdown checkpoint record itself was ingested from pg_wal
    assert result.end_lsn > cf.checkpoint
    assert tl.last_record_lsn == result.end_lsn
    await _check_matches_files(tenant, tl_id, initdb_dir)
    # durable: flush, reload the tenant from disk, same answers
    await tl.flush()
    await tenant.shutdown()
    tenant2 = await Tenant.load(tmp_path / "t", tenant.tenant_id, CONFIG, redo=PostgresRedoManager())
    assert tenant2.timelines[tl_id].last_record_lsn == result.end_lsn
    await _check_matches_files(tenant2, tl_id, initdb_dir)
    await tenant2.shutdown()


@pytest.mark.postgres
async def test_import_tar_equals_directory(initdb_dir: Path, tmp_path: Path) -> None:
    tar_path = tmp_path / "base.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.add(initdb_dir, arcname=".")
    tenant = Tenant(tmp_path / "t", TenantId.generate(), CONFIG, redo=PostgresRedoManager())
    tl_id = TimelineId.generate()
    tl = await tenant.create_timeline(tl_id)
    result = await import_datadir(tl, tar_path)
    assert result.end_lsn > result.base_lsn
    await _check_matches_files(tenant, tl_id, initdb_dir)
    await tenant.shutdown()


@pytest.mark.postgres
async def test_import_refuses_running_cluster(initdb_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(initdb_dir, copy)
    raw = (copy / "global/pg_control").read_bytes()
    cf = parse_control_file(raw)
    (copy / "global/pg_control").write_bytes(
        encode_control_file(attrs.evolve(cf, state=DBState.IN_PRODUCTION))
    )
    tenant = Tenant(tmp_path / "t", TenantId.generate(), CONFIG)
    tl = await tenant.create_timeline(TimelineId.generate())
    with pytest.raises(DatadirImportError, match="not shut down cleanly"):
        await import_datadir(tl, copy)
    with pytest.raises(DatadirImportError, match="neither"):
        await import_datadir(tl, tmp_path / "missing")
    await tenant.shutdown()


def _hostile_copy(initdb_dir: Path, dest: Path, damage: str) -> Path:
    """A copy of the initdb directory (or a tar of it) damaged in one way."""
    if damage.startswith("tar-truncated"):
        full = dest.with_suffix(".full.tar")
        with tarfile.open(full, "w") as tar:
            tar.add(initdb_dir, arcname=".")
        raw = full.read_bytes()
        dest = dest.with_suffix(".tar")
        dest.write_bytes(raw[: len(raw) * int(damage.rsplit("-", 1)[1]) // 100])
        return dest
    shutil.copytree(initdb_dir, dest)
    control = dest / "global/pg_control"
    cf = parse_control_file(control.read_bytes())
    match damage:
        case "pg_control-checksum":
            flipped = bytearray(control.read_bytes())
            flipped[40] ^= 1
            control.write_bytes(flipped)
        case "pg_control-short":
            control.write_bytes(b"x")
        case "no-wal":
            shutil.rmtree(dest / "pg_wal")
            (dest / "pg_wal").mkdir()
        case "oid-too-big":
            (dest / "base/1/4294967296").write_bytes(bytes(8192))
        case "db-oid-too-big":
            (dest / "base/99999999999").mkdir()
        case "segment-too-far":
            (dest / "base/1/16000.40000").write_bytes(b"")
        case "label-bad-lsn":
            (dest / "backup_label").write_bytes(b"START WAL LOCATION: 123456789/0 (file x)\n")
        case "label-without-backup-end":
            # A shut-down cluster's WAL has no end-of-backup record: as a base backup it is
            # not known to be consistent.
            redo = cf.checkpoint_copy.redo
            (dest / "backup_label").write_text(
                f"START WAL LOCATION: {redo >> 32:X}/{redo & 0xFFFF_FFFF:X} (file x)\n"
            )
        case "standby-label-short-wal":
            redo = cf.checkpoint_copy.redo
            (dest / "backup_label").write_text(
                f"START WAL LOCATION: {redo >> 32:X}/{redo & 0xFFFF_FFFF:X} (file x)\n"
                "BACKUP FROM: standby\n"
            )
            control.write_bytes(
                encode_control_file(attrs.evolve(cf, min_recovery_point=cf.checkpoint + (1 << 24)))
            )
        case _:
            raise AssertionError(damage)
    return dest


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("tar-truncated-30", "damaged archive"),
        ("tar-truncated-95", "damaged archive"),
        ("pg_control-checksum", "pg_control: incorrect checksum"),
        ("pg_control-short", "pg_control: pg_control has 1 bytes"),
        ("no-wal", "before the end of the checkpoint record"),
        ("oid-too-big", "is not an OID"),
        ("db-oid-too-big", "is not an OID"),
        ("segment-too-far", "MaxBlockNumber"),
        ("label-bad-lsn", "backup_label: invalid LSN"),
        ("label-without-backup-end", "without the end-of-backup record"),
        ("standby-label-short-wal", "before its minimum recovery point"),
    ],
)
async def test_import_hostile_source_is_a_clear_error(
    initdb_dir: Path, tmp_path: Path, damage: str, message: str
) -> None:
    """Whatever is wrong with the source is a DatadirImportError (an HTTP 400), never a
    tarfile/struct error (a 500) and never a silently incomplete timeline."""
    source = _hostile_copy(initdb_dir, tmp_path / "src", damage)
    tenant = Tenant(tmp_path / "t", TenantId.generate(), CONFIG)
    tl = await tenant.create_timeline(TimelineId.generate())
    with pytest.raises(DatadirImportError, match=message):
        await import_datadir(tl, source)
    await tenant.shutdown()


@pytest.mark.postgres
@pytest.mark.parametrize("as_tar", [False, True])
async def test_import_reads_wal_off_the_trio_thread(
    initdb_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_tar: bool
) -> None:
    """An import must not stall the page service: its 16 MiB WAL segment reads happen in
    worker threads, like its relation file reads."""
    import threading

    from pageserver import import_datadir as mod

    trio_thread = threading.current_thread()
    reads: list[int] = []
    for cls in (mod._DirSource, mod._TarSource):
        real = cls.wal_segment

        def checked(self: mod._Source, segno: int, real: Any = real) -> bytes | None:
            assert threading.current_thread() is not trio_thread, f"segment {segno} read on the trio thread"
            reads.append(segno)
            data: bytes | None = real(self, segno)
            return data

        monkeypatch.setattr(cls, "wal_segment", checked)
    source = initdb_dir
    if as_tar:
        source = tmp_path / "base.tar"
        with tarfile.open(source, "w") as tar:
            tar.add(initdb_dir, arcname=".")
    tenant = Tenant(tmp_path / "t", TenantId.generate(), CONFIG)
    tl = await tenant.create_timeline(TimelineId.generate())
    result = await import_datadir(tl, source)
    assert result.end_lsn > result.control.checkpoint
    assert reads and reads == sorted(set(reads))  # each segment read once, in order
    await tenant.shutdown()


@pytest.mark.postgres
async def test_bootstrap_timeline(tmp_path: Path) -> None:
    tenant = Tenant(tmp_path / "t", TenantId.generate(), CONFIG, redo=PostgresRedoManager())
    tl_id = TimelineId.generate()
    tl, result = await bootstrap_timeline(tenant, tl_id)
    assert tl.disk_consistent_lsn == result.end_lsn == tl.last_record_lsn
    dd = Datadir(tl)
    dbs = await dd.list_dbs(tl.last_record_lsn)
    assert (GLOBALTABLESPACE_OID, 0) in dbs and (DEFAULTTABLESPACE_OID, 1) in dbs
    # pg_class of template1 is there and non-empty
    assert await dd.get_rel_size(RelTag(DEFAULTTABLESPACE_OID, 1, 1259, 0), tl.last_record_lsn) > 0
    await tenant.shutdown()


@pytest.mark.postgres
@pytest.mark.parametrize("wal_method", ["fetch", "stream"])
async def test_import_pg_basebackup_tar(initdb_dir: Path, pg_tmp_path: Path, wal_method: str) -> None:
    """A ``pg_basebackup -Ft`` of a running server (WAL inside ``base.tar`` with ``-X fetch``,
    in ``pg_wal.tar`` beside it with ``-X stream``) imports at its START WAL LOCATION, its WAL
    makes it consistent, and the result equals the server's files once the server (idle since
    the backup) is shut down."""
    from compute.postgres import (
        PostgresInstance,
        chown_to_postgres,
        make_postgres_dir,
        pg_binary,
        run_as_postgres,
    )
    from tests.pageserver.test_walingest_pg import _compare_with_files

    pgdata = pg_tmp_path / "pg"
    shutil.copytree(initdb_dir, pgdata, symlinks=True)
    chown_to_postgres(pgdata)
    os.chmod(pgdata, 0o700)
    pg = PostgresInstance(datadir=pgdata, settings={"autovacuum": "off", "fsync": "off"})
    pg.start()
    try:
        pg.psql(
            "CREATE TABLE t (id int PRIMARY KEY, v text);"
            "INSERT INTO t SELECT g, repeat('v', 50) FROM generate_series(1, 3000) g;"
        )
        backup = make_postgres_dir(pg_tmp_path / "backup")
        run_as_postgres(
            [pg_binary("pg_basebackup"), "-h", "127.0.0.1", "-p", str(pg.port), "-U", "postgres",
             "-D", str(backup), "-Ft", "-X", wal_method, "-c", "fast"]
        )
        assert (backup / "pg_wal.tar").exists() == (wal_method == "stream")
        with tarfile.open(backup / "base.tar") as tar:
            label = tar.extractfile("backup_label")
            assert label is not None
            start_line = label.read().decode().splitlines()[0]
    finally:
        pg.stop("fast")
    tenant = Tenant(pg_tmp_path / "t", TenantId.generate(), CONFIG, redo=PostgresRedoManager())
    tl = await tenant.create_timeline(TimelineId.generate())
    result = await import_datadir(tl, backup / "base.tar")
    assert start_line.startswith("START WAL LOCATION: ")
    assert start_line.split()[3] == f"{result.base_lsn >> 32:X}/{result.base_lsn & 0xFFFF_FFFF:X}"
    assert result.end_lsn > result.control.checkpoint
    dd = Datadir(tl)
    user_rels = [r for r in await dd.list_rels(DEFAULTTABLESPACE_OID, 5, tl.last_record_lsn) if r.rel >= 16384]
    assert len(user_rels) >= 2  # the table and its primary key, created before the backup
    await _compare_with_files(tl, pgdata, set())
    await tenant.shutdown()
