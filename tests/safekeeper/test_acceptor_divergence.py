"""The election's truncation point against an independent oracle.

Term histories are generated the way a cluster makes them: every term's proposer took some
earlier term's log up to some point and started its own term there (so a term has exactly
one history). For an acceptor holding one such log (cut at its flush_lsn) and a proposer of a
higher term holding another, the truncation point must be the first LSN where the two logs'
terms differ (or the acceptor's end): positions, not list indexes, so the oracle shares no
code or structure with ``highest_common_point``.
"""

from __future__ import annotations

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from protocol.safekeeper import ProposerElected, TermSwitchEntry
from safekeeper.acceptor import Acceptor, AcceptorError, TruncateWal
from safekeeper.control_file import PersistentState

TENANT = TenantId(bytes(range(16)))
TIMELINE = TimelineId(bytes(range(16, 32)))
START = 0x1000028

History = tuple[TermSwitchEntry, ...]


@st.composite
def cluster(draw: st.DrawFn) -> list[tuple[History, int]]:
    """(history, end of that term's log) for terms 1..n."""
    logs: list[tuple[History, int]] = [((TermSwitchEntry(1, Lsn(START)),), START + 8 * draw(st.integers(0, 4)))]
    for term in range(2, draw(st.integers(2, 7)) + 1):
        parent, parent_end = logs[draw(st.integers(0, len(logs) - 1))]
        last = parent[-1].lsn
        point = last + 8 * draw(st.integers(0, (parent_end - last) // 8))
        history = (*(e for e in parent if e.lsn <= point), TermSwitchEntry(term, Lsn(point)))
        logs.append((history, point + 8 * draw(st.integers(0, 4))))
    return logs


def term_at(history: History, lsn: int) -> int:
    return max(e.term for e in history if e.lsn <= lsn)


@settings(max_examples=400, deadline=None)
@given(cluster(), st.data())
def test_truncation_is_where_the_logs_diverge(logs: list[tuple[History, int]], data: st.DataObject) -> None:
    mine, mine_end = logs[data.draw(st.integers(0, len(logs) - 1))]
    flush = mine[-1].lsn + 8 * data.draw(st.integers(0, (mine_end - mine[-1].lsn) // 8))
    prop, _ = logs[data.draw(st.integers(0, len(logs) - 1))]
    my_term, prop_term = mine[-1].term, prop[-1].term
    if prop_term <= my_term:
        return
    oracle = min(
        [e.lsn for e in (*mine, *prop) if e.lsn < flush and term_at(mine, e.lsn) != term_at(prop, e.lsn)]
        + [flush]
    )
    state = PersistentState(
        TENANT, TIMELINE, term=my_term, term_history=mine,
        timeline_start_lsn=Lsn(START), commit_lsn=Lsn(START),
    )
    for start in sorted({oracle, oracle - 8, oracle + 8, flush, prop[-1].lsn}):
        if start < START:
            continue
        acc = Acceptor(1, attrs.evolve(state), Lsn(flush))
        try:
            effects = acc.process(ProposerElected(prop_term, Lsn(start), prop))
        except AcceptorError:
            assert start != oracle, f"refused the divergence point {start:#x} (flush {flush:#x})"
            continue
        assert start == oracle, f"accepted {start:#x}, the logs diverge at {oracle:#x}"
        assert TruncateWal(Lsn(oracle)) in effects
        assert acc.flush_lsn == oracle and acc.state.term_history == prop
