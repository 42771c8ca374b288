"""``pagestore status``: every node (pid, ports), every timeline's LSNs, every endpoint."""

from __future__ import annotations

import argparse
from typing import Any

from control_plane import cluster
from control_plane.cmd_common import add_json, add_workdir, emit, guarded, load_env, table


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir(parser)
    add_json(parser)


def render(st: dict[str, Any]) -> str:
    out = [f"cluster {st['workdir']}", ""]
    out.append(table(
        [[n["name"], str(n["pid"] or "-"), "up" if n["http_ok"] else ("starting?" if n["running"] else "down"),
          str(n["pg_port"] or "-"), str(n["http_port"])] for n in st["nodes"]],
        ["node", "pid", "state", "libpq", "http"],
    ))
    if st.get("tenants"):
        out += ["", table([[t["tenant_id"], t["pageserver"], str(t["generation"] or "-")] for t in st["tenants"]],
                          ["tenant", "pageserver", "generation"])]
    if st["timelines"]:
        rows = []
        for t in st["timelines"]:
            commits = ", ".join(f"{k.removeprefix('safekeeper_')}:{v['commit_lsn']}"
                                for k, v in sorted(t["safekeepers"].items())) or "-"
            rows.append([t["branch"] or "-", t["timeline_id"][:12], t.get("pageserver") or "-",
                         str(t["last_record_lsn"]), str(t["disk_consistent_lsn"]),
                         str(t.get("remote_consistent_lsn")), commits, _backup_lsn(t["safekeepers"])])
        out += ["", table(rows, ["branch", "timeline", "pageserver", "last_record_lsn", "disk_consistent_lsn",
                                 "remote_consistent_lsn", "safekeeper commit_lsn", "wal backup_lsn"])]
    if st["endpoints"]:
        out += ["", table(
            [[e["name"], e["branch"] or "-", str(e["port"]), "running" if e["running"] else "stopped",
              "read-only@" + e["basebackup_lsn"] if e["read_only"] else "primary"] for e in st["endpoints"]],
            ["endpoint", "branch", "port", "state", "kind"],
        )]
    return "\n".join(out)


def _backup_lsn(safekeepers: dict[str, dict[str, Any]]) -> str:
    """The highest backup_lsn any safekeeper reports ("-" without WAL backup)."""
    from protocol.lsn import parse_lsn

    lsns = [v["backup_lsn"] for v in safekeepers.values() if v.get("backup_lsn")]
    return max(lsns, key=parse_lsn) if lsns else "-"


@guarded
def run(args: argparse.Namespace) -> int:
    st = cluster.status(load_env(args))
    emit(args, st, render)
    return 0
