"""The page filesystem mounted for real (pyfuse3, /dev/fuse) over a fake page service: what
PostgreSQL's md.c and fd.c do to ``base/`` and ``global/`` (listing, sizes, 8 KiB and 128 KiB
reads, extension, truncation, unlink, O_EXCL creates, mkdir/rmdir, rename, fsync), and that a
kernel read becomes one GetPage batch and a repeated read never reaches the daemon."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio

pyfuse3 = pytest.importorskip("pyfuse3")

from compute.pagefs.cache_file import LocalPageFile  # noqa: E402
from compute.pagefs.fs import DirNode, Listing, ListingError, PageFs, RelNode  # noqa: E402
from compute.pagefs.page_header import BLCKSZ, make_page  # noqa: E402
from compute.pagefs.remote import PageFetcher, PageFetchError  # noqa: E402
from compute.pagefs.store import Keep, PageStore, RemoteRead  # noqa: E402
from protocol.ids import TenantId, TimelineId  # noqa: E402
from protocol.lsn import Lsn  # noqa: E402
from protocol.pagestream import RelTag  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse") or os.geteuid() != 0,
                                reason="needs /dev/fuse and root (to mount)")
S = Lsn(0x0300_0000)
T = TypeVar("T")


def remote_page(rel: RelTag, blkno: int) -> bytes:
    return make_page(S - 8, fill=(rel.relnode + blkno) % 251)


class FakeFetcher(PageFetcher):
    def __init__(self) -> None:
        super().__init__("127.0.0.1", 1, TenantId(bytes(16)), TimelineId(bytes(16)))
        self.seen: list[list[RemoteRead]] = []
        self.fail = False

    async def fetch(self, rel: RelTag, reads: Sequence[RemoteRead]) -> list[bytes | memoryview]:
        if self.fail:
            raise PageFetchError("the page service is gone")
        if reads:
            self.seen.append(list(reads))
        await trio.lowlevel.checkpoint()
        return [remote_page(rel, r.blkno) for r in reads]


@pytest.fixture
async def mounted(tmp_path: Path) -> AsyncIterator[tuple[Path, PageFs, FakeFetcher]]:
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    (backing / "base" / "5").mkdir(parents=True)
    (backing / "global").mkdir()
    mnt.mkdir()
    (backing / "base" / "5" / "PG_VERSION").write_text("15\n")
    (backing / "global" / "pg_control").write_bytes(b"c" * 8192)
    init = make_page(0, fill=0x44)
    (backing / "base" / "5" / "16390_init").write_bytes(init)
    (backing / "base" / "5" / "16390").write_bytes(init)
    listing = Listing([(1664, 0, {1262: {"main": 1}}),
                       (1663, 5, {16384: {"main": 40, "fsm": 3}, 16390: {"init": 1}}),
                       (16400, 0, {}), (16400, 5, {16401: {"main": 3}}), (16402, 0, {})])
    fetcher = FakeFetcher()
    store = PageStore(LocalPageFile(tmp_path / "cache", 1024), start_lsn=S, primary=True,
                      durable_lsn=lambda: S, wal_log_hints=True)
    fs = PageFs(store, fetcher, backing, uid=0, gid=0)
    fs.load(listing)
    pyfuse3.init(fs, str(mnt), set(pyfuse3.default_options) | {"fsname=pagefs-test"})
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pyfuse3.main)
            yield mnt, fs, fetcher
            pyfuse3.terminate()
            nursery.cancel_scope.cancel()
    finally:
        pyfuse3.close(unmount=True)
        store.cache.close()


async def io(fn: Callable[..., T], *args: Any) -> T:
    """File IO on the mount runs in a thread: the trio thread serves the FUSE requests."""
    return await trio.to_thread.run_sync(fn, *args)


def pread(path: Path, size: int, off: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, off)
    finally:
        os.close(fd)


def pwrite(path: Path, data: bytes, off: int, flags: int = 0) -> None:
    fd = os.open(path, os.O_RDWR | flags, 0o600)
    try:
        assert os.pwrite(fd, data, off) == len(data)
        os.fsync(fd)  # answered ENOSYS by the daemon: the kernel reports success
    finally:
        os.close(fd)


async def test_listing_sizes_and_local_files(mounted: tuple[Path, PageFs, FakeFetcher]) -> None:
    mnt, _, _ = mounted
    names = set(await io(os.listdir, mnt / "base" / "5"))
    assert names == {"PG_VERSION", "16384", "16384_fsm", "16390", "16390_init"}
    assert set(await io(os.listdir, mnt)) == {"base", "global", "pg_tblspc"}
    assert (await io(os.stat, mnt / "base" / "5" / "16384")).st_size == 40 * BLCKSZ
    assert (await io((mnt / "base" / "5" / "PG_VERSION").read_text)) == "15\n"
    assert not await io((mnt / "base" / "5" / "16384.1").exists)  # GetNewRelFileNode's access()
    # the unlogged relation came from the backing directory and lives in the page store
    assert await io(pread, mnt / "base" / "5" / "16390", BLCKSZ, 0) == make_page(0, fill=0x44)


async def test_reads_are_batched_and_cached_by_the_kernel(mounted: tuple[Path, PageFs, FakeFetcher]) -> None:
    mnt, _, fetcher = mounted
    rel = RelTag(1663, 5, 16384, 0)
    path = mnt / "base" / "5" / "16384"
    data = await io(path.read_bytes)
    assert data == b"".join(remote_page(rel, b) for b in range(40))
    assert sum(len(b) for b in fetcher.seen) == 40
    assert max(len(b) for b in fetcher.seen) == 16  # a 128 KiB readahead is one batch
    assert {r.not_modified_since for b in fetcher.seen for r in b} == {S}
    before = len(fetcher.seen)
    assert await io(pread, path, BLCKSZ, 7 * BLCKSZ) == remote_page(rel, 7)
    assert len(fetcher.seen) == before  # keep_cache: the kernel's page cache answered


async def test_write_extend_truncate_unlink(mounted: tuple[Path, PageFs, FakeFetcher]) -> None:
    mnt, fs, fetcher = mounted
    path = mnt / "base" / "5" / "16400"
    # mdcreate: O_CREAT|O_EXCL; a second create of the same name fails
    await io(pwrite, path, b"", 0, os.O_CREAT | os.O_EXCL)
    with pytest.raises(FileExistsError):
        await io(pwrite, path, b"", 0, os.O_CREAT | os.O_EXCL)
    pages = [make_page(S + 8 * (i + 1), fill=i + 1) for i in range(4)]
    for i, page in enumerate(pages):  # mdextend
        await io(pwrite, path, page, i * BLCKSZ)
    await io(pwrite, path, make_page(S + 64, fill=9), 9 * BLCKSZ)  # an extension with a gap
    assert (await io(os.stat, path)).st_size == 10 * BLCKSZ
    assert await io(pread, path, BLCKSZ, 5 * BLCKSZ) == bytes(BLCKSZ)
    assert await io(pread, path, BLCKSZ, 2 * BLCKSZ) == pages[2]
    assert not fetcher.seen  # a new file never reads from the page service
    await io(os.truncate, path, 2 * BLCKSZ)  # mdtruncate / mdunlink's truncate(path, 0)
    assert (await io(os.stat, path)).st_size == 2 * BLCKSZ
    await io(pwrite, path, make_page(S + 72, fill=3), 3 * BLCKSZ)
    assert await io(pread, path, BLCKSZ, 2 * BLCKSZ) == bytes(BLCKSZ)
    await io(os.unlink, path)
    assert not await io(path.exists)
    # an existing relation: a write replaces the pageserver's page
    old = mnt / "base" / "5" / "16384"
    await io(pwrite, old, pages[0], 3 * BLCKSZ)
    assert await io(pread, old, BLCKSZ, 3 * BLCKSZ) == pages[0]
    assert fs.store.metrics.writes >= 6


async def test_large_and_unaligned_writes(mounted: tuple[Path, PageFs, FakeFetcher]) -> None:
    """copydir writes 64 KiB at a time; a writer that is not PostgreSQL may write any range."""
    mnt, _, _ = mounted
    path = mnt / "base" / "5" / "16401"
    big = b"".join(make_page(S + 8, fill=i + 1) for i in range(8))
    await io(pwrite, path, big, 0, os.O_CREAT | os.O_EXCL)
    assert await io(pread, path, len(big), 0) == big
    await io(pwrite, path, b"\xee" * 100, BLCKSZ - 50)  # across a block boundary
    got = await io(pread, path, 2 * BLCKSZ, 0)
    assert got[BLCKSZ - 50 : BLCKSZ + 50] == b"\xee" * 100
    assert got[: BLCKSZ - 50] == big[: BLCKSZ - 50] and got[BLCKSZ + 50 :] == big[BLCKSZ + 50 : 2 * BLCKSZ]
    # an unaligned write into a page of the pageserver merges with it
    rel = RelTag(1663, 5, 16384, 0)
    await io(pwrite, mnt / "base" / "5" / "16384", b"\x01\x02", 30 * BLCKSZ + 10)
    page = await io(pread, mnt / "base" / "5" / "16384", BLCKSZ, 30 * BLCKSZ)
    want = bytearray(remote_page(rel, 30))
    want[10:12] = b"\x01\x02"
    assert page == bytes(want)


async def test_directories_rename_and_io_errors(mounted: tuple[Path, PageFs, FakeFetcher]) -> None:
    mnt, fs, fetcher = mounted
    db = mnt / "base" / "16500"
    await io(db.mkdir)  # CREATE DATABASE
    await io(pwrite, db / "1259", make_page(S - 0x100, fill=1), 0, os.O_CREAT | os.O_EXCL)
    base = fs.nodes[fs.children_of(1)[b"base"]]
    node = fs.nodes[fs.children_of(base.ino)[b"16500"]]
    assert isinstance(node, DirNode) and node.db == (1663, 16500) and node.created_here
    with pytest.raises(OSError):
        await io(db.rmdir)  # not empty
    await io(os.unlink, db / "1259")
    await io(db.rmdir)  # DROP DATABASE
    assert "16500" not in await io(os.listdir, mnt / "base")
    # pg_internal.init is written under a temporary name and renamed
    tmp = mnt / "base" / "5" / "pg_internal.init.123"
    await io(tmp.write_bytes, b"relcache")
    await io(os.rename, tmp, mnt / "base" / "5" / "pg_internal.init")
    assert await io((mnt / "base" / "5" / "pg_internal.init").read_bytes) == b"relcache"
    assert (fs.backing / "base" / "5" / "pg_internal.init").read_bytes() == b"relcache"
    # a page service that is gone: PostgreSQL sees EIO
    fetcher.fail = True
    with pytest.raises(OSError) as exc:
        await io(pread, mnt / "base" / "5" / "16384_fsm", BLCKSZ, 0)
    assert exc.value.errno == 5
    assert fs.read_errors >= 1


async def test_tablespaces_in_place_and_linked(mounted: tuple[Path, PageFs, FakeFetcher]) -> None:
    """Tablespaces of the listing are directories in place under ``pg_tblspc``; their database
    directories are served like ``base/<db>``; CREATE/DROP TABLESPACE in place are mkdir and
    rmdir; one with a location is a symbolic link (to a directory outside the mount)."""
    mnt, fs, fetcher = mounted
    tblspc = mnt / "pg_tblspc"
    assert sorted(await io(os.listdir, tblspc)) == ["16400", "16402"]
    assert await io(os.listdir, tblspc / "16402") == ["PG_15_202209061"]  # no database in it yet
    path = tblspc / "16400" / "PG_15_202209061" / "5" / "16401"
    rel = RelTag(16400, 5, 16401, 0)
    assert await io(path.read_bytes) == b"".join(remote_page(rel, b) for b in range(3))
    assert fetcher.seen[-1][0].not_modified_since == S
    # CREATE TABLESPACE ... LOCATION '' and a database in it (CREATE DATABASE ... TABLESPACE)
    vdir = tblspc / "16410" / "PG_15_202209061"
    await io(os.makedirs, vdir / "16411")
    await io(pwrite, vdir / "16411" / "1259", make_page(S - 0x100, fill=2), 0, os.O_CREAT | os.O_EXCL)
    v = fs.nodes[fs.children_of(fs.children_of(fs.children_of(1)[b"pg_tblspc"])[b"16410"])[b"PG_15_202209061"]]
    node = fs.nodes[fs.children_of(v.ino)[b"16411"]]
    assert isinstance(node, DirNode) and node.db == (16410, 16411) and node.created_here
    created = fs.nodes[node.children[b"1259"]]
    assert isinstance(created, RelNode) and created.file is not None
    assert created.file.rel == RelTag(16410, 16411, 1259, 0) and created.file.keep_file == Keep.NEW_DATABASE  # H4
    assert await io(pread, vdir / "16411" / "1259", BLCKSZ, 0) == make_page(S - 0x100, fill=2)
    # a directory elsewhere in the tablespace is no database directory
    await io((tblspc / "16410" / "other").mkdir)
    other = fs.nodes[fs.children_of(fs.children_of(fs.children_of(1)[b"pg_tblspc"])[b"16410"])[b"other"]]
    assert isinstance(other, DirNode) and other.db is None
    await io((tblspc / "16410" / "other").rmdir)
    # DROP DATABASE, DROP TABLESPACE
    await io(os.unlink, vdir / "16411" / "1259")
    await io((vdir / "16411").rmdir)
    await io(vdir.rmdir)
    await io((tblspc / "16410").rmdir)
    assert sorted(await io(os.listdir, tblspc)) == ["16400", "16402"]
    # CREATE TABLESPACE ... LOCATION '/dir': a link (PostgreSQL then lstat()s and unlink()s it)
    outside = fs.backing.parent / "elsewhere"
    (outside / "PG_15_202209061").mkdir(parents=True)
    await io(os.symlink, outside, tblspc / "16420")
    assert await io(os.readlink, tblspc / "16420") == str(outside)
    assert await io(os.listdir, tblspc / "16420") == ["PG_15_202209061"]
    assert (await io(os.lstat, tblspc / "16420")).st_mode & 0o170000 == 0o120000
    await io(os.unlink, tblspc / "16420")
    assert sorted(await io(os.listdir, tblspc)) == ["16400", "16402"]


@pytest.mark.parametrize("bad", [
    None, [], {}, {"databases": 3}, {"databases": [{"spcnode": 1663}]},
    {"databases": [{"spcnode": 1663, "dbnode": 5, "relations": [{"relnode": 1, "forks": {"main": -1}}]}]},
    {"databases": [{"spcnode": 1663, "dbnode": 5, "relations": [{"relnode": 1, "forks": {"x": 1}}]}]},
    {"databases": [{"spcnode": "a", "dbnode": 5, "relations": []}]},
])
def test_a_malformed_listing_is_a_clear_error(bad: object) -> None:
    with pytest.raises(ListingError, match="malformed relation listing"):
        Listing.from_json(bad)
