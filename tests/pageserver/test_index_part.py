"""index_part.json: round trip, hostile contents are a clear XX001 error, and writing it does
its file-system calls the IO engine's way (with the threadpool engine: never on the trio
thread, since every flush writes one)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pageserver.storage import index_part as ip
from pageserver.storage.io_engine import ThreadpoolIoEngine
from protocol.errors import RemoteProtocolError
from protocol.lsn import Lsn

lsns = st.integers(0, 2**64 - 1).map(Lsn)
local_parts = st.builds(
    ip.IndexPart,
    layers=st.dictionaries(st.text(min_size=1, max_size=20), st.integers(0, 2**40)),
    disk_consistent_lsn=lsns,
    latest_gc_cutoff_lsn=lsns,
    ancestor_timeline_id=st.none() | st.just("ab" * 16),
    ancestor_lsn=lsns,
)


@st.composite
def remote_parts(draw: st.DrawFn) -> ip.IndexPart:
    """A remote index: every layer with a generation, some stored compressed."""
    part = draw(local_parts)
    generations = {name: draw(st.integers(1, 2**32 - 1)) for name in part.layers}
    stored = {name: ip.StoredLayer(draw(st.sampled_from(("zstd", "lz4"))), draw(st.integers(1, 2**40)))
              for name in part.layers if draw(st.booleans())}
    return attrs.evolve(part, generations=generations, stored=stored)


parts = local_parts | remote_parts()


@given(parts)
def test_round_trip(part: ip.IndexPart) -> None:
    assert ip.IndexPart.from_json(Path("x"), part.to_json()) == part


@given(st.binary(max_size=200) | parts.map(lambda p: p.to_json()[: len(p.to_json()) // 2]))
def test_hostile_contents_are_xx001(raw: bytes) -> None:
    try:
        ip.IndexPart.from_json(Path("x"), raw)
    except RemoteProtocolError as exc:
        assert exc.sqlstate == "XX001"


V1 = b"""{
 "version": 1,
 "disk_consistent_lsn": "0/1500780",
 "latest_gc_cutoff_lsn": "0/0",
 "ancestor_timeline_id": null,
 "ancestor_lsn": "0/0",
 "layers": {
  "a__0000000000000001-0000000001500781": {
   "file_size": 23137035,
   "generation": 3
  }
 }
}"""


def test_a_version_1_index_reads_as_layers_stored_as_they_are() -> None:
    """What every index written before compression looks like (no migration)."""
    part = ip.IndexPart.from_json(Path("x"), V1)
    name = "a__0000000000000001-0000000001500781"
    assert part.layers == {name: 23137035} and part.generations == {name: 3} and part.stored == {}
    assert part.stored_layer(name) == ip.StoredLayer("none", 23137035)
    assert part.disk_consistent_lsn == 0x1500780


def test_compressed_layers_are_written_with_both_sizes() -> None:
    part = ip.IndexPart(layers={"a": 100, "b": 50, "c": 30}, disk_consistent_lsn=Lsn(0x10),
                        generations={"a": 1, "b": 2, "c": 2},
                        stored={"a": ip.StoredLayer("zstd", 7), "c": ip.StoredLayer("lz4", 9)})
    doc = json.loads(part.to_json())
    assert doc["version"] == 2
    assert ip.IndexPart.from_json(Path("x"), part.to_json()) == part  # zstd, lz4 and raw side by side
    # Without a compressed object the document stays version 1 (what older builds read).
    plain = attrs.evolve(part, stored={})
    assert json.loads(plain.to_json())["version"] == 1
    assert ip.IndexPart.from_json(Path("x"), plain.to_json()) == plain
    assert doc["layers"] == {"a": {"file_size": 100, "generation": 1, "compression": "zstd", "compressed_size": 7},
                             "b": {"file_size": 50, "generation": 2},
                             "c": {"file_size": 30, "generation": 2, "compression": "lz4", "compressed_size": 9}}


@pytest.mark.parametrize(
    ("meta", "error"),
    [
        ({"file_size": 10, "compression": "gzip", "compressed_size": 5}, "unknown compression 'gzip'"),
        ({"file_size": 10, "compression": "lz4"}, "compressed_size"),
        ({"file_size": 10, "compression": "zstd"}, "compressed_size"),
        ({"file_size": 10, "compression": "zstd", "compressed_size": 0}, "compressed_size 0"),
        ({"file_size": 10, "compression": "zstd", "compressed_size": -5}, "non-negative"),
        ({"file_size": 10, "compression": "zstd", "compressed_size": "5"}, "non-negative"),
        ({"file_size": 10, "compressed_size": 5}, "without a compression"),
        ({"file_size": 10.5}, "non-negative"),
        ({"file_size": 10, "compression": ["zstd"]}, "invalid index_part"),
    ],
)
def test_hostile_layer_entries_are_xx001(meta: dict[str, object], error: str) -> None:
    doc = json.loads(V1)
    doc["version"] = 2
    doc["layers"] = {"a": meta}
    with pytest.raises(RemoteProtocolError, match=error) as info:
        ip.IndexPart.from_json(Path("x"), json.dumps(doc).encode())
    assert info.value.sqlstate == "XX001"


def test_an_unknown_version_is_refused() -> None:
    with pytest.raises(RemoteProtocolError, match="unsupported version 3"):
        ip.IndexPart.from_json(Path("x"), V1.replace(b'"version": 1', b'"version": 3'))


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
