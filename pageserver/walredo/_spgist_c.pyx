# SP-GiST's bulk tuple moves on one page, compiled: the twin of pageserver/walredo/_spgist_py.py
# (the reference, which documents the behaviour). Same names, results and error classes
# (tests/pageserver/test_native_spgist.py). Each call parses a record's leaf tuples or offsets
# and edits the 8 KiB page without the GIL; every length and offset read from the record or
# the page is checked in 64-bit arithmetic before a pointer moves (native.md 6.1), so nothing
# is read or written outside the record or the page. The page primitives (PageAddItem in
# shuffle mode, PageIndexTupleDelete, PageIndexMultiDelete with its compaction, the one-pass
# placeholder replacement) are the shared ones of _bufpage.h; what is SP-GiST's stays here.
"""SP-GiST's bulk tuple moves on one page, compiled (see pageserver/walredo/_spgist_py.py)."""

from libc.stdint cimport uint16_t, uint32_t, int64_t
from libc.string cimport memcpy
from libc.stdlib cimport calloc, malloc, free, qsort

from pageserver.walredo._bufpage cimport (
    PS_PAGE_BAD_LENGTHS,
    PS_PAGE_BAD_OFFSET,
    PS_PAGE_BAD_OFFSETS,
    PS_PAGE_BAD_POINTERS,
    PS_PAGE_CORRUPT_ITEM,
    ps_le16,
    ps_le32,
    ps_maxalign,
    ps_page_add_item_shuffle,
    ps_page_check_pointers,
    ps_page_fault,
    ps_page_index_multi_delete,
    ps_page_index_tuple_replace,
    ps_page_max_offset,
    ps_put_le16,
    ps_put_le32,
)

cdef extern from *:
    """
    #ifndef PAGESTORE_SOURCE_HASH
    #error "PAGESTORE_SOURCE_HASH is not defined: build with setup.py (pip install -e .)"
    #endif
    static const char *ps_spgist_source_hash = PAGESTORE_SOURCE_HASH;
    static int ps_cmp_u16(const void *a, const void *b)
    {
        return (int)*(const unsigned short *)a - (int)*(const unsigned short *)b;
    }
    """
    const char *ps_spgist_source_hash
    int ps_cmp_u16(const void *a, const void *b) noexcept nogil

from pageserver.walredo.bufpage import PageError

__all__ = ["IMPL", "multi_delete", "place_leaves", "skip_leaves"]

IMPL = "native"
SOURCE_HASH = ps_spgist_source_hash.decode("ascii")

cdef enum:
    BLCKSZ = 8192
    HDR = 24           # SizeOfPageHeaderData
    LEAF_HDR = 16      # SGLTHDRSZ
    SGDTSIZE = 16
    OPAQUE_POS = 8184  # BLCKSZ - MAXALIGN(sizeof(SpGistPageOpaqueData))

cdef enum:
    OK = 0
    E_TRUNC_HDR     # leaf i, pos
    E_SMALL         # leaf i, size
    E_NOFIT         # leaf i, size, pos
    E_POINTERS      # lower, upper, special
    E_LP_CORRUPT    # off, pos, length (SP-GiST's own check of a tuple it reads)
    E_NOT_PLACEHOLDER  # off
    E_SPECIAL       # special
    E_COUNT         # which (1 redirection, 2 placeholder), value
    E_FAIL_ADD      # size, off
    E_CORRUPT_LP    # offset, size (the PageIndex* check)
    E_INVALID_OFFNUM  # off
    E_INCORRECT
    E_LENGTHS       # total, available
    E_LP_PAST       # off
    E_FAIL_RUN      # count, first offset
    E_FAIL_REPLACE
    E_NOMEM


cdef struct Err:
    int code
    int64_t a
    int64_t b
    int64_t c


cdef unsigned char _EMPTY[1]


cdef inline int fail(Err *e, int code, int64_t a, int64_t b, int64_t c) noexcept nogil:
    e.code = code
    e.a = a
    e.b = b
    e.c = c
    return code


cdef int page_fail(int rc, const ps_page_fault *f, Err *e, int no_room, int64_t a, int64_t b) noexcept nogil:
    """A _bufpage.h primitive's failure as this kernel's error; ``no_room`` (with ``a``, ``b``)
    is what "does not fit" means to the caller."""
    if rc == PS_PAGE_BAD_POINTERS:
        return fail(e, E_POINTERS, f.a, f.b, f.c)
    if rc == PS_PAGE_BAD_OFFSET:
        return fail(e, E_INVALID_OFFNUM, f.a, 0, 0)
    if rc == PS_PAGE_CORRUPT_ITEM:
        return fail(e, E_CORRUPT_LP, f.a, f.b, 0)
    if rc == PS_PAGE_BAD_OFFSETS:
        return fail(e, E_INCORRECT, 0, 0, 0)
    if rc == PS_PAGE_BAD_LENGTHS:
        return fail(e, E_LENGTHS, f.a, f.b, 0)
    return fail(e, no_room, a, b, 0)


cdef int add_counter(unsigned char *page, int field, int64_t delta, Err *e) noexcept nogil:
    cdef int64_t special = ps_le16(page + 16)
    if special != OPAQUE_POS:
        return fail(e, E_SPECIAL, special, 0, 0)
    cdef int64_t v = <int64_t>ps_le16(page + OPAQUE_POS + 2 * field) + delta
    if v < 0 or v > 0xFFFF:
        return fail(e, E_COUNT, field, v, 0)
    ps_put_le16(page + OPAQUE_POS + 2 * field, <uint16_t>v)
    return OK


cdef int add_item(unsigned char *page, const unsigned char *tup, int64_t size, int64_t off, Err *e) noexcept nogil:
    """PageAddItem(tup, off) in shuffle mode, off in 1 .. maxoff + 1 (_spgist_py._add_at)."""
    cdef ps_page_fault f
    cdef int rc = ps_page_add_item_shuffle(page, tup, size, off, &f)
    if rc == PS_PAGE_BAD_OFFSET:
        return fail(e, E_FAIL_ADD, size, off, 0)
    return page_fail(rc, &f, e, E_FAIL_ADD, size, off) if rc else OK


cdef int check_placeholder(const unsigned char *page, int64_t off, Err *e) noexcept nogil:
    """The tuple at ``off`` (1 .. maxoff) is a PLACEHOLDER, its line pointer inside the page
    (_spgist_py._item_pos)."""
    if HDR + 4 * off > BLCKSZ:
        return fail(e, E_LP_PAST, off, 0, 0)
    cdef uint32_t raw = ps_le32(page + HDR + (off - 1) * 4)
    cdef int64_t pos = raw & 0x7FFF
    cdef int64_t length = raw >> 17
    cdef int64_t special = ps_le16(page + 16)
    if length < 8 or pos < HDR or pos + length > (special if special < BLCKSZ else BLCKSZ):
        return fail(e, E_LP_CORRUPT, off, pos, length)
    if page[pos] & 3 != 3:
        return fail(e, E_NOT_PLACEHOLDER, off, 0, 0)
    return OK


cdef int replace_placeholder(unsigned char *page, const unsigned char *tup, int64_t newlen, int64_t off,
                             Err *e) noexcept nogil:
    """The tuple at ``off`` (1 .. maxoff) must be a placeholder: nPlaceholder -= 1, then
    PageIndexTupleDelete(off) + PageAddItem(tup, off) in one pass (bufpage.page_index_tuple_replace)."""
    if check_placeholder(page, off, e):
        return e.code
    if add_counter(page, 2, -1, e):
        return e.code
    cdef ps_page_fault f
    cdef int rc = ps_page_index_tuple_replace(page, tup, newlen, off, &f)
    return page_fail(rc, &f, e, E_FAIL_ADD, newlen, off) if rc else OK


cdef int parse_leaves(const unsigned char *data, int64_t total, int64_t at, int64_t n, int64_t *end,
                      Err *e) noexcept nogil:
    cdef int64_t pos = at
    cdef int64_t i, size
    for i in range(n):
        if LEAF_HDR > total - pos:
            return fail(e, E_TRUNC_HDR, i, pos, 0)
        size = ps_le32(data + pos) >> 2
        if size < LEAF_HDR:
            return fail(e, E_SMALL, i, size, 0)
        if size > total - pos:
            return fail(e, E_NOFIT, i, size, pos)
        pos += size
    end[0] = pos
    return OK


cdef struct Leaf:
    int64_t off
    int64_t pos
    int64_t size


cdef int place(unsigned char *page, const unsigned char *data, int64_t total, int64_t offsets_at,
               int64_t select_at, int64_t at, int64_t n, bint want, Leaf *leaves, Err *e) noexcept nogil:
    """The twin's place_leaves step for step once the ``n`` tuples parsed: select, then runs of
    appends and runs of placeholder replacements (``_spgist_py._add_or_replace_many``), so that
    even a hostile page (two line pointers on one tuple) gives the twin's outcome."""
    cdef int64_t pos = at, m = 0, i, j, k, size, off
    for i in range(n):
        size = ps_le32(data + pos) >> 2
        if select_at < 0 or (data[select_at + i] != 0) == want:
            leaves[m].off = ps_le16(data + offsets_at + 2 * i)
            leaves[m].pos = pos
            leaves[m].size = size
            m += 1
        pos += size
    cdef int64_t maxoff, nxt, lower, upper, special, need
    cdef int rc
    cdef ps_page_fault f
    cdef bint dup
    cdef unsigned char *seen
    i = 0
    while i < m:
        maxoff = ps_page_max_offset(page)
        nxt = maxoff + 1
        j = i
        while j < m and leaves[j].off == nxt + (j - i):
            j += 1
        if j > i:
            # appends at maxoff + 1 (bufpage.page_append_items): all fit or none is written
            if ps_page_check_pointers(page, False, &lower, &upper, &special, &f):
                return page_fail(PS_PAGE_BAD_POINTERS, &f, e, E_FAIL_RUN, 0, 0)
            need = 4 * (j - i)
            for k in range(i, j):
                need += ps_maxalign(leaves[k].size)
            if need > upper - lower:
                return fail(e, E_FAIL_RUN, j - i, nxt, 0)
            for k in range(i, j):
                upper -= ps_maxalign(leaves[k].size)
                memcpy(page + upper, data + leaves[k].pos, <size_t>leaves[k].size)
                ps_put_le32(page + lower, <uint32_t>(upper | (1 << 15) | (leaves[k].size << 17)))
                lower += 4
            ps_put_le16(page + 12, <uint16_t>lower)
            ps_put_le16(page + 14, <uint16_t>upper)
            i = j
            continue
        while j < m and 1 <= leaves[j].off <= maxoff:
            j += 1
        if j == i:
            return add_item(page, data + leaves[i].pos, leaves[i].size, leaves[i].off, e)  # 0 or past maxoff + 1
        # a run of placeholder replacements; the same slot twice goes one by one
        dup = False
        if j - i > 1:
            seen = <unsigned char *>calloc(<size_t>(maxoff + 1), 1)
            if seen == NULL:
                return fail(e, E_NOMEM, 0, 0, 0)
            for k in range(i, j):
                if seen[leaves[k].off]:
                    dup = True
                seen[leaves[k].off] = 1
            free(seen)
        if dup:
            for k in range(i, j):
                if replace_placeholder(page, data + leaves[k].pos, leaves[k].size, leaves[k].off, e):
                    return e.code
            i = j
            continue
        for k in range(i, j):
            if check_placeholder(page, leaves[k].off, e):
                return e.code
        if add_counter(page, 2, -(j - i), e):
            return e.code
        # each replacement leaves the pointers consistent, so checking them again per tuple
        # (the primitive does) answers as the one check before the run did
        for k in range(i, j):
            rc = ps_page_index_tuple_replace(page, data + leaves[k].pos, leaves[k].size, leaves[k].off, &f)
            if rc:
                return page_fail(rc, &f, e, E_FAIL_REPLACE, 0, 0)
        i = j
    return OK


cdef int spg_multi_delete(unsigned char *page, const unsigned char *offs, int64_t n, uint16_t *sorted_offs,
                          int first_state, int rest_state, uint32_t blkno, uint32_t offnum, uint32_t xid,
                          Err *e) noexcept nogil:
    cdef int64_t i
    for i in range(n):
        sorted_offs[i] = ps_le16(offs + 2 * i)
    qsort(sorted_offs, <size_t>n, sizeof(uint16_t), ps_cmp_u16)
    cdef ps_page_fault f
    cdef int rc = ps_page_index_multi_delete(page, sorted_offs, n, &f)
    if rc:
        return page_fail(rc, &f, e, E_INCORRECT, 0, 0)
    cdef uint16_t first = ps_le16(offs)
    cdef unsigned char dead[2][SGDTSIZE]
    cdef int k, state
    for k in range(2):
        state = first_state if k == 0 else rest_state
        ps_put_le32(dead[k], <uint32_t>(state | (SGDTSIZE << 2)))
        ps_put_le16(dead[k] + 4, 0)
        if state == 1:
            ps_put_le16(dead[k] + 6, blkno >> 16)
            ps_put_le16(dead[k] + 8, blkno & 0xFFFF)
            ps_put_le16(dead[k] + 10, offnum)
            ps_put_le32(dead[k] + 12, xid)
        else:
            ps_put_le32(dead[k] + 6, 0xFFFFFFFF)
            ps_put_le16(dead[k] + 10, 0)
            ps_put_le32(dead[k] + 12, 0)
    for i in range(n):
        k = 0 if sorted_offs[i] == first else 1
        state = first_state if k == 0 else rest_state
        if add_item(page, dead[k], SGDTSIZE, sorted_offs[i], e):
            return e.code
        if state == 1:
            if add_counter(page, 1, 1, e):
                return e.code
        elif state == 3:
            if add_counter(page, 2, 1, e):
                return e.code
    return OK


cdef object _error(Err *e):
    cdef int c = e.code
    if c == E_TRUNC_HDR:
        return PageError(f"leaf tuple {e.a}: truncated header at {e.b}")
    if c == E_SMALL:
        return PageError(f"leaf tuple {e.a}: size {e.b} is below its header size")
    if c == E_NOFIT:
        return PageError(f"leaf tuple {e.a}: {e.b} bytes at {e.c} do not fit in the data")
    if c == E_POINTERS:
        return PageError(f"corrupted page pointers: lower = {e.a}, upper = {e.b}, special = {e.c}")
    if c == E_LP_CORRUPT:
        return PageError(f"line pointer {e.a} ({e.b}, {e.c}) is corrupt")
    if c == E_NOT_PLACEHOLDER:
        return PageError(f"tuple to be replaced at offset {e.a} is not a placeholder")
    if c == E_SPECIAL:
        return PageError(f"page special area at {e.a} is not an SP-GiST one")
    if c == E_COUNT:
        return PageError(f"{'redirection' if e.a == 1 else 'placeholder'} count would become {e.b}")
    if c == E_FAIL_ADD:
        return PageError(f"failed to add a tuple of size {e.a} at offset {e.b}")
    if c == E_CORRUPT_LP:
        return PageError(f"corrupted line pointer: offset = {e.a}, size = {e.b}")
    if c == E_INVALID_OFFNUM:
        return PageError(f"invalid index offnum: {e.a}")
    if c == E_INCORRECT:
        return PageError("incorrect index offsets supplied")
    if c == E_NOMEM:
        return MemoryError()
    if c == E_FAIL_RUN:
        return PageError(f"failed to add {e.a} tuples at offset {e.b}")
    if c == E_FAIL_REPLACE:
        return PageError("failed to add a tuple in place of a placeholder")
    if c == E_LP_PAST:
        return PageError(f"line pointer {e.a} is past the page")
    if c == E_LENGTHS:
        return PageError(f"corrupted item lengths: total {e.a}, available space {e.b}")
    return PageError(f"SP-GiST kernel error {c}")


cdef inline const unsigned char *_ptr(const unsigned char[::1] v) noexcept:
    return &v[0] if v.shape[0] > 0 else _EMPTY


cdef int _check_array(Py_ssize_t total, object at, object nbytes, str what) except -1:
    if at < 0 or nbytes > total - at:
        raise ValueError(f"{what} at {at} ({nbytes} bytes) is not inside the {total} bytes of data")
    return 0


def skip_leaves(data, at, n):
    cdef const unsigned char[::1] d = memoryview(data).cast("B")
    if n < 0:
        raise ValueError(f"negative tuple count {n}")
    _check_array(d.shape[0], at, 0, "the first leaf tuple")
    cdef Err e
    e.code = OK
    cdef int64_t end = 0, c_at = at, c_n = n, total = d.shape[0]
    cdef const unsigned char *p = _ptr(d)
    with nogil:
        parse_leaves(p, total, c_at, c_n, &end, &e)
    if e.code:
        raise _error(&e)
    return end


def place_leaves(page, data, offsets_at, select_at, tuples_at, n, want):
    cdef unsigned char[::1] pg = page
    if pg.shape[0] != BLCKSZ:
        raise ValueError(f"the page is {pg.shape[0]} bytes, not {BLCKSZ}")
    cdef const unsigned char[::1] d = memoryview(data).cast("B")
    if n < 0:
        raise ValueError(f"negative tuple count {n}")
    _check_array(d.shape[0], offsets_at, 2 * n, "the offsets")
    if select_at != -1:
        _check_array(d.shape[0], select_at, n, "the page selectors")
    _check_array(d.shape[0], tuples_at, 0, "the first leaf tuple")
    cdef Err e
    e.code = OK
    cdef int64_t end = tuples_at
    cdef int64_t c_off = offsets_at, c_sel = select_at, c_at = tuples_at, c_n = n, total = d.shape[0]
    cdef bint c_want = bool(want)
    cdef unsigned char *pp = &pg[0]
    cdef const unsigned char *p = _ptr(d)
    cdef Leaf small[16]
    cdef Leaf *leaves = small
    with nogil:
        parse_leaves(p, total, c_at, c_n, &end, &e)
    if e.code:
        raise _error(&e)
    # one entry per tuple: parsed, each is at least 16 bytes, so n is bounded by the data
    if c_n > 16:
        leaves = <Leaf *>malloc(<size_t>c_n * sizeof(Leaf))
        if leaves == NULL:
            raise MemoryError()
    try:
        with nogil:
            place(pp, p, total, c_off, c_sel, c_at, c_n, c_want, leaves, &e)
    finally:
        if leaves != small:
            free(leaves)
    if e.code:
        raise _error(&e)
    return end


def multi_delete(page, data, offsets_at, n, first_state, rest_state, blkno, offnum, xid):
    cdef unsigned char[::1] pg = page
    if pg.shape[0] != BLCKSZ:
        raise ValueError(f"the page is {pg.shape[0]} bytes, not {BLCKSZ}")
    cdef const unsigned char[::1] d = memoryview(data).cast("B")
    if n < 0:
        raise ValueError(f"negative offset count {n}")
    _check_array(d.shape[0], offsets_at, 2 * n, "the offsets")
    if not (0 <= first_state <= 3 and 0 <= rest_state <= 3):
        raise ValueError(f"tuple states {first_state}, {rest_state} are not 0-3")
    if not (0 <= blkno <= 0xFFFF_FFFF and 0 <= offnum <= 0xFFFF and 0 <= xid <= 0xFFFF_FFFF):
        raise ValueError(f"block {blkno}, offset {offnum} or xid {xid} is out of range")
    if n == 0:
        return None
    cdef int64_t c_n = n
    cdef uint16_t *sorted_offs = <uint16_t *>malloc(<size_t>c_n * sizeof(uint16_t))
    if sorted_offs == NULL:
        raise MemoryError()
    cdef Err e
    e.code = OK
    cdef unsigned char *pp = &pg[0]
    cdef const unsigned char *p = _ptr(d) + <int64_t>offsets_at
    cdef int c_first = first_state, c_rest = rest_state
    cdef uint32_t c_blk = blkno, c_offnum = offnum, c_xid = xid
    try:
        with nogil:
            spg_multi_delete(pp, p, c_n, sorted_offs, c_first, c_rest, c_blk, c_offnum, c_xid, &e)
    finally:
        free(sorted_offs)
    if e.code:
        raise _error(&e)
    return None
