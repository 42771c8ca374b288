"""``pagestore fuzz NAME --seconds N``: coverage-guided fuzzing of a native decoder against its twin.

Each harness feeds atheris' mutated inputs to the compiled kernel and to its pure-Python twin
(the reference) and fails on any difference of outcome: the same result, or an exception of
the same class (and, for the record tracker, the same message and the same ``record_end``).
A crash of the native code is a crash of the harness. The twin is imported under
``atheris.instrument_imports()``, so its Python branches guide the mutations; the compiled
module is not instrumented (native coverage needs a clang build, native.md §6.3).

Harnesses (``NAME``):

- ``scan-records``: ``protocol._wal_c.scan_records``. Input: base page (u16 LE), segment
  size choice (u8: 1, 2 or 2048 pages), start (u8, in 8-byte words), then the WAL bytes.
- ``record-tracker``: ``RecordTracker.feed`` over pieces. Input: start (u16 LE, 8-byte words
  after LSN 0x2000000), segment size choice (u8), piece length (u8, x 37 bytes), then WAL.
- ``crc32c``: ``crc32c`` with a seed and a split. Input: seed (u32 LE), split (u16 LE), data.
- ``same-run``: ``protocol._ingest_c.same_run``, the pageserver's run of like records. Input:
  offset (u8), extra stride (u8, 0-7 used), count (u8), VM byte offset (u8, 0: none), then the
  record bytes (xl_tot_len read from the first record's header); the LSN of the first record
  is fixed.
- ``pagestream-getpages``: ``protocol._pagestream_c.decode_getpages``, the page service's
  batch decode of a receive buffer. Input: version (u8: even v2, odd v3), start (u8), limit
  (u8), then the stream bytes; the decoded requests and the end position must be equal.
- ``getpage-load``: ``GetPageLoad.feed`` of ``bench getpage``'s client, the server's bytes.
  Input: requests in flight (u8), piece length (u8, x 97 bytes), resend (u8), then the
  response stream; every piece's returned requests, the count and the latencies must be equal
  (or the same error class).
- ``heap-multi-insert``: ``pageserver.walredo._heap_c.multi_insert``, heap redo's placement of
  a Heap2/MULTI_INSERT record's tuples on a page. Input: mode (u8: bit 0 XLOG_HEAP_INIT_PAGE;
  bits 1-2 the page: fresh, 40 tuples with freed slots, or its header's 24 bytes from the
  input), main-data length (u8), then the main data, the page header if asked for, and the
  block data. Both must give the same outcome (flags, or error class and message) and leave
  the same page bytes.
- ``take-append-run``: ``protocol._pq_c.take_append_run`` (the safekeeper's receive kernel:
  CopyData framing, AppendRequest headers, coalescing into an output buffer). Input: start
  (u8), max_length choice (u8), output size (u16 LE), max_bytes (u16 LE), then raw pgwire
  bytes. Both must return the same tuple and write the same bytes into ``out`` (and none
  beyond the run's WAL).
- ``plan-cached``: ``pageserver.storage._plan_c.plan_cached``, a vectored read's planning in
  one layer from its cached index blocks. Input: floor, cont, max_bytes, entries per block,
  cached LSN and data_end choices (u8 each), then raw 42-byte index entries (key 18 | lsn 8 |
  pos 8 | len 4 | crc 4; sorted or not); the keys asked are the entries' keys and their
  successors. Both must return the same result, blobs, reads, key states and LRU order (or the
  same error class).
- ``fused-walk``: ``protocol._ingest_c.fused_walk``, the pageserver's fused ingest walk over a
  received piece of WAL. Input: start (u16 LE, 8-byte words from the buffer's first byte),
  distance back to the record before (u16 LE, 8-byte words), relation-fork set, nextXid and
  ``last`` choices (u8 each), mode (u8: bits 0-1 the segment size, bit 2 the timeline, bits 3-4
  the latest page, bit 5 the CRCs of the records from the start made right again by
  ``fix_crcs``, so that mutated headers and lengths get past the CRC), then the WAL bytes, at
  LSN ``WALK_BASE`` (three pages before a segment boundary). Both must return the same result (end, record before, page, count, items, sizes,
  stop and its relation) or raise the same error class with the same message.

- ``pack-values``: ``pageserver.storage._l0_c.pack_values``, the L0 writer's packing of a frozen
  in-memory layer's index and bytes. Input: key count (u8, mod 32), max_bytes, LSN bounds and
  source length choices (u8 each), then the keys (18 bytes each), one u8 count per key, and the
  triples as u64 LE words. The layer is packed piece after piece from the cursor each call
  returns; every piece (bytes, entries, cursor) or the error (class and message) must be equal.

- ``read-images``: ``pageserver.storage._images_c.read_images``, the page service's image fast
  path in one layer: the index search, the reads and the checks. Input: cont, floor, entries
  per block and data_end choices (u8 each), the index's length in bytes (u16 LE), then raw
  42-byte index entries (sorted or not), then the layer file's bytes (written to a temporary
  file whose descriptor is read). The keys asked are the entries' keys and their successors,
  in input order. Both must give the same pages, absent flags, hits, reads and bytes and LRU
  order (or the same error class).

- ``spgist-leaves``: ``pageserver.walredo._spgist_c`` (SP-GiST's tuple kernel of the redo):
  ``place_leaves`` or ``multi_delete`` on an SP-GiST leaf page. Input: mode (u8: bit 0
  multi_delete, bit 1 a page selector array, bit 2 the selector wanted), tuple or offset count
  (u8), page items (u8: the page ``spgist_leaf_page`` builds), one page byte to overwrite (u16
  LE position, u8 value; positions past the page leave it alone), then the record bytes
  (offsets at 0, the selectors after them, then the leaf tuples). Both must return the same
  value and leave the same page, or fail with the same error class.

The seed corpus is synthetic WAL (``safekeeper.testing.synthetic_wal``; for ``same-run``, runs of
like records from ``like_records``; for ``fused-walk``, a bulk load's heap INSERTs, with pages
and a segment boundary crossed, from ``bulk_load_wal``; for ``take-append-run``, push streams of it) in these formats;
``--corpus DIR`` keeps it and what the run finds. Not part of the test run: it needs the
``fuzz`` extra (``pip install -e '.[fuzz]'``: atheris) and runs for as long as it is told.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protocol.pagestream import GetPageRequest

HARNESSES = ("scan-records", "record-tracker", "crc32c", "same-run", "pagestream-getpages",
             "getpage-load", "take-append-run", "spgist-leaves",
             "heap-multi-insert", "plan-cached", "fused-walk", "pack-values", "read-images")
# the compiled module each harness fuzzes (its twin is the reference)
MODULES = {"scan-records": "protocol._wal_c", "record-tracker": "protocol._wal_c", "crc32c": "protocol._wal_c",
           "same-run": "protocol._ingest_c", "pagestream-getpages": "protocol._pagestream_c",
           "getpage-load": "protocol._getpage_load_c", "take-append-run": "protocol._pq_c",
           "spgist-leaves": "pageserver.walredo._spgist_c",
           "heap-multi-insert": "pageserver.walredo._heap_c",
           "plan-cached": "pageserver.storage._plan_c", "fused-walk": "protocol._ingest_c",
           "pack-values": "pageserver.storage._l0_c", "read-images": "pageserver.storage._images_c"}
MAX_LENGTHS = (0, 4, 50, 1100, 1 << 20, (1 << 32) - 1)
RUN_LSN = 0x2000000 + 8192 + 24  # LSN of the first record of a same-run input
BASE = 0x2000000
SEG_CHOICES = (1, 2, 2048)
PAGE = 8192


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=HARNESSES, help="which native decoder to fuzz")
    parser.add_argument("--seconds", type=int, default=60, help="how long to fuzz")
    parser.add_argument("--max-len", type=int, default=40_000, help="longest input tried (bytes)")
    parser.add_argument("--corpus", type=Path, default=None, help="corpus directory (default: a temporary one)")


def run(args: argparse.Namespace) -> int:
    try:
        import atheris  # noqa: F401  (checked here so the error is a sentence, not a traceback)
    except ImportError:
        print("pagestore fuzz needs atheris: pip install -e '.[fuzz]'", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pagestore-fuzz-") as tmp:
        corpus = args.corpus or Path(tmp) / "corpus"
        corpus.mkdir(parents=True, exist_ok=True)
        write_seeds(args.name, corpus)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable, "-m", "bench.fuzz", args.name, f"-max_total_time={args.seconds}",
                f"-max_len={args.max_len}", "-print_final_stats=1", str(corpus),
            ],
            cwd=Path(__file__).resolve().parent.parent, check=False,
        )
        print(json.dumps({
            "bench": "fuzz", "harness": args.name, "seconds": round(time.perf_counter() - t0, 1),
            "corpus_files": sum(1 for _ in corpus.iterdir()), "ok": proc.returncode == 0,
        }), flush=True)
    return proc.returncode


def like_records(count: int, tot_len: int, stride: int, pos: int, vm_at: int = 0, seed: int = 0) -> bytes:
    """``count`` CRC-valid records like each other, ``stride`` bytes apart, the first at LSN
    ``pos`` (each ``xl_prev`` the start of the one before): a bulk load's heap page, as the
    ingest kernel's ``same_run`` takes it. Byte ``vm_at`` (when > 0) has its VM bit clear."""
    import random
    import struct

    from protocol._wal_py import crc32c

    rng = random.Random(seed)
    layout = rng.randbytes(22)
    out = bytearray()
    for i in range(count):
        payload = bytearray(layout + rng.randbytes(tot_len - 46))
        if vm_at > 0:
            payload[vm_at - 24] &= 0xFE
        head = struct.pack("<IIQBB2x", tot_len, 0x1234, pos + (i - 1) * stride, 0x00, 10)
        crc = crc32c(head, crc32c(payload))
        out += head + crc.to_bytes(4, "little") + payload + bytes(stride - tot_len)
    return bytes(out)


def write_seeds(name: str, corpus: Path) -> None:
    from protocol.lsn import Lsn
    from safekeeper.testing import synthetic_wal

    if name in ("pagestream-getpages", "getpage-load"):
        _pagestream_seeds(name, corpus)
        return
    if name == "take-append-run":
        _append_run_seeds(corpus)
        return
    if name == "spgist-leaves":
        _spgist_seeds(corpus)
        return
    if name == "heap-multi-insert":
        _multi_insert_seeds(corpus)
        return
    if name == "plan-cached":
        _plan_seeds(corpus)
        return
    if name == "fused-walk":
        _walk_seeds(corpus)
        return
    if name == "pack-values":
        _pack_seeds(corpus)
        return
    if name == "read-images":
        _images_seeds(corpus)
        return
    if name == "same-run":
        for k, (tot_len, count) in enumerate(((59, 120), (203, 36), (250, 30))):
            stride = (tot_len + 7) & ~7
            vm_at = 0 if k == 1 else tot_len - 3
            seed = bytes([0, 0, count - 1, vm_at]) + like_records(count, tot_len, stride, RUN_LSN, vm_at, seed=k)
            (corpus / f"seed-run-{tot_len}").write_bytes(seed)
        return
    for k, size in enumerate((26, 200, 3000, 9000)):
        wal = synthetic_wal(Lsn(BASE), 40_000 if size > 1000 else 12_000, record_size=size)
        if name == "scan-records":
            seed = (BASE // PAGE).to_bytes(2, "little") + bytes([2, 5]) + wal
        elif name == "record-tracker":
            seed = (0).to_bytes(2, "little") + bytes([2, 1 + 7 * k]) + wal
        else:
            seed = (k * 0x9E3779B1 & 0xFFFFFFFF).to_bytes(4, "little") + (77 * k).to_bytes(2, "little") + wal[:5000]
        (corpus / f"seed-{size}").write_bytes(seed)


def _pagestream_seeds(name: str, corpus: Path) -> None:
    from protocol.lsn import Lsn
    from protocol.pagestream import GetPageRequest, RelTag, ResponseWriter, encode_request_into

    rel = RelTag(1663, 5, 16384, 0)
    for k, n in enumerate((1, 4, 32)):
        if name == "pagestream-getpages":
            buf = bytearray()
            for i in range(n):
                encode_request_into(buf, GetPageRequest(i, Lsn(0x10 + i), Lsn(0), rel, i), 3, framed=True)
            (corpus / f"seed-{n}").write_bytes(bytes([1, 0, 200]) + bytes(buf))
        else:
            from protocol._getpage_load_py import GetPageLoad

            load = GetPageLoad((1663, 5, 16384, 0), 100, seed=n)
            dec_reqs = _load_requests(load.requests(n, 0))
            w = ResponseWriter(3)
            for r in dec_reqs:
                w.get_page(r, bytes([k]) * 8192)
            (corpus / f"seed-{n}").write_bytes(bytes([n, 3 + k, 1]) + bytes(w.take()))


def _load_requests(data: bytes) -> list[GetPageRequest]:
    from protocol.pagestream import GetPageRequest, RequestStreamDecoder

    dec = RequestStreamDecoder(3)
    dec.receive_data(data)
    out: list[GetPageRequest] = []
    while isinstance(ev := dec.next_event(), GetPageRequest):
        out.append(ev)
    return out


def _append_run_seeds(corpus: Path) -> None:
    """Push streams as a walproposer sends them: CopyData frames of v3 AppendRequests of
    synthetic WAL, some runs broken by another message or another term."""
    from protocol.lsn import Lsn
    from protocol.safekeeper import AppendRequest, encode_message
    from safekeeper.testing import synthetic_wal

    def frame(payload: bytes) -> bytes:
        return b"d" + (4 + len(payload)).to_bytes(4, "big") + payload

    for k, (piece, total) in enumerate(((100, 2000), (1024, 12_000), (3000, 9000), (0, 0))):
        wal = synthetic_wal(Lsn(BASE), max(total, 1), record_size=64)[:total]
        stream = bytearray()
        at = 0
        for off in range(0, max(total, 1), max(piece, 1)):
            part = wal[off : off + piece]
            msg = AppendRequest(2, Lsn(BASE + at), Lsn(BASE + at + len(part)), Lsn(BASE + at), Lsn(BASE), part, generation=1)
            stream += frame(encode_message(msg, 3))
            at += len(part)
        if k == 2:
            stream += frame(b"v" + bytes(12))  # another message ends the run
        params = bytes([0, 4]) + (16_000).to_bytes(2, "little") + (9000 + 1000 * k).to_bytes(2, "little")
        (corpus / f"seed-run-{k}").write_bytes(params + bytes(stream))


def spgist_leaf_page(items: int) -> tuple[bytearray, list[int]]:
    """An SP-GiST leaf page of ``items`` tuples (live ones of several sizes, placeholders,
    redirects, the page's counters kept) and the tuple state of each offset."""
    import struct

    from pageserver.walredo import bufpage as bp
    from pageserver.walredo import spgist

    page = bytearray(bp.BLCKSZ)
    spgist.init_page(page, spgist.SPGIST_LEAF)
    states: list[int] = []
    for i in range(items):
        state = (0, 0, 3, 1)[i % 4]
        if state == 0:
            size = (16, 24, 40, 21)[i % 7 % 4]
            tup = struct.pack("<IHHHH", size << 2, 0, 0, 7, i & 0xFF) + bytes([i & 0xFF]) * (size - 12)
        else:
            tup = struct.pack("<IHHHHI", state | 16 << 2, 0, 0, 5, 9, 77)
        if not bp.page_append_items(page, [tup]):
            break
        states.append(state)
    struct.pack_into("<HH", page, bp.BLCKSZ - 6, states.count(1), states.count(3))
    return page, states


def _spgist_seeds(corpus: Path) -> None:
    import struct

    for k, (items, n, select) in enumerate(((8, 3, False), (40, 12, True), (120, 30, False), (200, 60, True))):
        _page, states = spgist_leaf_page(items)
        holes = [j + 1 for j, s in enumerate(states) if s == 3]
        offsets, tuples, sel = [], [], []
        nxt = len(states) + 1
        for i in range(n):
            if holes and i % 2:
                offsets.append(holes.pop())
            else:
                offsets.append(nxt)
                nxt += 1
            size = 16 + 8 * (i % 3)
            tuples.append(struct.pack("<IHHHH", size << 2, 0, 0, 3, i) + bytes(size - 12))
            sel.append(1)
        body = struct.pack(f"<{n}H", *offsets) + (bytes(sel) if select else b"") + b"".join(tuples)
        mode = (2 | 4) if select else 0
        (corpus / f"seed-place-{k}").write_bytes(bytes([mode, n, items]) + b"\xff\xff\x00" + body)
        delete = sorted({1 + (7 * i) % max(1, len(states)) for i in range(n)})[: len(states)]
        (corpus / f"seed-delete-{k}").write_bytes(bytes([1, len(delete), items]) + b"\xff\xff\x00"
                                                  + struct.pack(f"<{len(delete)}H", *delete))


def multi_insert_record(ntuples: int, length: int, offsets: list[int] | None, flags: int = 0x20) -> tuple[bytes, bytes]:
    """(main data, block data) of a Heap2/MULTI_INSERT of ``ntuples`` tuples of ``length``
    body bytes (a pgbench_accounts row is 98 after its 24-byte header), as COPY writes them."""
    import struct

    main = struct.pack("<BxH", flags, ntuples) + (struct.pack(f"<{len(offsets)}H", *offsets) if offsets else b"")
    data = bytearray()
    for i in range(ntuples):
        if len(data) & 1:
            data += b"\0"
        data += struct.pack("<HHHB", length, 4, 0x0b00, 24) + bytes([i & 0xFF]) * length
    return main, bytes(data)


def _multi_insert_page(mode: int, header: bytes) -> bytearray:
    from pageserver.walredo import _heap_py
    from pageserver.walredo import bufpage as bp

    page = bp.new_page(0)
    if mode == 1:
        for i in range(40):
            _heap_py.put_tuple(page, i + 1, i, 0, 0, 0, 0, 24, b"f" * (i % 50))
        for off in (3, 17, 40):
            bp.set_itemid(page, off, 0, bp.LP_UNUSED, 0)
    elif mode == 2:
        page[:24] = header.ljust(24, b"\0")
    return page


def _multi_insert_seeds(corpus: Path) -> None:
    for k, (n, length, init) in enumerate(((61, 98, True), (1, 98, True), (20, 13, False), (3, 500, False))):
        main, data = multi_insert_record(n, length, None if init else [41, 3, 17][: n] + list(range(42, 42 + n - 3)))
        mode = (1 if init else 0) | (0 if init else 2)
        (corpus / f"seed-{k}").write_bytes(bytes([mode, len(main) & 0xFF]) + main + data)
_U64 = (1 << 64) - 1
_PLAN_BOUNDS = (0, 1, 16, 40, 1 << 63, _U64, _U64 + 1, -1)


def _plan_seeds(corpus: Path) -> None:
    from pageserver.storage.key import rel_block_key

    for k, (n_keys, versions) in enumerate(((3, 1), (12, 3), (40, 2))):
        raw, off = bytearray(), 4096
        for blk in range(0, n_keys * (1 + k % 2), 1 + k % 2):
            for v in range(versions):
                raw += rel_block_key(1663, 5, 16384, 0, blk) + (16 + 8 * v).to_bytes(8, "big")
                raw += ((off << 1) | (v == 0)).to_bytes(8, "big") + (100).to_bytes(4, "big") + bytes(4)
                off += 100
        (corpus / f"seed-{k}").write_bytes(bytes([0, 5 + k, 2, 3 + k, k, 1]) + bytes(raw))


def plan_outcome(mod: ModuleType, data: bytes) -> tuple[object, ...] | None:
    """One ``plan-cached`` input run through ``mod`` (see the module docstring)."""
    from collections import OrderedDict

    from pageserver.storage.layer_file import _BLOCK_HDR, IndexBlock
    from pageserver.storage.reconstruct import KeyState

    if len(data) < 6:
        return None
    p, body = data[:6], data[6:]
    n = min(len(body) // 42, 300)
    raws = [body[i * 42 : (i + 1) * 42] for i in range(n)]
    per = 1 + p[3] % 8
    blocks = [IndexBlock(_BLOCK_HDR.pack(0, len(c), 0) + b"".join(c), len(c))
              for c in (raws[i : i + per] for i in range(0, n, per))] or [IndexBlock(bytes(8), 0)]
    fences = [b.prefixes[0] if b.prefixes else bytes(26) for b in blocks]
    cache = OrderedDict(((1, b), block) for b, block in enumerate(blocks))
    wanted: set[bytes] = set()
    for r in raws[:64]:
        key = r[:18]
        wanted.add(key)
        wanted.add(((int.from_bytes(key, "big") + 1) & ((1 << 144) - 1)).to_bytes(18, "big"))
    keys = sorted(wanted)
    states = {}
    for key in keys:
        st = KeyState(_PLAN_BOUNDS[p[4] % 5] if p[4] & 8 else -1, None)
        st.pending = []
        states[key] = st
    blobs: list[tuple[int, int, int]] = []
    reads: list[object] = []
    max_bytes = (0, 64, 8192, 1 << 20, -1)[p[2] % 5]
    data_end = (1 << 20, 1 << 40, _U64, 4096)[p[5] % 4]
    outcome = _outcome(mod.plan_cached, fences, len(blocks), cache, 1, keys, _PLAN_BOUNDS[p[0] % 8],
                       _PLAN_BOUNDS[p[1] % 8], states, blobs, reads, "r", max_bytes, 4096, data_end)
    return (outcome, blobs, reads, [(k, s.complete, s.pending) for k, s in states.items()], list(cache))


_IMAGES_LSNS = (0, 1, 16, 17, 40, 1 << 63, _U64, _U64 + 1)


def _images_seeds(corpus: Path) -> None:
    from crc32c import crc32c

    from pageserver.storage.key import rel_block_key

    for k, (n_keys, versions) in enumerate(((2, 1), (3, 2), (1, 3))):
        raw, blobs, off = bytearray(), bytearray(), 64
        for blk in range(n_keys):
            for v in range(versions):
                blob = bytes([0 if v != 1 else 1]) + bytes([blk + 16 * v]) * 8192
                raw += rel_block_key(1663, 5, 16384, 0, blk) + (16 + v).to_bytes(8, "big")
                raw += ((off << 1) | 1).to_bytes(8, "big") + len(blob).to_bytes(4, "big")
                raw += crc32c(blob).to_bytes(4, "big")
                blobs += blob
                off += len(blob)
        head = bytes([4, k % 3, 1 + k, 0]) + len(raw).to_bytes(2, "little")
        (corpus / f"seed-{k}").write_bytes(head + bytes(raw) + bytes(64) + bytes(blobs))


def images_outcome(mod: ModuleType, data: bytes) -> tuple[tuple[object, ...], list[object]] | None:
    """One ``read-images`` input run through ``mod`` (see the module docstring)."""
    import tempfile
    from collections import OrderedDict

    from pageserver.storage.layer_file import _BLOCK_HDR, IndexBlock

    if len(data) < 6:
        return None
    p = data[:6]
    n_raw = min(int.from_bytes(p[4:6], "little"), len(data) - 6)
    body, file_bytes = data[6 : 6 + n_raw], data[6 + n_raw :]
    n = min(len(body) // 42, 300)
    raws = [body[i * 42 : (i + 1) * 42] for i in range(n)]
    per = 1 + p[2] % 8
    blocks = [IndexBlock(_BLOCK_HDR.pack(0, len(c), 0) + b"".join(c), len(c))
              for c in (raws[i : i + per] for i in range(0, n, per))] or [IndexBlock(bytes(8), 0)]
    fences = [b.prefixes[0] if b.prefixes else bytes(26) for b in blocks]
    cache = OrderedDict(((1, b), block) for b, block in enumerate(blocks))
    keys: list[bytes] = []
    for r in raws[:64]:
        for key in (r[:18], ((int.from_bytes(r[:18], "big") + 1) & ((1 << 144) - 1)).to_bytes(18, "big")):
            if key not in keys:
                keys.append(key)
    data_end = (len(file_bytes), 1 << 40, _U64, 64)[p[3] % 4]
    with tempfile.TemporaryFile() as f:
        f.write(file_bytes)
        f.flush()
        outcome = _outcome(mod.read_images, fences, len(blocks), cache, 1, keys, _IMAGES_LSNS[p[0] % 8],
                           _IMAGES_LSNS[p[1] % 8], 64, data_end, f.fileno())
    return (outcome, list(cache))


_PACK_MAX_BYTES = (0, 1, 100, 5000, 1 << 40)
_PACK_LSNS = ((0, 1 << 64), (100, 200), (1 << 63, (1 << 64) + 5), (-1, 0))
_PACK_SRC = bytes(range(256)) * 8


def _pack_seeds(corpus: Path) -> None:
    import random
    import struct

    for k, (n_keys, per) in enumerate(((1, 1), (3, 4), (20, 9))):
        rng = random.Random(k)
        keys = sorted({rng.randbytes(18) for _ in range(n_keys)})
        counts = bytes([per] * len(keys))
        words = bytearray()
        for _ in keys:
            lsn = 100 + rng.randrange(5)
            for _ in range(per):
                length = rng.choice((0, 3, 40))
                off = rng.randrange(0, 2000 - length)
                words += struct.pack("<QQQ", lsn, off << 1 | rng.randrange(2), length)
                lsn += 1 + rng.randrange(3)
        header = bytes([len(keys), k + 1, 1, 2])
        (corpus / f"seed-{k}").write_bytes(header + b"".join(keys) + counts + bytes(words))


def pack_outcome(mod: ModuleType, data: bytes) -> list[tuple[object, ...]] | None:
    """One ``pack-values`` input run through ``mod``: every call's outcome, piece after piece
    (see the module docstring)."""
    from array import array

    if len(data) < 4:
        return None
    n_keys = data[0] % 32
    max_bytes = _PACK_MAX_BYTES[data[1] % len(_PACK_MAX_BYTES)]
    lo, hi = _PACK_LSNS[data[2] % len(_PACK_LSNS)]
    src = _PACK_SRC[: (0, 7, 2000)[data[3] % 3]]
    body = data[4:]
    keys = body[: 18 * n_keys]
    rest = body[18 * n_keys :]
    counts = array("Q", list(rest[:n_keys]))
    words = rest[n_keys:]
    triples: array[int] = array("Q")
    triples.frombytes(words[: len(words) // 8 * 8])
    if triples.itemsize == 8 and sys.byteorder == "big":  # (the input's words are little-endian)
        triples.byteswap()
    steps: list[tuple[object, ...]] = []
    key_at = sub = 0
    offset = 4096
    for _ in range(1000):
        try:
            d, e, key_at, sub = mod.pack_values(keys, counts, triples, src, key_at, sub, offset, max_bytes, lo, hi)
        except Exception as exc:
            steps.append(("err", type(exc).__name__, str(exc)))
            break
        steps.append(("ok", d, e, key_at, sub))
        offset += len(d)
        if key_at == len(counts):
            break
    return steps


WALK_BASE = 2 * (16 << 20) - 3 * PAGE - 1000  # the walk crosses short page headers, then a long one
WALK_REL = (1663, 5, 16384)
_WALK_RELS: tuple[tuple[tuple[int, int, int, int, int], ...], ...] = (
    (), ((*WALK_REL, 0, 3),), ((*WALK_REL, 0, 1000),), ((*WALK_REL, 0, 0), (1663, 5, 16385, 0, 5)),
    ((1663, 5, 16385, 0, 5), (*WALK_REL, 0, 4)),
)
_WALK_NXT = (-1, 0, 900, 901, 10_000, 0xFFFF_FFFF)
_WALK_SEGS = (16 << 20, 1 << 20, 2 * PAGE, PAGE)


def bulk_load_wal(n: int, every: int = 50, other_at: int = -1) -> tuple[bytes, list[tuple[int, int]]]:
    """The WAL of a bulk load (``n`` heap INSERTs of 100-byte tuples into relation 16384 from
    block 3 on, a new-page INSERT every ``every``, xid 900) at ``WALK_BASE``, and each record's
    (start, end) LSN. Record ``other_at`` is a 300-byte XLOG NOOP (the general path's)."""
    import struct

    from protocol.wal.encoder import BlockSpec, WalEncoder
    from protocol.wal.record import RelFileNode
    from protocol.wal.rmgr import XLOG_NOOP, RmgrId

    rel = RelFileNode(*WALK_REL)
    tup = struct.pack("<HHB", 1, 0x0800, 24) + bytes(range(100))
    enc = WalEncoder(WALK_BASE)
    spans: list[tuple[int, int]] = []
    for i in range(n):
        if i == other_at:
            s, e = enc.append(RmgrId.XLOG, XLOG_NOOP, main_data=bytes(300))
        else:
            init = i % every == 0
            s, e = enc.append(RmgrId.HEAP, 0x80 if init else 0x00, xid=900,
                              blocks=[BlockSpec(rel, 3 + i // every, data=tup, will_init=init)],
                              main_data=struct.pack("<HB", 1 + i % every, 0))
        spans.append((int(s), int(e)))
    return enc.take(), spans


def _walk_seeds(corpus: Path) -> None:
    for k, (n, every, other_at, first, rels) in enumerate(
        ((220, 50, -1, 1, 2), (220, 7, -1, 40, 2), (220, 50, 90, 60, 2), (120, 50, -1, 5, 1), (220, 50, -1, 100, 0))
    ):
        wal, spans = bulk_load_wal(n, every, other_at)
        pos, prev = spans[first][0], spans[first - 1][0]
        params = ((pos - WALK_BASE) // 8).to_bytes(2, "little") + ((pos - prev) // 8).to_bytes(2, "little")
        # nextXid 10,000: the load's xid 900 is below it; every other seed has its CRCs fixed
        params += bytes([rels, 4, 0, 0x20 if k % 2 else 0])
        (corpus / f"seed-walk-{k}").write_bytes(params + wal)


def fix_crcs(wal: bytearray, at: int, limit: int = 64) -> None:
    """Make up to ``limit`` records from offset ``at`` of ``wal`` (at ``WALK_BASE``) CRC-valid
    again after a mutation, following each ``xl_tot_len`` across page headers (long or short as
    their ``xlp_info`` says), so that hostile headers and lengths reach the checks behind the
    CRC. Stops at a length below 24 or past the buffer."""
    from protocol._wal_py import crc32c

    o = at
    for _ in range(limit):
        if (WALK_BASE + o) % PAGE == 0:
            if o + 4 > len(wal):
                return
            o += 40 if wal[o + 2] & 0x02 else 24
        if o + 4 > len(wal):
            return
        tot_len = int.from_bytes(wal[o : o + 4], "little")
        if tot_len < 24:
            return
        spans, rest, p = [], tot_len, o  # the record's pieces in the buffer
        while rest > 0:
            room = PAGE - (WALK_BASE + p) % PAGE
            take = min(room, rest)
            if p + take > len(wal):
                return
            spans.append((p, take))
            rest -= take
            p += take
            if rest > 0:
                if p + 4 > len(wal):
                    return
                p += 40 if wal[p + 2] & 0x02 else 24
        raw = bytearray(b"".join(wal[s : s + n] for s, n in spans))
        crc = crc32c(raw[:20], crc32c(raw[24:])).to_bytes(4, "little")
        for i in range(4):  # the CRC field may be split by a page boundary too
            k, q = 20 + i, 0
            while k >= spans[q][1]:
                k -= spans[q][1]
                q += 1
            wal[spans[q][0] + k] = crc[i]
        o = p + (-(WALK_BASE + p) % 8)


def walk_outcome(mod: ModuleType, data: bytes) -> tuple[object, ...] | None:
    """One ``fused-walk`` input run through ``mod`` (see the module docstring)."""
    from array import array

    if len(data) < 8:
        return None
    wal: bytes | bytearray = data[8:]
    pos = WALK_BASE + 8 * (int.from_bytes(data[:2], "little") % (len(wal) // 8 + 1))
    prev = max(0, pos - 8 * int.from_bytes(data[2:4], "little"))
    mode = data[7]
    if mode & 0x20:
        wal = bytearray(wal)
        fix_crcs(wal, pos - WALK_BASE)
    page = pos & ~(PAGE - 1)
    latest = (page, max(0, page - PAGE), 0, (1 << 64) - 1)[(mode >> 3) & 3]
    last = (0, 0, pos, pos + 500, (1 << 64) - 1)[data[6] % 5]
    args = (wal, WALK_BASE, pos, prev, latest, 2 if mode & 4 else 1, _WALK_SEGS[mode & 3],
            _WALK_RELS[data[4] % len(_WALK_RELS)], _WALK_NXT[data[5] % len(_WALK_NXT)], last)
    try:
        got = mod.fused_walk(*args)
    except Exception as exc:
        return ("err", type(exc).__name__, str(exc))
    items = [tuple(x.tolist() if isinstance(x, array) else x for x in item) for item in got[4]]
    return ("ok", *got[:4], items, *got[5:])


def _outcome(fn: Callable[..., object], *args: object) -> tuple[object, ...]:
    try:
        return ("ok", fn(*args))
    except Exception as exc:
        return ("err", type(exc).__name__)


def _trace(cls: type, data: bytes, start: int, step: int, seg: int) -> list[object]:
    out: list[object] = []
    try:
        tracker = cls(start, seg)
    except Exception as exc:
        return [("init-err", type(exc).__name__)]
    for at in range(0, len(data), step):
        try:
            out.append(tracker.feed(data[at : at + step]))
        except Exception as exc:
            out.append(("err", type(exc).__name__, str(exc), tracker.record_end, tracker.pos))
            break
    return out


def _harness(name: str, native: ModuleType, twin: ModuleType) -> Callable[[bytes], None]:
    def scan_records(data: bytes) -> None:
        if len(data) < 4:
            return
        base = int.from_bytes(data[:2], "little") * PAGE
        seg = SEG_CHOICES[data[2] % 3] * PAGE
        wal = data[4:]
        i = min(data[3] * 8, len(wal) & ~7)
        args = (wal, i, len(wal), base, seg)
        a, b = _outcome(native.scan_records, *args), _outcome(twin.scan_records, *args)
        if a != b:
            raise AssertionError(f"scan_records differs: native {a} twin {b}")

    def record_tracker(data: bytes) -> None:
        if len(data) < 4:
            return
        start = BASE + 8 * int.from_bytes(data[:2], "little")
        seg = SEG_CHOICES[data[2] % 3] * PAGE
        step = 37 * (data[3] + 1)
        # the WAL bytes are at start: the seeds begin at BASE (a page start)
        a = _trace(native.RecordTracker, data[4:], start, step, seg)
        b = _trace(twin.RecordTracker, data[4:], start, step, seg)
        if a != b:
            raise AssertionError(f"RecordTracker differs: native {a[-1:]} twin {b[-1:]}")

    def crc32c(data: bytes) -> None:
        if len(data) < 6:
            return
        seed = int.from_bytes(data[:4], "little")
        body = data[6:]
        split = int.from_bytes(data[4:6], "little") % (len(body) + 1)
        whole = native.crc32c(body, seed)
        if whole != twin.crc32c(body, seed) or native.crc32c(body[split:], native.crc32c(body[:split], seed)) != whole:
            raise AssertionError(f"crc32c differs on {len(body)} bytes, seed {seed:#x}, split {split}")

    def same_run(data: bytes) -> None:
        if len(data) < 8:
            return
        o, extra, k, vm_at = data[0], data[1] % 8, data[2], data[3]
        buf = data[4:]
        tot_len = int.from_bytes(buf[o : o + 4].ljust(4, b"\0"), "little") % 4096
        stride = ((tot_len + 7) & ~7) + 8 * extra
        args = (buf, o, RUN_LSN, tot_len, stride, k, vm_at)
        a, b = _outcome(native.same_run, *args), _outcome(twin.same_run, *args)
        if a != b:
            raise AssertionError(f"same_run differs: native {a} twin {b}")

    def pagestream_getpages(data: bytes) -> None:
        from protocol.pagestream import GetPageRequest, RelTag

        if len(data) < 3:
            return
        v3, body = bool(data[0] & 1), data[3:]
        start = data[1] % (len(body) + 1)
        args = (body, start, len(body), v3, data[2], GetPageRequest, RelTag)
        a = _outcome(native.decode_getpages, *args, {})
        b = _outcome(twin.decode_getpages, *args, {})
        if a != b:
            raise AssertionError(f"decode_getpages differs: native {a} twin {b}")

    def getpage_load(data: bytes) -> None:
        if len(data) < 3:
            return
        n, step, resend, body = data[0] % 64, 97 * (data[1] + 1), bool(data[2] & 1), data[3:]

        def trace(mod: ModuleType) -> list[object]:
            load = mod.GetPageLoad((1663, 5, 16384, 0), 100, seed=n)
            out: list[object] = [load.requests(n, 0)]
            for i, at in enumerate(range(0, len(body), step)):
                try:
                    out.append(load.feed(body[at : at + step], 1000 * (i + 1), resend))
                except Exception as exc:
                    out.append(("err", type(exc).__name__))
                    return out
            out.append((load.count, load.in_flight, list(load.latencies_us())))
            return out

        a, b = trace(native), trace(twin)
        if a != b:
            raise AssertionError(f"GetPageLoad differs: native {a[-1:]} twin {b[-1:]}")

    def take_append_run(data: bytes) -> None:
        if len(data) < 6:
            return
        stream = data[6:]
        start = min(data[0], len(stream))
        max_length = MAX_LENGTHS[data[1] % len(MAX_LENGTHS)]
        out_size = int.from_bytes(data[2:4], "little")
        max_bytes = int.from_bytes(data[4:6], "little")

        def run(m: ModuleType) -> tuple[object, ...]:
            out = bytearray(b"\xee" * out_size)
            outcome = _outcome(m.take_append_run, stream, start, len(stream), max_length, out, max_bytes)
            return (*outcome, bytes(out))

        a, b = run(native), run(twin)
        if a != b:
            raise AssertionError(f"take_append_run differs: native {a[:2]} twin {b[:2]}")
        if a[0] == "ok":
            r = a[1]
            assert isinstance(r, tuple)
            n = r[5] - r[4]
            if a[2][n:] != b"\xee" * (out_size - n):  # type: ignore[index]
                raise AssertionError("take_append_run wrote past the run's WAL")

    def spgist_leaves(data: bytes) -> None:
        if len(data) < 6:
            return
        mode, n, items = data[0], data[1], data[2]
        at, value = int.from_bytes(data[3:5], "little"), data[5]
        body = data[6:]
        page, _ = spgist_leaf_page(items)
        if at < PAGE:
            page[at] = value

        def run(m: ModuleType) -> tuple[object, ...]:
            p = bytearray(page)
            if mode & 1:
                outcome = _outcome(m.multi_delete, p, body, 0, n, 1, 3, 5, 6, 7)
            else:
                select_at = 2 * n if mode & 2 else -1
                tuples_at = 2 * n + (n if mode & 2 else 0)
                outcome = _outcome(m.place_leaves, p, body, 0, select_at, tuples_at, n, (mode >> 2) & 1)
            if len(p) != PAGE:
                raise AssertionError(f"the page became {len(p)} bytes")
            return (*outcome, bytes(p)) if outcome[0] == "ok" else outcome

        a, b = run(native), run(twin)
        if a != b:
            raise AssertionError(f"spgist {'multi_delete' if mode & 1 else 'place_leaves'} differs: native {a[:2]} twin {b[:2]}")

    def heap_multi_insert(data: bytes) -> None:
        if len(data) < 2:
            return
        init, mode = bool(data[0] & 1), (data[0] >> 1) % 3
        body = data[2:]
        main, body = body[: data[1]], body[data[1] :]
        header = b""
        if mode == 2:
            header, body = body[:24], body[24:]

        def run(m: ModuleType) -> tuple[object, ...]:
            page = _multi_insert_page(mode, header)
            try:
                got: tuple[object, ...] = ("ok", m.multi_insert(page, main, body, 0x1234, 77, init))
            except Exception as exc:
                got = ("err", type(exc).__name__, str(exc))
            return (*got, bytes(page))

        a, b = run(native), run(twin)
        if a != b:
            raise AssertionError(f"multi_insert differs: native {a[:3]} twin {b[:3]}")
    def plan_cached(data: bytes) -> None:
        a, b = plan_outcome(native, data), plan_outcome(twin, data)
        if a != b:
            raise AssertionError(f"plan_cached differs: native {a and a[0]} twin {b and b[0]}")

    def fused_walk(data: bytes) -> None:
        a, b = walk_outcome(native, data), walk_outcome(twin, data)
        if a != b:
            raise AssertionError(f"fused_walk differs: native {a and a[:5]} twin {b and b[:5]}")

    def pack_values(data: bytes) -> None:
        a, b = pack_outcome(native, data), pack_outcome(twin, data)
        if a != b:
            raise AssertionError(f"pack_values differs: native {a and a[-1][:1]} twin {b and b[-1][:1]}")

    def read_images(data: bytes) -> None:
        a, b = images_outcome(native, data), images_outcome(twin, data)
        if a != b:
            raise AssertionError(f"read_images differs: native {a and a[0][:1]} twin {b and b[0][:1]}")

    return {"scan-records": scan_records, "record-tracker": record_tracker, "crc32c": crc32c,
            "same-run": same_run, "pagestream-getpages": pagestream_getpages,
            "getpage-load": getpage_load, "take-append-run": take_append_run,
            "spgist-leaves": spgist_leaves, "heap-multi-insert": heap_multi_insert,
            "plan-cached": plan_cached, "fused-walk": fused_walk, "pack-values": pack_values,
            "read-images": read_images}[name]


def _fuzz_main(argv: list[str]) -> None:
    import atheris

    name = argv[1]
    import importlib

    from protocol import _native
    from protocol._native_sources import TWINS

    module = MODULES[name]
    # the twin first: a compiled module may import helpers from it (protocol._ingest_c does),
    # and a twin imported before instrument_imports would give no coverage
    with atheris.instrument_imports():
        twin = importlib.import_module(TWINS[module])
    native = _native.load_native(module)
    atheris.Setup([argv[0], *argv[2:]], _harness(name, native, twin))
    atheris.Fuzz()


if __name__ == "__main__":
    # the fuzzing process: python -m bench.fuzz NAME [libFuzzer flags] CORPUS
    _fuzz_main(sys.argv)
