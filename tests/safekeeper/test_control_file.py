"""The control file: round trips, damage is refused, writes in place survive a torn write."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import crc32c
import pytest
from hypothesis import given
from hypothesis import strategies as st

import safekeeper.control_file as cf
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from protocol.safekeeper import MembershipConfiguration, SafekeeperId, TermSwitchEntry
from safekeeper.control_file import (
    CONTROL_FILE_NAME,
    SLOT_SIZE,
    ControlFile,
    ControlFileError,
    PersistentState,
    decode,
    decode_file,
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


def _state(term: int, history: int = 0) -> PersistentState:
    return PersistentState(
        TenantId(bytes(range(16))), TimelineId(bytes(16)), term=term,
        term_history=tuple(TermSwitchEntry(t, Lsn(t << 20)) for t in range(1, history + 1)),
        commit_lsn=Lsn(term << 24),
    )


def test_a_write_after_the_first_is_one_pwrite_and_one_fdatasync_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    control = ControlFile(tmp_path)
    control.write(_state(1))  # made the atomic way
    inode = (tmp_path / CONTROL_FILE_NAME).stat().st_ino
    calls: list[str] = []

    def refuse(name: str) -> object:
        def call(*args: object, **kwargs: object) -> None:
            raise AssertionError(f"{name} on an in-place control file write")
        return call

    real_pwrite, real_fdatasync = os.pwrite, os.fdatasync

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        calls.append(f"pwrite {offset} {len(data)}")
        return real_pwrite(fd, data, offset)

    def fdatasync(fd: int) -> None:
        calls.append("fdatasync")
        real_fdatasync(fd)

    monkeypatch.setattr(os, "rename", refuse("rename"))
    monkeypatch.setattr(os, "fsync", refuse("fsync"))
    monkeypatch.setattr(cf, "fsync_dir", refuse("fsync_dir"))
    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    for term in (2, 3, 4):
        control.write(_state(term))
    monkeypatch.undo()
    size = len(encode(_state(2), 2))
    assert calls == [
        f"pwrite {SLOT_SIZE} {size}", "fdatasync", f"pwrite 0 {size}", "fdatasync",
        f"pwrite {SLOT_SIZE} {size}", "fdatasync",
    ]
    assert (tmp_path / CONTROL_FILE_NAME).stat().st_ino == inode
    assert read_control_file(tmp_path) == _state(4)
    assert ControlFile(tmp_path).read() == _state(4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONTROL_FILE_NAME]


@given(st.data())
def test_a_torn_in_place_write_reads_as_the_old_or_the_new_state(data: st.DataObject) -> None:
    # The write of state k+1 goes to the slot of state k-1; the crash leaves any prefix of
    # the new record there, followed by the slot's old bytes or by garbage (a torn sector).
    k = data.draw(st.integers(2, 5), label="writes before")
    history = data.draw(st.integers(0, 40), label="history entries")
    image = bytearray(2 * SLOT_SIZE)
    for seq in range(1, k + 1):
        rec = encode(_state(seq, history), seq)
        at = ((seq + 1) % 2) * SLOT_SIZE  # odd writes in slot 0, even ones in slot 1
        image[at : at + len(rec)] = rec
    assert decode_file(bytes(image)) == (k, SLOT_SIZE, _state(k, history))
    new = encode(_state(k + 1, history + 1), k + 1)
    cut = data.draw(st.integers(0, len(new)), label="bytes of the new record written")
    slot = (k % 2) * SLOT_SIZE  # write k + 1's
    torn = bytearray(image)
    torn[slot : slot + cut] = new[:cut]
    if data.draw(st.booleans(), label="garbage after the cut"):
        end = min(slot + SLOT_SIZE, slot + cut + data.draw(st.integers(0, 600)))
        torn[slot + cut : end] = data.draw(st.binary(min_size=end - slot - cut, max_size=end - slot - cut))
    seq, _, state = decode_file(bytes(torn))
    if cut == len(new):
        assert (seq, state) == (k + 1, _state(k + 1, history + 1))
    else:
        assert state in (_state(k, history), _state(k + 1, history + 1))
        assert seq == k or bytes(torn[slot : slot + len(new)]) == new


def test_a_record_outgrowing_its_slot_remakes_the_file_then_writes_in_place(tmp_path: Path) -> None:
    control = ControlFile(tmp_path)
    control.write(_state(1))
    assert (tmp_path / CONTROL_FILE_NAME).stat().st_size == 2 * SLOT_SIZE
    big = _state(2, history=400)  # 400 x 16 bytes of term history: more than one 4 KiB slot
    control.write(big)
    assert (tmp_path / CONTROL_FILE_NAME).stat().st_size == 4 * SLOT_SIZE
    assert control.replaced == 2
    control.write(_state(3, history=401))
    assert control.written == 1 and control.replaced == 2
    assert ControlFile(tmp_path).read() == _state(3, history=401)


def test_a_version_1_file_is_read_and_replaced_by_two_slots_at_its_first_write(tmp_path: Path) -> None:
    body = cf.encode_body(_state(7))
    old = bytearray(struct.pack("<III", cf.MAGIC, 1, len(body)) + body)
    old += struct.pack("<I", crc32c.crc32c(old))
    (tmp_path / CONTROL_FILE_NAME).write_bytes(bytes(old))
    control = ControlFile(tmp_path)
    assert control.read() == _state(7)
    control.write(_state(8))
    assert control.replaced == 1
    assert (tmp_path / CONTROL_FILE_NAME).stat().st_size == 2 * SLOT_SIZE
    control.write(_state(9))
    assert control.written == 1
    assert read_control_file(tmp_path) == _state(9)


def test_both_slots_damaged_refuses_naming_the_file(tmp_path: Path) -> None:
    control = ControlFile(tmp_path)
    control.write(_state(1))
    control.write(_state(2))
    path = tmp_path / CONTROL_FILE_NAME
    raw = bytearray(path.read_bytes())
    raw[30] ^= 1
    path.write_bytes(bytes(raw))
    assert read_control_file(tmp_path) == _state(2)  # slot 0 held write 1
    raw[SLOT_SIZE + 30] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ControlFileError, match=f"{path}.*CRC"):
        read_control_file(tmp_path)
    with pytest.raises(ControlFileError, match="not two slots"):
        decode_file(bytes(raw[:-1]))
