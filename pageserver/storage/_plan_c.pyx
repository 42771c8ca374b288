# A vectored read's planning in one persistent layer, compiled: the twin of
# pageserver/storage/_plan_py.py (the reference, which documents the behaviour). Same names,
# results and error classes (tests/pageserver/test_native_plan.py). The index search bisects
# the fences and each block's raw entries with the same midpoints as Python's bisect over the
# same bytes, so even a hostile (unsorted) index gives the twin's answer; every entry is read
# only below the block's length, which must be whole entries; LSNs, offsets and bounds are
# compared in 64-bit unsigned arithmetic with the Python ints' out-of-range cases kept apart
# (native.md 6.1).
"""Vectored-read planning in one layer, compiled (see pageserver/storage/_plan_py.py)."""

from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from libc.string cimport memcmp
from libc.stdlib cimport malloc, realloc, free
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_Check, PyBytes_FromStringAndSize
from cpython.dict cimport PyDict_GetItem, PyDict_CheckExact
from cpython.object cimport PyObject
from cpython.list cimport PyList_Append
from cpython.long cimport PyLong_CheckExact, PyLong_AsLongLongAndOverflow

cdef extern from "../../protocol/_bytes.h":
    uint32_t ps_be32(const unsigned char *p) nogil
    uint64_t ps_be64(const unsigned char *p) nogil

cdef extern from *:
    """
    #ifndef PAGESTORE_SOURCE_HASH
    #error "PAGESTORE_SOURCE_HASH is not defined: build with setup.py (pip install -e .)"
    #endif
    static const char *ps_plan_source_hash = PAGESTORE_SOURCE_HASH;
    """
    const char *ps_plan_source_hash

from collections import OrderedDict

__all__ = ["ENTRY_SIZE", "IMPL", "EntryOutsideData", "plan_cached"]

IMPL = "native"
SOURCE_HASH = ps_plan_source_hash.decode("ascii")
ENTRY_SIZE = 42

DEF C_ENTRY = 42
DEF C_KEY = 18
DEF C_PREFIX = 26


class EntryOutsideData(ValueError):
    """A planned read does not lie in the layer's data section; args: (offset, length)."""


# A Python int bound against u64 values: below (< 0), above (> 2**64 - 1), else v.
cdef struct Bound:
    bint below
    bint above
    uint64_t v


cdef Bound _bound(object x) except *:
    cdef Bound b
    cdef int overflow = 0
    cdef long long v
    if PyLong_CheckExact(x):
        # the usual bound: an int that fits in 64 bits signed, no Python comparison
        v = PyLong_AsLongLongAndOverflow(x, &overflow)
        if not overflow:
            b.below = v < 0
            b.above = False
            b.v = <uint64_t>v if v >= 0 else 0
            return b
    b.below = x < 0
    b.above = x > 0xFFFFFFFFFFFFFFFF
    b.v = 0
    if not b.below and not b.above:
        b.v = <uint64_t>x
    return b


cdef inline bint _lt(uint64_t v, Bound b) noexcept:  # v < b
    return b.above or (not b.below and v < b.v)


cdef inline bint _le(uint64_t v, Bound b) noexcept:  # v <= b
    return b.above or (not b.below and v <= b.v)


# bytes ordering (what Python compares): memcmp of the common length, then the shorter first
cdef inline int _cmp(const unsigned char *a, Py_ssize_t na, const unsigned char *b,
                     Py_ssize_t nb) noexcept:
    cdef Py_ssize_t n = na if na < nb else nb
    cdef int c = memcmp(a, b, <size_t>n) if n else 0
    if c:
        return c
    return (na > nb) - (na < nb)


cdef Py_ssize_t _fence_bisect_right(list fences, const unsigned char *x, Py_ssize_t nx) except -2:
    cdef Py_ssize_t lo = 0, hi = len(fences), mid
    cdef object f
    while lo < hi:
        mid = (lo + hi) // 2
        f = fences[mid]
        if not PyBytes_Check(f):
            raise TypeError("fences must be bytes")
        if _cmp(x, nx, <const unsigned char *>PyBytes_AS_STRING(f), PyBytes_GET_SIZE(f)) < 0:
            hi = mid
        else:
            lo = mid + 1
    return lo


cdef inline Py_ssize_t _entry_bisect_left(const unsigned char *raw, Py_ssize_t lo, Py_ssize_t hi,
                                          const unsigned char *x, Py_ssize_t nx) noexcept:
    cdef Py_ssize_t mid
    while lo < hi:
        mid = (lo + hi) // 2
        if _cmp(raw + mid * C_ENTRY, C_PREFIX, x, nx) < 0:
            lo = mid + 1
        else:
            hi = mid
    return lo


# b - a over 18-byte big-endian integers == k (0 <= k)
cdef bint _diff_is(const unsigned char *a, const unsigned char *b, uint64_t k) noexcept:
    cdef uint8_t d[C_KEY]
    cdef int i, borrow = 0, x
    for i in range(C_KEY - 1, -1, -1):
        x = <int>b[i] - <int>a[i] - borrow
        borrow = 1 if x < 0 else 0
        d[i] = <uint8_t>(x + 256 if x < 0 else x)
    if borrow:
        return False  # negative
    for i in range(C_KEY - 8):
        if d[i]:
            return False
    cdef uint64_t low = 0
    for i in range(C_KEY - 8, C_KEY):
        low = (low << 8) | d[i]
    return low == k


cdef struct Seg:
    const unsigned char *raw
    Py_ssize_t lo
    Py_ssize_t hi
    Py_ssize_t run   # which run it belongs to


cdef class _Segs:
    cdef Seg *items
    cdef Py_ssize_t n, cap

    def __cinit__(self):
        self.items = NULL
        self.n = 0
        self.cap = 0

    def __dealloc__(self):
        free(self.items)

    cdef int push(self, const unsigned char *raw, Py_ssize_t lo, Py_ssize_t hi,
                  Py_ssize_t run) except -1:
        cdef Seg *grown
        cdef Py_ssize_t cap
        if self.n == self.cap:
            cap = 16 if self.cap == 0 else self.cap * 2
            grown = <Seg *>realloc(self.items, <size_t>cap * sizeof(Seg))
            if grown == NULL:
                raise MemoryError()
            self.items, self.cap = grown, cap
        self.items[self.n].raw = raw
        self.items[self.n].lo = lo
        self.items[self.n].hi = hi
        self.items[self.n].run = run
        self.n += 1
        return 0


cdef object _cached_raw(object blocks, bint exact, object move_to_end, object file_id,
                        Py_ssize_t blkno, list held):
    """Block ``blkno``'s raw entries (bytes of whole entries) from the block mapping, touched in
    its LRU order and kept alive in ``held``; None if the mapping lacks the block."""
    cdef PyObject *found
    ident = (file_id, blkno)
    if exact:
        found = PyDict_GetItem(blocks, ident)
        block = <object>found if found != NULL else None
    else:
        block = blocks.get(ident)
    if block is None:
        return None
    if move_to_end is not None:
        move_to_end(ident)
    raw = block.raw
    if not PyBytes_Check(raw):
        raise TypeError("an index block's raw entries must be bytes")
    if PyBytes_GET_SIZE(raw) != len(block.prefixes) * C_ENTRY:
        raise ValueError("an index block's raw entries do not match its decoded entries")
    held.append(block)
    held.append(raw)
    return raw


def plan_cached(fences, n_blocks, blocks, file_id, keys, floor, cont, states, list blobs,
                list reads, reader, max_bytes, data_start, data_end):
    """Search the cached index for ``keys`` and plan their reads: see the twin."""
    if not isinstance(fences, list):
        fences = list(fences)
    cdef list fence_list = fences
    cdef Py_ssize_t nkeys = len(keys), n_fences = len(fence_list), nblk = n_blocks
    cdef Py_ssize_t i, j, r, blkno, lo, hi, n_entries, run_first
    cdef list key_list = list(keys)
    cdef object k, raw, st, pending_obj = None, got
    cdef unsigned char start[C_PREFIX]
    cdef unsigned char end[C_KEY + 9]
    cdef const unsigned char *first_p
    cdef const unsigned char *last_p
    cdef const unsigned char *p
    cdef const unsigned char *rawp
    cdef list held = []
    cdef _Segs segs = _Segs()
    cdef Py_ssize_t hits = 0, completed = 0
    cdef bint exact = PyDict_CheckExact(blocks) or type(blocks) is OrderedDict
    move_to_end = getattr(blocks, "move_to_end", None)
    for i in range(nkeys):
        k = key_list[i]
        if not PyBytes_Check(k) or PyBytes_GET_SIZE(k) != C_KEY:
            raise ValueError("keys must be 18-byte bytes")
    # the runs of consecutive keys: (first index, last index) pairs
    cdef list runs = []
    if nkeys == 1:
        runs.append((0, 0))
    elif nkeys > 1:
        if _diff_is(<const unsigned char *>PyBytes_AS_STRING(key_list[0]),
                    <const unsigned char *>PyBytes_AS_STRING(key_list[nkeys - 1]),
                    <uint64_t>(nkeys - 1)):
            runs.append((0, nkeys - 1))
        else:
            run_first = 0
            for i in range(1, nkeys):
                if not _diff_is(<const unsigned char *>PyBytes_AS_STRING(key_list[i - 1]),
                                <const unsigned char *>PyBytes_AS_STRING(key_list[i]), 1):
                    runs.append((run_first, i - 1))
                    run_first = i
            runs.append((run_first, nkeys - 1))
    # 1. search
    cdef Py_ssize_t last_blk = -1
    cdef object last_raw = None
    for r in range(len(runs)):
        i, j = runs[r]
        first_p = <const unsigned char *>PyBytes_AS_STRING(key_list[i])
        last_p = <const unsigned char *>PyBytes_AS_STRING(key_list[j])
        for i in range(C_KEY):
            start[i] = first_p[i]
            end[i] = last_p[i]
        for i in range(C_KEY, C_PREFIX):
            start[i] = 0
        for i in range(C_KEY, C_KEY + 9):
            end[i] = 0xFF
        blkno = _fence_bisect_right(fence_list, start, C_PREFIX) - 1
        if blkno < 0:
            blkno = 0
        if blkno != last_blk:
            raw = _cached_raw(blocks, exact, move_to_end, file_id, blkno, held)
            if raw is None:
                return None
            last_blk, last_raw = blkno, raw
        else:
            # the block the previous lookup touched: the twin's second lookup finds the same
            # block and leaves the LRU order as it is
            raw = last_raw
        hits += 1
        rawp = <const unsigned char *>PyBytes_AS_STRING(raw)
        n_entries = PyBytes_GET_SIZE(raw) // C_ENTRY
        lo = _entry_bisect_left(rawp, 0, n_entries, start, C_PREFIX)
        hi = _entry_bisect_left(rawp, lo, n_entries, end, C_KEY + 9)
        if hi > lo:
            segs.push(rawp, lo, hi, r)
        while hi == n_entries and blkno + 1 < nblk:
            if blkno + 1 >= n_fences:
                raise IndexError("list index out of range")
            f = fence_list[blkno + 1]
            if not PyBytes_Check(f):
                raise TypeError("fences must be bytes")
            if _cmp(<const unsigned char *>PyBytes_AS_STRING(f), PyBytes_GET_SIZE(f), end, C_KEY + 9) >= 0:
                break
            blkno += 1
            raw = _cached_raw(blocks, exact, move_to_end, file_id, blkno, held)
            if raw is None:
                return None
            last_blk, last_raw = blkno, raw
            hits += 1
            rawp = <const unsigned char *>PyBytes_AS_STRING(raw)
            n_entries = PyBytes_GET_SIZE(raw) // C_ENTRY
            hi = _entry_bisect_left(rawp, 0, n_entries, end, C_KEY + 9)
            if hi:
                segs.push(rawp, 0, hi, r)
    # 2. plan, backwards (segments were pushed in run order, blocks in order within a run)
    cdef Bound b_floor = _bound(floor), b_cont = _bound(cont), b_cached
    cdef Bound b_start = _bound(data_start), b_end = _bound(data_end)
    cdef bint max_neg = max_bytes < 0
    cdef uint64_t max_b = 0 if max_neg else (<uint64_t>max_bytes if max_bytes <= 0xFFFFFFFFFFFFFFFF
                                             else 0xFFFFFFFFFFFFFFFF)
    cdef Py_ssize_t slot = len(blobs), rd_slot
    cdef bint have_read = False, done = True
    cdef uint64_t rd_start = 0, rd_end = 0, lsn, pos, off, length
    cdef uint32_t crc
    cdef const unsigned char *cur = NULL
    cdef Py_ssize_t s, cur_run = -1, k_lo = 0, k_at = -1
    cdef int c
    rd_slot = slot
    for s in range(segs.n - 1, -1, -1):
        if segs.items[s].run != cur_run:
            cur_run = segs.items[s].run  # a new run: ``cur`` and ``done`` start over
            cur = NULL
            done = True
            b_cached = _bound(-1)
            st = None
            k_lo, k_at = runs[cur_run]
        rawp = segs.items[s].raw
        for i in range(segs.items[s].hi - 1, segs.items[s].lo - 1, -1):
            p = rawp + i * C_ENTRY
            if cur == NULL or memcmp(p, cur, C_KEY) != 0:
                cur = p
                # The entry's key is one of the run's keys (the search bounded it by them):
                # look the state up by that object (its hash is cached) rather than a new
                # bytes. Entries come backwards, so the run's keys are passed over backwards;
                # a key not among them (a hostile, unsorted index) takes a new bytes, as the
                # twin's lookup would.
                k = None
                while k_at >= k_lo:
                    c = memcmp(PyBytes_AS_STRING(key_list[k_at]), p, C_KEY)
                    if c > 0:
                        k_at -= 1
                        continue
                    if c == 0:
                        k = key_list[k_at]
                    break
                if k is None:
                    k = PyBytes_FromStringAndSize(<const char *>p, C_KEY)
                st = states[k]
                done = bool(st.complete)
                b_cached = _bound(st.cached_lsn)
                got = st.pending
                if got is None:
                    raise AssertionError("blob planned for a non-deferring key")
                pending_obj = got
            if done:
                continue
            lsn = ps_be64(p + C_KEY)
            if not _lt(lsn, b_cont):  # lsn >= cont
                continue
            if _lt(lsn, b_floor) or _le(lsn, b_cached):  # lsn < floor or lsn <= cached
                done = True  # and so are the key's older entries
                continue
            pos = ps_be64(p + C_PREFIX)
            off = pos >> 1
            length = ps_be32(p + C_PREFIX + 8)
            crc = ps_be32(p + C_PREFIX + 12)
            # a new read unless the blob ends where the one being grown starts and fits in it
            # (rd_end - off is only taken then: off <= rd_start <= rd_end, no wrap)
            if not have_read or off + length != rd_start or max_neg or rd_end - off > max_b:
                if have_read:
                    _check(rd_start, rd_end - rd_start, b_start, b_end)
                    PyList_Append(reads, (reader, rd_start, rd_end - rd_start, rd_slot, slot - rd_slot))
                rd_end = off + length
                rd_slot = slot
            have_read = True
            rd_start = off
            PyList_Append(blobs, (off, length, crc))
            PyList_Append(pending_obj, (lsn, slot))
            slot += 1
            if pos & 1:
                st.complete = True
                done = True
                completed += 1
    if have_read:
        _check(rd_start, rd_end - rd_start, b_start, b_end)
        PyList_Append(reads, (reader, rd_start, rd_end - rd_start, rd_slot, slot - rd_slot))
    return hits, completed


cdef int _check(uint64_t offset, uint64_t length, Bound data_start, Bound data_end) except -1:
    # offset < data_start or offset + length > data_end
    if _lt(offset, data_start) or not _le(offset + length, data_end):
        raise EntryOutsideData(offset, length)
    return 0
