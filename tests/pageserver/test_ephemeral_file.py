"""EphemeralFile: appends and reads at offsets, before, during and after flushes; lifecycle."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from pageserver.storage.buffered_writer import FlushFailedError
from pageserver.storage.ephemeral_file import (
    EphemeralFile,
    remove_stale_ephemeral_files,
)
from pageserver.storage.io_engine import (
    IO_ENGINE_KINDS,
    SYNC_MODES,
    BlockingIoEngine,
    make_io_engine,
)

_T = TypeVar("_T")


@pytest.mark.parametrize("double_buffering", [False, True])
@pytest.mark.parametrize("sync_mode", SYNC_MODES)
@pytest.mark.parametrize("kind", IO_ENGINE_KINDS)
@settings(max_examples=10)
@given(
    values=st.lists(st.binary(min_size=0, max_size=300), max_size=120),
    buffer_size=st.sampled_from([4096, 8192]),
    probes=st.lists(st.integers(0, 10_000), max_size=20),
)
async def test_append_and_read_back(
    kind: str,
    sync_mode: str,
    double_buffering: bool,
    values: list[bytes],
    buffer_size: int,
    probes: list[int],
) -> None:
    directory = Path(tempfile.mkdtemp(prefix="eph-"))
    try:
        engine = make_io_engine(kind)
        async with trio.open_nursery() as nursery:
            eph = await EphemeralFile.create(
                engine,
                directory,
                nursery=nursery if double_buffering else None,
                write_buffer_size=buffer_size,
                double_buffering=double_buffering,
                sync_mode=sync_mode,  # type: ignore[arg-type]
            )
            assert eph.path.parent == directory and eph.path.name.startswith("ephemeral-")
            offsets = []
            for i, v in enumerate(values):
                offsets.append(await eph.append(v))
                # Every value written so far reads back, wherever its bytes are right now.
                for p in probes[i % 4 :: 4]:
                    j = p % len(offsets)
                    assert await eph.read_at(offsets[j], len(values[j])) == values[j]
            picks = [p % len(values) for p in probes] if values else []
            assert await eph.read_many([(offsets[j], len(values[j])) for j in picks]) == [
                values[j] for j in picks
            ]
            assert len(eph) == sum(map(len, values))
            assert offsets == [sum(map(len, values[:i])) for i in range(len(values))]
            assert await eph.read_all() == b"".join(values)
            await eph.freeze()
            with pytest.raises(trio.ClosedResourceError):
                await eph.append(b"late")
            for off, v in zip(offsets, values, strict=True):
                assert await eph.read_at(off, len(v)) == v
            assert eph.path.read_bytes() == b"".join(values)
            await eph.aclose()
            assert not eph.path.exists()
    finally:
        shutil.rmtree(directory)


class GatedEngine(BlockingIoEngine):
    def __init__(self) -> None:
        super().__init__()
        self.gate = trio.Event()

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        if fn.__name__ == "_pwrite_all":
            await self.gate.wait()
        return fn(*args)


async def test_reads_while_a_flush_is_pending_and_close_waits_for_it(tmp_path: Path) -> None:
    engine = GatedEngine()
    async with trio.open_nursery() as nursery:
        eph = await EphemeralFile.create(
            engine, tmp_path, nursery=nursery, write_buffer_size=4096, double_buffering=True
        )
        values = [bytes([i]) * 100 for i in range(50)]  # 5000 bytes: one buffer in flight
        offsets = [await eph.append(v) for v in values]
        await trio.testing.wait_all_tasks_blocked()
        assert eph.writer.flush_in_flight
        for off, v in zip(offsets, values, strict=True):
            assert await eph.read_at(off, 100) == v
        assert eph.path.read_bytes() == b""
        # aclose must not close the fd under the pending write: it waits for it.
        closer_done = trio.Event()

        async def close_it() -> None:
            await eph.aclose()
            closer_done.set()

        nursery.start_soon(close_it)
        await trio.testing.wait_all_tasks_blocked()
        assert not closer_done.is_set()
        engine.gate.set()
    assert closer_done.is_set()
    assert not eph.path.exists()


async def test_flush_error_surfaces_on_append(tmp_path: Path) -> None:
    class Failing(BlockingIoEngine):
        async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
            if fn.__name__ == "_pwrite_all":
                await trio.lowlevel.checkpoint()
                raise OSError(5, "Input/output error (injected)")
            return fn(*args)

    async with trio.open_nursery() as nursery:
        eph = await EphemeralFile.create(
            Failing(), tmp_path, nursery=nursery, write_buffer_size=4096, double_buffering=True
        )
        await eph.append(b"x" * 4096)  # handed to the background flush, which fails
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(FlushFailedError, match="injected"):
            await eph.append(b"y")
        await eph.aclose()  # discarding a failed file does not raise again


async def test_names_are_unique_and_stale_files_are_swept(tmp_path: Path) -> None:
    engine = make_io_engine("blocking")
    (tmp_path / "ephemeral-1").write_bytes(b"left by a crash")
    (tmp_path / "000-FFF__0-1").write_bytes(b"a layer")
    files = [
        await EphemeralFile.create(engine, tmp_path, double_buffering=False) for _ in range(3)
    ]
    assert len({f.path for f in files}) == 3
    assert all(f.path.exists() for f in files)
    for f in files:
        await f.aclose()
    removed = remove_stale_ephemeral_files(tmp_path)
    assert [p.name for p in removed] == ["ephemeral-1"]
    assert [p.name for p in tmp_path.iterdir()] == ["000-FFF__0-1"]


async def test_double_buffering_needs_the_owners_nursery(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="owner's nursery"):
        await EphemeralFile.create(make_io_engine("blocking"), tmp_path, double_buffering=True)
    assert list(tmp_path.iterdir()) == []


async def test_real_ingest_path_gives_identical_layers_for_every_io_knob(tmp_path: Path) -> None:
    """WAL -> decoder -> ingest -> in-memory layer (ephemeral file) -> L0, as ``bench ingest``
    runs it: the IO knobs change speed, never bytes. Tiny buffers force many (background)
    flushes, and O_DIRECT pads and truncates."""
    from bench.ingest import RowConfig, build_wal, run_row

    chunks, counts = build_wal(1 << 20, fpi_every=2, seed=7)
    assert counts["fpis"] > 0 and counts["heap_inserts"] > 3000
    layers: list[dict[str, bytes]] = []
    for i, row in enumerate([
        RowConfig("blocking", 8192, False, "none"),
        RowConfig("threadpool", 4096, True, "direct"),
        RowConfig("blocking", 1 << 20, True, "dsync"),
    ]):
        workdir = tmp_path / str(i)
        workdir.mkdir()
        result = await run_row(row, chunks, workdir, keep=True)
        assert result["records"] == counts["heap_inserts"] + counts["fpis"]
        assert result["l0_layers"] == 1
        tl_dir = Path(result["timeline_dir"])
        assert not [p for p in tl_dir.iterdir() if p.name.startswith("ephemeral-")]
        layers.append({p.name: p.read_bytes() for p in tl_dir.iterdir() if "__" in p.name})
    assert layers[0] and layers[0] == layers[1] == layers[2]
