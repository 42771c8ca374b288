"""The ``remote_storage`` config table: both kinds, strict keys, names checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from common.config import ConfigError, dump_config, load_config, make_converter
from remote_storage import LocalStorageConfig, RemoteStorageConfig, S3StorageConfig, register_hooks


@attrs.frozen
class Node:
    remote_storage: RemoteStorageConfig | None = None


def _conv() -> Any:
    conv = make_converter()
    register_hooks(conv)
    return conv


def test_kinds_round_trip() -> None:
    local = load_config(Node, 'remote_storage = {kind = "local", path = "/data/remote"}', converter=_conv())
    assert local.remote_storage == LocalStorageConfig(path=Path("/data/remote"))
    s3 = load_config(
        Node,
        'remote_storage = {kind = "s3", endpoint = "http://127.0.0.1:8333", bucket = "pagestore", prefix = "a/b", region = "eu-west-1"}',
        converter=_conv(),
    )
    assert s3.remote_storage == S3StorageConfig(
        endpoint="http://127.0.0.1:8333", bucket="pagestore", prefix="a/b", region="eu-west-1"
    )
    assert local.remote_storage.compression == s3.remote_storage.compression == "zstd"  # the default
    plain = load_config(Node, 'remote_storage = {kind = "local", path = "/r", compression = "none"}',
                        converter=_conv())
    assert plain.remote_storage == LocalStorageConfig(path=Path("/r"), compression="none")
    level3 = load_config(Node, 'remote_storage = {kind = "s3", bucket = "b-1", compression_level = 3}',
                         converter=_conv())
    assert isinstance(level3.remote_storage, S3StorageConfig) and level3.remote_storage.compression_level == 3
    fast = load_config(Node, 'remote_storage = {kind = "s3", bucket = "b-1", compression = "lz4", compression_level = 16}',
                       converter=_conv())
    assert isinstance(fast.remote_storage, S3StorageConfig) and fast.remote_storage.compression == "lz4"
    zstd_fast = load_config(Node, 'remote_storage = {kind = "local", path = "/r", compression_level = -1}',
                            converter=_conv())
    assert isinstance(zstd_fast.remote_storage, LocalStorageConfig)
    assert zstd_fast.remote_storage.compression_level == -1
    for cfg in (local, s3, plain, level3, fast, zstd_fast, Node()):
        assert load_config(Node, dump_config(cfg, converter=_conv()), converter=_conv()) == cfg


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('remote_storage = {kind = "gcs"}', "remote_storage.kind: unknown 'gcs'"),
        ('remote_storage = {path = "/x"}', "remote_storage.kind: missing"),
        ('remote_storage = {kind = "local", path = "/x", bucket = "b"}', "remote_storage.bucket: unknown key"),
        ('remote_storage = {kind = "s3", bucket = "under_score"}', "DNS-style bucket name"),
        ('remote_storage = {kind = "s3", bucket = "okay", timeout_s = 0}', "timeout_s must be positive"),
        ('remote_storage = {kind = "local", path = "/x", compression = "gzip"}', "remote_storage.compression"),
        ('remote_storage = {kind = "s3", bucket = "okay", compression_level = 0}', "compression_level"),
        ('remote_storage = {kind = "local", path = "/x", compression_level = 20}', "compression_level"),
        ('remote_storage = {kind = "local", path = "/x", compression = "lz4", compression_level = 17}',
         "compression_level must be 1..16 (not 0)"),
        ('remote_storage = {kind = "local", path = "/x", compression = "lz4", compression_level = -1}',
         "compression_level must be 1..16"),
        ('remote_storage = {kind = "local", path = "/x", compression_level = -8}', "compression_level"),
        ('remote_storage = {kind = "s3", bucket = "okay", compression = "lz4", compression_level = 0}',
         "compression_level"),
        ('remote_storage = {kind = "s3", bucket = "okay", compression = "LZ4"}', "remote_storage.compression"),
    ],
)
def test_bad_tables_name_the_key(text: str, error: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(Node, text, converter=_conv())
    assert error in str(info.value)
