"""The control file: round trips, damage is refused, the write is atomic."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from protocol.safekeeper import MembershipConfiguration, SafekeeperId, TermSwitchEntry
from safekeeper.control_file import (
    CONTROL_FILE_NAME,
    ControlFileError,
    PersistentState,
    decode,
    encode,
    read_control_file,
    write_control_file,
)

u64 = st.integers(0, 2**64 - 1)
lsns = u64.map(Lsn)
members = st.lists(
    st.builds(SafekeeperId, u64, st.text(max_size=20), st.integers(0, 65535)), max_size=3
).map(tuple)
states = st.builds(
    PersistentState,
    tenant_id=st.binary(min_size=16, max_size=16).map(TenantId),
    timeline_id=st.binary(min_size=16, max_size=16).map(TimelineId),
    mconf=st.builds(
        MembershipConfiguration, st.integers(0, 2**32 - 1), members, st.none() | members
    ),
    term=u64,
    term_history=st.lists(st.builds(TermSwitchEntry, u64, lsns), max_size=5).map(tuple),
    pg_version=st.integers(0, 2**32 - 1),
    system_id=u64,
    wal_seg_size=st.integers(0, 2**32 - 1),
    timeline_start_lsn=lsns,
    local_start_lsn=lsns,
    commit_lsn=lsns,
    backup_lsn=lsns,
    peer_horizon_lsn=lsns,
    remote_consistent_lsn=lsns,
)


@given(states)
def test_round_trip(state: PersistentState) -> None:
    assert decode(encode(state)) == state


@given(states, st.data())
def test_any_damage_is_refused(state: PersistentState, data: st.DataObject) -> None:
    raw = bytearray(encode(state))
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(ControlFileError):
        decode(bytes(raw))
    with pytest.raises(ControlFileError):
        decode(bytes(raw[: data.draw(st.integers(0, len(raw) - 1))]))


def test_atomic_write_and_read(tmp_path: Path) -> None:
    assert read_control_file(tmp_path) is None
    first = PersistentState(TenantId(bytes(16)), TimelineId(bytes(16)), term=1)
    write_control_file(tmp_path, first)
    second = PersistentState(TenantId(bytes(16)), TimelineId(bytes(16)), term=2)
    write_control_file(tmp_path, second)
    assert read_control_file(tmp_path) == second
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONTROL_FILE_NAME]
