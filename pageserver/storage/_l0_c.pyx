# The L0 writer's packing of a frozen in-memory layer, compiled: the twin of
# pageserver/storage/_l0_py.py (the reference, which documents the behaviour). Same names,
# results and error messages (tests/pageserver/test_native_l0.py). Two passes without the GIL:
# the first walks the index from the cursor, checks every value it reaches and finds where
# the piece stops; then the two result objects are allocated at their exact sizes and the
# second pass copies the values and writes their entries (crc32c with the SSE4.2 kernel).
# Offsets and lengths are checked in 64-bit unsigned arithmetic before any pointer moves, and
# the Python ints are range-checked before they become C integers (native.md 6.1).
"""The L0 writer's packing, compiled (see pageserver/storage/_l0_py.py)."""

from libc.stdint cimport UINT32_MAX, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize

cdef extern from "../../protocol/_crc32c.h":
    int ps_crc32c_choose(int force_software) nogil
    uint32_t ps_crc32c(uint32_t value, const unsigned char *p, size_t length) nogil

cdef extern from "../../protocol/_bytes.h":
    void ps_put_be32(unsigned char *p, uint32_t v) nogil
    void ps_put_be64(unsigned char *p, uint64_t v) nogil

cdef extern from *:
    """
    #ifndef PAGESTORE_SOURCE_HASH
    #error "PAGESTORE_SOURCE_HASH is not defined: build with setup.py (pip install -e .)"
    #endif
    static const char *ps_l0_source_hash = PAGESTORE_SOURCE_HASH;
    """
    const char *ps_l0_source_hash

import os

__all__ = ["ENTRY_SIZE", "IMPL", "pack_values"]

IMPL = "native"
SOURCE_HASH = ps_l0_source_hash.decode("ascii")
ENTRY_SIZE = 42

_LIMIT = 1 << 62
_U64_MAX = (1 << 64) - 1

ps_crc32c_choose(1 if os.environ.get("PAGESTORE_CRC32C_SW") == "1" else 0)

DEF C_ENTRY = 42
DEF C_KEY = 18
DEF LIMIT = 1 << 62
DEF MAX_LENGTH = 0x100000000

cdef enum:
    ST_DONE = 0
    ST_KEY_ORDER = 1
    ST_LSN_RANGE = 2
    ST_LSN_RISE = 3
    ST_LENGTH = 4
    ST_OUTSIDE = 5


cdef struct Walk:
    # in: the layer's LSN range (lo_inf: lsn_start above every u64; hi_inf: lsn_end above)
    uint64_t lo
    uint64_t hi
    bint lo_inf
    bint hi_inf
    # in/out: the cursor (key, value within it, value overall)
    size_t k
    uint64_t sub
    size_t v
    # out: values and bytes of the piece; what stopped the walk
    size_t n
    uint64_t out
    int status


cdef void _walk(Walk *w, const unsigned char *keys, const uint64_t *counts, size_t n_keys,
                const uint64_t *triples, uint64_t src_len, uint64_t max_bytes) noexcept nogil:
    """Pass 1: check the values from the cursor on and find where the piece stops."""
    cdef uint64_t lsn, off, length, count
    while w.k < n_keys:
        if w.sub == 0 and w.k > 0 and memcmp(keys + C_KEY * (w.k - 1), keys + C_KEY * w.k, C_KEY) >= 0:
            w.status = ST_KEY_ORDER
            return
        count = counts[w.k]
        while w.sub < count:
            lsn = triples[3 * w.v]
            length = triples[3 * w.v + 2]
            if w.n > 0 and (w.out >= max_bytes or length > max_bytes - w.out):
                w.status = ST_DONE
                return
            if w.lo_inf or lsn < w.lo or (not w.hi_inf and lsn >= w.hi):
                w.status = ST_LSN_RANGE
                return
            if w.sub > 0 and lsn <= triples[3 * w.v - 3]:
                w.status = ST_LSN_RISE
                return
            if length >= <uint64_t>MAX_LENGTH:
                w.status = ST_LENGTH
                return
            off = triples[3 * w.v + 1] >> 1
            if length > src_len or off > src_len - length:
                w.status = ST_OUTSIDE
                return
            w.out += length
            w.n += 1
            w.sub += 1
            w.v += 1
        w.k += 1
        w.sub = 0
    w.status = ST_DONE


cdef bint _copy(const unsigned char *keys, const uint64_t *counts, size_t n_keys,
                const uint64_t *triples, size_t n_triples, const unsigned char *src,
                uint64_t src_len, size_t k, uint64_t sub, size_t v, size_t n,
                uint64_t data_offset, unsigned char *data, uint64_t data_len,
                unsigned char *entries) noexcept nogil:
    """Pass 2: the ``n`` values from the cursor (all checked by ``_walk``) and their entries.
    The bounds are checked again (a few compares per value): the arrays are the caller's, and
    between the passes the GIL was taken, so another thread could have changed them in place.
    False: something no longer fits (nothing outside the buffers was touched)."""
    cdef size_t i
    cdef uint64_t pos, length, at = 0
    cdef const unsigned char *blob
    cdef unsigned char *e
    for i in range(n):
        while k < n_keys and sub >= counts[k]:
            k += 1
            sub = 0
        if k >= n_keys or v >= n_triples // 3:
            return False
        pos = triples[3 * v + 1]
        length = triples[3 * v + 2]
        if (pos >> 1) > src_len or length > src_len - (pos >> 1):
            return False
        if length > data_len - at or length > <uint64_t>UINT32_MAX:
            return False
        blob = src + (pos >> 1)
        if length:
            memcpy(data + at, blob, length)
        e = entries + C_ENTRY * i
        memcpy(e, keys + C_KEY * k, C_KEY)
        ps_put_be64(e + 18, triples[3 * v])
        ps_put_be64(e + 26, ((data_offset + at) << 1) | (pos & 1))
        ps_put_be32(e + 34, <uint32_t>length)
        ps_put_be32(e + 38, ps_crc32c(0, blob, length))
        at += length
        sub += 1
        v += 1
    return at == data_len


def pack_values(keys, const uint64_t[::1] counts, const uint64_t[::1] triples, src,
                key_at, sub, data_offset, max_bytes, lsn_start, lsn_end):
    """See pageserver/storage/_l0_py.py."""
    cdef const unsigned char[::1] kv = keys
    cdef const unsigned char[::1] sv = src
    cdef size_t n_keys = counts.shape[0]
    cdef size_t n_triples = triples.shape[0]
    cdef size_t i
    cdef uint64_t total = 0
    cdef Walk w
    cdef const unsigned char *kp
    cdef const unsigned char *sp
    cdef const uint64_t *cp
    cdef const uint64_t *tp
    cdef uint64_t src_len = sv.shape[0]
    cdef uint64_t c_offset, c_max
    cdef bytes data, entries
    cdef size_t start_k
    cdef uint64_t start_sub
    cdef size_t start_v
    cdef bint over = False
    cdef unsigned char *dp
    cdef unsigned char *ep
    cdef bint fits
    if <size_t>kv.shape[0] != C_KEY * n_keys:
        raise ValueError(f"pack_values: {kv.shape[0]} key bytes for {n_keys} keys")
    for i in range(n_keys):
        if counts[i] == 0:
            raise ValueError(f"pack_values: key {i} has no values")
        if counts[i] > n_triples - total:
            over = True  # (more values than triples: the sum is not needed in C)
        else:
            total += counts[i]
    if over or n_triples % 3 or total != n_triples // 3:
        exact = sum([counts[i] for i in range(n_keys)]) if over else total
        raise ValueError(f"pack_values: the counts add up to {exact} values, the triples hold {n_triples} numbers")
    if not 0 <= key_at <= n_keys or sub < 0 or (sub >= counts[key_at] if key_at < n_keys else sub != 0):
        raise ValueError(f"pack_values: cursor ({key_at}, {sub}) outside the index")
    if not 0 <= data_offset < _LIMIT or not 0 <= max_bytes < _LIMIT:
        raise ValueError(f"pack_values: data_offset {data_offset} or max_bytes {max_bytes} out of range")
    c_offset = data_offset
    c_max = max_bytes
    w.lo_inf = lsn_start > _U64_MAX
    w.lo = 0 if w.lo_inf or lsn_start < 0 else lsn_start
    w.hi_inf = lsn_end > _U64_MAX
    w.hi = 0 if w.hi_inf or lsn_end < 0 else lsn_end
    w.k = key_at
    w.sub = sub
    w.v = 0
    for i in range(w.k):
        w.v += counts[i]
    w.v += w.sub
    w.n = 0
    w.out = 0
    w.status = ST_DONE
    start_k, start_sub, start_v = w.k, w.sub, w.v
    kp = &kv[0] if n_keys else NULL
    cp = &counts[0] if n_keys else NULL
    tp = &triples[0] if n_triples else NULL
    sp = &sv[0] if src_len else NULL
    with nogil:
        _walk(&w, kp, cp, n_keys, tp, src_len, c_max)
    if w.status == ST_KEY_ORDER:
        raise ValueError(f"pack_values: keys out of order at key {w.k}")
    if w.status != ST_DONE:
        lsn = triples[3 * w.v]
        length = triples[3 * w.v + 2]
        if w.status == ST_LSN_RANGE:
            raise ValueError(f"pack_values: value {w.v}: LSN {lsn:X} outside [{lsn_start:X}, {lsn_end:X})")
        if w.status == ST_LSN_RISE:
            raise ValueError(f"pack_values: value {w.v}: LSN {lsn:X} not above the one before")
        if w.status == ST_LENGTH:
            raise ValueError(f"pack_values: value {w.v}: {length} bytes do not fit an index entry")
        raise ValueError(
            f"pack_values: value {w.v}: {length} bytes at {triples[3 * w.v + 1] >> 1} "
            f"outside the layer's {src_len} bytes"
        )
    data = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>w.out)
    entries = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>(C_ENTRY * w.n))
    dp = <unsigned char *>PyBytes_AS_STRING(data)
    ep = <unsigned char *>PyBytes_AS_STRING(entries)
    with nogil:
        fits = _copy(kp, cp, n_keys, tp, n_triples, sp, src_len, start_k, start_sub, start_v,
                     w.n, c_offset, dp, w.out, ep)
    if not fits:
        raise RuntimeError("pack_values: the index or the layer's bytes changed during the call")
    return data, entries, w.k, w.sub
