"""``pagestore waldump SEGMENT...``: print the WAL records of segment files as JSON lines.

One JSON object per record: ``lsn``, ``end_lsn``, ``prev`` (LSNs as ``X/Y``), ``rmgr``
(pg_waldump's resource manager name), ``type`` (pg_waldump's record type, e.g.
``INSERT+INIT``), ``info``, ``xid``, ``tot_len``, ``rec_len`` (pg_waldump's ``rec``: the length
without images), ``blocks`` (``id``, ``spc``, ``db``, ``rel``, ``fork``, ``blk``, ``has_image``,
``apply_image``, ``will_init``, ``hole_offset``, ``hole_length``, ``bimg_len``,
``compression``, ``data_len``) and ``main_data_len``.

Segments must be consecutive (``.partial`` allowed, e.g. the last one); they are sorted by
name. Like pg_waldump, ``--start`` finds the first record at or after the given LSN, and
``--end`` stops before a record that would end past it. Where valid WAL ends, and why, goes
to stderr in pg_waldump's words ("invalid record length at X/Y: wanted 24, got 0").
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from protocol.errors import RemoteProtocolError
from protocol.lsn import (
    WAL_SEGMENT_SIZE,
    XLOG_BLCKSZ,
    Lsn,
    format_lsn,
    parse_lsn,
    parse_segment_file_name,
)
from protocol.wal.reader import EndOfWal, WalStreamDecoder
from protocol.wal.record import FORK_NAMES, DecodedRecord

_CHUNK = 1 << 20


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("segments", nargs="+", metavar="SEGMENT", type=Path,
                        help="WAL segment files (consecutive; NAME.partial allowed)")
    parser.add_argument("--start", metavar="LSN", help="first record at or after this LSN")
    parser.add_argument("--end", metavar="LSN", help="stop before records ending after this LSN")
    parser.add_argument("--segment-size", type=int, default=WAL_SEGMENT_SIZE,
                        help="WAL segment size in bytes (default 16 MiB)")


def record_json(rec: DecodedRecord) -> dict[str, Any]:
    blocks = []
    for b in rec.blocks:
        blocks.append({
            "id": b.block_id,
            "spc": b.rnode.spc,
            "db": b.rnode.db,
            "rel": b.rnode.rel,
            "fork": FORK_NAMES[b.forknum] if b.forknum < len(FORK_NAMES) else str(b.forknum),
            "blk": b.blkno,
            "has_image": b.has_image,
            "apply_image": b.apply_image,
            "will_init": b.will_init,
            "hole_offset": b.hole_offset,
            "hole_length": b.hole_length,
            "bimg_len": b.bimg_len,
            "compression": b.compression,
            "data_len": len(b.data),
        })
    return {
        "lsn": format_lsn(rec.lsn),
        "end_lsn": format_lsn(rec.end_lsn),
        "prev": format_lsn(rec.xl_prev),
        "rmgr": rec.rmgr_name,
        "type": rec.record_type,
        "info": rec.xl_info,
        "xid": rec.xl_xid,
        "tot_len": rec.xl_tot_len,
        "rec_len": rec.xl_tot_len - rec.fpi_len,
        "blocks": blocks,
        "main_data_len": len(rec.main_data),
    }


def _lsn_arg(text: str | None, what: str) -> Lsn | None:
    if text is None:
        return None
    try:
        return parse_lsn(text)
    except RemoteProtocolError as exc:
        raise _UsageError(f"{what}: {exc.msg}") from None


class _UsageError(Exception):
    pass


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except _UsageError as exc:
        print(f"waldump: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    seg_size: int = args.segment_size
    # PostgreSQL's rule (IsValidWalSegSize): a power of two from 1 MiB to 1 GiB.
    if seg_size < 1 << 20 or seg_size > 1 << 30 or seg_size & (seg_size - 1):
        raise _UsageError(f"--segment-size {seg_size} is not a power of two between 1 MiB and 1 GiB")
    try:
        named = sorted(
            (parse_segment_file_name(p.name, seg_size), p) for p in args.segments
        )
    except ValueError as exc:
        raise _UsageError(str(exc)) from None
    for _, path in named:
        if not path.is_file():
            raise _UsageError(f"{path}: not a readable file")
    for ((tli_a, seg_a), _), ((tli_b, seg_b), path_b) in itertools.pairwise(named):
        if seg_b != seg_a + 1 or tli_b != tli_a:
            print(f"waldump: {path_b.name} does not follow the previous segment", file=sys.stderr)
            return 2
    (timeline, first_seg), _ = named[0]
    data_start = first_seg * seg_size
    start_arg = _lsn_arg(args.start, "--start")
    wanted = data_start if start_arg is None else start_arg
    end_limit = _lsn_arg(args.end, "--end")
    if not data_start <= wanted < data_start + seg_size * len(named):
        print(f"waldump: --start {format_lsn(wanted)} is not in the given segments", file=sys.stderr)
        return 2
    # Find the first record like pg_waldump does: scan from the page holding --start.
    page = wanted - wanted % XLOG_BLCKSZ
    decoder = WalStreamDecoder(page, data_start=data_start, segment_size=seg_size, timeline=timeline)
    out = sys.stdout
    dumps = json.dumps
    end: EndOfWal | None = None
    stopped_at_limit = False
    for _, path in named:
        try:
            f = path.open("rb")
        except OSError as exc:
            raise _UsageError(f"{path}: {exc.strerror}") from None
        with f:
            while chunk := f.read(_CHUNK):
                decoder.feed(chunk)
                for rec in decoder.records():
                    if rec.lsn < wanted:
                        continue
                    if end_limit is not None and rec.end_lsn > end_limit:
                        stopped_at_limit = True
                        break
                    out.write(dumps(record_json(rec)) + "\n")
                if stopped_at_limit or decoder.ended is not None:
                    break
        if stopped_at_limit or decoder.ended is not None:
            break
    if stopped_at_limit:
        return 0
    end = decoder.finish()
    last = "none" if end.last_record_lsn is None else format_lsn(end.last_record_lsn)
    print(
        f"waldump: valid WAL ends at {format_lsn(end.lsn)} (last record at {last}): {end.reason}",
        file=sys.stderr,
    )
    return 0
