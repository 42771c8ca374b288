"""Where a tenant's objects live in remote storage (Neon's layout, always with a generation).

    tenants/<tenant>/timelines/<timeline>/<layer file name>-<generation:08x>
    tenants/<tenant>/timelines/<timeline>/index_part.json-<generation:08x>

The generation goes at the end so that one listing of ``.../index_part.json`` finds every
generation's index. A layer's generation is the one of the attachment that wrote it; the index
names it (``IndexPart.generations``), so after a restart or a migration the layers of older
generations are still found.
"""

from __future__ import annotations

from protocol.ids import TenantId, TimelineId

INDEX_PART = "index_part.json"


def tenants_prefix() -> str:
    return "tenants/"


def tenant_prefix(tenant_id: TenantId) -> str:
    return f"tenants/{tenant_id.hex}/"


def timelines_prefix(tenant_id: TenantId) -> str:
    return f"tenants/{tenant_id.hex}/timelines/"


def timeline_prefix(tenant_id: TenantId, timeline_id: TimelineId) -> str:
    return f"tenants/{tenant_id.hex}/timelines/{timeline_id.hex}/"


def suffix(generation: int) -> str:
    if not 0 < generation < 1 << 32:
        raise ValueError(f"generation {generation} out of range")
    return f"-{generation:08x}"


def layer_key(tenant_id: TenantId, timeline_id: TimelineId, name: str, generation: int) -> str:
    return timeline_prefix(tenant_id, timeline_id) + name + suffix(generation)


def index_key(tenant_id: TenantId, timeline_id: TimelineId, generation: int) -> str:
    return timeline_prefix(tenant_id, timeline_id) + INDEX_PART + suffix(generation)


def index_generation(key: str) -> int | None:
    """The generation of an ``index_part.json-XXXXXXXX`` key, None for any other key."""
    name = key.rpartition("/")[2]
    head, sep, tail = name.rpartition("-")
    if head != INDEX_PART or not sep or len(tail) != 8:
        return None
    try:
        gen = int(tail, 16)
    except ValueError:
        return None
    return gen if gen > 0 else None
