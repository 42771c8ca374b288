"""``pagestore endpoint stop NAME``: stop its PostgreSQL, then its walproposer bridge."""

from __future__ import annotations

import argparse

from control_plane import endpoint
from control_plane.cmd_common import add_workdir, guarded, load_env


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir(parser)
    parser.add_argument("name", help="endpoint name")
    parser.add_argument("--mode", choices=["smart", "fast", "immediate"], default="fast",
                        help="pg_ctl stop mode (default fast)")


@guarded
def run(args: argparse.Namespace) -> int:
    endpoint.stop_endpoint(load_env(args), args.name, mode=args.mode)
    return 0
