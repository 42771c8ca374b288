"""``pagestore bench wal-codec``: throughput of the WAL encoder and the stream decoder.

For each workload, ``WalEncoder`` writes about ``--mib`` MiB of synthetic WAL (records, page
headers, CRCs), then ``WalStreamDecoder`` reads it back fed in 128 KiB chunks (full decode:
CRC, block references, ``DecodedRecord`` objects; images are not restored). Workloads:

- ``small``: one block reference with 100 bytes of data and 3 bytes of main data, like a
  pgbench heap insert (~150 bytes per record);
- ``fpi``: XLOG/FPI with one 8 KiB page image whose hole is 4 KiB (~4.2 KB per record);
- ``large``: one block reference with 2000 bytes of data and 6000 bytes of main data, so most
  records cross a page boundary.

Prints one JSON object per workload. Not a test: nothing is asserted except that every
record comes back.
"""

from __future__ import annotations

import argparse
import json
import struct
import time
from collections.abc import Callable

from protocol.wal.encoder import BlockSpec, WalEncoder
from protocol.wal.reader import WalStreamDecoder
from protocol.wal.record import DecodedRecord, RelFileNode
from protocol.wal.rmgr import XLOG_FPI, XLOG_HEAP_INSERT, RmgrId

START = 0x1000000
RN = RelFileNode(1663, 5, 16384)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mib", type=int, default=32, help="WAL per workload (default 32)")
    parser.add_argument("--workload", choices=["small", "fpi", "large"], action="append",
                        help="run only these (repeatable); default: all")


def _page() -> bytes:
    page = bytearray(bytes(range(256)) * 32)
    struct.pack_into("<HH", page, 12, 2048, 6144)
    page[2048:6144] = bytes(4096)
    return bytes(page)


def _workloads() -> dict[str, Callable[[WalEncoder, int], None]]:
    data100, data2000, main6000 = b"d" * 100, b"e" * 2000, b"m" * 6000
    page = _page()

    def small(enc: WalEncoder, i: int) -> None:
        enc.append(RmgrId.HEAP, XLOG_HEAP_INSERT, xid=i,
                   blocks=[BlockSpec(RN, i >> 6, data=data100)], main_data=b"abc")

    def fpi(enc: WalEncoder, i: int) -> None:
        enc.append(RmgrId.XLOG, XLOG_FPI, blocks=[BlockSpec(RN, i, image=page)])

    def large(enc: WalEncoder, i: int) -> None:
        enc.append(RmgrId.HEAP, XLOG_HEAP_INSERT, xid=i,
                   blocks=[BlockSpec(RN, i, data=data2000)], main_data=main6000)

    return {"small": small, "fpi": fpi, "large": large}


def run(args: argparse.Namespace) -> int:
    target = args.mib << 20
    for name, write in _workloads().items():
        if args.workload and name not in args.workload:
            continue
        enc = WalEncoder(START)
        chunks: list[bytes] = []
        size = 0
        t0 = time.perf_counter()
        i = 0
        while size < target:
            write(enc, i)
            i += 1
            if enc.buffered >= 1 << 20:
                chunk = enc.take()
                size += len(chunk)
                chunks.append(chunk)
        chunks.append(enc.take())
        t1 = time.perf_counter()
        data = b"".join(chunks)
        dec = WalStreamDecoder(START)
        n = 0
        t2 = time.perf_counter()
        step = 128 << 10
        for off in range(0, len(data), step):
            dec.feed(data[off : off + step])
            for _ in dec.records():
                n += 1
        t3 = time.perf_counter()
        if n != i:
            raise SystemExit(f"decoded {n} of {i} records")
        # the WAL receiver's path: every record one XLogData completes, in one call
        dec = WalStreamDecoder(START)
        batch: list[DecodedRecord] = []
        t4 = time.perf_counter()
        for off in range(0, len(data), step):
            dec.feed(data[off : off + step])
            dec.decode_into(batch)
            batch.clear()
        t5 = time.perf_counter()
        mb = len(data) / 1e6
        print(json.dumps({
            "bench": "wal-codec",
            "workload": name,
            "records": i,
            "bytes": len(data),
            "encode_s": round(t1 - t0, 3),
            "encode_mb_s": round(mb / (t1 - t0), 1),
            "encode_records_s": round(i / (t1 - t0)),
            "decode_s": round(t3 - t2, 3),
            "decode_mb_s": round(mb / (t3 - t2), 1),
            "decode_records_s": round(i / (t3 - t2)),
            "decode_into_s": round(t5 - t4, 3),
            "decode_into_records_s": round(i / (t5 - t4)),
        }), flush=True)
    return 0
