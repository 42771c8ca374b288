"""Per-tenant storage settings, with Neon's defaults (storage.md §2.10).

Values are attrs fields so the pageserver config loader (cattrs, ``forbid_extra_keys``) can
structure them from TOML; the validators reject bad values with a message naming the key.
``validate_get`` defaults to the environment variable ``PAGESTORE_VALIDATE_GET`` (unset: off),
so a test suite can switch it on for every tenant any room creates.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import attrs

MiB = 1024 * 1024


def _positive(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ValueError(f"{attr.name} must be positive, got {value}")


def _non_negative(_inst: object, attr: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attr.name} must not be negative, got {value}")


def _validate_get_default() -> bool:
    return os.environ.get("PAGESTORE_VALIDATE_GET", "") not in ("", "0")


@attrs.frozen(kw_only=True)
class StorageConfig:
    # freezing the open in-memory layer
    checkpoint_distance: int = attrs.field(default=256 * MiB, validator=_positive)
    checkpoint_timeout_s: float = attrs.field(default=600.0, validator=_non_negative)
    # compaction
    compaction_target_size: int = attrs.field(default=128 * MiB, validator=_positive)
    compaction_period_s: float = attrs.field(default=20.0, validator=_non_negative)
    # With remote storage: local layer files beyond this many bytes (per tenant) are evicted,
    # least recently used first, every eviction_period_s (and downloaded again when read).
    # 0: no limit.
    max_local_layer_bytes: int = attrs.field(default=0, validator=_non_negative)
    eviction_period_s: float = attrs.field(default=1.0, validator=attrs.validators.gt(0.0))
    compaction_threshold: int = attrs.field(default=10, validator=_positive)
    image_creation_threshold: int = attrs.field(default=3, validator=_positive)
    # GC
    gc_horizon: int = attrs.field(default=64 * MiB, validator=_non_negative)
    gc_period_s: float = attrs.field(default=3600.0, validator=_non_negative)
    pitr_interval_s: float = attrs.field(default=7 * 24 * 3600.0, validator=_non_negative)
    # read path
    get_impl: Literal["vectored", "legacy"] = attrs.field(
        default="vectored", validator=attrs.validators.in_(("vectored", "legacy"))
    )
    # Off by default (it doubles read cost); the test suite turns it on for every tenant by
    # setting PAGESTORE_VALIDATE_GET=1, which is where this default comes from.
    validate_get: bool = attrs.field(factory=_validate_get_default)
    max_vectored_read_bytes: int = attrs.field(default=128 * 1024, validator=_positive)
    # materialized page cache, in bytes (Neon: 8192 slots x 8 KiB)
    page_cache_size: int = attrs.field(default=64 * MiB, validator=_non_negative)
    # how many decoded layer-index blocks stay cached (Neon keeps B-tree nodes in its PageCache)
    index_cache_blocks: int = attrs.field(default=8192, validator=_non_negative)
    # IO (pageserver.storage.io_engine and the BufferedWriter)
    io_engine: Literal["blocking", "threadpool"] = attrs.field(
        default="blocking", validator=attrs.validators.in_(("blocking", "threadpool"))
    )
    # 1 MiB: the WAL ingest's in-memory layer hands a full buffer over per MiB, not per 64 KiB
    # (-15 % ingest CPU per record measured against 64 KiB; 1 MiB is also among the best rows
    # of the write-path matrix, docs/benchmarks.md "bench ingest")
    write_buffer_size: int = attrs.field(default=1024 * 1024, validator=_positive)
    double_buffering: bool = True
    # "none": page cache; "dsync": O_DSYNC writes; "direct": O_DIRECT (refused with a clear
    # error where the filesystem does not support it). For experiments: see docs/io.md.
    io_sync_mode: Literal["none", "dsync", "direct"] = attrs.field(
        default="none", validator=attrs.validators.in_(("none", "dsync", "direct"))
    )
    wait_lsn_timeout_s: float = attrs.field(default=60.0, validator=_non_negative)
    # Who writes a frozen layer's L0 file (pageserver/storage/l0_worker.py, docs/ingest.md):
    # "process": a worker process, and the writer's roll hands the layer over and goes on
    # (the flush runs in the background on the other core); "inline": the flushing task
    # itself, the writer's roll waits for it. Layers below ``l0_writer_min_bytes`` are always
    # written inline (a hand-off costs a few ms: worth it for a rolled 256 MiB layer only).
    l0_writer: Literal["inline", "process"] = attrs.field(
        default="process", validator=attrs.validators.in_(("inline", "process"))
    )
    l0_writer_min_bytes: int = attrs.field(default=16 * MiB, validator=_non_negative)
