"""The safekeeper's control file: one timeline's persistent acceptor state.

Owns the on-disk format and the atomic write. The format is ours (not Neon's bincode):

    magic u32 LE  = 0x504B5343 ("CSKP" on disk)
    version u32 LE = 1
    body_len u32 LE
    body (little-endian, fixed width; see ``_FIXED``, then the term history entries, then the
          membership configuration: members, a has-new-members flag u8, new members)
    crc32c u32 LE over every preceding byte

A write goes to ``safekeeper.control.partial``, is fsynced, renamed over
``safekeeper.control`` and the directory is fsynced: after a crash the file is either the old
or the new state, never a mix. A vote or an election is answered only after this returns
(the acceptor asks for it with a ``PersistControl`` effect).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import attrs
import crc32c

from common.fsync import fsync_dir
from protocol.ids import TenantId, TimelineId
from protocol.lsn import INVALID_LSN, WAL_SEGMENT_SIZE, Lsn
from protocol.safekeeper import (
    EMPTY_MCONF,
    MembershipConfiguration,
    SafekeeperId,
    TermSwitchEntry,
)

CONTROL_FILE_NAME = "safekeeper.control"
CONTROL_FILE_TMP = "safekeeper.control.partial"
MAGIC = 0x504B5343
VERSION = 1

_HEADER = struct.Struct("<III")
_CRC = struct.Struct("<I")
# tenant, timeline, generation, term, pg_version, system_id, wal_seg_size,
# timeline_start_lsn, local_start_lsn, commit_lsn, backup_lsn, peer_horizon_lsn,
# remote_consistent_lsn, n_history
_FIXED = struct.Struct("<16s16sIQIQIQQQQQQI")
_ENTRY = struct.Struct("<QQ")
_COUNT = struct.Struct("<I")
_MEMBER = struct.Struct("<QHH")  # node_id, pg_port, host length; then the host bytes
_FLAG = struct.Struct("<B")
MAX_HISTORY = 1 << 20
MAX_MEMBERS = 1 << 10


class ControlFileError(Exception):
    """The control file is damaged or of an unknown format: the node refuses to start."""


@attrs.frozen
class PersistentState:
    """Everything the acceptor must not forget across a crash."""

    tenant_id: TenantId
    timeline_id: TimelineId
    mconf: MembershipConfiguration = EMPTY_MCONF
    term: int = 0
    term_history: tuple[TermSwitchEntry, ...] = ()
    pg_version: int = 0
    system_id: int = 0
    wal_seg_size: int = WAL_SEGMENT_SIZE
    timeline_start_lsn: Lsn = INVALID_LSN
    local_start_lsn: Lsn = INVALID_LSN
    commit_lsn: Lsn = INVALID_LSN
    backup_lsn: Lsn = INVALID_LSN
    peer_horizon_lsn: Lsn = INVALID_LSN
    remote_consistent_lsn: Lsn = INVALID_LSN


def encode(state: PersistentState) -> bytes:
    body = bytearray(
        _FIXED.pack(
            state.tenant_id.raw,
            state.timeline_id.raw,
            state.mconf.generation,
            state.term,
            state.pg_version,
            state.system_id,
            state.wal_seg_size,
            state.timeline_start_lsn,
            state.local_start_lsn,
            state.commit_lsn,
            state.backup_lsn,
            state.peer_horizon_lsn,
            state.remote_consistent_lsn,
            len(state.term_history),
        )
    )
    for entry in state.term_history:
        body += _ENTRY.pack(entry.term, entry.lsn)
    _encode_members(body, state.mconf.members)
    body += _FLAG.pack(state.mconf.new_members is not None)
    _encode_members(body, state.mconf.new_members or ())
    out = bytearray(_HEADER.pack(MAGIC, VERSION, len(body)))
    out += body
    out += _CRC.pack(crc32c.crc32c(out))
    return bytes(out)


def decode(data: bytes) -> PersistentState:
    if len(data) < _HEADER.size + _CRC.size:
        raise ControlFileError(f"control file too short: {len(data)} bytes")
    magic, version, body_len = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ControlFileError(f"bad control file magic {magic:#010x}")
    if version != VERSION:
        raise ControlFileError(f"unsupported control file version {version}")
    if len(data) != _HEADER.size + body_len + _CRC.size:
        raise ControlFileError(f"control file length {len(data)} does not match body length {body_len}")
    end = _HEADER.size + body_len
    (stored_crc,) = _CRC.unpack_from(data, end)
    if crc32c.crc32c(data[:end]) != stored_crc:
        raise ControlFileError("control file CRC mismatch")
    if body_len < _FIXED.size:
        raise ControlFileError("control file body too short")
    (
        tenant_id,
        timeline_id,
        generation,
        term,
        pg_version,
        system_id,
        wal_seg_size,
        timeline_start_lsn,
        local_start_lsn,
        commit_lsn,
        backup_lsn,
        peer_horizon_lsn,
        remote_consistent_lsn,
        n_history,
    ) = _FIXED.unpack_from(data, _HEADER.size)
    if n_history > MAX_HISTORY or body_len < _FIXED.size + n_history * _ENTRY.size:
        raise ControlFileError(f"control file term history of {n_history} entries does not fit")
    pos = _HEADER.size + _FIXED.size
    history = []
    for _ in range(n_history):
        h_term, h_lsn = _ENTRY.unpack_from(data, pos)
        history.append(TermSwitchEntry(h_term, Lsn(h_lsn)))
        pos += _ENTRY.size
    try:
        members, pos = _decode_members(data, pos, end)
        (has_new,) = _FLAG.unpack_from(data, pos)
        new_members, pos = _decode_members(data, pos + 1, end)
    except (struct.error, UnicodeDecodeError) as exc:
        raise ControlFileError(f"control file membership configuration: {exc}") from None
    if pos != end:
        raise ControlFileError(f"control file body has {end - pos} trailing bytes")
    return PersistentState(
        tenant_id=TenantId(tenant_id),
        timeline_id=TimelineId(timeline_id),
        mconf=MembershipConfiguration(generation, members, new_members if has_new else None),
        term=term,
        term_history=tuple(history),
        pg_version=pg_version,
        system_id=system_id,
        wal_seg_size=wal_seg_size,
        timeline_start_lsn=Lsn(timeline_start_lsn),
        local_start_lsn=Lsn(local_start_lsn),
        commit_lsn=Lsn(commit_lsn),
        backup_lsn=Lsn(backup_lsn),
        peer_horizon_lsn=Lsn(peer_horizon_lsn),
        remote_consistent_lsn=Lsn(remote_consistent_lsn),
    )


def _encode_members(body: bytearray, members: tuple[SafekeeperId, ...]) -> None:
    body += _COUNT.pack(len(members))
    for m in members:
        host = m.host.encode()
        body += _MEMBER.pack(m.node_id, m.pg_port, len(host))
        body += host


def _decode_members(data: bytes, pos: int, end: int) -> tuple[tuple[SafekeeperId, ...], int]:
    (n,) = _COUNT.unpack_from(data, pos)
    pos += _COUNT.size
    if n > MAX_MEMBERS:
        raise ControlFileError(f"control file lists {n} members")
    out = []
    for _ in range(n):
        node_id, port, host_len = _MEMBER.unpack_from(data, pos)
        pos += _MEMBER.size
        if pos + host_len > end:
            raise ControlFileError("control file member host runs past the body")
        out.append(SafekeeperId(node_id, data[pos : pos + host_len].decode(), port))
        pos += host_len
    return tuple(out), pos


def write_control_file(directory: Path, state: PersistentState, no_sync: bool = False) -> None:
    """Atomically replace the control file in ``directory`` (blocking: run it off the trio thread)."""
    data = encode(state)
    tmp = directory / CONTROL_FILE_TMP
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if not no_sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, directory / CONTROL_FILE_NAME)
    if not no_sync:
        fsync_dir(directory)


def read_control_file(directory: Path) -> PersistentState | None:
    """The stored state, or None when the timeline has no control file yet."""
    path = directory / CONTROL_FILE_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return decode(data)
    except ControlFileError as exc:
        # Which timeline: the node refuses to start, and the operator must find the file.
        raise ControlFileError(f"{path}: {exc}") from None
