"""``pagestore bench getpage``: GetPage@LSN throughput and latency through the page service.

Neon's pagebench semantics (storage.md §5.1): every client is its own libpq connection in a
pagestream, keys are uniform over the timeline's relation blocks, requests ask for the latest
version, latencies go into an HdrHistogram (µs, 3 significant digits). Extended with
``--queue-depth`` (requests in flight per client) as in pagebench's later versions.

One run builds a timeline per tenant through the storage engine (``--pages`` 8 KiB pages of
one relation, written at one LSN and flushed to layer files; 10 % of them rewritten at a later
LSN so reads walk two layers), then for every combination of ``--modes`` x ``--get-impl`` x
``--cache`` x ``--queue-depth`` starts a pageserver *process* (so the client does not share a
GIL with it), drives it for ``--duration`` seconds and prints one JSON line: request_count,
pages/s, latency mean and p50/p95/p99/p99.9/p99.99 (µs), and the batching factor from the
server's ``pageserver_page_service_batch_size`` histogram. ``--cache cold`` disables the
pageserver's page cache (the OS cache stays warm). ``--postgres`` adds the baseline a user
would pick today: PostgreSQL 15 serving the same number of 8 KiB pages with
``SELECT get_raw_page('t', blk)`` (pageinspect) through ``pgbench -M prepared`` at the same
client count. ``--floor`` adds FLOOR rows with the same clients against servers that only echo
a fixed page (``pageserver.page_service.null_server``: ``null-trio``, ``null-blocking``): the
ceiling of any trio / any Python server on this machine, printed beside the real rows. With
``--postgres`` every row carries ``vs_postgres`` (its pages/s over the round's PostgreSQL row).

Prints JSON lines. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import trio
import trio.testing

PAGES_DEFAULT = 10_000
REL = (1663, 5, 16384, 0)
BASE_LSN = 0x1000_0000
REWRITE_LSN = 0x2000_0000


# ---------------------------------------------------------------------------------------------
# Building the timelines (once per run)


def _page(blkno: int, version: int) -> bytes:
    head = blkno.to_bytes(4, "big") + version.to_bytes(4, "big")
    return (head * 1024)[:8192]


async def _build(workdir: Path, tenants: int, pages: int) -> list[tuple[str, str]]:
    from pageserver.pgdatadir import DatadirWriter
    from pageserver.storage.config import StorageConfig
    from pageserver.storage.value import Image
    from pageserver.tenant import Tenant
    from protocol.ids import TenantId, TimelineId
    from protocol.lsn import Lsn

    config = StorageConfig(validate_get=False, double_buffering=False)
    ids = []
    for _ in range(tenants):
        tenant_id, timeline_id = TenantId.generate(), TimelineId.generate()
        tenant = Tenant(workdir / tenant_id.hex, tenant_id, config)
        tl = await tenant.create_timeline(timeline_id)
        writer = DatadirWriter(tl)
        mod = writer.begin(Lsn(BASE_LSN))
        await mod.put_rel_creation(REL, pages)
        for blk in range(pages):
            await mod.put_rel_page(REL, blk, Image(_page(blk, 1)))
        await mod.commit()
        await tl.flush()
        mod = writer.begin(Lsn(REWRITE_LSN))
        for blk in range(0, pages, 10):
            await mod.put_rel_page(REL, blk, Image(_page(blk, 2)))
        await mod.commit()
        await tl.flush()
        await tl.shutdown()
        ids.append((tenant_id.hex, timeline_id.hex))
    return ids


# ---------------------------------------------------------------------------------------------
# The server process


async def _write_steadily(timelines: list[Any], writes_per_s: float, pages: int) -> None:
    """New versions of random pages at a steady rate: last_record_lsn keeps moving, so
    "latest" requests get a new effective LSN every write (what breaks uniform-lsn batches)."""
    from pageserver.pgdatadir import DatadirWriter
    from pageserver.storage.value import Image
    from protocol.lsn import Lsn

    rng = random.Random(7)
    writers = [DatadirWriter(tl) for tl in timelines]
    version = 3
    while True:
        await trio.sleep(1 / writes_per_s)
        version += 1
        for w in writers:
            mod = w.begin(Lsn(w.lsn + 8))
            blk = rng.randrange(pages)
            await mod.put_rel_page(REL, blk, Image(_page(blk, version)))
            await mod.commit()


class LoopCounter(trio.abc.Instrument):
    """Counts trio run-loop iterations (each one waits for IO once, with or without a
    timeout): the hand-offs between tasks a request costs show up here, free of the machine's
    noise. One hook call per iteration (well under a µs), nothing per task step."""

    def __init__(self) -> None:
        self.iterations = 0

    def before_io_wait(self, timeout: float) -> None:
        self.iterations += 1


async def _serve(workdir: Path, mode: str, get_impl: str, cache: str, writes_per_s: float,
                 security: str = "off") -> None:
    from prometheus_client import CollectorRegistry

    from common.logging import setup_logging
    from common.malloc_tuning import keep_freed_heap
    from common.pgserver import PgServer, PgServerConfig
    from pageserver.page_service.handler import PageServiceHandler
    from pageserver.page_service.metrics import PageServiceMetrics
    from pageserver.page_service.reader import NotFound, PageReader
    from pageserver.page_service.timeline_adapter import TimelinePageReader
    from pageserver.storage.config import StorageConfig
    from pageserver.tenant import Tenant
    from protocol.ids import TenantId, TimelineId

    # Log lines to stderr: stdout is the pipe the driver reads the port from, and reads only
    # twice; a connection's log lines there would fill it and stall the server.
    setup_logging(level="warning")
    keep_freed_heap()  # as the pageserver process does (pageserver/node.py)
    config = StorageConfig(
        validate_get=False,
        double_buffering=False,
        get_impl=get_impl,  # type: ignore[arg-type]
        page_cache_size=0 if cache == "cold" else 256 * 1024 * 1024,
    )
    readers: dict[tuple[TenantId, TimelineId], PageReader] = {}
    timelines = []
    for tdir in sorted(workdir.iterdir()):
        tenant = await Tenant.load(tdir, TenantId.parse(tdir.name), config)
        for tid, tl in tenant.timelines.items():
            readers[(tenant.tenant_id, tid)] = TimelinePageReader(tl)
            timelines.append(tl)

    class Lookup:
        def get_reader(self, tenant_id: TenantId, timeline_id: TimelineId) -> PageReader:
            try:
                return readers[(tenant_id, timeline_id)]
            except KeyError:
                raise NotFound(f"no timeline {tenant_id}/{timeline_id}") from None

    registry = CollectorRegistry()
    metrics = PageServiceMetrics.register(registry)
    loop = LoopCounter()
    trio.lowlevel.add_instrument(loop)
    handler = PageServiceHandler(Lookup(), _page_service_config(mode), metrics)
    if security == "auth+tls-whole":
        from common import tls_stream

        tls_stream.STREAM_PIECE = 1 << 62  # one encryption and one write per batch
    elif security == "auth+tls-thread64":
        from common import tls_stream

        tls_stream.OFFLOAD_PIECE = tls_stream.STREAM_PIECE  # the thread writes 64 KiB pieces
    elif security == "auth+tls-switch":
        sys.setswitchinterval(0.0005)  # as the safekeeper's gil_switch_interval_s
    elif security == "auth+tls-aes128":
        _check_prefers_aes128()  # OPENSSL_CONF in this process's environment (_measure)
    authenticator, ssl_context = _server_security(workdir.parent, security)
    server = PgServer(handler, PgServerConfig(port=0, idle_timeout_s=None,
                                              tls_sender_thread=_SENDER_THREAD.get(security, "auto")),
                      authenticator=authenticator, ssl_context=ssl_context)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)
        if writes_per_s > 0:
            pages = int(json.loads((workdir.parent / "pages.json").read_text()))
            nursery.start_soon(_write_steadily, timelines, writes_per_s, pages)
        # receiving signals before the driver learns the port: its first SIGUSR1 may follow
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1) as signals:
            print(json.dumps({"port": port}), flush=True)
            async for signum in signals:
                if signum != signal.SIGUSR1:
                    break
                print(json.dumps({"loop_iterations": loop.iterations}), flush=True)
        # The share of the pages served that the image kernel read (Timeline._read_images),
        # so that a row shows whether the fast path was in play at all.
        fast = sum(tl.image_fast_pages for tl in timelines)
        print(json.dumps({"batching_factor": metrics.batching_factor(),
                          "image_fast_pages": fast}), flush=True)
        server.shutdown()
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------------------------
# Auth and TLS (--security off,auth,auth+tls): keys, a CA and a token written once per run into
# the run's directory; the token goes to the client processes as a file (never on argv).

# auth+tls is the server's default TLS (PgServerConfig.tls_sender_thread="auto": encrypted on
# the event loop's thread, a batch's responses written in pieces as they are encrypted, and
# handed to the connection's sender thread only while the loop's thread waits for a CPU); to
# compare with it, auth+tls-inline never hands off, auth+tls-thread always does (writes of
# >= 32 KiB), and auth+tls-whole is inline with each batch's responses encrypted and written
# whole (tls_stream.STREAM_PIECE raised in the server process).
SECURITY_MODES = ("off", "auth", "auth+tls", "auth+tls-inline", "auth+tls-thread",
                  "auth+tls-thread64", "auth+tls-whole", "auth+tls-aes128", "auth+tls-switch")
_SENDER_THREAD: dict[str, bool] = {"auth+tls-inline": False, "auth+tls-thread": True,
                                   "auth+tls-thread64": True, "auth+tls-whole": False}
# auth+tls-aes128: the default (auto) with the server preferring TLS_AES_128_GCM_SHA256 (the
# server's preference decides, so every TLS 1.3 client gets it: RFC 8446 makes that suite
# mandatory). Python 3.11's ssl has no call that sets TLS 1.3 suites; OpenSSL applies its
# config's system_default section to every context, and the ssl module does not override the
# suites, so the server and client processes of this mode run with OPENSSL_CONF naming this
# file (what an operator would do, docs/auth.md), and the server checks it took.
AES128_CIPHERSUITES = "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256"
_AES128_CONF = f"""openssl_conf = pagestore_init
[pagestore_init]
ssl_conf = pagestore_ssl
[pagestore_ssl]
system_default = pagestore_tls
[pagestore_tls]
Ciphersuites = {AES128_CIPHERSUITES}
"""
_AES128_CONF_NAME = "openssl-aes128.cnf"


def _security_env(base: Path, security: str, env: dict[str, str]) -> dict[str, str]:
    """The environment of a row's server and client processes."""
    if security == "auth+tls-aes128":
        return {**env, "OPENSSL_CONF": str(base / _AES128_CONF_NAME)}
    return env


def _check_prefers_aes128() -> None:
    import ssl

    first = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).get_ciphers()[0]["name"]
    if first != "TLS_AES_128_GCM_SHA256":
        raise SystemExit(f"auth+tls-aes128: OpenSSL prefers {first} (is OPENSSL_CONF read?)")


def _write_security(base: Path, targets: list[tuple[str, str]]) -> None:
    from common.auth import Scope, encode_token, generate_keypair, load_private_key, write_secret
    from common.tls import make_local_ca, make_node_cert
    from protocol.ids import TenantId

    priv, _ = generate_keypair(base / "auth")
    key = load_private_key(priv)
    for tenant, _timeline in targets:
        token = encode_token(key, Scope.TENANT, TenantId.parse(tenant))
        write_secret(base / "auth" / f"token-{tenant}", token.encode())
    make_local_ca(base / "ca")
    make_node_cert(base / "ca", base / "node", "bench")
    (base / _AES128_CONF_NAME).write_text(_AES128_CONF)


def _server_security(base: Path, security: str) -> tuple[Any, Any]:
    if security == "off":
        return None, None
    from common.auth import JwtVerifier, Service
    from common.pgauth import JwtAuthenticator
    from common.tls import server_context

    auth = JwtAuthenticator(JwtVerifier.from_key_path(base / "auth" / "auth_public_key.pem"),
                            Service.PAGESERVER)
    ctx = server_context(base / "node" / "server.crt", base / "node" / "server.key") \
        if security.startswith("auth+tls") else None
    return auth, ctx


def _client_security(base: Path, security: str, tenant: str) -> dict[str, Any]:
    """``password`` / ``ssl_context`` keyword arguments of the page clients."""
    if security == "off":
        return {}
    from common.tls import client_context

    kw: dict[str, Any] = {"password": (base / "auth" / f"token-{tenant}").read_text()}
    if security.startswith("auth+tls"):
        kw["ssl_context"] = client_context(base / "ca" / "ca.crt")
    return kw


def _cipher_floor(
    base: Path, pages: int = 32, batches: int = 50, *, aes128_child: bool = False
) -> list[dict[str, Any]]:
    """TLS's floor in this process: CPU µs to encrypt and to decrypt one 8 KiB page (with its
    pagestream framing) in a batch of ``pages``, through memory BIOs as the page service and
    its client do, with the cipher the server picks (TLS 1.3), TLS 1.2's alternatives, and
    TLS 1.3's AES-128-GCM (in a child process with auth+tls-aes128's OPENSSL_CONF); best of
    5 rounds of ``batches`` batches."""
    import ssl

    from common.tls import client_context, handshake_in_memory, server_context

    suites: list[str | None] = [None, "ECDHE-ECDSA-AES128-GCM-SHA256",
                                "ECDHE-ECDSA-CHACHA20-POLY1305", "TLS_AES_128_GCM_SHA256"]
    rows: list[dict[str, Any]] = []
    data = bytes(pages * (8192 + 22))
    plain = bytearray(len(data))
    view = memoryview(plain)
    for suite in suites:
        if aes128_child and suite != "TLS_AES_128_GCM_SHA256":
            continue  # the child measures only its own row
        if suite == "TLS_AES_128_GCM_SHA256" and not aes128_child:
            child = subprocess.run(
                [sys.executable, "-m", "bench.getpage", "--cipher-floor-aes128", str(base)],
                check=True, capture_output=True, text=True, cwd=_REPO,
                env=_security_env(base, "auth+tls-aes128", dict(os.environ)),
            )
            rows.extend(json.loads(line) for line in child.stdout.splitlines() if line)
            continue
        if aes128_child:
            _check_prefers_aes128()
        sctx = server_context(base / "node" / "server.crt", base / "node" / "server.key")
        if suite is not None and suite.startswith("ECDHE"):
            sctx.maximum_version = ssl.TLSVersion.TLSv1_2
            sctx.set_ciphers(suite)
        server, client, bios = handshake_in_memory(sctx, client_context(base / "ca" / "ca.crt"))
        enc, dec = [], []
        for _ in range(5):
            e = d = 0.0
            for _ in range(batches):
                t0 = time.thread_time()
                server.write(data)
                wire = bios[1].read()
                t1 = time.thread_time()
                bios[2].write(wire)
                have = 0
                while have < len(data):
                    have += cast(int, client.read(len(data) - have, view[have:]))
                t2 = time.thread_time()
                e, d = e + t1 - t0, d + t2 - t1
            enc.append(e / (batches * pages) * 1e6)
            dec.append(d / (batches * pages) * 1e6)
        cipher = server.cipher()
        rows.append({
            "bench": "getpage",
            "tls_cipher_floor": True,
            "cipher": cipher[0] if cipher else None,
            "tls_version": server.version(),
            "encrypt_us_per_page": round(min(enc), 2),
            "decrypt_us_per_page": round(min(dec), 2),
        })
    return rows


def _connect_cost(port: int, base: Path, security: str, tenant: str, timeline: str,
                  n: int = 100) -> dict[str, float]:
    """Connection set-up: TCP connect, (TLS handshake,) startup, (token check,) pagestream
    open, close; ``n`` of them one after another; median and p95 in ms."""
    import statistics

    from compute.page_client import BlockingPageClient
    from protocol.ids import TenantId, TimelineId

    kw = _client_security(base, security, tenant)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        BlockingPageClient.connect("localhost" if "ssl_context" in kw else "127.0.0.1", port,
                                   TenantId.parse(tenant), TimelineId.parse(timeline), **kw).close()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return {"connect_ms_p50": round(statistics.median(times), 3),
            "connect_ms_p95": round(times[int(0.95 * (n - 1))], 3)}


def _page_service_config(mode: str) -> Any:
    """``serial``, ``pipelined-N`` (scattered-lsn) or ``pipelined-N-uniform``."""
    from pageserver.page_service.config import (
        PageServiceConfig,
        PipelinedPipelining,
        SerialPipelining,
    )

    if mode == "serial":
        return PageServiceConfig(page_service_pipelining=SerialPipelining())
    size, _, batching = mode.removeprefix("pipelined-").partition("-")
    lsn_rule: Literal["uniform-lsn", "scattered-lsn"] = (
        "uniform-lsn" if batching == "uniform" else "scattered-lsn"
    )
    return PageServiceConfig(page_service_pipelining=PipelinedPipelining(int(size), lsn_rule))


# ---------------------------------------------------------------------------------------------
# The client


async def _client_loop(
    port: int,
    tenant: str,
    timeline: str,
    pages: int,
    queue_depth: int,
    deadline: float,
    hist: Any,
    seed: int,
    base: Path | None = None,
    security: str = "off",
) -> int:
    from compute.page_client import PageClient
    from protocol.ids import TenantId, TimelineId
    from protocol.lsn import MAX_LSN, Lsn
    from protocol.pagestream import ErrorResponse, GetPageRequest, RelTag

    rel = RelTag(*REL)
    rng = random.Random(seed)
    sent_at: dict[int, float] = {}
    count = 0
    kw = {} if base is None else _client_security(base, security, tenant)
    client = await PageClient.connect(
        "localhost" if "ssl_context" in kw else "127.0.0.1", port, TenantId.parse(tenant),
        TimelineId.parse(timeline), **kw,
    )
    try:

        def new_request() -> GetPageRequest:
            reqid = client.next_reqid()
            sent_at[reqid] = time.perf_counter()
            return GetPageRequest(reqid, MAX_LSN, Lsn(0), rel, rng.randrange(pages))

        await client.send(*[new_request() for _ in range(queue_depth)])
        while True:
            response = await client.receive()
            if isinstance(response, ErrorResponse):
                raise RuntimeError(f"GetPage failed: {response.message}")
            now = time.perf_counter()
            hist.record_value(max(1, int((now - sent_at.pop(response.request.reqid)) * 1e6)))
            count += 1
            if now < deadline:
                await client.send(new_request())
            elif client.in_flight == 0:
                return count
    finally:
        await client.aclose()


async def _drive(
    port: int,
    targets: list[tuple[str, str]],
    clients: int,
    pages: int,
    queue_depth: int,
    duration: float,
    base: Path | None = None,
    security: str = "off",
) -> tuple[int, Any, float]:
    """All clients as trio tasks of this process (``--client trio``: the ``PageClient``)."""
    from hdrh.histogram import HdrHistogram

    hists = []
    counts: list[int] = []
    start = time.perf_counter()
    deadline = start + duration

    async def one(tenant: str, timeline: str, seed: int) -> None:
        hist = HdrHistogram(1, 60_000_000, 3)
        hists.append(hist)
        counts.append(
            await _client_loop(port, tenant, timeline, pages, queue_depth, deadline, hist, seed,
                               base, security)
        )

    async with trio.open_nursery() as nursery:
        for i, (tenant, timeline) in enumerate(targets):
            for c in range(clients):
                nursery.start_soon(one, tenant, timeline, i * 1000 + c)
    elapsed = time.perf_counter() - start
    total = hists[0]
    for h in hists[1:]:
        total.add(h)
    return sum(counts), total, elapsed


def _process_client(
    port: int,
    tenant: str,
    timeline: str,
    pages: int,
    queue_depth: int,
    start_at: float,
    duration: float,
    seed: int,
    base: str | None = None,
    security: str = "off",
) -> dict[str, Any]:
    """One client process (``--client process``): a ``BlockingPageClient`` in a closed loop.

    Starts at ``start_at`` (``time.monotonic``, shared by all processes on Linux) so every
    client measures the same window; returns ``closed_loop``'s summary.
    """
    from compute.page_client import BlockingPageClient
    from protocol._native import require
    from protocol.ids import TenantId, TimelineId

    # The closed loop is the load-generator kernel (native, or its twin under
    # PAGESTORE_PURE_PYTHON=1): recv_into, feed, sendall; no Python per request.
    loads = require("protocol._getpage_load_c")
    kw = {} if base is None else _client_security(Path(base), security, tenant)
    client = BlockingPageClient.connect(
        "localhost" if "ssl_context" in kw else "127.0.0.1", port, TenantId.parse(tenant),
        TimelineId.parse(timeline), **kw,
    )
    load = loads.GetPageLoad(REL, pages, seed, first_reqid=client.next_reqid())
    return closed_loop(client, load, queue_depth, duration, lambda: start_at)


def closed_loop(
    client: Any, load: Any, queue_depth: int, duration: float, window: Callable[[], float]
) -> dict[str, Any]:
    """A client process's measured window, shared by ``bench getpage`` and ``bench
    getpage-pgbench``: ``client`` (a connected ``BlockingPageClient``, closed here) driven by
    ``load`` (a ``GetPageLoad``) with ``queue_depth`` requests in flight for ``duration`` s,
    from the ``time.monotonic`` that ``window()`` returns (the same instant in every process
    on Linux). Returns count, CPU s, end time and the encoded latency histogram."""
    from collections import Counter

    from hdrh.histogram import HdrHistogram

    buf = bytearray(1 << 20)
    view = memoryview(buf)
    ns = time.perf_counter_ns
    with client:
        sock = client.sock
        time.sleep(max(0.0, window() - time.monotonic()))
        cpu0 = time.process_time()
        deadline = ns() + int(duration * 1e9)
        sock.sendall(load.requests(queue_depth, ns()))
        while load.in_flight:
            n = sock.recv_into(buf)
            if not n:
                raise RuntimeError("the server closed the connection")
            now = ns()
            out = load.feed(view[:n], now, now < deadline)
            if out:
                sock.sendall(out)
        cpu_s = time.process_time() - cpu0
    hist = HdrHistogram(1, 60_000_000, 3)
    for value, times in Counter(load.latencies_us()).items():
        hist.record_value(value, times)
    encoded = hist.encode()
    return {
        "count": load.count,
        "cpu_s": cpu_s,
        "ended": time.monotonic(),
        "hist": encoded.decode() if isinstance(encoded, bytes) else encoded,
    }


def _drive_processes(
    port: int,
    targets: list[tuple[str, str]],
    clients: int,
    pages: int,
    queue_depth: int,
    duration: float,
    base: Path | None = None,
    security: str = "off",
    env: dict[str, str] | None = None,
    on_start: Callable[[], None] | None = None,
) -> tuple[int, Any, float, float]:
    """Client processes; ``on_start`` is called when the measured window opens (every client
    connected: TLS handshakes, token checks and their lazy imports are behind it)."""

    # Far enough ahead for every process to start and connect before the window opens.
    start_at = time.monotonic() + 2.0 + 0.2 * clients * len(targets)
    procs = []
    for i, (tenant, timeline) in enumerate(targets):
        for c in range(clients):
            argv = [port, tenant, timeline, pages, queue_depth, start_at, duration, i * 1000 + c,
                    None if base is None else str(base), security]
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "bench.getpage", "--client-process", json.dumps(argv)],
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=_REPO,
                    env=env,
                )
            )
    if on_start is not None:
        time.sleep(max(0.0, start_at - time.monotonic()))
        on_start()
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=duration + 60)
        if proc.returncode != 0:
            raise RuntimeError(f"a benchmark client process failed (exit {proc.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return merge_client_results(results, start_at)


def merge_client_results(
    results: list[dict[str, Any]], start_at: float
) -> tuple[int, Any, float, float]:
    """``closed_loop`` summaries of the client processes of one window (opened at
    ``start_at``) as count, merged histogram, window s (to the last client's end), CPU s."""
    from hdrh.histogram import HdrHistogram

    total = HdrHistogram(1, 60_000_000, 3)
    count, end, cpu_s = 0, start_at, 0.0
    for got in results:
        count += got["count"]
        cpu_s += got["cpu_s"]
        end = max(end, got["ended"])
        total.add(HdrHistogram.decode(got["hist"]))
    return count, total, end - start_at, cpu_s


def _read_json(stream: Any, key: str) -> dict[str, Any]:
    """The server's next JSON line carrying ``key`` (its log lines share stdout)."""
    while line := stream.readline():
        if line.startswith("{") and key in line:
            return dict(json.loads(line))
    raise RuntimeError(f"benchmark server exited before reporting {key!r}")


def _run_config(
    workdir: Path,
    targets: list[tuple[str, str]],
    args: argparse.Namespace,
    mode: str,
    get_impl: str,
    cache: str,
    qd: int,
    security: str = "off",
) -> dict[str, Any]:
    serve = ["--serve", str(workdir), mode, get_impl, cache, str(args.writes_per_s), security]
    count, hist, elapsed, server_cpu_s, server = _measure(serve, "batching_factor", targets, args, qd,
                                                          security)
    return {
        "bench": "getpage",
        "target": "pagestore",
        "impl": args.kernels,
        "security": security,
        "mode": mode,
        "get_impl": get_impl,
        "cache": cache,
        "client": args.client,
        "tenants": args.tenants,
        "clients_per_tenant": args.clients,
        "queue_depth": qd,
        "writes_per_s": args.writes_per_s,
        "pages": args.pages,
        **_measured_fields(count, hist, elapsed, server_cpu_s),
        "batching_factor": round(server["batching_factor"], 2),
        "image_fast_share": round(server.get("image_fast_pages", 0) / count, 3) if count else 0.0,
        **{k: v for k, v in server.items()
           if k.startswith(("connect_ms", "client_cpu", "server_loop"))},
    }


def _run_floor(
    kind: str, targets: list[tuple[str, str]], args: argparse.Namespace, qd: int
) -> dict[str, Any]:
    """One FLOOR row: the same clients against a null server (``null-trio`` or
    ``null-blocking``, see ``pageserver.page_service.null_server``) in its own process."""
    count, hist, elapsed, server_cpu_s, final = _measure(
        ["--null-serve", kind], "stopped", targets, args, qd
    )
    return {
        "bench": "getpage",
        "target": kind,
        "impl": args.kernels,
        "floor": True,
        "client": args.client,
        "tenants": args.tenants,
        "clients_per_tenant": args.clients,
        "queue_depth": qd,
        **_measured_fields(count, hist, elapsed, server_cpu_s),
        **{k: v for k, v in final.items() if k.startswith("client_cpu")},
    }


def _measured_fields(
    count: int, hist: Any, elapsed: float, server_cpu_s: tuple[float, float]
) -> dict[str, Any]:
    user_s, sys_s = server_cpu_s
    return {
        "duration_s": round(elapsed, 2),
        "request_count": count,
        "pages_per_s": round(count / elapsed),
        "latency_mean_us": round(hist.get_mean_value(), 1),
        **{f"latency_p{p}_us": hist.get_value_at_percentile(p) for p in (50, 95, 99, 99.9, 99.99)},
        # The server is idle while the clients start, so this is (almost) all serving.
        "server_cpu_us_per_request": round((user_s + sys_s) / count * 1e6, 1) if count else None,
        # of which in the kernel (socket calls, preadv): what no Python-side change removes
        "server_sys_us_per_request": round(sys_s / count * 1e6, 1) if count else None,
    }


def _measure(
    serve_argv: list[str],
    final_key: str,
    targets: list[tuple[str, str]],
    args: argparse.Namespace,
    qd: int,
    security: str = "off",
) -> tuple[int, Any, float, tuple[float, float], dict[str, Any]]:
    """Start a server process (``bench.getpage`` + ``serve_argv``; it prints its port as a
    JSON line, and a line with ``final_key`` when SIGTERM stops it), drive it with the
    configured clients; return count, histogram, elapsed s, server CPU s, the final line.
    Server and client processes run the kernels ``args.kernels`` names (``python``: with
    PAGESTORE_PURE_PYTHON=1)."""
    env = _kernel_env(args.kernels)
    if serve_argv[0] == "--serve":
        env = _security_env(Path(serve_argv[1]).parent, security, env)
    tree = getattr(args, "tree_path", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.getpage", *serve_argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        # a --server-rev tree: ``-m`` puts the working directory first on sys.path, ahead of
        # the editable install's finder, so the server imports that tree's modules
        cwd=tree if tree is not None else _REPO,
        env=env,
    )
    try:
        assert proc.stdout is not None
        port = _read_json(proc.stdout, "port")["port"]
        base = Path(serve_argv[1]).parent if serve_argv[0] == "--serve" else None

        def loop_iterations() -> int | None:
            # only the page service counts them (SIGUSR1 would end a null server)
            if base is None:
                return None
            proc.send_signal(signal.SIGUSR1)
            assert proc.stdout is not None
            return int(_read_json(proc.stdout, "loop_iterations")["loop_iterations"])

        cpu_before = _process_cpu_s(proc.pid)
        # The server's main thread (its event loop) apart: TLS's sender threads are the rest.
        loop_before = _process_cpu_s(proc.pid, proc.pid)
        loops_before = loop_iterations()

        def window_opens() -> None:
            # steady state only: connection set-up is connect_ms_p50/p95's
            nonlocal cpu_before, loop_before, loops_before
            cpu_before = _process_cpu_s(proc.pid)
            loop_before = _process_cpu_s(proc.pid, proc.pid)
            loops_before = loop_iterations()

        if args.client == "trio":
            cpu0 = time.process_time()
            count, hist, elapsed = trio.run(
                _drive, port, targets, args.clients, args.pages, qd, args.duration, base, security
            )
            client_cpu_s = time.process_time() - cpu0
        else:
            count, hist, elapsed, client_cpu_s = _drive_processes(
                port, targets, args.clients, args.pages, qd, args.duration, base, security, env,
                window_opens,
            )
        cpu_after = _process_cpu_s(proc.pid)
        loop_after = _process_cpu_s(proc.pid, proc.pid)
        loops_after = loop_iterations()
        server_cpu_s = (cpu_after[0] - cpu_before[0], cpu_after[1] - cpu_before[1])
        loop_cpu_s = sum(loop_after) - sum(loop_before)
        cost = {} if base is None else _connect_cost(port, base, security, *targets[0])
        proc.send_signal(signal.SIGTERM)
        final = {**_read_json(proc.stdout, final_key), **cost}
        if count:
            # The load generator's own CPU: it must stay well below the server's for the rows
            # to measure the server (PostgreSQL's is pgbench, in C).
            final["client_cpu_us_per_request"] = round(client_cpu_s / count * 1e6, 1)
            # of server_cpu_us_per_request, the event loop's thread (the rest: other threads)
            final["server_loop_cpu_us_per_request"] = round(loop_cpu_s / count * 1e6, 1)
            if loops_after is not None and loops_before is not None:
                # hand-offs per request: serial mode and the pipeline's fast lane need ~1
                # (less when the next request is already there), a hand-off adds one
                final["server_loop_iterations_per_request"] = round(
                    (loops_after - loops_before) / count, 2
                )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    return count, hist, elapsed, server_cpu_s, final


KERNELS = ("native", "python")
_REPO = Path(__file__).resolve().parent.parent


def _export_rev(rev: str, dest: Path) -> tuple[str, Path]:
    """``--server-rev``: ``rev`` exported into ``dest`` (git archive), this checkout's compiled
    modules copied in, checked to load there (their sources must hash the same). Returns
    (label, tree)."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(_REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"--server-rev: {rev!r} is not a commit: {exc.stderr.strip()}") from None
    tree = dest / sha[:12]
    tree.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(_REPO), "archive", sha], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    from protocol._native_sources import NATIVE_MODULES

    for name in NATIVE_MODULES:  # (the compiled modules, not a walk of .venv and .cache)
        module = _REPO / name.replace(".", "/")
        for so in module.parent.glob(module.name + "*.so"):
            rel = so.relative_to(_REPO)
            if (tree / rel).parent.is_dir():
                shutil.copy2(so, tree / rel)
    check = subprocess.run(
        [sys.executable, "-c", "from protocol import _native; _native.describe()"],
        cwd=tree, env=_kernel_env("native"), capture_output=True, text=True,
    )
    if check.returncode != 0:
        last = (check.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(
            f"--server-rev {rev}: this checkout's compiled modules do not fit {sha[:12]} ({last}); "
            "only revisions whose native sources equal this checkout's can be compared this way"
        )
    return f"{rev}={sha[:12]}", tree


def _kernel_env(kernels: str) -> dict[str, str]:
    """The environment of a bench process running the ``kernels`` implementation."""
    from protocol._native import ENV_VAR

    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    if kernels == "python":
        env[ENV_VAR] = "1"
    elif kernels != "native":
        raise SystemExit(f"--impl: unknown {kernels!r}; use {', '.join(KERNELS)}")
    return env


def _null_serve(kind: str) -> None:
    """``--null-serve trio|blocking``: a null server on a free port until SIGTERM."""
    import threading

    from pageserver.page_service import null_server

    sock = null_server.listen()
    if kind == "null-trio":

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                port = await nursery.start(null_server.serve_trio, sock)
                print(json.dumps({"port": port}), flush=True)
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for _ in signals:
                        break
                nursery.cancel_scope.cancel()

        trio.run(main)
    elif kind == "null-blocking":
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        print(json.dumps({"port": sock.getsockname()[1]}), flush=True)
        null_server.serve_blocking(sock, stop=stop)
    else:
        raise SystemExit(f"unknown null server {kind!r}")
    print(json.dumps({"stopped": kind}), flush=True)


def _process_cpu_s(pid: int, tid: int | None = None) -> tuple[float, float]:
    """(utime, stime) of process ``pid`` in seconds (``/proc/<pid>/stat``, Linux); of its
    thread ``tid`` only if given (``/proc/<pid>/task/<tid>/stat``)."""
    stat = Path(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces
    return int(fields[11]) / _CLOCK_TICKS, int(fields[12]) / _CLOCK_TICKS


_CLOCK_TICKS: float = float(os.sysconf("SC_CLK_TCK"))


# ---------------------------------------------------------------------------------------------
# The PostgreSQL baseline


def _postgres_baseline(args: argparse.Namespace, clients: int) -> dict[str, Any]:
    from compute.postgres import (
        PostgresInstance,
        chown_to_postgres,
        make_postgres_dir,
        postgres_tmpdir,
    )

    with postgres_tmpdir("pagestore-bench-pg-") as base:
        pg = PostgresInstance.create(
            make_postgres_dir(base / "data"),
            {
                "shared_buffers": "256MB",
                "fsync": "off",
                "synchronous_commit": "off",
                "autovacuum": "off",
            },
        )
        try:
            pg.start()
            pg.psql("CREATE EXTENSION pageinspect")
            pg.psql("CREATE TABLE t (data char(1000)) WITH (fillfactor = 10)")
            pg.psql(f"INSERT INTO t SELECT 'x' FROM generate_series(1, {args.pages})")
            pages = int(pg.psql("SELECT pg_relation_size('t') / 8192"))
            script = base / "getpage.sql"
            script.write_text(f"\\set blk random(0, {pages - 1})\nSELECT get_raw_page('t', :blk);\n")
            chown_to_postgres(script)
            # the first run warms the caches; the second is measured (with per-statement latency)
            run = ("-n", "-M", "prepared", "-c", str(clients), "-j", str(clients), "-f", str(script))
            pg.pgbench(*run, "-T", "2")
            out = pg.pgbench(*run, "-T", str(int(args.duration)), "-r")
        finally:
            pg.destroy()
    tps = re.search(r"tps = ([0-9.]+)", out)
    lat = re.search(r"latency average = ([0-9.]+) ms", out)
    txns = re.search(r"number of transactions actually processed: (\d+)", out)
    return {
        "bench": "getpage",
        "target": "postgres15-get_raw_page",
        "clients": clients,
        "pages": pages,
        "duration_s": args.duration,
        "request_count": int(txns.group(1)) if txns else None,
        "pages_per_s": round(float(tps.group(1))) if tps else None,
        "latency_mean_us": round(float(lat.group(1)) * 1000, 1) if lat else None,
    }


# ---------------------------------------------------------------------------------------------
# CLI


# ---------------------------------------------------------------------------------------------
# In-process: the page service's own cost and trio's floor (``--in-process``)


def _cpu_s() -> float:
    return time.process_time()


async def _trio_floor(n: int) -> dict[str, Any]:
    """CPU µs of one trio run-loop iteration and of one park + wake between two tasks."""
    c0 = _cpu_s()
    for _ in range(n):
        await trio.lowlevel.checkpoint()
    iteration = (_cpu_s() - c0) / n * 1e6
    ping, pong = trio.lowlevel.ParkingLot(), trio.lowlevel.ParkingLot()

    async def echo() -> None:
        for _ in range(n):
            await pong.park()
            ping.unpark()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo)
        await trio.testing.wait_all_tasks_blocked()
        c0 = _cpu_s()
        for _ in range(n):
            pong.unpark()
            await ping.park()
        hop = (_cpu_s() - c0) / (2 * n) * 1e6
    return {
        "bench": "getpage",
        "target": "trio-floor",
        "run_loop_iteration_cpu_us": round(iteration, 2),
        "park_and_wake_cpu_us": round(hop, 2),
    }


async def _in_process(mode: str, queue_depth: int, requests: int, reps: int) -> dict[str, Any]:
    """``serve_pagestream`` on one end of a socketpair, a client task on the other, one process.

    The timeline answers every read with the same page from memory, so this is the page
    service (decode, pipeline, execution, framing, metrics, socket calls) plus trio, with no
    storage engine and no second process to compete with. The client task's own cost (a few
    µs per request, the same for every mode) is included. The minimum over ``reps`` repeats
    is the least disturbed by the rest of the machine.
    """
    import socket

    from prometheus_client import CollectorRegistry

    from pageserver.page_service.metrics import PageServiceMetrics
    from pageserver.page_service.pipeline import PagestreamContext, serve_pagestream_bytes
    from pageserver.page_service.reader import PageRead, PageRequestError, SingleTimeline
    from protocol.lsn import MAX_LSN, Lsn
    from protocol.pagestream import GetPageRequest, RelTag, encode_request_into

    page = _page(7, 1)

    class StaticReader:
        last_record_lsn = Lsn(BASE_LSN)
        gc_cutoff_lsn = Lsn(0)

        async def wait_lsn(self, lsn: Lsn, timeout_s: float) -> None:
            return None

        async def get_pages(self, reads: Sequence[PageRead]) -> list[bytes | PageRequestError]:
            return [page] * len(reads)

        async def get_page(self, read: PageRead) -> bytes | PageRequestError:
            return page

        async def wait_shutdown(self) -> None:
            await trio.sleep_forever()

    reader = StaticReader()
    ctx = PagestreamContext(
        3,
        SingleTimeline(reader),  # type: ignore[arg-type]
        _page_service_config(mode),
        PageServiceMetrics.register(CollectorRegistry()),
        shutdown=reader.wait_shutdown,
    )
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    server = trio.SocketStream(trio.socket.from_stdlib_socket(theirs))
    burst = bytearray()
    for i in range(queue_depth):
        request = GetPageRequest(i, MAX_LSN, Lsn(0), RelTag(*REL), i)
        encode_request_into(burst, request, 3, framed=True)
    fd = ours.fileno()
    response_bytes = 5 + 8234  # CopyData header + v3 GetPage response
    cpu: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_pagestream_bytes, server, ctx)
        rounds = max(1, requests // queue_depth)
        for _ in range(reps):
            c0 = _cpu_s()
            for _ in range(rounds):
                os.write(fd, burst)
                want = response_bytes * queue_depth
                while want:
                    try:
                        want -= len(os.read(fd, want))
                    except BlockingIOError:
                        await trio.lowlevel.wait_readable(ours)
            cpu.append((_cpu_s() - c0) / (rounds * queue_depth) * 1e6)
        nursery.cancel_scope.cancel()
    ours.close()
    cpu.sort()
    return {
        "bench": "getpage",
        "target": "in-process",
        "mode": mode,
        "queue_depth": queue_depth,
        "requests": max(1, requests // queue_depth) * queue_depth,
        "repeats": reps,
        "cpu_us_per_request_min": round(cpu[0], 1),
        "cpu_us_per_request_median": round(cpu[len(cpu) // 2], 1),
    }


def _run_in_process(args: argparse.Namespace) -> int:
    """``--in-process``: the trio floor, then every mode x queue depth, rounds outermost."""
    print(json.dumps(trio.run(_trio_floor, 100_000)), flush=True)
    for _ in range(args.rounds):
        for mode in args.modes.split(","):
            for qd in (int(q) for q in args.queue_depth.split(",")):
                row = trio.run(_in_process, mode, qd, 2048, 7)
                print(json.dumps(row), flush=True)
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per configuration")
    parser.add_argument("--tenants", type=int, default=1)
    parser.add_argument(
        "--clients", default="1", help="comma list of connections per tenant (e.g. 1,4)"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="measure every configuration this many times"
    )
    parser.add_argument("--plot", default=None, help="write a latency/throughput PNG here")
    parser.add_argument(
        "--queue-depth", default="1,32", help="comma list of requests in flight per client"
    )
    parser.add_argument(
        "--pages", type=int, default=PAGES_DEFAULT, help="relation blocks per timeline"
    )
    parser.add_argument(
        "--modes",
        default="serial,pipelined-1,pipelined-32",
        help="comma list: serial, pipelined-N (max_batch_size N, scattered-lsn), "
        "pipelined-N-uniform (uniform-lsn); empty for none (e.g. only --floor rows)",
    )
    parser.add_argument("--get-impl", default="vectored", help="comma list: vectored, legacy")
    parser.add_argument("--cache", default="hot", help="comma list: hot, cold (no page cache)")
    parser.add_argument(
        "--postgres", action="store_true", help="also run the PostgreSQL 15 baseline"
    )
    parser.add_argument(
        "--client",
        choices=("process", "trio"),
        default="process",
        help="process: one process per client with a BlockingPageClient (default); "
        "trio: every client a trio task of the driver process with the async PageClient",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="instead of the above: trio's run-loop iteration and park/wake cost, then the "
        "page service's CPU per request per --modes x --queue-depth with an in-memory page "
        "and an in-process client over a socketpair (no storage, no second process)",
    )
    parser.add_argument(
        "--floor",
        nargs="?",
        const="null-trio,null-blocking",
        default="",
        help="also run FLOOR rows with the same clients against null servers that answer "
        "every GetPage with a fixed page (no storage, metrics or pipeline): null-trio (a trio "
        "server: the ceiling of any trio page service), null-blocking (a thread per "
        "connection: of any Python server); without a value both",
    )
    parser.add_argument(
        "--security",
        default="off",
        help="comma list: off, auth (a tenant JWT checked at connection start), auth+tls (and "
        "TLS, verified, as the server does it by default: encrypted on the event loop's thread, "
        "a batch's responses written piece by piece, handed to a sender thread only while the "
        "loop's thread waits for a CPU), auth+tls-inline (never handed off), auth+tls-thread "
        "(large writes always encrypted in the connection's sender thread), auth+tls-thread64 "
        "(the thread, writing 64 KiB pieces), auth+tls-whole (inline, each batch's responses "
        "encrypted and written whole), auth+tls-aes128 (the default with the server preferring "
        "TLS_AES_128_GCM_SHA256); each configuration is "
        "run once per "
        "security mode, side by side, and "
        "its row carries connect_ms_p50/p95 (connection set-up, 100 in a row)",
    )
    parser.add_argument(
        "--impl",
        default="native",
        help="comma list: native (the compiled kernels), python (the pure-Python twins, "
        "PAGESTORE_PURE_PYTHON=1); server and client processes of a row run the same; "
        "every configuration is run once per implementation, side by side",
    )
    parser.add_argument(
        "--server-rev",
        default="",
        help="comma list of git revisions: every configuration also runs with its server from "
        "that revision (exported with git archive, this checkout's compiled modules copied in: "
        "only revisions with the same native sources), beside this checkout's; rows carry "
        "'tree'. Clients always run this checkout's load generator. Before/after in one run",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="alternate the order of the configurations round by round (forward, then "
        "reversed: A B, B A, ...) so drifting load hits each alike, and print 'paired' lines: "
        "per round, every configuration's latency, server CPU and pages/s over the first "
        "configuration's (median, min, max, the rounds, the load); use with --rounds >= 4",
    )
    parser.add_argument(
        "--writes-per-s",
        type=float,
        default=0.0,
        help="new page versions per second per timeline while reading (0: a static timeline)",
    )


_MEDIAN_FIELDS = (
    "pages_per_s",
    "latency_mean_us",
    "latency_p50_us",
    "latency_p95_us",
    "latency_p99_us",
    "latency_p99.9_us",
    "batching_factor",
    "server_cpu_us_per_request",
    "server_sys_us_per_request",
    "client_cpu_us_per_request",
    "server_loop_iterations_per_request",
    "vs_postgres",
    "connect_ms_p50",
    "connect_ms_p95",
)


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    import statistics

    out = {k: v for k, v in rows[0].items()
           if k not in _MEDIAN_FIELDS and k not in ("round", "load_1m")}
    out["summary"] = f"median of {len(rows)} rounds"
    out["load_1m_rounds"] = [r.get("load_1m") for r in rows]
    for field in _MEDIAN_FIELDS:
        values = [r[field] for r in rows if r.get(field) is not None]
        if values:
            out[field] = round(statistics.median(values), 2)
    out["pages_per_s_rounds"] = [r["pages_per_s"] for r in rows]
    return out


_PAIRED_FIELDS = ("latency_mean_us", "latency_p50_us", "server_cpu_us_per_request", "pages_per_s")
_KEY_NAMES = ("clients", "get_impl", "cache", "mode", "queue_depth", "security", "impl", "tree")


def _paired(rows: _Rows, order: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """``--interleave``'s summary: for every (clients, queue depth), each configuration against
    the first one run there, round by round (both measured in the same round, next to each
    other): the ratio of each of ``_PAIRED_FIELDS``, its median, min and max over the rounds."""
    import statistics

    out: list[dict[str, Any]] = []
    baselines: dict[tuple[Any, Any], tuple[Any, ...]] = {}
    for key in order:
        group = (key[0], key[4])
        base_key = baselines.setdefault(group, key)
        if base_key == key:
            continue
        base_by_round = {r["round"]: r for r in rows[base_key]}
        pairs = [(r, base_by_round[r["round"]]) for r in rows[key] if r["round"] in base_by_round]
        if not pairs:
            continue
        differs = {n: ("worktree" if a is None else a, "worktree" if b is None else b)
                   for n, a, b in zip(_KEY_NAMES, key, base_key, strict=True) if a != b}
        line: dict[str, Any] = {
            "bench": "getpage",
            "paired": " vs ".join(
                "/".join(str(v[i]) for v in differs.values()) for i in (0, 1)
            ),
            "clients": key[0],
            "queue_depth": key[4],
            "rounds": len(pairs),
            "load_1m": [r.get("load_1m") for r, _ in pairs],
        }
        for field in _PAIRED_FIELDS:
            ratios = [round(r[field] / b[field], 3) for r, b in pairs
                      if r.get(field) and b.get(field)]
            if ratios:
                line[f"{field}_ratio"] = {
                    "median": round(statistics.median(ratios), 3),
                    "min": min(ratios),
                    "max": max(ratios),
                    "rounds": ratios,
                }
        out.append(line)
    return out


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    """Mean/p50/p99 latency per configuration at queue depth 1 and pages/s at every queue
    depth, one column per client count, PostgreSQL and the FLOOR rows as reference lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = [r for r in rows if r["target"] == "pagestore"]
    pg = {r["clients"]: r for r in rows if r["target"].startswith("postgres")}
    client_counts = sorted({r["clients_per_tenant"] * r["tenants"] for r in ours})
    fig, axes = plt.subplots(
        2, len(client_counts), figsize=(7 * len(client_counts), 9), squeeze=False
    )
    for col, clients in enumerate(client_counts):
        mine = [r for r in ours if r["clients_per_tenant"] * r["tenants"] == clients]
        qd1 = [r for r in mine if r["queue_depth"] == 1]
        labels = [f"{r['mode']} {r.get('impl', '')}\n{r['get_impl']}/{r['cache']}" for r in qd1]
        x = range(len(qd1))
        ax = axes[0][col]
        width = 0.27
        for i, (field, name) in enumerate(
            (("latency_mean_us", "mean"), ("latency_p50_us", "p50"), ("latency_p99_us", "p99"))
        ):
            ax.bar([xi + (i - 1) * width for xi in x], [r[field] for r in qd1], width, label=name)
        if clients in pg and pg[clients].get("latency_mean_us"):
            ax.axhline(pg[clients]["latency_mean_us"], color="k", ls="--", label="PostgreSQL mean")
        ax.set_xticks(list(x), labels, fontsize=7, rotation=30)
        ax.set_ylabel("latency, µs (queue depth 1)")
        ax.set_yscale("log")
        ax.set_title(f"{clients} client(s): GetPage latency at queue depth 1")
        ax.legend(fontsize=8)
        ax = axes[1][col]
        labels = [
            f"{r['mode']} QD{r['queue_depth']} {r.get('impl', '')} {r['get_impl']}/{r['cache']}"
            f" ({r['server_cpu_us_per_request']} µs CPU/page)"
            for r in mine
        ]
        ax.barh(range(len(mine)), [r["pages_per_s"] for r in mine], color="tab:blue")
        if clients in pg and pg[clients].get("pages_per_s"):
            ax.axvline(pg[clients]["pages_per_s"], color="k", ls="--", label="PostgreSQL")
        styles = iter(("tab:green", "tab:red", "tab:purple", "tab:olive"))
        floors = [
            r for r in rows if r.get("floor") and r["clients_per_tenant"] * r["tenants"] == clients
        ]
        for floor in floors:
            ax.axvline(
                floor["pages_per_s"],
                color=next(styles, "tab:gray"),
                ls=":",
                label=f"FLOOR {floor['target']} QD{floor['queue_depth']}",
            )
        ax.legend(fontsize=7)
        ax.set_yticks(range(len(mine)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("pages/s")
        ax.set_title(f"{clients} client(s): throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


_Rows = dict[tuple[Any, ...], list[dict[str, Any]]]


def _emit(
    ctx: tuple[_Rows, int, float | None], row: dict[str, Any], key: tuple[Any, ...]
) -> None:
    """Print ``row`` with its round and its ratio to the round's PostgreSQL row; keep it."""
    rows, round_no, pg_pages_per_s = ctx
    row["round"] = round_no
    row["load_1m"] = round(os.getloadavg()[0], 2)
    if pg_pages_per_s:
        row["vs_postgres"] = round(row["pages_per_s"] / pg_pages_per_s, 2)
    print(json.dumps(row), flush=True)
    rows.setdefault(key, []).append(row)


def run(args: argparse.Namespace) -> int:
    if args.in_process:
        return _run_in_process(args)
    base = Path(tempfile.mkdtemp(prefix="pagestore-bench-getpage-"))
    workdir = base / "tenants"
    workdir.mkdir()
    (base / "pages.json").write_text(json.dumps(args.pages))
    client_counts = [int(c) for c in str(args.clients).split(",")]
    rows: _Rows = {}
    try:
        t0 = time.perf_counter()
        targets = trio.run(_build, workdir, args.tenants, args.pages)
        securities = [s for s in args.security.split(",") if s]
        if unknown_sec := set(securities) - set(SECURITY_MODES):
            raise SystemExit(f"--security: unknown {sorted(unknown_sec)}; use {', '.join(SECURITY_MODES)}")
        if securities != ["off"]:
            _write_security(base, targets)
        print(
            json.dumps(
                {
                    "bench": "getpage",
                    "setup": "timelines built",
                    "tenants": args.tenants,
                    "pages": args.pages,
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            ),
            flush=True,
        )
        if any(s.startswith("auth+tls") for s in securities):
            for line in _cipher_floor(base):
                print(json.dumps(line), flush=True)
        # Rounds outermost: every configuration is measured once per round, so a burst of
        # load from elsewhere on the machine hits all of them alike; medians are printed last.
        modes = [m for m in args.modes.split(",") if m]
        floors = [f for f in (args.floor or "").split(",") if f]
        if unknown := set(floors) - {"null-trio", "null-blocking"}:
            raise SystemExit(f"--floor: unknown {sorted(unknown)}; use null-trio, null-blocking")
        queue_depths = [int(q) for q in args.queue_depth.split(",")]
        impls = [k for k in args.impl.split(",") if k]
        for kernels in impls:
            _kernel_env(kernels)  # an unknown name fails before anything runs
        trees: list[tuple[str | None, Path | None]] = [(None, None)]
        for rev in [r for r in args.server_rev.split(",") if r]:
            exported = _export_rev(rev, base / "trees")
            trees.append(exported)
            print(json.dumps({"bench": "getpage", "setup": "server tree", "tree": exported[0]}),
                  flush=True)
        order: list[tuple[Any, ...]] = []  # configuration keys in first-run order
        for round_no in range(args.rounds):
            for clients in client_counts:
                config_args = argparse.Namespace(**{**vars(args), "clients": clients})
                # PostgreSQL first, so every row of this round can carry its ratio to it.
                pg_pages_per_s = None
                if args.postgres:
                    row = _postgres_baseline(args, clients * args.tenants)
                    row["round"] = round_no
                    pg_pages_per_s = row["pages_per_s"]
                    print(json.dumps(row), flush=True)
                    rows.setdefault(("postgres", clients), []).append(row)
                ctx = (rows, round_no, pg_pages_per_s)
                # Rotated per round: no security mode always runs first.
                shift = round_no % len(securities)
                configs = [
                    (get_impl, cache, mode, qd, security, kernels, tree)
                    for get_impl in args.get_impl.split(",")
                    for cache in args.cache.split(",")
                    for mode in modes
                    for qd in queue_depths
                    for security in securities[shift:] + securities[:shift]
                    for kernels in impls
                    for tree in trees
                ]
                if args.interleave and round_no % 2:
                    configs.reverse()  # A B, B A, A B, ...: drift hits every configuration alike
                for get_impl, cache, mode, qd, security, kernels, (label, path) in configs:
                    row = _run_config(
                        workdir, targets,
                        argparse.Namespace(**{**vars(config_args), "kernels": kernels,
                                              "tree_path": path}),
                        mode, get_impl, cache, qd, security,
                    )
                    if label is not None:
                        row["tree"] = label
                    key = (clients, get_impl, cache, mode, qd, security, kernels, label)
                    if key not in order:
                        order.append(key)
                    _emit(ctx, row, key)
                # The null servers use no kernels; their clients run the first --impl's.
                floor_args = argparse.Namespace(**{**vars(config_args), "kernels": impls[0]})
                for kind in floors:
                    for qd in queue_depths:
                        _emit(ctx, _run_floor(kind, targets, floor_args, qd), (clients, kind, qd))
        summary = [_median_row(r) for r in rows.values()]
        if args.rounds > 1:
            for row in summary:
                print(json.dumps(row), flush=True)
        if args.interleave:
            for line in _paired(rows, order):
                print(json.dumps(line), flush=True)
        if args.plot:
            _plot(summary, args.plot)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--client-process":
        print(json.dumps(_process_client(*json.loads(sys.argv[2]))), flush=True)
    elif len(sys.argv) == 3 and sys.argv[1] == "--cipher-floor-aes128":
        for line in _cipher_floor(Path(sys.argv[2]), aes128_child=True):
            print(json.dumps(line), flush=True)
    elif len(sys.argv) == 3 and sys.argv[1] == "--null-serve":
        _null_serve(sys.argv[2])
    elif len(sys.argv) == 8 and sys.argv[1] == "--serve":
        trio.run(
            _serve, Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], float(sys.argv[6]),
            sys.argv[7],
        )
    else:
        raise SystemExit("usage: pagestore bench getpage [options]")
