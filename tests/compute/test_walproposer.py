"""The proposer state machine: quorum math, term choice, election, streaming points, commit.

The last test drives ``Proposer`` against a small model of the acceptor (protocols.md §3.5)
through random elections, appends, acknowledgements and disconnections, and checks the safety
property the protocol exists for: WAL that a proposer counted as committed keeps the same
content (the same writing term at every LSN) in every later term.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compute.walproposer.proposer import (
    Phase,
    Proposer,
    ProposerRejected,
    TermHistory,
    elect,
    quorum_lsn,
    quorum_size,
    start_streaming_point,
)
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn
from protocol.safekeeper import (
    AcceptorGreeting,
    AppendRequest,
    AppendResponse,
    ProposerElected,
    ProposerGreeting,
    TermSwitchEntry,
    VoteRequest,
    VoteResponse,
)
from safekeeper.acceptor import Acceptor, Reply
from safekeeper.control_file import PersistentState

BOOT = Lsn(0x0100_0028)
TENANT, TIMELINE = TenantId(bytes(range(16))), TimelineId(bytes(range(16, 32)))


def test_quorum_size() -> None:
    assert [quorum_size(n) for n in range(1, 8)] == [1, 2, 2, 3, 3, 4, 4]
    with pytest.raises(ValueError):
        quorum_size(0)


@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=9), st.data())
def test_quorum_lsn_is_highest_position_a_quorum_reached(flushes: list[int], data: st.DataObject) -> None:
    q = data.draw(st.integers(1, len(flushes)))
    got = quorum_lsn(flushes, q)
    assert sum(f >= got for f in flushes) >= q
    # Any higher value is reached by fewer than a quorum.
    assert sum(f > got for f in flushes) < q


def test_quorum_lsn_example() -> None:
    assert quorum_lsn([30, 10, 20], 2) == 20
    assert quorum_lsn([30, 10, 0], 2) == 10
    with pytest.raises(ValueError):
        quorum_lsn([1, 2], 3)


def _vote(term: int, flush: int, history: TermHistory, *, given: bool = True, trunc: int = 0) -> VoteResponse:
    return VoteResponse(term, given, Lsn(flush), Lsn(trunc), history)


def h(*pairs: tuple[int, int]) -> TermHistory:
    return tuple(TermSwitchEntry(t, Lsn(lsn)) for t, lsn in pairs)


@given(st.integers(1, 7), st.data())
def test_term_is_above_every_greeting_of_the_quorum(n: int, data: st.DataObject) -> None:
    terms = data.draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n))
    order = data.draw(st.permutations(range(n)))
    p = Proposer(n, bootstrap_lsn=BOOT)
    sent: list[tuple[int, VoteRequest | ProposerElected]] = []
    greeted: list[int] = []
    for i in order:
        p.connected(i)
        try:
            sent += p.on_greeting(i, AcceptorGreeting(node_id=i, term=terms[i]))
        except ProposerRejected as e:
            # Only a latecomer above the chosen term may reject us.
            assert p.term and e.seen_term >= p.term
            assert len(greeted) >= p.quorum
            break
        greeted.append(i)
        if len(greeted) < p.quorum:
            assert p.term == 0 and sent == []
    q = quorum_size(n)
    first = greeted[:q]
    assert p.term == max(terms[i] for i in first) + 1
    # Every greeted safekeeper got exactly one VoteRequest, for that term.
    assert sorted(i for i, _ in sent) == sorted(greeted)
    assert all(isinstance(m, VoteRequest) and m.term == p.term for _, m in sent)


def test_min_term_is_respected() -> None:
    p = Proposer(1, bootstrap_lsn=BOOT, min_term=41)
    p.connected(0)
    (_, req), = p.on_greeting(0, AcceptorGreeting(0, 3))
    assert isinstance(req, VoteRequest) and req.term == 42


def test_fresh_timeline_starts_at_bootstrap_lsn() -> None:
    p = Proposer(3, bootstrap_lsn=BOOT)
    for i in range(3):
        p.connected(i)
        p.on_greeting(i, AcceptorGreeting(i, 0))
    assert p.term == 1
    assert p.on_vote(0, _vote(1, 0, ())) == []
    out = p.on_vote(1, _vote(1, 0, ()))
    assert [i for i, _ in out] == [0, 1]
    for _, m in out:
        assert isinstance(m, ProposerElected)
        assert m.start_streaming_at == BOOT
        assert m.term_history == h((1, BOOT))
    # The third votes after the election and is brought in at once.
    ((i, m),) = p.on_vote(2, _vote(1, 0, ()))
    assert i == 2 and isinstance(m, ProposerElected) and m.start_streaming_at == BOOT
    assert p.slots[2].phase is Phase.ACTIVE


def test_donor_is_highest_last_log_term_then_flush() -> None:
    # sk0 has more WAL but in an older term; sk1's last term is newer, so it is the donor.
    votes = {
        0: _vote(9, 0x5000, h((1, 0x100), (3, 0x1000))),
        1: _vote(9, 0x3000, h((1, 0x100), (4, 0x2000)), trunc=0x1500),
        2: _vote(9, 0x2800, h((1, 0x100), (4, 0x2000)), trunc=0x1800),
    }
    e = elect(9, votes, BOOT)
    assert e.donor == 1
    assert e.epoch_start_lsn == 0x3000
    assert e.truncate_lsn == 0x1800
    assert e.term_history == h((1, 0x100), (4, 0x2000), (9, 0x3000))
    # sk0 diverged: after term 1 it holds term-3 WAL that we do not have, so it keeps only
    # term 1 (up to 0x1000, where its term 3 began) and is truncated there.
    assert start_streaming_point(e.term_history, votes[0].term_history, Lsn(0x5000)) == 0x1000
    # sk2 is in the donor's term but behind: streamed from its own end.
    assert start_streaming_point(e.term_history, votes[2].term_history, Lsn(0x2800)) == 0x2800
    assert start_streaming_point(e.term_history, (), Lsn(0)) == 0x100


def test_refusals_reject_the_proposer() -> None:
    p = Proposer(3, bootstrap_lsn=BOOT)
    for i in range(2):
        p.connected(i)
        p.on_greeting(i, AcceptorGreeting(i, 5))
    assert p.term == 6
    with pytest.raises(ProposerRejected) as exc:
        p.on_vote(0, _vote(6, 0, (), given=False))
    assert exc.value.seen_term == 6
    p2 = Proposer(3, bootstrap_lsn=BOOT)
    for i in range(2):
        p2.connected(i)
        p2.on_greeting(i, AcceptorGreeting(i, 5))
    with pytest.raises(ProposerRejected):
        p2.on_vote(0, _vote(7, 0, (), given=False))
    # A third safekeeper greeting above our term after the quorum: a rival proposer exists.
    p2.connected(2)
    with pytest.raises(ProposerRejected):
        p2.on_greeting(2, AcceptorGreeting(2, 8))


def test_messages_out_of_phase() -> None:
    """A message for a safekeeper that is not connected can only come from our own bug; one
    that does not fit an open connection's conversation is that safekeeper's fault."""
    p = Proposer(3, bootstrap_lsn=BOOT)
    with pytest.raises(LocalProtocolError):
        p.on_greeting(0, AcceptorGreeting(0, 1))
    p.connected(0)
    with pytest.raises(RemoteProtocolError, match="sent VoteResponse in phase handshake"):
        p.on_vote(0, _vote(1, 0, ()))


def _elected_proposer(n: int = 3) -> Proposer:
    p = Proposer(n, bootstrap_lsn=BOOT)
    for i in range(n):
        p.connected(i)
        p.on_greeting(i, AcceptorGreeting(i, 0))
    for i in range(n):
        p.on_vote(i, _vote(1, 0, ()))
    return p


def test_commit_is_quorum_of_acks_in_our_term_and_survives_disconnect() -> None:
    p = _elected_proposer()
    assert p.next_append(0, Lsn(BOOT + 1_000_000)) == (BOOT, BOOT + 131072)
    assert p.next_append(1, BOOT) == (BOOT, BOOT)
    p.sent(0, Lsn(BOOT + 131072))
    p.sent(1, Lsn(BOOT + 400))
    assert p.on_append_response(0, AppendResponse(1, Lsn(BOOT + 300), Lsn(0))) is False
    assert p.commit_lsn == 0
    assert p.on_append_response(1, AppendResponse(1, Lsn(BOOT + 200), Lsn(0))) is True
    assert p.commit_lsn == BOOT + 200
    assert p.truncate_lsn == BOOT  # sk2 has not acknowledged anything
    p.disconnected(0)
    # sk0's fsynced acknowledgement still counts.
    assert p.on_append_response(1, AppendResponse(1, Lsn(BOOT + 400), Lsn(0))) is True
    assert p.commit_lsn == BOOT + 300
    # Acks never move commit back.
    assert p.on_append_response(1, AppendResponse(1, Lsn(BOOT + 100), Lsn(0))) is False
    assert p.commit_lsn == BOOT + 300
    with pytest.raises(ProposerRejected):
        p.on_append_response(2, AppendResponse(2, Lsn(0), Lsn(0)))


def test_acknowledgement_the_peer_cannot_have_made_is_its_protocol_error() -> None:
    """A flush beyond the WAL sent, or in an older term, is RemoteProtocolError (that one
    connection is dropped) and counts for nothing: commit_lsn must only cover WAL a quorum
    really holds."""
    p = _elected_proposer()
    p.sent(0, Lsn(BOOT + 100))
    p.sent(1, Lsn(BOOT + 100))
    with pytest.raises(RemoteProtocolError, match="beyond the WAL sent"):
        p.on_append_response(0, AppendResponse(1, Lsn(BOOT + 101), Lsn(0)))
    with pytest.raises(RemoteProtocolError, match="old term"):
        p.on_append_response(1, AppendResponse(0, Lsn(BOOT + 100), Lsn(0)))
    assert p.commit_lsn == 0
    assert p.on_append_response(0, AppendResponse(1, Lsn(BOOT + 100), Lsn(0))) is False
    assert p.on_append_response(1, AppendResponse(1, Lsn(BOOT + 100), Lsn(0))) is True
    assert p.commit_lsn == BOOT + 100


def test_reconnected_voter_of_our_term_rejoins() -> None:
    p = _elected_proposer()
    p.disconnected(2)
    p.connected(2)
    (_, req), = p.on_greeting(2, AcceptorGreeting(2, 1))
    assert isinstance(req, VoteRequest)
    # It already voted for term 1, so it refuses, but we are elected: stream to it.
    ((_, m),) = p.on_vote(2, _vote(1, BOOT + 64, h((1, BOOT)), given=False))
    assert isinstance(m, ProposerElected) and m.start_streaming_at == BOOT + 64


# ------------------------------------------------------------------------------------------------
# Model-based check against a model acceptor


@attrs.define
class ModelAcceptor:
    """Just enough of §3.5: term, history, flush; content is implied by (history, flush)."""

    node_id: int
    term: int = 0
    history: TermHistory = ()
    flush: int = 0

    def vote(self, req: VoteRequest) -> VoteResponse:
        given = req.term > self.term
        if given:
            self.term = req.term
        hist = tuple(e for e in self.history if e.lsn <= self.flush)
        return VoteResponse(self.term, given, Lsn(self.flush), Lsn(0), hist)

    def elected(self, msg: ProposerElected) -> None:
        if msg.term < self.term:
            return
        self.term = msg.term
        self.flush = msg.start_streaming_at
        self.history = msg.term_history

    def append(self, term: int, begin: int, end: int) -> AppendResponse:
        if term < self.term:
            return AppendResponse(self.term, Lsn(0), Lsn(0))
        assert begin == self.flush, "proposer sent a gap or a rewrite"
        self.flush = end
        return AppendResponse(self.term, Lsn(self.flush), Lsn(0))


class SafekeeperAcceptor:
    """The safekeeper room's real acceptor state machine behind the model's interface: the
    proposer's messages must be ones it accepts (start points, contiguous appends)."""

    def __init__(self, node_id: int) -> None:
        self.acc = Acceptor(node_id, PersistentState(TENANT, TIMELINE), Lsn(0))

    @property
    def term(self) -> int:
        return self.acc.term

    @property
    def history(self) -> TermHistory:
        return self.acc.state.term_history

    @property
    def flush(self) -> int:
        return self.acc.flush_lsn

    def _reply(self, effects: Sequence[object]) -> object:
        replies = [e.msg for e in effects if isinstance(e, Reply)]
        return replies[0] if replies else None

    def vote(self, req: VoteRequest) -> VoteResponse:
        greeting = self._reply(
            self.acc.process(ProposerGreeting(TENANT, TIMELINE, 150000, 1, WAL_SEGMENT_SIZE))
        )
        assert isinstance(greeting, AcceptorGreeting)
        resp = self._reply(self.acc.process(req))
        assert isinstance(resp, VoteResponse)
        return resp

    def elected(self, msg: ProposerElected) -> None:
        assert self._reply(self.acc.process(msg)) is None

    def append(self, term: int, begin: int, end: int) -> AppendResponse:
        req = AppendRequest(term, Lsn(begin), Lsn(end), Lsn(0), Lsn(0), bytes(end - begin))
        refusal = self._reply(self.acc.process(req))
        if refusal is not None:
            assert isinstance(refusal, AppendResponse)
            return refusal
        # Model WAL has no records: every byte position counts as a record end.
        self.acc.wal_flushed(Lsn(max(end, self.acc.flush_record_lsn)))
        return self.acc.append_response()


def segments(history: TermHistory, end: int) -> list[tuple[int, int, int]]:
    """(start, end, term) pieces of WAL [first lsn, end) as written per ``history``."""
    out: list[tuple[int, int, int]] = []
    for k, e in enumerate(history):
        seg_end = history[k + 1].lsn if k + 1 < len(history) else end
        seg_end = min(seg_end, end)
        if seg_end > e.lsn:
            out.append((e.lsn, seg_end, e.term))
    return out


@pytest.mark.parametrize(
    "acceptor",
    [
        ModelAcceptor,
        SafekeeperAcceptor,
    ],
)
@settings(max_examples=150)
@given(n=st.sampled_from([1, 2, 3, 5]), data=st.data())
def test_committed_wal_survives_every_later_election(
    acceptor: type[ModelAcceptor | SafekeeperAcceptor], n: int, data: st.DataObject
) -> None:
    acceptors = [acceptor(i) for i in range(n)]
    committed: list[tuple[TermHistory, int]] = []
    min_term = 0
    for _round in range(data.draw(st.integers(1, 5), label="rounds")):
        p = Proposer(n, bootstrap_lsn=BOOT, min_term=min_term)
        # Mostly a quorum or more, in random order; sometimes too few to elect.
        order = data.draw(st.permutations(range(n)), label="order")
        online = order[: data.draw(st.integers(max(1, quorum_size(n) - 1), n), label="online")]
        wal_end = 0
        try:
            _run_election(p, acceptors, online)
            if not p.elected:
                continue
            assert p.election is not None
            # Leader completeness: every committed prefix is in our history.
            for hist, c in committed:
                assert segments(p.election.term_history, c) == segments(hist, c)
            wal_end = p.election.epoch_start_lsn
            for _step in range(data.draw(st.integers(0, 30), label="steps")):
                action = data.draw(st.sampled_from(["wal", "send", "send", "drop"]), label="action")
                active = [i for i in range(n) if p.slots[i].phase is Phase.ACTIVE]
                if action == "wal":
                    wal_end += data.draw(st.integers(1, 300_000 if acceptor is ModelAcceptor else 3_000))
                elif action == "send" and active:
                    i = data.draw(st.sampled_from(active))
                    begin, end = p.next_append(i, Lsn(wal_end))
                    p.sent(i, end)
                    resp = acceptors[i].append(p.term, begin, end)
                    if p.on_append_response(i, resp):
                        committed.append((p.election.term_history, p.commit_lsn))
                elif action == "drop" and active:
                    p.disconnected(data.draw(st.sampled_from(active)))
        except ProposerRejected as e:
            min_term = max(min_term, e.seen_term)
        # The commit point never runs ahead of what the proposer had.
        assert p.commit_lsn <= max(wal_end, BOOT)
    # Every acceptor that took part in the committing term or a later one agrees with the commit
    # up to its own flush (a minority left behind in an older term may hold abandoned WAL).
    for hist, c in committed:
        for a in acceptors:
            if not a.history or a.history[-1].term < hist[-1].term:
                continue
            upto = min(c, a.flush)
            assert segments(a.history, upto) == segments(hist, upto)


def _run_election(
    p: Proposer, acceptors: Sequence[ModelAcceptor | SafekeeperAcceptor], online: Sequence[int]
) -> None:
    for i in online:
        p.connected(i)
        for j, req in p.on_greeting(i, AcceptorGreeting(i, acceptors[i].term)):
            assert isinstance(req, VoteRequest)
            for k, el in p.on_vote(j, acceptors[j].vote(req)):
                assert isinstance(el, ProposerElected)
                acceptors[k].elected(el)


def _push(p: Proposer, acceptors: list[ModelAcceptor], i: int, wal_end: int) -> None:
    while True:
        begin, end = p.next_append(i, Lsn(wal_end))
        p.sent(i, end)
        p.on_append_response(i, acceptors[i].append(p.term, begin, end))
        if end == wal_end:
            return


def test_newer_term_beats_longer_log() -> None:
    """A minority holding more WAL of an older term must not become the donor."""
    acc = [ModelAcceptor(i) for i in range(3)]
    p1 = Proposer(3, bootstrap_lsn=BOOT)
    _run_election(p1, acc, [0, 1, 2])
    _push(p1, acc, 0, BOOT + 5000)  # only sk0 got this: never committed
    p1.disconnected(0)
    p2 = Proposer(3, bootstrap_lsn=BOOT)
    _run_election(p2, acc, [1, 2])
    assert p2.term == 2 and p2.election is not None
    assert p2.election.epoch_start_lsn == BOOT
    _push(p2, acc, 1, BOOT + 2000)
    _push(p2, acc, 2, BOOT + 2000)
    assert p2.commit_lsn == BOOT + 2000
    p3 = Proposer(3, bootstrap_lsn=BOOT)
    _run_election(p3, acc, [0, 1])
    assert p3.election is not None
    assert p3.election.donor == 1
    assert p3.election.term_history == h((1, BOOT), (2, BOOT), (3, BOOT + 2000))
    # sk0 holds term-1 WAL where term 2 wrote: it is truncated back to where term 2 began.
    assert p3.slots[0].start_streaming_at == BOOT
    assert acc[0].flush == BOOT


def test_history_entry_beyond_flush_does_not_count() -> None:
    """An acceptor told about term 2 (starting at B+9) that never received term-2 WAL reports
    its history cut at its flush (B): it agrees with a term-3 proposer only up to B."""
    b = BOOT
    prop = h((1, b), (3, b + 9))
    assert start_streaming_point(prop, h((1, b)), Lsn(b)) == b
    # The donor that holds term-1 WAL up to B+9 is streamed from its end.
    assert start_streaming_point(prop, h((1, b)), Lsn(b + 9)) == b + 9


def test_acks_below_epoch_start_do_not_commit() -> None:
    """Raft's "figure 8": a term must not count acknowledgements of WAL below its epoch start
    (older terms' WAL it is re-replicating) toward commit. Otherwise a later term whose donor
    holds another term's WAL at those LSNs overwrites what was reported committed."""
    acc = [ModelAcceptor(i) for i in range(3)]
    a, b, c = 0, 1, 2
    committed: list[tuple[TermHistory, int]] = []
    # Term 1: only A receives WAL; nothing is committed.
    p1 = Proposer(3, bootstrap_lsn=BOOT)
    _run_election(p1, acc, [a, b, c])
    _push(p1, acc, a, BOOT + 100)
    assert p1.commit_lsn == 0
    # Term 2: B and C vote, only C hears it was elected and gets term-2 WAL at [BOOT, BOOT+50).
    p2 = Proposer(3, bootstrap_lsn=BOOT, min_term=p1.term)
    for i in (b, c):
        p2.connected(i)
    reqs = [*p2.on_greeting(b, AcceptorGreeting(b, acc[b].term)),
            *p2.on_greeting(c, AcceptorGreeting(c, acc[c].term))]
    elected = []
    for j, req in reqs:
        assert isinstance(req, VoteRequest)
        elected += p2.on_vote(j, acc[j].vote(req))
    for k, el in elected:
        if k == c:
            assert isinstance(el, ProposerElected)
            acc[k].elected(el)
    p2.disconnected(b)
    _push(p2, acc, c, BOOT + 50)
    # Term 3: A (term-1 WAL to BOOT+100) is the donor; B is re-replicated term-1 WAL.
    p3 = Proposer(3, bootstrap_lsn=BOOT, min_term=p2.term)
    _run_election(p3, acc, [a, b])
    assert p3.election is not None and p3.election.epoch_start_lsn == BOOT + 100
    for i, end in ((a, BOOT + 100), (b, BOOT + 50)):
        begin, stop = p3.next_append(i, Lsn(end))
        p3.sent(i, stop)
        if p3.on_append_response(i, acc[i].append(p3.term, begin, stop)):
            committed.append((p3.election.term_history, p3.commit_lsn))
    # Term 4: B and C; C's last log term (2) beats B's (1 below B's flush): C is the donor.
    p4 = Proposer(3, bootstrap_lsn=BOOT, min_term=p3.term)
    _run_election(p4, acc, [b, c])
    assert p4.election is not None
    for hist, lsn in committed:
        assert segments(p4.election.term_history, lsn) == segments(hist, lsn), (
            f"WAL reported committed at {lsn:X} was overwritten by a later term"
        )


def test_safekeeper_back_with_less_wal_loses_its_old_acknowledgement() -> None:
    """A safekeeper acknowledged WAL, then came back without it (a replaced disk, a restart that
    lost WAL). Its old acknowledgement must not count towards commit_lsn: only the one other
    safekeeper holds that WAL, which is not a quorum of three."""
    p = _elected_proposer()
    for i in (0, 1):
        p.sent(i, Lsn(BOOT + 1000))
    p.on_append_response(0, AppendResponse(1, Lsn(BOOT + 100), Lsn(0)))
    p.on_append_response(1, AppendResponse(1, Lsn(BOOT + 100), Lsn(0)))
    assert p.commit_lsn == BOOT + 100
    p.on_append_response(0, AppendResponse(1, Lsn(BOOT + 1000), Lsn(0)))
    p.disconnected(0)
    p.connected(0)
    # It lost everything: term 0, empty history; we stream to it from the timeline's start.
    ((_, req),) = p.on_greeting(0, AcceptorGreeting(1, 0))
    assert isinstance(req, VoteRequest)
    ((_, m),) = p.on_vote(0, _vote(1, 0, ()))
    assert isinstance(m, ProposerElected) and m.start_streaming_at == BOOT
    assert p.slots[0].acked_flush_lsn == BOOT
    # sk1 reaches 1000: without sk0's lost WAL that is one copy, commit_lsn stays.
    assert p.on_append_response(1, AppendResponse(1, Lsn(BOOT + 1000), Lsn(0))) is False
    assert p.commit_lsn == BOOT + 100
    # Once sk0 holds it again, it commits.
    p.sent(0, Lsn(BOOT + 1000))
    assert p.on_append_response(0, AppendResponse(1, Lsn(BOOT + 1000), Lsn(0))) is True
    assert p.commit_lsn == BOOT + 1000
