"""Config loading: nested attrs, Literal, tagged unions, strict values, errors naming keys."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import attrs
import cattrs
import pytest

from common.config import (
    ConfigError,
    dump_config,
    load_config,
    make_converter,
    register_tagged_union,
    structure_config,
)


@attrs.frozen
class Serial:
    pass


@attrs.frozen
class Pipelined:
    max_batch_size: int = 32
    batching: Literal["uniform-lsn", "scattered-lsn"] = "uniform-lsn"


Pipelining = Serial | Pipelined


@attrs.frozen
class Listener:
    host: str = "127.0.0.1"
    port: int = 64000


@attrs.frozen
class NodeConfig:
    id: int
    workdir: Path = Path(".")
    listen: Listener = Listener()
    peers: list[Listener] = attrs.Factory(list)
    page_service_pipelining: Pipelining = Serial()
    timeout_s: float = 1.5
    no_sync: bool = False
    label: str | None = None


@pytest.fixture
def conv() -> cattrs.Converter:
    c = make_converter()
    register_tagged_union(c, Pipelining, tag="mode", classes={"serial": Serial, "pipelined": Pipelined})
    return c


def errors_of(conv: cattrs.Converter, text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(NodeConfig, text, converter=conv)
    return info.value.errors


def test_full_config_loads(conv: cattrs.Converter, tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text(
        """
id = 7
workdir = "/tmp/x"
timeout_s = 3
no_sync = true
page_service_pipelining = { mode = "pipelined", max_batch_size = 8, batching = "scattered-lsn" }
[listen]
port = 5454
[[peers]]
host = "10.0.0.1"
"""
    )
    cfg = load_config(NodeConfig, path, converter=conv)
    assert cfg == NodeConfig(
        id=7,
        workdir=Path("/tmp/x"),
        listen=Listener(port=5454),
        peers=[Listener(host="10.0.0.1")],
        page_service_pipelining=Pipelined(8, "scattered-lsn"),
        timeout_s=3.0,
        no_sync=True,
    )
    assert load_config(NodeConfig, 'id = 1\npage_service_pipelining = {mode = "serial"}', converter=conv).page_service_pipelining == Serial()
    # Round trip through TOML text.
    assert load_config(NodeConfig, dump_config(cfg, converter=conv), converter=conv) == cfg


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("id = 1\nbogus = 2", "bogus: unknown key"),
        ("id = 1\n[listen]\nprot = 1", "listen.prot: unknown key"),
        ("id = 1\n[listen]\nport = 'x'", "listen.port: expected an integer, got 'x'"),
        ("id = 1\n[listen]\nport = 1.5", "listen.port: expected an integer, got 1.5"),
        ("id = true", "id: expected an integer, got True"),
        ("id = 1\nno_sync = 1", "no_sync: expected a boolean, got 1"),
        ("id = 1\nlabel = 5", "label:"),
        ("", "id: required key missing"),
        ("id = 1\n[[peers]]\n[[peers]]\nport = 'p'", "peers[1].port: expected an integer"),
        (
            "id = 1\npage_service_pipelining = {mode = 'pipelined', max_batch_size = 'big'}",
            "page_service_pipelining.max_batch_size: expected an integer, got 'big'",
        ),
        (
            "id = 1\npage_service_pipelining = {mode = 'pipelined', batching = 'random'}",
            "page_service_pipelining.batching: invalid value 'random', expected one of",
        ),
        (
            "id = 1\npage_service_pipelining = {mode = 'turbo'}",
            "page_service_pipelining.mode: unknown 'turbo', expected one of 'serial', 'pipelined'",
        ),
        (
            "id = 1\npage_service_pipelining = {max_batch_size = 3}",
            "page_service_pipelining.mode: missing",
        ),
        (
            "id = 1\npage_service_pipelining = {mode = 'serial', max_batch_size = 3}",
            "page_service_pipelining.max_batch_size: unknown key",
        ),
        ("id = ", "TOML syntax"),
    ],
)
def test_errors_name_the_key(conv: cattrs.Converter, text: str, expected: str) -> None:
    errors = errors_of(conv, text)
    assert any(e.startswith(expected) for e in errors), errors


def test_several_errors_reported_at_once(conv: cattrs.Converter) -> None:
    errors = errors_of(conv, "id = 'x'\nnope = 1\n[listen]\nport = 'y'")
    assert sorted(e.split(":")[0] for e in errors) == ["id", "listen.port", "nope"]
    with pytest.raises(ConfigError, match="invalid config: "):
        structure_config(NodeConfig, {"id": "x"}, converter=conv)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(NodeConfig, tmp_path / "missing.toml")


def test_binary_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "binary.toml"
    path.write_bytes(b"id = 1\n\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(NodeConfig, path)
