"""Node config (TOML -> PageserverConfig), the backup command parser and the tar writer:
fast tests without PostgreSQL."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.config import ConfigError
from pageserver.basebackup import TarWriter, parse_backup_command
from pageserver.config import (
    PageserverConfig,
    dump_pageserver_config,
    load_pageserver_config,
    parse_pageserver_config,
)
from pageserver.page_service.config import PipelinedPipelining, SerialPipelining
from protocol.lsn import format_lsn, parse_lsn
from protocol.pgwire.errors import PgError

T = "0123456789abcdef0123456789abcdef"
TL = "fedcba9876543210fedcba9876543210"


def test_defaults_follow_architecture_ports(tmp_path: Path) -> None:
    cfg = parse_pageserver_config(f'workdir = "{tmp_path}"')
    assert cfg.pg_addr == ("127.0.0.1", 64000)
    assert cfg.http_addr == ("127.0.0.1", 9898)
    assert isinstance(cfg.page_service_pipelining, PipelinedPipelining)
    assert cfg.safekeepers == ()


def test_full_config_and_round_trip(tmp_path: Path) -> None:
    text = f"""
workdir = "{tmp_path}"
id = 7
listen_pg_addr = "127.0.0.1:1234"
page_service_pipelining = {{ mode = "serial" }}
wait_lsn_timeout_s = 5.0
io_engine = "threadpool"
safekeepers = ["127.0.0.1:5454", "127.0.0.1:5455"]
log_file = "ps.log"

[tenant_config]
checkpoint_distance = 1048576
get_impl = "legacy"
"""
    cfg = parse_pageserver_config(text)
    assert cfg.id == 7 and cfg.pg_addr == ("127.0.0.1", 1234)
    assert cfg.page_service_pipelining == SerialPipelining()
    storage = cfg.storage_config()
    assert storage.io_engine == "threadpool" and storage.wait_lsn_timeout_s == 5.0
    assert storage.checkpoint_distance == 1048576 and storage.get_impl == "legacy"
    assert cfg.log_path == tmp_path / "ps.log"
    assert cfg.page_service_config().wait_lsn_timeout_s == 5.0
    assert parse_pageserver_config(dump_pageserver_config(cfg)) == cfg


def test_relative_workdir_is_relative_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ps.toml"
    path.write_text('workdir = "data"\n')
    assert load_pageserver_config(path).workdir == tmp_path / "data"


@pytest.mark.parametrize(
    "text, key",
    [
        ('workdir = "/x"\nbogus = 1', "bogus: unknown key"),
        ('workdir = "/x"\nlisten_pg_addr = "nope"', "listen_pg_addr"),
        ('workdir = "/x"\nsafekeepers = ["a:b"]', "safekeepers"),
        ('workdir = "/x"\nid = "1"', "id: expected an integer"),
        ('workdir = "/x"\npage_service_pipelining = { mode = "turbo" }', "page_service_pipelining"),
        ('workdir = "/x"\n[tenant_config]\ncheckpoint_distance = 0', "tenant_config"),
        ('workdir = "/x"\n[tenant_config]\nnope = 1', "tenant_config.nope: unknown key"),
        ("id = 1", "workdir: required key missing"),
        ('workdir = "/x"\nio_engine = "aio"', "io_engine"),
    ],
)
def test_bad_config_names_the_key(text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_pageserver_config(text)
    assert key in str(info.value)


@pytest.mark.parametrize("key", ["wal_precheck_min_bytes", "wal_precheck_max_children"])
def test_a_removed_key_is_refused_with_what_to_do(tmp_path: Path, key: str) -> None:
    """A config file written for the pageserver that had the WAL pre-check child is refused,
    not silently accepted, and the error says why and what to do; other faults of the same
    file are still listed."""
    path = tmp_path / "ps.toml"
    path.write_text(f'workdir = "data"\n{key} = 32768\n')
    with pytest.raises(ConfigError) as info:
        load_pageserver_config(path)
    assert info.value.errors == [
        f"{key}: removed: the pageserver no longer has a WAL pre-check child (the ingest "
        "checks every record itself, in one process); delete this key"
    ]
    with pytest.raises(ConfigError) as info:
        parse_pageserver_config(f'workdir = "/x"\n{key} = 0\nbogus = 1')
    assert len(info.value.errors) == 2
    assert info.value.errors[0].startswith(f"{key}: removed:")
    assert info.value.errors[1] == "bogus: unknown key"


def test_backup_command_forms() -> None:
    cmd = parse_backup_command("basebackup", (T, TL))
    assert (cmd.lsn, cmd.gzip, cmd.full) == (None, False, False)
    cmd = parse_backup_command("basebackup", (T, TL, "0/16B3748", "--gzip"))
    assert cmd.lsn == parse_lsn("0/16B3748") and cmd.gzip
    cmd = parse_backup_command("basebackup", (T, TL, "--gzip", "--replica"))
    assert cmd.lsn is None and cmd.gzip and cmd.replica
    cmd = parse_backup_command("basebackup", (T, TL, "latest"))
    assert cmd.lsn is None
    cmd = parse_backup_command("fullbackup", (T, TL, "1/0", "0/FF0"))
    assert cmd.full and cmd.lsn == 1 << 32 and cmd.prev_lsn == 0xFF0


_lsn_words = st.from_regex(r"[-+ 0-9A-Fa-fx_]{0,9}/[-+ 0-9A-Fa-fx_]{0,9}", fullmatch=True)
_backup_words = st.one_of(
    st.text(max_size=40), _lsn_words, st.sampled_from(["latest", "--gzip", "--replica", "--x"])
)


@given(
    name=st.sampled_from(["basebackup", "fullbackup"]),
    ids=st.sampled_from([(), (T,), (T, TL), (T, TL.upper()), ("x" * 32, TL)]),
    rest=st.lists(_backup_words, max_size=4),
)
def test_backup_command_parser_refuses_with_pgerror_only(
    name: str, ids: tuple[str, ...], rest: list[str]
) -> None:
    """Any arguments either parse to LSNs PostgreSQL could print, or raise PgError."""
    try:
        cmd = parse_backup_command(name, (*ids, *rest))
    except PgError:
        return
    for lsn in (cmd.lsn, cmd.prev_lsn):
        assert lsn is None or 0 <= lsn < 2**64
        assert lsn is None or parse_lsn(format_lsn(lsn)) == lsn


@given(
    files=st.dictionaries(
        st.from_regex(r"[a-z][a-z0-9_]{0,20}(/[a-z0-9_]{1,20}){0,3}", fullmatch=True),
        st.binary(max_size=3000),
        max_size=8,
    ),
    gzip_=st.booleans(),
)
async def test_tar_writer_round_trip(files: dict[str, bytes], gzip_: bool) -> None:
    out: list[bytes] = []

    async def send(b: bytes) -> None:
        out.append(b)

    tar = TarWriter(send, gzip=gzip_, mtime=1_700_000_000)
    await tar.add_dir("somedir")
    for name, data in files.items():
        await tar.add_file(name, data)
    await tar.close()
    with tarfile.open(fileobj=io.BytesIO(b"".join(out))) as tf:
        got = {m.name: tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}  # type: ignore[union-attr]
        assert tf.getmember("somedir").isdir()
    assert got == files
    assert tar.files == len(files)


def test_config_class_is_frozen(tmp_path: Path) -> None:
    cfg = PageserverConfig(workdir=tmp_path)
    with pytest.raises(AttributeError):
        cfg.id = 2  # type: ignore[misc]
