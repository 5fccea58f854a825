"""Planted bugs: each detector fires on the bug, and the fixed twin runs clean."""

import struct

import numpy as np
import pytest
from conftest import kernel_path, library

from metal_emulator import EmulatorError


with open(kernel_path("bugs.metal"), encoding="utf-8") as _f:
    _BUGS = _f.read().splitlines()


def at(snippet: str, after: str = "") -> str:
    """'bugs.metal:<line>' of the first line containing `snippet` after the line containing `after`."""
    start = next(i for i, l in enumerate(_BUGS) if after in l) if after else 0
    line = next(i for i in range(start, len(_BUGS)) if snippet in _BUGS[i]) + 1
    return f"bugs.metal:{line}"


def lib(instrumented):
    return library("bugs.metal", instrumented)


def dispatch(instrumented, name, **kw):
    lib(instrumented).dispatch(name, **kw)


def expect_finding(kind, instrumented, name, line_fragment=None, **kw):
    with pytest.raises(EmulatorError) as e:
        dispatch(instrumented, name, **kw)
    assert kind in e.value.kinds, str(e.value)
    if line_fragment:
        assert line_fragment in str(e.value), str(e.value)
    return str(e.value)


def test_missing_barrier_is_a_race():
    msg = expect_finding("race", True, "missing_barrier_bug", at("tile[lid] = float(lid);"), buffers={0: np.zeros(64, np.float32)},
                         grid=(1,), threadgroup=(64,))
    assert "read-after-write" in msg and at("out[lid] = tile[(lid + 1) % n];") in msg
    out = np.zeros(64, np.float32)
    dispatch(True, "missing_barrier_fixed", buffers={0: out}, grid=(1,), threadgroup=(64,))
    np.testing.assert_array_equal(out, (np.arange(64) + 1) % 64)


def test_missing_second_barrier_is_a_write_after_read_race():
    msg = expect_finding("race", True, "missing_war_barrier_bug",
                         buffers={0: np.ones(128, np.float32), 1: np.zeros(32, np.float32)}, grid=(1,),
                         threadgroup=(32,))
    assert "write-after-read" in msg


def test_barrier_without_mem_threadgroup_does_not_order_threadgroup_memory():
    expect_finding("race", True, "barrier_wrong_flags_bug", buffers={0: np.zeros(32, np.float32)}, grid=(1,),
                   threadgroup=(32,))


def test_simdgroup_barrier_orders_within_a_simdgroup():
    out = np.zeros(64, np.float32)
    dispatch(True, "simdgroup_exchange", buffers={0: out}, grid=(1,), threadgroup=(64,))
    lid = np.arange(64)
    np.testing.assert_array_equal(out, (lid & ~31) + (31 - (lid & 31)))


@pytest.mark.parametrize("n", [250, 256])
def test_off_by_one_read_caught_at_ragged_size(instrumented, n):
    x = np.arange(n, dtype=np.float32)
    out = np.zeros(n, np.float32)
    args = dict(buffers={0: x, 1: out}, bytes={2: struct.pack("<I", n)}, grid=((n + 31) // 32,), threadgroup=(32,))
    msg = expect_finding("out-of-bounds", instrumented, "neighbor_sum_bug", at("in[gid + 1]"), **args)
    assert f"byte offset {4 * n} of device buffer(0)" in msg
    dispatch(instrumented, "neighbor_sum_fixed", **args)
    np.testing.assert_array_equal(out, x + np.append(x[1:], 0))


def test_early_return_before_barrier(instrumented):
    n = 250  # ragged: the last group has threads past n
    args = dict(buffers={0: np.ones(n, np.float32), 1: np.zeros(n, np.float32)}, bytes={2: struct.pack("<I", n)},
                grid=(8,), threadgroup=(32,))
    msg = expect_finding("barrier-divergence", instrumented, "early_return_bug", **args)
    assert "returned from the kernel" in msg and at("threadgroup_barrier", "early_return_bug") in msg and "threadgroup (7,0,0)" in msg
    dispatch(instrumented, "early_return_fixed", **args)


def test_collective_in_divergent_branch(instrumented):
    msg = expect_finding("simd-divergence", instrumented, "divergent_collective_bug",
                         buffers={0: np.zeros(32, np.float32)}, grid=(1,), threadgroup=(32,))
    assert "simd_sum at" in msg and at("simd_sum", "divergent_collective_bug") in msg
    out = np.zeros(32, np.float32)
    dispatch(instrumented, "divergent_collective_fixed", buffers={0: out}, grid=(1,), threadgroup=(32,))
    assert (out[:16] == 496).all() and (out[16:] == np.arange(16, 32)).all()


def test_lanes_at_different_collectives_deadlock(instrumented):
    msg = expect_finding("simd-divergence", instrumented, "mismatched_collectives_bug",
                         buffers={0: np.zeros(32, np.float32)}, grid=(1,), threadgroup=(32,))
    assert "simd_max" in msg and "simd_min" in msg


def test_threadgroup_array_overflow():
    msg = expect_finding("threadgroup-overflow", True, "tg_overflow_bug", at("tile[lid + 1]"),
                         buffers={0: np.zeros(32, np.float32)}, grid=(1,), threadgroup=(32,))
    assert "'tile'" in msg
    out = np.zeros(32, np.float32)
    dispatch(True, "tg_overflow_fixed", buffers={0: out}, grid=(1,), threadgroup=(32,))
    assert (out == 1).all()


def test_threadgroup_memory_limit(instrumented):
    msg = expect_finding("limits", instrumented, "tg_too_big", buffers={0: np.zeros(32, np.float32)}, grid=(1,),
                         threadgroup=(32,))
    assert "32768-byte limit" in msg


def test_dynamic_threadgroup_memory_counts_toward_limit():
    lib_ = library("threadgroup.metal", False)
    with pytest.raises(EmulatorError) as e:
        lib_.dispatch("share", buffers={0: np.zeros(1024, np.uint32)}, grid=(1,), threadgroup=(1024,),
                      threadgroup_memory={0: 32768})  # + 4 KiB of `stat`
    assert "limits" in e.value.kinds


def test_thread_limit(instrumented):
    msg = expect_finding("limits", instrumented, "missing_barrier_fixed", buffers={0: np.zeros(64, np.float32)},
                         grid=(1,), threadgroup=(33, 32))
    assert "1056 threads" in msg


def test_unset_function_constant_and_unbound_buffer():
    lib_ = library("basic.metal", False)
    with pytest.raises(EmulatorError, match="fc_double"):
        lib_.dispatch("add_one", buffers={0: np.zeros(4, np.float32), 1: np.zeros(4, np.float32)},
                      bytes={2: struct.pack("<I", 4)}, grid=(1,), threadgroup=(4,))
    with pytest.raises(EmulatorError, match=r"\[\[buffer\(1\)\]\] is not bound"):
        lib_.dispatch("add_one", buffers={0: np.zeros(4, np.float32)}, bytes={2: struct.pack("<I", 4)},
                      function_constants={0: True}, grid=(1,), threadgroup=(4,))


def test_shuffled_schedule_is_seeded_and_clean():
    out_a, out_b = np.zeros(64, np.float32), np.zeros(64, np.float32)
    dispatch(True, "missing_barrier_fixed", buffers={0: out_a}, grid=(1,), threadgroup=(64,), seed=123)
    dispatch(True, "missing_barrier_fixed", buffers={0: out_b}, grid=(1,), threadgroup=(64,), seed=0)
    np.testing.assert_array_equal(out_a, out_b)
    # the race is found whatever the order
    for seed in (1, 2, 3):
        expect_finding("race", True, "missing_barrier_bug", buffers={0: np.zeros(64, np.float32)}, grid=(1,),
                       threadgroup=(64,), seed=seed)
