"""A pageserver node with remote storage (a real SeaweedFS): a node that loses its whole data
directory gets its tenants back from object storage, pages equal."""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path

import pytest

from remote_storage import S3StorageConfig
from tests.pageserver.node_helpers import running_node
from tests.pageserver.test_node import _bootstrap, _copy_out
from tests.tmpdirs import pg_tmpdir

pytestmark = pytest.mark.postgres


def _files(tar: bytes) -> dict[str, bytes]:
    out = {}
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        for m in tf.getmembers():
            f = tf.extractfile(m)
            if f is not None:
                out[m.name] = f.read()
    return out


def test_node_loses_its_disk_and_comes_back_from_s3(s3_config: object) -> None:
    assert isinstance(s3_config, S3StorageConfig)
    c = s3_config
    extra = (
        f'remote_storage = {{kind = "s3", endpoint = "{c.endpoint}", bucket = "{c.bucket}", '
        f'prefix = "{c.prefix}", access_key_id = "test", secret_access_key = "test", create_bucket = true}}\n'
    )
    with pg_tmpdir("pagestore-remote-node-") as base:
        workdir = base / "ps"
        with running_node(workdir, extra) as node:
            tenant, timeline, lsn = _bootstrap(node)
            status, info = node.request("GET", f"/v1/tenant/{tenant}/timeline/{timeline}")
            assert status == 200, info
            # creation returns once the remote has it
            assert info["remote_consistent_lsn"] == info["disk_consistent_lsn"] == lsn
            before = _files(_copy_out(node, f"fullbackup {tenant} {timeline} {lsn}"))
            node.kill()  # kill -9
        for entry in Path(workdir).iterdir():
            if entry.name != "pageserver.toml":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        with running_node(workdir, extra) as node:
            status, info = node.request("GET", f"/v1/tenant/{tenant}/timeline/{timeline}")
            assert status == 200, info
            assert info["last_record_lsn"] == lsn
            assert info["remote_consistent_lsn"] == lsn
            after = _files(_copy_out(node, f"fullbackup {tenant} {timeline} {lsn}"))
        assert after.keys() == before.keys()
        # pg_control and the WAL segment are made per request (the checkpoint record's time,
        # and the previous record's LSN, known only for WAL this process ingested itself);
        # every relation file, SLRU and map is the data and must be equal.
        generated = {"global/pg_control", "pg_wal/000000010000000000000001"}
        diff = [name for name in before if name not in generated and before[name] != after[name]]
        assert not diff, diff[:5]
