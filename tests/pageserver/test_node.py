"""The pageserver node process: restart keeps tenants, basebackup/fullbackup over libpq boot a
vanilla PostgreSQL, pagestream serves the same pages, SIGTERM ends streams with 57P01."""

from __future__ import annotations

import gzip
import io
import tarfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import trio

from compute.page_client import PageClient
from compute.postgres import PostgresInstance
from pageserver.basebackup import CHUNK_BYTES
from protocol.ids import TenantId, TimelineId
from protocol.lsn import WAL_SEGMENT_SIZE, parse_lsn
from protocol.pagestream import RelTag
from protocol.pgwire.decoder import DEFAULT_MAX_MESSAGE_LEN
from protocol.pgwire.errors import PgError
from tests.pageserver.basebackup_helpers import unpack_tar
from tests.pageserver.node_helpers import NodeProcess, running_node
from tests.tmpdirs import pg_tmpdir

pytestmark = pytest.mark.postgres


@pytest.fixture
def base() -> Iterator[Path]:
    with pg_tmpdir("pagestore-node-") as path:
        yield path


@pytest.fixture
def node(base: Path) -> Iterator[NodeProcess]:
    with running_node(base / "ps") as proc:
        yield proc


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[NodeProcess, tuple[str, str, str]]]:
    """One node with one bootstrapped timeline for the tests that only read."""
    with pg_tmpdir("pagestore-node-") as path, running_node(path / "ps") as proc:
        yield proc, _bootstrap(proc)


def _bootstrap(node: NodeProcess) -> tuple[str, str, str]:
    status, body = node.request("POST", "/v1/tenant", {})
    assert status == 201, body
    tenant = body["tenant_id"]
    status, info = node.request("POST", f"/v1/tenant/{tenant}/timeline", {})
    assert status == 201, info
    return tenant, info["timeline_id"], info["last_record_lsn"]


def _copy_out_chunks(node: NodeProcess, query: str) -> list[bytes]:
    """The CopyData payloads of a COPY OUT, one per message (libpq's PQgetCopyData)."""
    with (
        psycopg.connect(host="127.0.0.1", port=node.pg_port, user="postgres", dbname="postgres",
                        autocommit=True) as conn,
        conn.cursor() as cur,
        cur.copy(query) as copy,
    ):
        return [bytes(chunk) for chunk in copy]


def _copy_out(node: NodeProcess, query: str) -> bytes:
    return b"".join(_copy_out_chunks(node, query))


def test_basebackup_over_libpq_boots_postgres(
    shared: tuple[NodeProcess, tuple[str, str, str]], base: Path
) -> None:
    node, (tenant, timeline, lsn) = shared
    chunks = _copy_out_chunks(node, f"basebackup {tenant} {timeline}")
    # The 16 MiB WAL segment too goes out in CopyData messages of at most CHUNK_BYTES, so a
    # client with the default 16 MiB message limit reads any basebackup.
    assert max(len(c) for c in chunks) <= CHUNK_BYTES < DEFAULT_MAX_MESSAGE_LEN
    data = b"".join(chunks)
    assert len(data) > WAL_SEGMENT_SIZE
    packed = _copy_out(node, f"basebackup {tenant} {timeline} {lsn} --gzip")
    full = _copy_out(node, f"fullbackup {tenant} {timeline} {lsn}")
    assert packed[:2] == b"\x1f\x8b"

    def names(blob: bytes) -> list[str]:
        with tarfile.open(fileobj=io.BytesIO(blob)) as tf:
            return tf.getnames()

    assert names(gzip.decompress(packed)) == names(data) == names(full)

    for i, blob in enumerate((data, gzip.decompress(packed), full)):
        target = base / f"pg{i}"
        unpack_tar(blob, target)
        pg = PostgresInstance(datadir=target)
        pg.start()
        try:
            assert int(pg.psql("SELECT count(*) FROM pg_class")) > 300
            pg.psql("CREATE TABLE t AS SELECT 1 AS x")
        finally:
            pg.stop()
    # --replica: a read-only hot standby at the LSN.
    replica = _copy_out(node, f"basebackup {tenant} {timeline} {lsn} --replica")
    assert "standby.signal" in names(replica) and "standby.signal" not in names(data)
    unpack_tar(replica, base / "replica")
    pg = PostgresInstance(datadir=base / "replica")
    pg.start()
    try:
        assert pg.psql("SELECT pg_is_in_recovery()") == "t"
        with pytest.raises(Exception, match="read-only"):
            pg.psql("CREATE TABLE t AS SELECT 1 AS x")
    finally:
        pg.stop()


BAD_BACKUP_QUERIES = [
    ("basebackup", "cannot parse query"),
    ("basebackup abc", "at least 2 arguments"),
    ("basebackup {t} nothex", "TimelineId"),
    ("basebackup {t} {z}", "not found"),
    ("basebackup {z} {tl}", "not found"),
    ("basebackup {t} {tl} 0/XYZ", "bad lsn"),
    ("basebackup {t} {tl} latest --gzip --gzip", "duplicate flag"),
    ("basebackup {t} {tl} --bogus", "unknown argument"),
    ("fullbackup {t} {tl} 0/1 0/1 0/1", "at most 4 arguments"),
    ("basebackup {t} {tl} 0/1000004", "not a record boundary"),
    ("basebackup {t} {tl} 0/8", "no data directory at 0/8"),
    ("fullbackup {t} {tl} 0/1000000 0/2000000", "prev_lsn 0/2000000 is not before"),
]


def test_basebackup_argument_errors(shared: tuple[NodeProcess, tuple[str, str, str]]) -> None:
    node, (tenant, timeline, lsn) = shared
    for query, fragment in BAD_BACKUP_QUERIES:
        sql = query.format(t=tenant, tl=timeline, z="00" * 16)
        with pytest.raises(psycopg.Error, match=fragment):
            _copy_out(node, sql)
    # The connection-level state is fine afterwards: a good backup still works.
    assert _copy_out(node, f"basebackup {tenant} {timeline} {lsn}")[:100]


async def test_pagestream_page_equals_basebackup_file(
    shared: tuple[NodeProcess, tuple[str, str, str]]
) -> None:
    node, (tenant, timeline, lsn) = shared
    data = await trio.to_thread.run_sync(_copy_out, node, f"basebackup {tenant} {timeline}")
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        member = tf.extractfile("base/5/1259")
        assert member is not None
        pg_class = member.read()
    async with await PageClient.connect("127.0.0.1", node.pg_port, TenantId.parse(tenant),
                                        TimelineId.parse(timeline)) as client:
        rel = RelTag(1663, 5, 1259, 0)
        nblocks = await client.nblocks(rel)
        assert nblocks * 8192 == len(pg_class)
        for blk in range(nblocks):
            page = await client.get_page(rel, blk, parse_lsn(lsn))
            assert page == pg_class[blk * 8192 : (blk + 1) * 8192], blk
        assert await client.exists(rel)
        assert not await client.exists(RelTag(1663, 5, 999_999, 0))


async def test_sigterm_ends_pagestream_with_57p01_and_restart_keeps_tenants(node: NodeProcess) -> None:
    tenant, timeline, lsn = await trio.to_thread.run_sync(_bootstrap, node)
    async with await PageClient.connect("127.0.0.1", node.pg_port, TenantId.parse(tenant),
                                        TimelineId.parse(timeline)) as client:
        rel = RelTag(1663, 5, 1259, 0)
        assert await client.nblocks(rel) > 0
        code = await trio.to_thread.run_sync(node.stop)
        assert code == 0
        with pytest.raises(PgError) as info:
            for _ in range(3):
                await client.nblocks(rel)
        assert info.value.sqlstate == "57P01"
    assert "pageserver stopped" in node.log_text

    await trio.to_thread.run_sync(node.start)
    status, got = await trio.to_thread.run_sync(node.request, "GET", f"/v1/tenant/{tenant}/timeline/{timeline}")
    assert status == 200, got
    assert got["last_record_lsn"] == lsn and got["disk_consistent_lsn"] == lsn
    status, tenants = await trio.to_thread.run_sync(node.request, "GET", "/v1/tenant")
    assert [t["id"] for t in tenants] == [tenant]
