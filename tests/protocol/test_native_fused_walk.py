"""``fused_walk``, the ingest kernel's walk over a whole piece of WAL: compiled against the twin.

On a bulk load's WAL (pages and a segment boundary crossed, records crossing pages) both give
the same result from every record start, with the input cut anywhere and with single bytes
changed (a seeded sample of each); and the walk takes nearly the whole load in one call. The
``pagestore fuzz fused-walk`` harness accepts its seeds, catches a planted difference, and
finds none on a seeded sample of mutated inputs."""

from __future__ import annotations

import random
import struct
from array import array
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench.fuzz import (
    _WALK_RELS,
    WALK_BASE,
    _harness,
    bulk_load_wal,
    fix_crcs,
    walk_outcome,
    write_seeds,
)
from protocol.wal.encoder import BlockSpec
from tests.conftest import kernel
from tests.fuzz_helpers import harness_takes_its_seeds_and_catches
from tests.pageserver import test_walingest_fused as fz

INGEST = "protocol._ingest_c"
REL = (1663, 5, 16384, 0)


def _norm(result: tuple[Any, ...]) -> tuple[Any, ...]:
    items = [tuple(x.tolist() if isinstance(x, array) else x for x in item) for item in result[4]]
    return (*result[:4], items, *result[5:])


def _outcome(fn: Any, *args: Any) -> tuple[Any, ...]:
    try:
        return ("ok", _norm(fn(*args)))
    except Exception as exc:
        return ("err", type(exc).__name__, str(exc))


@pytest.fixture(scope="module")
def load() -> tuple[bytes, int, list[tuple[int, int]]]:
    wal, spans = fz.encode(fz._bulk_load(600))
    base = fz.WAL_START  # (buf[0] is the first record)
    return bytes(wal), base, [(int(s), int(e)) for s, e in spans]


@pytest.mark.native
def test_native_equals_twin_on_a_bulk_load(load: tuple[bytes, int, list[tuple[int, int]]]) -> None:
    wal, base, spans = load
    c, py = kernel("native", INGEST).fused_walk, kernel("python", INGEST).fused_walk
    rng = random.Random(17)
    for i in range(1, len(spans), 7):
        pos, prev = spans[i][0], spans[i - 1][0]
        for rels in ((), ((*REL, 0),), ((*REL, 1000),)):
            buf = wal
            if i % 3 == 0:
                buf = wal[: rng.randrange(pos - base, len(wal) + 1)]
            elif i % 3 == 1:
                at = rng.randrange(pos - base, len(wal))
                buf = wal[:at] + bytes((wal[at] ^ (1 << rng.randrange(8)),)) + wal[at + 1 :]
            args = (buf, base, pos, prev, pos & ~8191, 1, 16 << 20, rels, 10_000, 0)
            assert _outcome(c, *args) == _outcome(py, *args)


def test_the_walk_takes_the_load(impl: str, load: tuple[bytes, int, list[tuple[int, int]]]) -> None:
    wal, base, spans = load
    walk = kernel(impl, INGEST).fused_walk
    pos, prev = spans[1][0], spans[0][0]
    got = walk(wal, base, pos, prev, pos & ~8191, 1, 16 << 20, ((*REL, 1000),), 10_000, 0)
    # it stops only at the long page header of the segment boundary (and what the load
    # itself cannot take), and ends where records end
    assert got[3] > 40
    assert got[0] in {e for _s, e in spans}
    values = [v for item in got[4] if len(item) == 6 for v in item[1]]
    assert values == sorted(values) and len(values) == got[3]


def test_bad_arguments_are_the_same_value_error(impl: str) -> None:
    walk = kernel(impl, INGEST).fused_walk
    with pytest.raises(ValueError, match="MAXALIGNed"):
        walk(b"\0" * 64, 0, 100, 0, 0, 1, 16 << 20, (), 0, 0)
    with pytest.raises(ValueError, match="segment size"):
        walk(b"\0" * 64, 0, 8, 0, 0, 1, 1000, (), 0, 0)
    with pytest.raises(ValueError, match="relation fork"):
        walk(b"\0" * 64, 0, 8, 0, 0, 1, 16 << 20, ((1, 2, 3),), 0, 0)


@pytest.mark.native
@pytest.mark.parametrize("breaker", ["vm-bit", "bad-crc", "other-length", "other-block"])
def test_a_run_broken_in_the_middle(breaker: str) -> None:
    """The twin checks the like records after a taken one as a run (``same_run``): a record
    in the middle of a page's run that must not be taken -- an INSERT clearing a VM bit, a
    wrong CRC -- or that starts a new run -- another length, another block -- gives the
    compiled kernel's result exactly, from every record before it on its page."""
    specs = fz._bulk_load(120, every=1000)
    at = 30
    if breaker == "vm-bit":
        specs[at]["main_data"] = struct.pack("<HB", 1 + at, 1)
    elif breaker == "other-length":
        specs[at]["blocks"] = [BlockSpec(fz.A, 3, data=fz._tuple(108))]
    elif breaker == "other-block":
        specs[at]["blocks"] = [BlockSpec(fz.A, 2, data=fz._tuple(100))]
    wal, spans = fz.encode(specs)
    wal = bytes(wal)
    base = fz.WAL_START
    if breaker == "bad-crc":
        s = spans[at][0] - base
        wal = wal[: s + 60] + bytes((wal[s + 60] ^ 0x10,)) + wal[s + 61 :]
    c, py = kernel("native", INGEST).fused_walk, kernel("python", INGEST).fused_walk
    page = spans[at][0] & ~8191
    firsts = [i for i in range(1, at + 1) if spans[i][0] & ~8191 == page and spans[i - 1][0] >= page]
    assert len(firsts) > 5
    for i in firsts:
        pos, prev = spans[i][0], spans[i - 1][0]
        args = (wal, base, pos, prev, page, 1, 16 << 20, ((*REL, 1000),), 10_000, 0)
        got = _outcome(c, *args)
        assert got == _outcome(py, *args)
        assert got[0] == "ok"
        taken_to = got[1][0]
        if breaker in ("vm-bit", "bad-crc"):
            assert taken_to == spans[at][0]  # stopped right before it
        else:
            assert taken_to > spans[at][1]  # (taken, in a run of its own)


# --- the fuzz harness (pagestore fuzz fused-walk; atheris itself is not needed here) ----------


def test_fuzz_harness_accepts_its_seeds_and_catches_a_planted_difference(tmp_path: Path) -> None:
    twin = kernel("python", INGEST)

    def lying(*args: Any) -> tuple[Any, ...]:
        got = twin.fused_walk(*args)
        return (*got[:3], got[3] - 1, *got[4:])

    liar = SimpleNamespace(fused_walk=lying)
    for data in harness_takes_its_seeds_and_catches("fused-walk", tmp_path, twin, liar, seeds=5):
        # the seeds are not vacuous: from their record the walk takes dozens of records,
        # across pages, or (the seed whose relation set is empty) stops at the unknown fork
        got = walk_outcome(twin, data)
        assert got is not None and got[0] == "ok"
        records, stop = got[4], got[7]
        assert isinstance(records, int)
        if _WALK_RELS[data[4] % len(_WALK_RELS)]:
            assert records >= 30
        else:
            assert (records, stop) == (0, twin.WALK_REL)


@pytest.mark.native
def test_native_equals_twin_on_mutated_harness_inputs(tmp_path: Path) -> None:
    """The harness's inputs with a few bytes changed (parameters or WAL) or cut short, a seeded
    sample: what ``pagestore fuzz fused-walk`` does for as long as it is told."""
    write_seeds("fused-walk", tmp_path)
    check = _harness("fused-walk", kernel("native", INGEST), kernel("python", INGEST))
    rng = random.Random(1717)
    for seed in sorted(tmp_path.iterdir()):
        data = seed.read_bytes()
        for _ in range(200):
            buf = bytearray(data[: rng.randrange(8, len(data) + 1)] if rng.random() < 0.3 else data)
            for _ in range(rng.randrange(1, 4)):
                at = rng.randrange(8) if rng.random() < 0.4 else rng.randrange(len(buf))
                buf[at] = rng.randrange(256)
            check(bytes(buf))


def test_fuzz_inputs_can_keep_their_crcs_right() -> None:
    """``fix_crcs`` (mode bit 0x20 of a harness input) recomputes the CRCs of the records it
    follows, across page headers and the segment's long one: broken CRCs come back right, and
    right ones stay as they are."""
    wal, spans = bulk_load_wal(220, 7)
    at = spans[1][0] - WALK_BASE
    kept = bytearray(wal)
    fix_crcs(kept, at, limit=1000)
    assert kept == wal
    broken = bytearray(wal)
    for s, _e in spans[1:]:
        broken[s - WALK_BASE + 20] ^= 0xFF if s % 8192 + 24 <= 8192 else 0
    assert broken != wal
    fix_crcs(broken, at, limit=1000)
    assert broken == wal
