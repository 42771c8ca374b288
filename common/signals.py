"""Graceful stop on SIGTERM / SIGINT, shared by the node processes."""

from __future__ import annotations

import signal
from collections.abc import Callable

import structlog
import trio

log = structlog.get_logger(__name__)


async def stop_on_signal(stop: Callable[[], None]) -> None:
    """Wait for the first SIGTERM or SIGINT, log it, call ``stop()`` and return."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("signal received, stopping", signal=signal.Signals(signum).name)
            stop()
            return
