# The pageserver's ingest kernel in Cython: the compiled twin of protocol/_ingest_py.py (the
# reference: contract, argument checks and messages).
#
# Same names, signatures, results and error classes as the twin; tests/protocol/
# test_native_ingest.py runs both on the same bytes. Every offset is checked against the
# buffer's length in 64-bit arithmetic before a pointer moves (native.md 6.1). same_run's loop
# is short (the records of one WAL page), so it keeps the GIL; fused_walk's walk over a whole
# received piece runs without it and builds its Python objects (one per stretch of records of
# one block, not one per record) afterwards.
"""The pageserver's ingest kernel, compiled (see protocol/_ingest_py.py for the reference)."""

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, getenv, malloc
from libc.string cimport memcmp, memcpy, strcmp
from cpython cimport array
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.ref cimport Py_INCREF

cdef extern from "_crc32c.h":
    int ps_crc32c_choose(int force_software) nogil
    uint32_t ps_crc32c(uint32_t value, const unsigned char *p, size_t length) nogil

cdef extern from "_bytes.h":
    uint16_t ps_le16(const unsigned char *p) nogil
    uint32_t ps_le32(const unsigned char *p) nogil
    uint64_t ps_le64(const unsigned char *p) nogil

cdef extern from *:
    """
    /* setup.py defines PAGESTORE_SOURCE_HASH: the hash of this module's sources, which
       protocol._native compares with the files on disk to refuse a stale build. */
    #ifndef PAGESTORE_SOURCE_HASH
    #error "PAGESTORE_SOURCE_HASH is not defined: build with setup.py (pip install -e .)"
    #endif
    static const char *ps_source_hash = PAGESTORE_SOURCE_HASH;
    """
    const char *ps_source_hash

import array as _array_mod

from protocol._ingest_py import (
    WALK_INPUT,
    WALK_OTHER,
    WALK_REL,
    check_run_args,
    check_triples_args,
    check_walk_args,
)

__all__ = ["IMPL", "WALK_INPUT", "WALK_OTHER", "WALK_REL", "append_triples", "fused_walk", "same_run"]

IMPL = "native"
SOURCE_HASH = ps_source_hash.decode("ascii")

cdef enum:
    RECORD_HEADER = 24
    # compared per record: (xl_tot_len, xl_xid) at 0, (xl_info, xl_rmid, pad) at 16, the 22
    # layout bytes at 24; xl_prev at 8 is a chain, xl_crc at 20 is checked
    RUN_COMPARED = 46


cdef int _choose_crc() except -1:
    # as protocol/_wal_c.pyx: PAGESTORE_CRC32C_SW=1 forces the table kernel; exactly 1 or unset
    cdef const char *sw = getenv(b"PAGESTORE_CRC32C_SW")
    if sw != NULL and strcmp(sw, b"1") != 0:
        raise ImportError(
            f"PAGESTORE_CRC32C_SW={sw.decode('utf-8', 'replace')!r}: set it to 1 to force the "
            "table CRC-32C kernel, or unset it to use SSE4.2 where the CPU has it"
        )
    ps_crc32c_choose(1 if sw != NULL else 0)
    return 0


_choose_crc()


cdef inline uint32_t _record_crc(const unsigned char *r, Py_ssize_t tot_len) noexcept nogil:
    # PostgreSQL's order: the payload after the header, then the header up to xl_crc
    cdef uint32_t c = ps_crc32c(0, r + RECORD_HEADER, <size_t>(tot_len - RECORD_HEADER))
    return ps_crc32c(c, r, 20)


def same_run(buf, o, pos, tot_len, stride, k, vm_at):
    """The run of records like the one at ``o``: ``(m, raws)``.

    See protocol/_ingest_py.py ``same_run`` (the reference) for the contract."""
    cdef const uint8_t[::1] view = memoryview(buf).cast("B")
    cdef Py_ssize_t size = view.shape[0]
    check_run_args(size, o, pos, tot_len, stride, k, vm_at)
    # (checked: 0 <= o, o + k * stride + tot_len <= size, pos + k * stride < 2**64)
    cdef Py_ssize_t off = o, n = tot_len, step = stride, count = k, vm = vm_at
    cdef uint64_t lsn = pos
    cdef const unsigned char *base = &view[0]
    cdef const unsigned char *one = base + off
    cdef const unsigned char *r
    cdef Py_ssize_t m = 0
    while m < count:
        r = one + (m + 1) * step
        if (
            memcmp(r, one, 8) != 0
            or memcmp(r + 16, one + 16, 4) != 0
            or memcmp(r + 24, one + 24, RUN_COMPARED - 24) != 0
            or ps_le64(r + 8) != lsn + <uint64_t>(m * step)
            or (vm > 0 and r[vm] & 0x01)
            or _record_crc(r, n) != ps_le32(r + 20)
        ):
            break
        m += 1
    raws = PyTuple_New(m + 1)
    cdef Py_ssize_t j
    for j in range(m + 1):
        raw = PyBytes_FromStringAndSize(<const char *>(one + j * step), n)
        Py_INCREF(raw)  # PyTuple_SET_ITEM steals a reference
        PyTuple_SET_ITEM(raws, j, raw)
    return m, raws


# --- fused_walk (the contract: protocol/_ingest_py.py) -----------------------------------------

cdef enum:
    PAGE = 8192
    PAGE_MASK = 8191
    PHD_SIZE = 24
    PAGE_MAGIC = 0xD110
    XLP_FIRST_IS_CONTRECORD = 0x0001
    XLP_LONG_HEADER = 0x0002
    XLP_FIRST_IS_OVERWRITE_CONTRECORD = 0x0008
    XLP_ALL_FLAGS = 0x000F
    SIMPLE_AT = 46
    MAX_RELS = 64
    C_WALK_INPUT = 0
    C_WALK_OTHER = 1
    C_WALK_REL = 2

cdef struct Run:
    uint32_t spc, db, rel, fork, blkno
    Py_ssize_t first    # index of its first record's end in the ends array
    Py_ssize_t count
    Py_ssize_t at       # offset of its first value in out
    Py_ssize_t vlen
    int will_init
    uint32_t grown_to   # 0, or the fork's new size after the run's (single) record


cdef inline int _short_page_ok(const unsigned char *p, uint64_t pageaddr, uint32_t tli,
                               uint64_t seg_size) noexcept nogil:
    # the twin's _short_page_ok: the info bits, or -1
    cdef uint16_t info
    if pageaddr % seg_size == 0:
        return -1
    info = ps_le16(p + 2)
    if (ps_le16(p) != PAGE_MAGIC or info & ~XLP_ALL_FLAGS or info & XLP_LONG_HEADER
            or ps_le64(p + 8) != pageaddr or ps_le32(p + 4) != tli):
        return -1
    return info


cdef inline bint _clears_vm(int rmid, int info, const unsigned char *main, Py_ssize_t n) noexcept nogil:
    # the twin's _clears_vm (pageserver.walingest._may_clear_vm_main) for heap and heap2
    cdef int op = info & 0x70
    if rmid == 10:
        if op == 0x00:
            return n < 3 or (main[2] & 0x01) != 0
        if op == 0x10 or op == 0x20 or op == 0x40 or op == 0x60:
            return n < 8 or (main[7] & 0x03) != 0
        return False
    if op == 0x50:
        return n < 1 or (main[0] & 0x01) != 0
    if op == 0x60:
        return n < 8 or (main[7] & 0x01) != 0
    return False


cdef inline bint _fast_rmgr(int rmid) noexcept nogil:
    return (9 <= rmid <= 17) or rmid == 20


cdef bytes _key(uint32_t spc, uint32_t db, uint32_t rel, uint32_t fork, uint32_t blkno):
    # pageserver.storage.key's layout: >BIIIBI (section 0: relations)
    cdef unsigned char k[18]
    k[0] = 0
    k[1] = spc >> 24; k[2] = spc >> 16; k[3] = spc >> 8; k[4] = spc
    k[5] = db >> 24; k[6] = db >> 16; k[7] = db >> 8; k[8] = db
    k[9] = rel >> 24; k[10] = rel >> 16; k[11] = rel >> 8; k[12] = rel
    k[13] = fork
    k[14] = blkno >> 24; k[15] = blkno >> 16; k[16] = blkno >> 8; k[17] = blkno
    return PyBytes_FromStringAndSize(<const char *>k, 18)


cdef array.array _ENDS_TEMPLATE = _array_mod.array("Q")


def fused_walk(buf, base, pos, prev, latest_page, tli, seg_size, rels, nxt, last):
    """The fused ingest's walk over a piece of WAL: ``(pos, prev, latest_page, records, items,
    sizes, stop, stop_rel)``.

    See protocol/_ingest_py.py ``fused_walk`` (the reference) for the contract."""
    cdef const uint8_t[::1] view = memoryview(buf).cast("B")
    cdef Py_ssize_t size = view.shape[0]
    check_walk_args(size, base, pos, prev, latest_page, tli, seg_size, rels, nxt, last)
    cdef Py_ssize_t nrels = len(rels)
    cdef uint32_t rspc[MAX_RELS]
    cdef uint32_t rdb[MAX_RELS]
    cdef uint32_t rrel[MAX_RELS]
    cdef uint32_t rfork[MAX_RELS]
    cdef uint32_t rn[MAX_RELS]
    cdef Py_ssize_t i
    for i in range(nrels):
        r = rels[i]
        rspc[i], rdb[i], rrel[i], rfork[i], rn[i] = r[0], r[1], r[2], r[3], r[4]
    # (checked: base <= pos <= base + size, 0 <= prev < pos, seg_size a power of two >= 8192)
    cdef uint64_t c_base = base, c_pos = pos, c_prev = prev, c_latest = latest_page
    cdef uint32_t c_tli = tli
    cdef uint64_t c_seg = seg_size
    cdef uint64_t c_last = last
    cdef long long c_nxt = nxt
    cdef uint32_t nxt32 = <uint32_t>(c_nxt if c_nxt >= 0 else 0)
    cdef const unsigned char *data = &view[0] if size else NULL
    cdef Py_ssize_t avail = size - <Py_ssize_t>(c_pos - c_base)
    # every record is at least SIMPLE_AT bytes of WAL and its value 2 more
    cdef Py_ssize_t max_records = avail // SIMPLE_AT + 1
    cdef Py_ssize_t cap = avail + avail // 16 + 64
    cdef unsigned char *out = <unsigned char *>malloc(cap)
    cdef uint64_t *ends = <uint64_t *>malloc(max_records * sizeof(uint64_t))
    cdef Run *runs = <Run *>malloc(max_records * sizeof(Run))
    if out == NULL or ends == NULL or runs == NULL:
        free(out); free(ends); free(runs)
        raise MemoryError()
    cdef Py_ssize_t used = 0, records = 0, nruns = 0
    cdef int stop = C_WALK_INPUT
    cdef uint32_t srel[4]  # the relation a WALK_REL stop names (set at that stop only)
    cdef uint64_t at, page_at, end, nextpage, rest
    cdef Py_ssize_t o, no, page_rem
    cdef uint32_t tot_len, xid, crc, spc, db, rel, blkno, n
    cdef int info, pinfo, rmid, flags, block_id, main_id, fork, will_init, slot, grown
    cdef Py_ssize_t data_len, main_len, vlen
    cdef const unsigned char *raw
    cdef unsigned char *w
    cdef uint32_t c
    cdef Run *cur
    srel[0] = srel[1] = srel[2] = srel[3] = 0  # (gcc cannot see that it is read only after that stop)
    try:
        with nogil:
            while True:
                at = c_pos
                page_at = c_latest
                if at & PAGE_MASK == 0:
                    o = <Py_ssize_t>(at - c_base)
                    if size - o < PHD_SIZE:
                        break
                    pinfo = _short_page_ok(data + o, at, c_tli, c_seg)
                    if pinfo < 0 or pinfo & XLP_FIRST_IS_CONTRECORD:
                        stop = C_WALK_OTHER
                        break
                    page_at = at
                    at += PHD_SIZE
                o = <Py_ssize_t>(at - c_base)
                page_rem = PAGE - <Py_ssize_t>(at & PAGE_MASK)
                if size - o < 4:
                    break
                tot_len = ps_le32(data + o)
                if tot_len < SIMPLE_AT:
                    stop = C_WALK_OTHER
                    break
                w = out + used + 2  # where the raw record goes in out
                if tot_len <= page_rem:
                    if size - o < tot_len:
                        break
                    raw = data + o
                    end = (at + tot_len + 7) & ~(<uint64_t>7)
                else:
                    rest = tot_len - page_rem
                    nextpage = at + page_rem
                    no = <Py_ssize_t>(nextpage - c_base)
                    if rest > PAGE - PHD_SIZE:
                        stop = C_WALK_OTHER
                        break
                    if size - no < PHD_SIZE:
                        break
                    pinfo = _short_page_ok(data + no, nextpage, c_tli, c_seg)
                    if (pinfo < 0 or pinfo & (XLP_FIRST_IS_CONTRECORD | XLP_FIRST_IS_OVERWRITE_CONTRECORD)
                            != XLP_FIRST_IS_CONTRECORD):
                        stop = C_WALK_OTHER
                        break
                    if ps_le32(data + no + 16) != rest:
                        stop = C_WALK_OTHER
                        break
                    if size - no - PHD_SIZE < <Py_ssize_t>rest:
                        break
                    # (the record is at most two pages: within cap, as its WAL is)
                    memcpy(w, data + o, page_rem)
                    memcpy(w + page_rem, data + no + PHD_SIZE, rest)
                    raw = w
                    end = (nextpage + PHD_SIZE + rest + 7) & ~(<uint64_t>7)
                    page_at = nextpage
                xid = ps_le32(raw + 4)
                info = raw[16]
                rmid = raw[17]
                crc = ps_le32(raw + 20)
                block_id = raw[24]
                flags = raw[25]
                data_len = ps_le16(raw + 26)
                spc = ps_le32(raw + 28)
                db = ps_le32(raw + 32)
                rel = ps_le32(raw + 36)
                blkno = ps_le32(raw + 40)
                main_id = raw[44]
                main_len = raw[45]
                if (
                    ps_le64(raw + 8) != c_prev
                    or not _fast_rmgr(rmid)
                    or block_id != 0
                    or main_id != 255
                    or flags & 0x90
                    or SIMPLE_AT + data_len + main_len != tot_len
                    or (data_len != 0) != ((flags & 0x20) != 0)
                    or end <= c_last
                ):
                    stop = C_WALK_OTHER
                    break
                if rmid <= 10 and _clears_vm(rmid, info, raw + SIMPLE_AT + data_len, main_len):
                    stop = C_WALK_OTHER
                    break
                fork = flags & 0x0F
                if fork > 3:
                    stop = C_WALK_OTHER
                    break
                if xid:
                    if c_nxt < 0:
                        stop = C_WALK_OTHER
                        break
                    if xid >= 3 and nxt32 >= 3:
                        if <uint32_t>(xid - nxt32) < 0x80000000u:
                            stop = C_WALK_OTHER
                            break
                    elif xid >= nxt32:
                        stop = C_WALK_OTHER
                        break
                slot = -1
                for i in range(nrels):
                    if rrel[i] == rel and rdb[i] == db and rspc[i] == spc and rfork[i] == <uint32_t>fork:
                        slot = i
                        break
                if slot < 0:
                    stop = C_WALK_REL
                    srel[0] = spc; srel[1] = db; srel[2] = rel; srel[3] = fork
                    break
                n = rn[slot]
                grown = blkno >= n
                if grown and blkno != n:
                    stop = C_WALK_OTHER
                    break
                c = ps_crc32c(0, raw + 24, tot_len - 24)
                if ps_crc32c(c, raw, 20) != crc:
                    stop = C_WALK_OTHER
                    break
                # taken
                will_init = (flags & 0x40) != 0
                vlen = 2 + <Py_ssize_t>tot_len
                cur = &runs[nruns - 1] if nruns else NULL
                if (cur == NULL or grown or cur.grown_to or cur.blkno != blkno or cur.rel != rel
                        or cur.db != db or cur.spc != spc or cur.fork != <uint32_t>fork
                        or cur.vlen != vlen or cur.will_init != will_init):
                    cur = &runs[nruns]
                    nruns += 1
                    cur.spc = spc; cur.db = db; cur.rel = rel; cur.fork = fork; cur.blkno = blkno
                    cur.first = records
                    cur.count = 0
                    cur.at = used
                    cur.vlen = vlen
                    cur.will_init = will_init
                    cur.grown_to = 0
                out[used] = 1  # TAG_POSTGRES
                out[used + 1] = will_init
                if raw != w:
                    memcpy(w, raw, tot_len)
                used += vlen
                ends[records] = end
                records += 1
                cur.count += 1
                if grown:
                    rn[slot] = n + 1
                    cur.grown_to = n + 1
                c_prev = at
                c_pos = end
                c_latest = page_at
        # the Python objects: one run tuple per stretch, one size value per growth
        blob = PyBytes_FromStringAndSize(<const char *>out, used)
        items = []
        for i in range(nruns):
            cur = &runs[i]
            key = _key(cur.spc, cur.db, cur.rel, cur.fork, cur.blkno)
            arr = array.clone(_ENDS_TEMPLATE, cur.count, False)
            memcpy(arr.data.as_voidptr, ends + cur.first, cur.count * sizeof(uint64_t))
            items.append((key, arr, blob, cur.at, cur.vlen, cur.will_init != 0))
            if cur.grown_to:
                size_value = PyBytes_FromStringAndSize(NULL, 5)
                w = <unsigned char *>(<char *>size_value)
                w[0] = 0  # TAG_IMAGE
                w[1] = cur.grown_to; w[2] = cur.grown_to >> 8; w[3] = cur.grown_to >> 16; w[4] = cur.grown_to >> 24
                items.append((_key(cur.spc, cur.db, cur.rel, cur.fork, 0xFFFFFFFF), ends[cur.first + cur.count - 1],
                              size_value, True))
        stop_rel = (srel[0], srel[1], srel[2], srel[3]) if stop == C_WALK_REL else None
        sizes = tuple([rn[i] for i in range(nrels)])
        return c_pos, c_prev, c_latest, records, items, sizes, stop, stop_rel
    finally:
        free(out); free(ends); free(runs)


def append_triples(entries, ends, start, stop, offset, vlen, will_init):
    """The index entries of a packed run's values: see protocol/_ingest_py.py ``append_triples``."""
    check_triples_args(entries, ends, start, stop, offset, vlen)
    cdef array.array e = entries
    cdef array.array src = ends
    cdef Py_ssize_t a = start, b = stop, n0 = len(e), v
    cdef uint64_t off = offset, size = vlen
    cdef uint64_t flag = 1 if will_init else 0
    array.resize_smart(e, n0 + 3 * (b - a))
    cdef unsigned long long *dst = e.data.as_ulonglongs + n0
    cdef const unsigned long long *lsns = src.data.as_ulonglongs
    for v in range(a, b):
        dst[0] = lsns[v]
        dst[1] = ((off + <uint64_t>(v - a) * size) << 1) | flag
        dst[2] = size
        dst += 3
