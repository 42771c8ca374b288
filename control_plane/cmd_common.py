"""What every control-plane command shares: ``--workdir``, ``--json`` and error reporting.

A command's ``run`` goes through ``guarded``: the errors a user can act on (a missing cluster
directory, a node that is down, an endpoint that did not start) end the command with exit code
1 and one clear message on stderr instead of a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.config import ConfigError
from control_plane.cluster import ClusterError
from control_plane.endpoint import EndpointError
from control_plane.http_client import ApiError
from control_plane.local_env import LocalEnv, LocalEnvError, default_workdir
from control_plane.process import ProcessError

USER_ERRORS = (LocalEnvError, ClusterError, EndpointError, ProcessError, ConfigError, ApiError)


def add_workdir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workdir", "-D", type=Path, default=None,
        help="cluster directory (default $PAGESTORE_WORKDIR or ./.pagestore)",
    )


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def add_tenant(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenant-id", default=None, help="tenant (default: the cluster's default tenant)")


def workdir_of(args: argparse.Namespace) -> Path:
    return args.workdir if args.workdir is not None else default_workdir()


def load_env(args: argparse.Namespace) -> LocalEnv:
    return LocalEnv.load(workdir_of(args))


def emit(args: argparse.Namespace, data: Any, human: Callable[[Any], str]) -> None:
    if getattr(args, "json", False):
        print(json.dumps(data, indent=2))
    else:
        print(human(data))


def add_one_name(parser: argparse.ArgumentParser, dest: str, help: str) -> None:
    """The arguments of a command about one named thing: ``--workdir``, the name, ``--json``."""
    add_workdir(parser)
    parser.add_argument(dest, help=help)
    add_json(parser)


def report(args: argparse.Namespace, action: Callable[[LocalEnv], Any], human: Callable[[Any], str]) -> int:
    """``action`` on the cluster of ``--workdir``, its answer printed (as JSON with ``--json``)."""
    emit(args, action(load_env(args)), human)
    return 0


def guarded(body: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return body(args)
        except USER_ERRORS as exc:
            print(f"pagestore: error: {exc}", file=sys.stderr)
            return 1

    return run


def stale_endpoints_hint(names: list[str]) -> str:
    """What to do about the stopped endpoints a deletion left (empty: none)."""
    if not names:
        return ""
    return (f"; stopped endpoints {', '.join(names)} named it: `pagestore endpoint remove NAME` "
            "removes each")


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in [header, *rows]]
    return "\n".join(lines)
