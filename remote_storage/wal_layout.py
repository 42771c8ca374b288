"""Where the safekeepers' WAL backup lives in remote storage, shared by writer and readers.

One object per closed WAL segment, in PostgreSQL's segment format (the bytes of the segment
file, 16 MiB), under

    wal/<tenant hex>/<timeline hex>/<24-hex segment file name>      (timeline ID 1)

The ``wal/`` tree sits beside the pageserver's ``tenants/`` tree in the same store (a bucket and
prefix, or a directory), so one ``remote_storage`` table serves the whole cluster. Names carry
no generation or safekeeper id: a closed segment below ``commit_lsn`` has the same bytes on
every safekeeper, so two uploaders of one segment write the same object (harmless), and a
reader lists ``wal/<tenant>/<timeline>/`` or asks for the segment it needs by name.
"""

from __future__ import annotations

from protocol.ids import TenantId, TimelineId
from protocol.lsn import WAL_SEGMENT_SIZE, parse_segment_file_name, segment_file_name

WAL_ROOT = "wal"


def wal_tenant_prefix(tenant_id: TenantId) -> str:
    """The prefix (ending in ``/``) of every timeline's backup of a tenant."""
    return f"{WAL_ROOT}/{tenant_id.hex}/"


def wal_timeline_prefix(tenant_id: TenantId, timeline_id: TimelineId) -> str:
    """The prefix (ending in ``/``) under which a timeline's backed-up segments live."""
    return f"{WAL_ROOT}/{tenant_id.hex}/{timeline_id.hex}/"


def wal_segment_key(
    tenant_id: TenantId, timeline_id: TimelineId, segno: int, seg_size: int = WAL_SEGMENT_SIZE
) -> str:
    return wal_timeline_prefix(tenant_id, timeline_id) + segment_file_name(segno, segment_size=seg_size)


def parse_wal_segment_key(prefix: str, key: str, seg_size: int = WAL_SEGMENT_SIZE) -> int:
    """The segment number of a key listed under ``prefix``; ``ValueError`` for anything else
    (a foreign object, a partial upload's temp name, another timeline ID)."""
    if not key.startswith(prefix):
        raise ValueError(f"{key!r} is not under {prefix!r}")
    name = key[len(prefix):]
    if name.endswith(".partial"):
        raise ValueError(f"{key!r} is a partial segment, not a backed-up one")
    tli, segno = parse_segment_file_name(name, seg_size)
    if tli != 1:
        raise ValueError(f"{key!r} is of timeline ID {tli}, only 1 is backed up")
    return segno
