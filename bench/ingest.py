"""``pagestore bench ingest``: bulk WAL ingest throughput across the write-path IO knobs.

What one row measures: a fresh tenant and timeline in a fresh directory, then the whole write
path, timed from WAL bytes to a durable L0 layer:

    WAL bytes (fed in 1 MiB chunks, like XLogData) -> ``WalStreamDecoder.decode_into``
    -> ``WalIngest.ingest_records`` (the WAL receiver's batch path) -> ``Timeline.put_mixed_nowait``
    -> in-memory layer -> ``EphemeralFile``
    -> ``Timeline.flush()`` (freeze, L0 delta layer written through ``BufferedWriter``, fsync,
    rename, index_part.json)

The WAL is built once per run, before any timing, with the protocol WAL encoder (``WalEncoder``),
and every row ingests the same bytes. It imitates a bulk load into one table:

- ``Heap/INSERT`` records with 100-200 bytes of tuple data (a 5-byte ``xl_heap_header`` plus the
  tuple as block data, 3 bytes of main data), filling 8 KiB heap pages in order; the first
  insert on each page carries ``XLOG_HEAP_INIT_PAGE`` (will_init);
- an ``XLOG/FPI_FOR_HINT`` full-page image of an already filled page every ``--fpi-every``
  pages (default 4: about a fifth of the WAL bytes), like the hint-bit FPIs that a first scan
  after a checkpoint writes.

The matrix is io_engine x write_buffer_size x double_buffering x sync mode (the engine's
``write_sync_mode``, which applies to the ephemeral file, the layer files and index_part.json).
All rows of one table come from one process run; each row prints one JSON object as soon as it
is done (with ``--repeat N`` the rounds are interleaved and a ``median_of`` row per
configuration follows at the end), then a final ``summary`` object compares the best row with
the seed's bad case (threadpool, 8 KiB, no double buffering, sync mode none).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import trio

from pageserver.pg_control import CheckPoint
from pageserver.storage.config import StorageConfig
from pageserver.storage.io_engine import IO_ENGINE_KINDS, SYNC_MODES, SyncMode, make_io_engine
from pageserver.tenant import Tenant
from pageserver.walingest import WalIngest
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from protocol.wal.encoder import BlockSpec, WalEncoder
from protocol.wal.reader import WalStreamDecoder
from protocol.wal.record import DecodedRecord, RelFileNode
from protocol.wal.rmgr import XLOG_FPI_FOR_HINT, XLOG_HEAP_INIT_PAGE, XLOG_HEAP_INSERT, RmgrId

MiB = 1 << 20
KiB = 1 << 10
# The WAL starts in the second segment; the timeline is seeded just below it.
WAL_START = Lsn(0x0100_0028)
SEED_LSN = Lsn(0x0100_0000)
REL = RelFileNode(1663, 5, 16384)
FEED_CHUNK = MiB
PAGE_SIZE = 8192
_HEAP_HEADER = struct.Struct("<HHB")  # xl_heap_header: t_infomask2, t_infomask, t_hoff
_HEAP_INSERT = struct.Struct("<HB")  # xl_heap_insert: offnum, flags
_PAGE_HEADER = struct.Struct("<QHHHHHHI")
_TUPLE_OVERHEAD = 24 + 4  # heap tuple header + line pointer
SEED_BAD = ("threadpool", 8 * KiB, False, "none")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mib", type=int, default=256, help="MiB of WAL to ingest per row (default 256)")
    parser.add_argument("--io-engine", choices=IO_ENGINE_KINDS, action="append",
                        help="engines to run (repeatable; default: all)")
    parser.add_argument("--buffer-kib", type=int, action="append",
                        help="write_buffer_size in KiB (repeatable; default: 8, 64, 1024)")
    parser.add_argument("--double-buffering", choices=["off", "on"], action="append",
                        help="repeatable; default: both")
    parser.add_argument("--sync-mode", choices=SYNC_MODES, action="append",
                        help="repeatable; default: all three")
    parser.add_argument("--fpi-every", type=int, default=4,
                        help="one FPI_FOR_HINT full-page image per this many heap pages (0: none)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the tenant directories go (default: a temp dir under /tmp)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds over the whole matrix (interleaved, so background load hits "
                             "every row alike); each row reports its median")


# -- the WAL --------------------------------------------------------------------------------


def _page_image(rng: random.Random, blkno: int, ntuples: int) -> bytes:
    """A plausible full heap page: header, line pointers, tuples at the end, a small hole."""
    lower = 24 + 4 * ntuples
    used = min(PAGE_SIZE - lower - 64, ntuples * 150)
    upper = PAGE_SIZE - used
    page = bytearray(PAGE_SIZE)
    _PAGE_HEADER.pack_into(page, 0, 0, 0, 0, lower, upper, PAGE_SIZE, PAGE_SIZE | 4, 0)
    page[24:lower] = rng.randbytes(lower - 24)
    page[upper:] = rng.randbytes(used)
    struct.pack_into("<I", page, upper, blkno)
    return bytes(page)


def build_wal(target_bytes: int, *, fpi_every: int, seed: int) -> tuple[list[bytes], dict[str, int]]:
    """WAL of at least ``target_bytes`` starting at ``WAL_START``, in ``FEED_CHUNK`` pieces."""
    rng = random.Random(seed)
    enc = WalEncoder(WAL_START, prev_lsn=SEED_LSN)
    chunks: list[bytes] = []
    size = 0
    counts = {"heap_inserts": 0, "fpis": 0, "heap_pages": 0, "tuple_bytes": 0}
    blkno = 0
    free = 0
    offnum = 0
    xid = 1000
    filled_pages: list[tuple[int, int]] = []
    while size < target_bytes:
        tuple_len = rng.randint(100, 200)
        need = tuple_len + _TUPLE_OVERHEAD
        info = XLOG_HEAP_INSERT
        if need > free:
            if offnum:
                filled_pages.append((blkno, offnum))
                blkno += 1
                counts["heap_pages"] += 1
                if fpi_every and counts["heap_pages"] % fpi_every == 0:
                    old_blk, old_n = filled_pages[rng.randrange(len(filled_pages))]
                    enc.append(RmgrId.XLOG, XLOG_FPI_FOR_HINT,
                               blocks=[BlockSpec(REL, old_blk, image=_page_image(rng, old_blk, old_n))])
                    counts["fpis"] += 1
            free = PAGE_SIZE - 24
            offnum = 0
            info |= XLOG_HEAP_INIT_PAGE
        free -= need
        offnum += 1
        data = _HEAP_HEADER.pack(2, 0x0800, 24) + rng.randbytes(tuple_len)
        enc.append(
            RmgrId.HEAP,
            info,
            xid=xid + counts["heap_inserts"] // 10_000,  # transactions of 10000 rows
            blocks=[BlockSpec(REL, blkno, data=data, will_init=bool(info & XLOG_HEAP_INIT_PAGE))],
            main_data=_HEAP_INSERT.pack(offnum, 0),
        )
        counts["heap_inserts"] += 1
        counts["tuple_bytes"] += tuple_len
        if enc.buffered >= FEED_CHUNK:
            chunk = enc.take()
            chunks.append(chunk)
            size += len(chunk)
    tail = enc.take()
    if tail:
        chunks.append(tail)
        size += len(tail)
    counts["wal_bytes"] = size
    counts["end_lsn"] = int(enc.insert_lsn)
    return chunks, counts


# -- one row --------------------------------------------------------------------------------


@attrs.frozen
class RowConfig:
    io_engine: str
    write_buffer_size: int
    double_buffering: bool
    sync_mode: SyncMode


async def _seed_timeline(ingest: WalIngest) -> None:
    """What initdb + basebackup import would leave: a checkpoint and the database directory."""
    mod = ingest.w.begin(SEED_LSN)
    mod.put_checkpoint(CheckPoint(
        redo=SEED_LSN, this_timeline_id=1, prev_timeline_id=1, full_page_writes=True,
        next_xid=1000, next_oid=16384, next_multi=1, next_multi_offset=0, oldest_xid=3,
        oldest_xid_db=1, oldest_multi=1, oldest_multi_db=1, time=0, oldest_commit_ts_xid=0,
        newest_commit_ts_xid=0, oldest_active_xid=0,
    ))
    await mod.put_dbdir_creation(REL.spc, REL.db)
    await mod.commit()


async def run_row(
    row: RowConfig, chunks: list[bytes], workdir: Path, *, keep: bool = False
) -> dict[str, Any]:
    """Ingest ``chunks`` into a fresh tenant under ``workdir`` with ``row``'s knobs; the result
    row as a dict. ``keep`` leaves the timeline directory (its path is in ``"timeline_dir"``)."""
    engine = make_io_engine(row.io_engine, write_sync_mode=row.sync_mode)
    config = StorageConfig(
        io_engine=row.io_engine,  # type: ignore[arg-type]
        write_buffer_size=row.write_buffer_size,
        double_buffering=row.double_buffering,
        compaction_period_s=0,
        gc_period_s=0,
    )
    path = workdir / f"tenant-{row.io_engine}-{row.write_buffer_size}-{int(row.double_buffering)}-{row.sync_mode}"
    path.mkdir()
    async with trio.open_nursery() as nursery:
        tenant = Tenant(path, TenantId(os.urandom(16)), config, engine=engine, nursery=nursery)
        tl = await tenant.create_timeline(TimelineId(os.urandom(16)), start_lsn=Lsn(SEED_LSN - 8))
        ingest = WalIngest(tl)
        await _seed_timeline(ingest)
        engine.stats.reset()
        decoder = WalStreamDecoder(WAL_START)
        gc.collect()
        t0 = time.perf_counter()
        for chunk in chunks:
            decoder.feed(chunk)
            batch: list[DecodedRecord] = []
            decoder.decode_into(batch)
            await ingest.ingest_records(batch)
        t_ingested = time.perf_counter()
        await tl.flush()
        t1 = time.perf_counter()
        stats = engine.stats.snapshot()
        layers = [p for p in tl.path.iterdir() if "__" in p.name]
        layer_bytes = sum(p.stat().st_size for p in layers)
        for layer in tl.in_memory_layers():
            await layer.aclose()
        nursery.cancel_scope.cancel()
    if not keep:
        shutil.rmtree(path)
    wal_bytes = sum(map(len, chunks))
    seconds = t1 - t0
    return {
        "io_engine": row.io_engine,
        "write_buffer_size": row.write_buffer_size,
        "double_buffering": row.double_buffering,
        "sync_mode": row.sync_mode,
        "wal_mib": round(wal_bytes / MiB, 1),
        "seconds": round(seconds, 3),
        "mb_per_s": round(wal_bytes / 1e6 / seconds, 2),
        "ingest_seconds": round(t_ingested - t0, 3),
        "flush_seconds": round(t1 - t_ingested, 3),
        "records": ingest.stats.records,
        "values": ingest.stats.values,
        "l0_layers": len(layers),
        "layer_mib": round(layer_bytes / MiB, 1),
        "pwrites": stats["pwrites"],
        "preads": stats["preads"] + stats["preadvs"],
        "fsyncs": stats["fsyncs"],
        "mib_written": round(stats["bytes_written"] / MiB, 1),
        **({"timeline_dir": str(tl.path)} if keep else {}),
    }


def _matrix(args: argparse.Namespace) -> list[RowConfig]:
    engines = args.io_engine or list(IO_ENGINE_KINDS)
    sizes = [k * KiB for k in (args.buffer_kib or [8, 64, 1024])]
    dbs = [d == "on" for d in (args.double_buffering or ["off", "on"])]
    modes = args.sync_mode or list(SYNC_MODES)
    return [RowConfig(e, s, d, m) for m, e, s, d in itertools.product(modes, engines, sizes, dbs)]


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    chunks, counts = build_wal(args.mib * MiB, fpi_every=args.fpi_every, seed=args.seed)
    print(json.dumps({"wal": counts, "build_seconds": round(time.perf_counter() - t0, 2),
                      "path": "WalStreamDecoder -> WalIngest -> Timeline -> EphemeralFile -> flush -> L0"}),
          flush=True)
    base = args.dir or Path(tempfile.gettempdir())
    workdir = Path(tempfile.mkdtemp(prefix="bench-ingest-", dir=base))
    matrix = _matrix(args)
    samples: dict[RowConfig, list[dict[str, Any]]] = {row: [] for row in matrix}
    try:
        for round_no in range(args.repeat):
            for row in matrix:
                try:
                    result = trio.run(run_row, row, chunks, workdir)
                except Exception as exc:  # one failed row (say ENOSPC) must not lose the others
                    print(json.dumps({**attrs.asdict(row), "round": round_no, "error": repr(exc)}),
                          flush=True)
                    continue
                result["round"] = round_no
                samples[row].append(result)
                # Printed at once, so a long run that is stopped early still has its rows.
                print(json.dumps(result), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows: list[dict[str, Any]] = []
    for row in matrix:
        runs = sorted(samples[row], key=lambda r: r["seconds"])
        if not runs:
            continue
        median = dict(runs[len(runs) // 2])
        median.pop("round")
        rows.append(median)
        if args.repeat > 1:
            median["median_of"] = len(runs)
            median["seconds_all"] = [r["seconds"] for r in samples[row]]
            print(json.dumps(median), flush=True)
    bad = [r for r in rows if (r["io_engine"], r["write_buffer_size"], r["double_buffering"], r["sync_mode"]) == SEED_BAD]
    if rows:
        best = max(rows, key=lambda r: r["mb_per_s"])
        summary: dict[str, Any] = {"summary": True, "best": {k: best[k] for k in (
            "io_engine", "write_buffer_size", "double_buffering", "sync_mode", "mb_per_s")}}
        if bad:
            summary["seed_bad_case_mb_per_s"] = bad[0]["mb_per_s"]
            summary["best_over_seed_bad_case"] = round(best["mb_per_s"] / bad[0]["mb_per_s"], 2)
        print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    from control_plane.cli import main

    sys.exit(main(["bench", "ingest", *sys.argv[1:]]))
