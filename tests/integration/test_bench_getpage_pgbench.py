"""``pagestore bench getpage-pgbench``, small: a pgbench database at scale 1 loaded through a
real cluster, its tenant duplicated, the copies serving the template's pages byte for byte,
then one hot row (vectored, native, 1 tenant) and one cold row (legacy, pure Python, 2 tenants)
measured by real pageserver processes with the load generator over every relation block."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import getpage_pgbench as bench
from compute.page_client import BlockingPageClient
from protocol.ids import TenantId, TimelineId
from protocol.pagestream import RelTag

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.native]


def _args(**kw: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    args = parser.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_the_small_pgbench_table_end_to_end(pg_tmp_path: Path) -> None:
    args = _args(duration=1.0, warmup=0.3, update_rounds=1, update_transactions=20)
    wd = pg_tmp_path / "scale1"
    template = bench.load_template(wd, 1, args, safekeepers=1)
    # every fork of every relation of every database: at least the whole pgbench database
    assert sum(template["sizes"]) * 8192 >= template["db_bytes"]
    assert len(template["rels"]) == len(set(template["rels"])) > 100  # the catalogs too
    keyspace = wd / "keyspace.json"
    keyspace.write_text(json.dumps({"rels": template["rels"], "sizes": template["sizes"]}))
    tenants = bench.duplicate_tenant(wd / "pageserver" / "tenants", template["tenant"], 1)
    assert len(set(tenants)) == 2

    # the copy is a tenant of its own that serves the template's pages
    largest = max(range(len(template["sizes"])), key=template["sizes"].__getitem__)
    rel = RelTag(*template["rels"][largest])
    pages: list[list[bytes]] = []

    def read_both(port: int) -> None:
        for tenant in tenants:
            with BlockingPageClient.connect("127.0.0.1", port, TenantId.parse(tenant),
                                            TimelineId.parse(template["timeline"])) as client:
                pages.append([client.get_page(rel, b) for b in (0, template["sizes"][largest] - 1)])

    rows = [
        bench.run_row(wd, template, tenants, keyspace, args, scale=1, tenants=1, clients=1,
                      get_impl="vectored", cache="hot", kernels="native", round_no=0,
                      probe=read_both),
        bench.run_row(wd, template, tenants, keyspace, args, scale=1, tenants=2, clients=1,
                      get_impl="legacy", cache="cold", kernels="python", round_no=0),
    ]
    assert len(pages) == 2 and pages[0] == pages[1] and any(pages[0][0])
    for row in rows:
        assert row["request_count"] > 50, row
        assert 0 < row["latency_p50_us"] <= row["latency_p95_us"] <= row["latency_p99_us"]
        assert row["latency_p99_us"] <= row["latency_p99.9_us"] <= row["latency_p99.99_us"]
        assert row["server_cpu_us_per_request"] > 0 and row["client_cpu_us_per_request"] > 0
    assert rows[1]["os_cache_dropped_bytes"] > 0
    summary = bench.summarize(rows)
    assert {(r["cache"], r["impl"], r["tenants"]) for r in summary} == {("hot", "native", 1),
                                                                       ("cold", "python", 2)}
    bench.plot(summary, wd / "plot.png")
    assert (wd / "plot.png").stat().st_size > 10_000
