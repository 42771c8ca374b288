"""Wire-message kernels in pure Python: the reference twin of ``protocol/_pq_c.pyx``.

Same names, signatures and results (errors included) as the compiled module; the tests run
both on the same bytes (tests/protocol/test_native_pq.py). ``protocol._native`` decides which
one pagestore uses (``PAGESTORE_PURE_PYTHON=1`` selects this one).

- ``coalesce_appends(payloads, k, max_bytes)``: the safekeeper's receive path. From
  ``payloads[k]`` on (CopyData payloads of a walproposer's push stream), the longest run of
  well-formed v3 AppendRequests that continue each other (same term and generation, each
  ``begin_lsn`` the previous ``end_lsn``), holding at most ``max_bytes`` of WAL in all.
  Returns ``(count, term, generation, begin_lsn, end_lsn, commit_lsn, truncate_lsn, wal)``:
  ``commit_lsn`` and ``truncate_lsn`` are the run's maxima (what the acceptor keeps of a
  sequence of appends), ``wal`` the run's WAL in one bytes object. ``count`` < 2 means
  "nothing to coalesce here" (then the other fields are 0 and ``wal`` empty): the caller
  decodes ``payloads[k]`` alone, which also reports what is wrong with a malformed message.
  "Well-formed" is exactly ``protocol.safekeeper.decode_proposer_message``'s fast path.
- ``take_frames(data, start, end, tag, max_length, limit)``: PostgreSQL framing of the complete
  messages with ``tag`` in ``data[start:end]`` (tag byte, then a big-endian length that counts
  itself), their bodies as zero-copy ``memoryview``s of ``data`` (at most ``limit``), and the
  index after the last one. It stops before the first message with another tag, a length
  outside ``4..max_length`` or one not all in ``data[start:end]`` (the caller's decoder reports
  bad lengths). ``protocol.buffer.ReceiveBuffer.take_frames`` is its caller.
- ``take_append_run(data, start, end, max_length, out, max_bytes)``: the safekeeper's receive
  path in one pass over the receive buffer. From ``data[start:end]`` (raw pgwire bytes), the
  longest run of complete CopyData messages (tag ``d``, length in ``4..max_length``) whose
  payloads are well-formed v3 AppendRequests continuing each other (as ``coalesce_appends``),
  with at most ``min(max_bytes, len(out))`` bytes of WAL; their WAL is copied into ``out``
  from offset 0 (``out`` is a writable buffer the caller reuses; it must not overlap
  ``data``). Returns ``(stop, count, term, generation, begin_lsn, end_lsn, commit_lsn,
  truncate_lsn)``: ``stop`` is the index after the last message taken, the WAL is
  ``out[:end_lsn - begin_lsn]``. ``count`` 0 (then ``stop == start`` and the other fields 0)
  means the first message is not one the run takes (another tag or message, incomplete,
  malformed, or more WAL than fits): the caller's general decoder handles it, and reports
  what is wrong with it. No object is made per message.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["IMPL", "coalesce_appends", "take_append_run", "take_frames"]

IMPL: Final = "python"

# protocol.safekeeper's constants (this module stays a leaf; the tests check they agree)
TAG_APPEND: Final = 0x61
V3_APPEND_HEADER: Final = struct.Struct(">BIQQQQQ")  # tag, generation, term, begin, end, commit, truncate
MAX_SEND_SIZE: Final = 16 * 8192

_NOTHING: Final = (0, 0, 0, 0, 0, 0, 0, b"")
_TAG_LEN: Final = struct.Struct("!BI")


def take_frames(
    data: Buffer, start: int, end: int, tag: int, max_length: int, limit: int
) -> tuple[list[memoryview], int]:
    """See the module docstring."""
    size = len(memoryview(data).cast("B"))
    if not 0 <= start <= end <= size:
        raise ValueError(f"frame range [{start}, {end}) is not inside {size} bytes")
    if not 0 <= tag <= 255 or max_length < 0 or limit < 0:
        raise ValueError(f"bad tag {tag}, max_length {max_length} or limit {limit}")
    unpack = _TAG_LEN.unpack_from
    out: list[memoryview] = []
    base: memoryview | None = None
    while end - start >= 5 and len(out) < limit:
        msg_tag, length = unpack(data, start)
        stop = start + 1 + length
        if msg_tag != tag or length < 4 or length > max_length or stop > end:
            break
        if base is None:
            # One export for the batch: its slices share it, so the array's reference
            # count stays raised while any of them lives.
            base = memoryview(data).cast("B")
        out.append(base[start + 5 : stop])
        start = stop
    return out, start


def coalesce_appends(
    payloads: Sequence[Buffer], k: int, max_bytes: int
) -> tuple[int, int, int, int, int, int, int, bytes]:
    """See the module docstring."""
    if not 0 <= k <= len(payloads):
        raise IndexError(f"start {k} outside {len(payloads)} payloads")
    if max_bytes < 0:
        raise ValueError(f"max_bytes {max_bytes} is negative")
    unpack = V3_APPEND_HEADER.unpack_from
    hsize = V3_APPEND_HEADER.size
    parts: list[memoryview] = []
    total = 0
    term = generation = first = last_end = commit = trunc = 0
    for j in range(k, len(payloads)):
        data = memoryview(payloads[j]).cast("B")
        if len(data) < hsize or data[0] != TAG_APPEND:
            break
        _, gen, t, begin, end, c, tr = unpack(data, 0)
        if end < begin or end - begin > MAX_SEND_SIZE or len(data) < hsize + end - begin:
            break
        if parts:
            if gen != generation or t != term or begin != last_end or total + (end - begin) > max_bytes:
                break
            commit = max(commit, c)
            trunc = max(trunc, tr)
        else:
            generation, term, first, commit, trunc = gen, t, begin, c, tr
        parts.append(data[hsize : hsize + end - begin])
        total += end - begin
        last_end = end
    if len(parts) < 2:
        return _NOTHING
    return len(parts), term, generation, first, last_end, commit, trunc, b"".join(parts)


_NO_RUN: Final = (0, 0, 0, 0, 0, 0)


def take_append_run(
    data: Buffer, start: int, end: int, max_length: int, out: Buffer, max_bytes: int
) -> tuple[int, int, int, int, int, int, int, int]:
    """See the module docstring."""
    src = memoryview(data).cast("B")
    size = len(src)
    if not 0 <= start <= end <= size:
        raise ValueError(f"frame range [{start}, {end}) is not inside {size} bytes")
    if max_length < 0 or max_bytes < 0:
        raise ValueError(f"bad max_length {max_length} or max_bytes {max_bytes}")
    dst = memoryview(out).cast("B")
    if dst.readonly:
        raise TypeError("take_append_run needs a writable output buffer")
    cap = min(max_bytes, len(dst))
    frame = _TAG_LEN.unpack_from
    header = V3_APPEND_HEADER.unpack_from
    hsize = V3_APPEND_HEADER.size
    pos = start
    count = total = 0
    term = generation = first = last_end = commit = trunc = 0
    while end - pos >= 5:
        tag, length = frame(src, pos)
        # remaining-count form, as take_frames: the whole message must be in data[pos:end]
        if tag != 0x64 or length < 4 or length > max_length or length > end - pos - 1:
            break
        body = pos + 5
        body_len = length - 4
        if body_len < hsize or src[body] != TAG_APPEND:
            break
        _, gen, t, begin, stop, c, tr = header(src, body)
        if stop < begin or stop - begin > MAX_SEND_SIZE or body_len - hsize < stop - begin:
            break
        n = stop - begin
        if count:
            if gen != generation or t != term or begin != last_end or total + n > cap:
                break
            commit = max(commit, c)
            trunc = max(trunc, tr)
        else:
            if n > cap:
                break
            generation, term, first, commit, trunc = gen, t, begin, c, tr
        dst[total : total + n] = src[body + hsize : body + hsize + n]
        total += n
        last_end = stop
        count += 1
        pos = body + body_len
    if not count:
        return (start, 0, *_NO_RUN)
    return pos, count, term, generation, first, last_end, commit, trunc
