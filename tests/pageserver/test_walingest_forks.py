"""Block references to fork numbers PostgreSQL does not have (4-15: the WAL format has four
bits for it, PostgreSQL uses 0-3) are invalid WAL: both ingest paths (``ingest_records`` and
the fused ``ingest_decoder``) stop at such a record with ``RemoteProtocolError`` (XX001)
naming its LSN and the fork, store nothing of it and create no such fork."""

from __future__ import annotations

import re

import pytest

from pageserver.storage.key import rel_block_key
from protocol.lsn import parse_lsn
from protocol.wal.encoder import BlockSpec, WalEncoder
from protocol.wal.record import RelFileNode
from tests.pageserver import test_walingest_fused as fz
from tests.pageserver.test_walingest_fused import WAL_START, A, B, Run
from tests.pageserver.test_walingest_fused_review import btree, insert

DATA_CORRUPTED = "XX001"


def _wal(bad_block: BlockSpec, *, first: BlockSpec | None = None) -> tuple[bytes, int]:
    """Fused-path records, the bad one, more of them; and the end of the record before it."""
    enc = WalEncoder(WAL_START)
    for spec in [insert()] * 4:
        enc.append(**spec)
    before = enc.insert_lsn
    blocks = [bad_block] if first is None else [first, bad_block]
    enc.append(**{**btree(), "blocks": blocks})
    for spec in [insert()] * 4:
        enc.append(**spec)
    return enc.take(), before


def _keys_of(rnode: RelFileNode, fork: int, blkno: int) -> bytes:
    return rel_block_key(rnode.spc, rnode.db, rnode.rel, fork, blkno)


def _assert_refused(run: Run, fork: int, before: int) -> None:
    assert isinstance(run.end, tuple) and run.end[0] == "error", run.end
    _, _, sqlstate, msg = run.end
    assert sqlstate == DATA_CORRUPTED
    assert f"fork number {fork}" in msg, msg
    # the record's start: where the one before ended, or after a page header
    at = re.search(r" at ([0-9A-F]+/[0-9A-F]+)", msg)
    assert at is not None and 0 <= parse_lsn(at.group(1)) - before <= 40, msg
    assert run.last_record_lsn <= before, "ingest went on past the invalid record"
    assert not any(rel[3] > 3 for rel in run.rel_sizes), run.rel_sizes


@pytest.mark.parametrize("fork", [4, 7, 15])
@pytest.mark.parametrize("rnode", [A, B], ids=["A", "B"])
def test_fork_numbers_above_init_are_refused_on_both_paths(fork: int, rnode: RelFileNode) -> None:
    wal, before = _wal(BlockSpec(rnode, 0, forknum=fork, data=fz._tuple(20)))
    for pieces in ([len(wal)], [8192 + 13]):
        batch, fused = fz.both(wal, pieces)
        for run in (batch, fused):
            _assert_refused(run, fork, before)
            bad_key = _keys_of(rnode, fork, 0)
            assert not [p for p in run.puts if p[0] == bad_key], "a page of the fork was stored"
        # the same values stored and the same end (statistics of a batch cut short by an
        # error are not compared: the receiver stops on it)
        assert fused.puts == batch.puts and fused.end == batch.end
        assert fused.last_record_lsn == batch.last_record_lsn and fused.rel_sizes == batch.rel_sizes


def test_bad_second_block_leaves_nothing_of_the_first() -> None:
    # the first block is valid (A's main fork block 1): nothing of the record may be stored
    wal, before = _wal(
        BlockSpec(A, 0, forknum=9, data=fz._tuple(20)), first=BlockSpec(A, 1, data=fz._tuple(20))
    )
    batch, fused = fz.both(wal, [len(wal)])
    for run in (batch, fused):
        _assert_refused(run, 9, before)
        assert not [p for p in run.puts if p[1] > before], "a value of the refused record was stored"
