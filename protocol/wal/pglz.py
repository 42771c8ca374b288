"""PostgreSQL's pglz format (``common/pg_lzcompress.c``): decompression, and a compressor for tests.

Full-page images in WAL may be pglz-compressed (``wal_compression = pglz``). The stream is a
sequence of groups: one control byte, then up to eight items, read least significant bit
first. A clear bit is one literal byte. A set bit is a back-reference tag of two or three
bytes: ``len = (b0 & 0x0F) + 3`` (18 means "add the third byte"), ``off = (b0 & 0xF0) << 4 |
b1``. A back-reference may overlap the bytes it produces (run-length encoding), so a copy
shorter than its distance is a plain slice and a longer one repeats the last ``off`` bytes.

The compressor is a greedy matcher that emits the same format; PostgreSQL's decoder accepts
it. It exists so tests and the WAL encoder can produce pglz images without a PostgreSQL.
"""

from __future__ import annotations

from protocol.errors import RemoteProtocolError

_MAX_MATCH = 273  # 18 + 255
_MAX_OFFSET = 0x0FFF
_MIN_MATCH = 3


class PglzError(RemoteProtocolError):
    """The compressed bytes are corrupt (PostgreSQL: "could not decompress image")."""


def pglz_decompress(src: bytes | memoryview, raw_size: int) -> bytes:
    """Decompress ``src``; the output must be exactly ``raw_size`` bytes and use all of ``src``.

    That is PostgreSQL's ``check_complete = true`` mode, the one WAL image restore uses.
    """
    out = bytearray()
    sp = 0
    srcend = len(src)
    # Index the source once as bytes: item access on bytes yields ints without a method call.
    data = bytes(src)
    while sp < srcend and len(out) < raw_size:
        ctrl = data[sp]
        sp += 1
        for _ in range(8):
            if sp >= srcend or len(out) >= raw_size:
                break
            if ctrl & 1:
                if sp + 2 > srcend:
                    raise PglzError("pglz: truncated back-reference tag")
                b0 = data[sp]
                length = (b0 & 0x0F) + 3
                off = ((b0 & 0xF0) << 4) | data[sp + 1]
                sp += 2
                if length == 18:
                    if sp >= srcend:
                        raise PglzError("pglz: truncated extended length")
                    length += data[sp]
                    sp += 1
                if off == 0 or off > len(out):
                    raise PglzError(f"pglz: back-reference offset {off} outside the output")
                length = min(length, raw_size - len(out))
                start = len(out) - off
                if length <= off:
                    out += out[start : start + length]
                else:
                    # An overlapping copy repeats the last ``off`` bytes.
                    pattern = bytes(out[start:])
                    reps, rest = divmod(length, off)
                    out += pattern * reps + pattern[:rest]
            else:
                out.append(data[sp])
                sp += 1
            ctrl >>= 1
    if len(out) != raw_size or sp != srcend:
        raise PglzError(
            f"pglz: decompressed {len(out)} of {raw_size} bytes using {sp} of {srcend} input bytes"
        )
    return bytes(out)


def pglz_compress(raw: bytes) -> bytes:
    """Compress ``raw`` into pglz format with a greedy 3-byte-prefix matcher.

    Unlike PostgreSQL this never refuses incompressible input; the caller decides whether
    the result is worth keeping (PostgreSQL stores an image compressed only if it got smaller).
    """
    out = bytearray()
    n = len(raw)
    last_pos: dict[bytes, int] = {}
    i = 0
    while i < n:
        ctrl_at = len(out)
        out.append(0)
        ctrl = 0
        for bit in range(8):
            if i >= n:
                break
            best_len = 0
            best_off = 0
            if i + _MIN_MATCH <= n:
                key = raw[i : i + _MIN_MATCH]
                cand = last_pos.get(key)
                if cand is not None and i - cand <= _MAX_OFFSET:
                    limit = min(_MAX_MATCH, n - i)
                    length = _MIN_MATCH
                    while length < limit and raw[cand + length] == raw[i + length]:
                        length += 1
                    best_len, best_off = length, i - cand
                last_pos[key] = i
            if best_len >= _MIN_MATCH:
                ctrl |= 1 << bit
                if best_len < 18:
                    out += bytes((((best_off >> 4) & 0xF0) | (best_len - 3), best_off & 0xFF))
                else:
                    out += bytes(
                        (((best_off >> 4) & 0xF0) | 0x0F, best_off & 0xFF, best_len - 18)
                    )
                # Remember prefixes inside the match too, so later data can refer to them.
                for j in range(i + 1, min(i + best_len, n - _MIN_MATCH + 1)):
                    last_pos[raw[j : j + _MIN_MATCH]] = j
                i += best_len
            else:
                out.append(raw[i])
                i += 1
        out[ctrl_at] = ctrl
    return bytes(out)
