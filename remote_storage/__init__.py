"""Object storage, the durable tier: one small interface over a local directory or S3.

``RemoteStorage`` (``remote_storage.base``) is what the pageserver and the safekeepers use:
``upload`` / ``upload_file`` (whole objects, exact length), ``download`` (optionally a byte
range), ``list`` (prefix, optional ``/`` delimiter), ``delete`` / ``delete_objects`` (missing
keys are not an error). Backends: ``LocalStorage`` (a directory; the embedded default) and
``S3Storage`` (boto3 in worker threads). ``make_remote_storage(config)`` picks one from the
``remote_storage`` config table (``remote_storage.config``). Retries with backoff are the
caller's choice (``remote_storage.retry``): the backends try each request once, with a timeout.
"""

from __future__ import annotations

from remote_storage.base import Listing, RemoteStorage
from remote_storage.config import (
    LocalStorageConfig,
    RemoteStorageConfig,
    S3StorageConfig,
    register_hooks,
)
from remote_storage.errors import RemoteNotFoundError, RemoteStorageError, RemoteTimeoutError


def make_remote_storage(config: RemoteStorageConfig) -> RemoteStorage:
    if isinstance(config, LocalStorageConfig):
        from remote_storage.local import LocalStorage

        return LocalStorage(config)
    from remote_storage.s3 import S3Storage

    return S3Storage(config)


__all__ = [
    "Listing",
    "LocalStorageConfig",
    "RemoteNotFoundError",
    "RemoteStorage",
    "RemoteStorageConfig",
    "RemoteStorageError",
    "RemoteTimeoutError",
    "S3StorageConfig",
    "make_remote_storage",
    "register_hooks",
]
