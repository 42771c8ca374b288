"""The ``remote_storage`` config table: ``{kind = "local", path = "..."}`` or
``{kind = "s3", endpoint = "http://127.0.0.1:8333", bucket = "pagestore", prefix = "",
region = "us-east-1"}``.

Credentials are not config: boto3 finds them the usual way (environment, ``~/.aws``);
``access_key_id`` / ``secret_access_key`` are for test stores such as SeaweedFS that accept
any. A relative local ``path`` is taken relative to the node's workdir by the node.

``compression`` (``"zstd"``, the default, ``"lz4"`` or ``"none"``) and ``compression_level``
(zstd 1-19 or its fast levels -7..-1, lz4 1-16) say how the pageserver stores layer files in
the store (``pageserver.remote_compression``); the index records it per layer, so a change applies to
new uploads and every object stays readable.
Indexes and WAL segments are stored as they are.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Final, Literal

import attrs
import cattrs

from common.config import register_tagged_union

Compression = Literal["none", "zstd", "lz4"]
COMPRESSIONS: Final[tuple[Compression, ...]] = ("none", "zstd", "lz4")
# The levels each codec takes. zstd: 1-3 cost 2-5 ms of CPU per MiB, higher ones are far
# slower for little more; its negative ("fast") levels trade ratio for speed (-1: a third less
# CPU than 1 in one call, but no saving in the upload path: docs/remote-storage.md), and below
# -7 the ratio falls off with no more speed; 0 is refused, zstd reads it as "its default" (3).
# lz4: 1-2 are its fast mode, 3-16 its HC levels (far slower to write, as fast to read).
_LEVEL_RANGE: Final[dict[str, tuple[int, int]]] = {"none": (1, 19), "zstd": (-7, 19), "lz4": (1, 16)}


def _check_level(cfg: LocalStorageConfig | S3StorageConfig) -> None:
    level = cfg.compression_level
    bottom, top = _LEVEL_RANGE[cfg.compression]
    if level == 0 or not bottom <= level <= top:
        raise ValueError(f"compression_level must be {bottom}..{top} (not 0) with "
                         f"compression = {cfg.compression!r}, got {level}")

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def _positive(_inst: object, attr: attrs.Attribute[float], value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attr.name} must be positive, got {value}")


def _bucket_name(_inst: object, attr: attrs.Attribute[str], value: str) -> None:
    if not _BUCKET.match(value):
        raise ValueError(f"{attr.name} must be a DNS-style bucket name (a-z, 0-9, '.', '-'), got {value!r}")


def _prefix(_inst: object, attr: attrs.Attribute[str], value: str) -> None:
    if value.startswith("/") or "//" in value:
        raise ValueError(f"{attr.name} must be a relative key prefix without '//', got {value!r}")


@attrs.frozen(kw_only=True)
class LocalStorageConfig:
    path: Path
    concurrency_limit: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    compression: Compression = "zstd"
    compression_level: int = 1  # checked against the codec's range (_check_level)

    def __attrs_post_init__(self) -> None:
        _check_level(self)


@attrs.frozen(kw_only=True)
class S3StorageConfig:
    bucket: str = attrs.field(validator=_bucket_name)
    endpoint: str | None = None  # None: AWS; set: path-style requests to this URL
    prefix: str = attrs.field(default="", validator=_prefix)
    region: str = "us-east-1"
    concurrency_limit: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    timeout_s: float = attrs.field(default=120.0, validator=_positive)  # per request
    connect_timeout_s: float = attrs.field(default=10.0, validator=_positive)
    access_key_id: str | None = None
    secret_access_key: str | None = None
    # The bucket is created at start if missing (test stores; a real bucket is made by its owner)
    create_bucket: bool = False
    # SigV4 over the body too (a SHA-256 of every PUT, on the client and a verifying server),
    # or UNSIGNED-PAYLOAD (the default: the headers are still signed). What guards a layer's
    # bytes either way: TLS on an https endpoint, the size checked against the index after
    # every upload and download, and the layer format's own CRC-32C over every blob, index
    # block and the summary, checked when the file is opened and read.
    payload_signing: bool = False
    compression: Compression = "zstd"
    compression_level: int = 1  # checked against the codec's range (_check_level)

    def __attrs_post_init__(self) -> None:
        _check_level(self)


RemoteStorageConfig = LocalStorageConfig | S3StorageConfig
_UNION: Any = RemoteStorageConfig


def register_hooks(conv: cattrs.Converter) -> None:
    register_tagged_union(
        conv, RemoteStorageConfig, tag="kind", classes={"local": LocalStorageConfig, "s3": S3StorageConfig}
    )
    # ``remote_storage`` is optional in node configs: None stays None (and is not written).
    optional: Any = RemoteStorageConfig | None
    conv.register_structure_hook_func(
        lambda t: t == optional, lambda v, _: None if v is None else conv.structure(v, _UNION)
    )
    conv.register_unstructure_hook_func(
        lambda t: t == optional, lambda v: None if v is None else conv.unstructure(v, _UNION)
    )
