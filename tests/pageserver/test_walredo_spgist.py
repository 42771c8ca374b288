"""SP-GiST redo (rmid 16) against real WAL from the installed PostgreSQL 15.

The indexes are created empty and then filled, updated, vacuumed and emptied, so every page
change arrives as an incremental SP-GiST record rather than as a build's full-page images:
points under quad_point_ops and kd_point_ops (picksplits, chains moved to new pages, the
nulls tree), text_ops (prefixes split by SPLIT_TUPLE, nodes added), inet_ops, and a tiny
index whose root stays a leaf (VACUUM_ROOT). With wal_consistency_checking = all every block
reference carries PostgreSQL's own page, which each replayed page must equal after spg_mask;
the pages rebuilt from the records alone (the GetPage path: no base image) must equal the
data files after CHECKPOINT; and the same WAL fed through WAL ingest comes back through
``Datadir.get_page``.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pageserver.pgdatadir import Datadir, RelTag
from pageserver.storage.reconstruct import PageReconstructError
from pageserver.walredo import bufpage as bp
from pageserver.walredo import manager as redo_manager
from pageserver.walredo.errors import RedoError
from pageserver.walredo.manager import PostgresRedoManager, RelBlock
from pageserver.walredo.mask import spg_mask
from pageserver.walredo.verify import verify_records
from protocol.lsn import Lsn
from protocol.wal.record import DecodedRecord
from protocol.wal.rmgr import RmgrId
from tests.pageserver.walredo_capture import (
    Capture,
    capture,
    compare_with_files,
    ingest_and_read,
    per_block,
    records_touching,
    rels_of,
)

pytestmark = pytest.mark.postgres

SQL = [
    # points: quad tree and k-d tree, plus NULLs (the nulls tree on block 2)
    "CREATE TABLE pts (id int, p point)",
    "CREATE INDEX pts_quad ON pts USING spgist (p)",
    "CREATE INDEX pts_kd ON pts USING spgist (p kd_point_ops)",
    "INSERT INTO pts SELECT g, point(g % 97, g % 89) FROM generate_series(1, 1500) g",
    "INSERT INTO pts SELECT g, NULL FROM generate_series(1, 700) g",
    # text: long shared prefixes, then strings that disagree inside them (SPLIT_TUPLE) and new
    # characters under existing nodes (ADD_NODE)
    "CREATE TABLE txt (id int, t text)",
    "CREATE INDEX txt_t ON txt USING spgist (t)",
    "INSERT INTO txt SELECT g, 'f' || repeat('o', 60) || g FROM generate_series(1, 1000) g",
    "INSERT INTO txt SELECT g, 'baaaaaaaaaaaaaar' || g FROM generate_series(1, 400) g",
    "INSERT INTO txt SELECT -g, 'f' || repeat('o', 60 - g) || 'surprise' FROM generate_series(1, 50) g",
    "INSERT INTO txt SELECT g, translate(lpad(to_hex(g * 7919), 6, '0'), '0123456789', 'ABCDEFGHIJ')"
    " FROM generate_series(1, 500) g",
    "CREATE TABLE net (id int, i inet)",
    "CREATE INDEX net_i ON net USING spgist (i)",
    "INSERT INTO net SELECT g, ('10.' || (g % 200) || '.' || (g % 7) || '.' || (g % 250))::inet"
    " FROM generate_series(1, 800) g",
    # groups sharing 600-byte prefixes: inner tuples with big prefixes fill inner pages, and
    # nodes added to them later move the tuples to other pages (ADD_NODE with a new location)
    "CREATE TABLE lp (id int, t text)",
    "CREATE INDEX lp_t ON lp USING spgist (t)",
    "INSERT INTO lp SELECT g, repeat(chr(65 + g % 30), 600) || 'a' || (g / 30) FROM generate_series(1, 1200) g",
    "INSERT INTO lp SELECT g, repeat(chr(65 + g % 30), 600) || chr(98 + (g / 30) % 24) FROM generate_series(1, 1200) g",
    # values longer than a page: a leaf too big for its new page is split there (initSrc)
    "CREATE TABLE big (id int, t text)",
    "CREATE INDEX big_t ON big USING spgist (t)",
    "INSERT INTO big SELECT g, chr(65 + g) || repeat('y', 20000) || g FROM generate_series(1, 20) g",
    # a root that stays a leaf: VACUUM_ROOT
    "CREATE TABLE tiny (id int, p point)",
    "CREATE INDEX tiny_p ON tiny USING spgist (p)",
    "INSERT INTO tiny SELECT g, point(g, g) FROM generate_series(1, 20) g",
    "DELETE FROM tiny WHERE id % 2 = 0",
    "VACUUM tiny",
    # VACUUM_LEAF (dead, placeholder, moved and re-chained tuples) and VACUUM_REDIRECT
    "DELETE FROM pts WHERE id % 3 = 0",
    "DELETE FROM txt WHERE id % 2 = 0",
    "DELETE FROM net WHERE id % 4 = 0",
    "VACUUM pts",
    "VACUUM txt",
    "VACUUM net",
    # new leaves replace DEAD chain heads and placeholders
    "INSERT INTO pts SELECT g, point(g % 101, g % 83) FROM generate_series(1, 800) g",
    "UPDATE txt SET t = t || 'x' WHERE id % 5 = 1",
    # emptied
    "DELETE FROM pts",
    "DELETE FROM txt",
    "DELETE FROM net",
    "VACUUM pts",
    "VACUUM txt",
    "VACUUM net",
    "VACUUM pts",
    "INSERT INTO pts SELECT g, point(g % 13, g % 11) FROM generate_series(1, 300) g",
]

RECORD_TYPES = [
    "ADD_LEAF", "MOVE_LEAFS", "ADD_NODE", "SPLIT_TUPLE", "PICKSPLIT", "VACUUM_LEAF",
    "VACUUM_ROOT", "VACUUM_REDIRECT",
]


@pytest.fixture(scope="module")
def cap() -> Capture:
    c = capture(SQL)
    print(f"workload {c.seconds:.1f}s, {len(c.records)} records, WAL {(c.end - c.start) / 2**20:.0f} MiB")
    return c


def _spgist_rels(c: Capture) -> set[int]:
    rels = rels_of(c, "spgist")
    assert len(rels) == 7
    return rels


def _cases(records: list[DecodedRecord]) -> Counter[str]:
    """Sub-cases of the records, read from their main data (what the redo must handle)."""
    c: Counter[str] = Counter()
    for r in records:
        if r.xl_rmid != RmgrId.SPGIST:
            continue
        t, m = r.record_type, r.main_data
        if t == "ADD_LEAF":
            new_page, nulls, off_leaf, off_head, off_parent = struct.unpack_from("<BBHHH", m)
            c["ADD_LEAF new page"] += bool(new_page)
            c["ADD_LEAF nulls tree"] += bool(nulls)
            c["ADD_LEAF replaces a DEAD head"] += off_leaf == off_head
            c["ADD_LEAF links a chain"] += off_head != 0 and off_leaf != off_head
            c["ADD_LEAF updates the parent"] += off_parent != 0
        elif t == "ADD_NODE":
            c["ADD_NODE in place"] += r.block(1) is None
            c["ADD_NODE moves the tuple (b1)"] += r.block(1) is not None
            c["ADD_NODE parent on another page (b2)"] += r.block(2) is not None
        elif t == "MOVE_LEAFS":
            c["MOVE_LEAFS to a new page"] += bool(m[2])
            c["MOVE_LEAFS nulls tree"] += bool(m[4])
        elif t == "SPLIT_TUPLE":
            c["SPLIT_TUPLE postfix on the same page"] += bool(m[5])
            c["SPLIT_TUPLE postfix on another page"] += not m[5]
        elif t == "PICKSPLIT":
            root, _nd, _ni, init_src, init_dest, _oi, init_inner, nulls, inner_is_parent = struct.unpack_from("<BxHHBBHBBB", m)
            c["PICKSPLIT root split"] += bool(root)
            c["PICKSPLIT re-initialises its source page"] += bool(init_src)
            c["PICKSPLIT new destination page"] += bool(init_dest)
            c["PICKSPLIT new inner page"] += bool(init_inner)
            c["PICKSPLIT inner page is the parent"] += bool(inner_is_parent)
            c["PICKSPLIT separate parent (b3)"] += r.block(3) is not None
            c["PICKSPLIT nulls tree"] += bool(nulls)
        elif t == "VACUUM_LEAF":
            ndead, nph, nmove, nchain = struct.unpack_from("<HHHH", m)
            c["VACUUM_LEAF dead"] += ndead > 0
            c["VACUUM_LEAF placeholders"] += nph > 0
            c["VACUUM_LEAF moves"] += nmove > 0
            c["VACUUM_LEAF re-chains"] += nchain > 0
        elif t == "VACUUM_REDIRECT":
            n, first = struct.unpack_from("<HH", m)
            c["VACUUM_REDIRECT to placeholders"] += n > 0
            c["VACUUM_REDIRECT trims placeholders"] += first != 0
    return c


def _index_records(c: Capture) -> list[DecodedRecord]:
    """The records touching the SP-GiST indexes (the heap's are another test's business)."""
    return records_touching(c, _spgist_rels(c))


def test_every_spgist_record_matches_its_verification_image(cap: Capture) -> None:
    report = verify_records(_index_records(cap))
    print(report.summary())
    assert not report.failures, "\n".join(report.failures[:20])
    assert report.adopted == 0
    # each record type was replayed by the SP-GiST routines (not just restored from an image)
    # and the result compared with PostgreSQL's page
    for t in RECORD_TYPES:
        assert report.checked[f"SPGist/{t}"] > 0, f"no SPGist/{t} was replayed and checked"
    cases = _cases(cap.records)
    print("\n".join(f"{n:7d} {k}" for k, n in sorted(cases.items())))
    missing = [k for k in (
        "ADD_LEAF new page", "ADD_LEAF nulls tree", "ADD_LEAF replaces a DEAD head", "ADD_LEAF links a chain",
        "ADD_LEAF updates the parent", "ADD_NODE in place", "ADD_NODE moves the tuple (b1)",
        "ADD_NODE parent on another page (b2)", "MOVE_LEAFS to a new page", "MOVE_LEAFS nulls tree",
        "SPLIT_TUPLE postfix on the same page", "SPLIT_TUPLE postfix on another page",
        "PICKSPLIT root split", "PICKSPLIT re-initialises its source page", "PICKSPLIT new destination page", "PICKSPLIT new inner page",
        "PICKSPLIT inner page is the parent", "PICKSPLIT separate parent (b3)", "PICKSPLIT nulls tree",
        "VACUUM_LEAF dead", "VACUUM_LEAF placeholders", "VACUUM_LEAF moves", "VACUUM_LEAF re-chains",
        "VACUUM_REDIRECT to placeholders", "VACUUM_REDIRECT trims placeholders",
    ) if not cases[k]]
    assert not missing, f"the workload did not produce {missing}"


def test_pages_rebuilt_from_records_equal_data_files(cap: Capture) -> None:
    rels = _spgist_rels(cap)
    mgr = PostgresRedoManager(count=True)
    rebuilt = {t: mgr.apply_to_target(t, None, recs) for t, recs in per_block(cap, rels).items()}
    compared = compare_with_files(cap, rebuilt, rels, spg_mask, skip_block0=True)
    print(f"compared {compared} SP-GiST pages with the data files; applied {dict(mgr.stats.applied)}")
    assert compared > 30
    for t in RECORD_TYPES:
        assert mgr.stats.applied[f"SPGist/{t}"] > 0


def test_ingested_records_are_readable(cap: Capture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The WAL through WalIngest: every SP-GiST page comes back from the timeline. Stored
    without SP-GiST redo, the same values fail naming the record and its LSN; with it, they
    read back right, with no re-ingest."""
    rels = _spgist_rels(cap)
    targets = sorted((t for t in cap.pages if t.rel in rels), key=lambda t: (t.rel, t.blkno))

    async def unreadable_without_redo(dd: Datadir, lsn: Lsn) -> None:
        t = targets[1]
        with monkeypatch.context() as m:
            m.delitem(redo_manager.REDO_ROUTINES, RmgrId.SPGIST)
            with pytest.raises(PageReconstructError, match=r"no redo for resource manager SPGist \(SPGist/\w+\).*record ending at"):
                await dd.get_page(RelTag(t.spc, t.db, t.rel, 0), t.blkno, lsn)

    got = ingest_and_read(cap, tmp_path, targets, unreadable_without_redo, rels)
    rebuilt = {t: p for t, p in got.items() if p != bytes(bp.BLCKSZ) or cap.pages[t] != p}
    assert compare_with_files(cap, rebuilt, rels, spg_mask, skip_block0=True) > 30


# --- hostile input ----------------------------------------------------------------------


def _samples(c: Capture) -> Iterator[tuple[DecodedRecord, RelBlock, bytearray]]:
    """One replayable (record, block, page before it) per record type and block id."""
    pages: dict[RelBlock, bytearray] = {}
    seen: set[tuple[str, int]] = set()
    mgr = PostgresRedoManager()
    for r in _index_records(c):
        for b in r.blocks:
            t = RelBlock(b.spc, b.db, b.rel, b.forknum, b.blkno)
            before = pages.get(t)
            if r.xl_rmid == RmgrId.SPGIST and not b.apply_image and (before is not None or b.will_init):
                key = (r.record_type, b.block_id)
                if key not in seen:
                    seen.add(key)
                    yield r, t, bytearray(before) if before is not None else bytearray(bp.BLCKSZ)
            try:
                new = mgr.redo_page(t, before, r)
            except RedoError:
                pages.pop(t, None)
                continue
            if new is not None:
                pages[t] = new


@pytest.fixture(scope="module")
def samples(cap: Capture) -> list[tuple[DecodedRecord, RelBlock, bytearray]]:
    s = list(_samples(cap))
    assert {r.record_type for r, _, _ in s} == set(RECORD_TYPES)
    return s


def _replay(rec: DecodedRecord, t: RelBlock, page: bytearray) -> bytearray | None:
    mgr = PostgresRedoManager()
    base = bytearray(page)
    bp.page_set_lsn(base, 0)  # the page predates the record (the mutated copy keeps its LSN)
    return mgr.redo_page(t, base, rec)


def test_truncated_main_data_is_an_error(samples: list[tuple[DecodedRecord, RelBlock, bytearray]]) -> None:
    for rec, t, page in samples:
        assert _replay(rec, t, page) is not None
        main = rec.main_data
        # every cut through the fixed part and the first tuples, then every 40th of the rest
        cuts = sorted(set(range(min(len(main), 64))) | set(range(64, len(main), max(1, len(main) // 40))))
        for cut in cuts:
            bad = attrs.evolve(rec, main_data=main[:cut])
            with pytest.raises(RedoError, match="SPGist"):
                _replay(bad, t, page)
        longer = attrs.evolve(rec, main_data=main + b"\x00" * 8)
        with pytest.raises(RedoError, match="SPGist"):
            _replay(longer, t, page)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_garbled_main_data_fails_cleanly(samples: list[tuple[DecodedRecord, RelBlock, bytearray]], data: st.DataObject) -> None:
    """Flipped bytes in the payload: a RedoError or a page, never another exception."""
    rec, t, page = data.draw(st.sampled_from(samples))
    main = bytearray(rec.main_data)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(main) - 1))
        main[i] = data.draw(st.integers(0, 255))
    try:
        _replay(attrs.evolve(rec, main_data=bytes(main)), t, page)
    except RedoError:
        pass


def test_a_wrong_redo_is_caught(cap: Capture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison can fail: a redo that links parents to the wrong node is reported."""
    from pageserver.walredo import spgist

    real = spgist.update_node_link

    def off_by_one(page: bytearray, off: int, node_i: int, blkno: int, offnum: int, rec: DecodedRecord) -> None:
        real(page, off, node_i, blkno, offnum + 1, rec)

    monkeypatch.setattr(spgist, "update_node_link", off_by_one)
    report = verify_records(_index_records(cap), max_failures=5)
    assert report.failures and all("SPGist" in f for f in report.failures), report.failures
