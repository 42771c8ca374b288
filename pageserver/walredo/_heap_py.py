"""Heap tuple placement on a page: the pure-Python reference of the compiled ``_heap_c``.

What heap redo spends its time on after a bulk load: every heap page of a ``COPY`` (pgbench
``-i``) is one or two Heap2/MULTI_INSERT records of ~60 tuples each, and each tuple is built
from the record's ``xl_multi_insert_tuple`` header and data and placed as
``heap_xlog_multi_insert`` does (``PageAddItem`` at the record's offset, overwrite mode, heap
page). ``put_tuple`` is one tuple (Heap/INSERT, the new tuple of an UPDATE); ``multi_insert``
is a whole record's block data in one call.

The contract both implementations keep (tests/pageserver/test_native_heap.py compares them on
the same random and mutated bytes, the page after an error included):

- ``page`` is a ``bytearray`` of exactly 8192 bytes (anything else: ``TypeError`` /
  ``PageError``), edited in place; nothing is ever written outside it.
- A page whose pointers are inconsistent, an offset that is 0 or past ``maxoff + 1``, a slot
  in use, a heap page past MaxHeapTuplesPerPage, or a tuple that does not fit raise
  ``PageError`` with the same message; so do record data that end inside a tuple or do not
  add up. The tuples placed before the failing one stay placed (as in PostgreSQL, which
  PANICs there: the page is not used).
- Integers out of their field's range (xid, block number, infomasks, t_hoff) raise
  ``OverflowError``.

The header fields and the line pointer are what PostgreSQL writes: xmin, xmax, cmin 0,
t_ctid = (blkno, offnum), t_infomask2, t_infomask, t_hoff from the record, then the body;
``lp_off = new pd_upper``, ``lp_len`` the unpadded length; the MAXALIGN padding keeps what was
on the page.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Final

from pageserver.walredo.errors import PageError

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["IMPL", "multi_insert", "put_tuple"]

IMPL: Final = "python"

BLCKSZ = 8192
SIZE_OF_PAGE_HEADER = 24
MAX_HEAP_TUPLES_PER_PAGE = (BLCKSZ - SIZE_OF_PAGE_HEADER) // (24 + 4)
SIZEOF_HEAP_TUPLE_HEADER = 23
_LP_NORMAL_BITS = 1 << 15

_POINTERS = struct.Struct("<HHH")  # pd_lower, pd_upper, pd_special at offset 12
_LOWER_UPPER = struct.Struct("<HH")
_U32 = struct.Struct("<I")
# xmin, xmax, cid, ctid (bi_hi, bi_lo, posid), infomask2, infomask, hoff
_TUPLE_HEADER = struct.Struct("<IIIHHHHHB")
_MI_HEADER = struct.Struct("<BxH")  # xl_heap_multi_insert: flags, ntuples
_MI_TUPLE = struct.Struct("<HHHB")  # xl_multi_insert_tuple: datalen, infomask2, infomask, t_hoff
_PAGE_INIT = bytes(BLCKSZ)


def _check_range(value: int, bits: int, what: str) -> None:
    if not 0 <= value < 1 << bits:
        raise OverflowError(f"{what} {value} does not fit {bits} bits")


def _check_page(page: bytearray) -> None:
    if type(page) is not bytearray:
        raise TypeError(f"page must be a bytearray, not {type(page).__name__}")
    if len(page) != BLCKSZ:
        raise PageError(f"page is {len(page)} bytes, not {BLCKSZ}")


def _place(
    page: bytearray,
    offnum: int,
    xmin: int,
    xmax: int,
    blkno: int,
    infomask2: int,
    infomask: int,
    hoff: int,
    body: Buffer,
) -> None:
    """PageAddItemExtended(offnum, overwrite, heap) of the tuple built from its fields."""
    lower, upper, special = _POINTERS.unpack_from(page, 12)
    if lower < SIZE_OF_PAGE_HEADER or lower > upper or upper > special or special > BLCKSZ:
        raise PageError(f"corrupted page pointers: lower = {lower}, upper = {upper}, special = {special}")
    maxoff = (lower - SIZE_OF_PAGE_HEADER) >> 2
    if offnum < 1 or offnum > maxoff + 1:
        raise PageError(f"invalid offset number {offnum} for a page of {maxoff} items")
    lp_pos = SIZE_OF_PAGE_HEADER + 4 * (offnum - 1)
    if offnum <= maxoff:
        if _U32.unpack_from(page, lp_pos)[0] & 0xFFFF8000:  # lp_flags or lp_len set
            raise PageError(f"failed to add tuple at offset {offnum}: the line pointer is in use")
        new_lower = lower
    else:
        new_lower = lower + 4
    if offnum > MAX_HEAP_TUPLES_PER_PAGE:
        raise PageError(f"failed to add tuple at offset {offnum}: past {MAX_HEAP_TUPLES_PER_PAGE} tuples")
    mv = memoryview(body)
    size = SIZEOF_HEAP_TUPLE_HEADER + len(mv)
    new_upper = upper - ((size + 7) & ~7)
    if size > BLCKSZ or new_lower > new_upper:
        raise PageError(f"failed to add tuple at offset {offnum}: {size} bytes do not fit in {upper - new_lower}")
    _U32.pack_into(page, lp_pos, new_upper | _LP_NORMAL_BITS | (size << 17))
    _LOWER_UPPER.pack_into(page, 12, new_lower, new_upper)
    _TUPLE_HEADER.pack_into(
        page, new_upper, xmin, xmax, 0, blkno >> 16, blkno & 0xFFFF, offnum, infomask2, infomask, hoff
    )
    page[new_upper + SIZEOF_HEAP_TUPLE_HEADER : new_upper + size] = mv


def put_tuple(
    page: bytearray,
    offnum: int,
    xmin: int,
    xmax: int,
    blkno: int,
    infomask2: int,
    infomask: int,
    hoff: int,
    body: Buffer,
) -> None:
    """Place one heap tuple (header from the fields, then ``body``) at ``offnum``."""
    _check_page(page)
    _check_range(offnum, 16, "offset number")
    _check_range(xmin, 32, "xmin")
    _check_range(xmax, 32, "xmax")
    _check_range(blkno, 32, "block number")
    _check_range(infomask2, 16, "t_infomask2")
    _check_range(infomask, 16, "t_infomask")
    _check_range(hoff, 8, "t_hoff")
    _place(page, offnum, xmin, xmax, blkno, infomask2, infomask, hoff, body)


def multi_insert(page: bytearray, main_data: Buffer, data: Buffer, xid: int, blkno: int, init: bool) -> int:
    """Every tuple of a Heap2/MULTI_INSERT record on its heap page: ``main_data`` is the
    record's ``xl_heap_multi_insert`` (flags, ntuples, and the offsets unless ``init``),
    ``data`` the block's data (``xl_multi_insert_tuple`` headers, each SHORTALIGNed, and the
    tuples' bodies). With ``init`` (XLOG_HEAP_INIT_PAGE) the page is initialized first and
    the tuples go to offsets 1..ntuples. Returns the record's flags byte (the caller sets the
    page LSN and the all-visible bit from it)."""
    _check_page(page)
    _check_range(xid, 32, "xid")
    _check_range(blkno, 32, "block number")
    main = memoryview(main_data)
    if len(main) < _MI_HEADER.size:
        raise PageError(f"heap2 multi_insert: main data has {len(main)} bytes, needs {_MI_HEADER.size}")
    flags, ntuples = _MI_HEADER.unpack_from(main)
    if init:
        page[:] = _PAGE_INIT
        _POINTERS.pack_into(page, 12, SIZE_OF_PAGE_HEADER, BLCKSZ, BLCKSZ)
        page[18:20] = b"\x04\x20"  # pd_pagesize_version: 8192 | layout version 4
        offsets: range | tuple[int, ...] = range(1, ntuples + 1)
    else:
        if len(main) < _MI_HEADER.size + 2 * ntuples:
            raise PageError(f"heap2 multi_insert: {ntuples} offsets do not fit {len(main)} bytes of main data")
        offsets = struct.unpack_from(f"<{ntuples}H", main, _MI_HEADER.size)
    mv = memoryview(data)
    end = len(mv)
    pos = 0
    for offnum in offsets:
        pos = (pos + 1) & ~1
        if end - pos < _MI_TUPLE.size:
            raise PageError(f"heap2 multi_insert: tuple header at {pos} past {end} bytes of block data")
        datalen, im2, im, hoff = _MI_TUPLE.unpack_from(mv, pos)
        pos += _MI_TUPLE.size
        if end - pos < datalen:
            raise PageError(f"heap2 multi_insert: tuple of {datalen} bytes at {pos} past {end} bytes of block data")
        _place(page, offnum, xid, 0, blkno, im2, im, hoff, mv[pos : pos + datalen])
        pos += datalen
    if pos != end:
        raise PageError(f"heap2 multi_insert: the tuples end at {pos}, the block data at {end}")
    v: int = flags
    return v
