"""The page service over the real storage engine (``TimelinePageReader`` on a ``Timeline``):
pages at several LSNs, in memory and after a flush to layer files, sizes, existence, DbSize,
zero pages past the end, and the pipelined output equal to the serial output."""

from __future__ import annotations

import struct
from pathlib import Path

import trio
import trio.testing

from pageserver.page_service.config import PageServiceConfig, PipelinedPipelining, SerialPipelining
from pageserver.page_service.pipeline import PagestreamContext, serve_pagestream_bytes
from pageserver.page_service.reader import PageRead, Shutdown, SingleTimeline
from pageserver.page_service.timeline_adapter import TimelinePageReader
from pageserver.pgdatadir import DatadirWriter
from pageserver.storage.config import StorageConfig
from pageserver.storage.value import Image
from pageserver.tenant import Tenant
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from protocol.pagestream import (
    BLCKSZ,
    DbSizeRequest,
    DbSizeResponse,
    ErrorResponse,
    ExistsRequest,
    ExistsResponse,
    GetPageRequest,
    GetPageResponse,
    NblocksRequest,
    NblocksResponse,
    RelTag,
    Request,
    StreamEnd,
)
from tests.pageserver.page_service_fakes import decode_all, frame_requests

CONFIG = StorageConfig(validate_get=True, double_buffering=False)
REL = RelTag(1663, 5, 16384, 0)
MAX = Lsn(0xFFFF_FFFF_FFFF_FFFF)
NBLOCKS = 20


def page(blkno: int, version: int) -> bytes:
    return (struct.pack(">II", blkno, version) * (BLCKSZ // 8))[:BLCKSZ]


async def build_timeline(path: Path) -> Tenant:
    tenant = Tenant(path, TenantId.generate(), CONFIG)
    tl = await tenant.create_timeline(TimelineId.generate())
    writer = DatadirWriter(tl)
    mod = writer.begin(Lsn(0x100))
    await mod.put_rel_creation((1663, 5, 16384, 0), NBLOCKS)
    for blk in range(NBLOCKS):
        await mod.put_rel_page((1663, 5, 16384, 0), blk, Image(page(blk, 1)))
    await mod.commit()
    await tl.flush()  # version 1 lives in layer files
    mod = writer.begin(Lsn(0x200))
    for blk in range(0, NBLOCKS, 2):
        await mod.put_rel_page((1663, 5, 16384, 0), blk, Image(page(blk, 2)))
    await mod.commit()  # version 2 of the even blocks is only in memory
    return tenant


def requests() -> list[Request]:
    out: list[Request] = []
    for i in range(60):
        lsn = [MAX, Lsn(0x150), Lsn(0x200)][i % 3]
        out.append(GetPageRequest(i, lsn, Lsn(0x100), REL, i % (NBLOCKS + 3)))
    out += [
        NblocksRequest(100, MAX, Lsn(0x100), REL),
        ExistsRequest(101, MAX, Lsn(0x100), RelTag(1663, 5, 16385, 0)),
        DbSizeRequest(102, MAX, Lsn(0x100), 5),
        GetPageRequest(103, MAX, Lsn(0x100), RelTag(1663, 5, 16385, 0), 0),
    ]
    return out


async def serve(tenant: Tenant, config: PageServiceConfig, reqs: list[Request]) -> bytes:
    tl = next(iter(tenant.timelines.values()))
    ctx = PagestreamContext(3, SingleTimeline(TimelinePageReader(tl)), config)
    client, server = trio.testing.memory_stream_pair()
    received = bytearray()
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            assert await serve_pagestream_bytes(server, ctx) is StreamEnd.TERMINATE
            await server.aclose()

        nursery.start_soon(run)
        await client.send_all(frame_requests(reqs, 3))
        await client.send_eof()
        while data := await client.receive_some():
            received += data
    return bytes(received)


async def test_pages_from_the_storage_engine(tmp_path: Path) -> None:
    tenant = await build_timeline(tmp_path / "t")
    reqs = requests()
    raw = await serve(tenant, PageServiceConfig(page_service_pipelining=PipelinedPipelining(8, "scattered-lsn")), reqs)
    responses = decode_all(raw, reqs, 3)
    for req, resp in zip(reqs[:60], responses[:60], strict=True):
        assert isinstance(req, GetPageRequest)
        if req.blkno >= NBLOCKS:
            expected = bytes(BLCKSZ)
        elif req.request_lsn >= 0x200 and req.blkno % 2 == 0:
            expected = page(req.blkno, 2)
        else:
            expected = page(req.blkno, 1)
        assert resp == GetPageResponse(req, expected), (req, resp)
    assert responses[60] == NblocksResponse(reqs[60], NBLOCKS)  # type: ignore[arg-type]
    assert responses[61] == ExistsResponse(reqs[61], False)  # type: ignore[arg-type]
    assert responses[62] == DbSizeResponse(reqs[62], NBLOCKS * BLCKSZ)  # type: ignore[arg-type]
    missing = responses[63]
    assert isinstance(missing, ErrorResponse) and missing.message.startswith("Not found")


async def test_pipelined_equals_serial_on_the_engine(tmp_path: Path) -> None:
    tenant = await build_timeline(tmp_path / "t")
    reqs = requests()
    serial = await serve(tenant, PageServiceConfig(page_service_pipelining=SerialPipelining()), reqs)
    for batching in ("uniform-lsn", "scattered-lsn"):
        config = PageServiceConfig(page_service_pipelining=PipelinedPipelining(32, batching))
        assert await serve(tenant, config, reqs) == serial


async def test_relation_growth_is_seen_through_the_size_cache(tmp_path: Path) -> None:
    """Sizes are cached per (fork, LSN); a later LSN with a bigger relation is a new entry."""
    tenant = await build_timeline(tmp_path / "t")
    tl = next(iter(tenant.timelines.values()))
    reader = TimelinePageReader(tl)
    beyond = PageRead(REL, NBLOCKS + 2, tl.last_record_lsn)
    assert await reader.get_pages([beyond]) == [bytes(BLCKSZ)]
    writer = DatadirWriter(tl)
    mod = writer.begin(Lsn(0x300))
    await mod.put_rel_extend((1663, 5, 16384, 0), NBLOCKS + 5)
    await mod.put_rel_page((1663, 5, 16384, 0), NBLOCKS + 2, Image(page(NBLOCKS + 2, 3)))
    await mod.commit()
    old, new = PageRead(REL, NBLOCKS + 2, Lsn(0x200)), PageRead(REL, NBLOCKS + 2, Lsn(0x300))
    assert await reader.get_pages([old, new]) == [bytes(BLCKSZ), page(NBLOCKS + 2, 3)]


async def test_reads_of_a_shut_down_timeline_end_the_stream_with_57p01(tmp_path: Path) -> None:
    """A timeline shut down under the page service: every kind of read is a ``Shutdown``
    (the stream ends with 57P01), never a per-request "not found" for pages that exist."""
    tenant = await build_timeline(tmp_path / "t")
    tl = next(iter(tenant.timelines.values()))
    reader = TimelinePageReader(tl)
    await tl.shutdown()
    reads = [PageRead(REL, blk, Lsn(0x200)) for blk in range(4)]
    for attempt in (
        lambda: reader.get_pages(reads),
        lambda: reader.get_rel_size(REL, Lsn(0x200)),
        lambda: reader.get_rel_exists(REL, Lsn(0x200)),
        lambda: reader.get_db_size(5, Lsn(0x200)),
    ):
        try:
            await attempt()
        except Shutdown as exc:
            assert exc.sqlstate == "57P01"
        else:
            raise AssertionError("a read of a shut-down timeline succeeded")
