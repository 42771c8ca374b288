"""An in-memory timeline that satisfies ``PageReader``, and helpers to drive a pagestream.

The fake keeps page versions per (rel, blkno) and answers exactly as protocols.md §1.4 says a
timeline should (zero page beyond the size, missing FSM/VM forks have size 0, a missing main
fork is NotFound). It records every ``get_pages`` call so tests can see the batches.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import trio

from pageserver.page_service.reader import (
    LsnTimeout,
    NotFound,
    PageRead,
    PageRequestError,
    ReadError,
)
from protocol.lsn import Lsn
from protocol.pagestream import (
    BLCKSZ,
    DEFAULTTABLESPACE_OID,
    SLRU_PAGES_PER_SEGMENT,
    RelTag,
    Request,
    RequestStreamDecoder,
    ResponseStreamDecoder,
    SlruKind,
    decode_response,
    encode_request_into,
)

ZERO_PAGE = bytes(BLCKSZ)
_PAGE_HEAD = struct.Struct(">IIIBIQ")


def page_image(rel: RelTag, blkno: int, lsn: int) -> bytes:
    """A recognisable page: its identity and version, repeated."""
    head = _PAGE_HEAD.pack(rel.spcnode, rel.dbnode, rel.relnode, rel.forknum, blkno, lsn)
    return (head * (BLCKSZ // len(head) + 1))[:BLCKSZ]


class FakeTimeline:
    """``PageReader`` over dicts; ``read_delay_s`` makes Execution slow so batches form."""

    def __init__(
        self,
        last_record_lsn: int = 0x1000,
        gc_cutoff_lsn: int = 0,
        read_delay_s: float = 0.0,
    ) -> None:
        self._last = Lsn(last_record_lsn)
        self._gc_cutoff = Lsn(gc_cutoff_lsn)
        self._advanced = trio.Event()
        self._shutdown = trio.Event()
        self.read_delay_s = read_delay_s
        # (rel, blkno) -> [(lsn, page)] ascending; rel -> creation lsn
        self.versions: dict[tuple[RelTag, int], list[tuple[int, bytes]]] = {}
        self.rels: dict[RelTag, int] = {}
        self.slru: dict[tuple[SlruKind, int], bytes] = {}
        self.get_pages_calls: list[list[PageRead]] = []
        self.fail_get_pages: BaseException | None = None
        self.block_get_pages = False

    # -- building ---------------------------------------------------------------------------

    def put_page(self, rel: RelTag, blkno: int, lsn: int) -> None:
        self.rels.setdefault(rel, lsn)
        self.versions.setdefault((rel, blkno), []).append((lsn, page_image(rel, blkno, lsn)))
        self.versions[(rel, blkno)].sort(key=lambda v: v[0])

    def fill(self, rel: RelTag, nblocks: int, lsns: Sequence[int]) -> None:
        for blkno in range(nblocks):
            for lsn in lsns:
                self.put_page(rel, blkno, lsn)

    def advance(self, lsn: int) -> None:
        self._last = Lsn(max(self._last, lsn))
        self._advanced.set()
        self._advanced = trio.Event()

    def shut_down(self) -> None:
        self._shutdown.set()

    # -- PageReader -------------------------------------------------------------------------

    @property
    def last_record_lsn(self) -> Lsn:
        return self._last

    @property
    def gc_cutoff_lsn(self) -> Lsn:
        return self._gc_cutoff

    async def wait_lsn(self, lsn: Lsn, timeout_s: float) -> None:
        with trio.move_on_after(timeout_s):
            while self._last < lsn:
                await self._advanced.wait()
            return
        raise LsnTimeout(f"timed out waiting for WAL up to {lsn:X}, last_record_lsn {self._last:X}")

    def _size(self, rel: RelTag, lsn: int) -> int:
        blocks = [
            blk for (r, blk), vs in self.versions.items() if r == rel and vs[0][0] <= lsn
        ]
        return max(blocks) + 1 if blocks else 0

    def _exists(self, rel: RelTag, lsn: int) -> bool:
        created = self.rels.get(rel)
        return created is not None and created <= lsn

    async def get_rel_exists(self, rel: RelTag, lsn: Lsn) -> bool:
        await trio.lowlevel.checkpoint()
        return self._exists(rel, lsn)

    async def get_rel_size(self, rel: RelTag, lsn: Lsn) -> int:
        await trio.lowlevel.checkpoint()
        if not self._exists(rel, lsn):
            if rel.forknum in (1, 2):
                return 0
            raise NotFound(f"relation {rel} not found at {lsn:X}")
        return self._size(rel, lsn)

    async def get_db_size(self, dbnode: int, lsn: Lsn) -> int:
        await trio.lowlevel.checkpoint()
        return BLCKSZ * sum(
            self._size(rel, lsn)
            for rel in self.rels
            if rel.spcnode == DEFAULTTABLESPACE_OID and rel.dbnode == dbnode
        )

    async def get_slru_segment(self, kind: SlruKind, segno: int, lsn: Lsn) -> bytes:
        await trio.lowlevel.checkpoint()
        try:
            return self.slru[(kind, segno)]
        except KeyError:
            raise NotFound(f"SLRU segment {kind.name} {segno} not found") from None

    async def get_pages(self, reads: Sequence[PageRead]) -> list[bytes | PageRequestError]:
        self.get_pages_calls.append(list(reads))
        if self.read_delay_s:
            await trio.sleep(self.read_delay_s)
        else:
            await trio.lowlevel.checkpoint()
        while self.block_get_pages:
            await trio.sleep(1)
        if self.fail_get_pages is not None:
            raise self.fail_get_pages
        out: list[bytes | PageRequestError] = []
        for read in reads:
            versions = self.versions.get((read.rel, read.blkno), [])
            visible = [page for lsn, page in versions if lsn <= read.lsn]
            if visible:
                out.append(visible[-1])
            elif read.rel.relnode == 666:
                out.append(ReadError(f"could not reconstruct {read.rel} blk {read.blkno}"))
            else:
                out.append(ZERO_PAGE)
        return out

    async def get_page(self, read: PageRead) -> bytes | PageRequestError:
        # recorded as a batch of one, as the pipeline's lone requests always were
        return (await self.get_pages([read]))[0]

    async def wait_shutdown(self) -> None:
        await self._shutdown.wait()


def slru_segment(fill: int) -> bytes:
    return bytes([fill]) * (SLRU_PAGES_PER_SEGMENT * BLCKSZ)


def frame_requests(requests: Sequence[Request], version: int) -> bytes:
    buf = bytearray()
    for r in requests:
        encode_request_into(buf, r, version, framed=True)  # type: ignore[arg-type]
    return bytes(buf)


def split_responses(raw: bytes) -> list[bytes]:
    """CopyData payloads of a response byte stream (other messages are a test failure)."""
    decoder = ResponseStreamDecoder(raw)
    out: list[bytes] = []
    while True:
        event = decoder.next_event()
        if isinstance(event, bytes):
            out.append(event)
            continue
        assert not hasattr(event, "tag"), f"unexpected backend message {event!r}"
        return out


def decode_all(raw: bytes, requests: Sequence[Request], version: int) -> list[object]:
    payloads = split_responses(raw)
    return [
        decode_response(p, version, r)  # type: ignore[arg-type]
        for p, r in zip(payloads, requests, strict=False)
    ]


def new_decoder(version: int) -> RequestStreamDecoder:
    return RequestStreamDecoder(version)  # type: ignore[arg-type]
