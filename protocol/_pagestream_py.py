"""Pagestream batch codec of the page service (kernel 2), pure Python: the reference twin of
``protocol/_pagestream_c.pyx``.

- ``decode_getpages(buf, pos, end, v3, limit, make_request, make_rel, rels)``: every framed
  GetPage request at ``buf[pos:end]`` at once, up to ``limit`` of them. Only messages that are
  exactly a GetPage (CopyData ``'d'``, the exact GetPage length, the GetPage tag) are taken;
  the first one that is not (another request, a malformed or incomplete message, CopyDone)
  stops the run and is left, whole, to ``protocol.pagestream.RequestStreamDecoder``, whose
  errors are the protocol's. Returns ``(requests, new pos)``; each request is
  ``make_request(reqid, lsn, not_modified_since, rel, blkno)`` (v2: reqid 0) with ``rel`` from
  the ``rels`` cache (``make_rel(spcnode, dbnode, relnode, forknum)`` on a miss; the cache is
  emptied when it holds ``MAX_CACHED_RELS``): a compute reads few relations at a time.
- ``encode_getpage_responses(out, v3, requests, pages)``: append one framed GetPage response
  per (request, page) to the bytearray ``out`` (v3 echoes the request; v2 is the tag and the
  page); each page must be ``BLCKSZ`` bytes (``ValueError`` otherwise, nothing appended),
  or None: its ``BLCKSZ`` bytes are zeros, a slot for the caller to fill (the page service's
  image kernel reads pages straight into them); ``out`` a ``bytearray`` (``TypeError``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["IMPL", "MAX_CACHED_RELS", "decode_getpages", "encode_getpage_responses"]

IMPL: Final = "python"
BLCKSZ: Final = 8192
MAX_CACHED_RELS: Final = 1024
TAG_GET_PAGE_REQUEST: Final = 2
TAG_GET_PAGE_RESPONSE: Final = 102
# 'd', length, then the GetPage payload of protocols.md §1.2 (v3 has the reqid).
FRAMED_GETPAGE_V3: Final = struct.Struct(">BIBQQQIIIBI")
FRAMED_GETPAGE_V2: Final = struct.Struct(">BIBQQIIIBI")
# framed v3 response header: 'd', length, tag, reqid, lsn, nms, rel, blkno (the page follows)
RESPONSE_V3: Final = struct.Struct(">cIBQQQIIIBI")
RESPONSE_V2: Final = struct.Struct(">cIB")


def decode_getpages(
    buf: Buffer,
    pos: int,
    end: int,
    v3: bool,
    limit: int,
    make_request: Callable[..., Any],
    make_rel: Callable[..., Any],
    rels: dict[tuple[int, int, int, int], Any],
) -> tuple[list[Any], int]:
    """See the module docstring."""
    view = memoryview(buf).cast("B")
    if not 0 <= pos <= end <= len(view):
        raise ValueError(f"range [{pos}, {end}) is not inside {len(view)} bytes")
    if limit < 0:
        raise ValueError(f"limit {limit} is negative")
    fast = FRAMED_GETPAGE_V3 if v3 else FRAMED_GETPAGE_V2
    size = fast.size
    out: list[Any] = []
    while len(out) < limit and end - pos >= size:
        if view[pos] != 0x64 or view[pos + 5] != TAG_GET_PAGE_REQUEST:
            break
        v = fast.unpack_from(view, pos)
        if v[1] != size - 1:
            break
        pos += size
        key = v[-5:-1]
        rel = rels.get(key)
        if rel is None:
            if len(rels) >= MAX_CACHED_RELS:
                rels.clear()
            rel = rels[key] = make_rel(*key)
        if v3:
            out.append(make_request(v[3], v[4], v[5], rel, v[-1]))
        else:
            out.append(make_request(0, v[3], v[4], rel, v[-1]))
    return out, pos


def encode_getpage_responses(
    out: bytearray, v3: bool, requests: Sequence[Any], pages: Sequence[Buffer | None]
) -> None:
    """See the module docstring."""
    if len(requests) != len(pages):
        raise ValueError(f"{len(requests)} requests but {len(pages)} pages")
    for page in pages:
        if page is not None and len(memoryview(page).cast("B")) != BLCKSZ:
            raise ValueError(f"a page is {BLCKSZ} bytes, got {len(memoryview(page).cast('B'))}")
    if not isinstance(out, bytearray):
        raise TypeError("out must be a bytearray")
    for req, page in zip(requests, pages, strict=True):
        if v3:
            r = req.rel
            out += RESPONSE_V3.pack(
                b"d", RESPONSE_V3.size - 1 + BLCKSZ, TAG_GET_PAGE_RESPONSE, req.reqid,
                req.request_lsn, req.not_modified_since, r.spcnode, r.dbnode, r.relnode,
                r.forknum, req.blkno,
            )
        else:
            out += RESPONSE_V2.pack(b"d", RESPONSE_V2.size - 1 + BLCKSZ, TAG_GET_PAGE_RESPONSE)
        out += bytes(BLCKSZ) if page is None else page
