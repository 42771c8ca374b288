"""Fast tests of the ``pagestore`` CLI's control plane: no node is started here.

- ``init`` writes a cluster directory whose node configs the nodes' own loaders accept, on the
  default ports (shifted by ``--port-offset``) or on free ports;
- ``--help`` works for every command and group;
- ``status --json`` has its documented shape with every node down;
- user errors (no cluster directory, unknown branch, busy ports) end with exit code 1 and a
  message, never a traceback.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from control_plane import cli, process
from control_plane.local_env import LocalEnv, LocalEnvError, plan_ports
from pageserver.config import load_pageserver_config
from safekeeper.config import load_config as load_safekeeper_config

ROOT = Path(__file__).resolve().parents[2]


def pagestore(*args: str) -> int:
    return cli.main(list(args))


def test_init_writes_configs_the_nodes_accept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workdir = tmp_path / "cluster"
    # An offset far from the defaults, so a cluster running on this machine does not collide.
    assert pagestore("init", "--workdir", str(workdir), "--safekeepers", "2", "--port-offset", "1000", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pageserver"]["pg_port"] == 65000 and out["pageserver"]["http_port"] == 10898
    assert [(s["pg_port"], s["http_port"]) for s in out["safekeepers"]] == [(6454, 8676), (6455, 8677)]

    ps = load_pageserver_config(workdir / "pageserver" / "pageserver.toml")
    assert ps.listen_pg_addr == "127.0.0.1:65000"
    assert ps.listen_http_addr == "127.0.0.1:10898"
    assert ps.safekeepers == ("127.0.0.1:6454", "127.0.0.1:6455")
    assert ps.workdir == (workdir / "pageserver").absolute()
    for i, (pg, http) in enumerate([(6454, 8676), (6455, 8677)], start=1):
        sk = load_safekeeper_config(workdir / f"safekeeper_{i}" / "safekeeper.toml")
        assert (sk.id, sk.listen_pg, sk.listen_http) == (i, f"127.0.0.1:{pg}", f"127.0.0.1:{http}")
        assert Path(sk.data_dir).is_relative_to(workdir.absolute())

    env = LocalEnv.load(workdir)
    assert env.config.endpoint_base_port == 55431 + 1000
    assert env.default_tenant() is None
    # A second init must not overwrite a cluster.
    assert pagestore("init", "--workdir", str(workdir)) == 1
    assert "already a pagestore cluster directory" in capsys.readouterr().err


def test_default_ports_follow_the_architecture() -> None:
    cfg = plan_ports(3)
    assert (cfg.pageserver.pg, cfg.pageserver.http) == (64000, 9898)
    assert [(s.pg, s.http) for s in cfg.safekeepers] == [(5454, 7676), (5455, 7677), (5456, 7678)]
    assert cfg.endpoint_base_port == 55431
    with pytest.raises(LocalEnvError):
        plan_ports(0)
    with pytest.raises(LocalEnvError):
        plan_ports(1, port_offset=70000)


def test_free_ports_are_distinct_and_loadable(tmp_path: Path) -> None:
    assert pagestore("init", "--workdir", str(tmp_path / "c"), "--free-ports", "--no-sync") == 0
    env = LocalEnv.load(tmp_path / "c")
    ports = [env.config.pageserver.pg, env.config.pageserver.http,
             *(p for s in env.config.safekeepers for p in (s.pg, s.http))]
    assert len(set(ports)) == len(ports) == 8
    assert env.config.endpoint_base_port == 0
    ps, sks = env.check_node_configs()
    assert ps.safekeepers == tuple(f"127.0.0.1:{s.pg}" for s in env.config.safekeepers)
    assert all(sk.no_sync for sk in sks)


def test_init_refuses_busy_ports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    offset = 1200  # the pageserver's libpq port becomes 65200
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", 64000 + offset))
            s.listen()
        except OSError:
            pass  # somebody else holds it: just as busy
        assert pagestore("init", "--workdir", str(tmp_path / "c"), "--port-offset", str(offset)) == 1
    err = capsys.readouterr().err
    assert "65200" in err and "--free-ports" in err
    assert not (tmp_path / "c" / "pagestore.toml").exists()


def _all_command_paths() -> list[list[str]]:
    paths = [path.split(" ") for path in cli.COMMANDS]
    groups = sorted({p[0] for p in paths if len(p) > 1})
    return [[]] + [[g] for g in groups] + paths


@pytest.mark.parametrize("path", _all_command_paths(), ids=lambda p: " ".join(p) or "pagestore")
def test_help_everywhere(path: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        pagestore(*path, "--help")
    assert exc.value.code == 0
    assert "usage: pagestore" in capsys.readouterr().out


def test_help_as_a_process() -> None:
    proc = subprocess.run([sys.executable, "-m", "control_plane.cli", "demo", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "--stop" in proc.stdout


def test_status_json_shape_with_nodes_down(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workdir = tmp_path / "c"
    assert pagestore("init", "--workdir", str(workdir), "--free-ports", "--safekeepers", "3") == 0
    capsys.readouterr()
    assert pagestore("status", "--workdir", str(workdir), "--json") == 0
    st = json.loads(capsys.readouterr().out)
    assert set(st) == {"workdir", "nodes", "tenants", "timelines", "endpoints"}
    assert [n["name"] for n in st["nodes"]] == ["pageserver", "safekeeper_1", "safekeeper_2", "safekeeper_3"]
    for n in st["nodes"]:
        assert set(n) == {"name", "pid", "running", "pg_port", "http_port", "http_ok", "error"}
        assert n["running"] is False and n["pid"] is None
        assert isinstance(n["pg_port"], int) and isinstance(n["http_port"], int)
    assert st["timelines"] == [] and st["endpoints"] == [] and st["tenants"] == []
    # Human output too.
    assert pagestore("status", "--workdir", str(workdir)) == 0
    assert "down" in capsys.readouterr().out


def test_init_several_pageservers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--pageservers N``: pageserver_1..N, each with its ports, directory and config (node id,
    the controller's upcall API), and a storage controller node; it needs remote storage."""
    assert pagestore("init", "--workdir", str(tmp_path / "x"), "--free-ports", "--pageservers", "2") == 1
    assert "--remote-storage" in capsys.readouterr().err
    assert pagestore("init", "--workdir", str(tmp_path / "x"), "--free-ports", "--pageservers", "0") == 1
    capsys.readouterr()
    workdir = tmp_path / "c"
    assert pagestore("init", "--workdir", str(workdir), "--free-ports", "--pageservers", "3",
                     "--remote-storage", "local", "--json") == 0
    init = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in init["pageservers"]] == ["pageserver_1", "pageserver_2", "pageserver_3"]
    ports = [x for p in init["pageservers"] for x in (p["pg_port"], p["http_port"])]
    assert len(set(ports)) == 6
    from pageserver.config import load_pageserver_config

    for i, p in enumerate(init["pageservers"], 1):
        conf = load_pageserver_config(Path(p["config"]))
        assert conf.id == i and conf.workdir == workdir.absolute() / f"pageserver_{i}"
        assert conf.control_plane_api == f"{init['storage_controller']}/upcall/v1/"
    # Auth on the controller too (the default): its config checks tokens with the cluster's
    # key; each pageserver gets a generations_api token in its environment, the CLI an admin one.
    from common.auth import CONTROL_PLANE_TOKEN_ENV, TOKEN_ENV, JwtVerifier, Scope
    from common.config import load_config
    from control_plane import http_client
    from control_plane.cluster import _node_env
    from control_plane.storage_controller import StorageControllerConfig

    env = LocalEnv.load(workdir)
    sc = load_config(StorageControllerConfig, env.storage_controller_config_path)
    assert sc.http_auth_type == "NeonJWT" and sc.auth_validation_public_key_path == env.public_key_path
    verifier = JwtVerifier.from_key_path(env.public_key_path)
    node_env = _node_env(env, "pageserver_2")
    assert verifier.decode(node_env[CONTROL_PLANE_TOKEN_ENV]).scope is Scope.GENERATIONS_API
    assert verifier.decode(node_env[TOKEN_ENV]).scope is Scope.SAFEKEEPERDATA
    assert CONTROL_PLANE_TOKEN_ENV not in _node_env(env, "safekeeper_1")
    assert init["storage_controller"] is not None
    cli_token, _ = http_client._credentials_for(f"{init['storage_controller']}/control/v1/tenant")
    assert cli_token is not None and verifier.decode(cli_token).scope is Scope.ADMIN
    assert pagestore("init", "--workdir", str(tmp_path / "open"), "--free-ports", "--pageservers", "2",
                     "--remote-storage", "local", "--no-auth") == 0
    capsys.readouterr()
    open_env = LocalEnv.load(tmp_path / "open")
    assert load_config(StorageControllerConfig, open_env.storage_controller_config_path).http_auth_type == "Trust"
    assert _node_env(open_env, "pageserver_1") == {}
    # --tls: the controller speaks HTTPS with its own certificate, and the upcalls verify it.
    assert pagestore("init", "--workdir", str(tmp_path / "tls"), "--free-ports", "--pageservers", "2",
                     "--remote-storage", "local", "--tls") == 0
    capsys.readouterr()
    tls_env = LocalEnv.load(tmp_path / "tls")
    assert tls_env.storage_controller_url is not None and tls_env.storage_controller_url.startswith("https://")
    tls_sc = load_config(StorageControllerConfig, tls_env.storage_controller_config_path)
    assert tls_sc.ssl_cert_file is not None and tls_sc.ssl_cert_file.exists()
    assert tls_sc.security().ssl_context is not None
    tls_ps = load_pageserver_config(tls_env.pageserver_config_path_of(2))
    assert tls_ps.control_plane_api == f"{tls_env.storage_controller_url}/upcall/v1/"
    assert tls_ps.ssl_ca_path is not None and tls_ps.ssl_ca_path.exists()
    assert pagestore("status", "--workdir", str(workdir), "--json") == 0
    st = json.loads(capsys.readouterr().out)
    assert [n["name"] for n in st["nodes"]] == ["pageserver_1", "pageserver_2", "pageserver_3", "safekeeper_1",
                                                "safekeeper_2", "safekeeper_3", "storage_controller"]
    assert not any(n["running"] for n in st["nodes"])
    # migrating needs the cluster up; a bad pageserver name is a message
    assert pagestore("tenant", "migrate", "--to", "pageserver_9", "--workdir", str(workdir)) == 1
    assert capsys.readouterr().err.startswith("pagestore: error:")


def test_user_errors_are_messages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert pagestore("status", "--workdir", str(tmp_path / "nothing")) == 1
    assert "pagestore init" in capsys.readouterr().err
    workdir = tmp_path / "c"
    assert pagestore("init", "--workdir", str(workdir), "--free-ports") == 0
    capsys.readouterr()
    for args in (["tenant", "list"], ["timeline", "list"],
                 ["timeline", "branch", "--branch-name", "b"], ["endpoint", "start", "ep"]):
        assert pagestore(*args, "--workdir", str(workdir)) == 1, args
        err = capsys.readouterr().err
        assert err.startswith("pagestore: error:") and "Traceback" not in err, err
    assert pagestore("endpoint", "stop", "nope", "--workdir", str(workdir)) == 1
    assert "no endpoint 'nope'" in capsys.readouterr().err


def test_branch_names_are_kept_per_tenant(tmp_path: Path) -> None:
    env = LocalEnv.create(tmp_path / "c", plan_ports(1, free_ports=True))
    env.add_branch("a" * 32, "main", "1" * 32)
    env.add_branch("b" * 32, "main", "2" * 32)
    env.add_branch("a" * 32, "dev", "3" * 32)
    assert env.default_tenant() == "a" * 32
    assert env.timeline_of_branch("a" * 32, "dev") == "3" * 32
    assert env.timeline_of_branch("b" * 32, "main") == "2" * 32
    assert env.branch_of_timeline("a" * 32, "1" * 32) == "main"
    with pytest.raises(LocalEnvError, match="already exists"):
        env.add_branch("a" * 32, "dev", "4" * 32)
    with pytest.raises(LocalEnvError, match="no branch 'x'"):
        env.timeline_of_branch("a" * 32, "x")
    state = json.loads((tmp_path / "c" / "branches.json").read_text())
    assert state["branches"]["a" * 32] == {"main": "1" * 32, "dev": "3" * 32}
    # The cluster config is plain TOML.
    assert tomllib.loads((tmp_path / "c" / "pagestore.toml").read_text())["pageserver"]["pg"] > 0


def test_stale_pid_file_never_names_another_process(tmp_path: Path) -> None:
    """A pid file whose pid now belongs to a different process (same pid, other start time)
    is not "running": `stop` must not signal it."""
    pid_path = tmp_path / "pid"
    pid = process.spawn(["sleep", "30"], log_path=tmp_path / "log", pid_path=pid_path, cwd=tmp_path)
    try:
        assert process.running_pid(pid_path) == pid
        recorded_pid, started = pid_path.read_text().split()
        assert int(recorded_pid) == pid and int(started) == process.start_time(pid)
        # The same pid with another start time: what a reboot or pid wrap-around leaves behind.
        pid_path.write_text(f"{pid} {int(started) + 1}\n")
        assert process.running_pid(pid_path) is None
        assert process.read_pid(pid_path) == pid
        # An old-style pid file (pid only) still works.
        pid_path.write_text(f"{pid}\n")
        assert process.running_pid(pid_path) == pid
    finally:
        assert process.stop_pid(pid, timeout=5) in ("terminated", "killed")
    assert process.running_pid(pid_path) is None


def test_endpoint_remove_takes_a_stopped_endpoints_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``endpoint remove``: a stopped endpoint's directory and entry go; a live process of it
    (here its bridge's pid file naming this test's process) refuses the removal, and the
    deletions' hint names the command. (A running PostgreSQL: ``test_timeline_delete``.)"""
    import os

    import cattrs

    from control_plane.cmd_common import stale_endpoints_hint
    from control_plane.endpoint import EndpointSpec, endpoint_dir

    workdir = tmp_path / "c"
    env = LocalEnv.create(workdir, plan_ports(1, free_ports=True))
    for name in ("a", "b"):
        d = endpoint_dir(env, name)
        (d / "pgdata").mkdir(parents=True)
        (d / "pgdata" / "PG_VERSION").write_text("15\n")
        spec = EndpointSpec(name=name, tenant_id="a" * 32, timeline_id="1" * 32, branch="main", port=1,
                            basebackup_lsn="0/0", read_only=False)
        (d / "endpoint.json").write_text(json.dumps(cattrs.unstructure(spec)))
    (endpoint_dir(env, "b") / "bridge.pid").write_text(f"{os.getpid()}\n")
    wd = ["--workdir", str(workdir)]
    assert cli.main(["endpoint", "remove", *wd, "a"]) == 0
    assert capsys.readouterr().out.startswith("endpoint a removed")
    assert not endpoint_dir(env, "a").exists()
    assert cli.main(["endpoint", "remove", *wd, "b"]) == 1
    err = capsys.readouterr().err
    assert f"endpoint 'b' is running (its walproposer bridge (pid {os.getpid()}))" in err
    assert "`pagestore endpoint stop b` first" in err
    assert (endpoint_dir(env, "b") / "endpoint.json").exists()
    assert cli.main(["endpoint", "remove", *wd, "a"]) == 1
    assert "no endpoint 'a'" in capsys.readouterr().err
    assert cli.main(["endpoint", "remove", *wd, "../x"]) == 1
    assert "bad endpoint name" in capsys.readouterr().err
    assert stale_endpoints_hint([]) == ""
    assert "stopped endpoints d, e named it: `pagestore endpoint remove NAME`" in stale_endpoints_hint(["d", "e"])
