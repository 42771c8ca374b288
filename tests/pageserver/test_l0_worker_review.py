"""Review of the background L0 writer's hand-off (``pageserver/storage/l0_worker.py``): an
answer from the worker is only believed when it names this job's L0 in this timeline's
directory; anything else (no file for a layer with values, a file elsewhere, another job's
file, a path that is not a string) fails the flush with nothing advanced (in memory or in
index_part), and the worker that said it is killed. The answer decoder turns any hostile
bytes into ``L0WorkerProtocolError`` (or a broken pipe when cut short), never another error.
A temp file a killed worker left behind is removed at the next load.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as hst

from pageserver.storage import l0_worker
from pageserver.storage.l0_worker import L0Worker, L0WorkerError, L0WorkerProtocolError
from pageserver.tenant import Tenant
from pageserver.timeline import Timeline
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from tests.pageserver.test_l0_worker import CFG, _filled, _image, _index_part, _put, k


def _layer_names(tl: Timeline) -> list[str]:
    layers = _index_part(tl)["layers"]
    assert isinstance(layers, dict)
    return [n for n in layers if "__" in n]


class _LyingWorker(L0Worker):
    """A worker whose answer is rewritten by ``lie`` (given the true answer and the job's
    directory) once ``armed``: what a buggy or confused worker could say."""

    def __init__(self, lie: Callable[[dict[str, Any], Path], dict[str, Any]]) -> None:
        super().__init__()
        self.lie = lie
        self.armed = False
        self.directory = Path()

    async def write_l0(self, layer: Any, directory: Path, **kw: Any) -> Path | None:
        self.directory = directory
        return await super().write_l0(layer, directory, **kw)

    async def _receive(self, stream: trio.abc.ReceiveStream) -> dict[str, Any]:
        answer = await super()._receive(stream)
        return self.lie(answer, self.directory) if self.armed else answer


def _no_file(answer: dict[str, Any], directory: Path) -> dict[str, Any]:
    return {"path": None}


def _elsewhere(answer: dict[str, Any], directory: Path) -> dict[str, Any]:
    # the real file, copied outside the timeline directory (outside the tenant's too)
    real = Path(answer["path"])
    other = directory.parents[2] / "elsewhere" / real.name
    other.parent.mkdir(exist_ok=True)
    other.write_bytes(real.read_bytes())
    return {"path": os.fspath(other)}


def _not_a_string(answer: dict[str, Any], directory: Path) -> dict[str, Any]:
    return {"path": 5}


def _relative(answer: dict[str, Any], directory: Path) -> dict[str, Any]:
    return {"path": os.path.relpath(answer["path"])}


_first_l0: list[str] = []


def _earlier_job(answer: dict[str, Any], directory: Path) -> dict[str, Any]:
    # the L0 of the layer flushed before (a stale answer of an earlier job)
    return {"path": _first_l0[0]}


@pytest.mark.parametrize("lie", [_no_file, _elsewhere, _not_a_string, _relative, _earlier_job])
async def test_a_wrong_answer_from_the_worker_advances_nothing(
    tmp_path: Path, lie: Callable[[dict[str, Any], Path], dict[str, Any]]
) -> None:
    tenant = Tenant(tmp_path / "t", TenantId.generate(), CFG)
    tl = await tenant.create_timeline(TimelineId.generate())
    worker = tl.l0_worker = _LyingWorker(lie)
    try:
        await _put(tl, 0x110)
        await tl.flush()  # a first L0, truthfully
        names = _layer_names(tl)
        assert len(names) == 1
        _first_l0[:] = [os.fspath(tl.path / names[0])]
        for lsn in range(0x120, 0x200, 0x10):
            await _put(tl, lsn)
        before, index_before, pid = tl.disk_consistent_lsn, _index_part(tl), worker.pid
        n_layers = len(list(tl._layer_map))
        worker.armed = True
        with pytest.raises(L0WorkerError, match="answer"):
            await tl.flush()
        # nothing acknowledged: the frozen layer stays, in memory and in index_part
        assert tl.disk_consistent_lsn == before and len(tl.frozen_layers) == 1
        assert _index_part(tl) == index_before
        assert len(list(tl._layer_map)) == n_layers
        assert await tl.get(k(0x150 % 50), Lsn(0x1F0)) == _image(0x150)
        # the worker that lied is not trusted with the next job
        assert pid is not None and worker.pid is None
        worker.armed = False
        await tl.flush()
        assert tl.disk_consistent_lsn == 0x1F0 and not tl.frozen_layers
        assert worker.starts == 2
    finally:
        await tenant.shutdown()
    again = await Tenant.load(tmp_path / "t", tenant.tenant_id, CFG)
    try:
        tl2 = again.timelines[tl.timeline_id]
        assert tl2.disk_consistent_lsn == 0x1F0
        for lsn in range(0x110, 0x200, 0x10):
            assert await tl2.get(k(lsn % 50), Lsn(0x1F0)) == _image(lsn)
    finally:
        await again.shutdown()


async def test_a_deeply_nested_answer_is_a_protocol_error() -> None:
    payload = b"[" * 200_000
    send, receive = trio.testing.memory_stream_pair()
    await send.send_all(l0_worker._ANSWER.pack(l0_worker.ANSWER_MAGIC, len(payload)) + payload)
    await send.aclose()
    with pytest.raises(L0WorkerProtocolError):
        await L0Worker()._receive(receive)


@settings(max_examples=200, deadline=None)
@given(hst.binary(max_size=64), hst.booleans())
def test_any_answer_bytes_give_a_protocol_error_or_a_broken_pipe(junk: bytes, framed: bool) -> None:
    data = l0_worker._ANSWER.pack(l0_worker.ANSWER_MAGIC, len(junk)) + junk if framed else junk

    async def main() -> None:
        send, receive = trio.testing.memory_stream_pair()
        await send.send_all(data)
        await send.aclose()
        try:
            await L0Worker()._receive(receive)
        except (L0WorkerProtocolError, trio.BrokenResourceError):
            pass

    trio.run(main)


async def test_a_killed_workers_temp_file_is_removed_at_load(tmp_path: Path) -> None:
    tenant, tl = await _filled(tmp_path / "t")
    await tl.flush()
    names = _layer_names(tl)
    await tenant.shutdown()
    # what a worker killed between its temp file and its rename leaves behind
    left = tl.path / (names[0][:-16] + "00000000000002FF.___temp")
    left.write_bytes(b"partial")
    (tl.path / (left.name + ".index")).write_bytes(b"partial")
    again = await Tenant.load(tmp_path / "t", tenant.tenant_id, CFG)
    try:
        assert not [p.name for p in tl.path.iterdir() if "___temp" in p.name]
        assert again.timelines[tl.timeline_id].disk_consistent_lsn == 0x1F0
    finally:
        await again.shutdown()


async def test_a_layer_whose_tail_was_not_written_is_not_handed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant, tl = await _filled(tmp_path / "t")
    try:
        before, index_before = tl.disk_consistent_lsn, _index_part(tl)
        layer = tl.open_layer
        assert layer is not None

        async def dying_disk() -> None:
            raise OSError(5, "injected EIO (the freeze's tail write)")

        monkeypatch.setattr(layer.file._writer, "flush", dying_disk)
        with pytest.raises(OSError, match="injected EIO"):
            await tl.flush()
        # the freeze failed: the layer is frozen but its file lacks the tail; the worker,
        # which reads the file, must not get it (it would write an L0 without those values)
        for _ in range(2):
            with pytest.raises(OSError, match="tail was not written"):
                await tl.flush()
        assert tl.l0_worker.jobs == 0 and tl.l0_worker.pid is None
        assert tl.disk_consistent_lsn == before and _index_part(tl) == index_before
        assert tl.frozen_layers == [layer]
        assert await tl.get(k(0x1F0 % 50), Lsn(0x1F0)) == _image(0x1F0)
    finally:
        await tenant.shutdown()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("stop", [False, True])
async def test_a_cancelled_job_never_writes_behind_the_callers_back(tmp_path: Path, stop: bool) -> None:
    """A flush given up on (a caller's timeout; the worker merely slow, or stopped as on a hung
    disk) kills its worker before it returns: no L0 appears later, and the layer is written
    by the next flush on a new worker."""
    tenant, tl = await _filled(tmp_path / "t", ["--stall-s", "0.4"])
    try:
        before = tl.disk_consistent_lsn
        with trio.move_on_after(0.2) as scope:
            await tl.flush()
        assert scope.cancelled_caught
        pid = tl.l0_worker.pid
        assert pid is None  # killed and reaped before the flush returned
        assert tl.l0_worker.starts == 1 and tl.disk_consistent_lsn == before
        await trio.sleep(0.8)  # well past the stall: a worker still alive would have renamed by now
        assert not _layer_names(tl) and not [p for p in tl.path.iterdir() if "__" in p.name]
        if stop:
            # a worker that hangs (stopped): the caller's timeout still ends the job and the worker
            await _put(tl, 0x200)
            tl.l0_worker = L0Worker(worker_args=["--stall-s", "0.3"])  # stopped before it writes
            async with trio.open_nursery() as nursery:
                async def stop_it() -> None:
                    while not (tl.l0_worker.busy and tl.l0_worker.pid is not None):
                        await trio.sleep(0.005)
                    os.kill(tl.l0_worker.pid, 19)  # SIGSTOP
                nursery.start_soon(stop_it)
                with trio.move_on_after(3) as scope:
                    await tl.flush()
            # no built-in timeout: the stopped worker held the flush until the caller gave up
            assert scope.cancelled_caught and tl.disk_consistent_lsn == before
            assert tl.l0_worker.pid is None and tl.l0_worker.starts == 1
        await tl.flush()
        assert not tl.frozen_layers and tl.disk_consistent_lsn == (0x200 if stop else 0x1F0)
    finally:
        await tenant.shutdown()
