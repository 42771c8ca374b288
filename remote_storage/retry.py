"""Retrying remote operations with capped exponential backoff.

``retry(op, what=..., attempts=None)`` calls ``op`` until it returns; a ``RemoteStorageError``
that is ``retryable`` (and an ``OSError``) is retried, anything else propagates at once.
``attempts=None`` retries forever (uploads and deletions: they must happen eventually; the
queue behind them waits); a number bounds it (downloads a reader waits for). The first retry is
immediate, then the delay grows by ``factor`` up to ``max_delay_s`` (Neon's: 1.1^n s, ≤ 3 s
for uploads). Failures log at info for the first three attempts, then at warning.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog
import trio

from remote_storage.errors import RemoteStorageError

log = structlog.get_logger("remote_storage")

T = TypeVar("T")


def backoff_delay(attempt: int, *, base_s: float = 0.1, factor: float = 2.0, max_delay_s: float = 3.0) -> float:
    """Seconds to wait before retry number ``attempt`` (1 = the first retry: immediate)."""
    if attempt <= 1:
        return 0.0
    return float(min(max_delay_s, base_s * factor ** (attempt - 2)))


async def retry(
    op: Callable[[], Awaitable[T]],
    *,
    what: str,
    attempts: int | None = None,
    base_s: float = 0.1,
    max_delay_s: float = 3.0,
) -> T:
    attempt = 0
    while True:
        try:
            return await op()
        except (RemoteStorageError, OSError) as exc:
            if isinstance(exc, RemoteStorageError) and not exc.retryable:
                raise
            attempt += 1
            if attempts is not None and attempt >= attempts:
                raise
            level = log.info if attempt <= 3 else log.warning
            level("remote operation failed, retrying", op=what, attempt=attempt, error=str(exc))
            await trio.sleep(backoff_delay(attempt, base_s=base_s, max_delay_s=max_delay_s))
