"""The lazy basebackup (``--lazy``: no relation data but unlogged relations' init forks) and the
relation listing a lazy endpoint's page filesystem starts from."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from compute.postgres import initdb
from pageserver.basebackup import (
    BackupCommand,
    TarWriter,
    parse_backup_command,
    relation_listing,
    write_basebackup,
)
from pageserver.pg_control import parse_control_file
from protocol.lsn import Lsn
from protocol.wal.page import record_end_lsn
from tests.pageserver.basebackup_helpers import DirectorySource
from tests.tmpdirs import pg_tmpdir

pytestmark = pytest.mark.postgres

UNLOGGED = 99999  # an unlogged relation added to template1: its init fork only
BIG = 99998  # a large permanent relation: must not change the lazy tar's size


@pytest.fixture(scope="module")
def datadirs() -> Iterator[tuple[Path, Path]]:
    """(initdb's directory with an unlogged relation, the same plus a 4 MiB relation)."""
    with pg_tmpdir("pagestore-bblazy-") as base:
        small = base / "small"
        initdb(small)
        init_page = bytes(range(256)) * 32
        (small / "base" / "1" / f"{UNLOGGED}_init").write_bytes(init_page)
        big = base / "big"
        shutil.copytree(small, big)
        (big / "base" / "1" / str(BIG)).write_bytes(b"\x01" * 8192 * 512)
        yield small, big


def _lsn(datadir: Path) -> Lsn:
    control = parse_control_file((datadir / "global" / "pg_control").read_bytes())
    return record_end_lsn(control.checkpoint, 24 + 2 + 88)


async def _tar(datadir: Path, *, lazy: bool) -> bytes:
    chunks: list[bytes] = []

    async def send(b: bytes) -> None:
        chunks.append(b)

    await write_basebackup(DirectorySource(datadir), _lsn(datadir), send, lazy=lazy, now=1_700_000_000)
    return b"".join(chunks)


async def test_lazy_tar_has_no_relation_data_but_init_forks(datadirs: tuple[Path, Path]) -> None:
    small, _ = datadirs
    data = await _tar(small, lazy=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        files = {m.name: m for m in tf.getmembers()}
        init = tf.extractfile(f"base/1/{UNLOGGED}_init")
        main = tf.extractfile(f"base/1/{UNLOGGED}")
        assert init is not None and main is not None
        # The unlogged relation starts from its init fork, as after a crash.
        assert init.read() == main.read() == (small / "base" / "1" / f"{UNLOGGED}_init").read_bytes()
    for needed in ("global/pg_control", "global/pg_filenode.map", "base/1/PG_VERSION",
                   "base/1/pg_filenode.map", "base/5/PG_VERSION", "pg_xact/0000", "PG_VERSION"):
        assert needed in files, needed
    assert files["base/5"].isdir()
    relation_files = [n for n in files if n.split("/")[-1][:1].isdigit() and n.startswith(("base/", "global/"))
                      and files[n].isfile()]
    assert sorted(relation_files) == [f"base/1/{UNLOGGED}", f"base/1/{UNLOGGED}_init"]
    full = await _tar(small, lazy=False)
    assert len(data) < len(full) // 2


async def test_lazy_tar_size_does_not_grow_with_the_data(datadirs: tuple[Path, Path]) -> None:
    small, big = datadirs
    assert len(await _tar(small, lazy=True)) == len(await _tar(big, lazy=True))
    assert len(await _tar(big, lazy=False)) >= len(await _tar(small, lazy=False)) + 8192 * 512


async def test_relation_listing_matches_the_files(datadirs: tuple[Path, Path]) -> None:
    _, big = datadirs
    listing = await relation_listing(DirectorySource(big), _lsn(big))
    dbs = {(d.spcnode, d.dbnode): d for d in listing.databases}
    assert (1664, 0) in dbs and (1663, 1) in dbs and (1663, 5) in dbs
    assert all(d.has_relmap for d in listing.databases)
    rels = {r.relnode: r.forks for r in dbs[(1663, 1)].relations}
    assert rels[BIG] == {"main": 512}
    assert rels[UNLOGGED] == {"init": 1}
    pg_class = rels[1259]
    assert pg_class["main"] == (big / "base" / "1" / "1259").stat().st_size // 8192
    assert pg_class["fsm"] == (big / "base" / "1" / "1259_fsm").stat().st_size // 8192
    for d in listing.databases:
        for r in d.relations:
            assert set(r.forks) <= {"main", "fsm", "vm", "init"}


def test_lazy_flag_parses() -> None:
    t, tl = "11" * 16, "22" * 16
    cmd = parse_backup_command("basebackup", (t, tl, "0/16B5A50", "--lazy", "--replica"))
    assert isinstance(cmd, BackupCommand) and cmd.lazy and cmd.replica and not cmd.gzip
    assert not parse_backup_command("basebackup", (t, tl)).lazy


async def test_lazy_tar_carries_the_wal_segment_as_a_hole(datadirs: tuple[Path, Path], tmp_path: Path) -> None:
    """The 16 MiB segment goes as a GNU sparse member: Python's tarfile and GNU tar both
    extract the same bytes as the full tar's plain member, as a file with a hole."""
    small, _ = datadirs
    lazy, full = await _tar(small, lazy=True), await _tar(small, lazy=False)
    assert len(lazy) < 1 << 20  # the segment is 16 MiB
    with tarfile.open(fileobj=io.BytesIO(full)) as tf:
        [name] = [m.name for m in tf.getmembers() if m.name.startswith("pg_wal/") and m.isfile()]
        f = tf.extractfile(name)
        assert f is not None
        want = f.read()
    assert len(want) == 16 << 20
    with tarfile.open(fileobj=io.BytesIO(lazy)) as tf:
        member = tf.getmember(name)
        assert member.type == tarfile.GNUTYPE_SPARSE and member.size == len(want)
        tf.extractall(tmp_path / "py", members=[member], filter="data")
    gnu = tmp_path / "gnu"
    gnu.mkdir()
    subprocess.run(["tar", "-x", "-C", str(gnu), name], input=lazy, check=True)
    for root in (tmp_path / "py", gnu):
        path = root / name
        assert path.read_bytes() == want
        assert path.stat().st_blocks * 512 < 1 << 20  # a hole, not 16 MiB of zeros


async def test_sparse_member_with_many_runs(tmp_path: Path) -> None:
    """More runs than the header holds (4) go into extension blocks (21 each)."""
    data = bytearray(8192 * 120)
    for i in range(0, 120, 2):  # 60 runs of one page each
        data[i * 8192 : i * 8192 + 5] = b"page%d" % (i % 10)
    chunks: list[bytes] = []

    async def send(b: bytes) -> None:
        chunks.append(b)

    tar = TarWriter(send, mtime=1_700_000_000)
    await tar.add_sparse_file("x/sparse", data)
    await tar.add_file("x/after", b"next member")
    await tar.close()
    raw = b"".join(chunks)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        tf.extractall(tmp_path / "py", filter="data")
    assert (tmp_path / "py/x/sparse").read_bytes() == bytes(data)
    assert (tmp_path / "py/x/after").read_bytes() == b"next member"
    (tmp_path / "gnu").mkdir()
    subprocess.run(["tar", "-x", "-C", str(tmp_path / "gnu")], input=raw, check=True)
    assert (tmp_path / "gnu/x/sparse").read_bytes() == bytes(data)
    assert (tmp_path / "gnu/x/after").read_bytes() == b"next member"
