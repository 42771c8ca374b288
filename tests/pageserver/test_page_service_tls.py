"""The page service over TLS on a real socket: a pipelined client's batches (up to 32 pages,
so a batch's responses are larger than ``tls_stream.STREAM_PIECE`` and leave in pieces) come
back whole and in order, as the server does it by default and with the sender thread."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
import trio
from prometheus_client import CollectorRegistry

from common.pgserver import PgServer, PgServerConfig
from common.tls import client_context, server_context
from compute.page_client import PageClient
from pageserver.page_service.config import PageServiceConfig, PipelinedPipelining
from pageserver.page_service.handler import PageServiceHandler
from pageserver.page_service.metrics import PageServiceMetrics
from protocol.lsn import Lsn
from protocol.pagestream import GetPageRequest, GetPageResponse
from tests.auth_helpers import TlsKit
from tests.pageserver.page_service_fakes import FakeTimeline, page_image
from tests.pageserver.test_page_service_handler import MAX, REL, TENANT, TIMELINE, Lookup


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsKit:
    return TlsKit.create(tmp_path_factory.mktemp("tls"))


@pytest.mark.parametrize("sender_thread", [False, True, "auto"], ids=["inline", "thread", "auto"])
async def test_pipelined_pages_over_tls_arrive_whole_and_in_order(
    tls: TlsKit, sender_thread: bool | Literal["auto"], tmp_path: Path
) -> None:
    tl = FakeTimeline(last_record_lsn=0x1000, read_delay_s=0.002)  # slow reads: batches form
    tl.fill(REL, 64, [0x100])
    metrics = PageServiceMetrics.register(CollectorRegistry())
    config = PageServiceConfig(page_service_pipelining=PipelinedPipelining(32, "scattered-lsn"))
    handler = PageServiceHandler(Lookup({(TENANT, TIMELINE): tl}), config, metrics)
    server = PgServer(
        handler,
        PgServerConfig(port=0, idle_timeout_s=None, tls_sender_thread=sender_thread),
        ssl_context=server_context(tls.cert, tls.key),
    )
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve)
            async with await PageClient.connect(
                "127.0.0.1", port, TENANT, TIMELINE, ssl_context=client_context(tls.ca_cert)
            ) as client:
                requests = [
                    GetPageRequest(client.next_reqid(), MAX, Lsn(0), REL, (i * 7) % 64)
                    for i in range(600)
                ]
                responses = await client.pipelined(requests, queue_depth=32)
            server.shutdown()
            nursery.cancel_scope.cancel()
    assert [r.request for r in responses] == requests  # type: ignore[union-attr]
    for r in responses:
        assert isinstance(r, GetPageResponse)
        assert r.page == page_image(REL, r.request.blkno, 0x100)
    assert metrics.batching_factor() > 8  # batches of more than STREAM_PIECE bytes formed
