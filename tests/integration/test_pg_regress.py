"""PostgreSQL's own regression suite as the test of ingest and redo (issue 16).

``bench.pg_regress`` does the work (``pagestore verify pg-regress`` runs the same): the whole
``parallel_schedule`` of the installed postgresql-15's source (``scripts/setup-pg-regress``)
against a lazy pagestore endpoint (the default storage: its relation files are its page
filesystem over the page service, issue 20) with ``wal_consistency_checking = all`` and, at the
same time, against a plain PostgreSQL of the same build. Then:

- both sides fail the same tests (the source may be older than the binaries: some expected
  outputs may differ, on both sides alike);
- the pageserver's ``validate_redo`` found no replayed page that differs from PostgreSQL's
  verification image, and checked many;
- after a CHECKPOINT, every page of every relation fork at its LSN equals PostgreSQL's file
  page, masked like its rm_mask: none unreadable, none different, of every access method the
  suite writes (FSM not compared). PostgreSQL's files are the reference standby's
  (``bench.standby``: PostgreSQL's own redo of the endpoint's WAL, streamed from the endpoint
  itself, not through pagestore, replayed to that LSN and restartpointed), since a lazy
  endpoint's files are the pageserver's own pages; ``bench.pg_regress`` says what that oracle
  does and does not check;
- a branch at that LSN boots from its basebackup and answers a catalog query over the
  ``regression`` database exactly as the endpoint does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.pg_regress import PgRegressOptions, run_pg_regress, suite_dir

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def test_regression_suite_on_pagestore(pg_tmp_path: Path) -> None:
    suite_dir()  # not set up: a clear error naming ./scripts/setup, not a skip
    result = run_pg_regress(PgRegressOptions(workdir=pg_tmp_path, timeout_s=1500),
                            emit=lambda d: print(json.dumps(d)[:4000]))
    summary = result.summary()
    print(json.dumps(summary))
    assert (summary["storage"], summary["oracle"]) == ("lazy", "standby files"), summary
    ep, plain = result.endpoint_run, result.plain_run
    assert ep is not None and plain is not None
    assert len(ep.passed) + len(ep.failed) >= 200, ep.as_json()  # the whole schedule ran
    assert set(ep.failed) == set(plain.failed), (ep.as_json(), plain.as_json())

    checks = summary["validation"]["checks"]
    assert checks is not None and checks > 10_000, summary["validation"]
    assert summary["validation"]["mismatches"] == 0, summary["validation"]

    pages = summary["pages"]
    assert result.pages is not None
    assert pages["unreadable"] == 0 and pages["different"] == 0 and pages["other_mismatches"] == 0, (
        json.dumps(pages) + "\n" + "\n".join(result.pages.mismatches[:30]))
    by_am = pages["by_am"]
    for kind in ("heap", "btree", "hash", "gin", "gist", "spgist", "brin", "vm", "sequence"):
        assert by_am.get(kind, {}).get("compared", 0) > 0, (kind, by_am)
        assert by_am[kind]["equal"] == by_am[kind]["compared"], (kind, by_am[kind])
    assert pages["compared"] > 10_000

    assert result.main_catalog is not None and result.branch_catalog == result.main_catalog, (
        result.main_catalog, result.branch_catalog)
