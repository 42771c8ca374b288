"""ReceiveBuffer, Reader and WriteBuffer: bounds, truncation errors, compaction, back-patching."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.buffer import U32, Reader, ReceiveBuffer, WriteBuffer
from protocol.errors import LocalProtocolError, RemoteProtocolError


def test_reader_integers_are_big_endian() -> None:
    r = Reader(bytes.fromhex("01 0203 04050607 08090a0b0c0d0e0f ffff ffffffff fffffffffffffffe"))
    assert r.u8() == 1
    assert r.u16() == 0x0203
    assert r.u32() == 0x04050607
    assert r.u64() == 0x08090A0B0C0D0E0F
    assert r.i16() == -1
    assert r.i32() == -1
    assert r.i64() == -2
    assert r.at_end()
    r.expect_end()


@pytest.mark.parametrize("method", ["u8", "u16", "u32", "u64", "i16", "i32", "i64"])
def test_reader_running_out_is_remote_error(method: str) -> None:
    r = Reader(b"", "Thing")
    with pytest.raises(RemoteProtocolError, match="truncated Thing") as info:
        getattr(r, method)()
    assert info.value.sqlstate == "08P01"


def test_reader_cstrings_and_bytes() -> None:
    data = memoryview(b"xxhello\x00w\xc3\xb6rld\x00rest")[2:]
    r = Reader(data)
    assert r.cstr() == "hello"
    assert r.cstr() == "wörld"
    assert r.bytes(2) == b"re"
    assert r.rest() == b"st"
    with pytest.raises(RemoteProtocolError, match="truncated"):
        r.bytes(1)


def test_reader_cstring_without_nul_and_bad_utf8() -> None:
    with pytest.raises(RemoteProtocolError, match="NUL"):
        Reader(b"abc").cstring()
    with pytest.raises(RemoteProtocolError, match="UTF-8") as info:
        Reader(b"\xff\x00").cstr()
    assert info.value.sqlstate == "22021"


def test_reader_trailing_bytes_detected() -> None:
    r = Reader(b"\x00\x01\x02", "Msg")
    r.u16()
    with pytest.raises(RemoteProtocolError, match="1 trailing bytes"):
        r.expect_end()


def test_reader_negative_length_is_remote_error() -> None:
    with pytest.raises(RemoteProtocolError):
        Reader(b"abc").bytes(-1)


@given(st.lists(st.binary(max_size=50), max_size=30))
def test_receive_buffer_take_preserves_stream(chunks: list[bytes]) -> None:
    buf = ReceiveBuffer()
    whole = b"".join(chunks)
    out = bytearray()
    for i, c in enumerate(chunks):
        buf.append(c)
        n = min(len(buf), i % 7)
        out += buf.take(n)
    out += buf.take(len(buf))
    assert bytes(out) == whole
    assert len(buf) == 0
    assert not buf


def test_receive_buffer_compacts_lazily() -> None:
    buf = ReceiveBuffer()
    buf.append(b"a" * 200_000)
    for _ in range(150):
        buf.consume(1000)
    # The dead prefix was dropped once it reached half of the array, not per consume.
    assert len(buf._data) < 200_000
    assert len(buf) == 50_000
    assert buf.peek(3) == b"aaa"
    with pytest.raises(LocalProtocolError):
        buf.take(50_001)


def test_receive_buffer_find_and_unpack() -> None:
    buf = ReceiveBuffer()
    buf.append(b"zz\x00\x00\x00\x07abc\x00")
    buf.consume(2)
    assert buf.unpack_from(U32) == (7,)
    assert buf.find(0, 4) == 7
    assert buf.byte_at(4) == ord("a")


def test_write_buffer_backpatches_length() -> None:
    w = WriteBuffer()
    w.new_message(b"Q")
    w.write_cstr("select 1")
    w.end_message()
    w.new_message(None)
    w.write_u32(80877103)
    w.end_message()
    assert w.take() == b"Q\x00\x00\x00\x0dselect 1\x00" + b"\x00\x00\x00\x08\x04\xd2\x16\x2f"
    assert len(w) == 0


def test_write_buffer_misuse_is_local_error() -> None:
    w = WriteBuffer()
    with pytest.raises(LocalProtocolError):
        w.end_message()
    w.new_message(b"d")
    with pytest.raises(LocalProtocolError):
        w.new_message(b"d")
    with pytest.raises(LocalProtocolError):
        w.getvalue()
    with pytest.raises(LocalProtocolError):
        WriteBuffer().write_cstring(b"a\x00b")


# -- the zero-copy receive path -------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=1 << 30), st.sampled_from([64, 512, 4096]))
def test_receive_buffer_views_never_change_and_stream_is_preserved(seed: int, arena: int) -> None:
    """Any mix of recv_into (writable/commit), append, take, take_view and take_frames gives
    back exactly the bytes put in, in order; every view handed out keeps showing its bytes
    while later data arrives (no array is reused, resized or compacted under a live view);
    dropping views lets arrays be reused. (A seeded driver: it reaches array switches and
    reuse far more often than shrinking-friendly operation lists did.)"""
    rng = random.Random(seed)
    buf = ReceiveBuffer(arena_size=arena)  # small arrays: many switches and reuses
    sent = bytearray()
    got = bytearray()
    held: list[tuple[memoryview, bytes]] = []
    for _ in range(150):
        op = rng.choice(["recv", "append", "frame", "take", "view", "frames", "drop"])
        if op == "recv":
            data = rng.randbytes(rng.randint(0, 300))
            window = buf.writable(max(len(data), 1))
            window[: len(data)] = data
            del window
            buf.commit(len(data))
            sent += data
        elif op in ("append", "frame"):
            data = rng.randbytes(rng.randint(0, 300))
            if op == "frame":
                data = b"d" + (len(data) + 4).to_bytes(4, "big") + data
            buf.append(data)
            sent += data
        elif op == "take":
            got += buf.take(min(rng.randint(0, 400), len(buf)))
        elif op == "view":
            v = buf.take_view(min(rng.randint(0, 400), len(buf)))
            held.append((v, bytes(v)))
            got += v
        elif op == "frames":
            # Frames taken whole (headers included): rebuild them from what was sent.
            before = len(buf)
            for v in buf.take_frames(ord("d"), 1 << 20, rng.randint(1, 5)):
                held.append((v, bytes(v)))
            consumed = before - len(buf)
            got += sent[len(got) : len(got) + consumed]
        elif held:
            del held[rng.randrange(len(held))]
        for v, content in held:
            assert v == content
    got += buf.take(len(buf))
    assert bytes(got) == bytes(sent)


def test_take_frames_stops_at_other_tags_bad_lengths_and_partial_messages() -> None:
    buf = ReceiveBuffer()
    buf.append(b"d\x00\x00\x00\x07abcd\x00\x00\x00\x04" + b"d\x00\x00\x00\x09wxyz")
    views = buf.take_frames(ord("d"), 100, 10)
    assert [bytes(v) for v in views] == [b"abc", b""]
    assert buf.peek(5) == b"d\x00\x00\x00\x09"  # incomplete: 4 of 5 body bytes
    buf.append(b"!")
    assert [bytes(v) for v in buf.take_frames(ord("d"), 100, 10)] == [b"wxyz!"]
    buf.append(b"d\x00\x00\x00\x03" + b"d\x00\x00\x01\x00")
    assert buf.take_frames(ord("d"), 100, 10) == []  # length 3 < 4: left for the decoder
    buf.consume(5)
    assert buf.take_frames(ord("d"), 100, 10) == []  # 256 > max_length
    buf.clear()
    buf.append(b"Q\x00\x00\x00\x05x")
    assert buf.take_frames(ord("d"), 100, 10) == []
    assert buf.take(6) == b"Q\x00\x00\x00\x05x"


def test_release_memory_when_idle_never_touches_views_handed_out() -> None:
    buf = ReceiveBuffer(arena_size=64)
    buf.append(b"d\x00\x00\x00\x08abcd" + b"d\x00\x00\x00\x08efgh")
    views = buf.take_frames(ord("d"), 100, 10)
    assert [bytes(v) for v in views] == [b"abcd", b"efgh"]
    buf.append(b"d\x00")  # a partial message: not idle, nothing released
    assert not buf.release_memory() and buf.capacity > 0
    buf.consume(2)
    window = buf.writable(16)
    assert not buf.release_memory()  # a receive window is out
    del window
    buf.commit(0)
    assert buf.release_memory() and buf.capacity == 0
    # Receiving again allocates afresh; the held views keep their bytes.
    for _ in range(20):
        w = buf.writable(64)
        w[:64] = b"\xff" * 64
        del w
        buf.commit(64)
        buf.take(64)
    assert [bytes(v) for v in views] == [b"abcd", b"efgh"]
