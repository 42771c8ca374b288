"""Deleting everything under a key prefix: a deleted timeline's or tenant's objects.

``delete_prefix(storage, prefix, first=...)`` lists ``prefix`` and deletes what it finds, the
keys ``first`` selects before the others (a pageserver timeline's ``index_part.json`` objects:
with the indexes gone first, a crash half-way leaves unnamed layers, which are leaks, never an
index that names a deleted layer). It lists again after deleting and repeats until the prefix
is empty, so an object a writer put meanwhile (a safekeeper's backup that had not stopped yet)
goes too. The prefix must end in ``/``: ``wal/<tenant>/<timeline>`` without it would also match
every timeline whose id starts with the same characters.

Listing and deleting retry with backoff a bounded number of times (``attempts``): the caller
(an HTTP request) reports the failure and can be repeated; what was deleted stays deleted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from remote_storage.base import RemoteStorage
from remote_storage.errors import RemoteStorageError
from remote_storage.retry import retry

DELETE_ATTEMPTS = 5
_MAX_PASSES = 10


def _keep_none(_key: str) -> bool:
    return False


async def delete_prefix(
    storage: RemoteStorage,
    prefix: str,
    *,
    first: Callable[[str], bool] = _keep_none,
    attempts: int = DELETE_ATTEMPTS,
) -> int:
    """Delete every object under ``prefix`` (``first`` ones before the rest); how many."""
    if not prefix.endswith("/") or prefix == "/":
        raise ValueError(f"a prefix to delete must name a directory (end in '/'), got {prefix!r}")
    deleted = 0
    for _ in range(_MAX_PASSES):
        listing = await retry(lambda: storage.list(prefix), what=f"list {prefix}", attempts=attempts)
        keys = [k for k in listing.keys if k.startswith(prefix)]
        if not keys:
            return deleted
        early = [k for k in keys if first(k)]
        late = [k for k in keys if not first(k)]
        for batch in (early, late):
            if batch:
                await retry(functools.partial(storage.delete_objects, batch),
                            what=f"delete {len(batch)} objects under {prefix}", attempts=attempts)
                deleted += len(batch)
    raise RemoteStorageError(f"objects keep appearing under {prefix} while it is deleted (a writer still running?)")
