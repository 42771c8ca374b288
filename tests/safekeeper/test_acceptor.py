"""The acceptor state machine: unit tests and a hypothesis rule-based machine."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from protocol.ids import TenantId, TimelineId
from protocol.lsn import INVALID_LSN, Lsn
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
from safekeeper.acceptor import (
    Acceptor,
    AcceptorError,
    Effect,
    InitFirstSegment,
    PersistControl,
    Reply,
    TruncateWal,
    WriteWal,
)
from safekeeper.control_file import PersistentState

TENANT = TenantId(bytes(range(16)))
TIMELINE = TimelineId(bytes(range(16, 32)))
START = Lsn(0x1000028)


def new_acceptor(node_id: int = 1) -> Acceptor:
    return Acceptor(node_id, PersistentState(TENANT, TIMELINE), INVALID_LSN)


def greeting(**kw: object) -> ProposerGreeting:
    args: dict[str, object] = {
        "tenant_id": TENANT,
        "timeline_id": TIMELINE,
        "pg_version": 150018,
        "system_id": 42,
        "wal_seg_size": 16 << 20,
    }
    args.update(kw)
    return ProposerGreeting(**args)  # type: ignore[arg-type]


def replies(effects: list[Effect]) -> list[object]:
    return [e.msg for e in effects if isinstance(e, Reply)]


def elect(acc: Acceptor, term: int, start: Lsn = START) -> list[Effect]:
    acc.process(VoteRequest(term))
    history = (*[e for e in acc.state.term_history if e.lsn < start], TermSwitchEntry(term, start))
    if not acc.state.term_history:
        history = (TermSwitchEntry(term, start),)
    return acc.process(ProposerElected(term, start, history))


def append(acc: Acceptor, term: int, begin: int, n: int, commit: int = 0) -> list[Effect]:
    return acc.process(AppendRequest(term, Lsn(begin), Lsn(begin + n), Lsn(commit), INVALID_LSN, bytes(n)))


def test_greeting_adopts_system_id_and_persists_before_reply() -> None:
    acc = new_acceptor()
    effects = acc.process(greeting())
    assert isinstance(effects[0], PersistControl)
    assert effects[0].state.system_id == 42
    assert replies(effects) == [AcceptorGreeting(node_id=1, term=0)]
    # Nothing changed the second time: no write.
    assert not any(isinstance(e, PersistControl) for e in acc.process(greeting()))


@pytest.mark.parametrize(
    "bad",
    [
        {"tenant_id": TenantId(bytes(16))},
        {"timeline_id": TimelineId(bytes(16))},
        {"wal_seg_size": 1 << 20},
    ],
)
def test_greeting_mismatch_is_an_error(bad: dict[str, object]) -> None:
    with pytest.raises(AcceptorError):
        new_acceptor().process(greeting(**bad))


def test_greeting_pg_major_mismatch_is_an_error() -> None:
    acc = new_acceptor()
    acc.process(greeting())
    acc.process(greeting(pg_version=150002))  # same major: fine
    with pytest.raises(AcceptorError):
        acc.process(greeting(pg_version=160000))


def test_vote_given_only_for_higher_term_and_persisted_first() -> None:
    acc = new_acceptor()
    effects = acc.process(VoteRequest(5))
    assert isinstance(effects[0], PersistControl) and effects[0].state.term == 5
    (resp,) = replies(effects)
    assert isinstance(resp, VoteResponse) and resp.vote_given and resp.term == 5
    effects = acc.process(VoteRequest(5))
    assert not any(isinstance(e, PersistControl) for e in effects)
    (resp,) = replies(effects)
    assert isinstance(resp, VoteResponse) and not resp.vote_given
    (resp,) = replies(acc.process(VoteRequest(3)))
    assert isinstance(resp, VoteResponse) and not resp.vote_given and resp.term == 5


def test_first_election_initialises_and_truncates() -> None:
    acc = new_acceptor()
    acc.process(greeting())
    effects = elect(acc, 1)
    kinds = [type(e) for e in effects]
    assert kinds == [InitFirstSegment, TruncateWal, PersistControl]
    persist = effects[-1]
    assert isinstance(persist, PersistControl)
    assert persist.state.timeline_start_lsn == START
    assert persist.state.commit_lsn == START
    assert persist.state.term_history == (TermSwitchEntry(1, START),)
    assert acc.flush_lsn == START


def test_append_flow_and_commit_capped_at_flush() -> None:
    acc = new_acceptor()
    elect(acc, 1)
    effects = append(acc, 1, START, 100, commit=START + 1000)
    assert [type(e) for e in effects] == [WriteWal]
    assert acc.commit_lsn == START  # nothing flushed beyond the start yet
    acc.wal_flushed(Lsn(START + 96))
    assert acc.commit_lsn == START + 96
    resp = acc.append_response()
    assert resp == AppendResponse(term=1, flush_lsn=Lsn(START + 96), commit_lsn=Lsn(START + 96))


def test_append_errors() -> None:
    acc = new_acceptor()
    with pytest.raises(AcceptorError, match="before ProposerElected"):
        append(acc, 1, START, 10)
    elect(acc, 2)
    append(acc, 2, START, 16)
    with pytest.raises(AcceptorError, match="gap"):
        append(acc, 2, START + 32, 16)
    with pytest.raises(AcceptorError, match="rewrites"):
        append(acc, 2, START, 16)
    with pytest.raises(AcceptorError, match="before ProposerElected"):
        append(acc, 3, START + 16, 16)
    # A deposed proposer gets a term-only refusal, not an error.
    (resp,) = replies(append(acc, 1, START + 16, 16))
    assert resp == AppendResponse(term=2, flush_lsn=INVALID_LSN, commit_lsn=INVALID_LSN)


def test_elected_truncates_at_the_last_common_point() -> None:
    acc = new_acceptor()
    elect(acc, 1)
    append(acc, 1, START, 800)
    acc.wal_flushed(Lsn(START + 800))
    acc.process(VoteRequest(2))
    # The new proposer knew term 1 only up to START + 400.
    history = (TermSwitchEntry(1, START), TermSwitchEntry(2, Lsn(START + 400)))
    with pytest.raises(AcceptorError, match="common point"):
        acc.process(ProposerElected(2, Lsn(START + 200), history))
    effects = acc.process(ProposerElected(2, Lsn(START + 400), history))
    assert TruncateWal(Lsn(START + 400)) in effects
    assert acc.flush_lsn == START + 400
    assert acc.state.term_history == history
    (vote,) = replies(acc.process(VoteRequest(3)))
    assert isinstance(vote, VoteResponse) and vote.flush_lsn == START + 400


def test_lower_term_election_is_ignored() -> None:
    acc = new_acceptor()
    elect(acc, 5)
    assert acc.process(ProposerElected(4, START, (TermSwitchEntry(4, START),))) == []


def test_generation_mismatch() -> None:
    acc = new_acceptor()
    with pytest.raises(AcceptorError, match="generation"):
        acc.process(VoteRequest(1, generation=3))


# ---------------------------------------------------------------------------------------------


@attrs.define
class Disk:
    """What would be on disk: the persisted state and the WAL end."""

    state: PersistentState
    wal_end: Lsn = INVALID_LSN


class AcceptorMachine(RuleBasedStateMachine):
    """Several proposers race; the acceptor crashes and restarts from its "disk".

    Invariants: the term never goes back (also across restarts, because it is persisted
    before any reply); an acknowledged flush_lsn only shrinks after a truncation ordered by
    a higher term; commit_lsn never shrinks and never passes flush_lsn.
    """

    def __init__(self) -> None:
        super().__init__()
        self.disk = Disk(PersistentState(TENANT, TIMELINE))
        self.acc = Acceptor(1, self.disk.state, INVALID_LSN)
        self.max_term_seen = 0
        self.acked: tuple[int, Lsn] = (0, INVALID_LSN)  # (term, flush_lsn) last acknowledged
        self.max_commit = INVALID_LSN
        self.elected_term: int | None = None

    def run(self, effects: list[Effect]) -> list[object]:
        out: list[object] = []
        for e in effects:
            if isinstance(e, PersistControl):
                self.disk.state = e.state
            elif isinstance(e, TruncateWal):
                assert e.lsn >= self.acc.commit_lsn or e.lsn >= self.max_commit
                self.disk.wal_end = e.lsn
            elif isinstance(e, WriteWal):
                assert e.begin_lsn == self.disk.wal_end
                self.disk.wal_end = Lsn(e.begin_lsn + len(e.wal))
            elif isinstance(e, Reply):
                out.append(e.msg)
        return out

    @rule(term=st.integers(1, 8))
    def vote(self, term: int) -> None:
        before = self.acc.term
        (resp,) = self.run(self.acc.process(VoteRequest(term)))
        assert isinstance(resp, VoteResponse)
        assert resp.vote_given == (term > before)
        if resp.vote_given:
            # Persisted before the reply.
            assert self.disk.state.term == term

    @rule(term=st.integers(1, 8), cut=st.integers(0, 3))
    def elected(self, term: int, cut: int) -> None:
        # A proposer that knows the acceptor's history up to its flush point, minus ``cut``
        # entries of 8 bytes: the start is the last common point when cut == 0.
        flush = self.acc.flush_lsn
        history = tuple(e for e in self.acc.state.term_history if e.lsn <= flush)
        start = flush if history else START
        # A real proposer never cuts below commit_lsn (a quorum has it).
        start = Lsn(max(start - 8 * cut, history[-1].lsn if history else START, self.acc.commit_lsn))
        try:
            effects = self.acc.process(
                ProposerElected(term, start, (*history, TermSwitchEntry(term, start)) if not history or history[-1].term < term else history)
            )
        except AcceptorError:
            return
        self.run(effects)
        if self.acc.term == term and any(isinstance(e, TruncateWal) for e in effects):
            self.elected_term = term
            if start < self.acked[1]:
                event("election truncated acknowledged WAL")
                assert term > self.acked[0], "acknowledged WAL truncated by the same term"

    @precondition(lambda self: self.elected_term is not None)
    @rule(n=st.sampled_from([0, 8, 16, 64]), commit_back=st.sampled_from([0, 8, 24, 64]))
    def append(self, n: int, commit_back: int) -> None:
        assert self.elected_term is not None
        begin = self.acc.write_lsn
        try:
            effects = self.acc.process(
                AppendRequest(
                    self.elected_term,
                    begin,
                    Lsn(begin + n),
                    Lsn(max(begin + n - commit_back, 0)),
                    INVALID_LSN,
                    bytes(n),
                )
            )
        except AcceptorError:
            return
        self.run(effects)

    @rule()
    def flush(self) -> None:
        self.acc.wal_flushed(self.disk.wal_end)
        resp = self.acc.append_response()
        # The acknowledged WAL belongs to the last term in the history.
        self.acked = (self.acc.last_log_term(), resp.flush_lsn)

    @rule()
    def restart(self) -> None:
        # Unflushed bytes may or may not survive; the restart scan finds at least the flushed.
        self.acc = Acceptor(1, self.disk.state, Lsn(max(self.acc.flush_record_lsn, self.disk.state.commit_lsn)) if self.disk.state.term_history else INVALID_LSN)
        self.disk.wal_end = self.acc.write_lsn
        self.elected_term = None
        # commit_lsn is persisted lazily: after a crash it may restart lower (never above flush).
        self.max_commit = self.acc.commit_lsn

    @invariant()
    def terms_never_go_back(self) -> None:
        assert self.acc.term >= self.max_term_seen
        assert self.disk.state.term == self.acc.term
        self.max_term_seen = self.acc.term

    @invariant()
    def acknowledged_flush_kept(self) -> None:
        term, flush = self.acked
        if self.acc.flush_lsn < flush:
            assert self.acc.term > term

    @invariant()
    def commit_monotonic_and_capped(self) -> None:
        assert self.acc.commit_lsn >= self.max_commit
        assert self.acc.commit_lsn <= max(self.acc.flush_lsn, self.acc.state.timeline_start_lsn)
        self.max_commit = self.acc.commit_lsn


TestAcceptorMachine = AcceptorMachine.TestCase
TestAcceptorMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_append_before_any_election_is_an_error() -> None:
    acc = new_acceptor()
    with pytest.raises(AcceptorError, match="before any ProposerElected"):
        append(acc, 0, START, 16)


def test_elected_with_no_common_term_never_starts_beyond_the_wal() -> None:
    """No term in common: the proposer's first entry is the point. If that is past our WAL,
    truncating "at" it would leave a hole that a restart scan stops at (flush_lsn would shrink
    below what was acknowledged, by the same term)."""
    acc = new_acceptor()
    elect(acc, 1)
    append(acc, 1, START, 800)
    acc.wal_flushed(Lsn(START + 800))
    acc.process(VoteRequest(3))
    beyond = Lsn(START + 0x10000)
    with pytest.raises(AcceptorError, match="beyond the end of WAL"):
        acc.process(ProposerElected(3, beyond, (TermSwitchEntry(2, beyond), TermSwitchEntry(3, beyond))))
    assert acc.flush_lsn == START + 800 and acc.state.term_history == (TermSwitchEntry(1, START),)
    # At or before our end it is an ordinary truncation at the divergence.
    effects = acc.process(ProposerElected(3, START, (TermSwitchEntry(2, START), TermSwitchEntry(3, START))))
    assert TruncateWal(START) in effects
