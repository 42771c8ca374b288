"""The FUSE operations of the page filesystem (pyfuse3 on trio): one tree with ``base/``,
``global/`` and ``pg_tblspc/`` at its root, which the endpoint's data directory links to.

- Relation segment files in a database directory (``global/``, ``base/<db>/``,
  ``pg_tblspc/<spc>/PG_15_202209061/<db>/``) are served by
  the page store (``compute.pagefs.store``): sizes from the relation listing at S, reads as
  GetPage batches (``compute.pagefs.remote``), writes into the local page file.
- Every other file (``PG_VERSION``, ``pg_filenode.map``, ``pg_internal.init``, ``pg_control``,
  temp relations, ``pgsql_tmp``) is an ordinary file in the backing directory, at the same
  relative path. Directories exist in both.
- ``fsync``/``fsyncdir`` answer ENOSYS: the kernel stops sending them, and the WAL on the
  safekeepers is the durable copy (``compute.pagefs``).
- Tablespaces are in place (``allow_in_place_tablespaces``: a directory ``pg_tblspc/<spc>``, as
  the basebackup makes every tablespace): ``CREATE TABLESPACE ... LOCATION ''`` is a mkdir
  here, and its databases are database directories like those of ``base/``. A tablespace
  created with a location is a symbolic link here (``symlink``/``readlink``) to a directory
  outside the mount: its files are ordinary local files for the endpoint's life; the next
  start serves them from the page service, in place.
- Lookups of names that do not exist are cached by the kernel (``st_ino = 0``): only this mount
  changes the tree. Files are opened with ``keep_cache``: a page read once is served by the
  kernel's page cache until it is written or truncated through this mount.

Files and directories belong to the postgres user, 0600 and 0700, as PostgreSQL creates them.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Final

import attrs
import pyfuse3
import structlog

from compute.pagefs.names import (
    DEFAULT_SPC,
    FORK_BY_NAME,
    GLOBAL_SPC,
    TABLESPACE_VERSION_DIRECTORY,
    RelFileName,
    parse_rel_file,
    segments,
)
from compute.pagefs.page_header import BLCKSZ
from compute.pagefs.remote import PageFetcher, PageFetchError
from compute.pagefs.store import Keep, PageStore, ReadRetry, RelFile
from protocol.pagestream import RelTag

log = structlog.get_logger("compute.pagefs.fs")

TIMEOUT_S: Final = 3600.0  # entry and attribute cache: nothing but this mount changes the tree
ROOT: Final = pyfuse3.ROOT_INODE


@attrs.define(eq=False)
class Node:
    ino: int
    parent: int
    name: bytes
    backing: Path
    mtime_ns: int


@attrs.define(eq=False)
class DirNode(Node):
    children: dict[bytes, int] = attrs.Factory(dict)
    db: tuple[int, int] | None = None  # (spcnode, dbnode) of a database directory
    created_here: bool = False


@attrs.define(eq=False)
class RelNode(Node):
    file: RelFile | None = None


@attrs.define(eq=False)
class PlainNode(Node):
    pass


@attrs.define(eq=False)
class LinkNode(Node):
    """A symbolic link (``CREATE TABLESPACE ... LOCATION '/dir'``): only its target, in memory."""

    target: bytes = b""


@attrs.frozen
class Listing:
    """The relation listing at S (``GET .../relations``): databases and fork sizes."""

    databases: list[tuple[int, int, dict[int, dict[str, int]]]]  # (spc, db, relnode -> forks)

    @classmethod
    def from_json(cls, data: object) -> Listing:
        """The pageserver's answer, checked: ``ListingError`` names what is wrong."""
        try:
            if not isinstance(data, dict) or not isinstance(data.get("databases"), list):
                raise TypeError("no list of databases")
            dbs = data["databases"]
            out = []
            for d in dbs:
                rels: dict[int, dict[str, int]] = {}
                for r in d["relations"]:
                    forks = {str(k): int(v) for k, v in r["forks"].items()}
                    if not set(forks) <= set(FORK_BY_NAME) or any(n < 0 or n > 0xFFFF_FFFF for n in forks.values()):
                        raise ValueError(f"bad forks {forks!r}")
                    rels[int(r["relnode"])] = forks
                out.append((int(d["spcnode"]), int(d["dbnode"]), rels))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ListingError(f"malformed relation listing: {exc!r}") from None
        return cls(out)


class ListingError(ValueError):
    """The relation listing from the pageserver is not what ``GET .../relations`` answers."""


class PageFs(pyfuse3.Operations):
    def __init__(self, store: PageStore, fetcher: PageFetcher, backing: Path, *, uid: int, gid: int) -> None:
        super().__init__()
        self.store = store
        self.fetcher = fetcher
        self.backing = backing
        self.uid, self.gid = uid, gid
        self.nodes: dict[int, Node] = {}
        self._next_ino = ROOT + 1
        self._fds: dict[int, tuple[Node, int]] = {}  # fh -> (node, os fd or -1)
        self._next_fh = 1
        now = time.time_ns()
        self.nodes[ROOT] = DirNode(ROOT, ROOT, b"", backing, now)
        self.read_errors = 0
        # The buffer every relation read is assembled into. One is enough: pyfuse3 hands the
        # buffer a read handler returns to the kernel (fuse_reply_buf) before any other task
        # runs, and assembling has no await, so no two reads ever fill it at once.
        self._read_buf = bytearray(128 * BLCKSZ)

    # -- building the tree --------------------------------------------------------------------

    def _add(self, node: Node) -> Node:
        self.nodes[node.ino] = node
        parent = self.nodes[node.parent]
        assert isinstance(parent, DirNode)
        parent.children[node.name] = node.ino
        return node

    def _ino(self) -> int:
        ino = self._next_ino
        self._next_ino += 1
        return ino

    def _dir(self, parent: DirNode, name: str, *, db: tuple[int, int] | None = None,
             created_here: bool = False) -> DirNode:
        existing = parent.children.get(name.encode())
        if existing is not None:
            node = self.nodes[existing]
            assert isinstance(node, DirNode)
            return node
        path = parent.backing / name
        path.mkdir(mode=0o700, exist_ok=True)
        d = DirNode(self._ino(), parent.ino, name.encode(), path, time.time_ns(), db=db, created_here=created_here)
        self._add(d)
        return d

    def _db_of(self, parent: DirNode, name: str) -> tuple[int, int] | None:
        """(spc, db) if a directory ``name`` under ``parent`` is a database directory:
        ``global``, ``base/<db>`` or ``pg_tblspc/<spc>/PG_15_202209061/<db>``."""
        if parent.ino == ROOT and name == "global":
            return (GLOBAL_SPC, 0)
        if not name.isdigit():
            return None
        if parent.parent == ROOT and parent.name == b"base":
            return (DEFAULT_SPC, int(name))
        if parent.name == TABLESPACE_VERSION_DIRECTORY.encode() and parent.parent != ROOT:
            spc = self.nodes[parent.parent]
            if spc.name.isdigit() and spc.parent != ROOT:
                tblspc = self.nodes[spc.parent]
                if tblspc.parent == ROOT and tblspc.name == b"pg_tblspc":
                    return (int(spc.name), int(name))
        return None

    def _rel_node(self, parent: DirNode, rf: RelFileName, nblocks_remote: int) -> RelNode:
        assert parent.db is not None
        rel = RelTag(parent.db[0], parent.db[1], rf.relnode, rf.fork)
        keep = Keep.NEW_DATABASE if parent.created_here else Keep.NO
        f = self.store.new_file(rel, rf.segno, nblocks_remote, keep=keep)
        node = RelNode(self._ino(), parent.ino, rf.name().encode(), parent.backing / rf.name(), time.time_ns(), f)
        self._add(node)
        return node

    def load(self, listing: Listing) -> None:
        """The tree at S: the backing directory (what the lazy basebackup unpacked there) and
        the relation listing. Relation files found in the backing directory (unlogged
        relations' init and main forks) move into the page store, where they stay local."""
        root = self.nodes[ROOT]
        assert isinstance(root, DirNode)
        self._load_dir(root)
        base = self._dir(root, "base")
        for spc, db, rels in listing.databases:
            if spc == GLOBAL_SPC:
                d = self._dir(root, "global", db=(spc, db))
            elif spc == DEFAULT_SPC:
                d = self._dir(base, str(db), db=(spc, db))
            else:  # a tablespace, in place
                version = self._dir(self._dir(self._dir(root, "pg_tblspc"), str(spc)), TABLESPACE_VERSION_DIRECTORY)
                if db == 0:
                    continue  # the tablespace itself (CREATE TABLESPACE), no database in it yet
                d = self._dir(version, str(db), db=(spc, db))
            for relnode, forks in rels.items():
                for fork_name, nblocks in forks.items():
                    fork = FORK_BY_NAME[fork_name]
                    for segno, n in enumerate(segments(nblocks)):
                        rf = RelFileName(relnode, fork, segno)
                        if rf.name().encode() not in d.children:
                            self._rel_node(d, rf, n)

    def _load_dir(self, d: DirNode) -> None:
        for entry in sorted(os.scandir(d.backing), key=lambda e: e.name):
            name = entry.name
            if entry.is_symlink():
                self._add(LinkNode(self._ino(), d.ino, name.encode(), d.backing / name, time.time_ns(),
                                   os.fsencode(os.readlink(entry.path))))
                os.unlink(entry.path)  # the link lives in the tree only, like the relation files
                continue
            if entry.is_dir(follow_symlinks=False):
                sub = self._dir(d, name, db=self._db_of(d, name))
                self._load_dir(sub)
                continue
            rf = parse_rel_file(name) if d.db is not None else None
            if rf is None:
                self._add(PlainNode(self._ino(), d.ino, name.encode(), d.backing / name, time.time_ns()))
                continue
            node = self._rel_node(d, rf, 0)
            assert node.file is not None
            data = Path(entry.path).read_bytes()
            for blk in range(len(data) // BLCKSZ):
                self.store.write_block(node.file, blk, data[blk * BLCKSZ : (blk + 1) * BLCKSZ])
            os.unlink(entry.path)

    # -- attributes ---------------------------------------------------------------------------

    def _attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.ino
        a.entry_timeout = a.attr_timeout = TIMEOUT_S
        a.st_uid, a.st_gid = self.uid, self.gid
        a.st_blksize = BLCKSZ
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = node.mtime_ns
        if isinstance(node, DirNode):
            a.st_mode = stat.S_IFDIR | 0o700
            a.st_nlink = 2
            a.st_size = 4096
        elif isinstance(node, LinkNode):
            a.st_mode = stat.S_IFLNK | 0o777
            a.st_nlink = 1
            a.st_size = len(node.target)
        elif isinstance(node, RelNode):
            assert node.file is not None
            a.st_mode = stat.S_IFREG | 0o600
            a.st_nlink = 1
            a.st_size = node.file.size
            a.st_blocks = node.file.size // 512
        else:
            st = os.lstat(node.backing)
            a.st_mode = stat.S_IFREG | 0o600
            a.st_nlink = 1
            a.st_size = st.st_size
            a.st_blocks = st.st_blocks
            a.st_mtime_ns = st.st_mtime_ns
        return a

    def _node(self, ino: int) -> Node:
        try:
            return self.nodes[ino]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    def relation_inodes(self) -> list[int]:
        return [ino for ino, n in self.nodes.items() if isinstance(n, RelNode)]

    def children_of(self, ino: int) -> dict[bytes, int]:
        return self._dirnode(ino).children

    def _dirnode(self, ino: int) -> DirNode:
        node = self._node(ino)
        if not isinstance(node, DirNode):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return node

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        parent = self._dirnode(parent_inode)
        ino = parent.children.get(name)
        if ino is None:
            a = pyfuse3.EntryAttributes()
            a.st_ino = 0  # a negative entry the kernel keeps
            a.entry_timeout = TIMEOUT_S
            return a
        return self._attrs(self.nodes[ino])

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attrs(self._node(inode))

    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = self._node(inode)
        if fields.update_size:
            if isinstance(node, RelNode):
                assert node.file is not None
                self.store.truncate(node.file, attr.st_size)
            elif isinstance(node, PlainNode):
                os.truncate(node.backing, attr.st_size)
            else:
                raise pyfuse3.FUSEError(errno.EISDIR)
        # mode, owner and times are fixed (postgres, 0600/0700): PostgreSQL never changes them
        return self._attrs(node)

    async def forget(self, inode_list: Iterable[tuple[int, int]]) -> None:
        return None  # inodes live as long as the tree names them (unlink drops the data)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = BLCKSZ
        s.f_blocks = s.f_bfree = s.f_bavail = 1 << 40
        s.f_files = s.f_ffree = s.f_favail = 1 << 32
        s.f_namemax = 255
        return s

    # -- directories --------------------------------------------------------------------------

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        parent = self._dirnode(parent_inode)
        if name in parent.children:
            raise pyfuse3.FUSEError(errno.EEXIST)
        text = os.fsdecode(name)
        db = self._db_of(parent, text)
        d = self._dir(parent, text, db=db, created_here=db is not None)
        return self._attrs(d)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        parent = self._dirnode(parent_inode)
        ino = parent.children.get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        d = self.nodes[ino]
        if not isinstance(d, DirNode):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if d.children:
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        os.rmdir(d.backing)
        del parent.children[name]
        del self.nodes[ino]

    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        parent = self._dirnode(parent_inode)
        if name in parent.children:
            raise pyfuse3.FUSEError(errno.EEXIST)
        node = self._add(LinkNode(self._ino(), parent.ino, name, parent.backing / os.fsdecode(name),
                                  time.time_ns(), target))
        return self._attrs(node)

    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        node = self._node(inode)
        if not isinstance(node, LinkNode):
            raise pyfuse3.FUSEError(errno.EINVAL)
        return node.target

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        self._dirnode(inode)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        d = self._dirnode(fh)
        names = sorted(d.children)
        for i in range(start_id, len(names)):
            node = self.nodes[d.children[names[i]]]
            if not pyfuse3.readdir_reply(token, names[i], self._attrs(node), i + 1):
                break

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        raise pyfuse3.FUSEError(errno.ENOSYS)

    # -- files --------------------------------------------------------------------------------

    def _fh(self, node: Node, fd: int) -> pyfuse3.FileInfo:
        fh = self._next_fh
        self._next_fh += 1
        self._fds[fh] = (node, fd)
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        parent = self._dirnode(parent_inode)
        if name in parent.children:
            raise pyfuse3.FUSEError(errno.EEXIST)
        text = os.fsdecode(name)
        rf = parse_rel_file(text) if parent.db is not None else None
        if rf is not None:
            node: Node = self._rel_node(parent, rf, 0)
            fd = -1
        else:
            path = parent.backing / text
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            node = self._add(PlainNode(self._ino(), parent.ino, name, path, time.time_ns()))
        return self._fh(node, fd), self._attrs(node)

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        node = self._node(inode)
        if isinstance(node, DirNode):
            raise pyfuse3.FUSEError(errno.EISDIR)
        if isinstance(node, LinkNode):
            raise pyfuse3.FUSEError(errno.ELOOP)  # the kernel follows links itself
        fd = os.open(node.backing, os.O_RDWR) if isinstance(node, PlainNode) else -1
        return self._fh(node, fd)

    async def release(self, fh: int) -> None:
        _, fd = self._fds.pop(fh, (None, -1))
        if fd >= 0:
            os.close(fd)

    async def flush(self, fh: int) -> None:
        return None

    async def fsync(self, fh: int, datasync: bool) -> None:
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        parent = self._dirnode(parent_inode)
        ino = parent.children.get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        node = self.nodes[ino]
        if isinstance(node, DirNode):
            raise pyfuse3.FUSEError(errno.EISDIR)
        if isinstance(node, RelNode):
            assert node.file is not None
            self.store.unlink(node.file)
        elif isinstance(node, PlainNode):
            os.unlink(node.backing)
        del parent.children[name]
        del self.nodes[ino]

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
                     flags: int, ctx: pyfuse3.RequestContext) -> None:
        old_parent, new_parent = self._dirnode(parent_inode_old), self._dirnode(parent_inode_new)
        ino = old_parent.children.get(name_old)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        node = self.nodes[ino]
        target = new_parent.children.get(name_new)
        target_node = self.nodes[target] if target is not None else None
        # PostgreSQL renames only ordinary files here (pg_internal.init); relation files stay put
        if not isinstance(node, PlainNode) or (target_node is not None and not isinstance(target_node, PlainNode)):
            raise pyfuse3.FUSEError(errno.EXDEV)
        if new_parent.db is not None and parse_rel_file(os.fsdecode(name_new)) is not None:
            raise pyfuse3.FUSEError(errno.EXDEV)
        new_path = new_parent.backing / os.fsdecode(name_new)
        os.rename(node.backing, new_path)
        if target is not None:
            del self.nodes[target]
        del old_parent.children[name_old]
        node.parent, node.name, node.backing = new_parent.ino, name_new, new_path
        new_parent.children[name_new] = ino

    # pyfuse3's stub says bytes; its fuse_read takes any contiguous buffer (PyObject_GetBuffer)
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:  # type: ignore[override]
        node, fd = self._fds[fh]
        if fd >= 0:
            return os.pread(fd, size, off)
        assert isinstance(node, RelNode) and node.file is not None
        return await self._read_rel(node.file, off, size)

    async def _read_rel(self, f: RelFile, off: int, size: int) -> bytes | memoryview:
        """The bytes of a relation read: a view of the shared read buffer (valid until the next
        read; ``write`` copies what it needs)."""
        while True:
            plan = self.store.plan_read(f, off, size)
            try:
                pages = await self.fetcher.fetch(f.rel, plan.remote)
            except PageFetchError as exc:
                self.read_errors += 1
                log.error("read failed", file=str(f.rel), segno=f.segno, offset=off, error=str(exc))
                raise pyfuse3.FUSEError(errno.EIO) from None
            need = len(plan.sources) * BLCKSZ
            if len(self._read_buf) < need:
                self._read_buf = bytearray(need)
            try:
                return self.store.assemble_into(plan, pages, self._read_buf)
            except ReadRetry:
                continue

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        node, fd = self._fds[fh]
        if fd >= 0:
            return os.pwrite(fd, buf, off)
        assert isinstance(node, RelNode) and node.file is not None
        f = node.file
        view = memoryview(buf)
        end = off + len(buf)
        blk = off // BLCKSZ
        pos = off
        while pos < end:
            start = blk * BLCKSZ
            if pos == start and end - pos >= BLCKSZ:
                self.store.write_block(f, blk, view[pos - off : pos - off + BLCKSZ])
                pos += BLCKSZ
            else:
                # a partial block (PostgreSQL writes whole blocks; other writers may not)
                cur = bytearray(await self._read_rel(f, start, BLCKSZ)) if start < f.size else bytearray()
                cur.extend(bytes(BLCKSZ - len(cur)))
                n = min(end, start + BLCKSZ) - pos
                cur[pos - start : pos - start + n] = view[pos - off : pos - off + n]
                self.store.write_block(f, blk, bytes(cur))
                pos += n
            blk += 1
        return len(buf)
