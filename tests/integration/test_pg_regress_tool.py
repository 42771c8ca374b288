"""``pagestore verify pg-regress``'s parts that need no server: pg_regress's output parsed into
passed and failed tests, unreadable pages' errors reduced to their reason."""

from __future__ import annotations

from bench.oracle import _reason
from bench.pg_regress import parse_results

OUTPUT = """\
(using postmaster on 127.0.0.1, port 54999)
============== running regression test queries        ==============
test tablespace                   ... ok          302 ms
parallel group (20 tests):  varchar char name text int2 int4 int8 oid float4 float8 bit
     boolean                      ... ok           81 ms
     char                         ... FAILED       33 ms
     name                         ... failed (ignored)       12 ms
test create_function_c            ... ok           20 ms
test hash_index                   ... FAILED (test process exited with exit code 2)      500 ms

=======================
 2 of 217 tests failed, 1 of these failures ignored.
=======================
"""


def test_parse_results() -> None:
    passed, failed = parse_results(OUTPUT)
    assert passed == ["tablespace", "boolean", "create_function_c"]
    assert failed == ["char", "name", "hash_index"]
    assert parse_results("") == ([], [])


def test_reason_drops_key_and_lsns() -> None:
    msg = ("Read error: could not reconstruct key 000000067F0000400000005E860000000003 at 0/7909F9E8: "
           "no redo for resource manager Hash (Hash/SPLIT_COMPLETE) (record ending at 0/7909F9E8)")
    assert _reason(msg) == "no redo for resource manager Hash (Hash/SPLIT_COMPLETE)"
    other = "Read error: could not reconstruct key 00AB at 1/2: page 0/1234 has a bad pd_lower"
    assert _reason(other) == "page X/X has a bad pd_lower"
    assert _reason("timeout") == "timeout"
