"""The tensor-op backward at head dim 256, split along D (issue 21, item 2): shaders/tensor_ops/attention_backward_mpp_dsplit.h.

Two kernels: flash_backward_mpp_dsplit_dq (one pair of SIMD-groups on 16 query rows, each half
owning 128 features; Delta and dQ) and flash_backward_mpp_dsplit_dkdv (two pairs on 16 keys each,
sharing each staged 16-row Q / dO block; dK, dV). Partial S and dP meet in threadgroup memory.
They run from a partial MSL 4 build of their own (backends.metal_mpp_dsplit_backward_library),
launched from the op's backward plan (csrc/metal/launch_backward.cpp), under both lane layouts
("m5" and "scrambled"), gradients NaN-poisoned before the launch
(backends.emulated_metal_attention_backward) and compared with autograd of the float64 reference by
the 2x rule. Proof the kernels ran: the plan's names, the partial library's dispatched_names(), and
the exact matmul2d runs and threadgroup barriers per launch.

Planted bugs (kept below): the threadgroup barrier between the partials' write and their sum in the
dQ kernel removed (a race), and one half adding its own partial dP instead of the other's (NotClose).
"""
import itertools
import math
import os
import shutil

import pytest
import torch

import backends
import flash_metal
from backends import LAST_DISPATCHES, emulated_metal_attention_backward, metal_mpp_dsplit_backward_library
from flash_metal.reference import attention_reference, attention_varlen_reference
from metal_emulator import EmulatorError, compile_library
from numerics import NotClose, assert_gradients_close, assert_varlen_gradients_close, make_qkv, make_tensor
from test_sinks import assert_sinks_grad_close
from repo_paths import ROOT_DIR

LAYOUTS = ("m5", "scrambled")
NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
# Head dim; rows per SIMD-group (and per dQ threadgroup: one pair); keys per dQ block; keys per dK/dV
# threadgroup (two pairs); queries per streamed dK/dV block; halves of a pair.
D, ROWS, BK, BKV, BQ, HALVES = 256, 16, 32, 32, 16, 2


def names(dtype):
    return (f"flash_backward_mpp_dsplit_dq_{NAMES[dtype]}_d{D}_bq{ROWS}_bk{BK}_wn{HALVES}",
            f"flash_backward_mpp_dsplit_dkdv_{NAMES[dtype]}_d{D}_bk{BKV}_bq{BQ}_wn{HALVES}")


# Threadgroup memory (16-bit): dQ, per half Q_h, dO_h (16 x 128), dS (16 x 32), float partial S and dP
# (16 x 32 each), 4 stats and a partial Delta per row; dK/dV, the shared Q and dO block (16 x 256 each) and
# 4 floats per query, per SIMD-group float partial S^T, dP^T and 16-bit P^T, dS^T (16 x 16 each).
DQ_BYTES = HALVES * (ROWS * (2 * D // 2 + BK) * 2 + (2 * ROWS * BK + ROWS * 4 + ROWS) * 4)
DKV_BYTES = 2 * BQ * D * 2 + BQ * 16 + 4 * (2 * ROWS * BQ * 4 + 2 * ROWS * BQ * 2)


def expected(B, Hq, Nq, Nk, causal):
    """((dQ runs, barriers), (dK/dV runs, barriers)). dQ: per 16-row threadgroup, one barrier (Delta's
    exchange), then per key block it sees 3 runs per half and 2 barriers. dK/dV: per 32-key threadgroup,
    query head and query block the threadgroup sees, 3 barriers; 4 runs per half of each pair that the
    block sees (a pair past the keys or before the block's rows skips its products, not the barriers).
    Causal is bottom-right: row i sees keys j <= i + Nk - Nq."""
    up = Nk - Nq
    dq_runs = dq_bar = 0
    for r0 in range(0, Nq, ROWS):
        last = min(r0 + ROWS, Nq) - 1
        visible = min(max(last + up + 1, 0), Nk) if causal else Nk
        blocks = math.ceil(visible / BK)
        dq_runs += 3 * HALVES * blocks
        dq_bar += 1 + 2 * blocks
    kv_runs = kv_bar = 0
    first_block = (lambda k0: min(max(k0 - up, 0), Nq) // BQ if causal else 0)
    for t0 in range(0, Nk, BKV):
        tg_first = first_block(t0)
        kv_bar += 3 * (math.ceil(Nq / BQ) - tg_first)
        for k0 in range(t0, min(t0 + BKV, Nk), ROWS):
            kv_runs += 4 * HALVES * (math.ceil(Nq / BQ) - max(first_block(k0), tg_first))
    return (B * Hq * dq_runs, B * Hq * dq_bar), (B * Hq * kv_runs, B * Hq * kv_bar)


def _case(B, Hq, Hkv, Nq, Nk, dtype, causal, seed, grad_lse=False):
    """Fresh inputs, the forward's out and lse (the CPU kernel, same dtype), grad_out and grad_lse."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, generator=g)
    out, lse = torch.ops.flash_metal.attention_forward(q, k, v, causal, None, "auto")
    grad_out = make_tensor((B, Hq, Nq, D), "contiguous", dtype, g)
    gl = torch.randn(B, Hq, Nq, generator=g) if grad_lse else None
    return q, k, v, out, lse, grad_out, gl


def run(case, causal, layout, instrumented=False, seed=0, counted=True, **options):
    """The forced tensor_ops backward at D = 256 under `layout`; checks the plan and, with counted, the counts."""
    q, k, v, out, lse, grad_out, gl = case
    B, Hq, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    plan = flash_metal.explain(q, k, v, causal, None, "tensor_ops", backward=True, grad_out=grad_out, out=out,
                               lse=lse, grad_lse=gl, **options)
    want = list(names(q.dtype)) + (["flash_sinks_grad"] if "sinks" in options else [])
    assert [d.kernel_name for d in plan.dispatches] == want
    dq_plan, dkv_plan = plan.dispatches[:2]
    if "cu_seqlens_q" not in options:
        assert dq_plan.grid == (math.ceil(Nq / ROWS), Hq, B) and dq_plan.threadgroup == (64, 1, 1)
        assert dkv_plan.grid == (math.ceil(Nk / BKV), Hkv, B) and dkv_plan.threadgroup == (128, 1, 1)
    assert dq_plan.threadgroup_memory == DQ_BYTES == 27264
    assert dkv_plan.threadgroup_memory == DKV_BYTES == 28928
    grads = emulated_metal_attention_backward(grad_out, q, k, v, out, lse, causal, None, gl, impl="tensor_ops",
                                              instrumented=instrumented, seed=seed, mpp_layout=layout, **options)
    assert [d.kernel_name for d, _ in LAST_DISPATCHES] == want
    assert set(names(q.dtype)) <= metal_mpp_dsplit_backward_library(instrumented).dispatched_names()
    (_, c1), (_, c2) = LAST_DISPATCHES[:2]
    assert c1.mpp_runs > 0 and c2.mpp_runs > 0
    if counted:
        assert ((c1.mpp_runs, c1.threadgroup_barriers), (c2.mpp_runs, c2.threadgroup_barriers)) == \
            expected(B, Hq, Nq, Nk, causal)
    return grads


# (dtype, (Nq, Nk), Hq, Hkv): ragged everywhere; GQA 2 with one ragged 16-row dQ threadgroup and a dK/dV
# threadgroup whose second pair has no key (Nk 40: keys 32..39, pair 2 from 48); more queries than keys
# (causal: the first rows see no key), GQA 3.
SHAPES = [(torch.float16, (17, 40), 2, 1), (torch.bfloat16, (37, 21), 3, 1)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, shape, hq, hkv", SHAPES, ids=["f16-17x40", "bf16-37x21"])
def test_matches_float64(dtype, shape, hq, hkv, causal, layout):
    Nq, Nk = shape
    case = _case(1, hq, hkv, Nq, Nk, dtype, causal, seed=Nq * 100 + Nk + causal)
    grads = run(case, causal, layout)
    q, k, v, out, lse, grad_out, gl = case
    assert_gradients_close(grads, q, k, v, grad_out, causal, None, gl)
    if causal and Nq > Nk:  # rows that see no key get dQ = 0 exactly
        assert torch.all(grads[0][:, :, :Nq - Nk] == 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sanitized_with_grad_lse(layout):
    # The instrumented build: device bounds (ragged blocks read nothing past q, k, v, dO), races (the
    # partials' exchange, the shared block, the tiles). Batch 2, GQA 2, causal, a gradient into lse.
    case = _case(2, 2, 1, 20, 35, torch.bfloat16 if layout == "m5" else torch.float16, True, seed=55,
                 grad_lse=True)
    grads = run(case, True, layout, instrumented=True)
    q, k, v, out, lse, grad_out, gl = case
    assert_gradients_close(grads, q, k, v, grad_out, True, None, gl)


def test_deterministic_across_schedules():
    # Bitwise the same gradients from two thread schedules: no atomics, and both halves of a pair add the
    # same two partials (commutative), whichever half finishes first.
    case = _case(1, 2, 1, 33, 40, torch.bfloat16, True, seed=33)
    a = run(case, True, "scrambled", seed=0)
    b = run(case, True, "scrambled", seed=9)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ---- the options, each once (layouts alternating) --------------------------------------------------------

OPTION_CASES = {
    "window": (False, dict(window_left=9, window_right=4), torch.float16),
    "causal-window-softcap": (True, dict(window_left=13, softcap=3.0), torch.bfloat16),
    "mask-bool": (True, dict(attn_mask="bool"), torch.bfloat16),
    "mask-input": (False, dict(attn_mask="input"), torch.float16),
    "mask-float32": (False, dict(attn_mask="float32"), torch.float16),
    "sinks": (True, dict(sinks=True), torch.float16),
}


def _option_case(name, Nq, Nk, B=1, grad_lse=False):
    """Fresh inputs with the options made concrete; out and lse from the float64 oracle."""
    causal, opts, dtype = OPTION_CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)) + Nq)
    q, k, v = make_qkv(B, 2, 1, Nq, Nk, D, dtype, generator=g)
    opts = dict(opts)
    kind = opts.get("attn_mask")
    if kind is not None:
        drop = torch.rand(B, 2, Nq, Nk, generator=g) < 0.3
        opts["attn_mask"] = ~drop if kind == "bool" else torch.randn(B, 2, Nq, Nk, generator=g).masked_fill(
            drop, float("-inf")).to(torch.float32 if kind == "float32" else dtype)
    if opts.get("sinks"):
        opts["sinks"] = torch.randn(2, generator=g)
    out, lse = attention_reference(q, k, v, causal, None, **opts)
    grad_out = make_tensor(q.shape, "contiguous", dtype, g)
    gl = torch.randn(B, 2, Nq, generator=g) if grad_lse else None
    return (q, k, v, out.to(dtype), lse.float(), grad_out, gl), causal, opts


def _check_options(case, causal, opts, layout, instrumented=False):
    q, k, v, out, lse, grad_out, gl = case
    full = expected(*q.shape[:3], k.shape[2], causal)
    grads = run(case, causal, layout, instrumented=instrumented, counted="window_left" not in opts, **opts)
    if "window_left" in opts:  # block skipping: fewer products than without the left window, in both kernels
        (_, c1), (_, c2) = LAST_DISPATCHES[:2]
        assert c1.mpp_runs < full[0][0] and c2.mpp_runs < full[1][0]
    assert_gradients_close(grads[:3], q, k, v, grad_out, causal, None, gl, **opts)
    if "sinks" in opts:
        assert_sinks_grad_close(grads[3], q, k, v, opts["sinks"], grad_out,
                                torch.zeros_like(lse) if gl is None else gl, causal,
                                {n: x for n, x in opts.items() if n != "sinks"})


@pytest.mark.parametrize("name", list(OPTION_CASES))
def test_options_match_float64(name):
    case, causal, opts = _option_case(name, 37, 70)
    _check_options(case, causal, opts, LAYOUTS[list(OPTION_CASES).index(name) % 2])


def test_every_option_at_once_sanitized():
    # Sinks, a bool mask that leaves some rows no key, a left window, softcap, batch 2, a gradient into lse.
    case, causal, opts = _option_case("sinks", 21, 40, B=2, grad_lse=True)
    q, k = case[0], case[1]
    mask = torch.rand(2, 2, 21, 40, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[:, :, :3] = False
    opts.update(attn_mask=mask, window_left=20, softcap=4.0)
    ref = attention_reference(q, k, case[2], causal, None, **opts)
    case = case[:3] + (ref[0].to(q.dtype), ref[1].float()) + case[5:]
    q, k, v, out, lse, grad_out, gl = case
    grads = run(case, causal, "scrambled", instrumented=True, counted=False, **opts)
    assert_gradients_close(grads[:3], q, k, v, grad_out, causal, None, gl, **opts)
    assert_sinks_grad_close(grads[3], q, k, v, opts["sinks"], grad_out, gl, causal,
                            {n: x for n, x in opts.items() if n != "sinks"})


VARLEN_LENGTHS = [(20, 35), (0, 4), (1, 1), (17, 0)]


@pytest.mark.parametrize("causal, opts, layout", [(False, {}, "m5"),
                                                  (True, dict(window_left=12, softcap=4.0), "scrambled")],
                         ids=["full-m5", "causal-win-cap-scrambled"])
def test_varlen_sanitized(causal, opts, layout):
    # Packed sequences, empty ones included, GQA 2, instrumented: each threadgroup reads only its sequence.
    g = torch.Generator().manual_seed(21 + causal)
    cq = torch.tensor([0, *itertools.accumulate(a for a, _ in VARLEN_LENGTHS)], dtype=torch.int32)
    ck = torch.tensor([0, *itertools.accumulate(b for _, b in VARLEN_LENGTHS)], dtype=torch.int32)
    q = torch.randn(int(cq[-1]), 4, D, generator=g).half()
    k = torch.randn(int(ck[-1]), 2, D, generator=g).half()
    v = torch.randn(int(ck[-1]), 2, D, generator=g).half()
    out, lse = attention_varlen_reference(q, k, v, cq, ck, causal, None, **opts)
    grad_out = torch.randn(q.shape, generator=g).half()
    mq, mk = max(a for a, _ in VARLEN_LENGTHS), max(b for _, b in VARLEN_LENGTHS)
    grads = emulated_metal_attention_backward(grad_out, q, k, v, out.half(), lse.float(), causal, None, None,
                                              impl="tensor_ops", instrumented=True, mpp_layout=layout,
                                              cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk,
                                              **opts)
    assert [d.kernel_name for d, _ in LAST_DISPATCHES] == list(names(torch.float16))
    assert all(d.function_constants[9] for d, _ in LAST_DISPATCHES)  # fc_varlen
    assert_varlen_gradients_close(grads, q, k, v, grad_out, cq, ck, causal, None, None, **opts)


# ---- routing: impl='tensor_ops' and Auto's gate (csrc/metal/families/backward_tensor_ops_dsplit.cpp) ----------------


def _explain(dtype=torch.float16, d=D, gpu="base", impl="tensor_ops", dv=None, **options):
    q = torch.randn(1, 4, 40, d).to(dtype)
    k = torch.randn(1, 2, 60, d).to(dtype)
    v = torch.randn(1, 2, 60, dv or d).to(dtype)
    out = torch.randn(1, 4, 40, dv or d).to(dtype)
    return flash_metal.explain(q, k, v, True, None, impl, gpu, backward=True, grad_out=out, out=out,
                               lse=torch.zeros(1, 4, 40), **options)


def test_forced_plan_explains_itself():
    plan = _explain()
    assert [x.kernel_name for x in plan.dispatches] == list(names(torch.float16))
    assert plan.reason.startswith("forced: tensor_ops (impl='tensor_ops'); backward (split-D tensor ops)")
    assert "each half owning 128 features" in plan.reason and "27264 bytes" in plan.reason


@pytest.mark.parametrize("gpu, dtype, dv, picked, words", [
    ("m5+tensor_ops", torch.float16, None, True, "a model, not a measurement"),
    ("m5-max+tensor_ops", torch.bfloat16, None, True, "ahead of the simdgroup backward at D = 256"),
    ("m5", torch.float16, None, False, "tensor ops not used: planned without a Mac"),
    ("m5+tensor_ops", torch.float32, None, False, "tensor ops not used: float32 stays on simdgroup matrices"),
    ("m5+tensor_ops", torch.float16, 128, False, "tensor ops not used: a v head dim of its own"),
    ("m4-max+tensor_ops", torch.float16, None, False, "backward"),
])
def test_auto_takes_it_only_where_the_gate_holds(gpu, dtype, dv, picked, words):
    plan = _explain(dtype, gpu=gpu, impl="auto", dv=dv)
    assert all(("_mpp_dsplit_" in x.kernel_name) == picked for x in plan.dispatches[:2]), plan.reason
    assert words in plan.reason
    if gpu.startswith("m4"):  # not a candidate there: no word of it
        assert "tensor ops" not in plan.reason


def test_the_switch_keeps_auto_off_it(monkeypatch):
    assert "_mpp_dsplit_" in _explain(gpu="m5+tensor_ops", impl="auto").dispatches[0].kernel_name
    monkeypatch.setenv("FLASH_METAL_DISABLE_TENSOR_OPS", "1")
    plan = _explain(gpu="m5+tensor_ops", impl="auto")
    assert "_mpp_" not in plan.dispatches[0].kernel_name
    assert "FLASH_METAL_DISABLE_TENSOR_OPS=1 turns them off" in plan.reason


def test_refusals_name_the_argument():
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        _explain(torch.float32)
    with pytest.raises(ValueError, match="head_dim 64, 96, 128 or 256"):
        _explain(d=192)
    with pytest.raises(ValueError, match="every option but a v head dim of its own"):
        _explain(dv=128)


def test_auto_routed_backward_runs_the_split_d_kernels():
    case = _case(1, 2, 1, 18, 20, torch.float16, False, seed=18)
    q, k, v, out, lse, grad_out, gl = case
    grads = emulated_metal_attention_backward(grad_out, q, k, v, out, lse, False, gpu="m5+tensor_ops",
                                              mpp_layout="scrambled")
    assert [d.kernel_name for d, _ in LAST_DISPATCHES] == list(names(torch.float16))
    assert_gradients_close(grads, q, k, v, grad_out, False)


def test_partial_library_holds_exactly_the_split_d_backward():
    lib = metal_mpp_dsplit_backward_library(False)
    assert set(lib.kernel_names()) == {n for dt in NAMES for n in names(dt)}
    assert all(lib.max_threads(n) == 128 for n in lib.kernel_names())
    assert not any("_dsplit_" in n for n in backends.metal_mpp_library(False).kernel_names())


# ---- planted bugs ----------------------------------------------------------------------------------------


def _planted(tmp_path, monkeypatch, old, new):
    """A copy of shaders/ with `old` (once in attention_backward_mpp_dsplit.h) replaced by `new`; the float16
    kernels alone in an instrumented partial library, which the backend runs."""
    root = ROOT_DIR
    shutil.copytree(os.path.join(root, "shaders"), tmp_path / "shaders")
    header = tmp_path / "shaders" / "tensor_ops" / "attention_backward_mpp_dsplit.h"
    text = header.read_text()
    assert text.count(old) == 1, old
    header.write_text(text.replace(old, new))
    lib = compile_library([str(tmp_path / "shaders" / "attention_mpp.metal")], instrumented=True, msl=4,
                          only=list(names(torch.float16)))
    monkeypatch.setattr(backends, "metal_mpp_dsplit_backward_library", lambda instrumented, fast_math=False: lib)
    return lib


def _planted_run():
    q, k, v, out, lse, grad_out, gl = _case(1, 2, 1, 17, 40, torch.float16, True, seed=17)
    grads = emulated_metal_attention_backward(grad_out, q, k, v, out, lse, True, impl="tensor_ops",
                                              instrumented=True, mpp_layout="m5")
    assert [d.kernel_name for d, _ in LAST_DISPATCHES] == list(names(torch.float16))
    assert_gradients_close(grads, q, k, v, grad_out, True)


def test_planted_missing_barrier_before_the_partials_sum_is_a_race(tmp_path, monkeypatch):
    barrier = "    threadgroup_barrier(mem_flags::mem_threadgroup);  // both halves' partial S and dP written"
    _planted(tmp_path, monkeypatch, barrier, "    // (planted: no barrier) both halves' partial S and dP written")
    with pytest.raises(EmulatorError) as info:
        _planted_run()
    assert "race" in info.value.kinds


def test_planted_summing_the_wrong_partial_is_not_close(tmp_path, monkeypatch):
    right = "\n      const float dp_full = dp[i] + dp_other[code];"  # the dQ kernel's (the dK/dV kernel's is deeper)
    _planted(tmp_path, monkeypatch, right, "\n      const float dp_full = dp[i] + dp_mine[code];")
    with pytest.raises(NotClose):
        _planted_run()
