"""Which safekeeper the WAL receiver streams from, and when it leaves one.

A safekeeper streams committed WAL only, and the safekeepers' commit positions differ: the
commit position rides on the proposer's next AppendRequest, so after a compute died, or after
sync-safekeepers (which stops once a quorum has the new commit position), one safekeeper can
keep a lower ``commit_lsn`` for good. Asked for WAL past it, it does not refuse (a restarted
safekeeper's ``commit_lsn`` is behind what receivers already have), it waits with keepalives.
A receiver sitting there never gets the WAL the others hold, and ``endpoint start``, which
waits for the pageserver before it starts the compute that would move that commit position,
waited forever (test_control_plane_crash, 1 run in 3). These tests pin the receiver's choice:
the most advanced safekeeper first, and a move when the current one stays behind.

The fakes (from test_wal_receiver) run under a virtual clock; the last tests use real
in-process safekeepers.
"""

from __future__ import annotations

import itertools
import random
from contextlib import AsyncExitStack
from pathlib import Path

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from pageserver.wal_receiver import WalReceiver, WalReceiverConfig
from protocol.ids import TenantId, TimelineId
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn
from protocol.wal.reader import WalStreamDecoder
from protocol.wal.record import DecodedRecord
from safekeeper.node import SafekeeperNode
from safekeeper.testing import TestProposer, running_node, synthetic_wal
from tests.pageserver.test_wal_receiver import (
    START,
    FakeSafekeeper,
    connector,
    expected_records,
    make_wal,
)

LAG_S = 3.0  # WalReceiverConfig.lagging_wal_timeout_s, the default


def _config(ports: tuple[int, ...]) -> WalReceiverConfig:
    return WalReceiverConfig(safekeepers=tuple(("h", p) for p in ports))


class _Collector:
    def __init__(self) -> None:
        self.got: list[tuple[Lsn, Lsn]] = []

    async def __call__(self, recs: list[DecodedRecord]) -> None:
        for rec in recs:
            # Nothing applied twice: a session restarts at the end of the last record.
            assert not self.got or rec.lsn >= self.got[-1][1], (rec.lsn, self.got[-1])
            self.got.append((rec.lsn, rec.end_lsn))
        await trio.lowlevel.checkpoint()


async def test_starts_on_the_most_advanced_safekeeper(autojump_clock: trio.testing.MockClock) -> None:
    """The first safekeeper in the list holds its commit position below the others' (as the
    one sync-safekeepers did not reach): the receiver asks all three and streams from an
    advanced one, never from the stuck one."""
    wal, spans = make_wal(60, 11)
    stuck_at = spans[20][1]
    sks = {p: FakeSafekeeper(wal, random.Random(p), keepalive_s=1.0) for p in (1, 2, 3)}
    sks[1].commit = stuck_at
    got = _Collector()
    recv = WalReceiver(_config((1, 2, 3)), start_lsn=START, on_records=got, connect=connector(sks))
    want = expected_records(wal, START)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(recv.run)
        with trio.fail_after(LAG_S / 2):  # no waiting for a lag check: the first choice is right
            await recv.wait_for_lsn(want[-1][1])
        nursery.cancel_scope.cancel()
    assert got.got == want
    assert sks[1].starts == [] and sks[1].identified >= 1
    assert recv.sessions == 1 and recv.lagging_switches == 0


async def test_leaves_a_safekeeper_whose_commit_position_stays_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """All three are equal when the receiver connects; then the commit position moves on two
    of them only (the proposer went away before telling the third). The receiver, fed
    keepalives and no WAL, moves to an advanced one within about lagging_wal_timeout_s and
    resumes at the end of the last record: every record once, in order."""
    wal, spans = make_wal(60, 12)
    middle = Lsn(spans[30][1] - 5)  # not a record end: the first session stops mid-record
    sks = {p: FakeSafekeeper(wal, random.Random(p), keepalive_s=1.0) for p in (1, 2, 3)}
    for sk in sks.values():
        sk.commit = middle
    got = _Collector()
    recv = WalReceiver(_config((1, 2, 3)), start_lsn=START, on_records=got, connect=connector(sks))
    want = expected_records(wal, START)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(recv.run)
        with trio.fail_after(60):
            await recv.wait_for_lsn(spans[29][1])
        first = recv.current
        assert first is not None
        for port, sk in sks.items():
            if port != first[1]:
                sk.commit = None
        moved_at = trio.current_time()
        with trio.fail_after(60):
            await recv.wait_for_lsn(want[-1][1])
        took = trio.current_time() - moved_at
        nursery.cancel_scope.cancel()
    assert got.got == want
    assert recv.lagging_switches == 1 and recv.sessions == 2
    assert took <= LAG_S + 1.5, took
    # The second session started exactly where the last record the first one completed ended.
    completed = expected_records(wal[: middle - START], START)[-1][1]
    second = [sk for port, sk in sks.items() if port != first[1] and sk.starts]
    assert len(second) == 1 and second[0].starts == [completed]


async def test_stays_while_no_other_safekeeper_is_ahead(autojump_clock: trio.testing.MockClock) -> None:
    """Idle (all WAL received, keepalives only) and nobody ahead: it keeps looking every
    lagging_wal_timeout_s but stays on its connection; the standby status replies go on."""
    wal, spans = make_wal(10, 13)
    sks = {p: FakeSafekeeper(wal, random.Random(p), keepalive_s=1.0) for p in (1, 2, 3)}
    recv = WalReceiver(_config((1, 2, 3)), start_lsn=START, on_records=_Collector(),
                       connect=connector(sks))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(recv.run)
        with trio.fail_after(60):
            await recv.wait_for_lsn(spans[-1][1])
        await trio.sleep(10 * LAG_S)
        assert recv.current is not None
        nursery.cancel_scope.cancel()
    assert recv.sessions == 1 and recv.lagging_switches == 0
    probes = sum(sk.identified for sk in sks.values())
    assert 3 + 2 * 8 <= probes <= 3 + 2 * 11  # the first choice, then the others every LAG_S
    current = next(sk for sk in sks.values() if sk.starts)
    assert current.statuses and current.statuses[-1].write_lsn == spans[-1][1]


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 2**32),
    st.lists(st.integers(0, 59), min_size=3, max_size=3),
    st.sampled_from([None, 30000, 70000]),
    st.booleans(),
)
def test_every_record_once_whatever_the_commit_positions(
    seed: int, stuck: list[int], cut: int | None, refuse_one: bool
) -> None:
    """Commit positions held at random records (one safekeeper maybe down, streams maybe cut),
    then released one safekeeper at a time, except one that stays behind for good: the
    receiver ends with every record once, in order, each session starting at the end of a
    record it handed over."""
    wal, spans = make_wal(60, seed)

    async def main() -> None:
        rng = random.Random(seed)
        sks = {p: FakeSafekeeper(wal, rng, cut=cut, keepalive_s=1.0) for p in (1, 2, 3)}
        for sk, at in zip(sks.values(), stuck, strict=True):
            sk.commit = Lsn(spans[at][1] - rng.choice([0, 0, 3]))
        if refuse_one:
            sks[rng.choice([1, 2, 3])].refuse = True
        got = _Collector()
        recv = WalReceiver(_config((1, 2, 3)), start_lsn=START, on_records=got,
                           connect=connector(sks))
        want = expected_records(wal, START)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(recv.run)
            reachable = [sk for sk in sks.values() if not sk.refuse]
            reachable.remove(rng.choice(reachable))  # left behind
            for sk in sorted(reachable, key=lambda s: s.commit or 0):
                await trio.sleep(rng.uniform(0, 2 * LAG_S))
                sk.commit = None  # this one's commit position reaches the end
            with trio.fail_after(60):
                await recv.wait_for_lsn(want[-1][1])
            nursery.cancel_scope.cancel()
        assert got.got == want
        starts = {s for sk in sks.values() for s in sk.starts}
        assert starts <= {START} | {end for _, end in want}

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# -- real in-process safekeepers ---------------------------------------------------------------

TENANT = TenantId(bytes(range(16)))
TIMELINE = TimelineId(bytes(range(16, 32)))
WAL_START = Lsn(WAL_SEGMENT_SIZE)


async def _push(sk: SafekeeperNode, wal: bytes, cuts: list[int], commit: Lsn) -> Lsn:
    """Elect a term on ``sk`` and append ``wal`` in the chunks ``cuts`` delimits, telling it
    the commit position ``commit`` (each AppendRequest carries at most the previous chunks'
    end, and a last, empty one the end itself when all of it is committed)."""
    assert sk.pg_port is not None
    async with await TestProposer.connect("127.0.0.1", sk.pg_port, TENANT, TIMELINE) as p:
        await p.greet()
        await p.elect(WAL_START)
        pos = WAL_START
        for a, b in itertools.pairwise(cuts):
            await p.append(pos, wal[a:b], Lsn(min(pos, commit)))
            pos = Lsn(pos + b - a)
        if commit >= pos:
            await p.append(pos, b"", pos)
        await p.wait_flush(pos)
    return pos


async def _wait_commit(sk: SafekeeperNode, lsn: Lsn) -> None:
    tl = sk.timelines[(TENANT, TIMELINE)]
    while tl.acceptor.commit_lsn < lsn:
        await trio.sleep(0.01)


def _first_record(wal: bytes) -> Lsn:
    dec = WalStreamDecoder(WAL_START)
    dec.feed(wal)
    return next(iter(dec.records())).lsn


async def test_real_safekeepers_one_left_behind_by_the_proposer(tmp_path: Path) -> None:
    """Three real safekeepers hold the same WAL; the proposer told two of them that all of it
    is committed and went away before telling the first one (its commit position stops at
    the second chunk). That one answers START_REPLICATION past its commit position with
    keepalives; the receiver must still get all the WAL, from the others, each record once."""
    wal = synthetic_wal(WAL_START, 256 * 1024, record_size=700)
    cuts = [0, 40_000, 90_000, 150_000, len(wal)]
    start = _first_record(wal)
    async with AsyncExitStack() as stack:
        nodes = [
            await stack.enter_async_context(running_node(tmp_path / f"sk{i}", wal_removal_period_s=0))
            for i in range(3)
        ]
        with trio.fail_after(30):
            end = Lsn(WAL_START + len(wal))
            assert await _push(nodes[0], wal, cuts, Lsn(WAL_START + cuts[2])) == end
            for node in nodes[1:]:
                assert await _push(node, wal, cuts, end) == end
                await _wait_commit(node, end)
        stuck = nodes[0].timelines[(TENANT, TIMELINE)].acceptor.commit_lsn
        assert WAL_START < stuck < end

        want = expected_records_from(wal, start)
        got = _Collector()
        cfg = WalReceiverConfig(
            safekeepers=tuple(("127.0.0.1", n.pg_port or 0) for n in nodes),
            tenant_id=TENANT,
            timeline_id=TIMELINE,
        )
        recv = WalReceiver(cfg, start_lsn=start, on_records=got)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(recv.run)
            with trio.fail_after(20):
                await recv.wait_for_lsn(want[-1][1])
            nursery.cancel_scope.cancel()
        assert got.got == want
        assert recv.current is None and recv.last_error is None


async def test_real_safekeepers_switch_when_the_current_one_stays_behind(tmp_path: Path) -> None:
    """The receiver streams from the first safekeeper while all three have the same commit
    position; then the other two learn a later one (sync-safekeepers reaching a quorum) and
    the first never does. The receiver moves within lagging_wal_timeout_s (1 s here)."""
    wal = synthetic_wal(WAL_START, 200 * 1024, record_size=500)
    cuts = [0, 60_000, 120_000, len(wal)]
    chunks = [wal[a:b] for a, b in itertools.pairwise(cuts)]
    start = _first_record(wal)
    async with AsyncExitStack() as stack:
        nodes = [
            await stack.enter_async_context(running_node(tmp_path / f"sk{i}", wal_removal_period_s=0))
            for i in range(3)
        ]
        proposers = []
        with trio.fail_after(30):
            for node in nodes:
                assert node.pg_port is not None
                p = await stack.enter_async_context(
                    await TestProposer.connect("127.0.0.1", node.pg_port, TENANT, TIMELINE)
                )
                await p.greet()
                await p.elect(WAL_START)
                end = await p.append_many(WAL_START, chunks)  # commits all but the last chunk
                await p.wait_flush(end)
                proposers.append(p)
            middle = Lsn(WAL_START + cuts[-2])
            for node in nodes:
                await _wait_commit(node, middle)

        want = expected_records_from(wal, start)
        got = _Collector()
        cfg = WalReceiverConfig(
            safekeepers=tuple(("127.0.0.1", n.pg_port or 0) for n in nodes),
            tenant_id=TENANT,
            timeline_id=TIMELINE,
            lagging_wal_timeout_s=1.0,
        )
        recv = WalReceiver(cfg, start_lsn=start, on_records=got)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(recv.run)
            with trio.fail_after(20):
                while recv.current is None or recv.last_record_lsn < middle - 500:
                    await trio.sleep(0.01)
            current = recv.current
            assert current is not None
            for node, p in zip(nodes, proposers, strict=True):
                if node.pg_port != current[1]:
                    await p.append(end, b"", end)  # the commit position reaches two of three
            with trio.fail_after(20):
                await recv.wait_for_lsn(want[-1][1])
            nursery.cancel_scope.cancel()
        assert got.got == want
        assert recv.lagging_switches == 1 and recv.sessions == 2


def expected_records_from(wal: bytes, start: Lsn) -> list[tuple[Lsn, Lsn]]:
    dec = WalStreamDecoder(start)
    dec.feed(wal[start - WAL_START :])
    return [(r.lsn, r.end_lsn) for r in dec.records()]
