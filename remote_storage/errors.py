"""The errors of remote storage: whose fault, and whether a retry may help."""

from __future__ import annotations


class RemoteStorageError(Exception):
    """A request to the object store failed. ``retryable``: the same request may succeed later
    (network, timeout, throttling, 5xx); not for a bad request or a missing object."""

    retryable = True


class RemoteNotFoundError(RemoteStorageError):
    """The object does not exist (S3 ``NoSuchKey`` / 404)."""

    retryable = False


class RemoteTimeoutError(RemoteStorageError):
    """The request did not finish within the configured timeout (its outcome is unknown)."""


class RemoteFatalError(RemoteStorageError):
    """A request the store refused for good (bad bucket name, access denied, ...)."""

    retryable = False
