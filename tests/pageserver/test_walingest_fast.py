"""The WAL ingest's batch path (issue 7's speed work) gives exactly the general path's values,
on real PostgreSQL 15 WAL.

A PostgreSQL runs a workload made to hit both paths: a bulk INSERT (the fast path's bread and
butter, with a new heap page every ~70 rows going to the general path), an index, VACUUM
(visibility-map bits set) then UPDATE/DELETE on those pages (records that clear VM bits: the
general path), a subtransaction rollback, TRUNCATE, CREATE DATABASE, a CHECKPOINT and the
full-page images after it, and a WAL switch. Its WAL is then:

- decoded with ``WalStreamDecoder.decode_into`` and with ``next_record``, in several
  chunkings: the same records (every field) and the same end;
- ingested into two timelines imported from the same initdb directory, one record at a time
  (``WalIngest.ingest_record``) and in the receiver's batches (``ingest_records``), with a
  small ``checkpoint_distance`` and write buffer so that layers roll and buffers fill inside
  batches, and the batch run's layers flushed through the in-memory layer's batched
  ``read_many`` path: every value (key, LSN, bytes, will_init), ``last_record_lsn``, the
  statistics, relation sizes and the checkpoint must be equal;
- and the same comparison must fail for mutants of the batch path: the will_init flag
  inverted, the VM-clear test skipped;
- ingested by the fused path (``WalIngest.ingest_decoder``, what the WAL receiver uses) in two
  chunkings: exactly the batch path's puts (key, LSN, bytes, will_init, layer, in order),
  ``last_record_lsn``, statistics, sizes, checkpoint and records per piece; most records must
  have taken the fused path. pgbench (``-i -s 1`` and 300 transactions) runs after the
  workload for this.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from compute.postgres import PostgresInstance, chown_to_postgres
from pageserver import walingest
from pageserver.import_datadir import import_datadir, run_initdb
from pageserver.storage import inmemory_layer
from pageserver.storage.config import StorageConfig
from pageserver.storage.inmemory_layer import InMemoryLayer
from pageserver.storage.io_engine import IoEngine
from pageserver.storage.key import Key
from pageserver.storage.layer_file import WriteOptions
from pageserver.storage.value import TAG_CLEAR_VM_FLAGS
from pageserver.tenant import Tenant
from pageserver.walingest import WalIngest
from protocol.ids import TenantId, TimelineId
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn, parse_lsn, segment_file_name
from protocol.wal.reader import EndOfWal, WalStreamDecoder
from protocol.wal.record import DecodedRecord
from protocol.wal.walk import walk_crc
from tests.pageserver.test_walingest_fused import Put, capture_puts
from tests.tmpdirs import pg_tmpdir

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

SETTINGS = {
    "wal_level": "replica",
    "full_page_writes": "on",
    "autovacuum": "off",
    "fsync": "off",
    "wal_keep_size": "1GB",  # CHECKPOINT must not recycle the segments the test reads
}
WORKLOAD = [
    "CREATE TABLE t (id int PRIMARY KEY, v text)",
    "INSERT INTO t SELECT g, repeat('x', 80) FROM generate_series(1, 15000) g",
    "VACUUM t",
    "UPDATE t SET v = 'updated' WHERE id % 7 = 0",
    "DELETE FROM t WHERE id % 11 = 0",
    "CREATE INDEX t_v ON t (v)",
    "BEGIN; INSERT INTO t VALUES (-1, 'a'); SAVEPOINT s; INSERT INTO t VALUES (-2, 'b');"
    " ROLLBACK TO s; COMMIT",
    "CREATE TABLE gone AS SELECT g FROM generate_series(1, 2000) g",
    "TRUNCATE gone",
    "CREATE DATABASE copy1",
    "CHECKPOINT",
    "UPDATE t SET v = 'after checkpoint' WHERE id < 3000",
    "INSERT INTO t SELECT g, repeat('y', 40) FROM generate_series(15001, 20000) g",
    "SELECT pg_switch_wal()",
    "INSERT INTO t SELECT g, 'z' FROM generate_series(20001, 21000) g",
]
CONFIG = StorageConfig(
    checkpoint_distance=1 << 20, write_buffer_size=8192, compaction_period_s=0, gc_period_s=0
)
CHUNK = 131072  # XLogData pieces as a walsender sends them


@attrs.frozen
class RealWal:
    init: Path
    wal: bytes  # from the start of segment 1
    end: Lsn


@pytest.fixture(scope="module")
def real_wal() -> Iterator[RealWal]:
    with pg_tmpdir() as root:
        trio.run(run_initdb, root / "init")
        pgdata = root / "pg"
        shutil.copytree(root / "init", pgdata, symlinks=True)
        chown_to_postgres(pgdata)
        os.chmod(pgdata, 0o700)
        pg = PostgresInstance(datadir=pgdata, settings=dict(SETTINGS))
        pg.start()
        try:
            for sql in WORKLOAD:
                pg.psql(sql)
            # pgbench's load (COPY into a new table, primary keys) and its transactions
            # (UPDATE x3, INSERT into history, commit per transaction): the fused path's mix
            pg.pgbench("-i", "-s", "1", "-q")
            pg.pgbench("-t", "300", "-c", "2", "-n")
            end = parse_lsn(pg.psql("SELECT pg_current_wal_insert_lsn()"))
        finally:
            pg.stop("immediate")
        wal = bytearray()
        segno = 1
        while (pgdata / "pg_wal" / segment_file_name(segno)).exists():
            wal += (pgdata / "pg_wal" / segment_file_name(segno)).read_bytes()
            segno += 1
        # the WAL up to a little past the end (the rest of the segment is zeros)
        yield RealWal(root / "init", bytes(wal[: end - WAL_SEGMENT_SIZE + 65536]), end)


# -- the decoder ------------------------------------------------------------------------------


def _decode(wal: RealWal, chunk: int, batched: bool) -> tuple[list[DecodedRecord], EndOfWal]:
    dec = WalStreamDecoder(WAL_SEGMENT_SIZE)
    out: list[DecodedRecord] = []
    for at in range(0, len(wal.wal), chunk):
        dec.feed(wal.wal[at : at + chunk])
        if batched:
            dec.decode_into(out)
        else:
            out.extend(dec.records())
    return out, dec.finish()


@pytest.mark.parametrize("chunk", [CHUNK, 1000])
def test_decode_into_equals_next_record_on_real_wal(real_wal: RealWal, chunk: int) -> None:
    want, want_end = _decode(real_wal, chunk, batched=False)
    got, got_end = _decode(real_wal, chunk, batched=True)
    assert len(want) > 20_000
    assert want[-1].end_lsn >= real_wal.end
    assert got == want
    assert got_end == want_end


def test_minimal_walk_finds_the_decoders_records_on_real_wal(real_wal: RealWal) -> None:
    # the walk-crc-min floor of `pagestore bench bulk-ingest` (protocol/wal/walk.py) walks the
    # same records as the decoder on every kind of record this workload writes (FPIs over
    # several pages, a WAL switch, a segment boundary), and stops at a corrupted one
    want, want_end = _decode(real_wal, CHUNK, batched=True)
    first = want[0].lsn
    walked = walk_crc(real_wal.wal, Lsn(WAL_SEGMENT_SIZE), first)
    assert (walked.records, walked.end_lsn) == (len(want), want_end.lsn)
    assert walked.error is not None  # the zeros after the end: xl_tot_len 0
    at = len(want) // 2
    while 8192 - want[at].lsn % 8192 < 24:
        at += 1  # (a record header on one page)
    victim = want[at]
    bad = bytearray(real_wal.wal)
    bad[victim.lsn + 12 - WAL_SEGMENT_SIZE] ^= 0x10  # in xl_prev
    walked = walk_crc(bytes(bad), Lsn(WAL_SEGMENT_SIZE), first)
    assert (walked.records, walked.end_lsn) == (at, victim.lsn)
    assert walked.error is not None and "CRC" in walked.error


# -- the ingest -------------------------------------------------------------------------------

Entry = tuple[Key, Lsn, bytes, bool]


@attrs.frozen
class Outcome:
    values: list[Entry]
    last_record_lsn: Lsn
    stats: walingest.IngestStats
    rel_sizes: dict[tuple[int, int, int, int], int]
    checkpoint: object
    last_record: tuple[Lsn, Lsn] | None
    layers: int


async def _ingest(
    root: Path, wal: RealWal, batched: bool, monkeypatch: pytest.MonkeyPatch
) -> Outcome:
    """Import initdb's directory, ingest the WAL, flush; every value that reaches an L0."""
    written: list[Entry] = []
    layers = []
    real_write_l0 = InMemoryLayer.write_l0

    async def capturing_write_l0(
        self: InMemoryLayer, engine: IoEngine, directory: Path, opts: WriteOptions
    ) -> Path | None:
        # the frozen layer's values, read before the real (batched) write takes them
        async for key, lsn, blob, will_init in self._entries():
            written.append((key, lsn, bytes(blob), will_init))
        layers.append(self)
        return await real_write_l0(self, engine, directory, opts)

    monkeypatch.setattr(InMemoryLayer, "write_l0", capturing_write_l0)
    async with trio.open_nursery() as nursery:
        tenant = Tenant(root, TenantId.generate(), CONFIG, nursery=nursery)
        tl = await tenant.create_timeline(TimelineId.generate())
        res = await import_datadir(tl, wal.init)
        await tl.flush()
        written.clear()
        start = res.end_lsn
        page = start & ~8191
        dec = WalStreamDecoder(start, data_start=page)
        ing = WalIngest(tl)
        for at in range(page - WAL_SEGMENT_SIZE, len(wal.wal), CHUNK):
            dec.feed(wal.wal[at : at + CHUNK])
            batch: list[DecodedRecord] = []
            dec.decode_into(batch)
            if batched:
                await ing.ingest_records(batch)
            else:
                for rec in batch:
                    await ing.ingest_record(rec)
        await tl.flush()
        out = Outcome(
            sorted(written),
            tl.last_record_lsn,
            ing.stats,
            dict(ing.w.rel_sizes),
            ing.w.checkpoint,
            ing.last_record,
            len(layers),
        )
        nursery.cancel_scope.cancel()
    await tenant.shutdown()
    return out


_REFERENCE: dict[Path, Outcome] = {}  # per real_wal: the tests below share one reference run


async def _reference(pg_tmp_path: Path, real_wal: RealWal, monkeypatch: pytest.MonkeyPatch) -> Outcome:
    ref = _REFERENCE.get(real_wal.init)
    if ref is not None:
        return ref
    with monkeypatch.context() as m:
        ref = _REFERENCE[real_wal.init] = await _ingest(pg_tmp_path / "one-by-one", real_wal, False, m)
    assert ref.last_record_lsn >= real_wal.end
    assert ref.layers > 5  # layers rolled during the ingest
    return ref


async def _batched(
    pg_tmp_path: Path,
    real_wal: RealWal,
    monkeypatch: pytest.MonkeyPatch,
    mutate: Callable[[pytest.MonkeyPatch], None] | None = None,
) -> Outcome:
    with monkeypatch.context() as m:
        # Flush every layer through the big-layer path (batched read_many of coalesced runs)
        # with small batches, so that it is compared with the whole-file path of the reference.
        m.setattr(inmemory_layer, "_READ_WHOLE_MAX", 0)
        m.setattr(inmemory_layer, "_READ_BATCH", 37)
        if mutate is not None:
            mutate(m)
        return await _ingest(pg_tmp_path / "batched", real_wal, True, m)


async def test_batch_ingest_equals_record_by_record(
    pg_tmp_path: Path, real_wal: RealWal, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = await _reference(pg_tmp_path, real_wal, monkeypatch)
    got = await _batched(pg_tmp_path, real_wal, monkeypatch)
    # the workload did hit both paths and the VM clears
    assert ref.stats.wal_records > 15_000
    assert ref.stats.images > 100
    assert any(blob[0] == TAG_CLEAR_VM_FLAGS for _, _, blob, _ in ref.values)
    assert got.values == ref.values
    assert got.last_record_lsn == ref.last_record_lsn
    assert got.stats == ref.stats
    assert got.rel_sizes == ref.rel_sizes
    assert got.checkpoint == ref.checkpoint
    assert got.last_record == ref.last_record


def _flip_will_init(m: pytest.MonkeyPatch) -> None:
    m.setattr(walingest, "_PG_RECORD_HEADS", walingest._PG_RECORD_HEADS[::-1])


def _no_vm_clear_test(m: pytest.MonkeyPatch) -> None:
    m.setattr(walingest, "_may_clear_vm", lambda rec: False)


@pytest.mark.parametrize("mutate", [_flip_will_init, _no_vm_clear_test])
async def test_batch_ingest_mutants_are_caught(
    pg_tmp_path: Path,
    real_wal: RealWal,
    monkeypatch: pytest.MonkeyPatch,
    mutate: Callable[[pytest.MonkeyPatch], None],
) -> None:
    ref = await _reference(pg_tmp_path, real_wal, monkeypatch)
    got = await _batched(pg_tmp_path, real_wal, monkeypatch, mutate)
    assert got.values != ref.values


async def _puts(
    root: Path, wal: RealWal, fused: bool, chunk: int, general: list[int] | None = None,
) -> tuple[list[Put], list[tuple[int, int]], Lsn, object, object, object, object]:
    """Every value stored, in order, ingesting the WAL by the fused or the batch path."""
    async with trio.open_nursery() as nursery:
        tenant = Tenant(root, TenantId.generate(), CONFIG, nursery=nursery)
        tl = await tenant.create_timeline(TimelineId.generate())
        res = await import_datadir(tl, wal.init)
        await tl.flush()
        start = res.end_lsn
        page = start & ~8191
        dec = WalStreamDecoder(start, data_start=page)
        ing = WalIngest(tl)
        if general is not None:
            real = ing.ingest_records

            async def counting(recs: Sequence[DecodedRecord]) -> None:
                general.append(len(recs))
                await real(recs)

            ing.ingest_records = counting  # type: ignore[method-assign]  # (a count of what took that path)
        per_piece: list[tuple[int, int]] = []
        with capture_puts() as puts:
            for at in range(page - WAL_SEGMENT_SIZE, len(wal.wal), chunk):
                piece = wal.wal[at : at + chunk]
                dec.feed(piece)
                if fused:
                    n, end_lsn, stop = await ing.ingest_decoder(dec)
                    last = int(end_lsn)
                else:
                    batch: list[DecodedRecord] = []
                    stop = dec.decode_into(batch)
                    n, last = len(batch), int(batch[-1].end_lsn) if batch else 0
                    if batch:
                        await ing.ingest_records(batch)
                per_piece.append((n, last))
                if isinstance(stop, EndOfWal):
                    break
        out = (
            list(puts), per_piece, tl.last_record_lsn, attrs.evolve(ing.stats),
            dict(ing.w.rel_sizes), ing.w.checkpoint, ing.last_record,
        )
        nursery.cancel_scope.cancel()
    await tenant.shutdown()
    return out


@pytest.mark.parametrize("chunk", [CHUNK, 8192 + 13])
async def test_fused_ingest_equals_batch_path(pg_tmp_path: Path, real_wal: RealWal, chunk: int) -> None:
    want = await _puts(pg_tmp_path / "batch", real_wal, False, chunk)
    general: list[int] = []
    got = await _puts(pg_tmp_path / "fused", real_wal, True, chunk, general)
    puts, _, last_record_lsn, stats = want[:4]
    assert len(puts) > 50_000
    assert last_record_lsn >= real_wal.end
    assert got[0] == puts  # every value, in order
    assert got[1:] == want[1:]
    # not vacuous: most records went through the fused path, not ingest_records
    assert isinstance(stats, walingest.IngestStats)
    assert sum(general) < stats.records // 3


async def test_waiters_inside_a_batch_wake(pg_tmp_path: Path, real_wal: RealWal) -> None:
    """``last_record_lsn`` advances per batch, not per record: a reader waiting for the end of
    any record inside a batch is woken by the time the batch is in, and never sees an LSN
    whose record is not completely stored."""
    async with trio.open_nursery() as nursery:
        tenant = Tenant(pg_tmp_path, TenantId.generate(), CONFIG, nursery=nursery)
        tl = await tenant.create_timeline(TimelineId.generate())
        res = await import_datadir(tl, real_wal.init)
        start = res.end_lsn
        page = start & ~8191
        dec = WalStreamDecoder(start, data_start=page)
        dec.feed(real_wal.wal[page - WAL_SEGMENT_SIZE : page - WAL_SEGMENT_SIZE + 4 * CHUNK])
        batch: list[DecodedRecord] = []
        dec.decode_into(batch)
        assert len(batch) > 1000
        ing = WalIngest(tl)
        woken: dict[int, Lsn] = {}
        mid = Lsn(batch[len(batch) // 2].lsn + 1)
        targets = [batch[0].end_lsn, batch[1].end_lsn, mid, batch[-1].end_lsn]

        async def wait(i: int, lsn: Lsn) -> None:
            await tl.wait_lsn(lsn, timeout_s=30)
            woken[i] = tl.last_record_lsn

        for i, lsn in enumerate(targets):
            nursery.start_soon(wait, i, lsn)
        await trio.testing.wait_all_tasks_blocked()
        assert not woken
        await ing.ingest_records(batch)
        assert tl.last_record_lsn == batch[-1].end_lsn
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(woken) == list(range(len(targets)))
        assert all(seen >= targets[i] for i, seen in woken.items())
        # every LSN a waiter saw is the end of a record of the batch
        ends = {rec.end_lsn for rec in batch}
        assert set(woken.values()) <= ends
        nursery.cancel_scope.cancel()
    await tenant.shutdown()
