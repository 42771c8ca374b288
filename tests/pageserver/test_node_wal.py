"""The whole loop through one pageserver node: bootstrap -> basebackup -> vanilla PostgreSQL
-> walproposer bridge (streaming from the basebackup LSN) -> safekeeper -> the node's WAL
receiver -> a new basebackup that holds the new data. Checks the basebackup LSN rule."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from compute.postgres import PostgresInstance, pg_binary, run_as_postgres
from control_plane.process import wait_until
from pageserver.pg_control import parse_control_file
from protocol.lsn import WAL_SEGMENT_SIZE, parse_lsn
from protocol.wal.reader import WalStreamDecoder
from protocol.wal.record import DecodedRecord
from safekeeper.testing import SafekeeperProcess
from tests.pageserver.basebackup_helpers import unpack_tar
from tests.pageserver.node_helpers import REPO, NodeProcess
from tests.tmpdirs import pg_tmpdir

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def _copy_out(port: int, query: str) -> bytes:
    with (
        psycopg.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres", autocommit=True) as conn,
        conn.cursor() as cur,
        cur.copy(query) as copy,
    ):
        return b"".join(bytes(chunk) for chunk in copy)


def _waldump_lsn(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:08X}"


def _checkpoint_xl_prev(tar_bytes: bytes) -> int:
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tf:
        control = parse_control_file(tf.extractfile("global/pg_control").read())  # type: ignore[union-attr]
        seg = [m for m in tf.getmembers() if m.name.startswith("pg_wal/0")]
        assert len(seg) == 1
        wal = tf.extractfile(seg[0]).read()  # type: ignore[union-attr]
    page = control.checkpoint - control.checkpoint % 8192
    seg_start = control.checkpoint - control.checkpoint % WAL_SEGMENT_SIZE
    dec = WalStreamDecoder(control.checkpoint, data_start=page)
    dec.feed(wal[page - seg_start :])
    rec = dec.next_record()
    assert isinstance(rec, DecodedRecord), rec
    return int(rec.xl_prev)


@pytest.fixture
def base() -> Iterator[Path]:
    with pg_tmpdir("pagestore-nodewal-") as path:
        yield path


def test_compute_wal_flows_back_into_the_timeline(base: Path) -> None:
    sk = SafekeeperProcess(base / "sk", node_id=1)
    sk.start(timeout=90)
    node = NodeProcess.configure(base / "ps", f'safekeepers = ["127.0.0.1:{sk.pg_port}"]\n')
    procs: list[subprocess.Popen[bytes]] = []
    computes: list[PostgresInstance] = []
    try:
        node.start()
        status, body = node.request("POST", "/v1/tenant", {})
        tenant = body["tenant_id"]
        status, info = node.request("POST", f"/v1/tenant/{tenant}/timeline", {})
        assert status == 201, info
        timeline, start_lsn = info["timeline_id"], info["last_record_lsn"]

        unpack_tar(_copy_out(node.pg_port, f"basebackup {tenant} {timeline}"), base / "compute")
        pg = PostgresInstance(
            datadir=base / "compute",
            settings={"wal_level": "replica", "max_wal_senders": "10", "fsync": "off",
                      "synchronous_standby_names": "walproposer", "synchronous_commit": "on"},
        )
        pg.start()
        computes.append(pg)
        bridge = subprocess.Popen(
            [sys.executable, "-m", "control_plane.cli", "walproposer", "--pg-port", str(pg.port),
             "--safekeepers", f"127.0.0.1:{sk.pg_port}", "--tenant-id", tenant, "--timeline-id", timeline,
             "--start-lsn", start_lsn],
            cwd=REPO, stdout=open(base / "bridge.log", "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
        )
        procs.append(bridge)
        # A synchronous commit returns only once the safekeeper has the WAL.
        # (the bridge, a Python subprocess, must start and win an election first: slow when loaded)
        pg.psql("CREATE TABLE t AS SELECT generate_series(1, 1000) AS x", timeout=120)
        flush = parse_lsn(pg.psql("SELECT pg_current_wal_flush_lsn()"))

        def ingested() -> bool:
            _, tl = node.request("GET", f"/v1/tenant/{tenant}/timeline/{timeline}")
            return parse_lsn(tl["last_record_lsn"]) >= flush

        wait_until("the pageserver to ingest the compute's WAL", ingested, timeout=120)
        _, tl = node.request("GET", f"/v1/tenant/{tenant}/timeline/{timeline}")
        assert tl["wal_receiver_safekeeper"] == f"127.0.0.1:{sk.pg_port}"

        data = _copy_out(node.pg_port, f"basebackup {tenant} {timeline} {tl['last_record_lsn']} --replica")
        # The checkpoint record's xl_prev is the start of the last record the node ingested:
        # pg_waldump of the compute's own WAL finds a record exactly there.
        xl_prev = _checkpoint_xl_prev(data)
        assert 0 < xl_prev < parse_lsn(tl["last_record_lsn"])
        dump = run_as_postgres(
            [pg_binary("pg_waldump"), "-p", str(base / "compute" / "pg_wal"), "-s", _waldump_lsn(xl_prev), "-n", "1"],
            check=False,
        ).stdout.decode()
        assert f"lsn: {_waldump_lsn(xl_prev)}," in dump, dump
        unpack_tar(data, base / "reader")
        reader = PostgresInstance(datadir=base / "reader")
        reader.start()
        computes.append(reader)
        assert reader.psql("SELECT sum(x) FROM t") == "500500"

        # A graceful stop flushes: after a restart the ingested WAL is on disk already.
        assert node.stop() == 0
        node.start()
        _, tl = node.request("GET", f"/v1/tenant/{tenant}/timeline/{timeline}")
        assert parse_lsn(tl["disk_consistent_lsn"]) >= flush, tl
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        for c in computes:
            c.stop("immediate")
        try:
            if node.proc is not None:
                node.stop()
        finally:
            node.kill()
            if sk.proc is not None:
                sk.proc.kill()
                sk.proc.wait(10)
