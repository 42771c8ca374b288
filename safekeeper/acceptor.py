"""The acceptor: every safekeeper consensus state change lives here (sans-IO).

``Acceptor.process(msg)`` takes one proposer message and returns the effects the caller must
carry out, in order: ``PersistControl`` (write the control file durably), ``InitFirstSegment``,
``TruncateWal``, ``WriteWal`` and ``Reply``. The caller performs each effect before the next and
only then sends a reply, so a vote or an election is never answered before it is on disk.
After it wrote and flushed WAL the caller reports the new record-aligned end with
``wal_flushed(flush_record_lsn)``; ``append_response()`` builds the reply for a write group.

Driver invariant: every ``WriteWal`` effect has been written and flushed (``wal_flushed``)
before a non-append message is processed, so a vote always reports flushed WAL (Neon's
"flush before voting" step).

Rules follow protocols.md §3.5 (Neon's ``safekeeper.rs``): terms only go up, the term history
is replaced by the elected proposer's, WAL is truncated at the election point, appends must be
contiguous, commit_lsn never passes the flushed WAL and never moves back.
"""

from __future__ import annotations

import attrs

from protocol.errors import INTERNAL_ERROR, RemoteProtocolError
from protocol.lsn import INVALID_LSN, Lsn, format_lsn
from protocol.safekeeper import (
    AcceptorGreeting,
    AcceptorMessage,
    AppendRequest,
    AppendResponse,
    MembershipConfiguration,
    ProposerElected,
    ProposerGreeting,
    ProposerMessage,
    TermSwitchEntry,
    VoteRequest,
    VoteResponse,
)
from safekeeper.control_file import PersistentState


class AcceptorError(RemoteProtocolError):
    """The proposer's message cannot be accepted; the stream ends with an ErrorResponse."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg, sqlstate=INTERNAL_ERROR)


@attrs.frozen
class PersistControl:
    state: PersistentState


@attrs.frozen
class InitFirstSegment:
    """There is no WAL yet: write the headers that make ``lsn``'s segment readable."""

    lsn: Lsn
    system_id: int


@attrs.frozen
class TruncateWal:
    lsn: Lsn


@attrs.frozen
class WriteWal:
    begin_lsn: Lsn
    wal: bytes | memoryview = attrs.field(eq=bytes, repr=False)


@attrs.frozen
class Reply:
    msg: AcceptorMessage


Effect = PersistControl | InitFirstSegment | TruncateWal | WriteWal | Reply


def pg_major(pg_version: int) -> int:
    return pg_version // 10000


def highest_common_point(
    prop: tuple[TermSwitchEntry, ...], mine: tuple[TermSwitchEntry, ...], my_wal_end: Lsn
) -> TermSwitchEntry | None:
    """The last (term, lsn) both histories agree on, the lsn being where that term ends for
    whichever of the two stops earlier; None when even the first term differs."""
    last = None
    for i in range(min(len(prop), len(mine))):
        if prop[i].term != mine[i].term:
            break
        if prop[i].lsn != mine[i].lsn:
            raise AcceptorError(
                f"term {prop[i].term} starts at {format_lsn(prop[i].lsn)} for the proposer "
                f"but at {format_lsn(mine[i].lsn)} here"
            )
        last = i
    if last is None:
        return None
    prop_end = prop[last + 1].lsn if last + 1 < len(prop) else Lsn(2**64 - 1)
    mine_end = mine[last + 1].lsn if last + 1 < len(mine) else my_wal_end
    return TermSwitchEntry(prop[last].term, Lsn(min(prop_end, mine_end)))


class Acceptor:
    """One timeline's acceptor. ``state`` is what is (or is about to be) persisted."""

    def __init__(self, node_id: int, state: PersistentState, flush_record_lsn: Lsn) -> None:
        self.node_id = node_id
        self.state = state
        # After a restart the end of WAL is the end of the last valid record.
        self.write_lsn = flush_record_lsn
        self.flush_record_lsn = flush_record_lsn
        self.commit_lsn = state.commit_lsn
        self.peer_horizon_lsn = state.peer_horizon_lsn
        # The pageserver's durable-in-remote-storage position (its feedback); only grows.
        self.remote_consistent_lsn = state.remote_consistent_lsn
        # WAL below it is in remote storage as whole segments (safekeeper.wal_backup); grows.
        self.backup_lsn = state.backup_lsn
        self.term_start_lsn = state.term_history[-1].lsn if state.term_history else INVALID_LSN
        self._commit_candidate = state.commit_lsn

    # -- queries -----------------------------------------------------------------------------

    @property
    def term(self) -> int:
        return self.state.term

    @property
    def flush_lsn(self) -> Lsn:
        """What the proposer is told: record-aligned, never below the timeline's start."""
        return Lsn(max(self.flush_record_lsn, self.state.timeline_start_lsn))

    def last_log_term(self) -> int:
        history = self.state.term_history
        return history[-1].term if history else 0

    def append_response(self) -> AppendResponse:
        return AppendResponse(
            term=self.state.term,
            flush_lsn=self.flush_lsn,
            commit_lsn=self.commit_lsn,
            generation=self.state.mconf.generation,
        )

    # -- transitions -------------------------------------------------------------------------

    def process(self, msg: ProposerMessage) -> list[Effect]:
        if isinstance(msg, AppendRequest):
            return self._append(msg)
        if isinstance(msg, ProposerGreeting):
            return self._greeting(msg)
        if isinstance(msg, VoteRequest):
            return self._vote(msg)
        return self._elected(msg)

    def _check_generation(self, generation: int, what: str) -> None:
        if generation != self.state.mconf.generation:
            raise AcceptorError(
                f"refusing {what}: generation {generation}, this safekeeper is at "
                f"{self.state.mconf.generation}"
            )

    def _greeting(self, msg: ProposerGreeting) -> list[Effect]:
        st = self.state
        if msg.tenant_id != st.tenant_id or msg.timeline_id != st.timeline_id:
            raise AcceptorError(
                f"greeting for {msg.tenant_id}/{msg.timeline_id} on timeline "
                f"{st.tenant_id}/{st.timeline_id}"
            )
        if st.pg_version and pg_major(msg.pg_version) != pg_major(st.pg_version):
            raise AcceptorError(
                f"incompatible PostgreSQL version {msg.pg_version}, timeline has {st.pg_version}"
            )
        if msg.wal_seg_size != st.wal_seg_size:
            raise AcceptorError(
                f"WAL segment size {msg.wal_seg_size} differs from the timeline's {st.wal_seg_size}"
            )
        new = self.persisted_state()
        if msg.system_id and msg.system_id != st.system_id:
            new = attrs.evolve(new, system_id=msg.system_id)
        if msg.pg_version and msg.pg_version != st.pg_version:
            new = attrs.evolve(new, pg_version=msg.pg_version)
        if msg.mconf.generation > st.mconf.generation:
            if not self._is_member(msg.mconf):
                raise AcceptorError(
                    f"membership generation {msg.mconf.generation} does not include node "
                    f"{self.node_id}"
                )
            new = attrs.evolve(new, mconf=msg.mconf)
        effects: list[Effect] = []
        if new != self.persisted_state():
            self.state = new
            effects.append(PersistControl(new))
        effects.append(
            Reply(AcceptorGreeting(node_id=self.node_id, term=new.term, mconf=new.mconf))
        )
        return effects

    def _is_member(self, mconf: MembershipConfiguration) -> bool:
        members = mconf.members + (mconf.new_members or ())
        return any(m.node_id == self.node_id for m in members)

    def _vote(self, msg: VoteRequest) -> list[Effect]:
        self._check_generation(msg.generation, "VoteRequest")
        flush_lsn = self.flush_lsn
        history = tuple(e for e in self.state.term_history if e.lsn <= flush_lsn)
        effects: list[Effect] = []
        vote_given = False
        if msg.term > self.state.term:
            self.state = attrs.evolve(self.state, term=msg.term)
            effects.append(PersistControl(self.persisted_state()))
            vote_given = True
        effects.append(
            Reply(
                VoteResponse(
                    term=self.state.term,
                    vote_given=vote_given,
                    flush_lsn=flush_lsn,
                    truncate_lsn=self.peer_horizon_lsn,
                    term_history=history,
                    generation=self.state.mconf.generation,
                )
            )
        )
        return effects

    def _elected(self, msg: ProposerElected) -> list[Effect]:
        self._check_generation(msg.generation, "ProposerElected")
        if self.state.term > msg.term:
            # A deposed proposer: it learns the higher term from the next response.
            return []
        # Validate before changing anything, so that an error leaves no unpersisted state.
        if not msg.term_history:
            raise AcceptorError("ProposerElected with an empty term history")
        # Compare with our history cut at our WAL end, as the vote did: a term we were elected in
        # but received no WAL of says nothing about what we hold (Neon's TermHistory::up_to).
        flush_lsn = self.flush_lsn
        mine = tuple(e for e in self.state.term_history if e.lsn <= flush_lsn)
        point = highest_common_point(msg.term_history, mine, flush_lsn)
        if point is None:
            point = msg.term_history[0]
        start = msg.start_streaming_at
        if point.lsn != start:
            raise AcceptorError(
                f"refusing ProposerElected: start_streaming_at {format_lsn(start)} is not the "
                f"last common point {format_lsn(point.lsn)} of the term histories"
            )
        if mine and start > flush_lsn:
            # Only reachable when no term is common (the proposer's first entry is taken as
            # the point): WAL would continue after a hole, which a restart scan ends at, so
            # flush_lsn acknowledged beyond it would shrink.
            raise AcceptorError(
                f"refusing ProposerElected: start_streaming_at {format_lsn(start)} is beyond "
                f"the end of WAL here {format_lsn(flush_lsn)} (the term histories share no term)"
            )
        if start < self.commit_lsn:
            raise AcceptorError(
                f"ProposerElected would truncate committed WAL: start {format_lsn(start)} "
                f"< commit_lsn {format_lsn(self.commit_lsn)}"
            )
        effects: list[Effect] = []
        if msg.term > self.state.term:
            self.state = attrs.evolve(self.state, term=msg.term)
            effects.append(PersistControl(self.persisted_state()))
        if self.write_lsn == INVALID_LSN and self.flush_record_lsn == INVALID_LSN:
            effects.append(InitFirstSegment(start, self.state.system_id))
        effects.append(TruncateWal(start))
        self.write_lsn = start
        self.flush_record_lsn = start
        st = self.persisted_state()
        timeline_start = st.timeline_start_lsn or msg.term_history[0].lsn
        new = attrs.evolve(
            st,
            timeline_start_lsn=timeline_start,
            peer_horizon_lsn=st.peer_horizon_lsn or timeline_start,
            local_start_lsn=st.local_start_lsn or start,
            commit_lsn=max(st.commit_lsn, timeline_start),
            backup_lsn=max(st.backup_lsn, timeline_start),
            remote_consistent_lsn=max(st.remote_consistent_lsn, timeline_start),
            term_history=msg.term_history,
        )
        self.state = new
        self.commit_lsn = Lsn(max(self.commit_lsn, new.commit_lsn))
        self._commit_candidate = Lsn(max(self._commit_candidate, self.commit_lsn))
        self.peer_horizon_lsn = Lsn(max(self.peer_horizon_lsn, new.peer_horizon_lsn))
        self.remote_consistent_lsn = Lsn(max(self.remote_consistent_lsn, new.remote_consistent_lsn))
        self.backup_lsn = Lsn(max(self.backup_lsn, new.backup_lsn))
        self.term_start_lsn = msg.term_history[-1].lsn
        effects.append(PersistControl(new))
        return effects

    def _append(self, msg: AppendRequest) -> list[Effect]:
        refusal = self.append(msg)
        if refusal is not None:
            return [Reply(refusal)]
        self.advance_commit()
        if msg.end_lsn > msg.begin_lsn:
            return [WriteWal(msg.begin_lsn, msg.wal)]
        return []

    def append(self, msg: AppendRequest) -> AppendResponse | None:
        """The hot path of ``process`` for appends: None means "accepted, write ``msg.wal``
        at ``msg.begin_lsn``"; a response is a term-only refusal to send back."""
        state = self.state
        if msg.generation != state.mconf.generation:
            self._check_generation(msg.generation, "AppendRequest")
        if state.term != msg.term:
            if state.term < msg.term:
                raise AcceptorError(
                    f"got AppendRequest of term {msg.term} before ProposerElected "
                    f"(term here is {state.term})"
                )
            return AppendResponse(
                term=state.term,
                flush_lsn=INVALID_LSN,
                commit_lsn=INVALID_LSN,
                generation=state.mconf.generation,
            )
        if not state.term_history:
            raise AcceptorError("got AppendRequest before any ProposerElected")
        write_lsn = self.write_lsn
        if msg.begin_lsn != write_lsn and write_lsn != INVALID_LSN:
            kind = "rewrites WAL written before" if msg.begin_lsn < write_lsn else "leaves a gap"
            raise AcceptorError(
                f"AppendRequest at {format_lsn(msg.begin_lsn)} {kind}: "
                f"write_lsn is {format_lsn(write_lsn)}"
            )
        if msg.end_lsn > msg.begin_lsn:
            self.write_lsn = msg.end_lsn
        if msg.commit_lsn > self._commit_candidate:
            self._commit_candidate = msg.commit_lsn
        if msg.truncate_lsn > self.peer_horizon_lsn:
            self.peer_horizon_lsn = msg.truncate_lsn
        return None

    def advance_commit(self) -> None:
        new = Lsn(min(max(self._commit_candidate, self.commit_lsn), self.flush_lsn))
        if new > self.commit_lsn:
            self.commit_lsn = new

    def wal_flushed(self, flush_record_lsn: Lsn) -> None:
        """The caller wrote and flushed WAL; ``flush_record_lsn`` ends on a record."""
        if flush_record_lsn < self.flush_record_lsn:
            raise AssertionError(
                f"flush_record_lsn went back from {format_lsn(self.flush_record_lsn)} "
                f"to {format_lsn(flush_record_lsn)}"
            )
        self.flush_record_lsn = flush_record_lsn
        self.advance_commit()

    def persisted_state(self) -> PersistentState:
        """The state with the in-memory LSNs folded in, for a lazy control file save."""
        return attrs.evolve(
            self.state,
            commit_lsn=self.commit_lsn,
            peer_horizon_lsn=self.peer_horizon_lsn,
            remote_consistent_lsn=self.remote_consistent_lsn,
            backup_lsn=self.backup_lsn,
        )

    def pageserver_progress(self, remote_consistent_lsn: Lsn) -> None:
        """A pageserver reported what it has made durable; stale reports are ignored."""
        if remote_consistent_lsn > self.remote_consistent_lsn:
            self.remote_consistent_lsn = remote_consistent_lsn
