"""PostgreSQL v3 wire messages, both directions, as frozen values with their codecs.

Every message class has ``encode(buf)`` (appends the whole framed message to a
``WriteBuffer``) and ``decode(reader)`` (parses the *body*, framing already stripped by the
decoders in ``protocol.pgwire.decoder``). Frontend = sent by clients, backend = sent by
servers; ``CopyData`` and ``CopyDone`` travel both ways and belong to both unions.

Untagged startup packets (``SSLRequest``, ``GSSENCRequest``, ``CancelRequest``,
``StartupMessage``) start with their length and a 32-bit request code instead of a tag.

Decoding rule: a body must be consumed exactly; leftover or missing bytes, unknown
enumerations and invalid UTF-8 are the peer's fault (``RemoteProtocolError``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, Final

import attrs

from protocol.buffer import U32, Reader, WriteBuffer
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.pgwire import sqlstate

PROTOCOL_VERSION_3: Final = 196608  # 3 << 16 | 0
SSL_REQUEST_CODE: Final = 80877103
GSSENC_REQUEST_CODE: Final = 80877104
CANCEL_REQUEST_CODE: Final = 80877102

# Data type OIDs we use in RowDescription.
OID_BOOL: Final = 16
OID_BYTEA: Final = 17
OID_INT8: Final = 20
OID_INT4: Final = 23
OID_TEXT: Final = 25
OID_OID: Final = 26


def _text_list(r: Reader) -> tuple[str, ...]:
    out: list[str] = []
    while (s := r.cstr()) != "":
        out.append(s)
    return tuple(out)


def _u16_count(n: int, what: str) -> int:
    if n > 0xFFFF:
        raise LocalProtocolError(f"too many {what}: {n} > 65535")
    return n


# ---------------------------------------------------------------------------------------------
# Untagged startup packets (frontend)
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class SSLRequest:
    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(None)
        buf.write_u32(SSL_REQUEST_CODE)
        buf.end_message()


@attrs.frozen
class GSSENCRequest:
    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(None)
        buf.write_u32(GSSENC_REQUEST_CODE)
        buf.end_message()


@attrs.frozen
class CancelRequest:
    process_id: int
    secret_key: int

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(None)
        buf.write_u32(CANCEL_REQUEST_CODE)
        buf.write_i32(self.process_id)
        buf.write_i32(self.secret_key)
        buf.end_message()


@attrs.frozen
class StartupMessage:
    """The first real packet: protocol version and ``name=value`` parameters (user, database,
    options, application_name, replication, ...)."""

    parameters: dict[str, str]
    protocol_version: int = PROTOCOL_VERSION_3

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(None)
        buf.write_u32(self.protocol_version)
        for name, value in self.parameters.items():
            if not name:
                raise LocalProtocolError("startup parameter name cannot be empty")
            buf.write_cstr(name)
            buf.write_cstr(value)
        buf.write_u8(0)
        buf.end_message()

    @classmethod
    def decode_parameters(cls, r: Reader, protocol_version: int) -> StartupMessage:
        params: dict[str, str] = {}
        while (name := r.cstr()) != "":
            if name in params:
                raise RemoteProtocolError(f"duplicate startup parameter {name!r}")
            params[name] = r.cstr()
        r.expect_end()
        return cls(params, protocol_version)

    @property
    def options(self) -> dict[str, str]:
        """The ``options`` parameter parsed into ``name=value`` pairs (see ``parse_options``)."""
        return parse_options(self.parameters.get("options", ""))


def split_options(text: str) -> list[str]:
    """Split like PostgreSQL's ``pg_split_opts``: whitespace separates, backslash escapes."""
    tokens: list[str] = []
    cur: list[str] = []
    in_token = False
    escaped = False
    for ch in text:
        if escaped:
            cur.append(ch)
            escaped = False
            in_token = True
        elif ch == "\\":
            escaped = True
            in_token = True
        elif ch.isspace():
            if in_token:
                tokens.append("".join(cur))
                cur.clear()
                in_token = False
        else:
            cur.append(ch)
            in_token = True
    if escaped:
        raise RemoteProtocolError(
            "startup options end with a lone backslash", sqlstate=sqlstate.INVALID_PARAMETER_VALUE
        )
    if in_token:
        tokens.append("".join(cur))
    return tokens


def parse_options(text: str) -> dict[str, str]:
    """Parse a startup ``options`` string into settings.

    Accepts PostgreSQL's ``-c name=value``, ``-cname=value`` and ``--name=value`` (dashes in
    the name become underscores, as PostgreSQL does), and Neon's bare ``name=value`` tokens
    following a ``-c`` (``-c tenant_id=X timeline_id=Y``). Anything else is refused.
    """
    out: dict[str, str] = {}
    tokens = split_options(text)
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if tok == "-c":
            if i >= len(tokens):
                raise RemoteProtocolError(
                    "startup options: -c without a setting",
                    sqlstate=sqlstate.INVALID_PARAMETER_VALUE,
                )
            tok = tokens[i]
            i += 1
        elif tok.startswith(("-c", "--")):
            tok = tok[2:]
        name, eq, value = tok.partition("=")
        if not eq or not name or name.startswith("-"):
            raise RemoteProtocolError(
                f"startup options: cannot parse {tok!r} (expected -c name=value)",
                sqlstate=sqlstate.INVALID_PARAMETER_VALUE,
            )
        out[name.replace("-", "_")] = value
    return out


# ---------------------------------------------------------------------------------------------
# Tagged frontend messages
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class PasswordMessage:
    """``p``: the cleartext password (or token) answering AuthenticationCleartextPassword."""

    TAG: ClassVar[bytes] = b"p"
    password: str

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write_cstr(self.password)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> PasswordMessage:
        return cls(r.cstr())


@attrs.frozen
class Query:
    TAG: ClassVar[bytes] = b"Q"
    query: str

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write_cstr(self.query)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> Query:
        return cls(r.cstr())


@attrs.frozen
class Terminate:
    TAG: ClassVar[bytes] = b"X"

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> Terminate:
        return cls()


@attrs.frozen
class CopyData:
    """``d``: one chunk of a COPY stream; ``data`` is the sub-protocol payload."""

    TAG: ClassVar[bytes] = b"d"
    data: bytes

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write(self.data)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> CopyData:
        return cls(r.rest())


@attrs.frozen
class CopyDone:
    TAG: ClassVar[bytes] = b"c"

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> CopyDone:
        return cls()


@attrs.frozen
class CopyFail:
    TAG: ClassVar[bytes] = b"f"
    message: str

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write_cstr(self.message)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> CopyFail:
        return cls(r.cstr())


@attrs.frozen
class Sync:
    TAG: ClassVar[bytes] = b"S"

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> Sync:
        return cls()


@attrs.frozen
class Flush:
    TAG: ClassVar[bytes] = b"H"

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> Flush:
        return cls()


@attrs.frozen
class Parse:
    TAG: ClassVar[bytes] = b"P"
    statement: str
    query: str
    param_types: tuple[int, ...] = ()

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write_cstr(self.statement)
        buf.write_cstr(self.query)
        buf.write_u16(_u16_count(len(self.param_types), "parameter types"))
        for oid in self.param_types:
            buf.write_u32(oid)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> Parse:
        statement = r.cstr()
        query = r.cstr()
        n = r.u16()
        return cls(statement, query, tuple(r.u32() for _ in range(n)))


@attrs.frozen
class Bind:
    TAG: ClassVar[bytes] = b"B"
    portal: str
    statement: str
    param_formats: tuple[int, ...] = ()
    params: tuple[bytes | None, ...] = ()
    result_formats: tuple[int, ...] = ()

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write_cstr(self.portal)
        buf.write_cstr(self.statement)
        buf.write_u16(_u16_count(len(self.param_formats), "parameter formats"))
        for f in self.param_formats:
            buf.write_i16(f)
        buf.write_u16(_u16_count(len(self.params), "parameters"))
        for p in self.params:
            if p is None:
                buf.write_i32(-1)
            else:
                buf.write_i32(len(p))
                buf.write(p)
        buf.write_u16(_u16_count(len(self.result_formats), "result formats"))
        for f in self.result_formats:
            buf.write_i16(f)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> Bind:
        portal = r.cstr()
        statement = r.cstr()
        param_formats = tuple(r.i16() for _ in range(r.u16()))
        params: list[bytes | None] = []
        for _ in range(r.u16()):
            n = r.i32()
            if n == -1:
                params.append(None)
            elif n < 0:
                raise RemoteProtocolError(f"Bind: invalid parameter length {n}")
            else:
                params.append(r.bytes(n))
        result_formats = tuple(r.i16() for _ in range(r.u16()))
        return cls(portal, statement, param_formats, tuple(params), result_formats)


def _check_kind(kind: str, what: str) -> str:
    if kind not in ("S", "P"):
        raise RemoteProtocolError(f"{what}: kind must be 'S' or 'P', got {kind!r}")
    return kind


@attrs.frozen
class Describe:
    TAG: ClassVar[bytes] = b"D"
    kind: str  # "S" statement or "P" portal
    name: str

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write(self.kind.encode("ascii"))
        buf.write_cstr(self.name)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> Describe:
        kind = _check_kind(chr(r.u8()), "Describe")
        return cls(kind, r.cstr())


@attrs.frozen
class Execute:
    TAG: ClassVar[bytes] = b"E"
    portal: str
    max_rows: int = 0

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write_cstr(self.portal)
        buf.write_i32(self.max_rows)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> Execute:
        return cls(r.cstr(), r.i32())


@attrs.frozen
class Close:
    TAG: ClassVar[bytes] = b"C"
    kind: str  # "S" statement or "P" portal
    name: str

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write(self.kind.encode("ascii"))
        buf.write_cstr(self.name)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> Close:
        kind = _check_kind(chr(r.u8()), "Close")
        return cls(kind, r.cstr())


# ---------------------------------------------------------------------------------------------
# Backend messages
# ---------------------------------------------------------------------------------------------

AUTH_OK: Final = 0
AUTH_CLEARTEXT_PASSWORD: Final = 3
AUTH_MD5_PASSWORD: Final = 5
AUTH_SASL: Final = 10
_AUTH_UNSUPPORTED_NAMES: Final = {
    2: "KerberosV5",
    6: "SCMCredential",
    7: "GSS",
    8: "GSSContinue",
    9: "SSPI",
    11: "SASLContinue",
    12: "SASLFinal",
}


@attrs.frozen
class AuthenticationOk:
    TAG: ClassVar[bytes] = b"R"

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write_i32(AUTH_OK)
        buf.end_message()


@attrs.frozen
class AuthenticationCleartextPassword:
    TAG: ClassVar[bytes] = b"R"

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write_i32(AUTH_CLEARTEXT_PASSWORD)
        buf.end_message()


@attrs.frozen
class AuthenticationMD5Password:
    TAG: ClassVar[bytes] = b"R"
    salt: bytes = attrs.field(validator=attrs.validators.min_len(4))

    def encode(self, buf: WriteBuffer) -> None:
        if len(self.salt) != 4:
            raise LocalProtocolError("MD5 salt must be 4 bytes")
        buf.new_message(self.TAG)
        buf.write_i32(AUTH_MD5_PASSWORD)
        buf.write(self.salt)
        buf.end_message()


@attrs.frozen
class AuthenticationSASL:
    TAG: ClassVar[bytes] = b"R"
    mechanisms: tuple[str, ...]

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write_i32(AUTH_SASL)
        for m in self.mechanisms:
            if not m:
                raise LocalProtocolError("empty SASL mechanism name")
            buf.write_cstr(m)
        buf.write_u8(0)
        buf.end_message()


Authentication = (
    AuthenticationOk | AuthenticationCleartextPassword | AuthenticationMD5Password | AuthenticationSASL
)


def _decode_authentication(r: Reader) -> Authentication:
    code = r.i32()
    if code == AUTH_OK:
        return AuthenticationOk()
    if code == AUTH_CLEARTEXT_PASSWORD:
        return AuthenticationCleartextPassword()
    if code == AUTH_MD5_PASSWORD:
        return AuthenticationMD5Password(r.bytes(4))
    if code == AUTH_SASL:
        return AuthenticationSASL(_text_list(r))
    name = _AUTH_UNSUPPORTED_NAMES.get(code, "unknown")
    raise RemoteProtocolError(
        f"unsupported authentication request {code} ({name})",
        sqlstate=sqlstate.FEATURE_NOT_SUPPORTED,
    )


@attrs.frozen
class ParameterStatus:
    TAG: ClassVar[bytes] = b"S"
    name: str
    value: str

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write_cstr(self.name)
        buf.write_cstr(self.value)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> ParameterStatus:
        return cls(r.cstr(), r.cstr())


@attrs.frozen
class BackendKeyData:
    TAG: ClassVar[bytes] = b"K"
    process_id: int
    secret_key: int

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write_i32(self.process_id)
        buf.write_i32(self.secret_key)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> BackendKeyData:
        return cls(r.i32(), r.i32())


TRANSACTION_STATUSES: Final = ("I", "T", "E")


@attrs.frozen
class ReadyForQuery:
    """``Z``: the server is idle; ``status`` is I (idle), T (in transaction), E (failed)."""

    TAG: ClassVar[bytes] = b"Z"
    status: str = "I"

    def encode(self, buf: WriteBuffer) -> None:
        if self.status not in TRANSACTION_STATUSES:
            raise LocalProtocolError(f"bad transaction status {self.status!r}")
        buf.new_message(self.TAG)
        buf.write(self.status.encode("ascii"))
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> ReadyForQuery:
        status = chr(r.u8())
        if status not in TRANSACTION_STATUSES:
            raise RemoteProtocolError(f"ReadyForQuery: bad transaction status {status!r}")
        return cls(status)


@attrs.frozen
class FieldDescription:
    name: str
    type_oid: int = OID_TEXT
    table_oid: int = 0
    column_attnum: int = 0
    type_size: int = -1
    type_modifier: int = -1
    format: int = 0  # 0 text, 1 binary


@attrs.frozen
class RowDescription:
    TAG: ClassVar[bytes] = b"T"
    fields: tuple[FieldDescription, ...]

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write_u16(_u16_count(len(self.fields), "columns"))
        for f in self.fields:
            buf.write_cstr(f.name)
            buf.write_u32(f.table_oid)
            buf.write_i16(f.column_attnum)
            buf.write_u32(f.type_oid)
            buf.write_i16(f.type_size)
            buf.write_i32(f.type_modifier)
            buf.write_i16(f.format)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> RowDescription:
        fields = []
        for _ in range(r.u16()):
            name = r.cstr()
            fields.append(
                FieldDescription(
                    name=name,
                    table_oid=r.u32(),
                    column_attnum=r.i16(),
                    type_oid=r.u32(),
                    type_size=r.i16(),
                    type_modifier=r.i32(),
                    format=r.i16(),
                )
            )
        return cls(tuple(fields))


@attrs.frozen
class DataRow:
    """``D``: one row; each value is the column's text (or binary) bytes, or None for NULL."""

    TAG: ClassVar[bytes] = b"D"
    values: tuple[bytes | None, ...]

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write_u16(_u16_count(len(self.values), "columns"))
        for v in self.values:
            if v is None:
                buf.write_i32(-1)
            else:
                buf.write_i32(len(v))
                buf.write(v)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> DataRow:
        values: list[bytes | None] = []
        for _ in range(r.u16()):
            n = r.i32()
            if n == -1:
                values.append(None)
            elif n < 0:
                raise RemoteProtocolError(f"DataRow: invalid column length {n}")
            else:
                values.append(r.bytes(n))
        return cls(tuple(values))


@attrs.frozen
class CommandComplete:
    TAG: ClassVar[bytes] = b"C"
    tag: str

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write_cstr(self.tag)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> CommandComplete:
        return cls(r.cstr())


@attrs.frozen
class EmptyQueryResponse:
    TAG: ClassVar[bytes] = b"I"

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> EmptyQueryResponse:
        return cls()


def _encode_fields(buf: WriteBuffer, fields: tuple[tuple[str, str], ...]) -> None:
    for code, value in fields:
        if len(code) != 1 or code == "\0":
            raise LocalProtocolError(f"error field code must be one non-NUL char, got {code!r}")
        buf.write(code.encode("ascii"))
        buf.write_cstr(value)
    buf.write_u8(0)


def _decode_fields(r: Reader) -> tuple[tuple[str, str], ...]:
    fields: list[tuple[str, str]] = []
    while (code := r.u8()) != 0:
        if code >= 0x80:
            raise RemoteProtocolError(f"{r.what}: non-ASCII field code {code:#x}")
        fields.append((chr(code), r.cstr()))
    return tuple(fields)


class _FieldsMixin:
    """Accessors shared by ErrorResponse and NoticeResponse (fields keyed by one char)."""

    __slots__ = ()
    fields: tuple[tuple[str, str], ...]

    def get(self, code: str, default: str = "") -> str:
        for c, v in self.fields:
            if c == code:
                return v
        return default

    @property
    def severity(self) -> str:
        # 'V' is the non-localized severity (9.6+); 'S' may be translated.
        return self.get("V") or self.get("S")

    @property
    def sqlstate(self) -> str:
        return self.get("C")

    @property
    def message(self) -> str:
        return self.get("M")

    @property
    def detail(self) -> str:
        return self.get("D")

    @property
    def hint(self) -> str:
        return self.get("H")


def _build_fields(
    message: str, code: str, severity: str, detail: str | None, hint: str | None
) -> tuple[tuple[str, str], ...]:
    fields = [("S", severity), ("V", severity), ("C", code), ("M", message)]
    if detail:
        fields.append(("D", detail))
    if hint:
        fields.append(("H", hint))
    return tuple(fields)


@attrs.frozen
class ErrorResponse(_FieldsMixin):
    """``E``: fields such as S/V severity, C SQLSTATE, M message, D detail, H hint."""

    TAG: ClassVar[bytes] = b"E"
    fields: tuple[tuple[str, str], ...]

    @classmethod
    def build(
        cls,
        message: str,
        code: str = sqlstate.INTERNAL_ERROR,
        *,
        severity: str = "ERROR",
        detail: str | None = None,
        hint: str | None = None,
    ) -> ErrorResponse:
        return cls(_build_fields(message, code, severity, detail, hint))

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        _encode_fields(buf, self.fields)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> ErrorResponse:
        return cls(_decode_fields(r))


@attrs.frozen
class NoticeResponse(_FieldsMixin):
    TAG: ClassVar[bytes] = b"N"
    fields: tuple[tuple[str, str], ...]

    @classmethod
    def build(
        cls,
        message: str,
        code: str = sqlstate.SUCCESSFUL_COMPLETION,
        *,
        severity: str = "NOTICE",
        detail: str | None = None,
        hint: str | None = None,
    ) -> NoticeResponse:
        return cls(_build_fields(message, code, severity, detail, hint))

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        _encode_fields(buf, self.fields)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> NoticeResponse:
        return cls(_decode_fields(r))


def _encode_copy_response(
    buf: WriteBuffer, tag: bytes, fmt: int, column_formats: tuple[int, ...]
) -> None:
    buf.new_message(tag)
    buf.write_u8(fmt)
    buf.write_u16(_u16_count(len(column_formats), "columns"))
    for f in column_formats:
        buf.write_i16(f)
    buf.end_message()


def _decode_copy_response(r: Reader) -> tuple[int, tuple[int, ...]]:
    fmt = r.u8()
    if fmt > 1:
        raise RemoteProtocolError(f"{r.what}: bad copy format {fmt}")
    return fmt, tuple(r.i16() for _ in range(r.u16()))


@attrs.frozen
class CopyInResponse:
    TAG: ClassVar[bytes] = b"G"
    format: int = 0
    column_formats: tuple[int, ...] = ()

    def encode(self, buf: WriteBuffer) -> None:
        _encode_copy_response(buf, self.TAG, self.format, self.column_formats)

    @classmethod
    def decode(cls, r: Reader) -> CopyInResponse:
        return cls(*_decode_copy_response(r))


@attrs.frozen
class CopyOutResponse:
    TAG: ClassVar[bytes] = b"H"
    format: int = 0
    column_formats: tuple[int, ...] = ()

    def encode(self, buf: WriteBuffer) -> None:
        _encode_copy_response(buf, self.TAG, self.format, self.column_formats)

    @classmethod
    def decode(cls, r: Reader) -> CopyOutResponse:
        return cls(*_decode_copy_response(r))


@attrs.frozen
class CopyBothResponse:
    TAG: ClassVar[bytes] = b"W"
    format: int = 0
    column_formats: tuple[int, ...] = ()

    def encode(self, buf: WriteBuffer) -> None:
        _encode_copy_response(buf, self.TAG, self.format, self.column_formats)

    @classmethod
    def decode(cls, r: Reader) -> CopyBothResponse:
        return cls(*_decode_copy_response(r))


@attrs.frozen
class ParseComplete:
    TAG: ClassVar[bytes] = b"1"

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> ParseComplete:
        return cls()


@attrs.frozen
class BindComplete:
    TAG: ClassVar[bytes] = b"2"

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> BindComplete:
        return cls()


@attrs.frozen
class CloseComplete:
    TAG: ClassVar[bytes] = b"3"

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> CloseComplete:
        return cls()


@attrs.frozen
class NoData:
    TAG: ClassVar[bytes] = b"n"

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> NoData:
        return cls()


@attrs.frozen
class PortalSuspended:
    TAG: ClassVar[bytes] = b"s"

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> PortalSuspended:
        return cls()


@attrs.frozen
class ParameterDescription:
    TAG: ClassVar[bytes] = b"t"
    param_types: tuple[int, ...]

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write_u16(_u16_count(len(self.param_types), "parameter types"))
        for oid in self.param_types:
            buf.write_u32(oid)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> ParameterDescription:
        return cls(tuple(r.u32() for _ in range(r.u16())))


@attrs.frozen
class NotificationResponse:
    TAG: ClassVar[bytes] = b"A"
    process_id: int
    channel: str
    payload: str

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write_i32(self.process_id)
        buf.write_cstr(self.channel)
        buf.write_cstr(self.payload)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> NotificationResponse:
        return cls(r.i32(), r.cstr(), r.cstr())


@attrs.frozen
class NegotiateProtocolVersion:
    TAG: ClassVar[bytes] = b"v"
    newest_minor: int
    unrecognized_options: tuple[str, ...] = ()

    def encode(self, buf: WriteBuffer) -> None:
        buf.new_message(self.TAG)
        buf.write_i32(self.newest_minor)
        buf.write_i32(len(self.unrecognized_options))
        for name in self.unrecognized_options:
            buf.write_cstr(name)
        buf.end_message()

    @classmethod
    def decode(cls, r: Reader) -> NegotiateProtocolVersion:
        minor = r.i32()
        n = r.i32()
        if n < 0 or n > r.remaining:
            raise RemoteProtocolError(f"NegotiateProtocolVersion: bad option count {n}")
        return cls(minor, tuple(r.cstr() for _ in range(n)))


# ---------------------------------------------------------------------------------------------
# Unions and helpers
# ---------------------------------------------------------------------------------------------

StartupPacket = SSLRequest | GSSENCRequest | CancelRequest | StartupMessage

FrontendMessage = (
    SSLRequest
    | GSSENCRequest
    | CancelRequest
    | StartupMessage
    | PasswordMessage
    | Query
    | Terminate
    | CopyData
    | CopyDone
    | CopyFail
    | Sync
    | Flush
    | Parse
    | Bind
    | Describe
    | Execute
    | Close
)

BackendMessage = (
    AuthenticationOk
    | AuthenticationCleartextPassword
    | AuthenticationMD5Password
    | AuthenticationSASL
    | ParameterStatus
    | BackendKeyData
    | ReadyForQuery
    | RowDescription
    | DataRow
    | CommandComplete
    | EmptyQueryResponse
    | ErrorResponse
    | NoticeResponse
    | CopyInResponse
    | CopyOutResponse
    | CopyBothResponse
    | CopyData
    | CopyDone
    | ParseComplete
    | BindComplete
    | CloseComplete
    | NoData
    | PortalSuspended
    | ParameterDescription
    | NotificationResponse
    | NegotiateProtocolVersion
)

Message = FrontendMessage | BackendMessage


def encode(*messages: Message) -> bytes:
    """Frame and concatenate messages (one ``send_all`` worth)."""
    buf = WriteBuffer()
    for m in messages:
        m.encode(buf)
    return buf.take()


def encode_all(messages: Iterable[Message]) -> bytes:
    buf = WriteBuffer()
    for m in messages:
        m.encode(buf)
    return buf.take()


_COPY_DATA_TAG: Final = b"d"


def encode_copy_data(payload: bytes | bytearray | memoryview) -> bytes:
    """One CopyData frame without building a message object (hot path)."""
    return _COPY_DATA_TAG + U32.pack(len(payload) + 4) + bytes(payload)


def append_copy_data(out: bytearray, payload: bytes | bytearray | memoryview) -> None:
    """Append one CopyData frame to ``out`` (batching many frames into one send_all)."""
    out += _COPY_DATA_TAG
    out += U32.pack(len(payload) + 4)
    out += payload
