"""The proposer side of the safekeeper consensus protocol, as a pure state machine.

This module owns the decisions a walproposer makes (protocols.md §3, Neon's ``walproposer.c``);
it does no IO, so it is tested by feeding it acceptor messages. The IO layer (``bridge.py``)
opens one START_WAL_PUSH stream per safekeeper, sends the ProposerGreeting itself, passes every
acceptor message here and sends the messages the state machine returns.

Rules, in the order a term goes through them:

1. **Term.** A term is chosen once a quorum (``n // 2 + 1``) of safekeepers has greeted: it is the
   highest term any of them reported, plus one. Safekeepers that greet later get a VoteRequest for
   that same term straight away. A later greeting with a higher term means another proposer
   is alive: ``ProposerRejected``.
2. **Election.** A quorum of granted votes elects us. A refused vote before that, or one carrying
   a higher term at any time, is ``ProposerRejected``: the caller starts over with a fresh
   ``Proposer`` (which picks a higher term), exactly as Neon's walproposer exits and restarts.
3. **Epoch start.** Among the safekeepers that voted, the *donor* is the one with the highest
   last-log-term (the term of its last term-history entry) and, among those, the highest
   ``flush_lsn``. Its ``flush_lsn`` is where our term starts (``epoch_start_lsn``); its term
   history plus ``(our term, epoch_start_lsn)`` is our term history. ``truncate_lsn`` is the
   highest truncate_lsn among the voters. When every voter is empty (flush_lsn 0) the timeline is
   new and our term starts at ``bootstrap_lsn``, the LSN the caller knows WAL starts at.
4. **Streaming point per safekeeper.** ProposerElected tells each voter where to truncate and
   where we start streaming: the end of the last term its history shares with ours (the start of
   our next term there, or the end of its own WAL in that term, whichever is lower); with no
   common term, the start of our history.
5. **Commit.** ``commit_lsn`` is the ``quorum``-th highest ``flush_lsn`` acknowledged *in our
   term* and not below ``epoch_start_lsn`` (Raft: a term commits nothing until a quorum holds
   its own start; a safekeeper's last acknowledgement survives its disconnection: it was
   fsynced, unless it comes back with less: its acknowledgement is then cut to where it
   restarts streaming). It only moves forward; it rides on every AppendRequest. ``truncate_lsn`` (peer horizon) is the
   lowest of those acknowledgements over all safekeepers, also never moving back.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.lsn import INVALID_LSN, Lsn, format_lsn
from protocol.safekeeper import (
    MAX_SEND_SIZE,
    AcceptorGreeting,
    AppendResponse,
    ProposerElected,
    TermSwitchEntry,
    VoteRequest,
    VoteResponse,
)

TermHistory = tuple[TermSwitchEntry, ...]


class ProposerRejected(Exception):
    """A safekeeper lives in a term we cannot win with: start over with a fresh proposer."""

    def __init__(self, msg: str, *, seen_term: int) -> None:
        super().__init__(msg)
        self.seen_term = seen_term


class Phase(enum.Enum):
    """Where one safekeeper connection is in the conversation."""

    OFFLINE = "offline"  # no stream
    HANDSHAKE = "handshake"  # greeting sent, waiting for AcceptorGreeting
    VOTING = "voting"  # greeted; waiting until a quorum has greeted so a term exists
    WAIT_VERDICT = "wait_verdict"  # VoteRequest sent
    IDLE = "idle"  # vote granted, waiting for the quorum of votes
    ACTIVE = "active"  # ProposerElected sent; streaming WAL


@attrs.define
class SafekeeperSlot:
    """What the proposer knows about one safekeeper (index ``i`` in the configured list)."""

    phase: Phase = Phase.OFFLINE
    greeting_term: int = 0
    vote: VoteResponse | None = None
    # Next LSN to send; set when ProposerElected is sent.
    streaming_at: Lsn | None = None
    start_streaming_at: Lsn | None = None
    # Last flush_lsn acknowledged in *our* term; kept across disconnections.
    acked_flush_lsn: Lsn = INVALID_LSN
    node_id: int = 0


def quorum_size(n: int) -> int:
    """Majority of ``n`` safekeepers."""
    if n < 1:
        raise ValueError("need at least one safekeeper")
    return n // 2 + 1


def quorum_lsn(flush_lsns: Sequence[int], quorum: int) -> Lsn:
    """The highest LSN that at least ``quorum`` of the given positions have reached."""
    if not 1 <= quorum <= len(flush_lsns):
        raise ValueError(f"quorum {quorum} out of range for {len(flush_lsns)} safekeepers")
    return Lsn(sorted(flush_lsns, reverse=True)[quorum - 1])


def last_log_term(history: TermHistory) -> int:
    return history[-1].term if history else 0


@attrs.frozen
class Election:
    """Outcome of a won vote: our term history, and where the donor's WAL ends."""

    term: int
    epoch_start_lsn: Lsn
    truncate_lsn: Lsn
    term_history: TermHistory
    donor: int


def elect(
    term: int, votes: dict[int, VoteResponse], bootstrap_lsn: Lsn
) -> Election:
    """Rule 3: pick the donor among ``votes`` (index -> granted vote) and our term history."""
    if not votes:
        raise LocalProtocolError("election without votes")
    donor = max(
        sorted(votes),
        key=lambda i: (last_log_term(votes[i].term_history), votes[i].flush_lsn),
    )
    donor_vote = votes[donor]
    epoch_start = donor_vote.flush_lsn
    truncate = Lsn(max(v.truncate_lsn for v in votes.values()))
    history: TermHistory = donor_vote.term_history
    if epoch_start == INVALID_LSN:
        # Nothing was ever written: the timeline starts where the caller's WAL starts.
        epoch_start = truncate = bootstrap_lsn
        history = ()
    if history and history[-1].term >= term:
        raise LocalProtocolError(
            f"donor history ends in term {history[-1].term}, not below our term {term}"
        )
    return Election(
        term=term,
        epoch_start_lsn=epoch_start,
        truncate_lsn=truncate,
        term_history=(*history, TermSwitchEntry(term, epoch_start)),
        donor=donor,
    )


def start_streaming_point(prop: TermHistory, sk: TermHistory, sk_flush_lsn: Lsn) -> Lsn:
    """Rule 4: the LSN up to which the safekeeper's WAL agrees with our history."""
    if not prop:
        raise LocalProtocolError("proposer term history is empty")
    common = -1
    for i in range(min(len(prop), len(sk))):
        if prop[i].term != sk[i].term:
            break
        common = i
    if common < 0:
        return prop[0].lsn
    if common == len(prop) - 1:
        # The safekeeper already is in our (last) term: it agrees up to its own end.
        return sk_flush_lsn
    prop_end = prop[common + 1].lsn
    sk_end = sk[common + 1].lsn if common + 1 < len(sk) else sk_flush_lsn
    return Lsn(min(prop_end, sk_end))


Outgoing = list[tuple[int, VoteRequest | ProposerElected]]


class Proposer:
    """One term's worth of proposer state over ``n`` safekeepers (indexes 0..n-1).

    Methods return the messages to send as ``(safekeeper index, message)`` pairs. A fresh
    instance is needed after ``ProposerRejected`` or a restart; ``min_term`` lets the caller
    demand a term above one it has seen rejected.
    """

    def __init__(self, n_safekeepers: int, *, bootstrap_lsn: Lsn, min_term: int = 0) -> None:
        self.n = n_safekeepers
        self.quorum = quorum_size(n_safekeepers)
        self.bootstrap_lsn = bootstrap_lsn
        self.slots = [SafekeeperSlot() for _ in range(n_safekeepers)]
        self._max_seen_term = min_term
        self.term = 0  # 0 until a quorum greeted
        self.election: Election | None = None
        self.commit_lsn = INVALID_LSN
        self.truncate_lsn = INVALID_LSN

    # -- connection lifecycle ------------------------------------------------------------------

    def connected(self, i: int) -> None:
        """A START_WAL_PUSH stream is open and the greeting is on its way."""
        slot = self.slots[i]
        if slot.phase is not Phase.OFFLINE:
            raise LocalProtocolError(f"safekeeper {i} connected twice")
        slot.phase = Phase.HANDSHAKE

    def disconnected(self, i: int) -> None:
        slot = self.slots[i]
        slot.phase = Phase.OFFLINE
        slot.vote = None
        slot.streaming_at = None
        slot.start_streaming_at = None

    @property
    def elected(self) -> bool:
        return self.election is not None

    # -- greeting and vote -----------------------------------------------------------------------

    def on_greeting(self, i: int, msg: AcceptorGreeting) -> Outgoing:
        slot = self._expect_received(i, Phase.HANDSHAKE, "AcceptorGreeting")
        slot.greeting_term = msg.term
        slot.node_id = msg.node_id
        slot.phase = Phase.VOTING
        if self.term:
            if msg.term >= self.term and not self._voted_for_us(msg.term):
                raise ProposerRejected(
                    f"safekeeper {i} is in term {msg.term}, ours is {self.term}",
                    seen_term=msg.term,
                )
            return self._request_votes()
        greeted = [s.greeting_term for s in self.slots if s.phase is Phase.VOTING]
        if len(greeted) < self.quorum:
            return []
        self.term = max(self._max_seen_term, *greeted) + 1
        return self._request_votes()

    def _voted_for_us(self, term: int) -> bool:
        # A greeting in exactly our term comes from a safekeeper that voted for us in this session
        # and reconnected; its vote is persisted, so it may stream with us once we are elected.
        return term == self.term and self.elected

    def _request_votes(self) -> Outgoing:
        out: Outgoing = []
        for j, s in enumerate(self.slots):
            if s.phase is Phase.VOTING:
                s.phase = Phase.WAIT_VERDICT
                out.append((j, VoteRequest(self.term)))
        return out

    def on_vote(self, i: int, msg: VoteResponse) -> Outgoing:
        slot = self._expect_received(i, Phase.WAIT_VERDICT, "VoteResponse")
        if msg.term > self.term:
            raise ProposerRejected(
                f"safekeeper {i} refused term {self.term}: it is in term {msg.term}",
                seen_term=msg.term,
            )
        if not msg.vote_given and not self.elected:
            raise ProposerRejected(
                f"safekeeper {i} refused its vote for term {self.term}", seen_term=msg.term
            )
        slot.vote = msg
        slot.phase = Phase.IDLE
        if self.election is not None:
            return [self._send_elected(i)]
        votes = {j: s.vote for j, s in enumerate(self.slots) if s.phase is Phase.IDLE and s.vote}
        if len(votes) < self.quorum:
            return []
        self.election = elect(self.term, votes, self.bootstrap_lsn)
        self.truncate_lsn = self.election.truncate_lsn
        # A commit_lsn from an older term is still committed, but it must not move past our
        # epoch start before our own acknowledgements arrive.
        return [self._send_elected(j) for j in sorted(votes)]

    def _send_elected(self, i: int) -> tuple[int, ProposerElected]:
        assert self.election is not None
        slot = self.slots[i]
        assert slot.vote is not None
        start = start_streaming_point(
            self.election.term_history, slot.vote.term_history, slot.vote.flush_lsn
        )
        slot.phase = Phase.ACTIVE
        slot.start_streaming_at = start
        slot.streaming_at = start
        # The safekeeper truncates to ``start`` and holds nothing of ours beyond it: an earlier
        # acknowledgement above that (it came back with less WAL: a replaced disk, a restart that
        # lost WAL) no longer counts towards commit_lsn.
        if slot.acked_flush_lsn > start:
            slot.acked_flush_lsn = start
        return i, ProposerElected(
            term=self.term,
            start_streaming_at=start,
            term_history=self.election.term_history,
            timeline_start_lsn=self.election.term_history[0].lsn,
        )

    # -- streaming ------------------------------------------------------------------------------

    def next_append(self, i: int, available_lsn: Lsn) -> tuple[Lsn, Lsn]:
        """The WAL range [begin, end) to send to safekeeper ``i`` next (may be empty)."""
        slot = self._expect(i, Phase.ACTIVE, "AppendRequest")
        assert slot.streaming_at is not None
        begin = slot.streaming_at
        end = Lsn(max(begin, min(available_lsn, begin + MAX_SEND_SIZE)))
        return begin, end

    def sent(self, i: int, end_lsn: Lsn) -> None:
        slot = self._expect(i, Phase.ACTIVE, "AppendRequest")
        assert slot.streaming_at is not None
        if end_lsn < slot.streaming_at:
            raise LocalProtocolError(f"safekeeper {i}: sent position moved back")
        slot.streaming_at = end_lsn

    def on_append_response(self, i: int, msg: AppendResponse) -> bool:
        """Record an acknowledgement; True when ``commit_lsn`` advanced."""
        slot = self._expect_received(i, Phase.ACTIVE, "AppendResponse")
        if msg.term > self.term:
            raise ProposerRejected(
                f"safekeeper {i} moved to term {msg.term} while we stream in {self.term}",
                seen_term=msg.term,
            )
        # Both are the peer's fault (RemoteProtocolError: the caller drops that one connection).
        # A flush beyond what it was sent would count WAL it does not hold towards commit_lsn,
        # releasing commits that are not on a quorum of disks.
        if msg.term < self.term:
            raise RemoteProtocolError(f"safekeeper {i} acknowledged in old term {msg.term}")
        assert slot.streaming_at is not None
        if msg.flush_lsn > slot.streaming_at:
            raise RemoteProtocolError(
                f"safekeeper {i} acknowledged flush up to {format_lsn(msg.flush_lsn)}, beyond the "
                f"WAL sent to it (up to {format_lsn(slot.streaming_at)})"
            )
        if msg.flush_lsn > slot.acked_flush_lsn:
            slot.acked_flush_lsn = msg.flush_lsn
        lowest = Lsn(min(s.acked_flush_lsn for s in self.slots))
        if lowest > self.truncate_lsn:
            self.truncate_lsn = lowest
        # Raft's rule (Neon's walproposer too): an acknowledgement below our epoch start is of
        # older terms' WAL we are re-replicating; counting it could commit WAL that a later
        # donor of another term overwrites. Only a quorum at or past the epoch start commits.
        assert self.election is not None
        epoch_start = self.election.epoch_start_lsn
        new_commit = quorum_lsn(
            [f if f >= epoch_start else INVALID_LSN for f in (s.acked_flush_lsn for s in self.slots)],
            self.quorum,
        )
        if new_commit > self.commit_lsn:
            self.commit_lsn = new_commit
            return True
        return False

    def min_needed_lsn(self) -> Lsn | None:
        """Lowest LSN an active safekeeper still has to receive (None if none is active)."""
        positions = [
            s.streaming_at for s in self.slots if s.phase is Phase.ACTIVE and s.streaming_at
        ]
        return Lsn(min(positions)) if positions else None

    def _expect(self, i: int, phase: Phase, what: str) -> SafekeeperSlot:
        """For what we do ourselves: a wrong phase is our bug."""
        slot = self.slots[i]
        if slot.phase is not phase:
            raise LocalProtocolError(f"{what} for safekeeper {i} in phase {slot.phase.value}")
        return slot

    def _expect_received(self, i: int, phase: Phase, what: str) -> SafekeeperSlot:
        """For a message safekeeper ``i`` sent: on an open connection, one that does not fit the
        conversation is the safekeeper's fault (the caller drops that connection); with no
        connection at all, feeding it to us is our bug."""
        slot = self.slots[i]
        if slot.phase is Phase.OFFLINE:
            raise LocalProtocolError(f"{what} for safekeeper {i} that is not connected")
        if slot.phase is not phase:
            raise RemoteProtocolError(
                f"safekeeper {i} sent {what} in phase {slot.phase.value}, expected {phase.value}"
            )
        return slot
