"""MPP tensor ops (MSL 4): matmul2d and cooperative-tensor reductions against
float64 references under both lane layouts, and the planted bugs each check
catches (README.md, "MPP tensor ops")."""

import numpy as np
import pytest
import torch
from conftest import kernel_path

from metal_emulator import EmulatorError, compile_library
from metal_emulator import _build

LAYOUTS = ("m5", "scrambled")


def lib(instrumented=False):
    return compile_library([kernel_path("mpp.metal")], instrumented=instrumented, msl=4)


def poisoned(*shape):
    return np.full(shape, np.nan, np.float32)


def f64(t):
    return t.to(torch.float64).numpy()


def assert_product(out, expect, bound, k):
    """float32 accumulation of k products: |error| <= 2 k eps32 (|A||B| + |C|)."""
    tol = 2 * k * 2.0**-24 * bound + 1e-30
    err = np.abs(out.astype(np.float64) - expect)
    assert np.all(err <= tol), f"max error {err.max()} (max allowed {tol.max()})"


# (kernel, dtype, M, N, K, transpose_left, transpose_right, accumulate, slice offsets a_x, a_y, b_x, b_y)
GEMMS = [
    ("mpp_gemm_half_16x32_nt_mul", torch.float16, 16, 32, 24, False, True, False, (3, 1, 0, 2)),
    ("mpp_gemm_bfloat_16x32_tn_acc", torch.bfloat16, 16, 32, 40, True, False, True, (0, 5, 2, 0)),
    ("mpp_gemm_float_20x32_nn_acc", torch.float32, 20, 32, 17, False, False, True, (1, 1, 1, 1)),
    ("mpp_gemm_float_20x32_tt_mul", torch.float32, 20, 32, 9, True, True, False, (2, 0, 0, 3)),
]


def stored(rng, dtype, rows, cols, x, y):
    """A rows x cols matrix at column x, row y of a larger row-major array (leading dimension > x + cols)."""
    full = torch.from_numpy(rng.standard_normal((y + rows + 1, x + cols + 3))).to(dtype)
    return full, full[y:y + rows, x:x + cols]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", GEMMS, ids=[g[0] for g in GEMMS])
def test_gemm_tile_matches_float64(case, layout):
    name, dtype, m, n, k, tl, tr, acc, (ax, ay, bx, by) = case
    rng = np.random.default_rng(7)
    a_full, a = stored(rng, dtype, *((k, m) if tl else (m, k)), ax, ay)
    b_full, b = stored(rng, dtype, *((n, k) if tr else (k, n)), bx, by)
    ldc = n + 5
    c = rng.standard_normal((m, ldc)).astype(np.float32)
    out = poisoned(m, ldc)
    p = np.array([k, a_full.shape[1], b_full.shape[1], ldc, ax, ay, bx, by], np.int32)
    counts = lib().dispatch(name, buffers={0: a_full, 1: b_full, 2: c, 3: out}, bytes={4: p.tobytes()}, grid=(1,),
                            threadgroup=(32,), mpp_layout=layout)
    assert (counts.mpp_runs, counts.mpp_flops) == (1, 2 * m * n * k)  # K read from the left operand
    la, lb = f64(a.T if tl else a), f64(b.T if tr else b)
    cc = c[:, :n].astype(np.float64) if acc else 0.0
    assert_product(out[:, :n], la @ lb + cc, np.abs(la) @ np.abs(lb) + np.abs(cc), k)
    assert np.isnan(out[:, n:]).all()  # nothing written past the tile


def two_phase_inputs():
    rng = np.random.default_rng(3)
    a, b, v = (torch.from_numpy(rng.standard_normal(s)).to(torch.float16) for s in ((32, 16), (16, 16), (16, 16)))
    out = rng.standard_normal((32, 16)).astype(np.float32)
    return a, b, v, out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_phase_through_threadgroup_memory(layout):
    """execution_simdgroups<2>: a cooperative tensor stored to threadgroup memory, a barrier, then
    multiply_accumulate into device memory; the instrumented build finds no race."""
    a, b, v, out = two_phase_inputs()
    out0 = out.astype(np.float64)
    counts = lib(True).dispatch("mpp_two_phase", buffers={0: a, 1: b, 2: v, 3: out}, grid=(1,), threadgroup=(64,),
                                mpp_layout=layout)
    assert counts.threadgroup_barriers == 1  # run()'s rendezvous is not counted as a barrier
    assert (counts.mpp_runs, counts.mpp_flops) == (2, 2 * (2 * 32 * 16 * 16))  # once per threadgroup per run()
    p = (f64(a) @ f64(b)).astype(np.float32).astype(np.float64)  # P is stored as float
    assert_product(out, p @ f64(v) + out0, np.abs(p) @ np.abs(f64(v)) + np.abs(out0), 16)


def test_missing_barrier_between_phases_is_a_race():
    a, b, v, out = two_phase_inputs()
    with pytest.raises(EmulatorError) as e:
        lib(True).dispatch("mpp_two_phase_bug", buffers={0: a, 1: b, 2: v, 3: out}, grid=(1,), threadgroup=(64,))
    assert "race" in e.value.kinds and "read-after-write" in str(e.value), str(e.value)


@pytest.mark.parametrize("threads", [32, 96])
def test_simdgroup_count_other_than_the_scope_is_a_usage_finding(threads):
    a, b, v, out = two_phase_inputs()
    with pytest.raises(EmulatorError) as e:
        lib().dispatch("mpp_two_phase", buffers={0: a, 1: b, 2: v, 3: out}, grid=(1,), threadgroup=(threads,))
    assert e.value.kinds == {"usage"} and "execution_simdgroups<N>" in str(e.value), str(e.value)


def test_ragged_simdgroup_is_a_usage_finding():
    a, b = torch.randn(16, 16).to(torch.float16), torch.randn(16, 32).to(torch.float16)
    with pytest.raises(EmulatorError) as e:  # SIMD-group 1 of a 48-thread threadgroup has 16 lanes
        lib().dispatch("mpp_hardcoded_map_bug", buffers={0: a, 1: b, 2: poisoned(16, 32)}, grid=(1,), threadgroup=(48,))
    assert e.value.kinds == {"usage"} and "full 32-lane" in str(e.value), str(e.value)


@pytest.mark.parametrize("name,threads,kind", [("mpp_divergent_lanes_bug", 32, "simd-divergence"),
                                               ("mpp_divergent_simdgroups_bug", 64, "barrier-divergence")])
def test_run_reached_by_part_of_its_scope_is_divergence(name, threads, kind):
    a = torch.randn(16, 16).to(torch.float16)
    with pytest.raises(EmulatorError) as e:
        lib().dispatch(name, buffers={0: a, 1: poisoned(16, 16)}, grid=(1,), threadgroup=(threads,))
    assert kind in e.value.kinds and "matmul2d run" in str(e.value), str(e.value)


def hardcoded_map(layout, seed=1):
    rng = np.random.default_rng(5)
    a, b = (torch.from_numpy(rng.standard_normal(s)).to(torch.float16) for s in ((16, 16), (16, 32)))
    out = poisoned(16, 32)
    lib().dispatch("mpp_hardcoded_map_bug", buffers={0: a, 1: b, 2: out}, grid=(1,), threadgroup=(32,),
                   mpp_layout=layout, mpp_seed=seed)
    la, lb = f64(a), f64(b)
    return out, la @ lb, np.abs(la) @ np.abs(lb)


def test_hardcoded_lane_map_is_right_under_m5_only():
    out, expect, bound = hardcoded_map("m5")  # "m5" is the map MLX hard-codes: slot for slot
    assert_product(out, expect, bound, 16)
    for seed in (1, 2):
        out, expect, bound = hardcoded_map("scrambled", seed)
        with pytest.raises(AssertionError):
            assert_product(out, expect, bound, 16)


def reduce(name, m, n, layout):
    s = np.random.default_rng(11).standard_normal((m, n)).astype(np.float32)
    row_max, row_sum, col_max = poisoned(32, m), poisoned(32, m), poisoned(32, n)
    lib().dispatch(name, buffers={0: s, 1: row_max, 2: row_sum, 3: col_max}, grid=(1,), threadgroup=(32,),
                   mpp_layout=layout)
    return s, row_max, row_sum, col_max


def check_reduction(per_lane, expect, tol, layout, replicas=None):
    """Every row (column) is held by at least one lane, every lane holding it has the right value."""
    for r in range(per_lane.shape[1]):
        held = per_lane[~np.isnan(per_lane[:, r]), r]
        assert held.size >= 1, f"index {r} held by no lane"
        if replicas is not None and layout == "m5":
            assert held.size == replicas, (r, held.size)
        assert np.all(np.abs(held - expect[r]) <= tol[r]), (r, held, expect[r])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,m,n", [("mpp_reduce_16x32", 16, 32), ("mpp_reduce_16x16", 16, 16)])
def test_reductions_match_float64(name, m, n, layout):
    s, row_max, row_sum, col_max = reduce(name, m, n, layout)
    s64 = s.astype(np.float64)
    # m5: a row of a 16-row tile is held by 4 lanes (MLX get_coord), a column by 8
    check_reduction(row_max, s64.max(1), np.zeros(m), layout, replicas=4)
    check_reduction(row_sum, s64.sum(1), n * 2.0**-24 * np.abs(s64).sum(1), layout, replicas=4)
    check_reduction(col_max, s64.max(0), np.zeros(n), layout, replicas=8)


def test_row_reduction_over_the_wrong_dimension_is_caught():
    for layout in LAYOUTS:
        s, row_max, *_ = reduce("mpp_reduce_16x16_columns_bug", 16, 16, layout)
        with pytest.raises(AssertionError):
            check_reduction(row_max, s.astype(np.float64).max(1), np.zeros(16), layout)


def test_bad_layout_and_msl_version_are_refused():
    with pytest.raises(EmulatorError, match="mpp_layout must be one of"):
        lib().dispatch("mpp_reduce_16x16", buffers={i: poisoned(32, 16) for i in range(4)}, mpp_layout="m4")
    with pytest.raises(ValueError, match="msl must be one of"):
        compile_library([kernel_path("mpp.metal")], msl=5)
    # the shipped shaders' build keeps MSL 3.1 in C++17
    assert "-std=c++17" in _build.common_flags() and "-D__METAL_VERSION__=310" in _build.common_flags()


def tf32(x):
    """float32 -> 10 mantissa bits, to nearest even (the emulator's relaxed_precision)."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0xFFF + ((b >> 13) & 1)) & ~np.uint64(0x1FFF)
    return b.astype(np.uint32).view(np.float32)


def slots(name, layout, instrumented=False):
    rng = np.random.default_rng(13)
    s, a, b = (rng.standard_normal((16, 16)).astype(np.float32) for _ in range(3))
    out, out2 = poisoned(16, 16), poisoned(16, 16)
    lib(instrumented).dispatch(name, buffers={0: s, 1: out, 2: a, 3: b, 4: out2}, grid=(1,), threadgroup=(32,),
                               mpp_layout=layout)
    return s, out, a, b, out2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_through_slots_and_relaxed_precision(layout):
    s, out, a, b, out2 = slots("mpp_slots", layout, instrumented=True)
    np.testing.assert_array_equal(out, s)
    ra, rb = tf32(a).astype(np.float64), tf32(b).astype(np.float64)
    assert_product(out2, ra @ rb, np.abs(ra) @ np.abs(rb), 16)
    with pytest.raises(AssertionError):  # TF32-sized, not float32-sized, errors
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        assert_product(out2, a64 @ b64, np.abs(a64) @ np.abs(b64), 16)


def test_ignoring_is_valid_element_is_caught_under_scrambled():
    s, out, *_ = slots("mpp_slots_ignore_valid_bug", "m5", instrumented=True)  # a full 16 x 16 tile: no invalid slot
    np.testing.assert_array_equal(out, s)
    with pytest.raises(EmulatorError) as e:
        slots("mpp_slots_ignore_valid_bug", "scrambled", instrumented=True)
    assert "out-of-bounds" in e.value.kinds, str(e.value)


def test_accumulating_into_an_uncleared_cooperative_tensor_is_nan():
    *_, out2 = slots("mpp_slots_uncleared_bug", "m5")
    assert np.isnan(out2).all()


def chain(name, layout, instrumented=False):
    rng = np.random.default_rng(17)
    q, k, v = (torch.from_numpy(rng.standard_normal((16, 16))).to(torch.float16) for _ in range(3))
    out = poisoned(16, 16)
    counts = lib(instrumented).dispatch(name, buffers={0: q, 1: k, 2: v, 3: out}, grid=(1,), threadgroup=(32,),
                                        mpp_layout=layout)
    p = (f64(q) @ f64(k).T).astype(np.float32).astype(np.float64)  # S is float
    return counts, out, p @ f64(v), np.abs(p) @ np.abs(f64(v))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_destination_converted_to_left_input(layout):
    counts, out, expect, bound = chain("mpp_chain", layout, instrumented=True)
    assert_product(out, expect, bound, 16)
    assert counts.mpp_runs == 2


def test_slot_by_slot_copy_into_an_input_is_right_under_m5_only():
    """PyTorch #191794's bug: a destination copied slot for slot into the next op's input."""
    assert_product(*chain("mpp_chain_slot_copy_bug", "m5")[1:], 16)
    with pytest.raises(AssertionError):
        assert_product(*chain("mpp_chain_slot_copy_bug", "scrambled")[1:], 16)


def same_op_slots(name, layout):
    """(A B^T) * (A2 B2^T) elementwise from two destination cooperative tensors combined slot by slot; for the
    planted bug the second is (A2 B2') from an op of another descriptor (B2' = B2 read as 16 x 32)."""
    rng = np.random.default_rng(29)
    a, a2 = (torch.from_numpy(rng.standard_normal((16, 16))).to(torch.float16) for _ in range(2))
    b, b2 = (torch.from_numpy(rng.standard_normal((32, 16))).to(torch.float16) for _ in range(2))
    out = poisoned(16, 32)
    lib(True).dispatch(name, buffers={0: a, 1: b, 2: a2, 3: b2, 4: out}, grid=(1,), threadgroup=(32,),
                       mpp_layout=layout)
    b2m = f64(b2).T if name == "mpp_same_op_slots" else f64(b2).reshape(16, 32)
    x, y = f64(a) @ f64(b).T, f64(a2) @ b2m
    # Each factor's float32 error is within 2 k eps of its |A||B| (assert_product), so the product's within
    # twice that of the two bounds' product (plus one rounding, far below).
    bound = 2 * (np.abs(f64(a)) @ np.abs(f64(b)).T) * (np.abs(f64(a2)) @ np.abs(b2m))
    return out, x * y, bound


@pytest.mark.parametrize("layout", LAYOUTS)
def test_destinations_of_one_op_type_share_their_slots(layout):
    """What the tensor-op backward relies on (dS = P * (dP - Delta) slot by slot): two destination cooperative
    tensors of one op type hold the same element in the same slot, a cooperative tensor's layout being a
    function of its type and thread (README, "MPP tensor ops"), in every layout."""
    assert_product(*same_op_slots("mpp_same_op_slots", layout), 16)


def test_destinations_of_other_op_types_combined_slot_by_slot_is_right_under_m5_only():
    assert_product(*same_op_slots("mpp_other_op_slots_bug", "m5"), 16)
    with pytest.raises(AssertionError):
        assert_product(*same_op_slots("mpp_other_op_slots_bug", "scrambled"), 16)


def k_edge(name, kv, layout, instrumented=False):
    """out = A B over the first kv of 32 keys, both operands' K extents ending at kv (kernels/mpp.metal)."""
    rng = np.random.default_rng(31)
    a, b = (torch.from_numpy(rng.standard_normal(s)).to(torch.float16) for s in ((16, 32), (32, 32)))
    out = poisoned(16, 32)
    counts = lib(instrumented).dispatch(name, buffers={0: a, 1: b, 2: out}, bytes={3: np.array([kv], np.int32).tobytes()},
                                        grid=(1,), threadgroup=(32,), mpp_layout=layout)
    la, lb = f64(a)[:, :kv], f64(b)[:kv]
    return counts, out, la @ lb, np.abs(la) @ np.abs(lb)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_dynamic_k_reads_the_operands_k_extents(layout):
    """The ragged last key block, as the kernels' O += P.V and dQ += dS.K run it: K from the operands."""
    counts, out, expect, bound = k_edge("mpp_k_edge", 20, layout, instrumented=True)
    assert (counts.mpp_runs, counts.mpp_flops) == (1, 2 * 16 * 32 * 20)
    assert_product(out, expect, bound, 20)


def test_a_static_k_past_the_operands_k_extents_is_nan():
    """Planted bug (mpp_k_edge_static_bug): a static K = 32 over operands whose K extents end at 20 keys, as the
    tensor-op kernels' P.V and dS.K ran their last key block before issue 40. Apple's matmul2d does not
    edge-check a static K (undefined: NaN on M5s, llama.cpp PR #27450); the emulator makes every such read NaN,
    so the whole product is NaN. A full block (K extents 32) is right."""
    _, out, *_ = k_edge("mpp_k_edge_static_bug", 20, "m5")
    assert np.isnan(out).all()
    _, out, expect, bound = k_edge("mpp_k_edge_static_bug", 32, "m5")
    assert_product(out, expect, bound, 32)


def test_execution_simdgroups_1_is_execution_simdgroup():
    """Planted bug (mpp_one_as_many_bug): execution_simdgroups<1> on a threadgroup of two SIMD-groups, meant as
    one op the two share. It is execution_simdgroup (one type in Apple's headers): each SIMD-group runs the
    whole op (two runs, not one), so both write every element of the threadgroup tile, a race the instrumented
    build reports."""
    rng = np.random.default_rng(37)
    a, b = (torch.from_numpy(rng.standard_normal(s)).to(torch.float16) for s in ((32, 16), (16, 16)))
    out = poisoned(32, 16)
    counts = lib().dispatch("mpp_one_as_many_bug", buffers={0: a, 1: b, 2: out}, grid=(1,), threadgroup=(64,))
    assert (counts.mpp_runs, counts.mpp_flops) == (2, 2 * (2 * 32 * 16 * 16))
    assert_product(out, f64(a) @ f64(b), np.abs(f64(a)) @ np.abs(f64(b)), 16)
    with pytest.raises(EmulatorError) as e:
        lib(True).dispatch("mpp_one_as_many_bug", buffers={0: a, 1: b, 2: poisoned(32, 16)}, grid=(1,),
                           threadgroup=(64,))
    assert "race" in e.value.kinds, str(e.value)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,tl", [("mpp_transposed_inputs_tt", True), ("mpp_transposed_inputs_nt", False)])
def test_transposed_input_cooperative_tensors(name, tl, layout):
    """Input cooperative tensors of an op with transpose flags (as MLX's nax.h runs them) hold the operand as
    stored and the op reads it transposed: A^T B^T and A B^T from one stored A."""
    rng = np.random.default_rng(41)
    a, b = (torch.from_numpy(rng.standard_normal(s)).to(torch.float16) for s in ((16, 16), (32, 16)))
    out = poisoned(16, 32)
    lib().dispatch(name, buffers={0: a, 1: b, 2: out}, grid=(1,), threadgroup=(32,), mpp_layout=layout)
    la, lb = (f64(a).T if tl else f64(a)), f64(b).T
    assert_product(out, la @ lb, np.abs(la) @ np.abs(lb), 16)


def test_an_innermost_stride_other_than_1_is_refused():
    """Planted bug (mpp_strided_bug): a tensor whose innermost stride is 2 (Apple: it must be 1)."""
    a = torch.randn(16, 32).to(torch.float16)
    with pytest.raises(EmulatorError) as e:
        lib().dispatch("mpp_strided_bug", buffers={0: a, 1: poisoned(16, 16)}, grid=(1,), threadgroup=(32,))
    assert "innermost stride must be 1" in str(e.value), str(e.value)


def map_rows(name, layout, seed=1):
    rng = np.random.default_rng(17)
    s, t = rng.standard_normal((16, 32)).astype(np.float32), rng.standard_normal((16, 16)).astype(np.float32)
    out, out2, flag = poisoned(16, 32), poisoned(16, 16), np.full(1, -1, np.int32)
    counts = lib().dispatch(name, buffers={0: s, 1: t, 2: out, 3: out2, 4: flag}, grid=(1,), threadgroup=(32,),
                            mpp_layout=layout, mpp_seed=seed)
    return s, t, out, out2, int(flag[0]), counts


@pytest.mark.parametrize("layout", LAYOUTS)
def test_map_iterator_broadcasts_a_row_reduction(layout):
    # Same op: always compatible; another op's 16 x 16 tile: compatible under "m5" (a lane holds the same rows
    # in every 16-row destination there), not under this "scrambled" layout, where the checked kernel skips it.
    s, t, out, out2, flag, counts = map_rows("mpp_map_iterator", layout)
    np.testing.assert_array_equal(out, s - s.max(1, keepdims=True))
    assert flag == (1 if layout == "m5" else 0)
    if flag:
        np.testing.assert_array_equal(out2, t - s.max(1, keepdims=True))
    else:
        assert np.isnan(out2).all()
    # Coordinate queries per lane: 2 compatibility checks, one map_iterator per valid element mapped.
    assert counts.mpp_coord_queries == 32 * 2 + 16 * 32 + (16 * 16 if flag else 0)


def test_map_iterator_without_the_compatibility_check_is_refused():
    # The planted bug: mapping another op's elements without asking is_iterator_compatible is right under "m5"
    # and a failure under "scrambled" (undefined on Apple's GPUs where the answer is false).
    s, t, _, out2, _, _ = map_rows("mpp_map_iterator_unchecked_bug", "m5")
    np.testing.assert_array_equal(out2, t - s.max(1, keepdims=True))
    with pytest.raises(EmulatorError, match="is_iterator_compatible"):
        map_rows("mpp_map_iterator_unchecked_bug", "scrambled")
