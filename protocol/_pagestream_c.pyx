# Pagestream batch codec, compiled: the twin of protocol/_pagestream_py.py (the reference,
# which documents the behaviour). Same names, results and error classes
# (tests/protocol/test_native_pagestream.py). Every length is checked against the bytes that
# remain before it is used (native.md 6.1); a batch's responses are sized once and copied in
# with memcpy.
"""Pagestream batch codec, compiled (see protocol/_pagestream_py.py for the reference)."""

from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy, memset
from libc.stdlib cimport free, malloc
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_GET_SIZE
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Resize
from cpython.object cimport PyObject_GenericSetAttr

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
    static const char *ps_pagestream_source_hash = PAGESTORE_SOURCE_HASH;
    """
    const char *ps_pagestream_source_hash

__all__ = ["IMPL", "MAX_CACHED_RELS", "decode_getpages", "encode_getpage_responses"]

IMPL = "native"
SOURCE_HASH = ps_pagestream_source_hash.decode("ascii")
BLCKSZ = 8192
MAX_CACHED_RELS = 1024

cdef enum:
    C_BLCKSZ = 8192
    V3_SIZE = 47          # 'd', u32, tag, reqid, lsn, nms, spc, db, rel, fork, blkno
    V2_SIZE = 39
    RESP_V3_HEAD = 47     # 'd', u32, tag 102, reqid, lsn, nms, spc, db, rel, fork, blkno
    RESP_V2_HEAD = 6
    TAG_GET_PAGE_REQUEST = 2
    TAG_GET_PAGE_RESPONSE = 102


_REQUEST_FIELDS = ("reqid", "request_lsn", "not_modified_since", "rel", "blkno")
# make_request classes seen, and whether they are plain records (below)
cdef dict _plain_records = {}
cdef object _object_new = object.__new__


cdef bint _plain_record(object cls) except -1:
    """Whether ``cls(...)`` does nothing but set the five fields: an attrs class (frozen or
    not) with exactly ``_REQUEST_FIELDS``, no validator, converter, on_setattr hook, pre- or
    post-init, and ``object.__new__``. Then an instance is made as attrs' own ``__init__``
    makes it (``object.__setattr__`` per field) without the Python frame: the same object,
    a third of the cost. Decided once per class."""
    got = _plain_records.get(cls)
    if got is None:
        got = False
        fields = getattr(cls, "__attrs_attrs__", None)
        if (
            isinstance(cls, type)
            and cls.__new__ is _object_new
            and fields is not None
            and tuple(f.name for f in fields) == _REQUEST_FIELDS
            and not hasattr(cls, "__attrs_post_init__")
            and not hasattr(cls, "__attrs_pre_init__")
            # attrs' generated __init__, not one of the class's own
            and "attrs generated" in getattr(getattr(cls.__init__, "__code__", None), "co_filename", "")
        ):
            got = all(
                f.init and f.validator is None and f.converter is None and f.on_setattr is None
                for f in fields
            )
        if len(_plain_records) >= 64:
            _plain_records.clear()
        _plain_records[cls] = got
    return got


def decode_getpages(buf, pos, end, v3, limit, make_request, make_rel, rels):
    """Every framed GetPage at ``buf[pos:end]`` at once; see the twin."""
    cdef const unsigned char[::1] view = memoryview(buf).cast("B")
    cdef Py_ssize_t size_all = view.shape[0]
    if not 0 <= pos <= end <= size_all:
        raise ValueError(f"range [{pos}, {end}) is not inside {size_all} bytes")
    if limit < 0:
        raise ValueError(f"limit {limit} is negative")
    cdef bint is_v3 = bool(v3)
    cdef Py_ssize_t p = pos, e = end, size = V3_SIZE if is_v3 else V2_SIZE
    cdef Py_ssize_t most = limit if limit < (1 << 40) else (1 << 40)
    cdef Py_ssize_t count = 0
    cdef const unsigned char *b = &view[0] if size_all else NULL
    cdef const unsigned char *m
    cdef uint64_t reqid, lsn, nms
    cdef uint32_t spc, db, relnode, blk
    cdef unsigned char fork
    cdef Py_ssize_t body
    cdef bint plain = _plain_record(make_request)
    # the previous request's relation: a run of one relation skips the key and the lookup
    cdef bint have_prev = False
    cdef uint32_t pspc = 0, pdb = 0, prelnode = 0
    cdef unsigned char pfork = 0
    rel = None
    out = []
    while count < most and e - p >= size:
        m = b + p
        if m[0] != 0x64 or m[5] != TAG_GET_PAGE_REQUEST or ps_be32(m + 1) != <uint32_t>(size - 1):
            break
        if is_v3:
            reqid = ps_be64(m + 6)
            body = 14
        else:
            reqid = 0
            body = 6
        lsn = ps_be64(m + body)
        nms = ps_be64(m + body + 8)
        spc = ps_be32(m + body + 16)
        db = ps_be32(m + body + 20)
        relnode = ps_be32(m + body + 24)
        fork = m[body + 28]
        blk = ps_be32(m + body + 29)
        p += size
        if not (have_prev and spc == pspc and db == pdb and relnode == prelnode and fork == pfork):
            # (the same relation as the previous request is in ``rels`` already: the cache
            # is only emptied when a new one goes in)
            key = (spc, db, relnode, fork)
            rel = rels.get(key)
            if rel is None:
                if len(rels) >= MAX_CACHED_RELS:
                    rels.clear()
                rel = make_rel(spc, db, relnode, fork)
                rels[key] = rel
            have_prev, pspc, pdb, prelnode, pfork = True, spc, db, relnode, fork
        if plain:
            req = _object_new(make_request)
            PyObject_GenericSetAttr(req, "reqid", reqid)
            PyObject_GenericSetAttr(req, "request_lsn", lsn)
            PyObject_GenericSetAttr(req, "not_modified_since", nms)
            PyObject_GenericSetAttr(req, "rel", rel)
            PyObject_GenericSetAttr(req, "blkno", blk)
        else:
            req = make_request(reqid, lsn, nms, rel, blk)
        out.append(req)
        count += 1
    return out, p


cdef struct RespHead:
    uint64_t reqid
    uint64_t lsn
    uint64_t nms
    uint32_t spc
    uint32_t db
    uint32_t relnode
    uint32_t blk
    unsigned char fork
    const char *page


cdef const char *_page_ptr(object page, list held) except NULL:
    """The 8192 bytes of ``page`` (bytes directly, any other buffer through a memoryview;
    either kept in ``held`` until the copies are done)."""
    cdef Py_buffer view
    cdef Py_ssize_t size
    if PyBytes_CheckExact(page):
        size = PyBytes_GET_SIZE(page)
        if size != C_BLCKSZ:
            raise ValueError(f"a page is {BLCKSZ} bytes, got {size}")
        # held too: ``pages`` may be a sequence whose items are made on access, and the
        # pointer must outlive this call until the copies are done
        held.append(page)
        return PyBytes_AS_STRING(page)
    PyObject_GetBuffer(page, &view, PyBUF_SIMPLE)
    try:
        size = view.len
    finally:
        PyBuffer_Release(&view)
    if size != C_BLCKSZ:
        raise ValueError(f"a page is {BLCKSZ} bytes, got {size}")
    mv = memoryview(page)
    held.append(mv)
    cdef const unsigned char[::1] m = mv.cast("B")
    return <const char *>&m[0]


def encode_getpage_responses(out, v3, requests, pages):
    """Append one framed GetPage response per (request, page) to ``out``; see the twin."""
    cdef Py_ssize_t n = len(requests), i
    if len(pages) != n:
        raise ValueError(f"{n} requests but {len(pages)} pages")
    cdef bint is_v3 = bool(v3)
    cdef Py_ssize_t head = RESP_V3_HEAD if is_v3 else RESP_V2_HEAD
    cdef Py_ssize_t at, grow = n * (head + C_BLCKSZ)
    # Every value first (what can fail: a page of the wrong size, a field that is not an
    # integer in range), into C structs rather than a tuple per request; then one resize and
    # the copies, so an error appends nothing.
    cdef RespHead *hs = <RespHead *>malloc(<size_t>(n if n else 1) * sizeof(RespHead))
    if hs == NULL:
        raise MemoryError()
    cdef list held = []
    cdef unsigned char *d
    cdef RespHead *h
    try:
        for i in range(n):
            page = pages[i]
            # None: the page's bytes are left zero, for the caller to fill (its slot)
            hs[i].page = NULL if page is None else _page_ptr(page, held)
        if not isinstance(out, bytearray):
            raise TypeError("out must be a bytearray")
        at = PyByteArray_GET_SIZE(out)
        if is_v3:
            for i in range(n):
                req = requests[i]
                r = req.rel
                h = &hs[i]
                h.reqid = req.reqid
                h.lsn = req.request_lsn
                h.nms = req.not_modified_since
                h.spc = r.spcnode
                h.db = r.dbnode
                h.relnode = r.relnode
                h.fork = r.forknum
                h.blk = req.blkno
        PyByteArray_Resize(out, at + grow)
        d = <unsigned char *>PyByteArray_AS_STRING(out) + at
        for i in range(n):
            d[0] = 0x64
            ps_put_be32(d + 1, <uint32_t>(head - 1 + C_BLCKSZ))
            d[5] = TAG_GET_PAGE_RESPONSE
            if is_v3:
                h = &hs[i]
                ps_put_be64(d + 6, h.reqid)
                ps_put_be64(d + 14, h.lsn)
                ps_put_be64(d + 22, h.nms)
                ps_put_be32(d + 30, h.spc)
                ps_put_be32(d + 34, h.db)
                ps_put_be32(d + 38, h.relnode)
                d[42] = h.fork
                ps_put_be32(d + 43, h.blk)
            if hs[i].page != NULL:
                memcpy(d + head, hs[i].page, C_BLCKSZ)
            else:
                memset(d + head, 0, C_BLCKSZ)
            d += head + C_BLCKSZ
    finally:
        free(hs)
