"""The WAL run pre-check's claims and its child process (no trio: the child starts in ~70 ms).

A bulk load writes runs of like records on a WAL page (INSERTs into one heap page: the same
``xl_tot_len``, ``xl_xid``, ``xl_info``, ``xl_rmid`` and 22 layout bytes); the ingest's
fused path checks such a run in a few batched C calls (``walingest._same_run``). The
pre-check does those byte checks ahead of the ingest, in a child process, so the ingest's
core only looks the answer up. This module owns:

- ``find_runs`` / ``RunFinder`` (pure, no IO): the claims about one buffer / a stream of
  receiver pieces; ``check_claims``: are an answer's claims well formed;
- the wire format and the child (``python -m pageserver.wal_runs``: ``_serve``).

``pageserver.wal_precheck`` is the pageserver's side (``WalPrecheck``, trio).

The claim (the ingest's correctness rests on it; docs/wal-precheck.md): ``(start, last,
stride)`` with ``n = (last - start) // stride + 1 >= 2`` records R_i at ``start + i*stride``
asserts about the bytes the child received: every R_i lies inside the 8 KiB WAL page holding
``start`` and inside the bytes received; ``xl_tot_len(R_0) >= 46`` and ``stride ==
MAXALIGN(xl_tot_len(R_0))``; bytes [0:8), [16:20) and [24:46) of each R_i equal R_0's;
``xl_prev(R_i) == start + (i-1)*stride`` for i >= 1; every R_i's CRC-32C is right. Nothing
about R_0's ``xl_prev``: a claim is a pure function of the bytes at those LSNs, whatever walk
found ``start``; so any stretch of >= 2 of a claim's records is a claim too (the ingest may
enter a run in the middle). The walk over pages and records only decides where to look;
hostile bytes give fewer claims, never a false one, never an exception.

Wire format (little-endian, stdin/stdout pipes): the child's first answer bytes are
``"WPRy"`` (ready: its imports are done); request ``"WPRq" u64 base u32 len u32
ring_offset``; the piece's ``len`` bytes are at ``ring_offset`` in a shared ring (a memfd the
child maps: copying a piece there costs the ingest's core ~4 µs, a 128 KiB pipe write ~30),
or, when ``ring_offset`` is ``0xFFFFFFFF`` (the ring is full of unanswered pieces), follow
the header on the pipe. Answer ``"WPRs" u64 base u32 len u32 crc32c(data) u32 n`` then ``n``
u64 starts, ``n`` u64 lasts, ``n`` u64 strides. The child answers every request in order; a
piece's ring bytes are not reused before ``result`` has taken its answer.

Test seams (child flags, ``WalPrecheck(worker_args=...)``): ``--stall-s S`` delays every
answer; ``--garble N`` corrupts the Nth answer's magic; ``--misanswer N`` answers the Nth
request with another base; ``--bad-claim N`` adds a malformed claim to the Nth answer;
``--die-after N`` exits after answering N requests.
"""

from __future__ import annotations

import argparse
import mmap
import os
import struct
import sys
import time
from array import array
from collections.abc import Sequence
from functools import lru_cache
from itertools import islice, repeat
from operator import add, and_, ge, lt, mod, sub, xor

import attrs

from common.child_io import open_pipes, read_exact, start_watchdog
from protocol.lsn import WAL_SEGMENT_SIZE, XLOG_BLCKSZ
from protocol.wal import crc as _crcmod
from protocol.wal.page import XLOG_PAGE_MAGIC, XLP_FIRST_IS_CONTRECORD, XLP_LONG_HEADER
from protocol.wal.record import SIZE_OF_XLOG_RECORD

__all__ = [
    "ANSWER_HEADER",
    "ANSWER_MAGIC",
    "INLINE",
    "MAX_LSN",
    "MAX_PIECE",
    "MIN_STRIDE",
    "PAGE_MASK",
    "READY_MAGIC",
    "REQUEST_HEADER",
    "REQUEST_MAGIC",
    "RING_SIZE",
    "RUN_HEAD_SIZE",
    "RunClaims",
    "RunFinder",
    "check_claims",
    "encode_answer",
    "find_runs",
    "main",
]

PAGE_MASK = XLOG_BLCKSZ - 1
_SHORT_PHD, _LONG_PHD = 24, 40
# The bytes a run's records share besides the header: walingest's SIMPLE_HEADERS (22 bytes).
RUN_HEAD_SIZE = SIZE_OF_XLOG_RECORD + 22
# The smallest stride a claim can have: MAXALIGN(46).
MIN_STRIDE = (RUN_HEAD_SIZE + 7) & ~7
# xlp_magic, xlp_info, (xlp_tli), xlp_pageaddr, xlp_rem_len
_PAGE = struct.Struct("<HH4xQI")
_U32 = struct.Struct("<I")
MAX_LSN = (1 << 64) - 1

if array("Q").itemsize != 8:  # pragma: no cover - every platform we run on
    raise ImportError("array('Q') is not 8 bytes here: the pre-check's answer format needs it")


@lru_cache(maxsize=2048)
def _batch(one: str, gap: int, count: int) -> struct.Struct:
    """``count`` times ``one`` with ``gap`` pad bytes between two (none after the last: an
    unpack never reads past the last record)."""
    return struct.Struct("<" + f"{gap}x".join([one] * count))


@attrs.frozen(slots=True)
class RunClaims:
    """The claims about one piece: claim ``j`` is ``(starts[j], lasts[j], strides[j])``
    (absolute LSNs; sorted by start, non-overlapping; see the module docstring)."""

    starts: array[int] = attrs.field(factory=lambda: array("Q"))
    lasts: array[int] = attrs.field(factory=lambda: array("Q"))
    strides: array[int] = attrs.field(factory=lambda: array("Q"))

    def __len__(self) -> int:
        return len(self.starts)

    def triples(self) -> list[tuple[int, int, int]]:
        return list(zip(self.starts, self.lasts, self.strides, strict=True))

    def records(self) -> int:
        """How many records the claims cover."""
        return sum((last - start) // stride + 1 for start, last, stride in self.triples())


def find_runs(
    buf: bytes, buf_lsn: int, segment_size: int = WAL_SEGMENT_SIZE, out: RunClaims | None = None
) -> RunClaims:
    """The claims about ``buf`` (WAL bytes from ``buf_lsn`` on): every run of >= 2 like
    records on each page whose header is in ``buf`` (module docstring). Any bytes are
    accepted: garbage gives no claims. ``segment_size`` must be a power of two >= 8 KiB."""
    claims = RunClaims() if out is None else out
    end = buf_lsn + len(buf)
    if buf_lsn < 0 or end > MAX_LSN:
        return claims
    seg_mask = segment_size - 1
    page = (buf_lsn + PAGE_MASK) & ~PAGE_MASK
    if page != buf_lsn:
        # (nothing before the first page header can be walked; from there on, every record
        # is 8-aligned in the buffer, so the u64/u32 views below see its fields)
        if page >= end:
            return claims
        buf = bytes(buf[page - buf_lsn :])
        buf_lsn = page
    view = memoryview(buf)
    words = view[: len(buf) & ~7].cast("Q"), view[: len(buf) & ~3].cast("I")
    unpack_page = _PAGE.unpack_from
    while page + _SHORT_PHD <= end:
        at = page - buf_lsn
        magic, info, addr, rem_len = unpack_page(buf, at)
        long = not page & seg_mask
        size = _LONG_PHD if long else _SHORT_PHD
        if (
            magic == XLOG_PAGE_MAGIC
            and addr == page
            and bool(info & XLP_LONG_HEADER) == long
            and page + size <= end
        ):
            first = at + size
            if info & XLP_FIRST_IS_CONTRECORD:
                first += (rem_len + 7) & ~7
            _walk_page(buf, buf_lsn, first, min(at + XLOG_BLCKSZ, len(buf)), claims, words)
        page += XLOG_BLCKSZ
    return claims


def _walk_page(
    buf: bytes, buf_lsn: int, o: int, limit: int, claims: RunClaims, words: tuple[memoryview, memoryview]
) -> None:
    """Claim the runs among the records from offset ``o`` on that end by ``limit`` (the page's
    end or the buffer's, whichever comes first)."""
    unpack_u32 = _U32.unpack_from
    while o + RUN_HEAD_SIZE <= limit:
        tot_len = unpack_u32(buf, o)[0]
        if tot_len < SIZE_OF_XLOG_RECORD or o + tot_len > limit:
            return
        stride = (tot_len + 7) & ~7
        # R_1..R_k fit: R_k ends at o + k*stride + tot_len <= limit
        k = (limit - o - tot_len) // stride
        nxt = o + stride
        if (
            k
            and tot_len >= RUN_HEAD_SIZE
            and buf[o : o + 8] == buf[nxt : nxt + 8]
            and buf[o + 24 : o + RUN_HEAD_SIZE] == buf[nxt + 24 : nxt + RUN_HEAD_SIZE]
        ):
            o += _claim_runs(buf, buf_lsn, o, tot_len, stride, k, claims, words) * stride
        else:
            o += stride


def _claim_runs(
    buf: bytes,
    buf_lsn: int,
    o: int,
    tot_len: int,
    stride: int,
    k: int,
    claims: RunClaims,
    words: tuple[memoryview, memoryview],
) -> int:
    """Claim the runs among R_0 (at offset ``o``) and the ``k`` record slots after it at
    ``stride`` (they fit the page), run after run while the next run's first record has the
    same ``xl_tot_len``; returns how many records were dealt with (the walk goes on after them).

    Batched as ``walingest._same_run``, but once for all the runs of a page, and with as few
    Python objects per record as it takes: the fixed-size fields are strided columns of the
    buffer's u64 / u32 views (``xl_prev`` against the chain, (xl_tot_len, xl_xid) and
    (xl_info, xl_rmid, pad) against R_0's: C compares; objects per slot only when they
    differ somewhere), the 22 layout bytes one struct unpack at the stride with the prefix of
    like ones per run by ``tuple.count``, one ``crc32c`` map over the runs' records."""
    q, w = words
    n = k + 1
    start = buf_lsn + o
    s8, s4 = stride >> 3, stride >> 2
    r8, r4 = o >> 3, o >> 2
    # every slot's first 46 bytes are in the buffer: the last slot's record ends by ``limit``
    cols: list[tuple[object, ...]] = [_batch("22s", stride - 22, n).unpack_from(buf, o + 24)]
    h8 = q[r8 : r8 + n * s8 : s8]
    if h8 != array("Q", (h8[0],)) * n:
        cols.append(_batch("8s", stride - 8, n).unpack_from(buf, o))
    irp = w[r4 + 4 : r4 + 4 + n * s4 : s4]
    if irp != array("I", (irp[0],)) * n:
        cols.append(_batch("4s", stride - 4, n).unpack_from(buf, o + 16))
    # slots whose xl_prev is not the slot before (none in a well-formed page; a record there
    # cannot extend a run)
    prevs = q[r8 + 1 + s8 : r8 + 1 + n * s8 : s8]
    chain = array("Q", range(start, start + k * stride, stride))
    unlinked: tuple[int, ...] = ()
    if prevs != chain:
        unlinked = tuple(i + 1 for i, (x, y) in enumerate(zip(prevs.tolist(), chain, strict=True)) if x != y)
    runs: list[tuple[int, int]] = []
    a = 0
    while a < k:
        if a and w[r4 + a * s4] != tot_len:
            break  # another length: the walk goes on from this record
        m = k - a  # like records after R_a
        for col in cols:
            rest = col[a + 1 :]
            want = col[a]
            same = rest.count(want)
            if same != len(rest) and rest[:same].count(want) != same:
                same = _prefix(rest, want)
            if same < m:
                m = same
        for i in unlinked:
            if a < i <= a + m:
                m = i - a - 1
                break
        if m:
            runs.append((a, a + m))
            a += m + 1
        else:
            a += 1
    # (a == k: the last slot is left to the walk, its length unchecked; a == n: a run ended it)
    if runs:
        first, last = runs[0][0], runs[-1][1]
        crc32c = _crcmod.crc32c
        pieces = _crc_batch(tot_len, stride, last - first + 1).unpack_from(buf, o + first * stride)
        crcs = list(map(crc32c, pieces[0::2], map(crc32c, pieces[1::2])))
        want_crcs = w[r4 + 5 + first * s4 : r4 + 5 + (last + 1) * s4 : s4].tolist()
        ok = crcs == want_crcs
        for r0, r1 in runs:
            if ok:
                _add(claims, start + r0 * stride, start + r1 * stride, stride)
                continue
            # a bad CRC splits the run: claim each stretch of >= 2 good records
            i = r0
            while i <= r1:
                j = i
                while j <= r1 and crcs[j - first] == want_crcs[j - first]:
                    j += 1
                if j - i >= 2:
                    _add(claims, start + i * stride, start + (j - 1) * stride, stride)
                i = j + 1
    return a


def _add(claims: RunClaims, start: int, last: int, stride: int) -> None:
    claims.starts.append(start)
    claims.lasts.append(last)
    claims.strides.append(stride)


@lru_cache(maxsize=2048)
def _crc_batch(tot_len: int, stride: int, count: int) -> struct.Struct:
    """The two CRC pieces of ``count`` records: bytes [0:20) and [24:tot_len) of each."""
    return _batch(f"20s4x{tot_len - SIZE_OF_XLOG_RECORD}s", stride - tot_len, count)


def _prefix(col: Sequence[object], want: object) -> int:
    for i, x in enumerate(col):
        if x != want:
            return i
    return len(col)


class RunFinder:
    """``find_runs`` over the WAL receiver's pieces (any start and length): a piece that
    continues the previous one (``base`` == its end) is walked together with the previous
    piece's incomplete last page (claims about that page's records may repeat); any other
    piece drops that carry, and a page it starts in the middle of is skipped (no header)."""

    def __init__(self, segment_size: int = WAL_SEGMENT_SIZE) -> None:
        if segment_size < XLOG_BLCKSZ or segment_size & (segment_size - 1):
            raise ValueError(f"WAL segment size {segment_size} is not a power of two >= {XLOG_BLCKSZ}")
        self.segment_size = segment_size
        self._carry = b""
        self._carry_lsn = 0
        self._end: int | None = None

    def walked_from(self, base: int) -> int:
        """Where the buffer of a piece at ``base`` would start (its claims start there or
        later): the carried page's start, or ``base``."""
        return self._carry_lsn if self._carry and base == self._end else base

    def feed(self, base: int, data: bytes) -> RunClaims:
        if self._carry and base == self._end:
            buf = self._carry + data
            buf_lsn = self._carry_lsn
        else:
            buf = bytes(data)
            buf_lsn = base
        end = base + len(data)
        self._end = end
        claims = find_runs(buf, buf_lsn, self.segment_size)
        last_page = end & ~PAGE_MASK
        if end & PAGE_MASK and last_page >= buf_lsn:
            self._carry = buf[last_page - buf_lsn :]
            self._carry_lsn = last_page
        else:
            self._carry = b""
        return claims


# -- the wire ------------------------------------------------------------------------------

REQUEST_MAGIC = b"WPRq"
ANSWER_MAGIC = b"WPRs"
READY_MAGIC = b"WPRy"  # the child's first 4 bytes: its imports are done, it reads requests
REQUEST_HEADER = struct.Struct("<4sQII")
# ``ring_offset`` of a request whose bytes follow on the pipe
INLINE = 0xFFFF_FFFF
# The shared ring the pieces travel through (a memfd both map): copying 128 KiB there costs
# ~4 µs against ~30 µs for a pipe write of it, on the ingest's core.
RING_SIZE = 4 << 20
ANSWER_HEADER = struct.Struct("<4sQIII")
# The largest piece: the receiver's are <= 128 KiB; anything far bigger is a garbled header.
MAX_PIECE = 16 << 20


def encode_answer(base: int, length: int, crc: int, claims: RunClaims) -> bytes:
    return (
        ANSWER_HEADER.pack(ANSWER_MAGIC, base, length, crc, len(claims.starts))
        + claims.starts.tobytes()
        + claims.lasts.tobytes()
        + claims.strides.tobytes()
    )


def check_claims(claims: RunClaims, low: int, high: int) -> str | None:
    """Why ``claims`` are not well formed for a buffer of WAL [low, high), or ``None``.
    Runs on the ingest's core for every answer: C loops (``map``) over the columns; the
    first bad claim is looked for one by one only when a column is wrong."""
    starts, lasts, strides = claims.starts, claims.lasts, claims.strides
    if not (len(starts) == len(lasts) == len(strides)):
        return "claim columns of different lengths"
    if not starts:
        return None
    spans = list(map(sub, lasts, starts))
    # R_last's end - 1 is at least last + stride - 8 (its length is > stride - 8)
    tails = list(map(add, lasts, map(sub, strides, repeat(8))))
    if (
        min(strides) >= MIN_STRIDE
        and max(strides) <= XLOG_BLCKSZ
        and not any(map(and_, strides, repeat(7)))
        and all(map(ge, spans, strides))
        and not any(map(mod, spans, strides))
        and all(map(lt, lasts, islice(starts, 1, None)))
        and starts[0] >= low
        and max(tails) < high
        and max(map(xor, tails, starts)) <= PAGE_MASK
    ):
        return None
    prev_end = -1
    for start, last, stride in zip(starts, lasts, strides, strict=True):
        if stride < MIN_STRIDE or stride & 7 or stride > XLOG_BLCKSZ:
            return f"claim {start:X}: bad stride {stride}"
        if last < start + stride or (last - start) % stride:
            return f"claim {start:X}..{last:X}: last is not start + k*stride, k >= 1"
        if start <= prev_end:
            return f"claim {start:X}: not after the previous claim (ends {prev_end:X})"
        tail = last + stride - 8
        if start < low or tail >= high or tail & ~PAGE_MASK != start & ~PAGE_MASK:
            return f"claim {start:X}..{last:X}/{stride} outside the page or the piece [{low:X}, {high:X})"
        prev_end = last
    raise AssertionError("check_claims: the columns failed but no claim did")  # pragma: no cover


# -- the child -----------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    start_watchdog(args.parent_pid, "precheck-watchdog")
    stdin, out = open_pipes()
    finder = RunFinder(args.segment_size)
    ring = mmap.mmap(args.ring_fd, args.ring_size) if args.ring_fd is not None else None
    crc32c = _crcmod.crc32c
    answered = 0
    os.write(out, READY_MAGIC)
    while True:
        header = read_exact(stdin, REQUEST_HEADER.size)
        if header is None:
            return 0  # the pageserver closed the pipe: done
        magic, base, length, at = REQUEST_HEADER.unpack(header)
        if (
            magic != REQUEST_MAGIC
            or length > MAX_PIECE
            or base + length > MAX_LSN
            or (at != INLINE and (ring is None or at + length > len(ring)))
        ):
            print(f"wal_runs: bad request header {bytes(header)!r}", file=sys.stderr)
            return 2
        if at != INLINE:
            assert ring is not None
            data = ring[at : at + length]
        else:
            got = read_exact(stdin, length) if length else b""
            if got is None:
                return 1
            data = bytes(got)
        nth = answered + 1
        claims = finder.feed(base, data)
        if nth == args.bad_claim:
            claims.starts.append(base)
            claims.lasts.append(base + 40)
            claims.strides.append(40)
        if args.stall_s:
            time.sleep(args.stall_s)
        answer = encode_answer(base + 8192 if nth == args.misanswer else base, length, crc32c(data), claims)
        if nth == args.garble:
            answer = b"XXXX" + answer[4:]
        view = memoryview(answer)
        while view:
            view = view[os.write(out, view) :]
        answered += 1
        if answered == args.die_after:
            os._exit(4)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pageserver.wal_runs")
    parser.add_argument("--segment-size", type=int, default=WAL_SEGMENT_SIZE)
    parser.add_argument("--ring-fd", type=int, default=None, help="the shared ring's memfd")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when no longer this process's child")
    parser.add_argument("--ring-size", type=int, default=0)
    parser.add_argument("--stall-s", type=float, default=0.0, help="test seam: sleep before each answer")
    parser.add_argument("--garble", type=int, default=0, help="test seam: corrupt the Nth answer's magic")
    parser.add_argument("--misanswer", type=int, default=0, help="test seam: the Nth answer names another base")
    parser.add_argument("--bad-claim", type=int, default=0, help="test seam: a malformed claim in the Nth answer")
    parser.add_argument("--die-after", type=int, default=0, help="test seam: exit after N answers")
    args = parser.parse_args(argv)
    try:
        return _serve(args)
    except (BrokenPipeError, EOFError, KeyboardInterrupt):
        return 1


if __name__ == "__main__":
    sys.exit(main())
