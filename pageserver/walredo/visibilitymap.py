"""Visibility map pages: two bits per heap block after a standard page header.

Heap records clear VM bits without referencing the VM page (their ``*_ALL_VISIBLE_CLEARED``
flags), Heap2/VISIBLE sets them with a block reference, and a relation truncation clears the
bits past the cut. PostgreSQL never stamps the VM page LSN when it clears bits; neither does
raw-record redo here.
"""

from __future__ import annotations

from pageserver.walredo import bufpage as bp

VM_ALL_VISIBLE = 0x01
VM_ALL_FROZEN = 0x02
VM_VALID_BITS = 0x03

MAPSIZE = bp.BLCKSZ - bp.maxalign(bp.SIZE_OF_PAGE_HEADER)
HEAPBLOCKS_PER_BYTE = 4
HEAPBLOCKS_PER_PAGE = MAPSIZE * HEAPBLOCKS_PER_BYTE
_MAP_START = bp.maxalign(bp.SIZE_OF_PAGE_HEADER)


def heapblk_to_mapblock(heapblk: int) -> int:
    return heapblk // HEAPBLOCKS_PER_PAGE


def _pos(heapblk: int) -> tuple[int, int]:
    rem = heapblk % HEAPBLOCKS_PER_PAGE
    return _MAP_START + rem // HEAPBLOCKS_PER_BYTE, (heapblk % HEAPBLOCKS_PER_BYTE) * 2


def vm_set_in_page(page: bytearray, heapblk: int, flags: int) -> bool:
    """visibilitymap_set on the VM page; True when bits changed (PostgreSQL then stamps LSN)."""
    byte, shift = _pos(heapblk)
    if flags != (page[byte] >> shift) & VM_VALID_BITS:
        page[byte] |= flags << shift
        return True
    return False


def vm_clear_in_page(page: bytearray, heapblk: int, flags: int) -> bool:
    """visibilitymap_clear: True when some bit was set."""
    byte, shift = _pos(heapblk)
    mask = flags << shift
    if page[byte] & mask:
        page[byte] &= ~mask & 0xFF
        return True
    return False


def vm_get(page: bytes | bytearray, heapblk: int) -> int:
    byte, shift = _pos(heapblk)
    return (page[byte] >> shift) & VM_VALID_BITS


def vm_truncate_page(page: bytearray, trunc_byte: int, trunc_offs: int) -> None:
    """Clear the bits of heap blocks at and past the cut within the last remaining VM page."""
    pos = _MAP_START + trunc_byte
    page[pos + 1 :] = bytes(bp.BLCKSZ - pos - 1)
    # trunc_offs is a bit offset (2 x heap block % 4)
    page[pos] &= (1 << trunc_offs) - 1
