"""Pagestream v2/v3: the compute <-> pageserver page request protocol (protocols.md §1.2-1.3).

This module owns every byte of the pagestream sub-protocol:

- request and response values (``@attrs.frozen``); a v3 response echoes its request, so each
  response carries the request it answers;
- ``decode_request`` / ``encode_request`` (one CopyData payload = one request) and
  ``decode_response`` / ``ResponseWriter`` (responses appended to one ``bytearray``, optionally
  already framed as CopyData messages so a batch of answers is one ``send_all``);
- ``RequestStreamDecoder``: the server's sans-IO reader of the frontend byte stream while the
  connection is in CopyBoth (CopyData -> request, CopyDone, Terminate, anything else an error);
- ``ResponseStreamDecoder``: the client's reader of backend messages during the stream.

All integers are big-endian. v2 has no ``reqid`` (it decodes as 0) and v2 responses carry only
the tag and the result, so decoding a v2 response needs the request it answers.

Errors: a malformed request is the compute's fault and ends the stream with an ErrorResponse
XX000 (neon's ``QueryError::Other``), so decode errors are ``RemoteProtocolError`` with
SQLSTATE XX000; framing errors (bad length, unexpected message) keep 08P01.

This is the page service's hot path: every layout is a precompiled ``struct.Struct`` and GetPage
requests are parsed straight out of the receive buffer without an intermediate copy.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal, TypeAlias

import attrs

from protocol import _native
from protocol.buffer import Buffer, ReceiveBuffer
from protocol.errors import (
    INTERNAL_ERROR,
    PROTOCOL_VIOLATION,
    LocalProtocolError,
    RemoteProtocolError,
)
from protocol.lsn import Lsn

PagestreamVersion: TypeAlias = Literal[2, 3]

# The batch codec kernel (protocol/_pagestream_c.pyx, or its twin): every GetPage of a receive
# buffer decoded at once, a batch's responses encoded into one buffer.
_native.require("protocol._pagestream_c")
if _native.IMPL == "python":
    from protocol._pagestream_py import decode_getpages as decode_getpages
    from protocol._pagestream_py import encode_getpage_responses
else:
    from protocol._pagestream_c import decode_getpages as decode_getpages
    from protocol._pagestream_c import encode_getpage_responses

BLCKSZ: Final = 8192
SLRU_PAGES_PER_SEGMENT: Final = 32
DEFAULTTABLESPACE_OID: Final = 1663
MAX_LSN: Final = Lsn(0xFFFF_FFFF_FFFF_FFFF)


class RequestTag(enum.IntEnum):
    EXISTS = 0
    NBLOCKS = 1
    GET_PAGE = 2
    DB_SIZE = 3
    GET_SLRU_SEGMENT = 4


class ResponseTag(enum.IntEnum):
    EXISTS = 100
    NBLOCKS = 101
    GET_PAGE = 102
    ERROR = 103
    DB_SIZE = 104
    GET_SLRU_SEGMENT = 105


class SlruKind(enum.IntEnum):
    CLOG = 0
    MULTIXACT_MEMBERS = 1
    MULTIXACT_OFFSETS = 2


def _bad_request(msg: str) -> RemoteProtocolError:
    return RemoteProtocolError(msg, sqlstate=INTERNAL_ERROR)


# ---------------------------------------------------------------------------------------------
# Values


@attrs.frozen
class RelTag:
    """A relation fork: wire order spcnode, dbnode, relnode, forknum (main=0 fsm=1 vm=2 init=3)."""

    spcnode: int
    dbnode: int
    relnode: int
    forknum: int

    def __str__(self) -> str:
        return f"{self.spcnode}/{self.dbnode}/{self.relnode}.{self.forknum}"


@attrs.frozen
class ExistsRequest:
    reqid: int
    request_lsn: Lsn
    not_modified_since: Lsn
    rel: RelTag


@attrs.frozen
class NblocksRequest:
    reqid: int
    request_lsn: Lsn
    not_modified_since: Lsn
    rel: RelTag


@attrs.frozen
class GetPageRequest:
    reqid: int
    request_lsn: Lsn
    not_modified_since: Lsn
    rel: RelTag
    blkno: int


@attrs.frozen
class DbSizeRequest:
    reqid: int
    request_lsn: Lsn
    not_modified_since: Lsn
    dbnode: int


@attrs.frozen
class GetSlruSegmentRequest:
    reqid: int
    request_lsn: Lsn
    not_modified_since: Lsn
    kind: SlruKind
    segno: int


Request: TypeAlias = (
    ExistsRequest | NblocksRequest | GetPageRequest | DbSizeRequest | GetSlruSegmentRequest
)


@attrs.frozen
class ExistsResponse:
    request: ExistsRequest
    exists: bool


@attrs.frozen
class NblocksResponse:
    request: NblocksRequest
    n_blocks: int


@attrs.frozen
class GetPageResponse:
    request: GetPageRequest
    page: bytes | memoryview = attrs.field(eq=bytes, repr=False)


@attrs.frozen
class ErrorResponse:
    """A per-request error; v3 echoes only the request header (reqid and both LSNs)."""

    reqid: int
    request_lsn: Lsn
    not_modified_since: Lsn
    message: str

    @classmethod
    def for_request(cls, request: Request, message: str) -> ErrorResponse:
        return cls(request.reqid, request.request_lsn, request.not_modified_since, message)


@attrs.frozen
class DbSizeResponse:
    request: DbSizeRequest
    db_size: int  # bytes


@attrs.frozen
class GetSlruSegmentResponse:
    request: GetSlruSegmentRequest
    segment: bytes | memoryview = attrs.field(eq=bytes, repr=False)


Response: TypeAlias = (
    ExistsResponse
    | NblocksResponse
    | GetPageResponse
    | ErrorResponse
    | DbSizeResponse
    | GetSlruSegmentResponse
)

# ---------------------------------------------------------------------------------------------
# Layouts. "H3"/"H2" = the v3/v2 request header after the tag: (reqid,) lsn, not_modified_since.

_REL = "IIIB"
_REQ_V3: Final[dict[int, struct.Struct]] = {
    RequestTag.EXISTS: struct.Struct(">BQQQ" + _REL),
    RequestTag.NBLOCKS: struct.Struct(">BQQQ" + _REL),
    RequestTag.GET_PAGE: struct.Struct(">BQQQ" + _REL + "I"),
    RequestTag.DB_SIZE: struct.Struct(">BQQQI"),
    RequestTag.GET_SLRU_SEGMENT: struct.Struct(">BQQQBI"),
}
_REQ_V2: Final[dict[int, struct.Struct]] = {
    RequestTag.EXISTS: struct.Struct(">BQQ" + _REL),
    RequestTag.NBLOCKS: struct.Struct(">BQQ" + _REL),
    RequestTag.GET_PAGE: struct.Struct(">BQQ" + _REL + "I"),
    RequestTag.DB_SIZE: struct.Struct(">BQQI"),
    RequestTag.GET_SLRU_SEGMENT: struct.Struct(">BQQBI"),
}
REQUEST_SIZES: Final = {
    3: {tag: st.size for tag, st in _REQ_V3.items()},
    2: {tag: st.size for tag, st in _REQ_V2.items()},
}

# Responses, v3: tag, reqid, request_lsn, not_modified_since, echoed body, result.
_V3_EXISTS = struct.Struct(">BQQQ" + _REL + "B")
_V3_NBLOCKS = struct.Struct(">BQQQ" + _REL + "I")
_V3_GET_PAGE = struct.Struct(">BQQQ" + _REL + "I")  # + 8192 bytes
_V3_ERROR = struct.Struct(">BQQQ")  # + message + NUL
_V3_DB_SIZE = struct.Struct(">BQQQIq")
_V3_SLRU = struct.Struct(">BQQQBII")  # + n_blocks * 8192
# Responses, v2: tag and result only.
_V2_EXISTS = struct.Struct(">BB")
_V2_NBLOCKS = struct.Struct(">BI")
_V2_TAG = struct.Struct(">B")
_V2_DB_SIZE = struct.Struct(">Bq")
_V2_SLRU = struct.Struct(">BI")

# CopyData framing ('d', u32 length that counts itself) fused with the response header, so a
# framed GetPage answer is one pack() plus the page.
_COPY_HDR = struct.Struct(">cI")
_COPY = b"d"


def _framed(st: struct.Struct) -> struct.Struct:
    return struct.Struct(">cI" + st.format[1:])


_F_V3_EXISTS = _framed(_V3_EXISTS)
_F_V3_NBLOCKS = _framed(_V3_NBLOCKS)
_F_V3_GET_PAGE = _framed(_V3_GET_PAGE)
_F_V3_ERROR = _framed(_V3_ERROR)
_F_V3_DB_SIZE = _framed(_V3_DB_SIZE)
_F_V3_SLRU = _framed(_V3_SLRU)
_F_V2_EXISTS = _framed(_V2_EXISTS)
_F_V2_NBLOCKS = _framed(_V2_NBLOCKS)
_F_V2_TAG = _framed(_V2_TAG)
_F_V2_DB_SIZE = _framed(_V2_DB_SIZE)
_F_V2_SLRU = _framed(_V2_SLRU)

# ---------------------------------------------------------------------------------------------
# Requests


def _check_version(version: int) -> None:
    if version != 3 and version != 2:
        raise LocalProtocolError(f"unsupported pagestream version {version}")


def _build_request(tag: int, v: tuple[Any, ...], v3: bool) -> Request:
    if v3:
        reqid, lsn, nms = v[1], v[2], v[3]
        body = 4
    else:
        reqid, lsn, nms = 0, v[1], v[2]
        body = 3
    if tag == RequestTag.GET_PAGE:
        return GetPageRequest(
            reqid, lsn, nms, RelTag(v[body], v[body + 1], v[body + 2], v[body + 3]), v[body + 4]
        )
    if tag == RequestTag.EXISTS:
        return ExistsRequest(
            reqid, lsn, nms, RelTag(v[body], v[body + 1], v[body + 2], v[body + 3])
        )
    if tag == RequestTag.NBLOCKS:
        return NblocksRequest(
            reqid, lsn, nms, RelTag(v[body], v[body + 1], v[body + 2], v[body + 3])
        )
    if tag == RequestTag.DB_SIZE:
        return DbSizeRequest(reqid, lsn, nms, v[body])
    kind = v[body]
    if kind > SlruKind.MULTIXACT_OFFSETS:
        raise _bad_request(f"invalid SLRU kind {kind}")
    return GetSlruSegmentRequest(reqid, lsn, nms, SlruKind(kind), v[body + 1])


def decode_request(data: Buffer, version: PagestreamVersion) -> Request:
    """Decode one CopyData payload. Trailing bytes are ignored, as the pageserver does."""
    _check_version(version)
    if not data:
        raise _bad_request("empty pagestream request")
    tag = data[0]
    layouts = _REQ_V3 if version == 3 else _REQ_V2
    st = layouts.get(tag)
    if st is None:
        raise _bad_request(f"invalid tag {tag}")
    if len(data) < st.size:
        raise _bad_request(
            f"truncated pagestream request (tag {tag}): {len(data)} bytes, need {st.size}"
        )
    return _build_request(tag, st.unpack_from(data), version == 3)


def _request_values(req: Request) -> tuple[int, tuple[int, ...]]:
    """The request's tag and its body fields in wire order."""
    match req:
        case GetPageRequest(rel=r):
            return RequestTag.GET_PAGE, (r.spcnode, r.dbnode, r.relnode, r.forknum, req.blkno)
        case ExistsRequest(rel=r):
            return RequestTag.EXISTS, (r.spcnode, r.dbnode, r.relnode, r.forknum)
        case NblocksRequest(rel=r):
            return RequestTag.NBLOCKS, (r.spcnode, r.dbnode, r.relnode, r.forknum)
        case DbSizeRequest():
            return RequestTag.DB_SIZE, (req.dbnode,)
        case GetSlruSegmentRequest():
            return RequestTag.GET_SLRU_SEGMENT, (int(req.kind), req.segno)
    raise LocalProtocolError(f"not a pagestream request: {req!r}")


def encode_request_into(
    buf: bytearray, req: Request, version: PagestreamVersion, *, framed: bool = False
) -> None:
    """Append ``req``'s payload to ``buf``; with ``framed`` as a whole CopyData message."""
    _check_version(version)
    tag, body = _request_values(req)
    if version == 3:
        st = _REQ_V3[tag]
        payload = st.pack(tag, req.reqid, req.request_lsn, req.not_modified_since, *body)
    else:
        if req.reqid != 0:
            raise LocalProtocolError("pagestream v2 has no reqid")
        st = _REQ_V2[tag]
        payload = st.pack(tag, req.request_lsn, req.not_modified_since, *body)
    if framed:
        buf += _COPY_HDR.pack(_COPY, len(payload) + 4)
    buf += payload


def encode_request(req: Request, version: PagestreamVersion) -> bytes:
    buf = bytearray()
    encode_request_into(buf, req, version)
    return bytes(buf)


# ---------------------------------------------------------------------------------------------
# Responses: writer (server side)


# The enum member as a plain int: ``struct.pack`` of an IntEnum goes through ``__index__``.
_GET_PAGE_TAG: Final = int(ResponseTag.GET_PAGE)


class ResponseWriter:
    """Appends pagestream responses to ``buf``; ``framed`` wraps each one in CopyData.

    The server answers a whole batch into one writer and sends ``buf`` with one ``send_all``.
    Fast paths (``get_page`` etc.) take the request and the result and never build a response
    object; ``write`` accepts any response value.
    """

    __slots__ = ("buf", "framed", "version")

    def __init__(self, version: PagestreamVersion, *, framed: bool = True) -> None:
        _check_version(version)
        self.version = version
        self.framed = framed
        self.buf = bytearray()

    def take(self) -> bytearray:
        """Everything written so far; the writer starts empty again."""
        out = self.buf
        self.buf = bytearray()
        return out

    def _head(
        self,
        v3: struct.Struct,
        fv3: struct.Struct,
        v2: struct.Struct,
        fv2: struct.Struct,
        extra: int,
        v3_values: Callable[[], tuple[Any, ...]],
        v2_values: tuple[Any, ...],
    ) -> None:
        if self.version == 3:
            if self.framed:
                self.buf += fv3.pack(_COPY, v3.size + extra + 4, *v3_values())
            else:
                self.buf += v3.pack(*v3_values())
        elif self.framed:
            self.buf += fv2.pack(_COPY, v2.size + extra + 4, *v2_values)
        else:
            self.buf += v2.pack(*v2_values)

    def get_page(self, req: GetPageRequest, page: Buffer) -> None:
        if len(page) != BLCKSZ:
            raise LocalProtocolError(f"a page is {BLCKSZ} bytes, got {len(page)}")
        buf = self.buf
        if self.version == 3:
            r = req.rel
            values = (
                _GET_PAGE_TAG,
                req.reqid,
                req.request_lsn,
                req.not_modified_since,
                r.spcnode,
                r.dbnode,
                r.relnode,
                r.forknum,
                req.blkno,
            )
            if self.framed:
                buf += _F_V3_GET_PAGE.pack(_COPY, _V3_GET_PAGE.size + BLCKSZ + 4, *values)
            else:
                buf += _V3_GET_PAGE.pack(*values)
        elif self.framed:
            buf += _F_V2_TAG.pack(_COPY, 1 + BLCKSZ + 4, _GET_PAGE_TAG)
        else:
            buf += _V2_TAG.pack(_GET_PAGE_TAG)
        buf += page

    def reserve_pages(self, requests: Sequence[GetPageRequest]) -> tuple[int, int, int]:
        """``get_pages`` with every page zero, for the caller to fill in place (the page
        service's image kernel reads pages straight into them): ``(start, dest, stride)``, the
        batch's responses from ``buf[start:]``, request i's page at ``buf[dest + i * stride:]``
        (``BLCKSZ`` bytes). ``truncate(start)`` takes the batch back out."""
        if not self.framed:
            raise LocalProtocolError("page slots are for framed responses")
        start = len(self.buf)
        encode_getpage_responses(self.buf, self.version == 3, requests, [None] * len(requests))
        head = _F_V3_GET_PAGE.size if self.version == 3 else _F_V2_TAG.size
        return start, start + head, head + BLCKSZ

    def truncate(self, start: int) -> None:
        """Drop everything written from ``start`` on."""
        del self.buf[start:]

    def get_pages(self, requests: Sequence[GetPageRequest], pages: Sequence[Buffer]) -> None:
        """``get_page`` for a whole batch: one kernel call sizes the buffer once and copies
        every header and page in (nothing is written if a page is not ``BLCKSZ`` bytes)."""
        if self.framed:
            try:
                encode_getpage_responses(self.buf, self.version == 3, requests, pages)
            except ValueError as exc:
                raise LocalProtocolError(str(exc)) from None
            return
        for req, page in zip(requests, pages, strict=True):
            self.get_page(req, page)

    def error(self, req: Request | ErrorResponse, message: str) -> None:
        raw = message.encode("utf-8", errors="replace").replace(b"\0", b"?") + b"\0"
        self._head(
            _V3_ERROR,
            _F_V3_ERROR,
            _V2_TAG,
            _F_V2_TAG,
            len(raw),
            lambda: (ResponseTag.ERROR, req.reqid, req.request_lsn, req.not_modified_since),
            (ResponseTag.ERROR,),
        )
        self.buf += raw

    def exists(self, req: ExistsRequest, exists: bool) -> None:
        r = req.rel
        self._head(
            _V3_EXISTS,
            _F_V3_EXISTS,
            _V2_EXISTS,
            _F_V2_EXISTS,
            0,
            lambda: (
                ResponseTag.EXISTS,
                req.reqid,
                req.request_lsn,
                req.not_modified_since,
                r.spcnode,
                r.dbnode,
                r.relnode,
                r.forknum,
                int(exists),
            ),
            (ResponseTag.EXISTS, int(exists)),
        )

    def nblocks(self, req: NblocksRequest, n_blocks: int) -> None:
        r = req.rel
        self._head(
            _V3_NBLOCKS,
            _F_V3_NBLOCKS,
            _V2_NBLOCKS,
            _F_V2_NBLOCKS,
            0,
            lambda: (
                ResponseTag.NBLOCKS,
                req.reqid,
                req.request_lsn,
                req.not_modified_since,
                r.spcnode,
                r.dbnode,
                r.relnode,
                r.forknum,
                n_blocks,
            ),
            (ResponseTag.NBLOCKS, n_blocks),
        )

    def db_size(self, req: DbSizeRequest, db_size: int) -> None:
        self._head(
            _V3_DB_SIZE,
            _F_V3_DB_SIZE,
            _V2_DB_SIZE,
            _F_V2_DB_SIZE,
            0,
            lambda: (
                ResponseTag.DB_SIZE,
                req.reqid,
                req.request_lsn,
                req.not_modified_since,
                req.dbnode,
                db_size,
            ),
            (ResponseTag.DB_SIZE, db_size),
        )

    def slru_segment(self, req: GetSlruSegmentRequest, segment: Buffer) -> None:
        n_blocks, rem = divmod(len(segment), BLCKSZ)
        if rem:
            raise LocalProtocolError(f"SLRU segment of {len(segment)} bytes is not whole pages")
        self._head(
            _V3_SLRU,
            _F_V3_SLRU,
            _V2_SLRU,
            _F_V2_SLRU,
            len(segment),
            lambda: (
                ResponseTag.GET_SLRU_SEGMENT,
                req.reqid,
                req.request_lsn,
                req.not_modified_since,
                int(req.kind),
                req.segno,
                n_blocks,
            ),
            (ResponseTag.GET_SLRU_SEGMENT, n_blocks),
        )
        self.buf += segment

    def write(self, resp: Response) -> None:
        match resp:
            case GetPageResponse():
                self.get_page(resp.request, resp.page)
            case ErrorResponse():
                self.error(resp, resp.message)
            case ExistsResponse():
                self.exists(resp.request, resp.exists)
            case NblocksResponse():
                self.nblocks(resp.request, resp.n_blocks)
            case DbSizeResponse():
                self.db_size(resp.request, resp.db_size)
            case GetSlruSegmentResponse():
                self.slru_segment(resp.request, resp.segment)
            case _:
                raise LocalProtocolError(f"not a pagestream response: {resp!r}")


def encode_response(resp: Response, version: PagestreamVersion) -> bytes:
    writer = ResponseWriter(version, framed=False)
    writer.write(resp)
    return bytes(writer.buf)


# ---------------------------------------------------------------------------------------------
# Responses: decoder (client side)


def _bad_response(msg: str) -> RemoteProtocolError:
    return RemoteProtocolError(msg, sqlstate=PROTOCOL_VIOLATION)


def _need(data: Buffer, size: int, what: str) -> None:
    if len(data) < size:
        raise _bad_response(f"truncated {what} response: {len(data)} bytes, need {size}")


def _cstr_message(data: Buffer, start: int) -> str:
    raw = bytes(data[start:])
    end = raw.find(b"\0")
    if end < 0:
        raise _bad_response("pagestream error message has no NUL terminator")
    return raw[:end].decode("utf-8", errors="replace")


_RESPONSE_FOR: Final[dict[int, int]] = {
    RequestTag.EXISTS: ResponseTag.EXISTS,
    RequestTag.NBLOCKS: ResponseTag.NBLOCKS,
    RequestTag.GET_PAGE: ResponseTag.GET_PAGE,
    RequestTag.DB_SIZE: ResponseTag.DB_SIZE,
    RequestTag.GET_SLRU_SEGMENT: ResponseTag.GET_SLRU_SEGMENT,
}


def decode_response(
    data: Buffer, version: PagestreamVersion, request: Request | None = None
) -> Response:
    """Decode one response payload.

    v3 rebuilds the echoed request; when ``request`` is given it must match (the compute
    PANICs on a mismatch; we raise). v2 responses carry no echo, so ``request`` is required.
    """
    _check_version(version)
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    if not view:
        raise _bad_response("empty pagestream response")
    tag = view[0]
    if version == 2:
        if request is None:
            raise LocalProtocolError("decoding a v2 response needs the request it answers")
        return _decode_v2_response(view, tag, request)
    resp = _decode_v3_response(view, tag)
    if request is not None:
        echoed: object = resp if isinstance(resp, ErrorResponse) else resp.request
        expected: object = (
            ErrorResponse.for_request(request, resp.message)
            if isinstance(resp, ErrorResponse)
            else request
        )
        if echoed != expected:
            raise _bad_response(f"response {resp!r} does not answer request {request!r}")
    return resp


def _decode_v3_response(view: memoryview, tag: int) -> Response:
    if tag == ResponseTag.GET_PAGE:
        _need(view, _V3_GET_PAGE.size + BLCKSZ, "GetPage")
        v = _V3_GET_PAGE.unpack_from(view)
        req = GetPageRequest(v[1], v[2], v[3], RelTag(v[4], v[5], v[6], v[7]), v[8])
        return GetPageResponse(req, view[_V3_GET_PAGE.size : _V3_GET_PAGE.size + BLCKSZ])
    if tag == ResponseTag.ERROR:
        _need(view, _V3_ERROR.size + 1, "Error")
        _, reqid, lsn, nms = _V3_ERROR.unpack_from(view)
        return ErrorResponse(reqid, lsn, nms, _cstr_message(view, _V3_ERROR.size))
    if tag == ResponseTag.EXISTS:
        _need(view, _V3_EXISTS.size, "Exists")
        v = _V3_EXISTS.unpack_from(view)
        return ExistsResponse(
            ExistsRequest(v[1], v[2], v[3], RelTag(v[4], v[5], v[6], v[7])), v[8] != 0
        )
    if tag == ResponseTag.NBLOCKS:
        _need(view, _V3_NBLOCKS.size, "Nblocks")
        v = _V3_NBLOCKS.unpack_from(view)
        return NblocksResponse(
            NblocksRequest(v[1], v[2], v[3], RelTag(v[4], v[5], v[6], v[7])), v[8]
        )
    if tag == ResponseTag.DB_SIZE:
        _need(view, _V3_DB_SIZE.size, "DbSize")
        v = _V3_DB_SIZE.unpack_from(view)
        return DbSizeResponse(DbSizeRequest(v[1], v[2], v[3], v[4]), v[5])
    if tag == ResponseTag.GET_SLRU_SEGMENT:
        _need(view, _V3_SLRU.size, "GetSlruSegment")
        v = _V3_SLRU.unpack_from(view)
        if v[4] > SlruKind.MULTIXACT_OFFSETS:
            raise _bad_response(f"invalid SLRU kind {v[4]}")
        size = v[6] * BLCKSZ
        _need(view, _V3_SLRU.size + size, "GetSlruSegment")
        slru_req = GetSlruSegmentRequest(v[1], v[2], v[3], SlruKind(v[4]), v[5])
        return GetSlruSegmentResponse(slru_req, view[_V3_SLRU.size : _V3_SLRU.size + size])
    raise _bad_response(f"unknown pagestream response tag {tag}")


def _decode_v2_response(view: memoryview, tag: int, request: Request) -> Response:
    if tag == ResponseTag.ERROR:
        _need(view, 2, "Error")
        return ErrorResponse.for_request(request, _cstr_message(view, 1))
    expected_tag = _RESPONSE_FOR[_request_values(request)[0]]
    if tag != expected_tag:
        raise _bad_response(f"response tag {tag} does not answer {type(request).__name__}")
    match request:
        case GetPageRequest():
            _need(view, 1 + BLCKSZ, "GetPage")
            return GetPageResponse(request, view[1 : 1 + BLCKSZ])
        case ExistsRequest():
            _need(view, _V2_EXISTS.size, "Exists")
            return ExistsResponse(request, _V2_EXISTS.unpack_from(view)[1] != 0)
        case NblocksRequest():
            _need(view, _V2_NBLOCKS.size, "Nblocks")
            return NblocksResponse(request, _V2_NBLOCKS.unpack_from(view)[1])
        case DbSizeRequest():
            _need(view, _V2_DB_SIZE.size, "DbSize")
            return DbSizeResponse(request, _V2_DB_SIZE.unpack_from(view)[1])
        case GetSlruSegmentRequest():
            _need(view, _V2_SLRU.size, "GetSlruSegment")
            size = _V2_SLRU.unpack_from(view)[1] * BLCKSZ
            _need(view, _V2_SLRU.size + size, "GetSlruSegment")
            return GetSlruSegmentResponse(request, view[_V2_SLRU.size : _V2_SLRU.size + size])
    raise LocalProtocolError(f"not a pagestream request: {request!r}")


# ---------------------------------------------------------------------------------------------
# Stream decoders (sans-IO, h11 vocabulary)


class _NeedData(enum.Enum):
    NEED_DATA = "NEED_DATA"


NEED_DATA: Final = _NeedData.NEED_DATA


class StreamEnd(enum.Enum):
    """How the compute ended the stream: both are clean ends."""

    COPY_DONE = "CopyDone"
    TERMINATE = "Terminate"


# During COPY PostgreSQL ignores Flush and Sync; anything else but CopyData/CopyDone/CopyFail/
# Terminate is "unexpected message during COPY".
_IGNORED_DURING_COPY: Final = frozenset(b"HS")
MAX_REQUEST_MESSAGE_LEN: Final = 64 * 1024
MAX_RESPONSE_MESSAGE_LEN: Final = 2 * 1024 * 1024


class RequestStreamDecoder:
    """The server's reader of frontend messages during a pagestream CopyBoth.

    ``receive_data(b"")`` signals EOF; ``next_event()`` then returns ``StreamEnd.TERMINATE``
    once the buffer is drained, or raises if EOF cut a message in half. After an exception the
    decoder is dead (every later call re-raises it): the stream cannot be resynchronised.
    """

    __slots__ = ("_buf", "_eof", "_error", "_layouts", "_v3", "version")

    def __init__(self, version: PagestreamVersion, initial: Buffer = b"") -> None:
        _check_version(version)
        self.version = version
        self._v3 = version == 3
        self._layouts = _REQ_V3 if self._v3 else _REQ_V2
        self._buf = ReceiveBuffer()
        self._buf.append(initial)
        self._eof = False
        self._error: RemoteProtocolError | None = None

    def receive_data(self, data: Buffer) -> None:
        if self._eof and data:
            raise LocalProtocolError("receive_data after EOF")
        if not data:
            self._eof = True
        else:
            self._buf.append(data)

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def next_event(self) -> Request | StreamEnd | _NeedData:
        if self._error is not None:
            raise self._error
        try:
            return self._next_event()
        except RemoteProtocolError as exc:
            self._error = exc
            raise

    def _next_event(self) -> Request | StreamEnd | _NeedData:
        buf = self._buf
        while True:
            have = len(buf)
            if have < 5:
                if self._eof:
                    if have:
                        raise RemoteProtocolError(
                            "connection closed in the middle of a message",
                            sqlstate=PROTOCOL_VIOLATION,
                        )
                    return StreamEnd.TERMINATE
                return NEED_DATA
            tag_b, length = buf.unpack_from(_COPY_HDR)
            assert isinstance(tag_b, bytes) and isinstance(length, int)
            if length < 4 or length > MAX_REQUEST_MESSAGE_LEN:
                raise RemoteProtocolError(
                    f"bad message length {length}", sqlstate=PROTOCOL_VIOLATION
                )
            if have < length + 1:
                if self._eof:
                    raise RemoteProtocolError(
                        "connection closed in the middle of a message", sqlstate=PROTOCOL_VIOLATION
                    )
                return NEED_DATA
            tag = tag_b[0]
            if tag == 0x64:  # 'd' CopyData
                size = length - 4
                if size == 0:
                    buf.consume(length + 1)
                    raise _bad_request("empty pagestream request")
                req_tag = buf.byte_at(5)
                st = self._layouts.get(req_tag)
                if st is None:
                    buf.consume(length + 1)
                    raise _bad_request(f"invalid tag {req_tag}")
                if size < st.size:
                    buf.consume(length + 1)
                    raise _bad_request(
                        f"truncated pagestream request (tag {req_tag}): {size} bytes, need {st.size}"
                    )
                values = buf.unpack_from(st, 5)
                buf.consume(length + 1)  # trailing bytes inside the CopyData are ignored
                return _build_request(req_tag, values, self._v3)
            buf.consume(length + 1)
            if tag == 0x63:  # 'c' CopyDone
                return StreamEnd.COPY_DONE
            if tag == 0x58:  # 'X' Terminate
                return StreamEnd.TERMINATE
            if tag in _IGNORED_DURING_COPY:
                continue
            if tag == 0x66:  # 'f' CopyFail
                raise RemoteProtocolError("client sent CopyFail", sqlstate=INTERNAL_ERROR)
            raise RemoteProtocolError(
                f"unexpected message {tag_b!r} during COPY", sqlstate=PROTOCOL_VIOLATION
            )


@attrs.frozen
class BackendMessage:
    """A backend message the client saw during the stream that is not CopyData."""

    tag: bytes
    payload: bytes


class ResponseStreamDecoder:
    """The client's splitter of backend messages during a pagestream: CopyData payloads are
    returned as ``bytes`` (decode them with ``decode_response`` and the matching request), any
    other message (ErrorResponse, CopyDone, ReadyForQuery...) as ``BackendMessage``."""

    __slots__ = ("_buf", "_eof")

    def __init__(self, initial: Buffer = b"") -> None:
        self._buf = ReceiveBuffer()
        self._buf.append(initial)
        self._eof = False

    def receive_data(self, data: Buffer) -> None:
        if not data:
            self._eof = True
        else:
            self._buf.append(data)

    def next_event(self) -> bytes | BackendMessage | _NeedData:
        buf = self._buf
        have = len(buf)
        if have >= 5:
            tag_b, length = buf.unpack_from(_COPY_HDR)
            assert isinstance(tag_b, bytes) and isinstance(length, int)
            if length < 4 or length > MAX_RESPONSE_MESSAGE_LEN:
                raise _bad_response(f"bad message length {length}")
            if have >= length + 1:
                buf.consume(5)
                payload = buf.take(length - 4)
                if tag_b == _COPY:
                    return payload
                return BackendMessage(tag_b, payload)
        if self._eof:
            raise _bad_response("server closed the connection" + (" mid-message" if have else ""))
        return NEED_DATA
