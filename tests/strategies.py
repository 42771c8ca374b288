"""Hypothesis strategies for the fixed-width integers and LSNs that wire formats carry."""

from __future__ import annotations

from hypothesis import strategies as st

from protocol.lsn import Lsn

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFF_FFFF)
u64 = st.integers(0, 0xFFFF_FFFF_FFFF_FFFF)
i16 = st.integers(-(2**15), 2**15 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
lsns = u64.map(Lsn)
