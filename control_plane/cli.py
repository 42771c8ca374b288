"""The ``pagestore`` command line: one entry point, subcommands owned by their rooms.

Each subcommand lives in the module of the room that owns it and exposes two functions:
``configure(parser: argparse.ArgumentParser) -> None`` and ``run(args: argparse.Namespace) -> int``.
``COMMANDS`` maps a command path (``"waldump"``, ``"bench ingest"``) to ``"module"``. Modules
are imported only when their command runs or its help is asked for, so a slow import in one
room never slows another's command.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Protocol, cast

# command path -> (module, one-line help). Keep sorted by path.
COMMANDS: dict[str, tuple[str, str]] = {
    "bench bulk-ingest": ("bench.bulk_ingest", "bulk INSERT WAL: pageserver ingest time vs PostgreSQL crash recovery"),
    "bench compute": ("bench.compute", "lazy vs full endpoints vs plain PostgreSQL: start to first query, TPS, cold seq scan"),
    "bench getpage": ("bench.getpage", "GetPage@LSN pages/s and latency: serial vs pipelined, queue depth, vs PostgreSQL get_raw_page"),
    "bench getpage-pgbench": ("bench.getpage_pgbench", "the seed's getpage table: GetPage@latest over pgbench timelines (scale x tenants x cache x get_impl x impl)"),
    "bench ingest": ("bench.ingest", "bulk WAL ingest MB/s: io_engine x write buffer x double buffering x sync mode"),
    "bench native-kernels": ("bench.native_kernels", "each native (Cython) kernel beside its pure-Python twin: MiB/s of CPU, one run"),
    "bench read-path": ("bench.read_path", "get_vectored vs legacy gets: keys/s, preadv calls, deep L0 stack"),
    "bench redo": ("bench.redo", "pure-Python WAL redo: µs per record type; every page kind's rebuild time next to a btree page with as many records"),
    "bench remote": ("bench.remote", "remote storage on SeaweedFS: upload MB/s vs a boto3 loop, ingest with uploads on/off, attach + first read of 1 GB"),
    "bench wal-codec": ("bench.wal_codec", "WAL encoder and stream decoder throughput (MB/s, records/s)"),
    "bench walproposer": ("bench.walproposer", "synchronous commit through the walproposer bridge: bulk MB/s, pgbench TPS"),
    "bench wal-acceptor": ("bench.wal_acceptor", "safekeeper WAL ingest MiB/s: sizes x fsync x coalescing"),
    "demo": ("control_plane.cmd_demo", "the main job: cluster, pgbench, branch at an LSN, compare pages"),
    "endpoint list": ("control_plane.cmd_endpoint_list", "list endpoints"),
    "endpoint remove": ("control_plane.cmd_endpoint_remove", "remove a stopped endpoint's directory and its entry"),
    "endpoint start": ("control_plane.cmd_endpoint_start", "start a PostgreSQL 15 compute on a branch (or read-only at an LSN)"),
    "endpoint stop": ("control_plane.cmd_endpoint_stop", "stop an endpoint and its walproposer bridge"),
    "fuzz": ("bench.fuzz", "coverage-guided fuzzing of a native decoder against its pure-Python twin (atheris)"),
    "init": ("control_plane.cmd_init", "write a local cluster directory (pageservers, safekeepers, remote storage)"),
    "pagefs": ("compute.pagefs.main", "the page filesystem of a lazy endpoint (FUSE over the page service)"),
    "pageserver": ("pageserver.node", "run a pageserver node (pagestore pageserver -c FILE)"),
    "safekeeper": ("safekeeper.node", "run a safekeeper node (pagestore safekeeper -c FILE)"),
    "storage-controller": ("control_plane.storage_controller", "run the storage controller (tenant generations; pagestore storage-controller -c FILE)"),
    "start": ("control_plane.cmd_start", "start the cluster's storage nodes (pageservers, safekeepers, ...)"),
    "status": ("control_plane.cmd_status", "nodes, timelines with their LSNs, endpoints"),
    "stop": ("control_plane.cmd_stop", "stop endpoints, pageserver and safekeepers"),
    "tenant create": ("control_plane.cmd_tenant_create", "create a tenant; its first timeline is branch main"),
    "tenant delete": ("control_plane.cmd_tenant_delete", "delete a tenant everywhere, remote storage included"),
    "tenant list": ("control_plane.cmd_tenant_list", "list tenants"),
    "tenant migrate": ("control_plane.cmd_tenant_migrate", "move a tenant to another pageserver (new generation; endpoints follow)"),
    "timeline branch": ("control_plane.cmd_timeline_branch", "branch a timeline at an LSN"),
    "timeline delete": ("control_plane.cmd_timeline_delete", "delete a timeline everywhere, remote storage included"),
    "timeline import": ("control_plane.cmd_timeline_import", "import a PostgreSQL data directory or tar as a timeline"),
    "timeline list": ("control_plane.cmd_timeline_list", "list a tenant's timelines"),
    "waldump": ("control_plane.cmd_waldump", "print WAL records of segment files as JSON lines"),
    "token": ("control_plane.cmd_token", "print a JWT for a tenant (or a node-wide scope) signed with the cluster's key"),
    "verify oracle": ("bench.oracle", "every page and SLRU segment the pageserver serves vs PostgreSQL's files (masked)"),
    "verify regress-wal": ("bench.regress_index_wal", "PostgreSQL's regression suite on plain PostgreSQL, chosen rmgrs' records replayed offline vs their verification images"),
    "verify pg-regress": ("bench.pg_regress", "PostgreSQL's regression suite on an endpoint vs plain PostgreSQL, then every page vs the files"),
    "walproposer": ("compute.walproposer.main", "stream a vanilla PostgreSQL's WAL to a quorum of safekeepers"),
}

GROUP_HELP = {
    "bench": "benchmarks; each prints JSON lines",
    "tenant": "create, list, migrate and delete tenants",
    "timeline": "branch, list, import and delete timelines",
    "endpoint": "start, stop and remove PostgreSQL computes on pagestore",
    "verify": "correctness checks against PostgreSQL",
}


class CommandModule(Protocol):
    def configure(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _load(module: str) -> CommandModule:
    return cast(CommandModule, importlib.import_module(module))


class _VersionAction(argparse.Action):
    """``--version``: the package version and which kernels run (native or pure Python).

    Computed only when asked: it imports the kernels, whose ImportError (not built, stale,
    a bad PAGESTORE_PURE_PYTHON) is then the answer."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and the implementation, then exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from importlib.metadata import version

        from protocol import _native

        info = _native.describe()
        impl = "native (Cython)" if info["impl"] == "native" else "pure Python (PAGESTORE_PURE_PYTHON=1)"
        print(f"pagestore {version('pagestore')}: {impl} kernels, CRC-32C {info['crc32c']}")
        parser.exit()


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagestore", description="Disaggregated storage for PostgreSQL, on trio."
    )
    parser.add_argument("--version", action=_VersionAction)
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction[argparse.ArgumentParser]] = {}
    # Only the module of the command actually named on the command line is imported.
    wanted = " ".join(a for a in argv[:2] if not a.startswith("-"))
    for path, (module, help_text) in sorted(COMMANDS.items()):
        head, _, tail = path.partition(" ")
        if tail:
            if head not in groups:
                gp = top.add_parser(head, help=GROUP_HELP.get(head, head))
                groups[head] = gp.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
            sub = groups[head].add_parser(tail, help=help_text, description=help_text)
        else:
            sub = top.add_parser(path, help=help_text, description=help_text)
        sub.set_defaults(_module=module)
        if wanted == path or (not tail and argv[:1] == [path]):
            _load(module).configure(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_list)
    args = parser.parse_args(args_list)
    return _load(args._module).run(args)


if __name__ == "__main__":
    sys.exit(main())
