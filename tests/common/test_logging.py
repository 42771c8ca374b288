"""Logging setup: JSON lines with bound context to a file; console lines on a TTY."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from common.logging import setup_logging


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def test_json_lines_with_context(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "node.log"
    setup_logging(log_file=path, level="info")
    log = structlog.get_logger("test")
    with structlog.contextvars.bound_contextvars(conn_id=3, tenant_id="ab"):
        log.info("hello", n=1)
        log.debug("hidden")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    log.warning("outside")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["event"] for e in lines] == ["hello", "failed", "outside"]
    assert lines[0]["conn_id"] == 3 and lines[0]["tenant_id"] == "ab" and lines[0]["n"] == 1
    assert lines[0]["level"] == "info" and lines[0]["timestamp"].endswith("Z")
    assert "conn_id" not in lines[2]
    assert "boom" in json.dumps(lines[1]["exception"])


def test_console_renderer_on_tty(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(level="debug", force_tty=True)
    structlog.get_logger("test").debug("pretty", key="v")
    err = capsys.readouterr().err
    assert "pretty" in err and "key" in err and not err.lstrip().startswith("{")


def test_bad_level() -> None:
    with pytest.raises(ValueError, match="unknown log level"):
        setup_logging(level="loud")
