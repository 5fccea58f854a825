"""The tile loader's dense path (issue 19): fc_dense, [[function_constant(10)]].

The prefill and backward kernels copy their Q, K, V (and dO) tiles with
prefill_load_tile (shaders/prefill/attention_prefill.h). Under fc_dense it copies
16-byte uint4 chunks, each thread stepping 32-bit offsets along the tile;
otherwise one load per element at any stride. The planner
(csrc/metal/launch.cpp, dense_loader) sets fc_dense when every loaded tensor
has unit feature stride, D equals its bucket, 16-byte aligned rows (storage
offset, batch, head and row strides) and row strides small enough for 32-bit
offsets; dense_expected below restates that rule.

Both paths are compared with the float64 oracle (FlashAttention's 2x rule)
on the same values in a dense layout and in a general one, and each run
proves which path ran: the dispatch's function constant, and the emulator's
instruction mix (device_loads_by_index: 16-byte loads only on the dense
path, 2- or 4-byte ones on the general path). The buckets 72, 80 and 96
exercise the loader's row wrap (THREADS is not a multiple of the chunks per
row) and its ragged last iteration.
"""
import os

import numpy as np
import pytest
import torch

import flash_metal
from backends import LAST_DISPATCHES, emulated_metal_attention, emulated_metal_attention_backward
from numerics import assert_attention_close, assert_gradients_close, dtype_id, lay_out, make_qkv, make_tensor
from repo_paths import ROOT_DIR, TESTS_DIR

DENSE = 10  # index of fc_dense (kDenseFunctionConstant in csrc/metal/plan.h)
BUCKETS = (32, 64, 72, 80, 96, 128, 256)


def bucket_of(d):
    return min(b for b in BUCKETS if b >= d)


def dense_expected(*tensors):
    """csrc/metal/launch.cpp's dense_loader rule for (B, H, N, D) tensors: unit
    feature stride, D == bucket, 16-byte aligned storage offset and strides
    (batch and head only where that dimension has more than one entry), row
    stride * 128 rows * element size below 2^31."""
    for t in tensors:
        es = t.element_size()
        D = t.shape[-1]
        if D != bucket_of(D) or t.stride(3) != 1 or (t.storage_offset() * es) % 16:
            return False
        for dim in (0, 1, 2):
            if (dim == 2 or t.shape[dim] > 1) and (t.stride(dim) * es) % 16:
                return False
        if t.stride(2) * es * 128 >= 2**31:
            return False
    return True


def loads_by_tensor(d, counts):
    return {name: counts.device_loads_by_index[i] for name, i in d.buffers.items() if name in ("q", "k", "v")}


def check_path(d, counts, dense, dtype):
    """The dispatch ran the loader path it claims: its constant, and (instrumented)
    q, k and v read only by 16-byte loads (dense) or only by element-wide ones."""
    assert d.function_constants[DENSE] is dense
    if counts.device_loads_by_index is None:
        return
    elem = torch.empty((), dtype=dtype).element_size()
    for name, mix in loads_by_tensor(d, counts).items():
        assert set(mix) == ({16} if dense else {elem}), (name, mix)


# (layout, dense?) pairs over the same values: "contiguous" and "transposed"
# (a packed (B, N, H, D) buffer) qualify at D == bucket; "storage_end" (a
# storage offset of 37 elements), "offset_slice" (row stride D + 3) and
# "every_other" (feature stride 2) never do.
LAYOUTS = ["contiguous", "transposed", "storage_end", "offset_slice", "every_other"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("D", [64, 60])
def test_planner_sets_fc_dense_by_the_rule(layout, D):
    q, k, v = make_qkv(2, 4, 2, 40, 48, D, torch.float16, layout)
    want = dense_expected(q, k, v)
    assert want == (D == 64 and layout in ("contiguous", "transposed"))
    plan = flash_metal.explain(q, k, v, impl="prefill")
    assert plan.function_constants[DENSE] is want
    assert ("Tile loader: dense" in plan.reason) == want
    assert ("fc_dense off" in plan.reason) == (not want)
    if D == 60:
        assert "head_dim 60 is below its bucket 64" in plan.reason
    back = flash_metal.explain(q, k, v, backward=True)
    assert [d.function_constants[DENSE] for d in back.dispatches] == [want, want]


def test_planner_checks_grad_out_and_each_input():
    q, k, v = make_qkv(1, 2, 2, 40, 48, 64, torch.float32)
    assert dense_expected(q, k, v)
    g = lay_out(torch.randn(1, 2, 40, 64), "every_other")
    back = flash_metal.explain(q, k, v, backward=True, grad_out=g)
    assert [d.function_constants[DENSE] for d in back.dispatches] == [False, False]
    assert "grad_out's feature stride is 2, not 1" in back.reason
    assert flash_metal.explain(q, k, v, backward=True, grad_out=g.contiguous()).dispatches[0].function_constants[DENSE]
    # one misaligned input is enough: v at a 1-float storage offset (4 bytes)
    v_off = torch.randn(1 + v.numel())[1:].view(v.shape)
    plan = flash_metal.explain(q, k, v_off, impl="prefill")
    assert not plan.function_constants[DENSE] and "v's storage offset is not a multiple of 16 bytes" in plan.reason
    # a storage offset of 4 floats (16 bytes) is aligned
    v16 = torch.randn(4 + v.numel())[4:].view(v.shape)
    assert flash_metal.explain(q, k, v16, impl="prefill").function_constants[DENSE]


def _forward(q, k, v, causal, instrumented):
    out, lse = emulated_metal_attention(q, k, v, causal, None, "prefill", instrumented)
    ((d, counts),) = LAST_DISPATCHES
    return out, lse, d, counts


# Every bucket: 72 (f16 CPR 9, f32 18), 80 (10, 20) and 96 (12, 24) step
# with the row wrap; 72 and 80 have a ragged last iteration. Ragged Nq and
# Nk (edge tiles) and GQA.
@pytest.mark.parametrize("layout", ["contiguous", "storage_end"])
@pytest.mark.parametrize("D", BUCKETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
def test_forward_both_loaders_match_the_oracle(dtype, D, layout):
    q, k, v = make_qkv(1, 4, 2, 45, 70, D, dtype, layout)
    dense = layout == "contiguous"
    assert dense_expected(q, k, v) is dense
    for causal in (False, True):
        out, lse, d, counts = _forward(q, k, v, causal, instrumented=False)
        check_path(d, counts, dense, dtype)
        assert_attention_close(out, lse, q, k, v, causal)


@pytest.mark.parametrize("D", [72, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
def test_forward_dense_sanitized(dtype, D):
    """The sanitizing build (bounds, races, barriers) on the dense path, ragged edges."""
    q, k, v = make_qkv(1, 2, 1, 45, 70, D, dtype, "transposed")
    out, lse, d, counts = _forward(q, k, v, True, instrumented=True)
    check_path(d, counts, True, dtype)
    assert_attention_close(out, lse, q, k, v, True)


def test_dense_issues_8x_fewer_load_instructions_at_d128_f16():
    """Same values, same bytes: the dense path reads q, k and v with one 16-byte
    load per 8 halves, the general path with one 2-byte load per half."""
    runs = {}
    for layout in ("contiguous", "storage_end"):
        q, k, v = make_qkv(1, 2, 2, 64, 64, 128, torch.float16, layout)
        out, lse, d, counts = _forward(q, k, v, False, instrumented=True)
        assert_attention_close(out, lse, q, k, v, False)
        runs[layout] = (d, counts)
    (dd, cd), (dg, cg) = runs["contiguous"], runs["storage_end"]
    check_path(dd, cd, True, torch.float16)
    check_path(dg, cg, False, torch.float16)
    for name in ("q", "k", "v"):
        bytes_d = cd.device_bytes_read_by_index[dd.buffers[name]]
        bytes_g = cg.device_bytes_read_by_index[dg.buffers[name]]
        assert bytes_d == bytes_g > 0
        assert loads_by_tensor(dd, cd)[name] == {16: bytes_d // 16}
        assert loads_by_tensor(dg, cg)[name] == {2: bytes_g // 2}
        assert sum(loads_by_tensor(dg, cg)[name].values()) == 8 * sum(loads_by_tensor(dd, cd)[name].values())


@pytest.mark.parametrize("layout", ["transposed", "storage_end"])
@pytest.mark.parametrize("D", [64, 72, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
def test_backward_both_loaders_match_the_oracle(dtype, D, layout):
    """Both backward kernels (dQ; dK/dV) on each path; grad_out in the same layout."""
    g = torch.Generator().manual_seed(1)
    q, k, v = make_qkv(1, 4, 2, 45, 38, D, dtype, layout, generator=g)
    dout = make_tensor((1, 4, 45, D), layout, dtype, g)
    assert dense_expected(q, k, v, dout) is (layout == "transposed")
    # float32's backward runs head dims 65-72 in its 80-wide kernels (choose_backward:
    # 72's blocks hold 6 resident SIMD-groups), where D = 72 is padding: the general path.
    wider = dtype == torch.float32 and D == 72
    dense = layout == "transposed" and not wider
    out, lse = torch.ops.flash_metal.attention_forward(q, k, v, True, None, "auto")
    grads = emulated_metal_attention_backward(dout, q, k, v, out, lse, causal=True)
    assert len(LAST_DISPATCHES) == 2
    for d, counts in LAST_DISPATCHES:
        assert ("_d80_" in d.kernel_name) == wider
        check_path(d, counts, dense, dtype)
    assert_gradients_close(grads, q, k, v, dout, True)


def test_backward_dense_sanitized_and_counted():
    """The sanitizing build on the dense backward (ragged edges, GQA): both
    kernels read q, k, v and grad_out by 16-byte loads only."""
    g = torch.Generator().manual_seed(2)
    q, k, v = make_qkv(1, 4, 2, 45, 38, 72, torch.float16, "contiguous", generator=g)
    dout = make_tensor((1, 4, 45, 72), "contiguous", torch.float16, g)
    out, lse = torch.ops.flash_metal.attention_forward(q, k, v, True, None, "auto")
    grads = emulated_metal_attention_backward(dout, q, k, v, out, lse, causal=True, instrumented=True)
    for d, counts in LAST_DISPATCHES:
        check_path(d, counts, True, torch.float16)
        assert set(counts.device_loads_by_index[d.buffers["grad_out"]]) == {16}
    assert_gradients_close(grads, q, k, v, dout, True)


IR_KERNELS = os.path.join(TESTS_DIR, "dense_loader_ir.metal")
# (dtype, tile rows, DMAX, threads) of tests/dense_loader_ir.metal's dense_tile instantiations.
TILES = [(np.float16, 32, 72, 128), (np.float32, 32, 80, 128), (np.float16, 16, 128, 128), (np.float32, 8, 256, 64)]
NP_NAMES = {np.float16: "half", np.float32: "float"}


def load_tiles(kernels):
    """Runs every dense_tile instantiation of `kernels` (sanitizing build) on a
    source with a padded row stride and a ragged edge; returns the mismatches."""
    from metal_emulator import compile_library

    lib = compile_library([kernels], instrumented=True)
    bad = []
    for dt, rows, dmax, threads in TILES:
        vec = 16 // np.dtype(dt).itemsize
        stride = dmax + 3 * vec  # row stride: whole 16-byte chunks, not the row length
        valid = rows - 3  # the last 3 rows are past the sequence: zeros, never read
        src = np.random.default_rng(rows + dmax).standard_normal(valid * stride).astype(dt)
        dst = np.full(rows * dmax, np.nan, dt)
        c = lib.dispatch(f"dense_tile_{NP_NAMES[dt]}_r{rows}_d{dmax}_t{threads}",
                         buffers={0: src, 3: dst}, bytes={1: np.int32(stride).tobytes(), 2: np.int32(valid).tobytes()},
                         threadgroup=(threads,), threadgroup_memory={0: rows * (dmax * np.dtype(dt).itemsize + 16)})
        want = np.zeros((rows, dmax), dt)
        want[:valid] = src.reshape(valid, stride)[:, :dmax]
        if not np.array_equal(dst.reshape(rows, dmax), want):
            bad.append((dt, rows, dmax, threads))
        # every source byte read once, by 16-byte loads only
        assert c.device_loads_by_index[0] == {16: valid * dmax * np.dtype(dt).itemsize // 16}
    return bad


def test_dense_loader_copies_tiles_exactly():
    """The loader alone, at the shapes the kernels use: DMAX 72 and 80 (chunks
    per row 9 / 20: the row wrap, a ragged last iteration), 128, 256 with 64
    threads; a row stride longer than the row; edge rows zero-filled."""
    assert load_tiles(IR_KERNELS) == []


def _planted_copy(tmp_path, kernels, old, new):
    """A copy of shaders/ with `old` (present exactly once in attention_prefill.h)
    replaced by `new`, and of the test kernels file `kernels` beside it; returns
    the copied kernels file's path."""
    import shutil

    root = ROOT_DIR
    shutil.copytree(os.path.join(root, "shaders"), tmp_path / "shaders")
    (tmp_path / "tests").mkdir()
    shutil.copy(kernels, tmp_path / "tests")
    header = tmp_path / "shaders" / "prefill" / "attention_prefill.h"
    text = header.read_text()
    assert text.count(old) == 1
    header.write_text(text.replace(old, new))
    return str(tmp_path / "tests" / os.path.basename(kernels))


def test_planted_loader_bug_is_caught(tmp_path):
    """Planted: the row wrap forgets to move the source offset to the next row.
    load_tiles sees the tiles that wrap (DMAX 72, 80) come out wrong."""
    bad = load_tiles(_planted_copy(tmp_path, IR_KERNELS, "      s_off += rs - CPR;\n", ""))
    assert [(rows, dmax) for _, rows, dmax, _ in bad] == [(32, 72), (32, 80)]


def test_dense_loader_ir_has_no_64bit_multiply_or_runtime_division():
    """Over the optimised IR (-O2, as the fast build compiles): the dense
    loader, at the shapes the kernels use, issues no 64-bit multiply and no
    division by a runtime value. The check is proven on a planted loader
    (a runtime division and a 64-bit multiply per chunk) and on the general
    path (64-bit index math per element), which it flags."""
    from metal_emulator import slow_integer_math

    found = slow_integer_math(IR_KERNELS)
    dense = {name: insts for name, insts in found.items() if name.startswith("dense_tile_")}
    assert len(dense) == 4
    assert all(insts == [] for insts in dense.values()), dense
    planted = found["planted_slow_tile"]
    assert any(i.startswith("mul") and " i64 " in i for i in planted), planted
    assert any(i.startswith(("sdiv", "srem", "udiv", "urem")) for i in planted), planted
    assert any(i.startswith("mul") and " i64 " in i for i in found["whole_loader_half_r32_d72_t128"])


# ---- the Q.K^T feature loop runs to a compile-time bound (issue 19) -------------------------

PREFILL_IR = os.path.join(TESTS_DIR, "prefill_ir.metal")
# tests/prefill_ir.metal's instantiation: DMAX 32, BK 32, so TD = 4 feature and TK = 4 key fragments.
PREFILL_IR_KERNEL, PREFILL_TD, PREFILL_TK = "prefill_half_d32_bq32_bk32_wm4", 4, 4
# The Q.K^T loop as shipped (attention_prefill.h): to the bucket's TD, with a uniform guard.
QK_LOOP = "      FM_UNROLL for (int i = 0; i < TDP; ++i) {\n        const int dd = part * TDP + i;"


def test_prefill_qk_feature_loop_is_unrolled(tmp_path):
    """In the optimised IR (-O2, as the fast build compiles) of a shipped
    prefill instantiation, every MMA of Q.K^T and of P.V is its own call
    site: TD x TK each, so both loops unrolled (the QK loop's trip count is
    the compile-time TD / parts, not the runtime ceil(D / 8)). Planted: the QK loop
    run to d_frags, as before issue 19, leaves one loop body of TK sites."""
    from metal_emulator import mma_call_sites

    assert mma_call_sites(PREFILL_IR) == {PREFILL_IR_KERNEL: 2 * PREFILL_TD * PREFILL_TK}
    planted_file = _planted_copy(
        tmp_path, PREFILL_IR, QK_LOOP,
        "      for (int dd = part * TDP; dd < min(d_frags, part * TDP + TDP); ++dd) {")
    planted = mma_call_sites(planted_file)[PREFILL_IR_KERNEL]
    assert planted < 2 * PREFILL_TD * PREFILL_TK, planted
