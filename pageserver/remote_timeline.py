"""A timeline's upload queue: its layers and ``index_part.json`` into remote storage, in an
order that never lets the remote index name an object that is not there.

Every local index_part write (flush, compaction, image layers, GC, creation) hands the new
index to ``schedule_index_upload``, which compares it with the last scheduled one and queues:

1. ``UploadLayer`` for each layer the new index names and no earlier one did (the local file
   is pinned in the tenant's graveyard until it is uploaded: a compaction that replaces it
   meanwhile cannot delete it from under the upload);
2. ``UploadIndex`` with the new index (layer generations filled in);
3. ``Delete`` of the objects of layers the new index no longer names.

One worker task (``run``) executes the queue in order, with these liberties only: consecutive
layer uploads run in parallel (``parallel_uploads``), and index uploads are coalesced (each
index is complete, so only the newest of a run needs to go up). With ``coalesce_indexes`` (the
default), when an index reaches the head of the queue, the layers of the later indexes queued
behind it (up to a Delete or a Barrier) are uploaded first and only the newest of those indexes
is sent; and an index waits until ``index_upload_interval_s`` has passed since the last index
PUT, coalescing what is queued meanwhile, unless what stands behind it cannot be coalesced (a
Delete, a Barrier (``wait_uploaded``), a layer no index follows yet, a layer already uploaded
or queued twice, more than ``parallel_uploads * 4`` layers): then it goes at once. A node flushing L0s faster than that sends one index per interval instead of
one per flush; ``remote_consistent_lsn`` lags by at most the interval plus the uploads. The
layers moved ahead of an index are ones it does not name (they are new in later indexes), so
the invariant is the same: at most one index PUT is in flight, every index goes up after the
layers it names (never an index naming an object whose PUT has not completed), and a Delete
runs only after an index without those layers is uploaded; it then asks ``validate`` (is my generation still current?)
and drops the deletion if not: a newer attachment may be using them (the objects leak, which is
safe). Deletions are executed by this worker, in queue order, so a deletion never overtakes a
later upload of the same key. The upload queue itself is not persisted: after a crash the
remote index is the authority (``pageserver.remote_tenant``). The deletions are: with a
``DeletionQueue`` (``pageserver.deletion_queue``) each Delete is written to local disk before
the index that enables it is uploaded and forgotten only after its DELETE succeeded, so a crash
between an index and its deletions does not leak the unlinked objects.

``remote_consistent_lsn`` is the ``disk_consistent_lsn`` of the last uploaded index, once
``validate`` confirmed the generation: the WAL receiver reports it to the safekeepers, which
remove WAL only below it. Uploads and deletions retry forever with capped backoff
(``remote_storage.retry``): while the store is down, ingest and flushes go on, the queue grows,
and ``remote_consistent_lsn`` stays where it was.

Layer files are stored compressed (``compression = "zstd"``, the default of the
``remote_storage`` table) or as they are: each upload compresses its file into a temp file
beside it in a worker thread (``pageserver.remote_compression``), PUTs that, and the index
records how each object is stored. An L0 written by the L0 writer process comes with its
object already compressed there (``stage_spec``: the process compresses the file it has just
written, off this process and its GIL); the upload checks that staged object and sends it as
it is, or compresses the layer itself if it is missing or does not pass. Downloads read that from the index they come from, so
objects of any age (and of either setting) read back alike.

Until ``activate`` (a timeline still being bootstrapped or imported) nothing is queued: only
the newest index is kept and queued whole on activation, so the remote never sees a half-made
timeline.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import structlog
import trio
from prometheus_client import Counter, Gauge, Histogram

from common.fsync import fsync_dir, fsync_file
from pageserver import remote_compression, remote_layout
from pageserver.deletion_queue import DeletionList, DeletionQueue
from pageserver.storage.index_part import IndexPart, StoredLayer
from protocol.ids import TenantId, TimelineId
from protocol.lsn import INVALID_LSN
from remote_storage import RemoteNotFoundError, RemoteStorage
from remote_storage.config import Compression
from remote_storage.retry import retry

log = structlog.get_logger("pageserver.remote_timeline")

UPLOADED_BYTES = Counter("pageserver_remote_upload_bytes", "bytes of layer files uploaded (before compression)")
UPLOADED_STORED_BYTES = Counter(
    "pageserver_remote_upload_stored_bytes", "bytes of layer objects uploaded (after compression: what the store keeps)"
)
DOWNLOADED_BYTES = Counter("pageserver_remote_download_bytes", "bytes of layer files downloaded (after decompression)")
DOWNLOADED_STORED_BYTES = Counter(
    "pageserver_remote_download_stored_bytes", "bytes of layer objects downloaded (before decompression)"
)
CODEC_SECONDS = Counter(
    "pageserver_remote_codec_cpu_seconds", "CPU seconds spent compressing and decompressing layer files", ["op"]
)
UPLOADED_LAYERS = Counter("pageserver_remote_uploaded_layers", "layer files uploaded")
UPLOADED_INDEXES = Counter("pageserver_remote_uploaded_indexes", "index_part.json objects uploaded")
DELETED_OBJECTS = Counter("pageserver_remote_deleted_objects", "layer objects deleted from remote storage")
DROPPED_DELETIONS = Counter(
    "pageserver_remote_dropped_deletions",
    "layer objects not deleted because the generation was no longer current (leaked, safe)",
)
STAGED_LAYERS = Counter(
    "pageserver_remote_staged_layers", "layer objects sent as the L0 writer process compressed them"
)
REJECTED_STAGED = Counter(
    "pageserver_remote_rejected_staged_layers",
    "staged layer objects that failed their checks (torn, another codec, an older layer): compressed again",
)
SKIPPED_COMPRESSIONS = Counter(
    "pageserver_remote_skipped_compressions", "layer files stored as they are: a sample did not compress"
)
COALESCED_INDEXES = Counter(
    "pageserver_remote_coalesced_indexes", "index uploads not sent: a newer index (naming their layers too) was"
)
UPLOAD_INDEX_SECONDS = Histogram("pageserver_remote_index_upload_seconds", "index_part.json uploads, retries included")
QUEUED_OPS = Gauge("pageserver_remote_queued_operations", "operations waiting in upload queues")

Validator = Callable[[], Awaitable[bool]]

DOWNLOAD_ATTEMPTS = 5  # a reader waits for these (about 0.7 s of backoff in all)
_TEMP_DOWNLOAD = ".___temp_download"
_TEMP_STORED = ".___temp_stored"  # a compressed object on its way up or down


async def always_valid() -> bool:
    """The validator of a node that issues its own generations (no control plane)."""
    return True


@attrs.frozen
class UploadLayer:
    name: str
    path: Path
    size: int


@attrs.frozen
class UploadIndex:
    part: IndexPart


@attrs.define(eq=False)
class Delete:
    keys: tuple[str, ...]
    # Its list in the node's deletion queue, written before the index that drops the keys
    # goes up (None: no queue, or not yet written).
    persisted: DeletionList | None = None


@attrs.frozen(eq=False)
class Barrier:
    done: trio.Event


Op = UploadLayer | UploadIndex | Delete | Barrier


def _unlink_all(paths: tuple[Path, ...]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _publish(tmp: Path, path: Path) -> None:
    """A complete download into place: fsync the file, rename it, fsync the directory. Without
    the first fsync a crash could leave the new name with the right size but bytes never
    written (it would fail its CRC when opened, instead of being downloaded again)."""
    fsync_file(tmp)
    os.rename(tmp, path)
    fsync_dir(path.parent)


async def download_layer(
    storage: RemoteStorage, key: str, path: Path, size: int, *, stored: StoredLayer | None = None,
    attempts: int = DOWNLOAD_ATTEMPTS,
) -> None:
    """``key`` into ``path`` (temp file, size check against the index, fsync, rename, dir fsync).
    ``stored``: how the object is stored, as its index says (None: as it is, ``size`` bytes);
    a compressed object is downloaded to a temp file, size-checked, then decompressed with the
    checks of ``pageserver.remote_compression`` (a corrupt one: ``LayerCorruptionError``, not
    retried)."""
    tmp = path.with_name(path.name + _TEMP_DOWNLOAD)
    stored_tmp = path.with_name(path.name + _TEMP_STORED)
    compressed = stored is not None and stored.compression != "none"
    want = stored.size if stored is not None else size

    async def get() -> None:
        got = await storage.download_file(key, stored_tmp if compressed else tmp)
        if got != want:
            # A short or long transfer (or object): retried, then the read fails.
            raise OSError(f"{key}: downloaded {got} bytes, the index says {want}")

    def decompress() -> None:
        assert stored is not None  # (only for a compressed object)
        started = time.thread_time()
        try:
            remote_compression.decompress_file(
                stored_tmp, tmp, size, key, remote_compression.codec_of(stored.compression))
        finally:
            stored_tmp.unlink(missing_ok=True)
            CODEC_SECONDS.labels("decompress").inc(time.thread_time() - started)

    try:
        await retry(get, what=f"download {key}", attempts=attempts)
        if compressed:
            await trio.to_thread.run_sync(decompress)
        # inside the try: a failed fsync or rename leaves no temp file behind either
        await trio.to_thread.run_sync(_publish, tmp, path)
    except BaseException:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(_unlink_all, (tmp, stored_tmp))
        raise
    DOWNLOADED_STORED_BYTES.inc(want)
    DOWNLOADED_BYTES.inc(size)


class Pins:
    """Local layer files that must stay until uploaded (shared with the tenant's graveyard)."""

    def __init__(self) -> None:
        self._count: collections.Counter[Path] = collections.Counter()

    def pin(self, path: Path) -> None:
        self._count[path] += 1

    def unpin(self, path: Path) -> None:
        self._count[path] -= 1
        if self._count[path] <= 0:
            del self._count[path]

    def __contains__(self, path: object) -> bool:
        return path in self._count


class RemoteTimelineClient:
    DEFAULT_PARALLEL_UPLOADS = 8
    def __init__(
        self,
        storage: RemoteStorage,
        tenant_id: TenantId,
        timeline_id: TimelineId,
        generation: int,
        local_dir: Path,
        *,
        remote_index: IndexPart | None = None,
        validate: Validator = always_valid,
        pins: Pins | None = None,
        on_unpinned: Callable[[], Awaitable[None]] | None = None,
        parallel_uploads: int = DEFAULT_PARALLEL_UPLOADS,
        deletions: DeletionQueue | None = None,
        compression: Compression = "zstd",
        compression_level: int = 1,
        coalesce_indexes: bool = True,
        index_upload_interval_s: float = 0.5,
        compression_probe: bool = True,
        stage_in_l0_writer: bool = False,
    ) -> None:
        self.storage = storage
        self.tenant_id = tenant_id
        self.timeline_id = timeline_id
        self.generation = generation
        self.local_dir = local_dir
        self.validate = validate
        self.pins = pins if pins is not None else Pins()
        self._on_unpinned = on_unpinned
        self.parallel_uploads = parallel_uploads
        self.deletions = deletions
        self.compression = compression
        self.compression_level = compression_level
        self.coalesce_indexes = coalesce_indexes
        self.compression_probe = compression_probe  # skip layers whose sample does not compress
        self.index_upload_interval_s = index_upload_interval_s
        self.stage_in_l0_writer = stage_in_l0_writer  # adopt objects the L0 writer compressed
        self._last_index_put = -float("inf")  # trio.current_time() of the last index PUT
        self._pushes = 0  # ops ever queued (the coalescer's "has more come?")
        # Compression is CPU work in worker threads: at most two at once (a core each on a
        # small machine), whatever parallel_uploads allows for the PUTs.
        self._codec_limiter = trio.CapacityLimiter(2)
        # The remote objects of the last scheduled index: name -> (size, generation)
        self._layers: dict[str, tuple[int, int]] = {}
        # How each uploaded object is stored, by key: what an index naming it records. Filled
        # when an upload completes (and from the remote index), dropped when it is deleted.
        self._stored: dict[str, StoredLayer] = {}
        self.remote_consistent_lsn = INVALID_LSN  # visible: uploaded and validated
        self.projected_lsn = INVALID_LSN  # uploaded, maybe not validated yet
        self.uploaded_index: IndexPart | None = remote_index  # the last index known remote
        if remote_index is not None:
            for name, size in remote_index.layers.items():
                self._layers[name] = (size, remote_index.generations.get(name, generation))
                self._stored[self.layer_key(name, self._layers[name][1])] = remote_index.stored_layer(name)
            self.remote_consistent_lsn = self.projected_lsn = remote_index.disk_consistent_lsn
        self._ops: collections.deque[Op] = collections.deque()
        self._wakeup = trio.Event()
        self.active = False
        self._pending: IndexPart | None = None
        self.last_error: str | None = None
        self.failed_attempts = 0
        self.stopped = False
        # The worker (``run``): cancelled by ``shutdown``, which waits for it to be gone.
        self._worker_scope = trio.CancelScope()
        self._worker_running = False
        self._worker_gone = trio.Event()

    def __repr__(self) -> str:
        return f"<RemoteTimelineClient {self.tenant_id.hex}/{self.timeline_id.hex} gen {self.generation}>"

    @property
    def queued(self) -> int:
        return len(self._ops)

    def layer_generation(self, name: str) -> int | None:
        got = self._layers.get(name)
        return None if got is None else got[1]

    def stage_spec(self) -> remote_compression.StageSpec | None:
        """What the L0 writer process should compress a new L0 into (its staged object), or
        None: nothing to stage (uncompressed uploads, staging off, or a queue that is not
        running: an inactive one may never upload the layer, a stopped one never will)."""
        if self.compression == "none" or not self.stage_in_l0_writer or not self.active or self.stopped:
            return None
        return remote_compression.StageSpec(
            remote_compression.codec_of(self.compression), self.compression_level, self.compression_probe)

    def layer_key(self, name: str, generation: int) -> str:
        return remote_layout.layer_key(self.tenant_id, self.timeline_id, name, generation)

    async def download_layer(self, name: str, path: Path, size: int) -> None:
        """The remote object of layer ``name`` (as the last scheduled index names it) into
        ``path``: temp file, size check, fsync, rename, directory fsync; bounded retries."""
        known = self._layers.get(name)
        key = None if known is None else self.layer_key(name, known[1])
        stored = None if key is None else self._stored.get(key)
        if key is None or stored is None:
            raise RemoteNotFoundError(f"layer {name} is not in the remote index of {self.timeline_id.hex}")
        await download_layer(self.storage, key, path, size, stored=stored)

    # -- scheduling (synchronous: called from the timeline's index_part write) ------------------

    def schedule_index_upload(self, part: IndexPart) -> None:
        if self.stopped:
            return
        if not self.active:
            self._pending = part
            return
        self._schedule(part)

    def activate(self) -> None:
        """Start uploading (the timeline is complete); queues the newest index given so far."""
        if self.active:
            return
        self.active = True
        pending, self._pending = self._pending, None
        if pending is not None:
            self._schedule(pending)

    def _schedule(self, part: IndexPart) -> None:
        replaced: list[str] = []
        for name, size in part.layers.items():
            known = self._layers.get(name)
            if known is not None and known[0] == size:
                continue
            if known is not None:
                # A local file of another size under a name the remote index has (only after a
                # restart kept a stale local file): it goes up under this generation, a new
                # key; the old object is deleted after the index stops naming it.
                if known[1] == self.generation:
                    log.error("layer rewritten with another size in one generation; the old "
                              "object is overwritten", layer=name, generation=self.generation)
                else:
                    replaced.append(self.layer_key(name, known[1]))
            path = self.local_dir / name
            self.pins.pin(path)
            self._push(UploadLayer(name, path, size))
            self._layers[name] = (size, self.generation)
        gone = [name for name in self._layers if name not in part.layers]
        generations = {name: self._layers[name][1] for name in part.layers}
        self._push(UploadIndex(attrs.evolve(part, generations=generations)))
        keys = [self.layer_key(name, self._layers.pop(name)[1]) for name in gone] + replaced
        if keys:
            self._push(Delete(tuple(keys)))

    def _push(self, op: Op) -> None:
        self._pushes += 1
        self._ops.append(op)
        QUEUED_OPS.inc()
        self._wakeup.set()

    async def wait_uploaded(self) -> None:
        """Return once everything queued before the call is done (uploaded, deleted)."""
        if not self.active:
            self.activate()
        done = trio.Event()
        self._push(Barrier(done))
        await done.wait()

    def stop(self) -> None:
        """Drop the queue (the node is going away; the remote index stays as uploaded)."""
        self.stopped = True
        for op in self._ops:
            if isinstance(op, UploadLayer):
                self.pins.unpin(op.path)
            elif isinstance(op, Barrier):
                op.done.set()
        QUEUED_OPS.dec(len(self._ops))
        self._ops.clear()
        self._wakeup.set()

    # -- the worker -------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """``stop``, cancel the worker and wait until it is gone: then no request of this
        client is in flight any more (a timeline deletion lists the remote after this)."""
        self.stop()
        self._worker_scope.cancel()
        if self._worker_running:
            await self._worker_gone.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Execute the queue until cancelled (or ``stop``/``shutdown``)."""
        self._worker_running = True
        try:
            with self._worker_scope:
                await self._run(task_status)
        finally:
            self._worker_running = False
            self._worker_gone.set()

    async def _run(self, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        while not self.stopped:
            if not self._ops:
                self._wakeup = trio.Event()
                await self._wakeup.wait()
                continue
            op = self._ops[0]
            if isinstance(op, UploadLayer):
                batch: list[UploadLayer] = []
                for queued in self._ops:
                    if not isinstance(queued, UploadLayer) or len(batch) >= self.parallel_uploads * 4:
                        break
                    batch.append(queued)
                await self._upload_layers(batch)
                if self._halted():
                    break  # ``stop`` dropped the queue (and unpinned its layers)
                for _ in batch:
                    self._pop()
                await self._release(batch)
            elif isinstance(op, UploadIndex):
                if self.coalesce_indexes:
                    if not await self._coalesce() or self._halted():
                        continue  # more was queued, or the node stops: look again
                    op = self._ops[0]
                    assert isinstance(op, UploadIndex)
                else:
                    # Only a newer index right behind replaces this one (each is complete).
                    while len(self._ops) > 1 and isinstance(self._ops[1], UploadIndex):
                        self._pop()
                        COALESCED_INDEXES.inc()
                    op = self._ops[0]
                    assert isinstance(op, UploadIndex)
                if len(self._ops) > 1 and isinstance(self._ops[1], Delete):
                    # The deletions this index enables go to disk first: a crash after the
                    # upload must not leak them (recovery: pageserver.deletion_queue).
                    await self._persist(self._ops[1])
                    if self._halted():
                        break
                await self._upload_index(op.part)
                self._last_index_put = trio.current_time()
                if self._halted():
                    break
                self._pop()
            elif isinstance(op, Delete):
                await self._persist(op)
                if self._halted():
                    break
                await self._delete(op.keys)
                if op.persisted is not None and self.deletions is not None:
                    await trio.to_thread.run_sync(self.deletions.done, op.persisted)
                if self._halted():
                    break
                self._pop()
            else:
                op.done.set()
                self._pop()

    async def _release(self, uploaded: list[UploadLayer]) -> None:
        """Uploaded layers whose ops have left the queue: their files may go now."""
        for x in uploaded:
            self.pins.unpin(x.path)
        if self._on_unpinned is not None:
            await self._on_unpinned()

    def _halted(self) -> bool:
        """``stopped``, read afresh: ``stop`` may have run during the worker's last await (a
        method, so that the loop's ``while not self.stopped`` does not narrow it for mypy)."""
        return self.stopped

    def _pop(self) -> None:
        self._ops.popleft()
        QUEUED_OPS.dec()

    async def _coalesce(self) -> bool:
        """The queue's head is an index. Upload the layers of the indexes queued right behind
        it (up to a Delete, a Barrier or a layer whose key is already uploaded) and drop the
        indexes the newest of them supersedes, so that the head is that newest one. True:
        upload the head now (something behind it cannot be coalesced, or the interval since
        the last index PUT is over); False: look again (more was queued meanwhile, or the
        queue stopped). Every layer an index names is uploaded before it, as without this."""
        ops = self._ops
        pushes = self._pushes
        group: list[UploadLayer] = []
        pending: list[UploadLayer] = []
        last = 0
        blocked = False
        names: set[str] = set()
        for i in range(1, len(ops)):
            q = ops[i]
            if isinstance(q, UploadIndex):
                last = i
                group += pending
                pending = []
            elif (isinstance(q, UploadLayer) and len(group) + len(pending) < self.parallel_uploads * 4
                  and self.layer_key(q.name, self.generation) not in self._stored
                  and q.name not in names):
                # (a name queued twice stops the scan: two PUTs of one key must not run at once)
                names.add(q.name)
                pending.append(q)
            else:
                blocked = True
                break
        if group:
            await self._upload_layers(group)
            if self.stopped:
                return False  # ``stop`` dropped the queue (and unpinned its layers)
        if last:
            newest = ops[last]  # only appends happened meanwhile: positions 0..last are the same
            superseded = sum(1 for j in range(last) if isinstance(ops[j], UploadIndex))
            for _ in range(last + 1):
                self._pop()
            ops.appendleft(newest)
            QUEUED_OPS.inc()
            COALESCED_INDEXES.inc(superseded)
        if group:
            # unpinned only once their ops have left the queue: a ``stop`` during the await
            # below must not unpin them a second time (the pins are shared with the graveyard)
            await self._release(group)
            if self.stopped:
                return False
        if blocked or pending:
            return True
        if self._pushes != pushes:
            return False  # queued during the uploads: coalesce that too
        wait = self._last_index_put + self.index_upload_interval_s - trio.current_time()
        if wait <= 0:
            return True
        self._wakeup = trio.Event()
        with trio.move_on_after(wait):
            await self._wakeup.wait()
            return False
        return True

    async def _persist(self, op: Delete) -> None:
        if self.deletions is None or op.persisted is not None:
            return
        deletions = self.deletions

        def write() -> DeletionList:
            return deletions.persist(self.tenant_id, self.timeline_id, self.generation, op.keys)

        # A local disk error is retried like a remote one: the index must not go up before
        # the list is durable.
        op.persisted = await retry(lambda: trio.to_thread.run_sync(write), what="persist a deletion list")

    async def _retry(self, what: str, fn: Callable[[], Awaitable[object]]) -> None:
        async def attempt() -> object:
            try:
                result = await fn()
            except Exception as exc:
                self.failed_attempts += 1
                self.last_error = f"{what}: {exc}"
                raise
            self.last_error = None
            return result

        await retry(attempt, what=what)

    def _prepare(self, x: UploadLayer, dst: Path) -> StoredLayer:
        """``x``'s object into ``dst`` (worker thread): the L0 writer's staged object if it
        passes its checks, else ``_compress``."""
        codec = remote_compression.codec_of(self.compression)
        size, rejected = remote_compression.adopt_staged(x.path, x.size, codec, dst)
        if size is not None:
            STAGED_LAYERS.inc()
            return StoredLayer(codec, size)
        if rejected is not None:
            REJECTED_STAGED.inc()
            log.warning("staged layer object rejected; compressing the layer again", layer=x.name, why=rejected)
        return self._compress(x, dst)

    def _compress(self, x: UploadLayer, dst: Path) -> StoredLayer:
        """``x``'s file into ``dst`` as ``self.compression`` (worker thread); "none" if that saves nothing."""
        started = time.thread_time()
        try:
            codec = remote_compression.codec_of(self.compression)
            if self.compression_probe and not remote_compression.worth_compressing(
                    x.path, self.compression_level, codec):
                SKIPPED_COMPRESSIONS.inc()
                return StoredLayer("none", x.size)
            read, written = remote_compression.compress_file(x.path, dst, self.compression_level, codec)
        finally:
            CODEC_SECONDS.labels("compress").inc(time.thread_time() - started)
        if read != x.size:
            # The index says x.size: an object of another size must not be named by it.
            raise OSError(f"{x.path}: compressed {read} bytes, the index says {x.size}")
        if written >= read:
            dst.unlink()
            return StoredLayer("none", x.size)
        return StoredLayer(codec, written)

    async def _upload_layers(self, batch: list[UploadLayer]) -> None:
        limiter = trio.CapacityLimiter(self.parallel_uploads)

        async def one(x: UploadLayer) -> None:
            key = self.layer_key(x.name, self.generation)
            stored_tmp = x.path.with_name(x.name + _TEMP_STORED)
            # The object to send, made once: a retry after a failed PUT sends the same file
            # (None: make it, again after an upload of the wrong size).
            stored: StoredLayer | None = None

            async def put() -> None:
                nonlocal stored
                if stored is None:
                    if self.compression == "none":
                        stored = StoredLayer("none", x.size)
                    else:
                        prepare = self._prepare if self.stage_in_l0_writer else self._compress
                        async with self._codec_limiter:
                            stored = await trio.to_thread.run_sync(prepare, x, stored_tmp)
                src = stored_tmp if stored.compression != "none" else x.path
                size = await self.storage.upload_file(key, src)
                if size != stored.size:
                    # The index says stored.size: an object of another size must not be named by it.
                    want, stored = stored.size, None
                    raise OSError(f"{src}: uploaded {size} bytes, the index says {want}")

            def cleanup() -> None:
                stored_tmp.unlink(missing_ok=True)
                with contextlib.suppress(OSError):  # (not adopted: the upload is done with it)
                    remote_compression.discard_staged(x.path)

            try:
                async with limiter:
                    await self._retry(f"upload {key}", put)
            finally:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(cleanup)
            assert stored is not None  # (put returned)
            self._stored[key] = stored
            UPLOADED_BYTES.inc(x.size)
            UPLOADED_STORED_BYTES.inc(stored.size)
            UPLOADED_LAYERS.inc()

        async with trio.open_nursery() as nursery:
            for x in batch:
                nursery.start_soon(one, x)

    async def _upload_index(self, part: IndexPart) -> None:
        key = remote_layout.index_key(self.tenant_id, self.timeline_id, self.generation)
        stored: dict[str, StoredLayer] = {}
        for name in part.layers:
            got = self._stored.get(self.layer_key(name, part.generations[name]))
            if got is None:
                # Queue order makes every layer's upload complete before an index naming it.
                raise AssertionError(f"{key} would name layer {name}, which is not uploaded")
            if got.compression != "none":
                stored[name] = got
        part = attrs.evolve(part, stored=stored)
        body = part.to_json()
        started = time.monotonic()
        await self._retry(f"upload {key}", lambda: self.storage.upload(key, body))
        UPLOADED_INDEXES.inc()
        self.uploaded_index = part
        self.projected_lsn = part.disk_consistent_lsn
        if await self.validate():
            if part.disk_consistent_lsn > self.remote_consistent_lsn:
                self.remote_consistent_lsn = part.disk_consistent_lsn
        else:
            log.warning("generation no longer current: remote_consistent_lsn not advanced",
                        tenant_id=self.tenant_id.hex, timeline_id=self.timeline_id.hex,
                        generation=self.generation)
        UPLOAD_INDEX_SECONDS.observe(time.monotonic() - started)

    async def _delete(self, keys: tuple[str, ...]) -> None:
        for key in keys:  # no later index names them (a re-upload of a key comes after this)
            self._stored.pop(key, None)
        if not await self.validate():
            DROPPED_DELETIONS.inc(len(keys))
            log.warning("generation no longer current: not deleting (objects leak)",
                        tenant_id=self.tenant_id.hex, timeline_id=self.timeline_id.hex,
                        generation=self.generation, objects=len(keys))
            return
        await self._retry(f"delete {len(keys)} objects", lambda: self.storage.delete_objects(keys))
        DELETED_OBJECTS.inc(len(keys))
