"""``pagestore waldump`` on encoder-made segments: JSON lines, --start/--end, .partial files."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

from control_plane.cli import main as cli_main
from protocol.lsn import WAL_SEGMENT_SIZE, format_lsn
from protocol.wal.encoder import BlockSpec, WalEncoder
from protocol.wal.record import RelFileNode
from tests.protocol.wal_strategies import make_page

RN = RelFileNode(1663, 5, 16384)


def run(*args: str) -> tuple[int, list[dict[str, Any]], str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = cli_main(["waldump", *args])
    return rc, [json.loads(line) for line in out.getvalue().splitlines()], err.getvalue()


def write_wal(tmp_path: Path, *, partial_cut: int | None = None) -> tuple[list[Path], list[tuple[int, int]]]:
    enc = WalEncoder(WAL_SEGMENT_SIZE)
    page = make_page(2, 120, 5000)
    spans: list[tuple[int, int]] = []
    for i in range(2000):
        blocks = [BlockSpec(RN, i, data=b"d" * (i % 50), will_init=i % 4 == 0)]
        if i % 50 == 0:
            blocks.append(BlockSpec(RN, i + 1, image=page, compression="lz4" if i % 100 else None))
        spans.append(enc.append(10, 0x00, xid=1000 + i, blocks=blocks, main_data=bytes(30000 if i % 3 == 0 else 3)))
    enc.zero_fill_to_segment_end()
    data = enc.take()
    paths = []
    nseg = len(data) // WAL_SEGMENT_SIZE
    for k in range(nseg):
        chunk = data[k * WAL_SEGMENT_SIZE : (k + 1) * WAL_SEGMENT_SIZE]
        name = f"00000001000000000000000{k + 1:X}"
        if k == nseg - 1 and partial_cut is not None:
            chunk = chunk[:partial_cut]
            name += ".partial"
        path = tmp_path / name
        path.write_bytes(chunk)
        paths.append(path)
    return paths, spans


def test_dump_all_records(tmp_path: Path) -> None:
    paths, spans = write_wal(tmp_path)
    assert len(paths) == 2
    rc, recs, err = run(*map(str, reversed(paths)))  # any order: sorted by name
    assert rc == 0
    assert [(r["lsn"], r["end_lsn"]) for r in recs] == [(format_lsn(a), format_lsn(b)) for a, b in spans]
    first = recs[0]
    assert first["rmgr"] == "Heap" and first["type"] == "INSERT" and first["xid"] == 1000
    assert first["main_data_len"] == 30000 and first["prev"] == "0/0"
    assert first["blocks"][0] == {
        "id": 0, "spc": 1663, "db": 5, "rel": 16384, "fork": "main", "blk": 0,
        "has_image": False, "apply_image": False, "will_init": True, "hole_offset": 0,
        "hole_length": 0, "bimg_len": 0, "compression": None, "data_len": 0,
    }
    img = first["blocks"][1]
    assert img["has_image"] and img["apply_image"] and (img["hole_offset"], img["hole_length"]) == (120, 4880)
    assert first["rec_len"] == first["tot_len"] - img["bimg_len"]
    assert f"valid WAL ends at {format_lsn(spans[-1][1])}" in err
    assert "wanted 24, got 0" in err


def test_start_and_end(tmp_path: Path) -> None:
    paths, spans = write_wal(tmp_path)
    start = spans[100][0] + 8  # not a record start: the next record is found, like pg_waldump
    end = spans[200][1]
    rc, recs, _ = run(*map(str, paths), "--start", format_lsn(start), "--end", format_lsn(end))
    assert rc == 0
    assert [r["lsn"] for r in recs] == [format_lsn(s[0]) for s in spans[101:201]]


def test_partial_segment(tmp_path: Path) -> None:
    paths, spans = write_wal(tmp_path, partial_cut=200_000)
    assert paths[-1].name.endswith(".partial")
    rc, recs, err = run(*map(str, paths))
    assert rc == 0
    got = [r["lsn"] for r in recs]
    assert got == [format_lsn(s[0]) for s in spans[: len(got)]]
    assert 0 < len(got) < len(spans)
    assert "end of WAL input" in err


def test_gap_between_segments_is_refused(tmp_path: Path) -> None:
    a = tmp_path / "000000010000000000000001"
    b = tmp_path / "000000010000000000000003"
    a.write_bytes(b"")
    b.write_bytes(b"")
    rc, _, err = run(str(a), str(b))
    assert rc == 2 and "does not follow" in err


def test_bad_arguments_are_usage_errors_not_tracebacks(tmp_path: Path) -> None:
    seg = tmp_path / "000000010000000000000001"
    seg.write_bytes(bytes(WAL_SEGMENT_SIZE))
    cases = [
        ((str(tmp_path / "000000010000000000000002"),), "not a readable file"),
        ((str(seg), "--start", "nonsense"), "--start: invalid LSN"),
        ((str(seg), "--end", "1/zz"), "--end: invalid LSN"),
        ((str(seg), "--segment-size", "0"), "--segment-size 0"),
        ((str(seg), "--segment-size", "3000000"), "not a power of two"),
    ]
    for args, expected in cases:
        rc, records, err = run(*args)
        assert (rc, records) == (2, []), (args, err)
        assert expected in err, (args, err)
