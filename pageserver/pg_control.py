"""PostgreSQL 15's ``pg_control`` file (``ControlFileData``) and ``CheckPoint`` struct.

Both are x86-64 C structs, little-endian, with the C compiler's padding spelled out as ``x``
in the precompiled ``struct.Struct`` formats below (8-byte fields are 8-byte aligned).

- ``CheckPoint`` is 88 bytes. It is the main data of XLOG CHECKPOINT_SHUTDOWN/ONLINE records,
  the ``checkPointCopy`` inside pg_control, and the value of the pageserver's checkpoint key.
- ``ControlFileData`` is 296 bytes; its last field is a CRC-32C of the 288 bytes before it.
  The file on disk is 8192 bytes (``PG_CONTROL_FILE_SIZE``), zero after the struct.

``parse_control_file`` checks the length, the CRC and the version (1300 for PostgreSQL 15)
and raises ``RemoteProtocolError`` (SQLSTATE XX001) otherwise; ``encode_control_file``
recomputes the CRC and pads to 8192 bytes, so ``attrs.evolve`` a parsed control file and
encode it to write a new one (basebackup does).
"""

from __future__ import annotations

import struct
from enum import IntEnum

import attrs

from protocol.errors import RemoteProtocolError
from protocol.pgwire.sqlstate import DATA_CORRUPTED
from protocol.wal import crc as _crc

PG_CONTROL_VERSION = 1300
PG_CONTROL_FILE_SIZE = 8192
SIZEOF_CHECKPOINT = 88

# redo, ThisTimeLineID, PrevTimeLineID, fullPageWrites, nextXid (FullTransactionId), nextOid,
# nextMulti, nextMultiOffset, oldestXid, oldestXidDB, oldestMulti, oldestMultiDB, time,
# oldestCommitTsXid, newestCommitTsXid, oldestActiveXid
_CHECKPOINT = struct.Struct("<QII?7xQIIIIIII4xqIII4x")
assert _CHECKPOINT.size == SIZEOF_CHECKPOINT

_CONTROL = struct.Struct(
    "<QIIi4xqQ"  # system_identifier .. checkPoint
    f"{SIZEOF_CHECKPOINT}s"  # checkPointCopy
    "QQI4xQQ?3x"  # unloggedLSN .. backupEndRequired
    "i?3xiiiii?3x"  # wal_level .. track_commit_timestamp
    "IdIIIIIIII?3xI"  # maxAlign .. data_checksum_version
    "32s"  # mock_authentication_nonce
)
_CRC = struct.Struct("<I")
CRC_OFFSET = _CONTROL.size
SIZEOF_CONTROL_FILE_DATA = CRC_OFFSET + _CRC.size + 4  # the struct is padded to 8
assert CRC_OFFSET == 288


class DBState(IntEnum):
    STARTUP = 0
    SHUTDOWNED = 1
    SHUTDOWNED_IN_RECOVERY = 2
    SHUTDOWNING = 3
    IN_CRASH_RECOVERY = 4
    IN_ARCHIVE_RECOVERY = 5
    IN_PRODUCTION = 6


def _corrupt(what: str) -> RemoteProtocolError:
    return RemoteProtocolError(what, sqlstate=DATA_CORRUPTED)


@attrs.frozen(slots=True)
class CheckPoint:
    redo: int
    this_timeline_id: int
    prev_timeline_id: int
    full_page_writes: bool
    next_xid: int  # FullTransactionId: epoch << 32 | xid
    next_oid: int
    next_multi: int
    next_multi_offset: int
    oldest_xid: int
    oldest_xid_db: int
    oldest_multi: int
    oldest_multi_db: int
    time: int
    oldest_commit_ts_xid: int
    newest_commit_ts_xid: int
    oldest_active_xid: int

    @classmethod
    def decode(cls, buf: bytes | bytearray | memoryview) -> CheckPoint:
        if len(buf) < SIZEOF_CHECKPOINT:
            raise _corrupt(f"CheckPoint needs {SIZEOF_CHECKPOINT} bytes, got {len(buf)}")
        return cls(*_CHECKPOINT.unpack_from(buf))

    def encode(self) -> bytes:
        return _CHECKPOINT.pack(*attrs.astuple(self, recurse=False))


@attrs.frozen(slots=True)
class ControlFileData:
    system_identifier: int
    pg_control_version: int
    catalog_version_no: int
    state: int
    time: int
    checkpoint: int  # location of the latest checkpoint record
    checkpoint_copy: CheckPoint
    unlogged_lsn: int
    min_recovery_point: int
    min_recovery_point_tli: int
    backup_start_point: int
    backup_end_point: int
    backup_end_required: bool
    wal_level: int
    wal_log_hints: bool
    max_connections: int
    max_worker_processes: int
    max_wal_senders: int
    max_prepared_xacts: int
    max_locks_per_xact: int
    track_commit_timestamp: bool
    max_align: int
    float_format: float
    blcksz: int
    relseg_size: int
    xlog_blcksz: int
    xlog_seg_size: int
    name_data_len: int
    index_max_keys: int
    toast_max_chunk_size: int
    loblksize: int
    float8_by_val: bool
    data_checksum_version: int
    mock_authentication_nonce: bytes


def parse_control_file(buf: bytes | bytearray | memoryview, *, check_crc: bool = True) -> ControlFileData:
    """Decode a pg_control file (at least the 296-byte struct; the file is 8192 bytes)."""
    if len(buf) < SIZEOF_CONTROL_FILE_DATA:
        raise _corrupt(f"pg_control has {len(buf)} bytes, expected at least {SIZEOF_CONTROL_FILE_DATA}")
    mv = memoryview(buf)
    (stored,) = _CRC.unpack_from(mv, CRC_OFFSET)
    if check_crc and _crc.crc32c(mv[:CRC_OFFSET]) != stored:
        raise _corrupt("incorrect checksum in control file")
    fields = list(_CONTROL.unpack_from(mv))
    if fields[1] != PG_CONTROL_VERSION:
        raise _corrupt(
            f"pg_control version {fields[1]} is not PostgreSQL 15's {PG_CONTROL_VERSION}"
        )
    fields[6] = CheckPoint.decode(fields[6])
    return ControlFileData(*fields)


def encode_control_file(cf: ControlFileData) -> bytes:
    """The 8192-byte pg_control file for ``cf``, with a freshly computed CRC."""
    fields = list(attrs.astuple(cf, recurse=False))
    fields[6] = cf.checkpoint_copy.encode()
    body = _CONTROL.pack(*fields)
    crc = _crc.crc32c(body)
    out = body + _CRC.pack(crc)
    return out + bytes(PG_CONTROL_FILE_SIZE - len(out))
