"""``pagestore demo``: the main job (see ``control_plane.demo`` for the steps)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from control_plane import cluster
from control_plane.cmd_common import USER_ERRORS, workdir_of
from control_plane.demo import DemoFailed, DemoOptions, result_json, run_demo
from control_plane.local_env import LocalEnv


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", "-D", type=Path, default=None,
                        help="cluster directory (default $PAGESTORE_WORKDIR or ./.pagestore); a previous "
                             "demo's directory there is stopped and replaced")
    parser.add_argument("--stop", action="store_true", help="stop the cluster at the end")
    parser.add_argument("--scale", type=int, default=5, help="pgbench scale factor (default 5)")
    parser.add_argument("--duration", type=int, default=20, help="seconds of pgbench (default 20)")
    parser.add_argument("--clients", type=int, default=4, help="pgbench clients (default 4)")
    parser.add_argument("--storage", choices=["lazy", "full"], default="lazy",
                        help="storage of the branch and read-only endpoints (default lazy; main is full: "
                             "the page check reads its files)")
    ports = parser.add_mutually_exclusive_group()
    ports.add_argument("--port-offset", type=int, default=0, help="add N to every default port")
    ports.add_argument("--free-ports", action="store_true", help="let the OS pick every port")
    parser.add_argument("--no-auth", action="store_true",
                        help="a trusting cluster (default: every port checks tokens)")
    parser.add_argument("--tls", action="store_true", help="TLS on every port (a local CA)")
    parser.add_argument("--json-result", type=Path, default=None,
                        help="also write every number the demo measured to this JSON file")


def run(args: argparse.Namespace) -> int:
    if args.duration < 2:
        print("pagestore demo: --duration must be at least 2 s", file=sys.stderr)
        return 2
    opts = DemoOptions(workdir=workdir_of(args), scale=args.scale, duration_s=args.duration,
                       clients=args.clients, port_offset=args.port_offset, free_ports=args.free_ports,
                       stop_at_end=args.stop, auth=not args.no_auth, tls=args.tls, storage=args.storage)
    console = Console()

    def on_failure(env: LocalEnv | None) -> None:
        if env is None:
            return
        console.print(f"[red]logs[/]: {env.workdir}/pageserver/pageserver.log, "
                      f"{env.workdir}/safekeeper_*/safekeeper.log, {env.workdir}/endpoints/*/pgdata/server.log, "
                      f"{env.workdir}/endpoints/*/bridge.log", highlight=False)
        if args.stop:
            cluster.stop(env, immediate=True, log=lambda _m: None)
        else:
            console.print(f"the cluster is left running for inspection; stop it with: "
                          f"pagestore stop --workdir {env.workdir}", highlight=False)

    try:
        result = run_demo(opts, console, on_failure)
    except DemoFailed as exc:
        console.print(f"[bold red]pagestore demo FAILED[/] at {exc}", highlight=False)
        return 1
    except USER_ERRORS as exc:
        console.print(f"[bold red]pagestore demo FAILED[/]: {exc}", highlight=False)
        return 1
    except KeyboardInterrupt:
        console.print("[bold red]pagestore demo interrupted[/]")
        return 130
    if args.json_result is not None:
        args.json_result.write_text(result_json(result) + "\n")
    console.print("[bold green]pagestore demo: every check passed[/]")
    return 0
