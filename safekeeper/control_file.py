"""The safekeeper's control file: one timeline's persistent acceptor state.

Owns the on-disk format and its writes. The format is ours (not Neon's bincode). One state is
a *record*, little-endian:

    magic u32 = 0x504B5343 ("CSKP" on disk)
    version u32 = 2
    seq u64 (which write this is: 1, 2, 3, ...)
    body_len u32
    body (fixed width; see ``_FIXED``, then the term history entries, then the membership
          configuration: members, a has-new-members flag u8, new members)
    crc32c u32 over every preceding byte of the record

The file is two *slots* of ``S`` bytes each (``S`` = 4 KiB, or the power of two that holds the
record), and the record of write ``seq`` lives in slot 0 if ``seq`` is odd, slot 1 if even. A write is one ``pwrite``
of the new record into the slot that does not hold the newest one, then one ``fdatasync``: no
temporary file, no rename, no directory fsync (as PostgreSQL rewrites ``pg_control`` in
place). A crash during the write can tear only that slot; the other still holds the previous
state, whole and checksummed, and reading takes the valid record with the highest ``seq``.
So after a crash the state is the old or the new one, never a mix, and a state whose write
returned is never lost (the next write goes to the other slot). A slot damaged *after* its
write returned cannot be told from a torn write: the older record is taken then (only both
slots damaged refuses to start).

The file is made, and remade when a record outgrows its slots, the atomic way: written whole
to ``safekeeper.control.partial``, fsynced, renamed over ``safekeeper.control``, the
directory fsynced. Version 1 files (one record without ``seq``, the whole file) are read, and
their first write replaces them so. A vote or an election is answered only after the write
returns (the acceptor asks for it with a ``PersistControl`` effect).
"""

from __future__ import annotations

import contextlib
import errno
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
VERSION = 2
VERSION_1 = 1

_HEADER_V1 = struct.Struct("<III")  # magic, version 1, body_len
_HEADER = struct.Struct("<IIQI")  # magic, version, seq, body_len
_MAGIC_VERSION = struct.Struct("<II")
# A slot's size: at least this, a power of two; at most SLOT_MAX (the term history's own
# cap, MAX_HISTORY entries of 16 bytes, fits it).
SLOT_SIZE = 4096
SLOT_MAX = 1 << 25
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


def encode_body(state: PersistentState) -> bytearray:
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
    return body


def encode(state: PersistentState, seq: int = 1) -> bytes:
    """The record of write ``seq`` holding ``state``."""
    body = encode_body(state)
    out = bytearray(_HEADER.pack(MAGIC, VERSION, seq, len(body)))
    out += body
    out += _CRC.pack(crc32c.crc32c(out))
    return bytes(out)


def record_length(data: bytes | memoryview) -> int:
    """The length of the record at the start of ``data`` by its header (any version), for a
    slot whose record is followed by padding; raises ``ControlFileError`` if it cannot be
    read or does not fit."""
    if len(data) < _MAGIC_VERSION.size:
        raise ControlFileError(f"control file too short: {len(data)} bytes")
    magic, version = _MAGIC_VERSION.unpack_from(data, 0)
    if magic != MAGIC:
        raise ControlFileError(f"bad control file magic {magic:#010x}")
    header = {VERSION: _HEADER, VERSION_1: _HEADER_V1}.get(version)
    if header is None:
        raise ControlFileError(f"unsupported control file version {version}")
    if len(data) < header.size:
        raise ControlFileError(f"control file too short: {len(data)} bytes")
    body_len: int = header.unpack_from(data, 0)[-1]
    n = header.size + body_len + _CRC.size
    if n > len(data):
        raise ControlFileError(f"control file body length {body_len} runs past its end")
    return n


def decode_record(data: bytes) -> tuple[int, PersistentState]:
    """``(seq, state)`` of exactly one record (a version 1 record has seq 0)."""
    if len(data) < _HEADER_V1.size + _CRC.size:
        raise ControlFileError(f"control file too short: {len(data)} bytes")
    magic, version = _MAGIC_VERSION.unpack_from(data, 0)
    if magic != MAGIC:
        raise ControlFileError(f"bad control file magic {magic:#010x}")
    if version == VERSION:
        if len(data) < _HEADER.size + _CRC.size:
            raise ControlFileError(f"control file too short: {len(data)} bytes")
        _, _, seq, body_len = _HEADER.unpack_from(data, 0)
        start = _HEADER.size
    elif version == VERSION_1:
        _, _, body_len = _HEADER_V1.unpack_from(data, 0)
        seq, start = 0, _HEADER_V1.size
    else:
        raise ControlFileError(f"unsupported control file version {version}")
    if len(data) != start + body_len + _CRC.size:
        raise ControlFileError(f"control file length {len(data)} does not match body length {body_len}")
    end = start + body_len
    (stored_crc,) = _CRC.unpack_from(data, end)
    if crc32c.crc32c(data[:end]) != stored_crc:
        raise ControlFileError("control file CRC mismatch")
    return seq, _decode_body(data, start, end)


def decode(data: bytes) -> PersistentState:
    """The state of exactly one record."""
    return decode_record(data)[1]


def _decode_body(data: bytes, pos: int, end: int) -> PersistentState:
    if end - pos < _FIXED.size:
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
    ) = _FIXED.unpack_from(data, pos)
    pos += _FIXED.size
    if n_history > MAX_HISTORY or end - pos < n_history * _ENTRY.size:
        raise ControlFileError(f"control file term history of {n_history} entries does not fit")
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


def _slot_of(seq: int) -> int:
    """Write ``seq``'s slot: 0 for odd, 1 for even (the first record is at the start)."""
    return (seq + 1) % 2


def decode_file(data: bytes) -> tuple[int, int, PersistentState]:
    """``(seq, slot_size, state)`` of a whole control file: the valid slot with the highest
    seq (slot size 0 for a version 1 file, which is one record)."""
    if len(data) >= _MAGIC_VERSION.size and _MAGIC_VERSION.unpack_from(data, 0) == (MAGIC, VERSION_1):
        return 0, 0, decode(data)
    size = len(data) // 2
    if len(data) != 2 * size or size < SLOT_SIZE or size > SLOT_MAX or size & (size - 1):
        raise ControlFileError(f"control file of {len(data)} bytes is not two slots")
    best: tuple[int, PersistentState] | None = None
    errors = []
    for slot in range(2):
        piece = data[slot * size : (slot + 1) * size]
        try:
            seq, state = decode_record(piece[: record_length(piece)])
        except ControlFileError as exc:
            errors.append(f"slot {slot}: {exc}")
            continue
        if _slot_of(seq) != slot:
            errors.append(f"slot {slot}: holds write {seq}")
            continue
        if best is None or seq > best[0]:
            best = (seq, state)
    if best is None:
        raise ControlFileError("no valid copy of the state (" + "; ".join(errors) + ")")
    return best[0], size, best[1]


class ControlFile:
    """One timeline's control file (see the module docstring); blocking, one caller at a
    time (the timeline's lock). It remembers the newest record's ``seq`` and the slot size,
    so every write after the first one is a ``pwrite`` + ``fdatasync`` in place."""

    __slots__ = ("_seq", "_slot_size", "directory", "no_sync", "replaced", "written")

    def __init__(self, directory: Path, *, no_sync: bool = False) -> None:
        self.directory = directory
        self.no_sync = no_sync
        self._seq = 0
        self._slot_size = 0  # 0: no file of two slots yet (none, or version 1)
        self.written = 0  # writes in place
        self.replaced = 0  # whole-file writes (creation, growth, a version 1 file)

    @property
    def path(self) -> Path:
        return self.directory / CONTROL_FILE_NAME

    def read(self) -> PersistentState | None:
        """The stored state, or None when the timeline has no control file yet."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            self._seq, self._slot_size, state = decode_file(data)
        except ControlFileError as exc:
            # Which timeline: the node refuses to start, and the operator must find the file.
            raise ControlFileError(f"{self.path}: {exc}") from None
        return state

    def write(self, state: PersistentState) -> None:
        seq = self._seq + 1
        record = encode(state, seq)
        size = self._slot_size
        if size == 0 or len(record) > size:
            self._replace(record, seq)
            return
        fd = os.open(self.path, os.O_WRONLY)
        try:
            offset = _slot_of(seq) * size
            view = memoryview(record)
            while view:
                n = os.pwrite(fd, view, offset)
                if n <= 0:
                    raise OSError(errno.ENOSPC, "pwrite of the control file wrote nothing")
                view, offset = view[n:], offset + n
            if not self.no_sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        self._seq = seq
        self.written += 1

    def _replace(self, record: bytes, seq: int) -> None:
        size = SLOT_SIZE
        while size < len(record):
            size *= 2
        if size > SLOT_MAX:
            raise ControlFileError(f"control file record of {len(record)} bytes is too large")
        image = bytearray(2 * size)
        offset = _slot_of(seq) * size
        image[offset : offset + len(record)] = record
        tmp = self.directory / CONTROL_FILE_TMP
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(image)
            while view:
                view = view[os.write(fd, view) :]
            if not self.no_sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self.path)
        if not self.no_sync:
            fsync_dir(self.directory)
        self._seq, self._slot_size = seq, size
        self.replaced += 1


def write_control_file(directory: Path, state: PersistentState, no_sync: bool = False) -> None:
    """Store ``state`` as the control file in ``directory`` (reads the file first to learn
    where to write; a timeline keeps a ``ControlFile`` instead). Blocking."""
    control = ControlFile(directory, no_sync=no_sync)
    with contextlib.suppress(ControlFileError):
        control.read()  # a damaged file is replaced whole
    control.write(state)


def read_control_file(directory: Path) -> PersistentState | None:
    """The stored state, or None when the timeline has no control file yet."""
    return ControlFile(directory).read()
