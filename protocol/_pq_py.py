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
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["IMPL", "coalesce_appends"]

IMPL: Final = "python"

# protocol.safekeeper's constants (this module stays a leaf; the tests check they agree)
TAG_APPEND: Final = 0x61
V3_APPEND_HEADER: Final = struct.Struct(">BIQQQQQ")  # tag, generation, term, begin, end, commit, truncate
MAX_SEND_SIZE: Final = 16 * 8192

_NOTHING: Final = (0, 0, 0, 0, 0, 0, 0, b"")


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
