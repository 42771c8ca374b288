"""Hash index redo (rmid 12) against the installed PostgreSQL 15.

One PostgreSQL runs with ``wal_consistency_checking = 'all'`` (every block reference carries
the page as the primary left it) while hash indexes are created EMPTY and then filled (bucket
splits, split points and masks moving), overflowed (a long same-key chain), vacuumed
(bucket cleanup, squeeze: tuples moved and overflow pages freed, the metapage's tuple count
updated), refilled (freed overflow pages reused through the bitmap), cleaned at insert time
(LP_DEAD items removed: VACUUM_ONE_PAGE), emptied, truncated and built unlogged (init fork).
A split is arranged right after a CHECKPOINT so the old bucket arrives as an applied image
that redo must change on top of.

- every record is replayed page by page and each replayed page is compared (hash_mask) with
  its verification image; each record type, and each variant of a record's layout, must
  have been checked, so the test cannot pass on a workload that missed one;
- after a CHECKPOINT every replayed index page equals the index file's page (masked);
- the same records fed through WAL ingest come back from ``Datadir.get_page`` equal to the
  files: ingest stores them under every block they reference (lock-only and data-less ones
  included) and reads need nothing but the stored raw records;
- hostile records (truncated or garbled data, missing blocks) raise ``RedoError`` naming
  the record, never a wrong page or an IndexError.
"""

from __future__ import annotations

import struct
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compute.postgres import PostgresInstance
from pageserver.storage.key import rel_block_key
from pageserver.storage.reconstruct import PageReconstructError
from pageserver.storage.value import PostgresRecord
from pageserver.walredo import bufpage as bp
from pageserver.walredo import hash as hh
from pageserver.walredo.errors import RedoError
from pageserver.walredo.manager import PostgresRedoManager, RelBlock
from pageserver.walredo.mask import hash_mask
from pageserver.walredo.verify import VERIFY_SETTINGS, VerifyReport, read_wal, verify_records
from protocol.lsn import Lsn, parse_lsn
from protocol.wal.encoder import BlockSpec, build_record
from protocol.wal.record import DecodedRecord, RelFileNode, decode_record
from protocol.wal.rmgr import RmgrId
from tests.pageserver.index_redo import (
    Pages,
    compare_with_files,
    ingest_and_read,
    relfilenodes_of_am,
    unbuilt_blocks,
)
from tests.tmpdirs import pg_tmpdir

pytestmark = pytest.mark.postgres

SETTINGS = {**VERIFY_SETTINGS, "shared_buffers": "64MB"}

WORKLOAD_SQL = [
    # created empty, then filled: bucket splits (split points and masks move), INSERTs
    "CREATE TABLE h (k int, pad int DEFAULT 0)",
    # vacuumed while empty, the table's estimate is 0 rows: 2 buckets (never vacuumed, 8), so
    # 2500 rows reach buckets 4 and 8, new doublings
    "VACUUM h",
    "CREATE INDEX h_k ON h USING hash (k)",
    "INSERT INTO h (k) SELECT g FROM generate_series(1, 2500) g",
    # one key: a long overflow chain (ADD_OVFL_PAGE); delete 2 of 3, VACUUM: bucket cleanup
    # (DELETE), squeeze (MOVE_PAGE_CONTENTS, SQUEEZE_PAGE), UPDATE_META_PAGE
    "CREATE TABLE o (k int)",
    "CREATE INDEX o_k ON o USING hash (k)",
    "INSERT INTO o SELECT 7 FROM generate_series(1, 3000)",
    "DELETE FROM o WHERE ctid IN (SELECT ctid FROM o LIMIT 2000)",
    "VACUUM o",
    # refill: the freed overflow pages come back through the bitmap (bmpage_found)
    "INSERT INTO o SELECT 7 FROM generate_series(1, 1500)",
    "DELETE FROM h WHERE k % 3 = 0",
    "VACUUM h",
    # insert-time cleanup: scans mark LP_DEAD, a full page with dead items is cleaned
    "CREATE TABLE d (k int)",
    "CREATE INDEX d_k ON d USING hash (k)",
    "INSERT INTO d SELECT 1 FROM generate_series(1, 400)",
    "DELETE FROM d WHERE ctid IN (SELECT ctid FROM d LIMIT 390)",
    "SET enable_seqscan = off; SET enable_bitmapscan = off;"
    " SELECT count(*) FROM d WHERE k = 1; SELECT count(*) FROM d WHERE k = 1",
    "INSERT INTO d SELECT 1 FROM generate_series(1, 400)",
    # emptied, truncated (a new relfilenode: INIT_META_PAGE again), unlogged (init fork)
    "DELETE FROM o",
    "VACUUM o",
    "CREATE TABLE t (k int)",
    "CREATE INDEX t_k ON t USING hash (k)",
    "INSERT INTO t SELECT g FROM generate_series(1, 300) g",
    "TRUNCATE t",
    "INSERT INTO t SELECT g FROM generate_series(1, 300) g",
    "CREATE UNLOGGED TABLE u (k int)",
    "CREATE INDEX u_k ON u USING hash (k)",
    "INSERT INTO u SELECT g FROM generate_series(1, 100) g",
]

ALL_TYPES = [
    "INIT_META_PAGE", "INIT_BITMAP_PAGE", "INSERT", "ADD_OVFL_PAGE", "SPLIT_ALLOCATE_PAGE",
    "SPLIT_COMPLETE", "MOVE_PAGE_CONTENTS", "SQUEEZE_PAGE", "DELETE", "SPLIT_CLEANUP",
    "UPDATE_META_PAGE", "VACUUM_ONE_PAGE",
]


def _split_after_checkpoint(pg: PostgresInstance) -> None:
    """Fill ``f_k`` to just below its split threshold, CHECKPOINT, insert one row: the split
    that row triggers logs the old bucket page as an applied image (+FPI redo)."""
    pg.psql("CREATE EXTENSION IF NOT EXISTS pageinspect")
    pg.psql("CREATE TABLE f (k int)")
    pg.psql("CREATE INDEX f_k ON f USING hash (k)")
    key = 0
    for _ in range(3):
        row = pg.psql("SELECT ffactor, maxbucket, ntuples FROM hash_metapage_info(get_raw_page('f_k', 0))")
        ffactor, maxbucket, ntuples = (int(float(x)) for x in row.split("|"))
        n = ffactor * (maxbucket + 1) - ntuples
        pg.psql(f"INSERT INTO f SELECT g FROM generate_series({key + 1}, {key + n}) g")
        key += n
        pg.psql("CHECKPOINT")
        key += 1
        pg.psql(f"INSERT INTO f VALUES ({key})")


@attrs.frozen
class HashRun:
    pg: PostgresInstance
    recs: list[DecodedRecord]  # the records that touch hash index relations
    report: VerifyReport


@pytest.fixture(scope="module")
def hash_wal() -> Iterator[HashRun]:
    with pg_tmpdir("pagestore-redo-hash-") as base:
        pg = PostgresInstance.create(base / "data", settings=SETTINGS)
        try:
            pg.start()
            pg.psql("CHECKPOINT")
            start = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
            t0 = time.monotonic()
            for sql in WORKLOAD_SQL:
                pg.psql(sql)
            _split_after_checkpoint(pg)
            end = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
            pg.psql("CHECKPOINT")
            print(f"workload took {time.monotonic() - t0:.1f}s, WAL {(end - start) / 2**20:.1f} MiB")
            t0 = time.monotonic()
            # Pages are tracked per block, so the heap's records (checked by the heap tests)
            # can be left out: keep those whose blocks are all of relations hash records name.
            recs = list(read_wal(pg.wal_dir(), start, end))
            rels = {b.rel for r in recs if r.xl_rmid == RmgrId.HASH for b in r.blocks}
            mine = [r for r in recs if r.blocks and all(b.rel in rels for b in r.blocks)]
            report = verify_records(mine)
            print(report.summary())
            print(f"verified {len(mine)} of {len(recs)} records in {time.monotonic() - t0:.1f}s")
            yield HashRun(pg, mine, report)
        finally:
            pg.destroy()


def _variants(recs: list[DecodedRecord]) -> Counter[str]:
    """Layout variants of the records, from their main data and block lists."""
    seen: Counter[str] = Counter()
    for r in recs:
        if r.xl_rmid != RmgrId.HASH:
            continue
        t = r.record_type
        ids = {b.block_id for b in r.blocks}
        main = r.main_data
        if t == "ADD_OVFL_PAGE":
            seen["ADD_OVFL_PAGE bitmap bit reused" if main[2] else "ADD_OVFL_PAGE new bit"] += 1
        elif t == "SPLIT_ALLOCATE_PAGE":
            if main[8] & hh.SPLIT_META_UPDATE_MASKS:
                seen["SPLIT_ALLOCATE_PAGE masks"] += 1
            if main[8] & hh.SPLIT_META_UPDATE_SPLITPOINT:
                seen["SPLIT_ALLOCATE_PAGE splitpoint"] += 1
            b0 = r.block(0)
            if b0 is not None and b0.apply_image:
                seen["SPLIT_ALLOCATE_PAGE old bucket image"] += 1
        elif t in ("MOVE_PAGE_CONTENTS", "SQUEEZE_PAGE", "DELETE") and 0 in ids:
            seen[f"{t} lock-only primary"] += 1
        if t == "SQUEEZE_PAGE":
            seen["SQUEEZE_PAGE prev is write page" if main[11] else "SQUEEZE_PAGE prev page"] += 1
            if 4 in ids:
                seen["SQUEEZE_PAGE next page"] += 1
        if r.blocks and r.blocks[0].forknum == 3:
            seen[f"{t} init fork"] += 1
    return seen


def test_every_hash_record_matches_its_verification_image(hash_wal: HashRun) -> None:
    recs, report = hash_wal.recs, hash_wal.report
    assert not report.failures, "\n".join(report.failures[:20])
    missing = [t for t in ALL_TYPES if report.checked[f"Hash/{t}"] == 0]
    assert not missing, f"never checked against a verification image: {missing}"
    # SPLIT_PAGE is FPI-only: its image is restored, never redone
    assert report.restored["Hash/SPLIT_PAGE"] > 0
    variants = _variants(recs)
    print(dict(variants))
    for v in (
        "ADD_OVFL_PAGE bitmap bit reused", "ADD_OVFL_PAGE new bit", "SPLIT_ALLOCATE_PAGE masks",
        "SPLIT_ALLOCATE_PAGE splitpoint", "SPLIT_ALLOCATE_PAGE old bucket image",
        "SQUEEZE_PAGE lock-only primary", "DELETE lock-only primary", "SQUEEZE_PAGE prev is write page",
        "SQUEEZE_PAGE prev page", "INIT_META_PAGE init fork",
        "INIT_BITMAP_PAGE init fork",
    ):
        assert variants[v] > 0, f"the workload wrote no {v}"


def test_replayed_hash_pages_equal_the_index_files(hash_wal: HashRun) -> None:
    pg, report = hash_wal.pg, hash_wal.report
    rels = relfilenodes_of_am(pg, "hash")
    assert {"h_k", "o_k", "d_k", "f_k", "u_k", "t_k"} <= set(rels.values())
    assert not report.failures
    pages: Pages = {t: p for t, p in report.pages.items() if t.rel in rels and t.fork != 1}
    compared, differ = compare_with_files(pg, pages, hash_mask)
    print(f"compared {compared} hash index pages with the files; {len(differ)} differ")
    db = next(iter(pages)).db
    for rel, name in rels.items():
        # blocks inside a split point's range that no record touched stay zeros on disk
        unbuilt = unbuilt_blocks(pg, pages, db, rel)
        assert not unbuilt, f"{name}: (fork, block) {unbuilt[:10]} were never rebuilt"
    assert compared > 50
    assert not differ, differ[:20]


def test_ingested_hash_records_are_readable(hash_wal: HashRun, tmp_path: Path) -> None:
    """WAL ingest stores the hash records raw under every block they name (lock-only and
    data-less ones included); reads rebuild the pages from them alone."""
    pg = hash_wal.pg
    # every index but h_k (2,500 plain INSERTs, the bulk of the run and the slowest to ingest)
    rels = {rel: name for rel, name in relfilenodes_of_am(pg, "hash").items() if name != "h_k"}
    mine = [r for r in hash_wal.recs if all(b.rel in rels for b in r.blocks)]
    missing = set(ALL_TYPES) - {r.record_type for r in mine if r.xl_rmid == RmgrId.HASH}
    assert not missing
    lock_only = sum(1 for r in mine if r.xl_rmid == RmgrId.HASH for b in r.blocks if not b.has_data and not b.apply_image)
    assert lock_only > 0
    errors, pages = ingest_and_read(tmp_path, mine, rels, unsupported=RmgrId.HASH)
    # stored before this redo existed, the same values failed, naming the record and its LSN
    assert errors and all("no redo for resource manager Hash (Hash/" in e and "record ending at" in e for e in errors), errors[:3]
    compared, differ = compare_with_files(pg, pages, hash_mask)
    print(f"ingested and read back {compared} hash index pages; {len(differ)} differ")
    assert compared > 50
    assert not differ, differ[:20]


# --- synthetic records: the +FPI path and hostile input ------------------------------------

REL = RelFileNode(1663, 5, 16400)
LSN0 = 0x200_0000


def _decode(raw: bytes) -> DecodedRecord:
    return decode_record(raw, LSN0, (LSN0 + len(raw) + 7) & ~7)


def _bucket_page(flag: int = hh.LH_BUCKET_PAGE, ntup: int = 3) -> bytearray:
    page = bytearray(bp.BLCKSZ)
    hh.init_buf(page, 1, 0, flag)
    for i in range(ntup):
        tup = struct.pack("<HHHHI4x", 0, 1, i + 1, 16, 1000 + i)
        assert bp.page_add_item(page, tup, i + 1, overwrite=False, is_heap=False) == i + 1
    return page


def test_split_allocate_changes_the_old_bucket_on_top_of_its_image() -> None:
    """PostgreSQL redoes SPLIT_ALLOCATE_PAGE's old bucket even when its image was restored."""
    old = _bucket_page()
    main = struct.pack("<IHHB", 3, hh.LH_BUCKET_PAGE | hh.LH_BUCKET_BEING_SPLIT, hh.LH_BUCKET_PAGE | hh.LH_BUCKET_BEING_POPULATED, 0)
    raw = build_record(prev=0, rmid=RmgrId.HASH, info=0x40, blocks=[
        BlockSpec(REL, 1, image=bytes(old)),
        BlockSpec(REL, 4, will_init=True),
        BlockSpec(REL, 0, data=b""),
    ], main_data=main)
    rec = _decode(raw)
    mgr = PostgresRedoManager()
    page = mgr.redo_page(RelBlock(1663, 5, 16400, 0, 1), None, rec)
    assert page is not None
    prev, _nxt, _bucket, flag, _pid = hh._OPAQUE.unpack_from(page, hh.SPECIAL)
    assert (prev, flag) == (3, hh.LH_BUCKET_PAGE | hh.LH_BUCKET_BEING_SPLIT)
    assert bp.page_get_lsn(page) == rec.end_lsn
    new = mgr.redo_page(RelBlock(1663, 5, 16400, 0, 4), None, rec)
    assert new is not None and hh._OPAQUE.unpack_from(new, hh.SPECIAL) == (3, hh.INVALID_BLOCK, 3, hh.LH_BUCKET_PAGE | hh.LH_BUCKET_BEING_POPULATED, hh.HASHO_PAGE_ID)


def test_squeeze_links_the_next_page_back() -> None:
    """SQUEEZE_PAGE block 4 (the freed page's successor; squeezes free the chain's tail, so
    real WAL has not shown one): its prev link becomes the freed page's predecessor."""
    nxt = _bucket_page(hh.LH_OVERFLOW_PAGE, ntup=1)
    raw = build_record(prev=0, rmid=RmgrId.HASH, info=0x80, blocks=[
        BlockSpec(REL, 40, data=b"", block_id=1), BlockSpec(REL, 42, block_id=2), BlockSpec(REL, 39, block_id=3),
        BlockSpec(REL, 43, block_id=4), BlockSpec(REL, 9, data=struct.pack("<I", 5), block_id=5),
    ], main_data=struct.pack("<IIHBB", 39, 43, 0, 1, 0))
    rec = _decode(raw)
    assert rec.block(4) is not None and rec.block(4).blkno == 43  # type: ignore[union-attr]
    page = PostgresRedoManager().redo_page(RelBlock(1663, 5, 16400, 0, 43), nxt, rec)
    assert page is not None
    assert hh._OPAQUE.unpack_from(page, hh.SPECIAL)[0] == 39
    assert bp.page_get_lsn(page) == rec.end_lsn


def _meta_page() -> bytearray:
    page = bytearray(bp.BLCKSZ)
    rec = _decode(build_record(prev=0, rmid=RmgrId.HASH, info=0x00, blocks=[BlockSpec(REL, 0, will_init=True)],
                               main_data=struct.pack("<dIH", 0.0, 450, 307)))
    hh.init_metapage(page, 0.0, 450, 307, rec)
    return page


@pytest.mark.parametrize(
    ("info", "main", "target_id", "data", "base"),
    [
        (0x20, b"\x01", 1, b"", "bucket"),  # INSERT: main data truncated
        (0x20, b"\x01\x00", 1, b"\x00" * 5, "bucket"),  # INSERT: tuple truncated
        (0x20, b"\x01\x00", 1, struct.pack("<HHHHI4x", 0, 1, 1, 40, 5), "bucket"),  # t_info size lies
        (0x20, b"\x09\x00", 1, struct.pack("<HHHHI4x", 0, 1, 1, 16, 5), "bucket"),  # offnum past maxoff+1
        (0x20, b"\x01\x00", 1, struct.pack("<HHHHI4x", 0, 1, 1, 16, 5), "zeros"),  # not a hash page
        (0x70, b"\x02\x00\x01", 1, b"\x01\x00", "bucket"),  # MOVE: offsets truncated
        (0x70, b"\x01\x00\x01", 1, b"\x01\x00" + b"\x00" * 6, "bucket"),  # MOVE: tuple truncated
        (0x70, b"\x01\x00\x01", 2, b"\x09\x00\x0a\x00\x0b\x00", "bucket"),  # MOVE: delete bad offsets
        (0x90, b"\x01\x01", 2, b"\x01\x00\x02", "bucket"),  # DELETE: odd offset array
        (0x30, b"\x00\x10\x00", 2, b"\xff\xff\xff\x7f", "meta"),  # ADD_OVFL: bit far past the bitmap
        (0x30, b"\x00\x10\x00", 4, b"", "meta"),  # ADD_OVFL: metapage's first-free bit missing
        (0xC0, struct.pack("<Ii", 0, 50) + b"\x01\x00", 1, b"", "bucket"),  # VACUUM_ONE_PAGE: offsets cut
        (0x50, b"", 1, b"", "bucket"),  # SPLIT_PAGE without its image
        (0xB0, b"\x00\x00", 1, b"", "meta"),  # UPDATE_META_PAGE: ntuples cut
        (0xB0, b"\x00" * 8, 1, b"", "bucket"),  # UPDATE_META_PAGE on a bucket page
        (0x00, struct.pack("<dIH", 1e6, 450, 0), 1, b"", "zeros"),  # INIT_META_PAGE: fill factor 0
        (0xF0, b"", 1, b"", "bucket"),  # unknown record type
    ],
)
def test_hostile_hash_records_raise_redo_error(info: int, main: bytes, target_id: int, data: bytes, base: str) -> None:
    """The requested page is block ``target_id`` (blocks before it carry 4 harmless bytes)."""
    blocks = [BlockSpec(REL, 100 + i, data=data if i == target_id else b"\x00\x00\x00\x00", will_init=(info == 0x00 and i == target_id)) for i in range(target_id + 1)]
    raw = build_record(prev=0, rmid=RmgrId.HASH, info=info, blocks=blocks, main_data=main)
    rec = _decode(raw)
    page = {"bucket": _bucket_page(), "meta": _meta_page(), "zeros": bytearray(bp.BLCKSZ)}[base]
    mgr = PostgresRedoManager()
    with pytest.raises(RedoError, match=r"Hash/") as exc:
        mgr.redo_page(RelBlock(1663, 5, 16400, 0, 100 + target_id), page, rec)
    assert "record ending at" in str(exc.value)


def test_unknown_and_missing_redo_is_named() -> None:
    """The error names the resource manager, the record and its LSN (via PageReconstructError)."""
    raw = build_record(prev=0, rmid=RmgrId.HASH, info=0x50, blocks=[BlockSpec(REL, 7, data=b"")])
    key = rel_block_key(1663, 5, 16400, 0, 7)
    mgr = PostgresRedoManager()
    with pytest.raises(PageReconstructError, match=r"SPLIT_PAGE.*record ending at"):
        mgr.apply(key, bytes(_bucket_page()), [(Lsn(LSN0 + 64), PostgresRecord(False, raw))])


def _bitmap_page() -> bytearray:
    page = bytearray(bp.BLCKSZ)
    rec = _decode(build_record(prev=0, rmid=RmgrId.HASH, info=0x10, blocks=[BlockSpec(REL, 0, will_init=True)],
                               main_data=b"\x00\x10"))
    hh.init_bitmap(page, 4096, rec)
    return page


@settings(max_examples=200, deadline=None)
@given(
    info=st.integers(0, 15).map(lambda i: i << 4),
    main=st.binary(max_size=40),
    data=st.binary(max_size=80),
    block_id=st.integers(0, 7),
    base=st.sampled_from(["bucket", "meta", "bitmap", "zeros"]),
    will_init=st.booleans(),
)
def test_garbage_hash_records_give_a_page_or_a_clear_error(
    info: int, main: bytes, data: bytes, block_id: int, base: str, will_init: bool
) -> None:
    """Random main and block data for every record type and block id: a page or
    PageReconstructError naming Hash, nothing else."""
    page = {"bucket": _bucket_page(), "meta": _meta_page(), "bitmap": _bitmap_page(), "zeros": bytearray(bp.BLCKSZ)}[base]
    raw = build_record(prev=0, rmid=RmgrId.HASH, info=info, blocks=[
        BlockSpec(REL, 7, data=data, will_init=will_init, block_id=block_id)], main_data=main)
    key = rel_block_key(1663, 5, 16400, 0, 7)
    try:
        out = PostgresRedoManager().apply(key, bytes(page), [(Lsn(LSN0 + 64), PostgresRecord(will_init, raw))])
    except PageReconstructError as exc:
        assert "Hash" in str(exc)
        return
    assert len(out) == bp.BLCKSZ
