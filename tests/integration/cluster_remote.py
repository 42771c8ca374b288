"""The remote storage of a test cluster (``pagestore init --remote-storage local|seaweedfs``),
as its nodes see it: listing and deleting objects from a test, whatever the kind."""

from __future__ import annotations

import tomllib
from pathlib import Path

import tomli_w
import trio

from control_plane.local_env import LocalEnv
from pageserver import remote_layout
from pageserver.storage.index_part import IndexPart
from protocol.ids import TenantId, TimelineId
from remote_storage import (
    LocalStorageConfig,
    RemoteStorageConfig,
    S3StorageConfig,
    make_remote_storage,
)


def store_config(env: LocalEnv) -> RemoteStorageConfig:
    table = env.remote_storage_table()
    assert table is not None
    kind = table.pop("kind")
    if kind == "local":
        return LocalStorageConfig(path=Path(table["path"]))
    assert kind == "s3"
    return S3StorageConfig(**table)


def remote_keys(env: LocalEnv, prefix: str) -> list[str]:
    async def keys() -> list[str]:
        storage = make_remote_storage(store_config(env))
        try:
            return (await storage.list(prefix)).keys
        finally:
            await storage.aclose()

    return trio.run(keys)


def remote_object(env: LocalEnv, key: str) -> bytes:
    async def get() -> bytes:
        storage = make_remote_storage(store_config(env))
        try:
            return await storage.download(key)
        finally:
            await storage.aclose()

    return trio.run(get)


def check_newest_index(env: LocalEnv, tenant_id: str, timeline_id: str) -> IndexPart:
    """The timeline's newest remote index names only objects that exist (the invariant no
    deletion may break); returns it."""
    t, tl = TenantId.parse(tenant_id), TimelineId.parse(timeline_id)
    keys = set(remote_keys(env, remote_layout.timeline_prefix(t, tl)))
    gens = sorted(g for k in keys if (g := remote_layout.index_generation(k)) is not None)
    assert gens, f"no index for {timeline_id}"
    key = remote_layout.index_key(t, tl, gens[-1])
    part = IndexPart.from_json(Path(key), remote_object(env, key))
    for name in part.layers:
        layer = remote_layout.layer_key(t, tl, name, part.generations.get(name, gens[-1]))
        assert layer in keys, f"{key} names {layer}, which is not in remote storage"
    return part


def delete_remote(env: LocalEnv, prefix: str) -> int:
    """Delete every object under ``prefix``; how many there were."""
    async def delete() -> int:
        storage = make_remote_storage(store_config(env))
        try:
            keys = (await storage.list(prefix)).keys
            await storage.delete_objects(keys)
            return len(keys)
        finally:
            await storage.aclose()

    return trio.run(delete)


def quick_safekeepers(env: LocalEnv, kind: str) -> None:
    """WAL backup, removal and the peers' sharing every 0.2 s (quicker than the defaults, so
    a test does not wait for them)."""
    for sk_id in env.safekeeper_ids:
        path = env.safekeeper_config_path(sk_id)
        conf = tomllib.loads(path.read_text())
        assert conf["remote_storage"]["kind"] == ("local" if kind == "local" else "s3")
        assert conf["wal_backup_peers"] == env.safekeeper_ids
        conf.update(wal_removal_period_s=0.2, wal_backup_period_s=0.2, peer_sync_period_s=0.2)
        path.write_text(tomli_w.dumps(conf))
