# Heap tuple placement, compiled: the twin of pageserver/walredo/_heap_py.py (the reference,
# which documents the contract). Same names, results, page bytes and error classes and
# messages (tests/pageserver/test_native_heap.py). The page primitives are the C ones of
# _bufpage.h; every length from the record is checked against what remains of its buffer, in
# 64-bit arithmetic, before a pointer moves (native.md 6.1), and ps_page_reserve_item checks
# the page before anything is written into it.
"""Heap tuple placement on a page, compiled (see pageserver/walredo/_heap_py.py)."""

from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t
from libc.string cimport memcpy
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE

from pageserver.walredo._bufpage cimport (
    PS_BLCKSZ,
    PS_MAX_HEAP_TUPLES_PER_PAGE,
    PS_PAGE_BAD_OFFSET,
    PS_PAGE_BAD_POINTERS,
    PS_PAGE_SLOT_USED,
    PS_PAGE_TOO_MANY,
    ps_le16,
    ps_page_init,
    ps_page_reserve_item,
    ps_put_le16,
    ps_put_le32,
)

cdef extern from *:
    """
    #ifndef PAGESTORE_SOURCE_HASH
    #error "PAGESTORE_SOURCE_HASH is not defined: build with setup.py (pip install -e .)"
    #endif
    static const char *ps_heap_source_hash = PAGESTORE_SOURCE_HASH;
    """
    const char *ps_heap_source_hash

from pageserver.walredo.errors import PageError

__all__ = ["IMPL", "multi_insert", "put_tuple"]

IMPL = "native"
SOURCE_HASH = ps_heap_source_hash.decode("ascii")

cdef enum:
    SIZEOF_HEAP_TUPLE_HEADER = 23
    MI_TUPLE_SIZE = 7
    MI_HEADER_SIZE = 4


cdef object _place_error(int64_t code, unsigned char *page, int64_t offnum, int64_t size, int64_t maxoff):
    """The PageError of a failed ps_page_reserve_item, worded as the twin words it."""
    cdef int64_t lower = ps_le16(page + 12), upper = ps_le16(page + 14), special = ps_le16(page + 16)
    cdef int64_t new_lower
    if code == PS_PAGE_BAD_POINTERS:
        return PageError(f"corrupted page pointers: lower = {lower}, upper = {upper}, special = {special}")
    if code == PS_PAGE_BAD_OFFSET:
        return PageError(f"invalid offset number {offnum} for a page of {maxoff} items")
    if code == PS_PAGE_SLOT_USED:
        return PageError(f"failed to add tuple at offset {offnum}: the line pointer is in use")
    if code == PS_PAGE_TOO_MANY:
        return PageError(f"failed to add tuple at offset {offnum}: past {PS_MAX_HEAP_TUPLES_PER_PAGE} tuples")
    new_lower = lower if offnum <= maxoff else lower + 4
    return PageError(f"failed to add tuple at offset {offnum}: {size} bytes do not fit in {upper - new_lower}")


cdef inline int64_t _place(unsigned char *page, int64_t offnum, uint32_t xmin, uint32_t xmax, uint32_t blkno,
                           uint16_t infomask2, uint16_t infomask, uint8_t hoff,
                           const unsigned char *body, int64_t bodylen, int64_t *maxoff) noexcept nogil:
    """Reserve the slot and write the tuple; the PS_PAGE_* code (< 0) or the tuple's offset."""
    cdef int64_t size = SIZEOF_HEAP_TUPLE_HEADER + bodylen
    cdef int64_t off = ps_page_reserve_item(page, offnum, size, 1, maxoff)
    cdef unsigned char *t
    if off < 0:
        return off
    t = page + off
    ps_put_le32(t, xmin)
    ps_put_le32(t + 4, xmax)
    ps_put_le32(t + 8, 0)
    ps_put_le16(t + 12, <uint16_t>(blkno >> 16))
    ps_put_le16(t + 14, <uint16_t>(blkno & 0xFFFF))
    ps_put_le16(t + 16, <uint16_t>offnum)
    ps_put_le16(t + 18, infomask2)
    ps_put_le16(t + 20, infomask)
    t[22] = hoff
    if bodylen > 0:
        memcpy(t + SIZEOF_HEAP_TUPLE_HEADER, body, <size_t>bodylen)
    return off


cdef unsigned char *_page_ptr(bytearray page) except NULL:
    cdef Py_ssize_t n = PyByteArray_GET_SIZE(page)
    if n != PS_BLCKSZ:
        raise PageError(f"page is {n} bytes, not {PS_BLCKSZ}")
    return <unsigned char *>PyByteArray_AS_STRING(page)


cdef inline void _check_range(object value, int bits, str what) except *:
    if not 0 <= value < (<object>1) << bits:  # a Python int shift: 1 << 32 overflows a C int
        raise OverflowError(f"{what} {value} does not fit {bits} bits")


def put_tuple(bytearray page, object offnum, object xmin, object xmax, object blkno, object infomask2,
              object infomask, object hoff, const unsigned char[::1] body):
    """Place one heap tuple (header from the fields, then ``body``) at ``offnum``."""
    cdef unsigned char *p = _page_ptr(page)
    cdef int64_t maxoff = 0, got, n = body.shape[0]
    _check_range(offnum, 16, "offset number")
    _check_range(xmin, 32, "xmin")
    _check_range(xmax, 32, "xmax")
    _check_range(blkno, 32, "block number")
    _check_range(infomask2, 16, "t_infomask2")
    _check_range(infomask, 16, "t_infomask")
    _check_range(hoff, 8, "t_hoff")
    got = _place(p, <int64_t>offnum, <uint32_t>xmin, <uint32_t>xmax, <uint32_t>blkno, <uint16_t>infomask2,
                 <uint16_t>infomask, <uint8_t>hoff, &body[0] if n > 0 else NULL, n, &maxoff)
    if got < 0:
        raise _place_error(got, p, offnum, SIZEOF_HEAP_TUPLE_HEADER + n, maxoff)


def multi_insert(bytearray page, const unsigned char[::1] main_data, const unsigned char[::1] data,
                 object xid, object blkno, bint init):
    """Every tuple of a Heap2/MULTI_INSERT record on its heap page (see the twin). Returns the
    record's flags byte."""
    cdef unsigned char *p = _page_ptr(page)
    cdef int64_t mlen = main_data.shape[0], end = data.shape[0]
    cdef const unsigned char *m
    cdef const unsigned char *d = &data[0] if end > 0 else NULL
    cdef int64_t ntuples, i, offnum, pos = 0, datalen, maxoff = 0, got
    cdef uint32_t cxid, cblk
    cdef uint16_t im2, im
    cdef uint8_t hoff, flags
    _check_range(xid, 32, "xid")
    _check_range(blkno, 32, "block number")
    cxid = <uint32_t>xid
    cblk = <uint32_t>blkno
    if mlen < MI_HEADER_SIZE:
        raise PageError(f"heap2 multi_insert: main data has {mlen} bytes, needs {MI_HEADER_SIZE}")
    m = &main_data[0]
    flags = m[0]
    ntuples = ps_le16(m + 2)
    if init:
        ps_page_init(p, 0)
    elif mlen - MI_HEADER_SIZE < 2 * ntuples:
        raise PageError(f"heap2 multi_insert: {ntuples} offsets do not fit {mlen} bytes of main data")
    for i in range(ntuples):
        offnum = i + 1 if init else ps_le16(m + MI_HEADER_SIZE + 2 * i)
        pos = (pos + 1) & ~1
        if end - pos < MI_TUPLE_SIZE:
            raise PageError(f"heap2 multi_insert: tuple header at {pos} past {end} bytes of block data")
        datalen = ps_le16(d + pos)
        im2 = ps_le16(d + pos + 2)
        im = ps_le16(d + pos + 4)
        hoff = d[pos + 6]
        pos += MI_TUPLE_SIZE
        if end - pos < datalen:
            raise PageError(f"heap2 multi_insert: tuple of {datalen} bytes at {pos} past {end} bytes of block data")
        got = _place(p, offnum, cxid, 0, cblk, im2, im, hoff, d + pos, datalen, &maxoff)
        if got < 0:
            raise _place_error(got, p, offnum, SIZEOF_HEAP_TUPLE_HEADER + datalen, maxoff)
        pos += datalen
    if pos != end:
        raise PageError(f"heap2 multi_insert: the tuples end at {pos}, the block data at {end}")
    return flags
