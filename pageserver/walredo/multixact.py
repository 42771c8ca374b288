"""MultiXact SLRU pages: ``pg_multixact/offsets`` (u32 per multixact) and ``members``.

A members page is an array of 409 groups of 20 bytes: 4 status bytes (one per member), then
4 xids. Raw MultiXact/CREATE_ID records and pagestore's ``MultixactOffsetCreate`` /
``MultixactMembersCreate`` values both end up in ``set_offset`` / ``set_members``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from pageserver.walredo.bufpage import BLCKSZ
from pageserver.walredo.errors import RedoError

MULTIXACT_OFFSETS_PER_PAGE = BLCKSZ // 4
MXACT_MEMBER_BITS_PER_XACT = 8
MULTIXACT_FLAGBYTES_PER_GROUP = 4
MULTIXACT_MEMBERS_PER_MEMBERGROUP = 4
MULTIXACT_MEMBERGROUP_SIZE = 4 * MULTIXACT_MEMBERS_PER_MEMBERGROUP + MULTIXACT_FLAGBYTES_PER_GROUP
MULTIXACT_MEMBERGROUPS_PER_PAGE = BLCKSZ // MULTIXACT_MEMBERGROUP_SIZE
MULTIXACT_MEMBERS_PER_PAGE = MULTIXACT_MEMBERGROUPS_PER_PAGE * MULTIXACT_MEMBERS_PER_MEMBERGROUP

_U32 = struct.Struct("<I")
_CREATE = struct.Struct("<IIi")  # mid, moff, nmembers
_MEMBER = struct.Struct("<Ii")  # xid, status


def offsets_page_of(mid: int) -> int:
    return mid // MULTIXACT_OFFSETS_PER_PAGE


def members_page_of(moff: int) -> int:
    return moff // MULTIXACT_MEMBERS_PER_PAGE


def set_offset(page: bytearray, pageno: int, mid: int, moff: int) -> None:
    if mid // MULTIXACT_OFFSETS_PER_PAGE == pageno:
        _U32.pack_into(page, (mid % MULTIXACT_OFFSETS_PER_PAGE) * 4, moff)


def next_multi_offset(mid: int, moff: int, nmembers: int) -> tuple[int, int]:
    """(next multixact, its starting offset): PostgreSQL 15 since 15.15 (RecordNewMultiXact)
    also writes the next multixact's offset when it creates one, on its page (the next one when
    ``mid`` is last on its page), skipping 0 for both as GetNewMultiXactId does."""
    nxt = (mid + 1) & 0xFFFF_FFFF
    noff = (moff + nmembers) & 0xFFFF_FFFF
    return (nxt or 1), (noff or 1)


def set_members(page: bytearray, pageno: int, moff: int, members: Sequence[tuple[int, int]]) -> None:
    """Write (xid, status) members starting at member offset ``moff``, where they fall on this page."""
    for i, (xid, status) in enumerate(members):
        off = (moff + i) & 0xFFFF_FFFF
        if off // MULTIXACT_MEMBERS_PER_PAGE != pageno:
            continue
        group = (off // MULTIXACT_MEMBERS_PER_MEMBERGROUP) % MULTIXACT_MEMBERGROUPS_PER_PAGE
        flagsoff = group * MULTIXACT_MEMBERGROUP_SIZE
        idx = off % MULTIXACT_MEMBERS_PER_MEMBERGROUP
        bshift = idx * MXACT_MEMBER_BITS_PER_XACT
        (flags,) = _U32.unpack_from(page, flagsoff)
        flags &= ~(((1 << MXACT_MEMBER_BITS_PER_XACT) - 1) << bshift)
        flags |= status << bshift
        _U32.pack_into(page, flagsoff, flags & 0xFFFF_FFFF)
        _U32.pack_into(page, flagsoff + MULTIXACT_FLAGBYTES_PER_GROUP + idx * 4, xid)


def parse_create(main: bytes, lsn: int) -> tuple[int, int, list[tuple[int, int]]]:
    """xl_multixact_create: (mid, moff, [(xid, status)])."""
    if len(main) < _CREATE.size:
        raise RedoError("truncated MultiXact CREATE_ID record", lsn=lsn, rmgr="MultiXact")
    mid, moff, n = _CREATE.unpack_from(main)
    if n < 0 or len(main) < _CREATE.size + n * _MEMBER.size:
        raise RedoError("MultiXact CREATE_ID members run past the record", lsn=lsn, rmgr="MultiXact")
    members = [_MEMBER.unpack_from(main, _CREATE.size + i * _MEMBER.size) for i in range(n)]
    return mid, moff, [(int(x), int(s)) for x, s in members]
