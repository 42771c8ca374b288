"""What the page filesystem reads in a PostgreSQL page header to decide whether a written page
may leave the local cache (the rules in ``compute.pagefs``): pd_lsn, pd_flags, pd_special and
the btree vacuum cycle id. Offsets from PostgreSQL 15's bufpage.h and nbtree.h."""

from __future__ import annotations

import struct
from typing import Final

BLCKSZ: Final = 8192
# pd_lsn is {uint32 xlogid; uint32 xrecoff} in the machine's (little-endian) order.
_LSN = struct.Struct("<II")
_U16 = struct.Struct("<H")
PD_FLAGS_OFF: Final = 10
PD_SPECIAL_OFF: Final = 16
PD_ALL_VISIBLE: Final = 0x0004
# The first WAL segment starts at 16 MiB: a smaller pd_lsn is no WAL position (0, GiST's
# GistBuildLSN = 1, the unlogged relations' fake LSN counter from 1000).
FIRST_REAL_LSN: Final = 0x0100_0000
BTREE_SPECIAL: Final = BLCKSZ - 16  # MAXALIGN(sizeof(BTPageOpaqueData)); GiST and hash too
MAX_BT_CYCLE_ID: Final = 0xFF7F  # above: the page ids of hash (FF80), GiST (FF81), SP-GiST (FF82)
ZERO_PAGE: Final = bytes(BLCKSZ)


def page_lsn(page: bytes | memoryview) -> int:
    hi: int
    lo: int
    hi, lo = _LSN.unpack_from(page, 0)
    return (hi << 32) | lo


def is_real_lsn(lsn: int) -> bool:
    return lsn >= FIRST_REAL_LSN


def is_heap_page(page: bytes | memoryview) -> bool:
    """Heap pages have no special space (pd_special = BLCKSZ)."""
    special: int = _U16.unpack_from(page, PD_SPECIAL_OFF)[0]
    return special == BLCKSZ


def all_visible_flag(page: bytes | memoryview) -> bool:
    """PD_ALL_VISIBLE on a heap page (set by VACUUM without an LSN bump unless
    wal_log_hints = on: hazard H1)."""
    return is_heap_page(page) and bool(_U16.unpack_from(page, PD_FLAGS_OFF)[0] & PD_ALL_VISIBLE)


def btree_cycle_id(page: bytes | memoryview) -> int:
    """The vacuum cycle id of a btree page, 0 for any other page (hazard H3)."""
    if _U16.unpack_from(page, PD_SPECIAL_OFF)[0] != BTREE_SPECIAL:
        return 0
    last = _U16.unpack_from(page, BLCKSZ - 2)[0]
    return last if last <= MAX_BT_CYCLE_ID else 0


def make_page(lsn: int, *, flags: int = 0, special: int = BLCKSZ, last_u16: int | None = None,
              fill: int = 0) -> bytes:
    """A page with the given header fields (tests and benchmarks)."""
    page = bytearray([fill & 0xFF]) * BLCKSZ
    _LSN.pack_into(page, 0, lsn >> 32, lsn & 0xFFFF_FFFF)
    _U16.pack_into(page, PD_FLAGS_OFF, flags)
    _U16.pack_into(page, PD_SPECIAL_OFF, special)
    if last_u16 is not None:
        _U16.pack_into(page, BLCKSZ - 2, last_u16)
    return bytes(page)
