"""How the fused path uses the WAL pre-check's claims (``pageserver.wal_runs``).

A claim stands for ``_same_run``'s byte checks (and the CRC-32C of every record it covers),
so the ingest must use one only where it speaks about the record at hand: the record is on
the claim's stride grid (``start + i * stride``), with the claim's stride, and never past the
page or the input. The pre-check walks a page from its header's ``xlp_rem_len``, the ingest
from the record before: on hostile WAL (a page header whose ``xlp_rem_len`` lies) the two
walks can disagree, and a true claim about records at other offsets must then cover nothing.
Here such claims are given to the ingest directly, next to a record whose CRC is wrong: the
ingest must stop at that record exactly as it does without claims. (The equality of the
fused path with and without real claims, on all the fused tests' WAL, is in
tests/pageserver/test_walingest_fused.py, ``both``.)
"""

from __future__ import annotations

import tempfile
from array import array
from pathlib import Path

import pytest
import trio

from pageserver.wal_runs import RunClaims, RunFinder
from protocol.lsn import Lsn
from protocol.wal.reader import EndOfWal
from tests.pageserver import test_walingest_fused as fz


def _claims(*triples: tuple[int, int, int]) -> RunClaims:
    return RunClaims(
        array("Q", [t[0] for t in triples]),
        array("Q", [t[1] for t in triples]),
        array("Q", [t[2] for t in triples]),
    )


def _bulk_with_bad_crc(n: int, bad: int) -> tuple[bytes, list[tuple[Lsn, Lsn]]]:
    """``n`` like INSERTs into one block; record ``bad``'s tuple data changed (CRC wrong)."""
    wal, spans = fz.encode(fz._bulk_load(n, every=10_000))
    buf = bytearray(wal)
    buf[spans[bad][0] - fz.WAL_START + 60] ^= 0x55
    return bytes(buf), spans


def _run(wal: bytes, claims: RunClaims | None) -> fz.Run:
    pieces = fz.chunking(len(wal), [131072])
    with tempfile.TemporaryDirectory() as d:
        return trio.run(
            fz.ingest, wal, pieces, True, None, Path(d),
            None if claims is None else (lambda lsn, piece: claims),
        )


@pytest.mark.parametrize("shape", ["misaligned", "other_stride", "later", "true"])
def test_a_claim_covers_only_records_on_its_grid(shape: str) -> None:
    n, bad = 60, 40
    wal, spans = _bulk_with_bad_crc(n, bad)
    plain = _run(wal, None)
    assert isinstance(plain.end, EndOfWal) and plain.last_record_lsn == spans[bad - 1][1]
    page = spans[bad][0] & ~8191
    first = next(i for i, (s, _e) in enumerate(spans) if s > page + 40)  # first record on it
    stride = spans[first + 1][0] - spans[first][0]
    last = next(i for i, (_s, e) in enumerate(spans) if e > page + 8192) - 1  # last inside
    assert first < bad < last
    start = spans[first][0]
    if shape == "misaligned":
        # records at start + 8 + i * stride: none of them is one of the ingest's records
        claim = (start + 8, start + 8 + (last - first - 1) * stride, stride)
    elif shape == "other_stride":
        # records at start + i * (stride + 8): from the second on, none is the ingest's
        claim = (start, start + (bad - first) * (stride + 8), stride + 8)
    elif shape == "later":
        claim = (spans[bad + 1][0], spans[last][0], stride)  # true: the records after it
    else:
        claim = (start, spans[bad - 1][0], stride)  # true: the records before the bad one
    got = _run(wal, _claims(claim))
    fz.assert_same(plain, got)


def test_a_claim_is_not_taken_past_the_page() -> None:
    """A claim whose ``last`` lies past its page (the child never sends one: checked by
    ``WalPrecheck``) is cut at the page's end by the ingest."""
    wal, _spans = fz.encode(fz._bulk_load(400, every=10_000))
    plain = _run(wal, None)
    real = RunFinder().feed(fz.WAL_START, wal)
    assert len(real) >= 3
    starts, lasts, strides = list(real.starts), list(real.lasts), list(real.strides)
    lasts[1] += 40 * strides[1]  # well into the next page
    got = _run(wal, _claims(*zip(starts, lasts, strides, strict=True)))
    fz.assert_same(plain, got)
