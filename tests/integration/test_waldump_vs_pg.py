"""``pagestore waldump`` against ``pg_waldump -b`` on WAL a real PostgreSQL 15 wrote.

One cluster: initdb, ``pgbench -i -s 1``, a short pgbench run, VACUUM, CREATE INDEX,
CHECKPOINT, then updates after checkpoints with ``wal_compression`` pglz, lz4 and zstd (so
compressed full-page images appear), then a clean shutdown. Every record pg_waldump prints
must agree with ours field by field; every image must restore to a sane page. Corrupted
copies of the segments must end where pg_waldump says valid WAL ends. Our encoder's output
must be read by pg_waldump without complaint, and agree too.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import struct
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from compute.postgres import (
    PostgresInstance,
    chown_to_postgres,
    make_postgres_dir,
    pg_binary,
    run_as_postgres,
)
from control_plane.cli import main as cli_main
from protocol.lsn import (
    WAL_SEGMENT_SIZE,
    XLOG_BLCKSZ,
    format_lsn,
    parse_lsn,
    parse_segment_file_name,
)
from protocol.wal.encoder import BlockSpec, WalEncoder
from protocol.wal.reader import WalStreamDecoder
from protocol.wal.record import RelFileNode
from tests.protocol.wal_strategies import make_page
from tests.tmpdirs import pg_tmpdir

pytestmark = pytest.mark.postgres

_REC = re.compile(
    r"^rmgr: (\S+)\s+len \(rec/tot\):\s*(\d+)/\s*(\d+), tx:\s*(\d+), "
    r"lsn: ([0-9A-F]+/[0-9A-F]+), prev ([0-9A-F]+/[0-9A-F]+), desc: (.*)$"
)
_BLK = re.compile(
    r"^\tblkref #(\d+): rel (\d+)/(\d+)/(\d+) fork (\w+) blk (\d+)"
    r"(?: \((FPW|FPW for WAL verification)\); hole: offset: (\d+), length: (\d+)"
    r"(?:, compression saved: (\d+), method: (\w+))?)?$"
)
_ERR = re.compile(r"error in WAL record at ([0-9A-F]+/[0-9A-F]+): (.*)$")


def parse_pg_waldump(text: str) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for line in text.splitlines():
        if not line:
            continue
        m = _REC.match(line)
        if m:
            rmgr, rec_len, tot_len, xid, lsn, prev, desc = m.groups()
            records.append({
                "rmgr": rmgr, "rec_len": int(rec_len), "tot_len": int(tot_len), "xid": int(xid),
                "lsn": format_lsn(parse_lsn(lsn)), "prev": format_lsn(parse_lsn(prev)),
                "type": desc.split(" ")[0] if not desc.startswith("UNKNOWN") else desc.strip(),
                "blocks": [],
            })
            continue
        b = _BLK.match(line)
        assert b, f"unexpected pg_waldump line: {line!r}"
        bid, spc, db, rel, fork, blk, fpw, hoff, hlen, saved, method = b.groups()
        records[-1]["blocks"].append({
            "id": int(bid), "spc": int(spc), "db": int(db), "rel": int(rel), "fork": fork,
            "blk": int(blk), "has_image": fpw is not None, "apply_image": fpw == "FPW",
            "hole_offset": int(hoff or 0), "hole_length": int(hlen or 0),
            "compression": method, "saved": None if saved is None else int(saved),
        })
    return records


def pg_waldump(wal_dir: Path, start: int) -> tuple[list[dict[str, Any]], tuple[str, str] | None]:
    proc = run_as_postgres(
        [pg_binary("pg_waldump"), "-b", "-p", str(wal_dir), "-s", format_lsn(start)], check=False
    )
    m = _ERR.search(proc.stderr.decode())
    err = None if m is None else (m.group(1), m.group(2))
    return parse_pg_waldump(proc.stdout.decode()), err


def ours(segments: list[Path], *extra: str) -> tuple[list[dict[str, Any]], str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        assert cli_main(["waldump", *map(str, segments), *extra]) == 0
    return [json.loads(line) for line in out.getvalue().splitlines()], err.getvalue()


def compare(theirs: list[dict[str, Any]], mine: list[dict[str, Any]]) -> None:
    assert len(mine) == len(theirs), (len(mine), len(theirs))
    for t, m in zip(theirs, mine, strict=True):
        where = t["lsn"]
        for key in ("lsn", "prev", "rmgr", "rec_len", "tot_len", "xid", "type"):
            assert m[key] == t[key], (where, key, m[key], t[key])
        assert len(m["blocks"]) == len(t["blocks"]), where
        for tb, mb in zip(t["blocks"], m["blocks"], strict=True):
            for key in ("id", "spc", "db", "rel", "fork", "blk", "has_image", "apply_image",
                        "hole_offset", "hole_length", "compression"):
                assert mb[key] == tb[key], (where, key, mb[key], tb[key])
            if tb["saved"] is not None:
                assert tb["saved"] == 8192 - mb["hole_length"] - mb["bimg_len"], where


def segment_files(wal_dir: Path) -> list[Path]:
    return sorted(p for p in wal_dir.iterdir() if re.fullmatch(r"[0-9A-F]{24}", p.name))


@pytest.fixture(scope="module")
def cluster_wal() -> Iterator[Path]:
    # Module scope, so the pg_tmp_path fixture (function scope) cannot be used.
    with pg_tmpdir("pagestore-waldump-") as base:
        pg = PostgresInstance.create(
            base / "data",
            settings={
                # logical: subtransactions then log their top-level xid (block id 252)
                "wal_level": "logical",
                "full_page_writes": "on",
                "wal_keep_size": "1GB",  # keep every segment since initdb
                "fsync": "off",
            },
        )
        try:
            pg.start()
            pg.pgbench("-i", "-s", "1", "-q")
            pg.pgbench("-n", "-t", "300")
            for sql in ("VACUUM", "CREATE INDEX ON pgbench_accounts (abalance)", "CHECKPOINT"):
                pg.psql(sql)
            for method in ("pglz", "lz4", "zstd"):
                pg.psql("CHECKPOINT")
                pg.psql(
                    f"SET wal_compression = '{method}'; "
                    "UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid % 97 = 0"
                )
            # Consistency checking attaches images without APPLY ("FPW for WAL verification").
            pg.psql(
                "SET wal_consistency_checking = 'heap,btree'; "
                "UPDATE pgbench_accounts SET abalance = abalance - 1 WHERE aid % 1000 = 0"
            )
            # A replication origin (block id 253) and a subtransaction (block id 252).
            pg.psql("SELECT pg_replication_origin_create('pagestore_test')")
            pg.psql(
                "SELECT pg_replication_origin_session_setup('pagestore_test'); BEGIN; "
                "INSERT INTO pgbench_history VALUES (1, 1, 1, 1, now(), 'top'); SAVEPOINT s1; "
                "INSERT INTO pgbench_history VALUES (2, 2, 2, 2, now(), 'sub'); RELEASE s1; COMMIT"
            )
            pg.stop()
            yield pg.wal_dir()
        finally:
            pg.stop("immediate")


def test_every_record_agrees_with_pg_waldump(cluster_wal: Path) -> None:
    segs = segment_files(cluster_wal)
    start = parse_segment_file_name(segs[0].name)[1] * WAL_SEGMENT_SIZE
    theirs, err = pg_waldump(cluster_wal, start)
    mine, stderr = ours(segs)
    compare(theirs, mine)
    assert err is not None
    last_lsn, reason = err
    assert f"(last record at {last_lsn}): {reason}" in stderr
    n_images = sum(b["has_image"] for r in mine for b in r["blocks"])
    methods = {b["compression"] for r in mine for b in r["blocks"] if b["has_image"]}
    assert {None, "pglz", "lz4", "zstd"} <= methods
    assert any(b["has_image"] and not b["apply_image"] for r in mine for b in r["blocks"])
    print(f"\n{len(mine)} records agree with pg_waldump ({n_images} images, end: {reason})")


def test_images_restore_to_sane_pages_and_fragments_decode(cluster_wal: Path) -> None:
    dec = WalStreamDecoder(0x1000000)
    count = 0
    origins: set[int] = set()
    top_xids: set[int] = set()
    for seg in segment_files(cluster_wal):
        dec.feed(seg.read_bytes())
        for rec in dec.records():
            if rec.origin is not None:
                origins.add(rec.origin)
            if rec.toplevel_xid is not None:
                top_xids.add(rec.toplevel_xid)
                assert rec.xl_xid != rec.toplevel_xid
            for blk in rec.blocks:
                page = blk.image
                if page is None:
                    continue
                count += 1
                assert len(page) == XLOG_BLCKSZ
                lower, upper, special, version = struct.unpack_from("<HHHH", page, 12)
                if upper == 0:  # a new, all-zero page
                    assert page == bytes(XLOG_BLCKSZ)
                    continue
                assert version == 0x2004, (format_lsn(rec.lsn), blk.compression)
                assert 24 <= lower <= upper <= special <= XLOG_BLCKSZ
                if blk.hole_length:
                    assert (blk.hole_offset, blk.hole_offset + blk.hole_length) == (lower, upper)
                    assert page[lower:upper] == bytes(upper - lower)
    assert count > 100
    assert origins and top_xids, (origins, top_xids)


def _copy_segments(src: Path, dst: Path) -> list[Path]:
    make_postgres_dir(dst)
    out = []
    for seg in segment_files(src):
        shutil.copyfile(seg, dst / seg.name)
        out.append(dst / seg.name)
    chown_to_postgres(dst)
    return out


def test_corruption_ends_where_pg_waldump_says(cluster_wal: Path, pg_tmp_path: Path) -> None:
    segs = segment_files(cluster_wal)
    dec = WalStreamDecoder(0x1000000)
    records: list[tuple[int, int]] = []
    for seg in segs:
        dec.feed(seg.read_bytes())
        records.extend((r.lsn, r.xl_tot_len) for r in dec.records())
    # Pick records in the middle of the WAL: one inside a page, one spanning pages.
    mid = len(records) // 2
    inside = next(r for r in records[mid:] if r[1] > 40 and r[0] // 8192 == (r[0] + r[1]) // 8192)
    spanning = next(r for r in records[mid:] if r[0] // 8192 != (r[0] + r[1] - 1) // 8192)
    next_page = (spanning[0] // 8192 + 1) * 8192
    # name -> (LSN of the byte, XOR mask, or None to zero it)
    cases: dict[str, tuple[int, int | None]] = {
        "crc": (inside[0] + 30, 0x40),  # a body byte: CRC mismatch
        "length": (inside[0], None),  # xl_tot_len's low byte: bad length or CRC
        "page": (next_page, 0x01),  # the magic of the page a record continues on
        "pageaddr": (next_page + 12, 0x10),
    }
    for name, (lsn, mask) in cases.items():
        dst = pg_tmp_path / name
        copies = _copy_segments(cluster_wal, dst)
        seg = copies[lsn // WAL_SEGMENT_SIZE - 1]
        with seg.open("r+b") as f:
            f.seek(lsn % WAL_SEGMENT_SIZE)
            byte = f.read(1)[0]
            f.seek(lsn % WAL_SEGMENT_SIZE)
            f.write(bytes([0 if mask is None else byte ^ mask]))
        theirs, err = pg_waldump(dst, 0x1000000)
        mine, stderr = ours(copies)
        compare(theirs, mine)
        assert err is not None, name
        assert f"(last record at {err[0]}): {err[1]}" in stderr, (name, err, stderr)
        print(f"{name}: {len(mine)} records, then {err[1]}")


def test_encoder_output_is_read_by_pg_waldump(pg_tmp_path: Path) -> None:
    rn = RelFileNode(1663, 5, 16384)
    enc = WalEncoder(WAL_SEGMENT_SIZE)
    page = make_page(1, 300, 7000)
    for i in range(6000):
        blocks = [BlockSpec(rn, i, data=bytes([i % 256]) * (i % 300), will_init=i % 5 == 0)]
        if i % 9 == 0:
            blocks.append(BlockSpec(RelFileNode(1663, 5, 16390), i, forknum=i % 3, image=page,
                                    apply_image=i % 2 == 0,
                                    compression=[None, "lz4", "zstd", "pglz"][i % 4]))
        # XLOG/NOOP: pg_waldump prints no description, so any main data is fine.
        enc.append(0, 0x20, xid=i, blocks=blocks, main_data=bytes(i * 7 % 9000))
        if i == 3000:
            enc.switch()
    enc.zero_fill_to_segment_end()
    data = enc.take()
    wal = make_postgres_dir(pg_tmp_path / "wal")
    segs = []
    for k in range(len(data) // WAL_SEGMENT_SIZE):
        path = wal / f"00000001000000000000000{k + 1:X}"
        path.write_bytes(data[k * WAL_SEGMENT_SIZE : (k + 1) * WAL_SEGMENT_SIZE])
        segs.append(path)
    chown_to_postgres(wal)
    theirs, err = pg_waldump(wal, WAL_SEGMENT_SIZE)
    assert len(theirs) == 6001
    assert err is not None and err[1].startswith("invalid record length at") and err[1].endswith("got 0")
    mine, stderr = ours(segs)
    compare(theirs, mine)
    assert f"(last record at {err[0]}): {err[1]}" in stderr


def test_truncated_segment(cluster_wal: Path, pg_tmp_path: Path) -> None:
    """A short last file: pg_waldump reads whole pages only, we read every complete record."""
    copies = _copy_segments(cluster_wal, pg_tmp_path / "short")
    last = copies[-1]
    cut = 3_000_000
    with last.open("r+b") as f:
        f.truncate(cut)
    theirs, _ = pg_waldump(pg_tmp_path / "short", 0x1000000)
    mine, stderr = ours(copies)
    compare(theirs, mine[: len(theirs)])
    seg_start = parse_segment_file_name(last.name)[1] * WAL_SEGMENT_SIZE
    # pg_waldump stops before the partial page; we go on to the last record that fits.
    assert len(mine) >= len(theirs)
    ends = [parse_lsn(r["end_lsn"]) for r in mine]
    assert ends[-1] <= seg_start + cut + 7
    assert f"valid WAL ends at {mine[-1]['end_lsn']}" in stderr and "end of WAL input" in stderr
