"""GiST records without page effects, and records naming a page they cannot change.

PAGE_REUSE (a hot-standby conflict point) and ASSIGN_LSN (wal_level = minimal only) register
no block: WAL ingest stores nothing for them and reading pages is unaffected. A record of
those types that did name a block, or an SP-GiST/GiST record of an unknown type, is an error
naming the resource manager, the record and its LSN, never a page.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import trio

from pageserver.pgdatadir import Datadir, RelTag
from pageserver.storage.config import StorageConfig
from pageserver.storage.key import rel_block_key
from pageserver.storage.reconstruct import PageReconstructError
from pageserver.storage.value import PostgresRecord
from pageserver.tenant import Tenant
from pageserver.walingest import WalIngest
from pageserver.walredo import bufpage as bp
from pageserver.walredo import gist, spgist
from pageserver.walredo.manager import PostgresRedoManager
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from protocol.wal.encoder import BlockSpec, build_record
from protocol.wal.record import DecodedRecord, RelFileNode, decode_record
from protocol.wal.rmgr import XLOG_GIST_ASSIGN_LSN, XLOG_GIST_PAGE_REUSE, RmgrId
from tests.pageserver.walredo_capture import bare_checkpoint

IDX = RelFileNode(1663, 5, 20000)
START = 0x100_0000


def _rec(lsn: int, rmid: int, info: int, main: bytes, blocks: list[BlockSpec] | None = None) -> DecodedRecord:
    raw = build_record(prev=0, rmid=rmid, info=info, main_data=main, blocks=blocks or [])
    return decode_record(raw, lsn, (lsn + len(raw) + 7) & ~7)


def _page_reuse_main() -> bytes:
    return struct.pack("<IIIIQ", IDX.spc, IDX.db, IDX.rel, 3, 1234)


def test_blockless_gist_records_are_ingested_and_store_nothing(tmp_path: Path) -> None:
    async def run() -> None:
        tenant = Tenant(tmp_path, TenantId.generate(), StorageConfig(validate_get=True, double_buffering=False), redo=PostgresRedoManager())
        tl = await tenant.create_timeline(TimelineId.generate())
        ing = WalIngest(tl)
        mod = ing.w.begin(Lsn(START))
        mod.put_checkpoint(bare_checkpoint())
        await mod.put_dbdir_creation(IDX.spc, IDX.db)
        await mod.commit()
        page = gist_leaf_page()
        lsn = START + 0x100
        first = _rec(lsn, RmgrId.XLOG, 0xB0, b"", [BlockSpec(IDX, 0, image=bytes(page))])  # XLOG/FPI
        assert await ing.ingest_record(first)
        before = ing.stats.values
        reuse = _rec(first.end_lsn, RmgrId.GIST, XLOG_GIST_PAGE_REUSE, _page_reuse_main())
        assign = _rec(reuse.end_lsn, RmgrId.GIST, XLOG_GIST_ASSIGN_LSN, struct.pack("<i", 0))
        assert await ing.ingest_record(reuse)
        assert await ing.ingest_record(assign)
        assert tl.last_record_lsn == assign.end_lsn
        assert ing.stats.values == before  # no value stored for either
        got = await Datadir(tl).get_page(RelTag(IDX.spc, IDX.db, IDX.rel, 0), 0, Lsn(assign.end_lsn))
        want = bytearray(page)
        bp.page_set_lsn(want, first.end_lsn)
        assert got == bytes(want)
        await tenant.shutdown()

    trio.run(run)


def gist_leaf_page() -> bytearray:
    page = bytearray(bp.BLCKSZ)
    gist.init_page(page, gist.F_LEAF)
    return page


@pytest.mark.parametrize(
    ("rmid", "info", "main", "name"),
    [
        (RmgrId.GIST, XLOG_GIST_PAGE_REUSE, _page_reuse_main(), "Gist/PAGE_REUSE"),
        (RmgrId.GIST, XLOG_GIST_ASSIGN_LSN, struct.pack("<i", 0), "Gist/ASSIGN_LSN"),
        (RmgrId.GIST, 0x40, b"", "Gist/UNKNOWN"),
        (RmgrId.SPGIST, 0x00, b"", "SPGist/UNKNOWN"),
        (RmgrId.SPGIST, 0x90, b"", "SPGist/UNKNOWN"),
    ],
)
def test_records_that_change_no_page_fail_on_one(rmid: int, info: int, main: bytes, name: str) -> None:
    page = gist_leaf_page() if rmid == RmgrId.GIST else bytearray(bp.BLCKSZ)
    if rmid == RmgrId.SPGIST:
        spgist.init_page(page, spgist.SPGIST_LEAF)
    rec = _rec(START, rmid, info, main, [BlockSpec(IDX, 0)])
    key = rel_block_key(IDX.spc, IDX.db, IDX.rel, 0, 0)
    with pytest.raises(PageReconstructError, match=rf"{name}.*record ending at"):
        PostgresRedoManager().apply(key, bytes(page), [(Lsn(rec.end_lsn), PostgresRecord(False, rec.raw))])


def test_spgist_metapage_cache_is_accepted_only_as_postgres_has_it() -> None:
    """The oracle's SP-GiST metapage rule: differences confined to the last-used-page cache
    pass when the served page equals the standby's; anything else is still a difference."""
    from bench.oracle import _spgist_meta_as_postgres
    from pageserver.walredo.mask import spg_mask

    meta = bytearray(bp.BLCKSZ)
    spgist.init_page(meta, spgist.SPGIST_META)
    struct.pack_into("<I", meta, 24, 0xBA0BABEE)
    bp.set_lower(meta, 24 + 4 + 64)
    served = bytes(meta)
    local = bytearray(meta)
    struct.pack_into("<Ii", local, 28, 7, 4000)  # the primary cached block 7 with free space
    assert _spgist_meta_as_postgres(served, bytes(local), served, spg_mask)
    assert not _spgist_meta_as_postgres(served, bytes(local), None, spg_mask)  # no standby: no excuse
    assert not _spgist_meta_as_postgres(served, bytes(local), bytes(local), spg_mask)  # standby differs
    local[24] ^= 1  # the magic number is not part of the cache
    assert not _spgist_meta_as_postgres(served, bytes(local), served, spg_mask)
