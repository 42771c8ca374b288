"""Review of the fused ingest path (``WalIngest.ingest_decoder``): targeted WAL for each way a
record could look like the fused path's layout without being it, or be it and still need the
general path, each compared with ``decode_into`` + ``ingest_records`` (same puts in the same
order, ``last_record_lsn``, statistics, sizes, checkpoint, records per piece, end of WAL).

Cases: a one-block record with an origin or a top-level xid fragment, a long main data; forks
other than main (VM, FSM, init; a fork number PostgreSQL never writes); block flags that lie
(HAS_DATA without data, data without HAS_DATA, SAME_REL on the first block, an image that is
not applied); every heap/heap2 record that clears VM bits, with the flags byte set, clear, and
just out of reach; xids around the 2^32 wrap of nextXid; a relation truncated, or created,
between two runs of records with identical layout bytes (the "same as before" shortcut),
extended by more than one block; records ending exactly at a page end and a few bytes before
it; XLOG_SWITCH inside a run. Each case is fed in three chunkings. The cases that should take
the fused path assert that it did (the comparison is not vacuous).
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from compute.postgres import PostgresInstance, chown_to_postgres
from pageserver.import_datadir import run_initdb
from pageserver.walingest import WalIngest
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn, parse_lsn, segment_file_name
from protocol.wal import encoder as encoder_mod
from protocol.wal.encoder import BlockSpec, WalEncoder
from protocol.wal.reader import EndOfWal, WalStreamDecoder
from protocol.wal.record import (
    BKPBLOCK_HAS_DATA,
    BKPBLOCK_SAME_REL,
    SIZE_OF_XLOG_RECORD,
    DecodedRecord,
    record_crc,
)
from protocol.wal.rmgr import SMGR_TRUNCATE_HEAP, XLOG_SMGR_CREATE, XLOG_SMGR_TRUNCATE, RmgrId
from tests.pageserver import test_walingest_fused as fz
from tests.pageserver.test_walingest_fast import SETTINGS, RealWal, _puts
from tests.pageserver.test_walingest_fused import WAL_START, A, B, C, Run, assert_same
from tests.tmpdirs import pg_tmpdir

PIECES = [131072, 8192 + 13, 61]
Spec = dict[str, Any]


def insert(rnode: Any = A, blkno: int = 1, *, xid: int = 900, flags: int = 0, **kw: Any) -> Spec:
    """A heap INSERT of the fused layout (one block, short main data with the flags at 2)."""
    spec: Spec = {"rmid": RmgrId.HEAP, "info": 0x00, "xid": xid,
                  "blocks": [BlockSpec(rnode, blkno, data=fz._tuple(100))],
                  "main_data": struct.pack("<HB", 3, flags)}
    spec.update(kw)
    return spec


def btree(rnode: Any = A, blkno: int = 1, fork: int = 0) -> Spec:
    return {"rmid": RmgrId.BTREE, "info": 0x00, "xid": 0,
            "blocks": [BlockSpec(rnode, blkno, forknum=fork, data=fz._tuple(20))],
            "main_data": b"\x05\x00"}


def smgr_truncate(rnode: Any, nblocks: int) -> Spec:
    return {"rmid": RmgrId.SMGR, "info": XLOG_SMGR_TRUNCATE, "xid": 0, "blocks": [],
            "main_data": struct.pack("<IIIIi", nblocks, rnode.spc, rnode.db, rnode.rel,
                                     SMGR_TRUNCATE_HEAP)}


def smgr_create(rnode: Any, fork: int = 0) -> Spec:
    return {"rmid": RmgrId.SMGR, "info": XLOG_SMGR_CREATE, "xid": 0, "blocks": [],
            "main_data": struct.pack("<IIIi", rnode.spc, rnode.db, rnode.rel, fork)}


def patched(patch: Callable[[bytearray], None]) -> Callable[..., bytes]:
    """``build_record`` with ``patch`` applied to the record's bytes, CRC recomputed: a
    record a writer other than PostgreSQL could send, valid to every check but the layout."""
    build = encoder_mod.build_record

    def build_(**kw: Any) -> bytes:
        raw = bytearray(build(**kw))
        patch(raw)
        struct.pack_into("<I", raw, 0, len(raw))
        struct.pack_into("<I", raw, 20, record_crc(bytes(raw)))
        return bytes(raw)

    return build_


def encode(specs: list[Spec | Callable[[WalEncoder], None]]) -> tuple[bytes, Lsn]:
    """The WAL of ``specs`` from WAL_START; a spec may carry ``patch`` (see ``patched``) or be
    a function writing to the encoder itself."""
    enc = WalEncoder(WAL_START)
    for spec in specs:
        if callable(spec):
            spec(enc)
            continue
        spec = dict(spec)
        patch = spec.pop("patch", None)
        with pytest.MonkeyPatch.context() as m:
            if patch is not None:
                m.setattr(encoder_mod, "build_record", patched(patch))
            enc.append(**spec)
    return enc.take(), enc.insert_lsn


@attrs.frozen
class Outcome:
    batch: Run
    fused: Run
    general: int  # records the fused run sent through ingest_records
    records: int  # records the batch run ingested (stats.records + skipped)


def compare(wal: bytes, pieces: list[int], next_xid: int | None = None) -> Outcome:
    """Both paths on ``wal`` fed in ``pieces``; the fused run counts what it did not fuse."""
    general: list[int] = []
    real = WalIngest.ingest_records

    async def counting(self: WalIngest, recs: list[DecodedRecord]) -> None:
        general.append(len(recs))
        await real(self, recs)

    with pytest.MonkeyPatch.context() as m, tempfile.TemporaryDirectory() as d:
        if next_xid is not None:
            m.setattr(fz, "_checkpoint", lambda: attrs.evolve(_CHECKPOINT(), next_xid=next_xid))
        chunks = fz.chunking(len(wal), pieces)
        batch = trio.run(fz.ingest, wal, chunks, False, None, Path(d) / "batch")
        m.setattr(WalIngest, "ingest_records", counting)
        fused = trio.run(fz.ingest, wal, chunks, True, None, Path(d) / "fused")
    stats: Any = batch.stats
    return Outcome(batch, fused, sum(general), stats.records + stats.skipped)


_CHECKPOINT = fz._checkpoint


def check(specs: list[Spec | Callable[[WalEncoder], None]], *, fused_at_least: int = 0,
          next_xid: int | None = None, to_end: bool = True) -> Outcome:
    """``to_end``: the WAL is valid to its end (else it must end at an undecodable record)."""
    wal, end = encode(specs)
    for pieces in PIECES:
        out = compare(wal, [pieces], next_xid)
        assert_same(out.batch, out.fused)
        if to_end:
            assert out.batch.last_record_lsn == end, "the WAL must be ingested to its end"
        else:
            assert isinstance(out.batch.end, EndOfWal) and out.batch.last_record_lsn < end
        assert out.records - out.general >= fused_at_least, "the fused path was not taken"
    return out


RUN = [insert()] * 6  # records the fused path takes (with its shortcut from the second on)

# -- layouts that only look like the fused one -------------------------------------------------

_EVEN = fz._tuple(100) + bytes(4)
LOOKALIKES: dict[str, Spec] = {
    "origin": insert(origin=7),
    "toplevel_xid": insert(toplevel_xid=899),
    "long_main_clear": insert(main_data=struct.pack("<HB", 3, 0) + bytes(300)),
    "long_main_vm": insert(main_data=struct.pack("<HB", 3, 1) + bytes(300)),
    "no_main_data": insert(main_data=b""),
    "has_data_without_data": insert(
        blocks=[BlockSpec(A, 1)], patch=lambda r: r.__setitem__(25, r[25] | BKPBLOCK_HAS_DATA)),
    "data_without_has_data": insert(
        patch=lambda r: r.__setitem__(25, r[25] & ~BKPBLOCK_HAS_DATA)),
    "same_rel_first_block": insert(
        patch=lambda r: r.__setitem__(25, r[25] | BKPBLOCK_SAME_REL)),
    "image_not_applied": insert(
        blocks=[BlockSpec(A, 1, data=fz._tuple(40), image=bytes(8192), apply_image=False)]),
    "image_applied": insert(blocks=[BlockSpec(A, 1, data=fz._tuple(40), image=bytes(8192))]),
    "block_id_1": insert(blocks=[BlockSpec(A, 1, data=fz._tuple(40), block_id=1)]),
    "two_blocks_same_rel": insert(
        blocks=[BlockSpec(A, 1, data=fz._tuple(40)), BlockSpec(A, 2, data=fz._tuple(40))]),
    "main_len_one_short": insert(
        patch=lambda r: r.__setitem__(SIZE_OF_XLOG_RECORD + 21, r[SIZE_OF_XLOG_RECORD + 21] - 1)),
    "btree_main_len_one_short": {
        **btree(), "patch": lambda r: r.__setitem__(SIZE_OF_XLOG_RECORD + 21, 1)},
    "trailing_bytes": insert(patch=lambda r: r.extend(bytes(8))),
    # an origin / top-level xid fragment whose bytes, read as the main data's header, make
    # the lengths add up (origin 6: 3 header bytes + 3 of main data), the flags byte set and
    # the byte where the fused layout would look for it clear
    "origin_lengths_add_up": insert(origin=6, flags=1, blocks=[BlockSpec(A, 1, data=_EVEN)]),
    "origin_lengths_add_up_clear": insert(origin=6, blocks=[BlockSpec(A, 1, data=_EVEN)]),
    "toplevel_xid_lengths_add_up": insert(
        toplevel_xid=0x308, flags=1, blocks=[BlockSpec(A, 1, data=_EVEN)]),
}


# the decoder refuses these (PostgreSQL's DecodeXLogRecord does): WAL ends at the first one
UNDECODABLE = {"data_without_has_data", "has_data_without_data", "main_len_one_short",
               "same_rel_first_block", "btree_main_len_one_short", "trailing_bytes"}


@pytest.mark.parametrize("case", sorted(LOOKALIKES))
def test_lookalike_layouts(case: str) -> None:
    spec = LOOKALIKES[case]
    check([*RUN, *RUN, spec, spec, *RUN, spec, insert(blkno=2), spec], fused_at_least=len(RUN),
          to_end=case not in UNDECODABLE)


# -- forks -----------------------------------------------------------------------------------


def test_forks_other_than_main() -> None:
    # A has a VM fork of 1 block, no FSM or init fork; B's main fork is empty. Fork numbers
    # above 3 do not exist in PostgreSQL: ingest refuses them (test_walingest_forks.py).
    specs: list[Spec | Callable[[WalEncoder], None]] = [*RUN]
    for fork, blkno in [(2, 0), (2, 0), (2, 1), (2, 1), (2, 3), (1, 0), (1, 0), (1, 1), (3, 0),
                        (3, 0)]:
        specs += [btree(A, blkno, fork), btree(B, blkno, fork)]
    check([*specs, *RUN], fused_at_least=len(RUN) + 6)


# -- visibility map ----------------------------------------------------------------------------

_HEAD7 = struct.pack("<IHB", 9, 2, 0)  # xmax, offnum, infobits: the flags byte is at 7


def _vm_specs(rmid: RmgrId, info: int, flags_at: int, bits: list[int]) -> list[Spec]:
    """Runs of records with identical layout bytes (shortcut candidates) whose flags byte
    differs, for main data just too short to hold it, just long enough, and longer."""
    out = []
    for length in (flags_at, flags_at + 1, flags_at + 6):
        for bit in [*bits, 0, *bits[::-1]]:
            main = bytearray(_HEAD7 + bytes(7) if flags_at == 7 else bytes(14))
            main[flags_at] = bit
            out.append({"rmid": rmid, "info": info, "xid": 900,
                        "blocks": [BlockSpec(A, 1, data=fz._tuple(60))],
                        "main_data": bytes(main[:length])})
    return out


@pytest.mark.parametrize(
    "rmid, info, flags_at, bits",
    [
        (RmgrId.HEAP, 0x00, 2, [0, 1, 2, 0xFE]),  # INSERT
        (RmgrId.HEAP, 0x80, 2, [0, 1]),  # INSERT + INIT_PAGE
        (RmgrId.HEAP, 0x10, 7, [0, 1, 2, 4]),  # DELETE
        (RmgrId.HEAP, 0x20, 7, [0, 1, 2, 4]),  # UPDATE on one page
        (RmgrId.HEAP, 0x40, 7, [0, 1, 2, 4]),  # HOT_UPDATE
        (RmgrId.HEAP, 0x60, 7, [0, 1, 2]),  # LOCK
        (RmgrId.HEAP, 0x70, 7, [0, 1]),  # INPLACE: clears nothing
        (RmgrId.HEAP2, 0x50, 0, [0, 1, 2]),  # MULTI_INSERT
        (RmgrId.HEAP2, 0x60, 7, [0, 1, 2]),  # LOCK_UPDATED
        (RmgrId.HEAP2, 0x10, 0, [0, 1]),  # PRUNE: clears nothing
    ],
)
def test_records_that_clear_vm_bits(rmid: RmgrId, info: int, flags_at: int, bits: list[int]) -> None:
    specs: list[Spec | Callable[[WalEncoder], None]] = [*RUN, *_vm_specs(rmid, info, flags_at, bits)]
    check(specs, fused_at_least=len(RUN))


def test_same_layout_bytes_other_record() -> None:
    """Records whose 22 layout bytes and length equal the fused record's before them but whose
    resource manager or info differs: a DELETE (VM flag at 7) after an INSERT (flag at 2), a
    heap INSERT clearing VM bits after a btree record."""
    main8 = bytes(7) + b"\x01"
    ins8 = insert(main_data=bytes(8))
    delete = {**ins8, "info": 0x10, "main_data": main8}
    bt = {"rmid": RmgrId.BTREE, "info": 0x00, "xid": 0,
          "blocks": [BlockSpec(A, 1, data=fz._tuple(100))], "main_data": b"\x00\x00\x01"}
    specs: list[Spec | Callable[[WalEncoder], None]] = [
        *RUN, ins8, ins8, delete, ins8, delete, delete, bt, bt, insert(flags=1), bt,
        insert(flags=1), insert(flags=1), bt,
    ]
    check(specs, fused_at_least=len(RUN))


def test_insert_flag_byte_alternates_under_the_shortcut() -> None:
    """Records identical but for the INSERT's flags byte: the shortcut must re-read it."""
    specs: list[Spec | Callable[[WalEncoder], None]] = []
    for i in range(40):
        specs.append(insert(flags=1 if i % 3 == 2 else 0))
    check(specs, fused_at_least=20)


# -- xids ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "next_xid, xids",
    [
        # nextXid just past the wrap (epoch 1): xids before the wrap precede it
        ((1 << 32) + 5, [2**32 - 10, 2**32 - 1, 1, 2, 3, 4, 5, 6, 0x8000_0004, 0x8000_0006]),
        # nextXid just before the wrap: small xids follow it (nextXid advances)
        (2**32 - 2, [2**32 - 3, 1, 2, 3, 4, 2**32 - 1, 0x8000_0000]),
        # half way round: an xid 2^31 - 1 below it precedes, 2^31 below follows
        ((1 << 32) + 0x8000_0005, [0x8000_0004, 6, 5, 4, 3, 0x8000_0007]),
        (3, [1, 2, 3, 2**32 - 1, 4]),
    ],
)
def test_xids_around_the_wrap(next_xid: int, xids: list[int]) -> None:
    specs: list[Spec | Callable[[WalEncoder], None]] = []
    for xid in xids:
        specs += [insert(xid=xid), insert(xid=xid), insert(xid=0)]
    check(specs, next_xid=next_xid, fused_at_least=len(xids))


# -- relation sizes --------------------------------------------------------------------------


def test_truncate_and_create_between_identical_runs() -> None:
    """The same record (same layout bytes) before and after its block left the relation:
    the shortcut must not carry across the truncation."""
    run2 = [insert(A, 2)] * 4
    specs: list[Spec | Callable[[WalEncoder], None]] = [
        *run2, smgr_truncate(A, 1), *run2, smgr_truncate(A, 0), *run2, insert(A, 4),
        insert(A, 3), *run2,
        # C has no fork until it is created; then blocks 0, 1 (new pages), 3 (past the end)
        insert(C, 0), smgr_create(C), insert(C, 0), insert(C, 0), insert(C, 1), insert(C, 1),
        insert(C, 3), insert(C, 2), smgr_truncate(C, 0), insert(C, 0), insert(C, 0),
    ]
    check(specs, fused_at_least=10)


def test_extended_by_more_than_one_block() -> None:
    specs: list[Spec | Callable[[WalEncoder], None]] = []
    for blkno in [0, 2, 1, 3, 5, 4, 6, 6, 9, 7, 8, 8]:
        specs += [insert(B, blkno, info=0x80), insert(B, blkno)]
    check(specs, fused_at_least=8)


# -- pages and segments ----------------------------------------------------------------------


def _fill_to_page_end(gap: int) -> Callable[[WalEncoder], None]:
    """INSERTs, then one whose record ends ``gap`` bytes before the page end."""

    def write(enc: WalEncoder) -> None:
        for _ in range(3):
            enc.append(**insert())
        room = 8192 - (enc.insert_lsn & 8191)
        if room < 200:
            enc.append(**insert())
            room = 8192 - (enc.insert_lsn & 8191)
        size = room - gap - (SIZE_OF_XLOG_RECORD + 22 + 3)
        _, end = enc.append(**insert(blocks=[BlockSpec(A, 1, data=b"\x01" * size)]))
        assert end & 8191 == 0

    return write


def test_records_ending_at_a_page_end() -> None:
    specs: list[Spec | Callable[[WalEncoder], None]] = []
    for gap in [0, 0, 4, 1, 7, 0, 3]:
        specs += [_fill_to_page_end(gap), insert(), insert(blkno=2)]
    check(specs, fused_at_least=30)


def test_xlog_switch_inside_a_run() -> None:
    def switch(enc: WalEncoder) -> None:
        enc.switch()

    specs: list[Spec | Callable[[WalEncoder], None]] = [*RUN, switch, *RUN, *RUN]
    check(specs, fused_at_least=2 * len(RUN))


# -- real PostgreSQL WAL -----------------------------------------------------------------------

# Records the synthetic cases above imitate, written by PostgreSQL itself: wal_level=logical
# (a subtransaction's first record carries the top-level xid; heap records log more), a
# replication origin session (every heap record carries an origin fragment), VM bits set by
# VACUUM (FREEZE) then cleared by INSERT, COPY (MULTI_INSERT), HOT UPDATE, DELETE and
# SELECT FOR UPDATE/SHARE (LOCK clearing all-frozen), TRUNCATE then INSERT in one transaction,
# and four clients inserting at once (relations extended by several blocks without WAL).
REAL_WORKLOAD = [
    "CREATE TABLE v (id int, pad text) WITH (fillfactor = 50)",
    "INSERT INTO v SELECT g, repeat('v', 60) FROM generate_series(1, 4000) g",
    "DELETE FROM v WHERE id % 5 = 0",
    "VACUUM (FREEZE) v",
    "INSERT INTO v SELECT g, 'new' FROM generate_series(1, 300) g",
    "VACUUM (FREEZE) v",
    "UPDATE v SET pad = 'hot' WHERE id % 13 = 1",
    "VACUUM (FREEZE) v",
    "SELECT count(*) FROM (SELECT id FROM v WHERE id % 17 = 2 FOR UPDATE) s",
    "SELECT count(*) FROM (SELECT id FROM v WHERE id % 19 = 3 FOR SHARE) s",
    "DELETE FROM v WHERE id % 23 = 4",
    "VACUUM (FREEZE) v",
    "COPY v (id) FROM PROGRAM 'seq 1 3000'",
    "SELECT pg_replication_origin_create('review')",
    "SELECT pg_replication_origin_session_setup('review');"
    " INSERT INTO v SELECT g, 'origin' FROM generate_series(1, 2000) g;"
    " UPDATE v SET pad = 'o' WHERE id < 50",
    "BEGIN; INSERT INTO v VALUES (-1, 'top'); SAVEPOINT a; INSERT INTO v VALUES (-2, 'sub');"
    " SAVEPOINT b; INSERT INTO v SELECT g, 'sub2' FROM generate_series(1, 500) g;"
    " RELEASE b; ROLLBACK TO a; INSERT INTO v VALUES (-3, 'after'); COMMIT",
    "BEGIN; CREATE TABLE tr (id int); INSERT INTO tr SELECT generate_series(1, 3000);"
    " TRUNCATE tr; INSERT INTO tr SELECT generate_series(1, 1000); COMMIT",
    "CREATE TABLE ext (id int, pad text)",
]
EXT_SCRIPT = "INSERT INTO ext SELECT g, repeat('e', 300) FROM generate_series(1, 40) g;\n"


@pytest.fixture(scope="module")
def review_wal() -> Iterator[RealWal]:
    with pg_tmpdir() as root:
        trio.run(run_initdb, root / "init")
        pgdata = root / "pg"
        shutil.copytree(root / "init", pgdata, symlinks=True)
        script = root / "ext.sql"
        script.write_text(EXT_SCRIPT)
        chown_to_postgres(pgdata)
        chown_to_postgres(script)
        os.chmod(pgdata, 0o700)
        pg = PostgresInstance(datadir=pgdata, settings={**SETTINGS, "wal_level": "logical"})
        pg.start()
        try:
            for sql in REAL_WORKLOAD:
                pg.psql(sql)
            pg.pgbench("-n", "-c", "4", "-t", "40", "-f", str(script))
            pg.psql("DELETE FROM ext WHERE id % 3 = 0")
            pg.psql("VACUUM (FREEZE) ext")
            pg.pgbench("-n", "-c", "4", "-t", "20", "-f", str(script))
            end = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
        finally:
            pg.stop("immediate")
        wal = bytearray()
        segno = 1
        while (pgdata / "pg_wal" / segment_file_name(segno)).exists():
            wal += (pgdata / "pg_wal" / segment_file_name(segno)).read_bytes()
            segno += 1
        yield RealWal(root / "init", bytes(wal[: end - WAL_SEGMENT_SIZE + 65536]), end)


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.parametrize("chunk", [131072, 8192 + 13])
async def test_fused_equals_batch_on_review_workload(
    pg_tmp_path: Path, review_wal: RealWal, chunk: int
) -> None:
    want = await _puts(pg_tmp_path / "batch", review_wal, False, chunk)
    general: list[int] = []
    got = await _puts(pg_tmp_path / "fused", review_wal, True, chunk, general)
    assert want[2] >= review_wal.end  # last_record_lsn: the whole workload went in
    assert got[0] == want[0]  # every value, in order
    assert got[1:] == want[1:]
    stats: Any = want[3]
    assert sum(general) < stats.records  # some records took the fused path
    # the workload has what it is meant to have: origin and top-level xid fragments
    dec = WalStreamDecoder(WAL_SEGMENT_SIZE)
    dec.feed(review_wal.wal)
    recs: list[DecodedRecord] = []
    dec.decode_into(recs)
    assert any(r.origin is not None and r.xl_rmid == RmgrId.HEAP for r in recs)
    assert any(r.toplevel_xid is not None for r in recs)
