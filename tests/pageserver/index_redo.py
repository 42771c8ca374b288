"""Helpers shared by the real-WAL index redo tests (hash, generic): compare rebuilt pages with
PostgreSQL's files, and rebuild pages through WAL ingest and ``Datadir.get_page``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import trio

from compute.postgres import PostgresInstance
from pageserver.pgdatadir import Datadir, RelTag
from pageserver.storage.reconstruct import PageReconstructError
from pageserver.tenant import Tenant
from pageserver.walingest import WalIngest
from pageserver.walredo import bufpage as bp
from pageserver.walredo.manager import (
    ON_IMAGE_ROUTINES,
    REDO_ROUTINES,
    PostgresRedoManager,
    RelBlock,
)
from pageserver.walredo.mask import MaskFn, masked
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from protocol.wal.record import DecodedRecord
from tests.pageserver.test_walingest import CONFIG as INGEST_CONFIG
from tests.pageserver.test_walingest import _checkpoint

Pages = dict[RelBlock, bytes | bytearray]


def relfilenodes_of_am(pg: PostgresInstance, amname: str) -> dict[int, str]:
    rows = pg.psql(
        "SELECT c.relfilenode, c.relname FROM pg_class c JOIN pg_am a ON a.oid = c.relam"
        f" WHERE a.amname = '{amname}' AND c.relfilenode <> 0"
    )
    return {int(line.split("|")[0]): line.split("|")[1] for line in rows.splitlines()}


def file_page(pg: PostgresInstance, db: int, rel: int, fork: int, blkno: int) -> bytes | None:
    path = pg.datadir / "base" / str(db) / f"{rel}{('', '_fsm', '_vm', '_init')[fork]}"
    if not path.exists() or path.stat().st_size < (blkno + 1) * bp.BLCKSZ:
        return None
    with path.open("rb") as f:
        f.seek(blkno * bp.BLCKSZ)
        return f.read(bp.BLCKSZ)


def compare_with_files(pg: PostgresInstance, pages: Pages, mask: MaskFn) -> tuple[int, list[str]]:
    """(pages compared, those that differ masked); pages whose file block is gone are skipped."""
    compared = 0
    differ: list[str] = []
    for t, page in pages.items():
        disk = file_page(pg, t.db, t.rel, t.fork, t.blkno)
        if disk is None:
            continue
        compared += 1
        if bp.page_is_new(page) or bp.page_is_new(disk):
            if bytes(page) != disk:
                differ.append(f"{t} (one side all zeros)")
        elif masked(page, t.blkno, mask) != masked(disk, t.blkno, mask):
            differ.append(f"{t}")
    return compared, differ


def unbuilt_blocks(pg: PostgresInstance, pages: Pages, db: int, rel: int) -> list[tuple[int, int]]:
    """(fork, block) of the relation's main and init files that are not zeros on disk and
    that no record rebuilt."""
    out: list[tuple[int, int]] = []
    for fork, suffix in ((0, ""), (3, "_init")):
        path = pg.datadir / "base" / str(db) / f"{rel}{suffix}"
        if not path.exists():
            continue
        got = {t.blkno for t in pages if t.rel == rel and t.fork == fork}
        for b in range(path.stat().st_size // bp.BLCKSZ):
            if b not in got and file_page(pg, db, rel, fork, b) != bytes(bp.BLCKSZ):
                out.append((fork, b))
    return out


def ingest_and_read(
    tmp_path: Path,
    recs: Sequence[DecodedRecord],
    rels: Iterable[int],
    *,
    unsupported: int | None = None,
    forks: Sequence[int] = (0, 3),
    validate: bool = True,
) -> tuple[list[str], Pages]:
    """Feed ``recs`` (real records of relations ``rels`` in one database) through WAL ingest
    into a fresh timeline, then read every block of those relations at the last LSN.

    With ``unsupported`` (a resource manager id), the pages are first read with that
    resource manager's redo taken out, as before it existed: the errors are returned. The
    second read, with it back and nothing re-ingested, gives the pages. ``forks`` are the
    forks read; ``validate`` checks every verification image the records carry."""
    db = recs[0].blocks[0].db
    spc = recs[0].blocks[0].spc

    async def run() -> tuple[list[str], Pages]:
        tenant = Tenant(tmp_path, TenantId.generate(), INGEST_CONFIG, redo=PostgresRedoManager(validate=validate))
        tl = await tenant.create_timeline(TimelineId.generate())
        ing = WalIngest(tl)
        mod = ing.w.begin(Lsn(recs[0].lsn))
        mod.put_checkpoint(_checkpoint(next_xid=1 << 20))
        await mod.put_dbdir_creation(spc, db)
        await mod.commit()
        for r in recs:
            await ing.ingest_record(r)
        lsn = tl.last_record_lsn
        dd = Datadir(tl)
        tags = []
        for rel in rels:
            for fork in forks:
                tag = RelTag(spc, db, rel, fork)
                if await dd.rel_exists(tag, lsn):
                    tags += [(tag, blkno) for blkno in range(await dd.get_rel_size(tag, lsn))]
        errors: list[str] = []
        if unsupported is not None:
            saved = REDO_ROUTINES.pop(unsupported), ON_IMAGE_ROUTINES.pop(unsupported, None)
            try:
                for tag, blkno in tags:
                    try:
                        await dd.get_page(tag, blkno, lsn)
                    except PageReconstructError as exc:
                        errors.append(str(exc))
            finally:
                REDO_ROUTINES[unsupported] = saved[0]
                if saved[1] is not None:
                    ON_IMAGE_ROUTINES[unsupported] = saved[1]
        pages: Pages = {}
        for tag, blkno in tags:
            pages[RelBlock(tag.spc, tag.db, tag.rel, tag.fork, blkno)] = await dd.get_page(tag, blkno, lsn)
        await tenant.shutdown()
        return errors, pages

    return trio.run(run)
