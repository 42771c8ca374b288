"""An adversarial review of the WAL pre-check ("claims") as the receiver drives it.

Each test here is a defect found in review (it failed before its fix) or a property the
review checked with a real child process:

- a pre-check child that stops answering must not hang the session forever: the receiver
  gives up on it after ``idle_timeout_s``, ends the session as a pre-check failure and goes
  on (a new session, a new child), and nothing is taken twice or lost;
- an XLogData header a safekeeper lies in (a ``wal_start`` that does not continue the stream,
  near the top of the LSN space, or a piece larger than the pre-check takes) is hostile
  input: it must fail that session like any other WAL that does not decode, never escape the
  receiver as a ``ValueError`` from ``WalPrecheck.submit``;
- a session's child is reaped and its pipes and ring closed, however the session ends.
"""

from __future__ import annotations

import os
import random
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from pageserver.wal_precheck import PrecheckPool, WalPrecheck, WalPrecheckError
from pageserver.wal_receiver import (
    PRECHECK_FAILURES_TO_DISABLE,
    ClaimedRuns,
    Precheck,
    WalReceiver,
    WalReceiverConfig,
)
from pageserver.wal_runs import MAX_PIECE, RunFinder
from protocol.lsn import Lsn
from protocol.replication import XLogData, encode_copy_message
from protocol.wal.encoder import BlockSpec
from protocol.wal.page import XLP_FIRST_IS_CONTRECORD
from protocol.wal.reader import EndOfWal, NeedData, WalStreamDecoder
from protocol.wal.record import DecodedRecord
from protocol.wal.rmgr import RmgrId
from tests.pageserver import test_walingest_fused as fz
from tests.pageserver.test_wal_receiver import (
    START,
    FakeConn,
    FakePrecheck,
    FakeSafekeeper,
    TaggedClaims,
    connector,
    expected_records,
    make_wal,
)


class Applied:
    """An ``on_wal`` that decodes everything and records (start, end) of each record; it
    checks that a message's claims, when it has them, are about the message just fed."""

    def __init__(self) -> None:
        self.records: list[tuple[Lsn, Lsn]] = []
        self.with_claims = 0

    async def __call__(
        self, dec: WalStreamDecoder, runs: ClaimedRuns | None
    ) -> tuple[int, Lsn, NeedData | EndOfWal]:
        if isinstance(runs, TaggedClaims):
            assert runs.end == dec.fed_lsn
        if runs is not None:
            self.with_claims += 1
        recs: list[DecodedRecord] = []
        stop = dec.decode_into(recs)
        self.records.extend((r.lsn, r.end_lsn) for r in recs)
        await trio.lowlevel.checkpoint()
        return len(recs), recs[-1].end_lsn if recs else Lsn(0), stop


class HangingPrecheck(FakePrecheck):
    """A pre-check whose child never answers (stopped, or stuck): ``result`` never returns."""

    async def result(self) -> TaggedClaims:
        await trio.sleep_forever()
        raise AssertionError("unreachable")


async def _until(pred: object, timeout: float) -> None:
    assert callable(pred)
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.01)


async def _receive_all(
    wal: bytes, sks: dict[int, FakeSafekeeper], factory: Callable[[], Precheck | None]
) -> WalReceiver:
    """Run a receiver (every message pre-checked, 10 s to answer) until it took all of
    ``wal``, exactly once and in order; returns it, stopped."""
    applied = Applied()
    cfg = WalReceiverConfig(safekeepers=(("h", 1),), precheck_min_bytes=1, idle_timeout_s=10.0)
    recv = WalReceiver(cfg, start_lsn=START, on_wal=applied, connect=connector(sks), precheck=factory)
    want = expected_records(wal, START)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(recv.run)
        with trio.fail_after(600):  # (virtual time)
            while applied.records != want:
                await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert applied.records == want  # nothing lost or taken twice
    return recv


async def test_a_child_that_never_answers_ends_the_session(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Before the fix the ingest waited for the first session's claims forever (no timeout
    around ``claims()``): the receiver stopped for good at the first checked message."""
    wal, _ = make_wal(60, 7)
    rng = random.Random(7)
    sks = {1: FakeSafekeeper(wal, rng)}
    log: list[str] = []
    made: list[FakePrecheck] = []

    def factory() -> Precheck:
        p = HangingPrecheck(log) if not made else FakePrecheck(log)
        made.append(p)
        return p

    recv = await _receive_all(wal, sks, factory)
    assert len(made) >= 2 and recv.sessions >= 2
    assert recv.last_error is not None and "pre-check" in recv.last_error
    assert log.count("new") == log.count("close")  # every session closed its pre-check


async def test_a_precheck_that_keeps_failing_is_turned_off(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Every child hangs: after PRECHECK_FAILURES_TO_DISABLE sessions in a row ended by it,
    the receiver stops making pre-checks (saying why) and the ingest goes on without claims;
    the safekeeper is not put in backoff for it."""
    wal, _ = make_wal(60, 11)
    sks = {1: FakeSafekeeper(wal, random.Random(11))}
    log: list[str] = []
    made: list[FakePrecheck] = []

    def factory() -> Precheck:
        made.append(HangingPrecheck(log))
        return made[-1]

    def metric(name: str) -> float:
        return REGISTRY.get_sample_value(name) or 0.0

    failures0 = metric("pageserver_wal_precheck_failures_total")
    disabled0 = metric("pageserver_wal_precheck_disabled_total")
    recv = await _receive_all(wal, sks, factory)
    assert metric("pageserver_wal_precheck_failures_total") - failures0 == PRECHECK_FAILURES_TO_DISABLE
    assert metric("pageserver_wal_precheck_disabled_total") - disabled0 == 1
    assert len(made) == PRECHECK_FAILURES_TO_DISABLE  # none after it was turned off
    assert recv.precheck_disabled is not None and "failures in a row" in recv.precheck_disabled
    assert recv.sessions > PRECHECK_FAILURES_TO_DISABLE
    assert not recv._backoff  # (the pre-check's failures are not the safekeeper's)


class GatedConn(FakeConn):
    """Serves the WAL in 40,000-byte XLogData messages (all big enough to be checked). After
    the first message of a session it waits until that session's pre-check child is ready (or
    broken), so that the later messages really go through the child. ``hostile`` replaces the
    fourth message with one whose header lies."""

    def __init__(self, sk: FakeSafekeeper, made: list[WalPrecheck], hostile: str | None) -> None:
        super().__init__(sk)
        self.made = made
        self.hostile = hostile
        self.session_sent = 0

    pids: ClassVar[list[int]] = []  # every child a session of these tests started (class-wide)

    async def receive(self) -> bytes | None:
        if self.session_sent and self.made:
            p = self.made[-1]
            with trio.fail_after(20):
                while not p.ready and p.broken is None:
                    await trio.sleep(0.01)
            if p.pid is not None and p.pid not in self.pids:
                self.pids.append(p.pid)
        end = Lsn(START + len(self.sk.wal))
        if self.pos >= end:
            await trio.sleep_forever()
        off = self.pos - START
        data = self.sk.wal[off : off + 40_000]
        if self.session_sent >= 3 and self.hostile is not None:
            kind, self.hostile = self.hostile, None
            if kind == "wal_start":
                # the header's LSN does not continue the stream (and is near 2^64)
                return encode_copy_message(XLogData(Lsn(2**64 - 16), end, 0, data))
            # the right LSN, but more bytes than the pre-check takes (the WAL then zeros)
            big = self.sk.wal[off:] + bytes(MAX_PIECE + 8 - len(self.sk.wal[off:]))
            return encode_copy_message(XLogData(self.pos, end, 0, big))
        msg = XLogData(self.pos, end, 0, data)
        self.pos = Lsn(self.pos + len(data))
        self.session_sent += 1
        await trio.sleep(0.001)
        return encode_copy_message(msg)


def _gated_connector(sks: dict[int, FakeSafekeeper], made: list[WalPrecheck], hostile: dict[int, str]):  # type: ignore[no-untyped-def]
    async def connect(host: str, port: int, params: dict[str, str]) -> GatedConn:
        await trio.lowlevel.checkpoint()
        return GatedConn(sks[port], made, hostile.pop(port, None))

    return connect


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _live(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.split(") ")[1][0] != "Z"


def _big_wal() -> bytes:
    # ~400 KB of records of a few sizes: ~10 messages of 40,000 bytes
    wal, _ = make_wal(120, 11)
    return wal


@pytest.mark.parametrize("hostile", ["wal_start", "oversize"])
async def test_a_lying_xlogdata_header_fails_the_session_not_the_receiver(hostile: str) -> None:
    """Before the fix the read-ahead task handed the message to ``WalPrecheck.submit`` before
    the ingest compared its ``wal_start`` with the stream (and whatever its size): ``submit``
    raised ``ValueError``, which no handler of the receiver expects, and ``run`` died."""
    wal = _big_wal()
    sks = {p: FakeSafekeeper(wal, random.Random(p)) for p in (1, 2)}
    made: list[WalPrecheck] = []

    def factory() -> Precheck:
        p = WalPrecheck()
        made.append(p)
        return p

    applied = Applied()
    cfg = WalReceiverConfig(safekeepers=(("h", 1), ("h", 2)), precheck_min_bytes=1)
    recv = WalReceiver(
        cfg, start_lsn=START, on_wal=applied,
        connect=_gated_connector(sks, made, {1: hostile, 2: hostile}), precheck=factory,
    )
    want = expected_records(wal, START)
    fds = _fds()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(recv.run)
        await _until(lambda: applied.records == want and len(made) >= 2, 30)
        nursery.cancel_scope.cancel()
    assert applied.records == want
    assert applied.with_claims > 0  # the child answered some of them
    assert recv.sessions >= 2 and recv.last_error is not None
    assert all(p.broken is not None for p in made)  # every session closed its child
    assert GatedConn.pids and not any(map(_live, GatedConn.pids))
    assert _fds() <= fds  # pipes and the ring's memfd closed


async def test_a_stalled_real_child_is_given_up_and_reaped() -> None:
    """The real child stalled (``--stall-s 60``): the session ends after ``idle_timeout_s``,
    the child is killed and reaped, and the next session (with a child that answers)
    finishes the WAL."""
    wal = _big_wal()
    sks = {1: FakeSafekeeper(wal, random.Random(1))}
    made: list[WalPrecheck] = []

    def factory() -> Precheck:
        p = WalPrecheck(worker_args=("--stall-s", "60") if not made else ())
        made.append(p)
        return p

    applied = Applied()
    cfg = WalReceiverConfig(safekeepers=(("h", 1),), precheck_min_bytes=1, idle_timeout_s=1.0)
    recv = WalReceiver(
        cfg, start_lsn=START, on_wal=applied, connect=_gated_connector(sks, made, {}), precheck=factory,
    )
    want = expected_records(wal, START)
    fds = _fds()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(recv.run)
        await _until(lambda: applied.records == want, 30)
        nursery.cancel_scope.cancel()
    assert applied.records == want
    assert len(made) >= 2 and applied.with_claims > 0
    assert recv.last_error is not None and "pre-check" in recv.last_error
    assert GatedConn.pids and not any(map(_live, GatedConn.pids))
    assert _fds() <= fds


def _precheck_children() -> list[int]:
    """Our own pre-check children (``python -m pageserver.wal_runs``) still running, and our
    unreaped children (zombies: their command line is gone)."""
    me = str(os.getpid())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rsplit(") ", 1)[1].split()[:2]
        if ppid == me and (state == "Z" or b"pageserver.wal_runs" in cmdline):
            found.append(int(entry))
    return found


def _fail(*args: object, **kwargs: object) -> object:
    raise OSError(24, "Too many open files (injected)")


@pytest.mark.parametrize("where", ["memfd", "mmap", "spawn"])
async def test_a_child_that_cannot_be_started_is_a_precheck_error(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the fix an ``OSError`` while starting the child (no fds, no memory, no
    processes) came out of ``start`` as is: the receiver took it for the safekeeper's
    connection failing (``CONNECTION_ERRORS``) and put that safekeeper in backoff; and when
    the ring's ``mmap`` failed, the child had been spawned already and was left running,
    never reaped."""
    import mmap

    before = set(_precheck_children())
    fds = _fds()
    if where == "memfd":
        monkeypatch.setattr(os, "memfd_create", _fail)
    elif where == "mmap":
        monkeypatch.setattr(mmap, "mmap", _fail)
    else:
        monkeypatch.setattr(trio.lowlevel, "open_process", _fail)
    handle = WalPrecheck()
    with pytest.raises(WalPrecheckError, match="could not be started"):
        await handle.start()
    monkeypatch.undo()
    assert handle.broken is not None and handle.pid is None
    await handle.aclose()
    assert set(_precheck_children()) <= before  # no child left behind
    assert _fds() <= fds  # the memfd and the pipes closed


# -- the ingest with the real finder's claims on WAL whose page headers lie -----------------


def _boundary_wal() -> tuple[bytes, list[int]]:
    """A bulk load into one block (a longer tuple every 31st record, so that some pages start
    on a record boundary) and the offsets of those pages' headers: there the decoder does not
    read ``xlp_rem_len`` (nothing continues), the finder does."""
    specs = []
    for i in range(1500):
        size = 300 if i % 31 == 30 else 100
        specs.append({"rmid": RmgrId.HEAP, "info": 0x80 if i == 0 else 0x00, "xid": 900,
                      "blocks": [BlockSpec(fz.A, 3, data=fz._tuple(size), will_init=i == 0)],
                      "main_data": struct.pack("<HB", 1, 0)})
    wal, _ = fz.encode(specs)
    first = ((fz.WAL_START + 8191) & ~8191) - fz.WAL_START
    free = [at for at in range(first, len(wal) - 24, 8192) if not struct.unpack_from("<H", wal, at + 2)[0] & 1]
    return wal, free


_WAL, _FREE = _boundary_wal()


def _lie(at: int, rem_len: int) -> bytes:
    buf = bytearray(_WAL)
    info = struct.unpack_from("<H", buf, at + 2)[0]
    struct.pack_into("<H", buf, at + 2, info | XLP_FIRST_IS_CONTRECORD)
    struct.pack_into("<I", buf, at + 16, rem_len)
    return bytes(buf)


def _plain_and_claimed(wal: bytes, pieces: list[int]) -> tuple[fz.Run, fz.Run]:
    with tempfile.TemporaryDirectory() as d:
        plain = trio.run(fz.ingest, wal, pieces, True, None, Path(d) / "plain")
        claimed = trio.run(fz.ingest, wal, pieces, True, None, Path(d) / "claimed", RunFinder().feed)
    return plain, claimed


def test_a_lying_page_header_moves_the_finders_walk_not_the_ingest() -> None:
    """The setting of the property test below: on a page that starts on a record boundary, a
    ``XLP_FIRST_IS_CONTRECORD`` with an ``xlp_rem_len`` that lies moves the finder's walk (its
    claims about the page change); the decoder refuses the page, so the ingest ends at its
    header, with the claims as without them."""
    assert _FREE
    at = _FREE[0]
    stride = struct.unpack_from("<I", _WAL, at + 24)[0] + 7 & ~7
    wal = _lie(at, stride // 2 + 8)
    honest = RunFinder().feed(fz.WAL_START, _WAL).triples()
    lied = RunFinder().feed(fz.WAL_START, wal).triples()
    assert honest != lied
    pieces = fz.chunking(len(wal), [131072])
    plain, claimed = _plain_and_claimed(wal, pieces)
    assert plain.last_record_lsn == fz.WAL_START + at and isinstance(plain.end, EndOfWal)
    fz.assert_same(plain, claimed)


@settings(max_examples=15, deadline=None)
@given(
    page=st.integers(0, 10),
    rem_len=st.one_of(st.integers(0, 8192), st.integers(0, 40).map(lambda i: i * 8)),
    flip=st.none() | st.tuples(st.integers(0, 2**31), st.integers(1, 255)),
    sizes=st.lists(st.sampled_from([977, 8192, 20000, 40000, 131072]), min_size=1, max_size=3),
)
def test_lying_page_headers_never_change_what_the_ingest_stores(
    page: int, rem_len: int, flip: tuple[int, int] | None, sizes: list[int]
) -> None:
    """Whatever a lying page header makes the finder claim, the fused path stores with the
    claims exactly what it stores without them (sound in review: held before any fix)."""
    buf = bytearray(_lie(_FREE[page % len(_FREE)], rem_len))
    if flip is not None:
        buf[flip[0] % len(buf)] ^= flip[1]
    plain, claimed = _plain_and_claimed(bytes(buf), fz.chunking(len(buf), sizes))
    fz.assert_same(plain, claimed)


async def test_small_live_messages_never_start_a_child() -> None:
    """A live compute's messages (a few records, far below ``precheck_min_bytes``) go through
    the read-ahead task but never start the child (sound in review)."""
    wal, _ = make_wal(60, 5)
    sks = {1: FakeSafekeeper(wal, random.Random(5))}
    made: list[WalPrecheck] = []

    class Small(FakeConn):
        async def receive(self) -> bytes | None:
            await trio.sleep(0.001)
            end = Lsn(START + len(self.sk.wal))
            if self.pos >= end:
                await trio.sleep_forever()
            off = self.pos - START
            data = self.sk.wal[off : off + 30_000]
            msg = XLogData(self.pos, end, 0, data)
            self.pos = Lsn(self.pos + len(data))
            return encode_copy_message(msg)

    async def connect(host: str, port: int, params: dict[str, str]) -> Small:
        await trio.lowlevel.checkpoint()
        return Small(sks[port])

    def factory() -> Precheck:
        made.append(WalPrecheck())
        return made[-1]

    applied = Applied()
    cfg = WalReceiverConfig(safekeepers=(("h", 1),), precheck_min_bytes=32 * 1024)
    recv = WalReceiver(cfg, start_lsn=START, on_wal=applied, connect=connect, precheck=factory)
    want = expected_records(wal, START)
    before = set(_precheck_children())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(recv.run)
        await _until(lambda: applied.records == want, 20)
        assert len(made) == 1 and made[0].pid is None and not made[0].ready
        assert set(_precheck_children()) <= before
        nursery.cancel_scope.cancel()
    assert applied.with_claims == 0


class FailingStart(FakePrecheck):
    async def start(self) -> None:
        await trio.lowlevel.checkpoint()
        raise WalPrecheckError("the child did not start (injected)")


async def test_sessions_that_never_used_the_precheck_do_not_reset_its_failures(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Found in review: every other session's stream ends before its first big message, every
    pre-check fails to start; a session that never used the pre-check reset the count, so it
    was never turned off."""
    wal, _ = make_wal(120, 11)
    sk = FakeSafekeeper(wal, random.Random(1))
    made: list[Precheck] = []
    log: list[str] = []
    conns = 0

    class Flaky(FakeConn):
        def __init__(self, sk: FakeSafekeeper, dead: bool) -> None:
            super().__init__(sk)
            self.dead = dead

        async def receive(self) -> bytes | None:
            if self.dead:
                await trio.sleep(0.001)
                raise EOFError("stream ended (injected)")
            return await super().receive()

    async def connect(host: str, port: int, params: dict[str, str]) -> Flaky:
        nonlocal conns
        await trio.lowlevel.checkpoint()
        conns += 1
        return Flaky(sk, dead=conns % 2 == 0)

    def factory() -> Precheck:
        made.append(FailingStart(log))
        return made[-1]

    cfg = WalReceiverConfig(safekeepers=(("h", 1),), precheck_min_bytes=1, idle_timeout_s=10.0)
    recv = WalReceiver(cfg, start_lsn=START, on_wal=Applied(), connect=connect, precheck=factory)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(recv.run)
        with trio.move_on_after(300):
            while recv.sessions < 40:
                await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    # every session that used the pre-check failed with it; it is never turned off
    assert recv.precheck_disabled is not None, (
        f"{recv.sessions} sessions, {len(made)} pre-checks made, all failing; never turned off"
    )


async def test_the_pool_limits_children_and_frees_a_slot_at_close() -> None:
    pool = PrecheckPool(1)
    first = pool()
    assert first is not None and pool() is None  # (the second session goes without)
    await first.aclose()
    await first.aclose()  # (a slot is freed once)
    assert pool.in_use == 0
    again = pool()
    assert again is not None and pool.in_use == 1
    await again.aclose()
    with pytest.raises(ValueError, match="room for one child"):
        PrecheckPool(0)


async def test_a_session_without_a_precheck_slot_ingests_unchecked(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The factory says no (the pageserver's children are all at work): the session runs, every
    message unchecked, and ends up with all the WAL."""
    wal, _ = make_wal(60, 5)
    sks = {1: FakeSafekeeper(wal, random.Random(5))}
    asked = 0

    def factory() -> Precheck | None:
        nonlocal asked
        asked += 1
        return None

    recv = await _receive_all(wal, sks, factory)
    assert asked == recv.sessions >= 1
    assert recv.precheck_failures == 0 and recv.precheck_disabled is None
