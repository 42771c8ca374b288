"""``pagestore stop``: stop endpoints, the pageserver and the safekeepers."""

from __future__ import annotations

import argparse

from control_plane import cluster
from control_plane.cmd_common import add_workdir, guarded, load_env


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir(parser)
    parser.add_argument("--immediate", action="store_true",
                        help="SIGKILL after 0.5 s instead of waiting for a clean shutdown")


@guarded
def run(args: argparse.Namespace) -> int:
    cluster.stop(load_env(args), immediate=args.immediate)
    return 0
