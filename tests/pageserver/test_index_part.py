"""index_part.json: round trip, hostile contents are a clear XX001 error, and writing it does
its file-system calls the IO engine's way (with the threadpool engine: never on the trio
thread, since every flush writes one)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pageserver.storage import index_part as ip
from pageserver.storage.io_engine import ThreadpoolIoEngine
from protocol.errors import RemoteProtocolError
from protocol.lsn import Lsn

lsns = st.integers(0, 2**64 - 1).map(Lsn)
parts = st.builds(
    ip.IndexPart,
    layers=st.dictionaries(st.text(min_size=1, max_size=20), st.integers(0, 2**40)),
    disk_consistent_lsn=lsns,
    latest_gc_cutoff_lsn=lsns,
    ancestor_timeline_id=st.none() | st.just("ab" * 16),
    ancestor_lsn=lsns,
)


@given(parts)
def test_round_trip(part: ip.IndexPart) -> None:
    assert ip.IndexPart.from_json(Path("x"), part.to_json()) == part


@given(st.binary(max_size=200) | parts.map(lambda p: p.to_json()[: len(p.to_json()) // 2]))
def test_hostile_contents_are_xx001(raw: bytes) -> None:
    try:
        ip.IndexPart.from_json(Path("x"), raw)
    except RemoteProtocolError as exc:
        assert exc.sqlstate == "XX001"


async def test_write_does_no_file_system_call_on_the_trio_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trio_thread = threading.current_thread()
    real_unlink = os.unlink

    def unlink(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        assert threading.current_thread() is not trio_thread, f"unlink({path}) on the trio thread"
        real_unlink(path)

    monkeypatch.setattr(os, "unlink", unlink)
    engine = ThreadpoolIoEngine(max_threads=2)
    (tmp_path / (ip.INDEX_PART + ".___temp")).write_bytes(b"left by a crash")
    part = ip.IndexPart(layers={"a": 1}, disk_consistent_lsn=Lsn(0x10))
    await ip.write_index_part(engine, tmp_path, part)
    assert await ip.read_index_part(engine, tmp_path) == part
    assert not (tmp_path / (ip.INDEX_PART + ".___temp")).exists()
