# The GetPage load generator, compiled: the twin of protocol/_getpage_load_py.py (the
# reference, which documents the behaviour). Same names, results and error classes
# (tests/protocol/test_native_getpage_load.py). Every length from the wire is checked against
# the bytes that remain, in 64-bit arithmetic, before it is used (native.md 6.1); the
# response loop runs without the GIL.
"""GetPage load generator, compiled (see protocol/_getpage_load_py.py for the reference)."""

from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy, memmove
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from array import array

cdef extern from "_bytes.h":
    uint32_t ps_be32(const unsigned char *p) nogil
    uint64_t ps_be64(const unsigned char *p) nogil
    void ps_put_be32(unsigned char *p, uint32_t v) nogil
    void ps_put_be64(unsigned char *p, uint64_t v) nogil

cdef extern from *:
    """
    #ifndef PAGESTORE_SOURCE_HASH
    #error "PAGESTORE_SOURCE_HASH is not defined: build with setup.py (pip install -e .)"
    #endif
    static const char *ps_load_source_hash = PAGESTORE_SOURCE_HASH;
    """
    const char *ps_load_source_hash

__all__ = ["IMPL", "MAX_RELS", "GetPageLoad", "LoadProtocolError", "LoadServerError"]

IMPL = "native"
SOURCE_HASH = ps_load_source_hash.decode("ascii")

MAX_LSN = 0xFFFF_FFFF_FFFF_FFFF
MAX_MESSAGE_LEN = 2 * 1024 * 1024
BLCKSZ = 8192
MAX_RELS = 1 << 20

cdef enum:
    C_BLCKSZ = 8192
    C_MAX_MESSAGE_LEN = 2 * 1024 * 1024
    REQUEST_SIZE = 47          # 'd', u32 length, 42-byte GetPage request
    RESPONSE_HEAD_SIZE = 42    # tag, reqid, lsn, nms, spc, db, rel, fork, blkno
    GETPAGE_PAYLOAD = RESPONSE_HEAD_SIZE + C_BLCKSZ
    ERROR_HEAD_SIZE = 25
    TAG_GET_PAGE = 102
    TAG_ERROR = 103

# what the nogil loop stopped on
cdef enum:
    ST_OK = 0
    ST_BAD_LENGTH = 1
    ST_LIBPQ_ERROR = 2
    ST_UNEXPECTED = 3
    ST_NO_FLIGHT = 4
    ST_EMPTY = 5
    ST_ERROR_TRUNCATED = 6
    ST_SERVER_ERROR = 7
    ST_BAD_TAG = 8
    ST_BAD_SIZE = 9
    ST_MISMATCH = 10
    ST_NOMEM = 11


class LoadProtocolError(ValueError):
    """The server's bytes are not the answers to the requests in flight."""


class LoadServerError(RuntimeError):
    """The server answered a request with an error (pagestream Error or libpq ErrorResponse)."""


cdef struct Flight:
    uint64_t reqid
    uint32_t rel
    uint32_t blk
    int64_t sent_ns


cdef struct RelRange:
    uint32_t spc
    uint32_t db
    uint32_t relnode
    uint8_t fork
    uint64_t start    # the relation's first flat block index


cdef class GetPageLoad:
    """One pagestream v3 connection's load: see the twin's docstring."""

    # the relations, ordered by start
    cdef RelRange *rels
    cdef Py_ssize_t nrels
    cdef readonly uint64_t pages
    cdef uint64_t state, next_reqid
    # ring of requests in flight
    cdef Flight *ring
    cdef Py_ssize_t ring_cap, ring_head, ring_len
    # received bytes not yet a whole message
    cdef unsigned char *pend
    cdef Py_ssize_t pend_len, pend_cap
    # latencies (µs)
    cdef uint32_t *lat
    cdef Py_ssize_t lat_len, lat_cap
    cdef Py_ssize_t _count

    def __cinit__(self):
        self.rels = NULL
        self.ring = NULL
        self.pend = NULL
        self.lat = NULL

    def __dealloc__(self):
        free(self.rels)
        free(self.ring)
        free(self.pend)
        free(self.lat)

    def __init__(self, rel, pages, seed, first_reqid=1):
        if isinstance(pages, int):
            rels, sizes = [rel], [pages]
        else:
            rels, sizes = rel, pages
            if len(rels) != len(sizes):
                raise ValueError(f"{len(rels)} relations but {len(sizes)} sizes")
            if not 1 <= len(rels) <= MAX_RELS:
                raise ValueError(f"{len(rels)} relations: want 1..{MAX_RELS}")
        checked = []
        total = 0
        for one, size in zip(rels, sizes, strict=True):
            spcnode, dbnode, relnode, forknum = one
            for name, v in (("spcnode", spcnode), ("dbnode", dbnode), ("relnode", relnode)):
                if not 0 <= v <= 0xFFFF_FFFF:
                    raise ValueError(f"{name} {v} does not fit in 32 bits")
            if not 0 <= forknum <= 255:
                raise ValueError(f"forknum {forknum} does not fit in 8 bits")
            if not 1 <= size <= 0x1_0000_0000:
                raise ValueError(f"pages {size} must be 1..2^32")
            checked.append((spcnode, dbnode, relnode, forknum, total))
            total += size  # at most 2^20 relations of 2^32 blocks: no 64-bit overflow
        if not 0 <= first_reqid <= MAX_LSN or not 0 <= seed <= MAX_LSN:
            raise ValueError("seed and first_reqid must fit in 64 bits")
        cdef RelRange *table = <RelRange *>realloc(self.rels, len(checked) * sizeof(RelRange))
        if table == NULL:
            raise MemoryError()
        self.rels = table
        cdef Py_ssize_t i
        for i, (spcnode, dbnode, relnode, forknum, start) in enumerate(checked):
            table[i].spc, table[i].db, table[i].relnode = spcnode, dbnode, relnode
            table[i].fork, table[i].start = forknum, start
        self.nrels = len(checked)
        self.pages = total
        self.state = seed
        self.next_reqid = first_reqid
        self.ring_cap = self.ring_head = self.ring_len = 0
        self.pend_len = self.pend_cap = 0
        self.lat_len = self.lat_cap = 0
        self._count = 0

    @property
    def in_flight(self):
        return self.ring_len

    @property
    def count(self):
        """Responses received and checked."""
        return self._count

    def latencies_us(self):
        """One latency per response, in the order received (a copy)."""
        out = array("I")
        if self.lat_len:
            out.frombytes(PyBytes_FromStringAndSize(<char *>self.lat, self.lat_len * 4))
        return out

    cdef inline uint32_t _next_block(self, uint32_t *rel_out) noexcept nogil:
        self.state += <uint64_t>0x9E3779B97F4A7C15
        cdef uint64_t z = self.state
        z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EB
        cdef uint64_t k = (z ^ (z >> 31)) % self.pages
        # the last relation whose start is <= k (starts increase; rels[0].start == 0)
        cdef Py_ssize_t lo = 0, hi = self.nrels, mid
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.rels[mid].start <= k:
                lo = mid
            else:
                hi = mid
        rel_out[0] = <uint32_t>lo
        return <uint32_t>(k - self.rels[lo].start)

    cdef int _grow_ring(self, Py_ssize_t need) except -1:
        cdef Py_ssize_t cap = self.ring_cap if self.ring_cap else 64
        cdef Py_ssize_t i
        while cap < need:
            cap *= 2
        if cap == self.ring_cap:
            return 0
        cdef Flight *ring = <Flight *>realloc(self.ring, cap * sizeof(Flight))
        if ring == NULL:
            raise MemoryError()
        # unwrap: the entries from head to the old end move to the new end
        cdef Py_ssize_t tail = self.ring_cap - self.ring_head
        if self.ring_len and self.ring_head + self.ring_len > self.ring_cap:
            memmove(ring + cap - tail, ring + self.ring_head, tail * sizeof(Flight))
            self.ring_head = cap - tail
        self.ring = ring
        self.ring_cap = cap
        return 0

    cdef bytes _requests(self, Py_ssize_t n, int64_t now_ns):
        if self.ring_len + n > self.ring_cap:
            self._grow_ring(self.ring_len + n)
        out = PyBytes_FromStringAndSize(NULL, n * REQUEST_SIZE)
        cdef unsigned char *p = <unsigned char *>PyBytes_AS_STRING(out)
        cdef Py_ssize_t i, at
        cdef uint32_t blk, rel
        cdef uint64_t reqid
        cdef RelRange *r
        for i in range(n):
            reqid = self.next_reqid
            self.next_reqid += 1
            blk = self._next_block(&rel)
            r = &self.rels[rel]
            p[0] = 0x64
            ps_put_be32(p + 1, REQUEST_SIZE - 1)
            p[5] = 2
            ps_put_be64(p + 6, reqid)
            ps_put_be64(p + 14, <uint64_t>0xFFFFFFFFFFFFFFFF)
            ps_put_be64(p + 22, 0)
            ps_put_be32(p + 30, r.spc)
            ps_put_be32(p + 34, r.db)
            ps_put_be32(p + 38, r.relnode)
            p[42] = r.fork
            ps_put_be32(p + 43, blk)
            p += REQUEST_SIZE
            at = (self.ring_head + self.ring_len) % self.ring_cap
            self.ring[at].reqid = reqid
            self.ring[at].rel = rel
            self.ring[at].blk = blk
            self.ring[at].sent_ns = now_ns
            self.ring_len += 1
        return out

    def requests(self, n, now_ns):
        """``n`` framed GetPage requests, sent (for the latencies) at ``now_ns``."""
        if n < 0:
            raise ValueError(f"cannot send {n} requests")
        return self._requests(n, now_ns)

    cdef int _append_pending(self, const unsigned char *src, Py_ssize_t n) except -1:
        cdef Py_ssize_t cap = self.pend_cap if self.pend_cap else 65536
        while cap < self.pend_len + n:
            cap *= 2
        if cap != self.pend_cap:
            p = <unsigned char *>realloc(self.pend, cap)
            if p == NULL:
                raise MemoryError()
            self.pend = p
            self.pend_cap = cap
        if n:
            memcpy(self.pend + self.pend_len, src, n)
        self.pend_len += n
        return 0

    cdef int _reserve_lat(self, Py_ssize_t extra) except -1:
        cdef Py_ssize_t cap = self.lat_cap if self.lat_cap else 4096
        while cap < self.lat_len + extra:
            cap *= 2
        if cap != self.lat_cap:
            p = <uint32_t *>realloc(self.lat, cap * sizeof(uint32_t))
            if p == NULL:
                raise MemoryError()
            self.lat = p
            self.lat_cap = cap
        return 0

    cdef int _scan(self, const unsigned char *buf, Py_ssize_t end, int64_t now_ns,
                   Py_ssize_t *pos_out, Py_ssize_t *answered_out, Py_ssize_t *err_at,
                   uint64_t *err_value) noexcept nogil:
        # Checks and consumes whole messages of buf[:end]; never reads past end.
        cdef Py_ssize_t pos = 0, answered = 0, start, size
        cdef uint64_t length, us
        cdef unsigned char tag, rtag
        cdef const unsigned char *h
        cdef Flight *f
        cdef RelRange *r
        cdef int status = ST_OK
        while end - pos >= 5:
            tag = buf[pos]
            length = ps_be32(buf + pos + 1)
            if length < 4 or length > C_MAX_MESSAGE_LEN:
                err_value[0] = length
                status = ST_BAD_LENGTH
                break
            if <uint64_t>(end - pos - 1) < length:
                break
            start = pos + 5
            size = <Py_ssize_t>length - 4
            err_at[0] = start
            err_value[0] = <uint64_t>size
            if tag == 0x45:
                pos = pos + 1 + <Py_ssize_t>length
                status = ST_LIBPQ_ERROR
                break
            if tag != 0x64:
                err_value[0] = tag
                status = ST_UNEXPECTED
                break
            if self.ring_len == 0:
                status = ST_NO_FLIGHT
                break
            if size < 1:
                status = ST_EMPTY
                break
            pos = pos + 1 + <Py_ssize_t>length
            f = &self.ring[self.ring_head]
            self.ring_head = (self.ring_head + 1) % self.ring_cap
            self.ring_len -= 1
            rtag = buf[start]
            if rtag == TAG_ERROR:
                status = ST_ERROR_TRUNCATED if size < ERROR_HEAD_SIZE + 1 else ST_SERVER_ERROR
                break
            if rtag != TAG_GET_PAGE:
                err_value[0] = rtag
                status = ST_BAD_TAG
                break
            if size != GETPAGE_PAYLOAD:
                status = ST_BAD_SIZE
                break
            h = buf + start
            r = &self.rels[f.rel]
            if (ps_be64(h + 1) != f.reqid or ps_be64(h + 9) != <uint64_t>0xFFFFFFFFFFFFFFFF
                    or ps_be64(h + 17) != 0 or ps_be32(h + 25) != r.spc
                    or ps_be32(h + 29) != r.db or ps_be32(h + 33) != r.relnode
                    or h[37] != r.fork or ps_be32(h + 38) != f.blk):
                err_value[0] = f.reqid
                status = ST_MISMATCH
                break
            us = <uint64_t>((now_ns - f.sent_ns) // 1000) if now_ns > f.sent_ns else 0
            if self.lat_len == self.lat_cap:
                status = ST_NOMEM  # reserved before the loop: cannot happen
                break
            if us < 1:
                us = 1
            elif us > <uint64_t>0xFFFFFFFF:
                us = <uint64_t>0xFFFFFFFF
            self.lat[self.lat_len] = <uint32_t>us
            self.lat_len += 1
            self._count += 1
            answered += 1
        pos_out[0] = pos
        answered_out[0] = answered
        return status

    def feed(self, data, now_ns, resend):
        """Take received bytes; returns the requests to send now: one new one per response
        completed by ``data`` if ``resend`` (a closed loop), else none."""
        cdef const unsigned char[::1] view = memoryview(data).cast("B")
        cdef Py_ssize_t n = view.shape[0]
        cdef const unsigned char *src = &view[0] if n else NULL
        cdef const unsigned char *buf
        cdef Py_ssize_t end, pos = 0, answered = 0, err_at = 0
        cdef uint64_t err_value = 0
        cdef int64_t now = now_ns
        cdef int status
        cdef bint direct = self.pend_len == 0
        if direct:
            buf, end = src, n
        else:
            self._append_pending(src, n)
            buf, end = self.pend, self.pend_len
        # at most one response per 5 bytes: room for every latency this call can add
        self._reserve_lat(end // 5 + 1)
        with nogil:
            status = self._scan(buf, end, now, &pos, &answered, &err_at, &err_value)
        if status != ST_OK:
            self._raise(status, buf, err_at, pos, err_value)
        # keep the incomplete tail
        if direct:
            if pos < n:
                self._append_pending(src + pos, n - pos)
        else:
            if pos:
                memmove(self.pend, self.pend + pos, self.pend_len - pos)
                self.pend_len -= pos
        if not resend or not answered:
            return b""
        return self._requests(answered, now)

    cdef _raise(self, int status, const unsigned char *buf, Py_ssize_t at, Py_ssize_t pos,
                uint64_t value):
        if status == ST_BAD_LENGTH:
            raise LoadProtocolError(f"bad message length {value}")
        if status == ST_LIBPQ_ERROR:
            body = PyBytes_FromStringAndSize(<const char *>buf + at, <Py_ssize_t>value)
            raise LoadServerError(_libpq_error_text(body))
        if status == ST_UNEXPECTED:
            raise LoadProtocolError(f"unexpected message {value:#04x} during the pagestream")
        if status == ST_NO_FLIGHT:
            raise LoadProtocolError("a response with no request in flight")
        if status == ST_EMPTY:
            raise LoadProtocolError("empty pagestream response")
        if status == ST_ERROR_TRUNCATED:
            raise LoadProtocolError("truncated pagestream Error response")
        if status == ST_SERVER_ERROR:
            raw = PyBytes_FromStringAndSize(<const char *>buf + at + ERROR_HEAD_SIZE,
                                            pos - at - ERROR_HEAD_SIZE)
            raise LoadServerError(raw.split(b"\0", 1)[0].decode("utf-8", "replace"))
        if status == ST_BAD_TAG:
            raise LoadProtocolError(f"unexpected pagestream response tag {value}")
        if status == ST_BAD_SIZE:
            raise LoadProtocolError(f"GetPage response of {value} bytes, not {GETPAGE_PAYLOAD}")
        if status == ST_MISMATCH:
            raise LoadProtocolError(f"response does not answer reqid {value}")
        raise MemoryError()


def _libpq_error_text(body):
    """The M (message) field of a libpq ErrorResponse body, or the whole body."""
    raw = bytes(body)
    for field in raw.split(b"\0"):
        if field[:1] == b"M":
            return field[1:].decode("utf-8", "replace")
    return raw.decode("utf-8", "replace")
