"""structlog setup for every node: JSON lines to a file, human lines to a terminal.

``setup_logging(log_file=..., level="info")`` configures structlog once per process:

- the processors merge ``structlog.contextvars`` (so ``conn_id``, ``peer``, ``tenant_id``,
  ``timeline_id`` bound by the connection loop appear on every line of that connection;
  trio copies context variables into tasks at ``start_soon``), add the level and an ISO
  timestamp (UTC), and render exceptions;
- with ``log_file`` each event is one JSON object per line appended to that file;
- without it, a TTY on stderr gets ``structlog.dev.ConsoleRenderer`` lines, anything else
  JSON lines on stderr (machine-readable when redirected).

Loggers: ``log = structlog.get_logger("pageserver.page_service")`` at module level;
``log.info("event name", key=value)``.
"""

from __future__ import annotations

import logging as stdlib_logging
import sys
from pathlib import Path
from typing import Any, TextIO

# structlog is imported by the functions below, not here: a config module that only needs
# LEVELS (the safekeeper's, which the CLI loads) does not pay for it.

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}

_open_files: list[TextIO] = []


def shared_processors() -> list[Any]:
    import structlog

    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]


def setup_logging(
    *, log_file: Path | None = None, level: str = "info", force_tty: bool | None = None
) -> None:
    """Configure structlog for this process (see the module docstring)."""
    import structlog

    if level not in LEVELS:
        raise ValueError(f"unknown log level {level!r}, expected one of {', '.join(LEVELS)}")
    for f in _open_files:
        f.close()
    _open_files.clear()
    stream: TextIO
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        stream = log_file.open("a", buffering=1, encoding="utf-8")  # line-buffered
        _open_files.append(stream)
        tty = False
    else:
        stream = sys.stderr
        tty = stream.isatty() if force_tty is None else force_tty
    renderer: Any
    if tty:
        processors = [*shared_processors(), structlog.dev.ConsoleRenderer()]
    else:
        renderer = structlog.processors.JSONRenderer()
        processors = [
            *shared_processors(),
            structlog.processors.dict_tracebacks,
            renderer,
        ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    # Libraries that use stdlib logging (none of ours) still reach the same stream.
    stdlib_logging.basicConfig(stream=stream, level=LEVELS[level], force=True)
