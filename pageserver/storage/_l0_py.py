"""The L0 writer's packing of a frozen in-memory layer: the reference (pure-Python twin) of
``_l0_c.pyx``.

``pack_values`` turns the in-memory layer's index, flattened in key order, into what an L0
delta layer file holds: the values' bytes back to back (the data section) and one 42-byte
index entry per value (``layer_file.ENTRY``: key 18 | lsn 8 | pos 8 | len 4 | crc32c 4, all
big-endian, ``pos = file offset << 1 | will_init``). The arguments:

- ``keys``: the layer's keys, sorted, 18 bytes each, joined;
- ``counts``: per key, how many values it has (``array('Q')``, at least one each);
- ``triples``: every value's ``(lsn, offset << 1 | will_init, length)``, key after key, each
  key's in LSN order (``array('Q')``; the in-memory index arrays joined in key order);
- ``src``: the frozen layer's bytes (the ephemeral file, read or mapped whole); a value's
  offset and length are relative to it;
- ``(key_at, sub)``: where to start, the ``sub``-th value of key ``key_at`` (a cursor the call
  returns, so a layer is packed in pieces of bounded size);
- ``data_offset``: the file offset the first packed value goes to;
- ``max_bytes``: stop before a value whose bytes would take the piece past this (the first
  value is always taken, however big);
- ``[lsn_start, lsn_end)``: the layer's LSN range; every value must lie in it.

Returns ``(data, entries, key_at, sub)``: the piece's values, their entries, and the cursor
after them (``key_at == len(counts)`` once everything is packed).

Checks (``ValueError``, the same message from both implementations, in this order): the
shapes (key bytes, counts against triples, a key without values), the cursor and the offsets'
range, then per value as it is reached: keys strictly rising (at a key's first value), the
piece's size, the LSN inside the layer and strictly above the key's value before it, the length
fitting an index entry, the bytes inside ``src``. Values past where the piece stops are checked
by the call that packs them; nothing is returned from a call that fails.
"""

from __future__ import annotations

import struct
from array import array
from typing import TYPE_CHECKING, Final

from crc32c import crc32c

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["ENTRY_SIZE", "IMPL", "pack_values"]

IMPL: Final = "python"
ENTRY_SIZE: Final = 42
_KEY_SIZE: Final = 18
# after the 18-byte key: lsn, pos, len, crc32c
_TAIL: Final = struct.Struct(">QQII")
_LIMIT: Final = 1 << 62
_MAX_LENGTH: Final = 1 << 32


def pack_values(
    keys: Buffer,
    counts: array[int],
    triples: array[int],
    src: Buffer,
    key_at: int,
    sub: int,
    data_offset: int,
    max_bytes: int,
    lsn_start: int,
    lsn_end: int,
) -> tuple[bytes, bytes, int, int]:
    """See the module docstring."""
    # (the views are released on the way out, an error's too: ``src`` may be an mmap its
    # owner closes right after the call)
    with memoryview(keys) as k0, k0.cast("B") as kv, memoryview(src) as s0, s0.cast("B") as sv:
        return _pack(kv, counts, triples, sv, key_at, sub, data_offset, max_bytes, lsn_start, lsn_end)


def _pack(
    kv: memoryview,
    counts: array[int],
    triples: array[int],
    sv: memoryview,
    key_at: int,
    sub: int,
    data_offset: int,
    max_bytes: int,
    lsn_start: int,
    lsn_end: int,
) -> tuple[bytes, bytes, int, int]:
    n_keys = len(counts)
    if len(kv) != _KEY_SIZE * n_keys:
        raise ValueError(f"pack_values: {len(kv)} key bytes for {n_keys} keys")
    total = 0
    for i, count in enumerate(counts):
        if count == 0:
            raise ValueError(f"pack_values: key {i} has no values")
        total += count
    if len(triples) % 3 or total != len(triples) // 3:
        raise ValueError(f"pack_values: the counts add up to {total} values, the triples hold {len(triples)} numbers")
    if not 0 <= key_at <= n_keys or sub < 0 or (sub >= counts[key_at] if key_at < n_keys else sub != 0):
        raise ValueError(f"pack_values: cursor ({key_at}, {sub}) outside the index")
    if not 0 <= data_offset < _LIMIT or not 0 <= max_bytes < _LIMIT:
        raise ValueError(f"pack_values: data_offset {data_offset} or max_bytes {max_bytes} out of range")
    src_len = len(sv)
    v = sum(counts[:key_at]) + sub
    pieces: list[bytes] = []
    entries: list[bytes] = []
    out = 0
    n = 0
    pack = _TAIL.pack
    k = key_at
    while k < n_keys:
        key = bytes(kv[_KEY_SIZE * k : _KEY_SIZE * (k + 1)])
        if sub == 0 and k > 0 and bytes(kv[_KEY_SIZE * (k - 1) : _KEY_SIZE * k]) >= key:
            raise ValueError(f"pack_values: keys out of order at key {k}")
        count = counts[k]
        stopped = False
        while sub < count:
            lsn, pos, length = triples[3 * v], triples[3 * v + 1], triples[3 * v + 2]
            if n > 0 and (out >= max_bytes or length > max_bytes - out):
                stopped = True
                break
            if lsn < lsn_start or lsn >= lsn_end:
                raise ValueError(f"pack_values: value {v}: LSN {lsn:X} outside [{lsn_start:X}, {lsn_end:X})")
            if sub > 0 and lsn <= triples[3 * v - 3]:
                raise ValueError(f"pack_values: value {v}: LSN {lsn:X} not above the one before")
            if length >= _MAX_LENGTH:
                raise ValueError(f"pack_values: value {v}: {length} bytes do not fit an index entry")
            off = pos >> 1
            if length > src_len or off > src_len - length:
                raise ValueError(f"pack_values: value {v}: {length} bytes at {off} outside the layer's {src_len} bytes")
            blob = bytes(sv[off : off + length])
            pieces.append(blob)
            entries.append(key + pack(lsn, ((data_offset + out) << 1) | (pos & 1), length, crc32c(blob)))
            out += length
            n += 1
            sub += 1
            v += 1
        if stopped:
            break
        k += 1
        sub = 0
    return b"".join(pieces), b"".join(entries), k, sub
