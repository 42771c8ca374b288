"""Hypothesis strategies and helpers shared by the WAL tests."""

from __future__ import annotations

import random
import struct

from hypothesis import strategies as st

from protocol.wal.encoder import BlockSpec, WalEncoder
from protocol.wal.record import BLCKSZ, RelFileNode

SEG = 16 * 1024 * 1024


def make_page(seed: int, lower: int, upper: int) -> bytes:
    """A compressible 8 KiB page with pd_lower/pd_upper set and zeros in the hole."""
    rng = random.Random(seed)
    motif = rng.randbytes(rng.randint(1, 64))
    page = bytearray((motif * (BLCKSZ // len(motif) + 1))[:BLCKSZ])
    for _ in range(rng.randint(0, 40)):
        page[rng.randrange(BLCKSZ)] = rng.randrange(256)
    struct.pack_into("<HH", page, 12, lower, upper)
    if lower < upper:
        page[lower:upper] = bytes(upper - lower)
    return bytes(page)


@st.composite
def pages(draw: st.DrawFn) -> bytes:
    lower = draw(st.integers(24, BLCKSZ))
    upper = draw(st.integers(lower, BLCKSZ))
    return make_page(draw(st.integers(0, 2**32)), lower, upper)


rnodes = st.builds(
    RelFileNode,
    st.sampled_from([1663, 1664]),
    st.integers(0, 3),
    st.integers(1, 2**32 - 1),
)


def _payload(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


sizes = st.one_of(st.integers(0, 40), st.integers(0, 400), st.integers(0, 20000))


@st.composite
def block_specs(draw: st.DrawFn, block_id: int, rnode_pool: list[RelFileNode]) -> BlockSpec:
    image = draw(st.none() | pages())
    hole: tuple[int, int] | None = None
    if image is not None and draw(st.booleans()):
        lower, upper = struct.unpack_from("<HH", image, 12)
        hole = draw(st.sampled_from([(0, 0), (lower, upper - lower) if lower < upper else (0, 0)]))
    return BlockSpec(
        rnode=draw(st.sampled_from(rnode_pool)),
        blkno=draw(st.integers(0, 2**32 - 1)),
        forknum=draw(st.integers(0, 3)),
        data=_payload(draw(st.integers(0, 1000)), draw(st.integers(0, 3000))),
        image=image,
        apply_image=draw(st.booleans()),
        will_init=draw(st.booleans()),
        hole=hole,
        compression=None if image is None else draw(st.sampled_from([None, "pglz", "lz4", "zstd"])),
        block_id=block_id,
    )


@st.composite
def record_specs(draw: st.DrawFn) -> dict[str, object]:
    pool = draw(st.lists(rnodes, min_size=1, max_size=3))
    ids = sorted(draw(st.sets(st.integers(0, 32), max_size=3)))
    blocks = [draw(block_specs(i, pool)) for i in ids]
    return {
        "rmid": draw(st.sampled_from([0, 1, 9, 10, 11, 15])),
        "info": draw(st.integers(0, 255).filter(lambda i: i & 0xF0 != 0x40)),  # not SWITCH
        "xid": draw(st.integers(0, 2**32 - 1)),
        "blocks": blocks,
        "main_data": _payload(draw(st.integers(0, 1000)), draw(sizes)),
        "origin": draw(st.none() | st.integers(0, 0xFFFF)),
        "toplevel_xid": draw(st.none() | st.integers(0, 2**32 - 1)),
    }


def encode(start: int, specs: list[dict[str, object]]) -> tuple[bytes, list[tuple[int, int]]]:
    enc = WalEncoder(start)
    spans: list[tuple[int, int]] = [enc.append(**spec) for spec in specs]  # type: ignore[arg-type]
    return enc.take(), spans


@st.composite
def simple_record_specs(draw: st.DrawFn) -> dict[str, object]:
    """Mostly the layout ``WalStreamDecoder.decode_into`` parses in one unpack (block 0 without
    image, short main data), sometimes one step off it (a second block, an image, no data, a
    long main data, an origin, an XLOG record)."""
    rnode = draw(rnodes)
    blocks = [
        BlockSpec(
            rnode=rnode,
            blkno=draw(st.integers(0, 2**32 - 1)),
            forknum=draw(st.integers(0, 3)),
            data=_payload(draw(st.integers(0, 1000)), draw(st.sampled_from([0, 1, 60, 140, 300]))),
            will_init=draw(st.booleans()),
            image=draw(st.none() | st.just(make_page(1, 40, 4000))) if draw(st.integers(0, 9)) == 0 else None,
        )
    ]
    if draw(st.integers(0, 9)) == 0:
        blocks.append(BlockSpec(rnode=draw(st.sampled_from([rnode, RelFileNode(1663, 5, 7)])), blkno=3))
    odd = draw(st.integers(0, 19))
    return {
        "rmid": 0 if odd == 0 else draw(st.sampled_from([10, 9, 11])),  # 0: XLOG
        "info": draw(st.sampled_from([0x00, 0x20, 0x80])),
        "xid": draw(st.integers(0, 2**32 - 1)),
        "blocks": blocks,
        "main_data": _payload(7, draw(st.sampled_from([0, 3, 14, 255, 256, 2000]))),
        "origin": 5 if odd == 1 else None,
        "toplevel_xid": 9 if odd == 2 else None,
    }
