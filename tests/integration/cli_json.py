"""Running a ``pagestore`` CLI command in-process with ``--json`` and reading its answer: what
the cluster tests use to drive the control plane as a user would."""

from __future__ import annotations

import json
from typing import Any

import pytest

from control_plane import cli


def pagestore_json(capsys: pytest.CaptureFixture[str], *args: str) -> Any:
    """``pagestore ARGS --json``: asserts exit code 0 (stderr in the message) and parses stdout."""
    capsys.readouterr()
    rc = cli.main([*args, "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out)
