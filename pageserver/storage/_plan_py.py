"""A vectored read's planning in one persistent layer, from its cached index blocks: the
reference (pure-Python twin) of ``_plan_c.pyx``.

``plan_cached`` does for a sorted list of distinct keys what the layer's walk step needs:

1. **Search.** Cut the keys into runs of consecutive keys; for each run find its index entries
   (bisect the layer's fences for the first block, bisect in the block, follow into the next
   blocks while the run goes on). Every block must be in the block cache (``blocks``, the
   ``IndexBlockCache``'s LRU dict, touched on every hit); if one is not, nothing is planned
   and the result is ``None`` (the caller then reads the index with ``await``).
2. **Plan.** One pass over the found entries, *backwards* (per key that is newest first, the
   order its values are taken in): a key is done in this layer at its first will_init entry,
   or at the first entry below ``floor`` or at/below its cached LSN; entries at or above
   ``cont`` are skipped. Each taken blob gets the next slot (``blobs`` gets its (offset,
   length, crc), the key's ``pending`` its (lsn, slot)); it joins the read being grown when it
   ends where that read starts, up to ``max_bytes``; each finished read is checked to lie in
   ``[data_start, data_end)`` (``EntryOutsideData(offset, length)`` if not) and appended to
   ``reads`` as (reader, offset, total, first slot, count).

Returns ``(blocks hit, keys completed)``. The compiled kernel takes the same arguments and
gives the same results and errors (tests/pageserver/test_native_plan.py); it reads each block's
``raw`` entries where this twin reads its decoded lists (both from the same bytes).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, Final, Protocol

__all__ = ["ENTRY_SIZE", "IMPL", "EntryOutsideData", "plan_cached"]

IMPL: Final = "python"
# one index entry: key 18 | lsn 8 | pos 8 | len 4 | crc32c 4 (layer_file.ENTRY)
ENTRY_SIZE: Final = 42
_KEY_SIZE: Final = 18
_ZERO_LSN: Final = bytes(8)
_ALL_LSNS_END: Final = b"\xff" * 9  # above every (key, lsn) prefix of the same key


class EntryOutsideData(ValueError):
    """A planned read does not lie in the layer's data section; args: (offset, length)."""


class _Block(Protocol):
    raw: bytes
    prefixes: list[bytes]
    keys: list[bytes]
    lsns: list[int]
    positions: list[int]
    lengths: list[int]
    crcs: list[int]


class _State(Protocol):
    complete: bool
    cached_lsn: int
    pending: list[tuple[int, Any]] | None


def _runs(keys: Sequence[bytes]) -> list[tuple[bytes, bytes]]:
    """Sorted distinct keys -> inclusive (first, last) runs of consecutive keys."""
    if not keys:
        return []
    first = keys[0]
    if len(keys) == 1:
        return [(first, first)]
    prev = int.from_bytes(first, "big")
    if int.from_bytes(keys[-1], "big") - prev == len(keys) - 1:
        return [(first, keys[-1])]
    runs: list[tuple[bytes, bytes]] = []
    start = last = first
    for key in keys[1:]:
        value = int.from_bytes(key, "big")
        if value != prev + 1:
            runs.append((start, last))
            start = key
        prev = value
        last = key
    runs.append((start, last))
    return runs


def plan_cached(
    fences: Sequence[bytes],
    n_blocks: int,
    blocks: MutableMapping[tuple[int, int], Any],
    file_id: int,
    keys: Sequence[bytes],
    floor: int,
    cont: int,
    states: Mapping[Any, Any],
    blobs: list[tuple[int, int, int]],
    reads: list[tuple[Any, int, int, int, int]],
    reader: object,
    max_bytes: int,
    data_start: int,
    data_end: int,
) -> tuple[int, int] | None:
    move_to_end = getattr(blocks, "move_to_end", None)
    for key in keys:
        if not isinstance(key, bytes) or len(key) != _KEY_SIZE:
            raise ValueError("keys must be 18-byte bytes")
    scanned: list[list[tuple[_Block, int, int]]] = []
    hits = 0
    # 1. search: every run's entries, or None at the first block the cache lacks
    for first, last in _runs(keys):
        start, end = first + _ZERO_LSN, last + _ALL_LSNS_END
        blkno = bisect.bisect_right(fences, start) - 1
        if blkno < 0:
            blkno = 0
        ident = (file_id, blkno)
        block = blocks.get(ident)
        if block is None:
            return None
        if move_to_end is not None:
            move_to_end(ident)
        hits += 1
        prefixes = _prefixes(block)
        lo = bisect.bisect_left(prefixes, start)
        hi = bisect.bisect_left(prefixes, end, lo)
        runs = [(block, lo, hi)] if hi > lo else []
        # rarely, the run goes on in the next blocks
        while hi == len(prefixes) and blkno + 1 < n_blocks and fences[blkno + 1] < end:
            blkno += 1
            ident = (file_id, blkno)
            block = blocks.get(ident)
            if block is None:
                return None
            if move_to_end is not None:
                move_to_end(ident)
            hits += 1
            prefixes = _prefixes(block)
            hi = bisect.bisect_left(prefixes, end)
            if hi:
                runs.append((block, 0, hi))
        scanned.append(runs)
    # 2. plan, backwards
    slot = len(blobs)
    rd_start = rd_end = -1  # the read being grown: [rd_start, rd_end), blobs from rd_slot
    rd_slot = slot
    completed = 0
    pending: list[tuple[int, Any]] = []
    for runs in reversed(scanned):
        cur = b""
        done = True
        cached = -1
        st: _State | None = None
        for block, lo, hi in reversed(runs):
            bkeys, lsns, positions = block.keys, block.lsns, block.positions
            lengths, crcs = block.lengths, block.crcs
            for i in range(hi - 1, lo - 1, -1):
                key = bkeys[i]
                if key != cur:
                    cur = key
                    st = states[key]
                    done = st.complete
                    cached = st.cached_lsn
                    got = st.pending
                    if got is None:
                        raise AssertionError("blob planned for a non-deferring key")
                    pending = got
                if done:
                    continue
                lsn = lsns[i]
                if lsn >= cont:
                    continue
                if lsn < floor or lsn <= cached:
                    done = True  # and so are the key's older entries
                    continue
                pos = positions[i]
                off = pos >> 1
                length = lengths[i]
                if off + length != rd_start or rd_end - off > max_bytes:
                    if rd_start >= 0:
                        _check(rd_start, rd_end - rd_start, data_start, data_end)
                        reads.append((reader, rd_start, rd_end - rd_start, rd_slot, slot - rd_slot))
                    rd_end = off + length
                    rd_slot = slot
                rd_start = off
                blobs.append((off, length, crcs[i]))
                pending.append((lsn, slot))
                slot += 1
                if pos & 1:
                    assert st is not None
                    st.complete = done = True
                    completed += 1
    if rd_start >= 0:
        _check(rd_start, rd_end - rd_start, data_start, data_end)
        reads.append((reader, rd_start, rd_end - rd_start, rd_slot, slot - rd_slot))
    return hits, completed


def _prefixes(block: _Block) -> list[bytes]:
    """The block's sorted prefixes, once its raw entries are checked to be what they decode."""
    raw = block.raw
    if not isinstance(raw, bytes):
        raise TypeError("an index block's raw entries must be bytes")
    prefixes = block.prefixes
    if len(raw) != len(prefixes) * ENTRY_SIZE:
        raise ValueError("an index block's raw entries do not match its decoded entries")
    return prefixes


def _check(offset: int, length: int, data_start: int, data_end: int) -> None:
    if offset < data_start or offset + length > data_end:
        raise EntryOutsideData(offset, length)
