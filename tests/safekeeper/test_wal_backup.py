"""WAL backup (``safekeeper.wal_backup``) over the local kind and over SeaweedFS: closed
segments land in remote storage byte for byte, WAL removal waits for both the backup and the
pageserver's ``remote_consistent_lsn``, an unavailable store is retried while removal waits,
and the election rule. The kill -9 test runs the node as a process."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from protocol.ids import TenantId, TimelineId
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn, format_lsn
from protocol.pgwire.errors import PgError
from remote_storage import (
    LocalStorageConfig,
    RemoteStorage,
    RemoteStorageConfig,
    RemoteStorageError,
    make_remote_storage,
)
from remote_storage.base import Listing
from remote_storage.wal_layout import parse_wal_segment_key, wal_segment_key, wal_timeline_prefix
from safekeeper.node import SafekeeperNode
from safekeeper.peers import peer_horizons
from safekeeper.testing import SafekeeperProcess, TestProposer, running_node, synthetic_wal
from safekeeper.wal_backup import backup_order, backup_rank, should_upload
from safekeeper.wal_storage import WalStorage
from tests.safekeeper.test_node_inprocess import TENANT, TIMELINE, commit_everything

SEG = WAL_SEGMENT_SIZE
START = Lsn(SEG)
PREFIX = wal_timeline_prefix(TENANT, TIMELINE)


@pytest.fixture(params=["local", "seaweedfs"])
def store_config(request: pytest.FixtureRequest, tmp_path: Path) -> RemoteStorageConfig:
    if request.param == "local":
        return LocalStorageConfig(path=tmp_path / "remote")
    cfg: RemoteStorageConfig = request.getfixturevalue("s3_config")
    return cfg


class FlakyStorage:
    """A store that fails every request while ``down`` (the network to it cut)."""

    def __init__(self, inner: RemoteStorage) -> None:
        self.inner = inner
        self.down = False
        self.refused = 0

    def _check(self) -> None:
        if self.down:
            self.refused += 1
            raise RemoteStorageError("connection refused (test: store down)")

    async def upload(self, key: str, data: bytes) -> None:
        self._check()
        await self.inner.upload(key, data)

    async def upload_file(self, key: str, path: Path) -> int:
        self._check()
        return await self.inner.upload_file(key, path)

    async def download(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        self._check()
        return await self.inner.download(key, start, end)

    async def download_file(self, key: str, path: Path) -> int:
        self._check()
        return await self.inner.download_file(key, path)

    async def list(self, prefix: str, delimiter: str | None = None) -> Listing:
        self._check()
        return await self.inner.list(prefix, delimiter)

    async def delete(self, key: str) -> None:
        self._check()
        await self.inner.delete(key)

    async def delete_objects(self, keys: Sequence[str]) -> None:
        self._check()
        await self.inner.delete_objects(keys)

    async def aclose(self) -> None:
        await self.inner.aclose()


def local_segments(sk: SafekeeperNode) -> list[int]:
    return WalStorage(sk.timeline_dir(TENANT, TIMELINE)).segments()


async def remote_segments(storage: RemoteStorage) -> list[int]:
    listing = await storage.list(PREFIX)
    return sorted(parse_wal_segment_key(PREFIX, k) for k in listing.keys)


async def write_wal(port: int, total: int, start: Lsn = START) -> tuple[bytes, Lsn]:
    """``total`` bytes of committed WAL from ``start`` (one proposer, then disconnect)."""
    wal = synthetic_wal(start, total, record_size=8000)
    chunk = 128 * 1024
    async with await TestProposer.connect("127.0.0.1", port, TENANT, TIMELINE) as p:
        await p.greet()
        await p.elect(start)
        end = await p.append_many(start, [wal[i : i + chunk] for i in range(0, len(wal), chunk)])
        # (the proposer's truncate_lsn: every safekeeper has it all; the peers hold nothing)
        p.truncate_lsn = end
        await commit_everything(p, end)
    return wal, end


async def wait_for(what: str, cond: object, timeout: float = 60) -> None:
    assert callable(cond)
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.02)


@pytest.fixture
async def node(tmp_path: Path, store_config: RemoteStorageConfig) -> AsyncIterator[SafekeeperNode]:
    async with running_node(tmp_path / "sk", remote_storage=store_config,
                            wal_removal_period_s=0.05, wal_backup_period_s=0.05) as sk:
        assert sk.remote is not None
        sk.remote = FlakyStorage(sk.remote)
        yield sk


async def test_closed_segments_backed_up_then_trimmed(node: SafekeeperNode) -> None:
    # Segments 1..3; commit_lsn in 3: 1 and 2 are closed.
    wal, end = await write_wal(node.pg_port or 0, 2 * SEG + SEG // 2)
    assert end // SEG == 3
    tl = node.timelines[(TENANT, TIMELINE)]
    await wait_for("backup", lambda: tl.acceptor.backup_lsn == 3 * SEG)
    storage = node.remote
    assert storage is not None
    assert await remote_segments(storage) == [1, 2]
    # Byte for byte PostgreSQL's segment files: what the safekeeper has on disk. Segment 1
    # starts with the page headers the election wrote, then the WAL from START (its start).
    for segno in (1, 2):
        obj = await storage.download(wal_segment_key(TENANT, TIMELINE, segno))
        path = tl.storage.segment_path(segno)
        assert path is not None and obj == path.read_bytes()
        lo, hi = max(segno * SEG, START), (segno + 1) * SEG
        assert obj[lo - segno * SEG :] == wal[lo - START : hi - START]
    # The pageserver has reported nothing: the backup alone removes nothing.
    await trio.sleep(0.3)
    assert local_segments(node) == [1, 2, 3]
    # The pageserver's durable position passes everything: now only the open segment stays.
    tl.acceptor.pageserver_progress(end)
    await wait_for("removal", lambda: local_segments(node) == [3])
    assert tl.removal_horizon() == 3 * SEG
    status = tl.status()
    assert status["backup_lsn"] == format_lsn(3 * SEG)
    backup = status["wal_backup"]
    assert isinstance(backup, dict)
    assert backup["uploaded_segments"] == 2 and backup["rank"] == 0 and backup["failures"] == 0
    # The segment holding commit_lsn is never uploaded (it is not closed).
    await trio.sleep(0.3)
    assert await remote_segments(storage) == [1, 2]
    # backup_lsn survives a restart (the control file).
    assert tl.persisted.backup_lsn == 3 * SEG


async def test_store_down_backup_retries_removal_waits_then_catches_up(node: SafekeeperNode) -> None:
    storage = node.remote
    assert isinstance(storage, FlakyStorage)
    storage.down = True
    _, end = await write_wal(node.pg_port or 0, 2 * SEG + SEG // 2)
    tl = node.timelines[(TENANT, TIMELINE)]
    # The pageserver has everything durable: only the backup holds the WAL now.
    tl.acceptor.pageserver_progress(end)
    await wait_for("retries", lambda: tl.backup.failures >= 4)
    await trio.sleep(0.3)
    assert tl.acceptor.backup_lsn == START
    assert local_segments(node) == [1, 2, 3]
    assert tl.removal_horizon() == START
    assert "store down" in str(tl.backup.last_error)
    storage.down = False
    await wait_for("catch-up", lambda: tl.acceptor.backup_lsn == 3 * SEG)
    assert await remote_segments(storage) == [1, 2]
    await wait_for("removal", lambda: local_segments(node) == [3])
    assert tl.backup.last_error is None
    assert tl.backup.uploaded_segments == 2


async def test_delete_ends_a_live_connection_and_takes_the_backup(node: SafekeeperNode) -> None:
    await write_wal(node.pg_port or 0, SEG)  # segment 1 closed
    tl = node.timelines[(TENANT, TIMELINE)]
    await wait_for("backup", lambda: tl.acceptor.backup_lsn == 2 * SEG)
    storage = node.remote
    assert storage is not None
    assert await remote_segments(storage) == [1]
    # a neighbour in the store: another timeline of the tenant
    other = wal_segment_key(TENANT, TimelineId.parse("ab" * 16), 1)
    await storage.upload(other, b"other")
    tl_dir = node.timeline_dir(TENANT, TIMELINE)
    async with await TestProposer.connect("127.0.0.1", node.pg_port or 0, TENANT, TIMELINE) as p:
        await p.greet()  # a live push connection on the timeline
        got = await node.delete_timeline(TENANT, TIMELINE)
        assert got == {"timelines": 1, "dir_existed": True, "remote_objects_deleted": 1}
        with trio.fail_after(10), pytest.raises(PgError) as ended:
            await p.vote(99)
        assert ended.value.sqlstate == "57P01" and "was deleted" in str(ended.value)
    assert (TENANT, TIMELINE) not in node.timelines
    assert not tl_dir.exists()
    assert await remote_segments(storage) == []
    assert (await storage.list(wal_timeline_prefix(TENANT, TimelineId.parse("ab" * 16)))).keys == [other]
    # again: nothing left (the HTTP route answers 404 for this)
    assert await node.delete_timeline(TENANT, TIMELINE) == {
        "timelines": 0, "dir_existed": False, "remote_objects_deleted": 0}
    # the tenant: the rest of wal/<tenant>/ goes too
    got = await node.delete_tenant(TENANT)
    assert got["remote_objects_deleted"] == 1
    assert (await storage.list(f"wal/{TENANT.hex}/")).keys == []
    # a new proposer may create the timeline afresh
    await write_wal(node.pg_port or 0, SEG // 4)
    assert (TENANT, TIMELINE) in node.timelines


async def test_the_elected_one_uploads_and_its_peer_adopts(
    tmp_path: Path, store_config: RemoteStorageConfig
) -> None:
    # Two safekeepers, one store; the timeline starts mid-segment (as after initdb), so the
    # first backed-up segment begins with the election's page headers.
    start = Lsn(SEG + 0x500780)
    store = store_config
    async with running_node(tmp_path / "sk1", id=1, remote_storage=store, wal_backup_peers=[1, 2],
                            wal_backup_period_s=0.05, wal_removal_period_s=0.05) as sk1, \
            running_node(tmp_path / "sk2", id=2, remote_storage=store, wal_backup_peers=[1, 2],
                         wal_backup_period_s=0.05, wal_removal_period_s=0.05) as sk2:
        for sk in (sk1, sk2):
            _, end = await write_wal(sk.pg_port or 0, SEG + SEG // 4, start=start)
        assert end // SEG == 2
        tls = [sk.timelines[(TENANT, TIMELINE)] for sk in (sk1, sk2)]
        # (the counters move right after backup_lsn, once the control file is saved)
        await wait_for("both", lambda: all(
            t.acceptor.backup_lsn == 2 * SEG
            and t.backup.uploaded_segments + t.backup.adopted_segments == 1 for t in tls))
        by_rank = sorted(tls, key=lambda t: t.backup.rank)
        assert [t.backup.rank for t in by_rank] == [0, 1]
        assert by_rank[0].backup.uploaded_segments == 1 and by_rank[0].backup.adopted_segments == 0
        assert by_rank[1].backup.uploaded_segments == 0 and by_rank[1].backup.adopted_segments == 1
        assert sk1.remote is not None
        assert await remote_segments(sk1.remote) == [1]
        # Both trim once the pageserver's position passes the segment, the peer too.
        for t in tls:
            t.acceptor.pageserver_progress(end)
        await wait_for("removal", lambda: local_segments(sk1) == local_segments(sk2) == [2])


@given(
    peers=st.sets(st.integers(min_value=1, max_value=50), min_size=1, max_size=7),
    raw=st.binary(min_size=16, max_size=16),
)
def test_every_safekeeper_computes_the_same_election(peers: set[int], raw: bytes) -> None:
    tl = TimelineId(raw)
    ids = tuple(sorted(peers))
    orders = {tuple(backup_order(ids, me, tl)) for me in ids}
    assert len(orders) == 1
    (order,) = orders
    assert sorted(order) == list(ids)
    assert sorted(backup_rank(ids, me, tl) for me in ids) == list(range(len(ids)))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=20), inner, max_size=4),
    max_leaves=20,
)


@given(doc=json_values | st.lists(st.fixed_dictionaries({
    "tenant_id": st.sampled_from([TENANT.hex, "zz", 5]),
    "timeline_id": st.sampled_from([TIMELINE.hex, "", None]),
    "remote_consistent_lsn": st.sampled_from(["0/1500780", "nope", "1/", 7]),
}), max_size=3))
def test_a_peer_answer_of_any_shape_is_parsed_or_skipped(doc: object) -> None:
    out = peer_horizons(doc)
    for (tenant, timeline), lsn in out.items():
        assert (tenant, timeline) == (TENANT, TIMELINE) and lsn == 0x1500780


def test_takeover_rule() -> None:
    take = 4 * SEG
    # The elected one uploads any closed segment; the others only when the store lags.
    assert should_upload(0, Lsn(5 * SEG), Lsn(4 * SEG), take)
    assert not should_upload(0, Lsn(4 * SEG), Lsn(4 * SEG), take)
    assert not should_upload(1, Lsn(7 * SEG), Lsn(4 * SEG), take)
    assert should_upload(1, Lsn(8 * SEG), Lsn(4 * SEG), take)
    assert not should_upload(2, Lsn(11 * SEG), Lsn(4 * SEG), take)
    assert should_upload(2, Lsn(12 * SEG), Lsn(4 * SEG), take)


def test_segment_keys_parse_back_and_refuse_foreign_names() -> None:
    for segno in (0, 1, 255, 256, 1 << 20):
        assert parse_wal_segment_key(PREFIX, wal_segment_key(TENANT, TIMELINE, segno)) == segno
    other = wal_timeline_prefix(TenantId(bytes(16)), TIMELINE)
    for bad in (PREFIX + "000000010000000000000001.partial", PREFIX + "junk",
                PREFIX + "000000020000000000000001", PREFIX + "00000001000000000000000g",
                other + "000000010000000000000001", PREFIX + "000000010000000000000001.___temp"):
        with pytest.raises(ValueError):
            parse_wal_segment_key(PREFIX, bad)


def kill_during_backup(proc: SafekeeperProcess, wal_dir: Path, closed: int, rounds: int) -> tuple[int, int]:
    """Kill -9 the node while its backup runs (a segment half written to the store, its temp
    file there, or one just finished), and start it again, ``rounds`` times at most; returns
    (kills, kills that hit a half-written segment)."""
    kills = mid = 0
    while kills < rounds:
        deadline = time.monotonic() + 30
        seen = -1
        hit = None
        while hit is None and time.monotonic() < deadline:
            names = [p.name for p in wal_dir.iterdir()] if wal_dir.exists() else []
            done = sum(not n.endswith(".___temp") for n in names)
            if done >= closed - 1:
                return kills, mid
            if any(n.endswith(".___temp") for n in names):
                hit = True
            elif seen >= 0 and done > seen:
                hit = False
            seen = done
            time.sleep(0.0005)
        assert hit is not None, "the backup made no progress for 30 s"
        proc.kill()
        kills += 1
        mid += hit
        proc.start()
    return kills, mid


async def test_kill_9_during_backup_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    remote_dir = tmp_path / "remote"
    # First without remote storage (in this process): the WAL is written and committed, and
    # a clean stop saves commit_lsn, so that the backup of the node started next (as a process,
    # on the same data directory) has every segment to do.
    async with running_node(tmp_path / "sk" / "data") as plain:
        wal, end = await write_wal(plain.pg_port or 0, 4 * SEG + SEG // 4)
    closed = end // SEG  # segments 1 .. closed-1 are closed
    proc = SafekeeperProcess(tmp_path / "sk", no_sync=True, wal_removal_period_s=0.05,
                             wal_backup_period_s=0.02,
                             remote_storage={"kind": "local", "path": str(remote_dir)})
    proc.start()
    try:
        wal_dir = remote_dir / PREFIX
        kills, mid = kill_during_backup(proc, wal_dir, closed, rounds=2)
        assert kills >= 1, "the backup finished before a kill landed in the middle of it"
        storage = make_remote_storage(LocalStorageConfig(path=remote_dir))
        with trio.fail_after(60):
            while proc.timeline_status(TENANT, TIMELINE)["backup_lsn"] != format_lsn(closed * SEG):
                await trio.sleep(0.05)
        # Every closed segment once, under its own name, nothing else in the timeline's tree
        # (no temp file of an interrupted upload left: its segment was uploaded again).
        assert await remote_segments(storage) == list(range(1, closed))
        names = sorted(p.name for p in wal_dir.iterdir())
        assert names == [wal_segment_key(TENANT, TIMELINE, s).rsplit("/", 1)[1] for s in range(1, closed)]
        for segno in range(1, closed):
            obj = await storage.download(wal_segment_key(TENANT, TIMELINE, segno))
            assert len(obj) == SEG
            lo, hi = max(segno * SEG, START), (segno + 1) * SEG
            assert obj[lo - segno * SEG :] == wal[lo - START : hi - START], segno
        metrics = proc.http_get("/metrics")
        assert "safekeeper_backup_lsn{" in metrics
        print(f"kills: {kills}, of them mid-upload: {mid}")
    finally:
        proc.kill()
