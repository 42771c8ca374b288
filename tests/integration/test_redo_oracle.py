"""The oracle (issue 8): PostgreSQL on pagestore, and every page the pageserver serves equals
PostgreSQL's own data files, masked as ``bufmask`` does, at the end and at 3 earlier LSNs.

``bench.oracle`` does the work (``pagestore verify oracle`` runs it at full size); this test
runs it small: pgbench scale 1 for ~10 s plus the issue's workloads, with the pageserver's
``validate_redo`` on and ``wal_consistency_checking = all`` in the workload sessions. A
planted byte in a heap page, a btree page and a CLOG page of a copy must come back as exactly
those mismatches (the check can fail).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from bench.oracle import OracleOptions, run_oracle
from pageserver.storage.key import SLRU_MULTIXACT_OFFSETS
from pageserver.storage.value import PostgresRecord
from pageserver.walredo import multixact
from pageserver.walredo.manager import PostgresRedoManager, SlruPage
from protocol.lsn import Lsn
from protocol.wal.encoder import build_record
from protocol.wal.rmgr import XLOG_MULTIXACT_CREATE_ID, RmgrId


def _create_id(mid: int, moff: int, members: list[tuple[int, int]]) -> bytes:
    main = struct.pack("<IIi", mid, moff, len(members)) + b"".join(struct.pack("<Ii", x, s) for x, s in members)
    return build_record(prev=0, rmid=RmgrId.MULTIXACT, info=XLOG_MULTIXACT_CREATE_ID, main_data=main)


@pytest.mark.parametrize("mid", [7, 2047])
def test_multixact_create_sets_the_next_offset(mid: int) -> None:
    """PostgreSQL >= 15.15 writes the next multixact's offset too (on the next page when ``mid``
    is the last entry of its page); the oracle found redo writing only ``mid``'s."""
    raw = _create_id(mid, 3, [(1500, 1), (1501, 2)])
    mgr = PostgresRedoManager()
    pages = {p: mgr.apply_to_target(SlruPage(SLRU_MULTIXACT_OFFSETS, p), bytes(8192),
                                    [(Lsn(0x1000000), PostgresRecord(False, raw))]) for p in (0, 1)}
    per_page = multixact.MULTIXACT_OFFSETS_PER_PAGE

    def entry(m: int) -> int:
        return int(struct.unpack_from("<I", pages[m // per_page], (m % per_page) * 4)[0])

    assert entry(mid) == 3 and entry(mid + 1) == 5
    assert sum(pages[0].count(b) for b in range(1, 256)) + sum(pages[1].count(b) for b in range(1, 256)) == 2
    assert multixact.next_multi_offset(0xFFFF_FFFF, 0xFFFF_FFFE, 2) == (1, 1)


@pytest.mark.postgres
@pytest.mark.slow
def test_every_page_equals_postgres(pg_tmp_path: Path) -> None:
    oracle = run_oracle(OracleOptions(workdir=pg_tmp_path / "cluster", scale=1, duration_s=10, clients=2,
                                      workload_rows=1200),
                        emit=lambda d: print(json.dumps(d)))
    results = oracle.results
    assert [r.label for r in results] == ["final", "after-init", "after-workload-a", "after-workload-b"]
    lsns = [r.lsn for r in results]
    assert len(set(lsns)) == 4
    final = results[0]
    # Every kind of page was compared, at every LSN, and something changed in between.
    assert {"heap", "btree", "vm", "sequence"} <= set(final.pages), final.pages
    for r in results:
        assert sum(r.pages.values()) > 1000 and r.slru_pages >= 3 and r.forks > 500, r.as_json()
    assert final.skipped_unlogged_forks > 0  # the unlogged table: only its init forks count
    # The workload sessions ran with wal_consistency_checking: redo validated their records.
    checks = oracle.validation.get("pageserver_walredo_validation_checks_total", 0)
    assert checks > 1000, oracle.validation
    assert oracle.validation.get("pageserver_walredo_validation_failures_total") == 0, oracle.validation
    # The check can fail: the planted bytes are found, named by relation, fork, block and LSN.
    planted = oracle.self_check
    assert len(planted) == 3, planted
    assert any("pgbench_accounts (" in m and "fork main" in m and "block 1: 1 bytes differ after the heap mask" in m
               and results[1].lsn in m for m in planted), planted
    assert any("pgbench_accounts_pkey" in m and "block 1: 1 bytes differ after the btree mask" in m
               for m in planted), planted
    assert any("pg_xact/0000 page 0" in m and "1 bytes differ" in m for m in planted), planted
    mismatches = [m for r in results for m in r.mismatches]
    assert not mismatches, "\n".join(mismatches[:40])
    for r in results:
        assert r.equal == r.pages and r.slru_equal == r.slru_pages
        assert r.nblocks_equal + r.nblocks_file_longer + r.fsm_nblocks_differ == r.forks
