"""The Metal backward (shaders/backward/attention_backward.h) on Linux, through the emulator.

Every backward instantiation (3 dtypes x 8 buckets less float32 d72, both kernels) runs in the
SANITIZING emulator build (races, barrier divergence, out-of-bounds) with
every function-constant combination the planner produces, on small ragged
shapes, launched from the op's own plan (tests/backends.py), and is compared
with the float64 oracle under the 2x rule (tests/numerics.py). Wider shapes,
layouts and determinism run on the fast build; the routing, the binding
tables' reach and the read volumes against the FlashAttention-2 backward I/O
model are checked here too (the signatures in test_metal_kernels.py).
"""
import itertools
import math
import os
import sys

import pytest
import torch

import backends
import flash_metal
from backends import emulated_metal_attention_backward
from numerics import DTYPES, assert_gradients_close, dtype_id, lay_out, make_qkv, make_tensor
from repo_paths import ROOT_DIR

BUCKETS = (32, 64, 72, 80, 96, 128, 192, 256)
# A head_dim per bucket, ragged inside it where the bucket allows (zero
# padding to the bucket), 256 exactly.
BUCKET_DIMS = {32: 17, 64: 63, 72: 70, 80: 77, 96: 90, 128: 100, 192: 136, 256: 256}
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
TG_LIMIT = 32 * 1024
# The register budget and hard limit choose_metal_kernel quotes (csrc/metal/families/family.h).
REGISTER_BUDGET = 72
# choose_backward's table (csrc/metal/families/backward.cpp), (bytes per element, bucket): (R owned rows, S streamed rows,
# F feature parts); 8 resident SIMD-groups per core on every named chip (tests/metal/test_metal_plan_limits.py).
# float32 has no 72: its blocks there (16, 16, 3) hold 6, so head dims 65-72 run in 80's (WIDER).
TABLE = {(2, 32): (64, 32, 1), (2, 64): (64, 32, 1), (2, 72): (64, 32, 1), (2, 80): (64, 32, 1),
         (2, 96): (64, 16, 1), (2, 128): (32, 16, 2), (2, 192): (16, 16, 4), (2, 256): (16, 8, 4),
         (4, 32): (64, 32, 1), (4, 64): (32, 16, 2), (4, 80): (32, 16, 2),
         (4, 96): (16, 16, 4), (4, 128): (16, 8, 4), (4, 192): (8, 8, 8), (4, 256): (8, 8, 8)}
WIDER = {(4, 72): 80}  # (bytes per element, bucket): the bucket whose instantiation runs instead
# Every instantiation once: (dtype, bucket) pairs with an instantiation of their own.
INSTANTIATIONS = [(dt, b) for dt in DTYPES for b in BUCKETS if (dt.itemsize, b) not in WIDER]


def _blocks(dispatch):
    """(bq, bk, wm, dsplit) parsed from a backward kernel name (dsplit 1 for the dQ kernel)."""
    fields = {p[:2]: int(p[2:]) for p in dispatch.kernel_name.split("_")[-4:] if p[:2] in ("bq", "bk", "wm", "ds")}
    return fields["bq"], fields["bk"], fields["wm"], fields.get("ds", 1)


def _case(B, Hq, Hkv, Nq, Nk, D, dtype, causal, grad_lse=False, layout="contiguous", seed=0):
    """Fresh inputs, the forward's out and lse (the CPU kernel, same dtype), grad_out and grad_lse."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, layout, generator=g)
    out, lse = torch.ops.flash_metal.attention_forward(q, k, v, causal, None, "auto")
    lq = layout if isinstance(layout, str) else layout[0]
    grad_out = make_tensor((B, Hq, Nq, D), lq, dtype, g)
    gl = torch.randn(B, Hq, Nq, generator=g) if grad_lse else None
    return q, k, v, out, lse, grad_out, gl


def _run(case, causal, **kw):
    q, k, v, out, lse, grad_out, gl = case
    return emulated_metal_attention_backward(grad_out, q, k, v, out, lse, causal, None, gl, **kw)


def _check(case, causal, **kw):
    q, k, v, out, lse, grad_out, gl = case
    grads = _run(case, causal, **kw)
    assert_gradients_close(grads, q, k, v, grad_out, causal, None, gl)
    return grads


def _plan(Nq, Nk, D, dtype, Hq=1, Hkv=1, B=1, causal=False, grad_lse=None):
    q = torch.empty(B, Hq, Nq, D, dtype=dtype)
    k = torch.empty(B, Hkv, Nk, D, dtype=dtype)
    return flash_metal.explain(q, k, k, causal, backward=True, grad_lse=grad_lse)


@pytest.mark.parametrize("dtype, bucket", INSTANTIATIONS, ids=[f"{dtype_id(dt)}-d{b}" for dt, b in INSTANTIATIONS])
def test_every_instantiation_sanitized(dtype, bucket):
    # Both kernels of the instantiation, every function-constant combination
    # (dQ: causal, align_q, align_k, has_grad_lse; dK/dV: the first three),
    # GQA (2 query heads per kv head), D padded to the bucket. A is aligned
    # to every block of both kernels (all powers of 2 up to 32); A + 5 and
    # A + 3 are ragged for all of them: Nq > Nk (causal rows with no key)
    # and Nk > Nq both occur.
    D = BUCKET_DIMS[bucket]
    probe = _plan(8, 8, D, dtype)
    A = max(max(_blocks(d)[:2]) for d in probe.dispatches)
    seen = set()
    for Nq, Nk in [(A, A), (A + 5, A), (A, A + 3), (A + 5, A + 3)]:
        for causal, grad_lse in itertools.product((False, True), (False, True)):
            case = _case(1, 2, 1, Nq, Nk, D, dtype, causal, grad_lse, seed=Nq * 7 + Nk + causal + 2 * grad_lse)
            _check(case, causal, instrumented=True)
            for d, _ in backends.LAST_DISPATCHES:
                seen.add((d.kernel_name, d.function_constants))
    dq, dkdv = probe.dispatches
    # Constants 0-3 (causal, align_q, align_k, has_grad_lse) in every combination; no option (4-9)
    # here (tests/metal/test_metal_backward_features.py sweeps those).
    assert {c[:4] for n, c in seen if n == dq.kernel_name} == set(itertools.product((False, True), repeat=4))
    assert {c[:3] for n, c in seen if n == dkdv.kernel_name} == set(itertools.product((False, True), repeat=3))
    assert not any(any(c[4:10]) for _, c in seen)
    # fc_dense (10): packed inputs, on exactly when D fills the bucket
    assert {c[10] for _, c in seen} == {D == bucket}
    assert {n for n, _ in seen} == {dq.kernel_name, dkdv.kernel_name}


# Shapes for the fast build: batch, GQA and MQA, Nq != Nk both ways (causal
# rows with no key), one query row, lengths past several blocks, every
# layout of numerics (strided, transposed, offset, storage end).
SWEEP = [
    # B, Hq, Hkv, Nq, Nk, D, layout
    (2, 4, 2, 70, 45, 64, "contiguous"),
    (1, 3, 1, 33, 100, 96, "transposed"),
    (1, 2, 2, 100, 37, 128, "offset_slice"),
    (2, 2, 1, 9, 130, 40, "every_other"),
    (1, 4, 1, 1, 50, 256, "d_outer"),
    (1, 2, 1, 65, 65, 80, "storage_end_bnhd"),
    (1, 1, 1, 129, 3, 32, "storage_end"),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SWEEP, ids=[f"{s[0]}x{s[1]}x{s[2]}_{s[3]}x{s[4]}_d{s[5]}_{s[6]}" for s in SWEEP])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_fast_build_shapes_and_layouts(dtype, shape, causal):
    B, Hq, Hkv, Nq, Nk, D, layout = shape
    _check(_case(B, Hq, Hkv, Nq, Nk, D, dtype, causal, grad_lse=Nq % 2 == 1, layout=layout), causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_strided_out_lse_and_gradients_of_the_outputs(dtype):
    # out, lse, grad_out and grad_lse are inputs with any strides too: each
    # laid out differently (NaN in every gap, so a wrong stride reads NaN).
    causal = True
    q, k, v, out, lse, grad_out, gl = _case(2, 4, 2, 37, 29, 72, dtype, causal, grad_lse=True, layout="transposed")
    out_s = lay_out(out, "every_other")
    go_s = lay_out(grad_out, "d_outer")

    def stats_view(t):
        B, H, N = t.shape
        view = torch.full((B, N, H + 1), float("nan"))[..., 1:].transpose(1, 2)
        view.copy_(t)
        return view

    lse_s, gl_s = stats_view(lse), stats_view(gl)
    plan = flash_metal.explain(q, k, v, causal, backward=True, grad_out=go_s, out=out_s, lse=lse_s, grad_lse=gl_s)
    assert plan.dispatches[0].function_constants[3] is True
    grads = emulated_metal_attention_backward(go_s, q, k, v, out_s, lse_s, causal, None, gl_s, instrumented=True)
    assert_gradients_close(grads, q, k, v, grad_out, causal, None, gl)


def test_rows_that_see_no_key_get_zero_grad_q_and_add_nothing():
    # Causal with Nk < Nq: the first Nq - Nk rows see no key (lse = -inf).
    # Their grad_q is exactly 0, and their grad_out, however large, changes
    # no grad_k / grad_v.
    causal = True
    q, k, v, out, lse, grad_out, _ = _case(1, 2, 1, 40, 25, 64, torch.float32, causal)
    empty = 40 - 25
    assert torch.isinf(lse[..., :empty]).all() and torch.isfinite(lse[..., empty:]).all()
    dq, dk, dv = _run((q, k, v, out, lse, grad_out, None), causal, instrumented=True)
    assert (dq[..., :empty, :] == 0).all() and (dq[..., empty:, :] != 0).any()
    loud = grad_out.clone()
    loud[..., :empty, :] = 1e6
    dq2, dk2, dv2 = _run((q, k, v, out, lse, loud, None), causal)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2) and torch.equal(dq, dq2)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_deterministic_across_runs_and_thread_schedules(dtype):
    # No atomics: the same inputs give bitwise-equal gradients, whatever
    # order the emulator runs the threads in (seed 0: fixed; others shuffled).
    case = _case(2, 6, 2, 77, 61, 64, dtype, True, grad_lse=True)
    first = _run(case, True)
    for seed in (0, 3, 11):
        again = _run(case, True, seed=seed)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_routing_blocks_memory_and_reasons_for_every_head_dim(dtype):
    size = 4 if dtype == torch.float32 else 2
    for D in range(1, 257):
        bucket = next(b for b in BUCKETS if b >= D)
        wider = WIDER.get((size, bucket))
        if wider:  # no float32 72: its blocks would hold 6 resident SIMD-groups; 80's hold 8
            assert "the 72-wide blocks reach only 6 resident simdgroups per core" in \
                _plan(45, 30, D, dtype).reason
            bucket = wider
        plan = _plan(45, 30, D, dtype, Hq=4, Hkv=2, B=3, causal=D % 2 == 0, grad_lse=torch.empty(3, 4, 45))
        dq, dkdv = plan.dispatches
        tname = DTYPE_NAMES[dtype]
        assert dq.kernel_name.startswith(f"flash_backward_dq_{tname}_d{bucket}_bq")
        assert dkdv.kernel_name.startswith(f"flash_backward_dkdv_{tname}_d{bucket}_bq")
        (qbq, qbk, qwm, qsplit), (kbq, kbk, kwm, split) = _blocks(dq), _blocks(dkdv)
        # One (R owned, S streamed, F feature parts) for both kernels: R / 8
        # row groups of F SIMD-groups each (choose_backward's table).
        assert (qbq, qbk, qsplit) == (kbk, kbq, split) == TABLE[(size, bucket)]
        assert qbq * qsplit == 8 * qwm and kbk * split == 8 * kwm and qwm == kwm <= 8
        assert dq.grid == (math.ceil(45 / qbq), 4, 3) and dq.threadgroup == (32 * qwm, 1, 1)
        assert dkdv.grid == (math.ceil(30 / kbk), 2, 3) and dkdv.threadgroup == (32 * kwm, 1, 1)
        dense = D == bucket  # fc_dense (index 10): packed inputs, no padding columns
        assert dq.function_constants == (D % 2 == 0, 45 % qbq == 0, 30 % qbk == 0, True) + (False,) * 6 + (dense, False)
        assert dkdv.function_constants == (D % 2 == 0, 45 % kbq == 0, 30 % kbk == 0, False) + (False,) * 6 + (dense, False)
        for d, own, streamed in ((dq, qbq, qbk), (dkdv, kbk, kbq)):
            rows = 2 * (own + streamed)
            padded = rows * (bucket * size + 16)
            # The parts' split-K scratch (2 x S / 8 fragments of 256 bytes per SIMD-group) if it fits.
            partials = own // 8 * split * 2 * (streamed // 8) * 256 if split > 1 else 0
            partials = partials if rows * bucket * size + partials <= TG_LIMIT else 0
            assert d.threadgroup_memory == (padded if padded + partials <= TG_LIMIT else rows * bucket * size) + partials
            assert d.threadgroup_memory <= TG_LIMIT and d.threadgroup_memory % 16 == 0
        # Delta per row; float32 also the dQ kernel's log2 row sums of P for the dK/dV kernel (issue 40)
        assert plan.scratch == {"delta": 3 * 4 * 45 * (2 if size == 4 else 1)}
        # Live values per lane (accumulators over the parts + one block of P
        # and dP + 16 of addresses and counters), within the budget.
        dq_floats, dkdv_floats = bucket // 4 // split + qbk // 2, bucket // 2 // split + kbq // 2
        assert (dq.live_registers, dkdv.live_registers) == (dq_floats + 16, dkdv_floats + 16)
        assert max(dq_floats, dkdv_floats) + 16 <= REGISTER_BUDGET
        assert plan.reason.startswith("backward:") and "atomics-free" in plan.reason
        assert f"{dq_floats} live floats" in plan.reason and f"{dkdv_floats} live floats" in plan.reason
        assert "within the 72-value register budget" in plan.reason
        assert (f"split over {split} simdgroups by features" in plan.reason) == (split > 1)
        assert ("zero-padded" in plan.reason) == (D != bucket)


def test_backward_accepts_only_auto_and_forward_plans_are_unchanged():
    q = torch.empty(1, 2, 20, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="impl must be 'auto'"):
        flash_metal.explain(q, q, q, impl="prefill", backward=True)
    fwd = flash_metal.explain(q, q, q)
    assert fwd.reason.startswith("prefill:") and set(fwd.scratch) == {"partial_out", "partial_stats"}
    # Without grad_lse the dQ kernel binds lse in its slot (never read).
    plan = flash_metal.explain(q, q, q, backward=True)
    dq, dkdv = plan.dispatches
    assert dq.function_constants[3] is False
    options = {"attn_mask", "cu_seqlens_q", "cu_seqlens_k"}
    assert set(dq.buffers) == {"q", "k", "v", "out", "lse", "grad_out", "grad_q", "grad_lse", "delta"} | options
    assert set(dkdv.buffers) == {"q", "k", "v", "lse", "grad_out", "grad_k", "grad_v", "delta"} | options
    # One slot per tensor across both kernels (and the forward's).
    for name in set(dq.buffers) & set(dkdv.buffers):
        assert dq.buffers[name] == dkdv.buffers[name]
    for name in set(dq.buffers) & set(fwd.buffers):
        assert dq.buffers[name] == fwd.buffers[name]


@pytest.mark.parametrize("D", [64, 256], ids=["d64", "d256_split"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_reads_match_the_flashattention2_backward_io_model(causal, D):
    # Exact device reads of K, V, Q and dO per dispatch (instrumented build),
    # against the split's I/O model: the dQ kernel reads Q, dO and O once and
    # K, V once per (query block, query head); the dK/dV kernel reads K, V
    # once and Q, dO once per (key block, query head), i.e. FlashAttention-2's
    # backward (K/V once, Q/dO once per key block) plus the dQ kernel's K/V
    # pass that replaces its atomics. Causal skips blocks: fewer reads. At
    # D = 256 the feature parts (SIMD-groups) share one threadgroup's tiles.
    # Causal: long enough that both kernels skip blocks at 64 owned rows
    # (float16 D = 64) and 32 streamed ones.
    B, Hq, Hkv, Nq, Nk, dtype = (1, 2, 1, 130, 120, torch.float16) if causal else (1, 4, 2, 70, 50, torch.float16)
    case = _case(B, Hq, Hkv, Nq, Nk, D, dtype, causal)
    _check(case, causal, instrumented=True)
    (dq, dq_counts), (dkdv, dkdv_counts) = backends.LAST_DISPATCHES
    e = 2  # bytes per element
    q_bytes, kv_bytes = B * Hq * Nq * D * e, B * Hkv * Nk * D * e
    (bq, _, _, _), (_, bk, _, split) = _blocks(dq), _blocks(dkdv)
    assert split == (4 if D == 256 else 1)  # parts share the threadgroup's tiles: no extra reads
    r1, r2 = dq_counts.device_bytes_read_by_index, dkdv_counts.device_bytes_read_by_index
    idx = dq.buffers
    full = {
        (1, 1): q_bytes,  # dQ kernel: q
        (1, 8): q_bytes,  # dQ kernel: grad_out
        (1, 3): q_bytes,  # dQ kernel: out (Delta)
        (1, 2): math.ceil(Nq / bq) * (Hq // Hkv) * kv_bytes,  # dQ kernel: k (and v below)
        (2, 1): kv_bytes,  # dK/dV kernel: k (and v)
        (2, 2): math.ceil(Nk / bk) * q_bytes,  # dK/dV kernel: q (and grad_out)
    }
    got = {
        (1, 1): r1[idx["q"]], (1, 8): r1[idx["grad_out"]], (1, 3): r1[idx["out"]],
        (1, 2): (r1[idx["k"]], r1[idx["v"]]), (2, 1): (r2[idx["k"]], r2[idx["v"]]),
        (2, 2): (r2[idx["q"]], r2[idx["grad_out"]]),
    }
    for key in ((1, 1), (1, 8), (1, 3), (2, 1)):
        want = full[key]
        assert got[key] == (want if key != (2, 1) else (want, want)), key
    for key in ((1, 2), (2, 2)):
        a, b = got[key]
        assert a == b, key
        assert (a < full[key]) if causal else (a == full[key]), key
    # The time model's loop (benchmarks/model/core/timing.py backward_blocks,
    # whose blocks each get a serial section) is the kernels': one
    # threadgroup per listed entry, 2 barriers per streamed block (3 with
    # feature parts: the split-K sum), plus the dQ kernel's 1 per
    # threadgroup before Delta (2 with feature parts).
    root = ROOT_DIR
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.model.core.counts import Shape
    from benchmarks.model.core.timing import backward_blocks

    per_block = 3 if split > 1 else 2
    for d, c, per_tg in ((dq, dq_counts, 2 if split > 1 else 1), (dkdv, dkdv_counts, 0)):
        blocks, _, heads = backward_blocks(d.kernel_name, Shape(B, Hq, Hkv, Nq, Nk, D), causal)
        assert c.threadgroups == len(blocks) * heads
        assert c.threadgroup_barriers == per_block * sum(blocks) * heads + per_tg * c.threadgroups
    if not causal:
        # No product is repeated (split-K, attention_backward.h): per (8
        # real rows, streamed block) the F parts together run S and dP once
        # (D / 8 MMAs per 8 streamed rows each) and the accumulators (dQ; dK
        # and dV) once: the counts of whole-feature SIMD-groups (main's
        # kernels), whatever F is. (Planted: parts that recompute S and dP,
        # the float32 D = 256 fallback, count 2F x D / 8 for them instead.)
        frags = D // 8
        (_, qbk, _, _), (kbq, _, _, _) = _blocks(dq), _blocks(dkdv)
        assert dq_counts.simdgroup_mmas == B * Hq * math.ceil(Nq / 8) * math.ceil(Nk / qbk) * (
            2 * frags + frags) * (qbk // 8)
        assert dkdv_counts.simdgroup_mmas == B * Hq * math.ceil(Nk / 8) * math.ceil(Nq / kbq) * (
            2 * frags + 2 * frags) * (kbq // 8)
        plan = flash_metal.explain(case[0], case[1], case[2], causal, None, "auto", backward=True)
        assert ("split-K: no matrix product repeated" in plan.reason) == (split > 1)
        assert "recomputes its rows' S and dP" not in plan.reason


@pytest.mark.parametrize("bucket", [64, 256], ids=["d64", "d256"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_fast_math_build(dtype, bucket):
    # Apple's compiler defaults to fast math (no infinities): the backward
    # meets lse = -inf on rows that see no key and must not compute with it.
    # The emulator's fast-math flavour (clang -ffast-math) folds code that
    # relies on infinities; causal with Nk < Nq has such rows.
    causal = True
    case = _case(1, 2, 1, 37, 21, BUCKET_DIMS[bucket], dtype, causal, grad_lse=True)
    assert torch.isinf(case[4]).any()
    _check(case, causal, fast_math=True)
    assert backends.metal_library(False, True).fast_math


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_model_scaling_rule_and_io_model(causal):
    # The model's backward (benchmarks/model) predicts big problems from counts
    # scaled off three emulated sizes (n = 2, 3, 4 units of 64): the rule
    # must reproduce a fourth emulated size (n = 5, two heads) exactly, and
    # its I/O model must equal the counted K+V and Q+dO reads.
    # benchmarks/ is a package at the repository root, not installed.
    root = ROOT_DIR
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.model.core import backward_counts as BM
    from benchmarks.model.core import gpus as G
    from benchmarks.model.core.counts import Shape
    from benchmarks.model.core.unfused import unfused_seconds
    from benchmarks.model.families.backward import io_measured, io_model

    s = Shape(1, 2, 2, 320, 320, 32)
    emulated = BM.emulate(s, torch.float16, causal)
    scaled = BM.scaled_counts(s, torch.float16, causal)
    assert [r.kernel for r in scaled] == [r.kernel for r in emulated]
    for a, b in zip(scaled, emulated):
        assert a.counts == b.counts and a.grid == b.grid
    assert io_measured(emulated) == io_model(s, 2, emulated, causal)
    # The unfused model: 4 GEMMs of 2 N^2 D FLOPs and 7 N^2 elements per head, at least.
    gpu = G.BY_NAME["M3 Max"]
    assert unfused_seconds(s, torch.float16, gpu) > 0
