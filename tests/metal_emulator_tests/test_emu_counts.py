"""Library.dispatch's DispatchCounts are exact: every expected value below is
worked out by arithmetic from kernels/counts.metal."""

import dataclasses

import numpy as np
import pytest
from conftest import library

from metal_emulator import DispatchCounts

KERNELS = "counts.metal"
BYTE_FIELDS = ("device_bytes_read", "device_bytes_written", "device_bytes_read_by_index",
               "device_bytes_written_by_index", "threadgroup_bytes_read", "threadgroup_bytes_written",
               "device_loads_by_index", "threadgroup_loads_by_width", "device_unique_bytes_read_by_index",
               "device_load_requests_by_index", "device_request_bytes_by_index",
               # the load windows of issue 43 (instrumented builds only, like the byte counts)
               "device_load_windows_by_index", "device_window_loads_by_index", "device_window_max_by_index")


def u32(x: int) -> bytes:
    return np.uint32(x).tobytes()


def rng():
    return np.random.default_rng(1234)


def event_counts(c: DispatchCounts) -> dict:
    """The fields both builds count."""
    return {k: v for k, v in dataclasses.asdict(c).items() if k not in BYTE_FIELDS}


def test_copy_bytes_per_buffer():
    lib = library(KERNELS, True)
    n, tpg, groups = 100, 32, 4  # 128 threads, 28 of them past n
    src = rng().random(n, dtype=np.float32)
    dst = np.full(n, np.nan, np.float16)
    c = lib.dispatch("copy_to_half", buffers={0: src, 1: dst}, bytes={2: u32(n)}, grid=(groups,), threadgroup=(tpg,))
    np.testing.assert_array_equal(dst, src.astype(np.float16))
    threads = tpg * groups
    assert (c.threadgroups, c.threads) == (groups, threads)
    # 4 bytes of src and 2 of dst per thread below n; every thread reads n (4 bytes)
    assert c.device_bytes_read_by_index == {0: 4 * n, 1: 0, 2: 4 * threads}
    assert c.device_bytes_written_by_index == {0: 0, 1: 2 * n, 2: 0}
    assert (c.device_bytes_read, c.device_bytes_written) == (4 * n + 4 * threads, 2 * n)
    assert (c.threadgroup_bytes_read, c.threadgroup_bytes_written) == (0, 0)
    # one 4-byte load instruction per float of src, and per read of n
    assert c.device_loads_by_index == {0: {4: n}, 1: {}, 2: {4: threads}}
    assert c.threadgroup_loads_by_width == {}


def test_vector_accesses_count_their_width():
    lib = library(KERNELS, True)
    threads = 64
    src = rng().random(4 * threads, dtype=np.float32)
    dst = np.zeros(4 * threads, np.float16)
    c = lib.dispatch("copy4_to_half4", buffers={0: src, 1: dst}, grid=(2,), threadgroup=(32,))
    # one float4 (16 bytes) in, one half4 (8 bytes) out per thread
    assert c.device_bytes_read_by_index == {0: 16 * threads, 1: 0}
    assert c.device_bytes_written_by_index == {0: 0, 1: 8 * threads}
    # the instruction mix: one 16-byte load per thread, not four 4-byte ones
    assert c.device_loads_by_index == {0: {16: threads}, 1: {}}


def test_uint4_chunks_of_half_rows():
    """The dense loader's forms (reinterpret_cast to uint4, uint4(0u), a uint4
    threadgroup tile read back as half) compile and run, and each chunk is one
    16-byte load: 8x fewer load instructions than 2-byte half loads of the
    same bytes (the halves read back from the tile)."""
    lib = library(KERNELS, True)
    tpg, groups = 32, 2
    src = rng().standard_normal(tpg * groups * 8).astype(np.float16)
    dst = np.full_like(src, np.nan)
    c = lib.dispatch("half_rows_as_uint4", buffers={0: src, 1: dst}, grid=(groups,), threadgroup=(tpg,),
                     threadgroup_memory={0: tpg * 16})
    np.testing.assert_array_equal(dst, src * np.float16(2))
    threads = tpg * groups
    assert c.device_loads_by_index == {0: {16: threads}, 1: {}}
    assert c.threadgroup_loads_by_width == {2: 8 * threads}
    assert c.threadgroup_bytes_read == c.device_bytes_read_by_index[0] == 16 * threads


@pytest.mark.parametrize("k,j", [(0, 0), (5, 3)])
def test_barriers_once_per_group_and_per_simdgroup(instrumented, k, j):
    lib = library(KERNELS, instrumented)
    groups, tpg = 3, 40  # 40 threads: two SIMD-groups, the second one ragged (8 lanes)
    out = np.zeros(groups * tpg, np.uint32)
    c = lib.dispatch("barriers", buffers={0: out}, bytes={1: u32(k), 2: u32(j)}, grid=(groups,), threadgroup=(tpg,))
    assert (out == 1).all()
    assert c.threadgroup_barriers == groups * k
    assert c.simdgroup_barriers == groups * 2 * j
    assert (c.threadgroups, c.threads) == (groups, groups * tpg)
    if instrumented:
        assert c.device_bytes_written_by_index[0] == 4 * groups * tpg


@pytest.mark.parametrize("m", [1, 4])
def test_mmas_once_per_simdgroup(instrumented, m):
    lib = library(KERNELS, instrumented)
    groups, sgs = 2, 2  # 64 threads per group: 2 SIMD-groups
    a = rng().standard_normal(64, dtype=np.float32)
    b = rng().standard_normal(64, dtype=np.float32)
    out = np.full(groups * sgs * 64, np.nan, np.float32)
    c = lib.dispatch("mmas", buffers={0: a, 1: b, 2: out}, bytes={3: u32(m)}, grid=(groups,), threadgroup=(32 * sgs,))
    expect = m * (a.reshape(8, 8).astype(np.float64) @ b.reshape(8, 8))
    for blk in out.reshape(groups * sgs, 8, 8):
        np.testing.assert_allclose(blk, expect, rtol=1e-5, atol=1e-5)
    simdgroups = groups * sgs
    assert c.simdgroup_mmas == simdgroups * m
    assert (c.simdgroup_loads, c.simdgroup_stores) == (2 * simdgroups, simdgroups)
    if instrumented:
        # a simdgroup_load of an 8x8 float matrix reads 256 bytes, a store writes 256
        assert c.device_bytes_read_by_index[0] == c.device_bytes_read_by_index[1] == 256 * simdgroups
        assert c.device_bytes_written_by_index == {0: 0, 1: 0, 2: 256 * simdgroups, 3: 0}


def test_exp_calls_count_lanes_and_elements(instrumented):
    lib = library(KERNELS, instrumented)
    groups, tpg = 2, 48
    x = rng().random(groups * tpg, dtype=np.float32)
    out = np.full(groups * tpg, np.nan, np.float32)
    c = lib.dispatch("exps", buffers={0: x, 1: out}, grid=(groups,), threadgroup=(tpg,))
    lid = np.arange(tpg)
    per_group = (2 * np.sum(lid % 3 == 0)  # exp2(float2): 2 each
                 + np.sum(lid % 3 == 1)  # exp(float): 1 each
                 + 4 * np.sum((lid % 3 == 2) & (lid % 5 == 0)))  # fast::exp2(half4): 4 each
    assert per_group == 2 * 16 + 16 + 4 * 3  # lids 5, 20, 35 take the last branch
    assert c.exp2_calls == groups * per_group
    got = out.reshape(groups, tpg)
    xs = x.reshape(groups, tpg)
    np.testing.assert_allclose(got[:, 1::3], np.exp(xs[:, 1::3]), rtol=1e-6)


def test_threadgroup_bytes():
    lib = library(KERNELS, True)
    groups, tpg = 2, 64
    out = np.full(groups * tpg, np.nan, np.float32)
    c = lib.dispatch("tg_traffic", buffers={0: out}, threadgroup_memory={0: 4 * tpg}, grid=(groups,),
                     threadgroup=(tpg,))
    assert not np.isnan(out).any()
    threads = groups * tpg
    assert c.threadgroup_bytes_written == threads * (4 + 2)  # one float of dyn, one ushort of tag
    assert c.threadgroup_bytes_read == threads * (4 + 4 + 2)  # two floats, one ushort
    assert c.threadgroup_barriers == groups
    assert c.device_bytes_written_by_index == {0: 4 * threads} and c.device_bytes_read == 0


def test_fast_build_has_no_byte_counts_and_same_events():
    fast, inst = library(KERNELS, False), library(KERNELS, True)
    args = dict(buffers={0: np.zeros(96, np.float32)}, threadgroup_memory={0: 4 * 48}, grid=(2,), threadgroup=(48,))
    cf = fast.dispatch("tg_traffic", **args)
    ci = inst.dispatch("tg_traffic", **args)
    assert all(getattr(cf, f) is None for f in BYTE_FIELDS)
    assert all(getattr(ci, f) is not None for f in BYTE_FIELDS)
    assert event_counts(cf) == event_counts(ci)


def test_counts_do_not_depend_on_the_schedule():
    lib = library(KERNELS, True)
    x = rng().random(96, dtype=np.float32)
    runs = {}
    for seed in (0, 7, 99):
        out = np.zeros(96, np.float32)
        e = lib.dispatch("exps", buffers={0: x, 1: out}, grid=(2,), threadgroup=(48,), seed=seed)
        t = lib.dispatch("tg_traffic", buffers={0: out}, threadgroup_memory={0: 4 * 48}, grid=(2,), threadgroup=(48,),
                         seed=seed)
        m = lib.dispatch("mmas", buffers={0: x[:64].copy(), 1: x[:64].copy(), 2: np.zeros(256, np.float32)},
                         bytes={3: u32(3)}, grid=(2,), threadgroup=(64,), seed=seed)
        runs[seed] = (e, t, m)
    assert runs[0] == runs[7] == runs[99]


def test_counts_are_per_dispatch():
    lib = library(KERNELS, False)
    args = dict(bytes={1: u32(2), 2: u32(1)}, grid=(1,), threadgroup=(32,))
    first = lib.dispatch("barriers", buffers={0: np.zeros(32, np.uint32)}, **args)
    second = lib.dispatch("barriers", buffers={0: np.zeros(32, np.uint32)}, **args)
    assert first == second and first.threadgroup_barriers == 2


@pytest.mark.parametrize("spread", [0, 1], ids=["one_address", "distinct"])
def test_broadcast_and_unique_bytes(spread):
    # Planted both ways (kernels/broadcast_loads): 4 load instructions per
    # lane of src, the 32 lanes at one address (the broadcast rule: 1
    # request per SIMD-group and instruction) or at 32 distinct ones (32).
    # Every SIMD-group of a threadgroup reads the same bytes: the unique
    # bytes count them once per threadgroup, the raw bytes once per lane.
    lib = library(KERNELS, True)
    groups, sgs = 3, 2
    threads = groups * sgs * 32
    src = rng().random(4 * 32, dtype=np.float32)
    dst = np.full(threads, np.nan, np.float32)
    c = lib.dispatch("broadcast_loads", buffers={0: src, 1: dst}, bytes={2: u32(spread)}, grid=(groups,),
                     threadgroup=(32 * sgs,))
    lanes = np.arange(32)
    addr = [lanes * 0 + i if not spread else i * 32 + lanes for i in range(4)]
    s = src.astype(np.float64)
    expect = s[addr[0]].sum() + s[addr[1]].sum() + s[addr[2]] + s[addr[3]]
    np.testing.assert_allclose(dst.reshape(-1, 32), np.broadcast_to(expect, (groups * sgs, 32)), rtol=1e-5)
    per_instruction = 32 if spread else 1
    assert c.device_loads_by_index[0] == {4: 4 * threads}
    assert c.device_load_requests_by_index[0] == 4 * per_instruction * groups * sgs
    assert c.device_request_bytes_by_index[0] == 4 * c.device_load_requests_by_index[0]
    assert c.device_bytes_read_by_index[0] == 4 * 4 * threads
    assert c.device_unique_bytes_read_by_index[0] == 4 * 4 * per_instruction * groups
