"""``pagestore start``: start the cluster's pageserver and safekeepers in the background."""

from __future__ import annotations

import argparse

from control_plane import cluster
from control_plane.cmd_common import add_workdir, guarded, load_env


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    cluster.start(load_env(args))
    return 0
