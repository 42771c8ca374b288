"""The pageserver's persisted deletion queue: remote layer objects a timeline stopped naming,
written to local disk *before* the index that drops them is uploaded, deleted only after that
index is up and the generation is validated, and forgotten only after the DELETE succeeded.

A crash anywhere on that path neither leaks the objects nor deletes one a newer index names:

- crash before the index upload: the list is on disk, the remote's newest index still names
  its keys; recovery skips every key that index names (they stay, live);
- crash after the index upload, before or during the DELETE: recovery deletes them (DELETE is
  idempotent) once the generation is validated;
- crash after the DELETE, before the list is removed: recovery deletes them again (a no-op).

Recovery runs when the tenant is loaded again on this node (``pageserver.remote_tenant``). A
list written in generation ``g`` runs only if the tenant is now attached here in exactly
``g + 1``: the same disk held both generations, so no other attachment came in between (Neon's
rule, remote-storage.md §2.5); it is then validated again in the new generation. Any other
case (the tenant moved, or came back in a later generation) drops the list: its objects leak,
which is safe (a newer attachment may name them).

Files, in ``<workdir>/deletion/``: ``<sequence:016x>.list``, a JSON document
``{version, sequence, tenant_id, timeline_id, generation, keys}``, written to a temp file,
fsynced, renamed, the directory fsynced.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import attrs
import structlog
from prometheus_client import Counter

from common.fsync import fsync_dir
from protocol.ids import TenantId, TimelineId

log = structlog.get_logger("pageserver.deletion_queue")

VERSION = 1
SUFFIX = ".list"
_TEMP = ".___temp"

PERSISTED_LISTS = Counter("pageserver_deletion_lists_persisted", "deletion lists written to local disk")
RECOVERED_KEYS = Counter("pageserver_deletion_recovered_keys", "keys of recovered deletion lists executed")
DROPPED_LIST_KEYS = Counter(
    "pageserver_deletion_dropped_keys",
    "keys of deletion lists dropped (generation not the successor, or not valid: leaked, safe)",
)


class DeletionListError(Exception):
    """A deletion list on disk that cannot be read (it is left in place, named in the message)."""


@attrs.frozen
class DeletionList:
    sequence: int
    tenant_id: TenantId
    timeline_id: TimelineId
    generation: int
    keys: tuple[str, ...]
    path: Path

    def to_json(self) -> bytes:
        return json.dumps({
            "version": VERSION, "sequence": self.sequence, "tenant_id": self.tenant_id.hex,
            "timeline_id": self.timeline_id.hex, "generation": self.generation, "keys": list(self.keys),
        }).encode()

    @classmethod
    def from_file(cls, path: Path) -> DeletionList:
        try:
            doc = json.loads(path.read_bytes())
            if not isinstance(doc, dict) or doc.get("version") != VERSION:
                raise ValueError(f"version {doc.get('version') if isinstance(doc, dict) else None!r}")
            keys = doc["keys"]
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise ValueError("keys is not a list of strings")
            generation = doc["generation"]
            sequence = doc["sequence"]
            if not isinstance(generation, int) or not isinstance(sequence, int):
                raise ValueError("generation and sequence must be integers")
            return cls(sequence, TenantId.parse(doc["tenant_id"]), TimelineId.parse(doc["timeline_id"]),
                       generation, tuple(keys), path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DeletionListError(f"deletion list {path}: {exc}") from None


class DeletionQueue:
    """The lists of one pageserver (all its tenants). Methods do file IO: call them in a
    worker thread."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        for tmp in directory.glob("*" + _TEMP):
            tmp.unlink()  # a write a crash interrupted: its list was never durable
        self._next = 1 + max((s for p in self._files() if (s := _sequence(p)) is not None), default=0)

    def _files(self) -> list[Path]:
        return sorted(p for p in self.directory.iterdir() if p.name.endswith(SUFFIX))

    def persist(self, tenant_id: TenantId, timeline_id: TimelineId, generation: int,
                keys: Iterable[str]) -> DeletionList:
        """Durably record that ``keys`` are to be deleted once an index without them is up."""
        seq = self._next
        self._next += 1
        path = self.directory / f"{seq:016x}{SUFFIX}"
        dl = DeletionList(seq, tenant_id, timeline_id, generation, tuple(keys), path)
        tmp = path.with_name(path.name + _TEMP)
        with open(tmp, "wb") as f:
            f.write(dl.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
        fsync_dir(self.directory)
        PERSISTED_LISTS.inc()
        return dl

    def done(self, dl: DeletionList) -> None:
        """The list's DELETE succeeded (or it was dropped): forget it."""
        dl.path.unlink(missing_ok=True)
        fsync_dir(self.directory)

    def lists(self, tenant_id: TenantId | None = None) -> list[DeletionList]:
        """The lists on disk (of one tenant), in sequence order."""
        out = [DeletionList.from_file(p) for p in self._files()]
        return [dl for dl in out if tenant_id is None or dl.tenant_id == tenant_id]

    def drop_tenant(self, tenant_id: TenantId, why: str) -> int:
        """Forget every list of a tenant this node no longer holds (the objects leak)."""
        dropped = 0
        for dl in self.lists(tenant_id):
            DROPPED_LIST_KEYS.inc(len(dl.keys))
            log.warning("dropping a deletion list (objects leak)", tenant_id=tenant_id.hex,
                        timeline_id=dl.timeline_id.hex, generation=dl.generation, keys=len(dl.keys),
                        why=why)
            dl.path.unlink(missing_ok=True)
            dropped += 1
        if dropped:
            fsync_dir(self.directory)
        return dropped

    def drop_except(self, tenants: Iterable[TenantId]) -> int:
        """At start-up: forget the lists of tenants not attached here any more."""
        keep = set(tenants)
        gone = {dl.tenant_id for dl in self.lists()} - keep
        return sum(self.drop_tenant(t, "the tenant is not attached to this node") for t in gone)


def _sequence(path: Path) -> int | None:
    try:
        return int(path.name.removesuffix(SUFFIX), 16)
    except ValueError:
        return None
