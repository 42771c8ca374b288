"""Keys, key spaces and value encodings: layouts, orders and hypothesis round trips."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pageserver.storage.key import (
    AUX_FILES_KEY,
    CHECKPOINT_KEY,
    CONTROLFILE_KEY,
    DBDIR_KEY,
    KEY_MAX,
    KEY_MIN,
    Key,
    KeyRange,
    KeySpace,
    is_inherited_key,
    is_rel_block_key,
    key_fields,
    key_from_int,
    key_hex,
    key_next,
    key_parse_hex,
    key_to_int,
    make_key,
    rel_block_key,
    rel_dir_key,
    rel_key_range,
    rel_size_key,
    relmap_file_key,
    slru_block_key,
    slru_dir_key,
    slru_segment_size_key,
    twophase_file_key,
)
from pageserver.storage.value import (
    ClearVisibilityMapFlags,
    ClogSetAborted,
    ClogSetCommitted,
    Image,
    MultixactMembersCreate,
    MultixactOffsetCreate,
    PostgresRecord,
    TestRecord,
    TruncateVisibilityMap,
    Value,
    decode_value,
    encode_value,
    value_will_init,
)
from protocol.errors import RemoteProtocolError

u8 = st.integers(0, 0xFF)
u32 = st.integers(0, 0xFFFF_FFFF)
fields = st.tuples(u8, u32, u32, u32, u8, u32)


def test_key_layout_matches_neon() -> None:
    k = rel_block_key(1663, 5, 16384, 0, 7)
    assert len(k) == 18
    assert key_hex(k) == "000000067F00000005000040000000000007"
    assert key_fields(k) == (0, 1663, 5, 16384, 0, 7)
    assert key_fields(rel_size_key(1663, 5, 16384, 0))[5] == 0xFFFFFFFF
    assert rel_size_key(1663, 5, 16384, 0) in rel_key_range(1663, 5, 16384, 0)
    assert rel_block_key(1663, 5, 16384, 1, 0) not in rel_key_range(1663, 5, 16384, 0)
    assert key_fields(rel_dir_key(1663, 5)) == (0, 1663, 5, 0, 0, 1)
    assert key_fields(relmap_file_key(1663, 5)) == (0, 1663, 5, 0, 0, 0)
    assert key_fields(DBDIR_KEY) == (0,) * 6
    assert key_fields(slru_dir_key(2)) == (1, 2, 0, 0, 0, 0)
    assert key_fields(slru_block_key(0, 3, 9)) == (1, 0, 1, 3, 0, 9)
    assert key_fields(slru_segment_size_key(0, 3))[5] == 0xFFFFFFFF
    assert key_fields(twophase_file_key(77)) == (2, 0, 0, 0, 0, 77)
    assert key_fields(CONTROLFILE_KEY) == (3, 0, 0, 0, 0, 0)
    assert key_fields(CHECKPOINT_KEY) == (3, 0, 0, 0, 0, 1)
    assert is_rel_block_key(k)
    assert not is_rel_block_key(rel_size_key(1663, 5, 16384, 0))
    assert not is_inherited_key(AUX_FILES_KEY)
    assert key_parse_hex(key_hex(k)) == k


@given(fields, fields)
def test_key_byte_order_is_field_order(a: tuple[int, ...], b: tuple[int, ...]) -> None:
    ka, kb = make_key(*a), make_key(*b)
    assert (ka < kb) == (a < b)
    assert key_to_int(ka) < key_to_int(kb) or a >= b
    assert key_from_int(key_to_int(ka)) == ka


def test_key_next_carries() -> None:
    assert key_fields(key_next(make_key(0, 1, 2, 3, 4, 0xFFFFFFFF))) == (0, 1, 2, 3, 5, 0)
    assert key_next(KEY_MIN) == make_key(0, 0, 0, 0, 0, 1)
    with pytest.raises(OverflowError):
        key_next(KEY_MAX)


small_keys = st.integers(0, 60).map(lambda n: key_from_int(n))
ranges = st.tuples(st.integers(0, 60), st.integers(0, 60)).map(
    lambda t: KeyRange(key_from_int(min(t)), key_from_int(max(t)))
)


def _as_set(ks: KeySpace) -> set[Key]:
    return set(ks.iter_keys())


@given(st.lists(ranges, max_size=6), st.lists(ranges, max_size=6), small_keys)
def test_keyspace_ops_match_sets(a: list[KeyRange], b: list[KeyRange], probe: Key) -> None:
    ka, kb = KeySpace.from_ranges(a), KeySpace.from_ranges(b)
    sa = {k for r in a for k in r.iter_keys()}
    sb = {k for r in b for k in r.iter_keys()}
    assert _as_set(ka) == sa
    assert _as_set(ka.merge(kb)) == sa | sb
    assert _as_set(ka.subtract(kb)) == sa - sb
    assert ka.contains(probe) == (probe in sa)
    assert ka.key_count() == len(sa)
    # normalized: sorted, disjoint, not touching
    for x, y in zip(ka.ranges, ka.ranges[1:], strict=False):
        assert x.end < y.start


texts = st.text(max_size=20)
xids = st.lists(u32, max_size=40).map(tuple)
values = st.one_of(
    st.binary(max_size=300).map(Image),
    st.builds(PostgresRecord, st.booleans(), st.binary(max_size=300)),
    st.builds(ClearVisibilityMapFlags, st.none() | st.integers(0, 0xFFFFFFFE), st.none() | st.integers(0, 0xFFFFFFFE), u8),
    st.builds(ClogSetCommitted, xids, st.integers(-(2**63), 2**63 - 1)),
    st.builds(ClogSetAborted, xids),
    st.builds(MultixactOffsetCreate, u32, u32),
    st.builds(MultixactMembersCreate, u32, st.lists(st.tuples(u32, u8), max_size=10).map(tuple)),
    st.builds(TruncateVisibilityMap, u32, u8),
    st.builds(TestRecord, texts, st.booleans(), st.booleans(), st.none() | texts),
)


@given(values)
def test_value_round_trip(value: Value) -> None:
    encoded = encode_value(value)
    assert decode_value(encoded) == value
    assert value_will_init(encoded) == value.will_init


@given(st.binary(max_size=64))
def test_hostile_value_bytes_raise_remote_protocol_error(blob: bytes) -> None:
    try:
        decode_value(blob)
    except RemoteProtocolError as exc:
        assert exc.sqlstate == "XX001"


@given(values, st.data())
def test_truncated_values_never_decode_to_something_else(value: Value, data: st.DataObject) -> None:
    encoded = encode_value(value)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    try:
        decoded = decode_value(encoded[:cut])
    except RemoteProtocolError:
        return
    # Only tail-delimited payloads (images, raw records) can be cut and still parse.
    assert isinstance(value, Image | PostgresRecord)
    assert decoded != value


@given(st.binary(max_size=8))
def test_value_will_init_on_hostile_bytes_is_a_bool_or_corruption(blob: bytes) -> None:
    try:
        got = value_will_init(blob)
    except RemoteProtocolError as exc:
        assert exc.sqlstate == "XX001"
        assert blob == b""
    else:
        assert isinstance(got, bool)
