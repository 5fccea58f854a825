"""The backward on Metal 4 tensor ops (impl='tensor_ops', issue 21 item 2): shaders/tensor_ops/attention_backward_mpp.h.

Two kernels of the MSL 4 library (shaders/attention_mpp.metal, run by the emulator's
compile_library(..., msl=4)): flash_backward_mpp_dq (Delta and dQ over query blocks),
then flash_backward_mpp_dkdv (dK and dV over key blocks, the GQA group's heads summed
in a fixed order), launched from the op's own backward plan (csrc/metal/launch.cpp).
Every numerical case runs under both cooperative-tensor lane layouts, "m5" (the
Apple10 map MLX and PyTorch hard-code) and "scrambled" (a seeded permutation), with
the gradients NaN-poisoned before the launch (backends.emulated_metal_attention_backward),
against autograd of the float64 reference by FlashAttention's 2x rule
(assert_gradients_close). Proof the tensor-op kernels ran: the plan's two kernel names,
the MPP library's dispatched_names() and the exact count of matmul2d runs.

Planted bugs (each a one-line change to a copy of the header, one kernel built):
a hard-coded lane map (MLX's M5 formula in place of get_multidimensional_index):
right under "m5", caught under "scrambled"; a missing simdgroup_barrier between
writing dS and the matmul2d that reads it: a race in the instrumented build; the
per-query stats of the dK/dV kernel looked up along the wrong dimension (the key
instead of the query): caught by the 2x rule; the threadgroup barrier after the dK/dV
kernel stages the Q / dO block its SIMD-groups share left out: a race; softcap's
derivative left out of the dQ kernel's dS: grad_q fails the 2x rule.

The options (windows, softcap, bool / additive masks, varlen, sinks with grad_sinks)
run on small ragged GQA shapes under both layouts against the float64 oracle
(flash_metal/reference.py), every option at once and varlen (empty sequences
included) in the instrumented build.
"""
import itertools
import math
import os
import shutil

import pytest
import torch

import backends
import flash_metal
from backends import LAST_DISPATCHES, emulated_metal_attention_backward, metal_mpp_library
from flash_metal.reference import attention_reference, attention_varlen_reference
from metal_emulator import EmulatorError, compile_library
from numerics import assert_gradients_close, assert_varlen_gradients_close, dtype_id, make_qkv, make_tensor
from test_sinks import assert_sinks_grad_close
from repo_paths import ROOT_DIR

LAYOUTS = ("m5", "scrambled")
DTYPES = (torch.float16, torch.bfloat16)
NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
ROWS, BLOCK = 16, 32  # rows per SIMD-group; keys per dQ block, query rows per dK/dV block
# SIMD-groups per threadgroup (csrc/metal/plan_detail.h, tensor_ops_backward_simdgroups): as many of 4 or 2
# as have their slices fit 32 KiB.
DQ_WM = {64: 4, 96: 4, 128: 2}
DKV_WM = {64: 4, 96: 4, 128: 4}


def names(dtype, d):
    return (f"flash_backward_mpp_dq_{NAMES[dtype]}_d{d}_bq{16 * DQ_WM[d]}_bk{BLOCK}",
            f"flash_backward_mpp_dkdv_{NAMES[dtype]}_d{d}_bk{16 * DKV_WM[d]}_bq{BLOCK}")


def tg_bytes(dkdv, d):
    """A threadgroup's memory (16-bit T). dQ, per SIMD-group: Q and dO (16 x D), dS (16 x 32), 4 floats per row.
    dK/dV: the streamed Q and dO block (32 x D each) and 4 floats per query, shared by the SIMD-groups; per
    SIMD-group P^T and dS^T (16 x 32) (K and V are read from device memory)."""
    if dkdv:
        return 2 * BLOCK * d * 2 + BLOCK * 16 + DKV_WM[d] * 2 * ROWS * BLOCK * 2
    return DQ_WM[d] * (2 * ROWS * d * 2 + ROWS * BLOCK * 2 + ROWS * 16)


def expected_runs(B, Hq, Hkv, Nq, Nk, causal):
    """matmul2d runs: dQ kernel 3 per (16-row SIMD-group, key block it sees) (S, dP, dQ); dK/dV kernel 4 per
    (16-key SIMD-group, query head of its group, query block that sees it) (S^T, dP^T, dV, dK). Causal is
    bottom-right: row i sees keys j <= i + Nk - Nq."""
    up = Nk - Nq
    dq = 0
    for r0 in range(0, Nq, ROWS):
        last = min(r0 + ROWS, Nq) - 1
        visible = min(max(last + up + 1, 0), Nk) if causal else Nk
        dq += 3 * math.ceil(visible / BLOCK)
    dkv = 0
    for k0 in range(0, Nk, ROWS):
        first = min(max(k0 - up, 0), Nq) if causal else 0
        dkv += 4 * (math.ceil(Nq / BLOCK) - first // BLOCK)
    return B * Hq * dq, B * Hq * dkv


def dkdv_staged(B, Hq, Nq, Nk, d, causal):
    """The dK/dV kernel's streamed blocks: (blocks, rows) over every (threadgroup, query head of its group,
    query block that sees some key of the threadgroup); each block is staged once between two threadgroup
    barriers (RAW, then WAR), its real rows read from device memory once."""
    up, bkv = Nk - Nq, 16 * DKV_WM[d]
    blocks = rows = 0
    for k0 in range(0, Nk, bkv):
        first = min(max(k0 - up, 0), Nq) if causal else 0
        for q0 in range(first // BLOCK * BLOCK, Nq, BLOCK):
            blocks += 1
            rows += min(BLOCK, Nq - q0)
    return B * Hq * blocks, B * Hq * rows


def _case(B, Hq, Hkv, Nq, Nk, D, dtype, causal, seed, grad_lse=False):
    """Fresh inputs, the forward's out and lse (the CPU kernel, same dtype), grad_out and grad_lse."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, generator=g)
    out, lse = torch.ops.flash_metal.attention_forward(q, k, v, causal, None, "auto")
    grad_out = make_tensor((B, Hq, Nq, D), "contiguous", dtype, g)
    gl = torch.randn(B, Hq, Nq, generator=g) if grad_lse else None
    return q, k, v, out, lse, grad_out, gl


def run(case, causal, layout, instrumented=False, seed=0, mpp_seed=1, check_runs=True):
    """The forced tensor_ops backward through the emulator under `layout`; checks the plan and the counts."""
    q, k, v, out, lse, grad_out, gl = case
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    plan = flash_metal.explain(q, k, v, causal, None, "tensor_ops", backward=True, grad_out=grad_out, out=out,
                               lse=lse, grad_lse=gl)
    dq_name, dkv_name = names(q.dtype, D)
    assert [d.kernel_name for d in plan.dispatches] == [dq_name, dkv_name]
    dq_plan, dkv_plan = plan.dispatches
    assert dq_plan.grid == (math.ceil(Nq / (16 * DQ_WM[D])), Hq, B) and dq_plan.threadgroup == (32 * DQ_WM[D], 1, 1)
    assert dkv_plan.grid == (math.ceil(Nk / (16 * DKV_WM[D])), Hkv, B)
    assert dkv_plan.threadgroup == (32 * DKV_WM[D], 1, 1)
    assert dq_plan.threadgroup_memory == tg_bytes(False, D) <= 32768
    assert dkv_plan.threadgroup_memory == tg_bytes(True, D) <= 32768
    grads = emulated_metal_attention_backward(grad_out, q, k, v, out, lse, causal, None, gl, impl="tensor_ops",
                                              instrumented=instrumented, seed=seed, mpp_layout=layout,
                                              mpp_seed=mpp_seed)
    (d1, c1), (d2, c2) = LAST_DISPATCHES
    ran = metal_mpp_library(instrumented).dispatched_names()
    assert d1.kernel_name == dq_name and d2.kernel_name == dkv_name and {dq_name, dkv_name} <= set(ran)
    if check_runs:
        assert (c1.mpp_runs, c2.mpp_runs) == expected_runs(B, Hq, Hkv, Nq, Nk, causal)
    # dQ: SIMD-groups are independent (each its own slice of threadgroup memory): no threadgroup barrier.
    # dK/dV: the SIMD-groups share each streamed Q / dO block, staged between two threadgroup barriers.
    assert c1.threadgroup_barriers == 0
    blocks, rows = dkdv_staged(B, Hq, Nq, Nk, D, causal)
    if check_runs:
        assert c2.threadgroup_barriers == 2 * blocks
    if instrumented:  # Q and dO read from device memory once per threadgroup, not per SIMD-group
        assert c2.device_bytes_read_by_index[0] == c2.device_bytes_read_by_index[8] == rows * D * q.element_size()
    return grads


# (D, (Nq, Nk), Hq, Hkv): every head dim, GQA 2 and 3 and Hkv = 2, Nq < Nk and Nq > Nk (causal, bottom-right:
# with Nq > Nk the first Nq - Nk rows see no key), ragged blocks throughout.
SHAPES = [(64, (37, 50), 2, 1), (96, (50, 21), 3, 1), (128, (33, 70), 2, 2)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d, shape, hq, hkv", SHAPES, ids=lambda x: None)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_matches_float64(dtype, d, shape, hq, hkv, causal, layout):
    Nq, Nk = shape
    case = _case(1, hq, hkv, Nq, Nk, d, dtype, causal, seed=hash((d, Nq, Nk, causal, str(dtype))) % 2**31)
    grads = run(case, causal, layout)
    q, k, v, out, lse, grad_out, gl = case
    assert_gradients_close(grads, q, k, v, grad_out, causal, None, gl)
    if causal and Nq > Nk:  # rows that see no key get dQ = 0 exactly
        assert torch.all(grads[0][:, :, :Nq - Nk] == 0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, d, shape",
                         [(torch.float16, 64, (23, 41)), (torch.bfloat16, 128, (1, 1)), (torch.float16, 96, (1, 40))],
                         ids=["f16-64", "bf16-128-1x1", "f16-96-1x40"])
def test_sanitized_with_grad_lse(dtype, d, shape, causal, layout):
    # The instrumented build: exact device bounds (ragged blocks read nothing past q, k, v, dO's ends),
    # threadgroup races between a SIMD-group's lanes (dS, P^T, dS^T and the stats go through threadgroup
    # memory). Batch 2, GQA 2, a gradient flowing into lse too; one row and one key; one row, many keys.
    case = _case(2, 2, 1, *shape, d, dtype, causal, seed=sum(shape) + causal, grad_lse=True)
    grads = run(case, causal, layout, instrumented=True)
    q, k, v, out, lse, grad_out, gl = case
    assert_gradients_close(grads, q, k, v, grad_out, causal, None, gl)


def test_deterministic_across_schedules_and_layout_seeds():
    # Bitwise the same gradients from two thread schedules (the emulator's seeded shuffles) under one
    # layout: no atomics, every element written by one thread in a fixed order.
    case = _case(1, 4, 2, 45, 52, 64, torch.bfloat16, True, seed=45)
    a = run(case, True, "scrambled", seed=0)
    b = run(case, True, "scrambled", seed=7)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    # Another scrambled layout (another seed): still within the 2x rule.
    q, k, v, out, lse, grad_out, gl = case
    assert_gradients_close(run(case, True, "scrambled", mpp_seed=5), q, k, v, grad_out, True)


# ---- the options (attention_features.h's helpers, as the simdgroup backward) ----------------------------------

# (causal, options, dtype, D): one small ragged GQA case each, dtypes and head dims alternating. Masks are
# per (batch, query head); sinks come with grad_sinks (flash_sinks_grad, appended to the plan).
OPTION_CASES = {
    "window": (False, dict(window_left=9, window_right=4), torch.float16, 64),
    "causal-window-softcap": (True, dict(window_left=13, softcap=3.0), torch.bfloat16, 96),
    "mask-bool": (True, dict(attn_mask="bool"), torch.bfloat16, 64),
    "mask-input": (False, dict(attn_mask="input"), torch.float16, 128),
    "mask-float32": (False, dict(attn_mask="float32"), torch.float16, 64),
    "sinks": (True, dict(sinks=True), torch.float16, 64),
}


def _option_case(name, Nq, Nk, grad_lse=False, B=1):
    """Fresh inputs with the options of OPTION_CASES[name] made concrete, out and lse from the float64 oracle
    (rounded to the dtype and float32): the backward only needs them to be the attention of q, k, v."""
    causal, opts, dtype, d = OPTION_CASES[name]
    g = torch.Generator().manual_seed(hash((name, Nq, Nk)) % 2**31)
    q, k, v = make_qkv(B, 2, 1, Nq, Nk, d, dtype, generator=g)
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


def _check_options(case, causal, opts, layout, instrumented=False, skips=True):
    q, k, v, out, lse, grad_out, gl = case
    grads = emulated_metal_attention_backward(grad_out, q, k, v, out, lse, causal, None, gl, impl="tensor_ops",
                                              instrumented=instrumented, mpp_layout=layout, **opts)
    ran = [d.kernel_name for d, _ in LAST_DISPATCHES]
    assert ran[:2] == list(names(q.dtype, q.shape[-1]))
    assert ran[2:] == (["flash_sinks_grad"] if "sinks" in opts else [])
    (_, c1), (_, c2) = LAST_DISPATCHES[:2]
    full = expected_runs(*q.shape[:2], k.shape[1], q.shape[2], k.shape[2], causal)
    if "window_left" in opts:  # block skipping: fewer products than without the left window, in both kernels
        assert c1.mpp_runs < full[0] and c2.mpp_runs < full[1] if skips else c1.mpp_runs <= full[0]
    else:
        assert (c1.mpp_runs, c2.mpp_runs) == full
    assert_gradients_close(grads[:3], q, k, v, grad_out, causal, None, gl, **opts)
    if "sinks" in opts:
        assert_sinks_grad_close(grads[3], q, k, v, opts["sinks"], grad_out,
                                torch.zeros_like(lse) if gl is None else gl, causal,
                                {k: x for k, x in opts.items() if k != "sinks"})
    return grads


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(OPTION_CASES))
def test_options_match_float64(name, layout):
    case, causal, opts = _option_case(name, 45, 70)
    _check_options(case, causal, opts, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_options_sanitized(layout):
    # Every option at once in the instrumented build (masks read only inside the sequence and window, no race
    # on the shared block), batch 2, a gradient into lse; a mask that leaves some rows no key.
    case, causal, opts = _option_case("sinks", 37, 41, grad_lse=True, B=2)
    q, k = case[0], case[1]
    mask = torch.rand(2, 2, 37, 41, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[:, :, :3] = False
    opts.update(attn_mask=mask, window_left=20, softcap=4.0)
    case = case[:3] + tuple(t.to(d) for t, d in zip(attention_reference(q, k, case[2], causal, None, **opts),
                                                       (q.dtype, torch.float32))) + case[5:]
    _check_options(case, causal, opts, layout, instrumented=True, skips=False)


VARLEN_LENGTHS = [(40, 50), (50, 21), (1, 1), (0, 4), (4, 0), (17, 33)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal, opts", [(False, {}), (True, dict(window_left=12, softcap=4.0))],
                         ids=["full", "causal-win-cap"])
def test_varlen_sanitized(causal, opts, layout):
    # Packed sequences, empty ones included, GQA 2, in the instrumented build: each threadgroup reads only its
    # sequence's rows; the gradients packed (total, H, D).
    g = torch.Generator().manual_seed(11 + causal)
    cq = torch.tensor([0, *itertools.accumulate(a for a, _ in VARLEN_LENGTHS)], dtype=torch.int32)
    ck = torch.tensor([0, *itertools.accumulate(b for _, b in VARLEN_LENGTHS)], dtype=torch.int32)
    q = torch.randn(int(cq[-1]), 4, 64, generator=g).half()
    k = torch.randn(int(ck[-1]), 2, 64, generator=g).half()
    v = torch.randn(int(ck[-1]), 2, 64, generator=g).half()
    out, lse = attention_varlen_reference(q, k, v, cq, ck, causal, None, **opts)
    grad_out = torch.randn(q.shape, generator=g).half()
    mq, mk = max(a for a, _ in VARLEN_LENGTHS), max(b for _, b in VARLEN_LENGTHS)
    grads = emulated_metal_attention_backward(grad_out, q, k, v, out.half(), lse.float(), causal, None, None,
                                              impl="tensor_ops", instrumented=True, mpp_layout=layout,
                                              cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk,
                                              **opts)
    assert [d.kernel_name for d, _ in LAST_DISPATCHES] == list(names(torch.float16, 64))
    assert all(d.function_constants[9] for d, _ in LAST_DISPATCHES)  # fc_varlen
    assert_varlen_gradients_close(grads, q, k, v, grad_out, cq, ck, causal, None, None, **opts)


# ---- routing: impl='tensor_ops' and Auto's gate (csrc/metal/families/backward_tensor_ops.cpp) -----------------------


def _explain(dtype=torch.float16, d=64, gpu="base", impl="tensor_ops", causal=True, Hq=4, Hkv=2, **options):
    q = torch.randn(1, Hq, 40, d).to(dtype)
    k = torch.randn(1, Hkv, 60, d).to(dtype)
    return flash_metal.explain(q, k, k, causal, None, impl, gpu, backward=True, grad_out=q, out=q,
                               lse=torch.zeros(1, Hq, 40), **options)


def test_forced_explains_itself():
    plan = _explain()
    assert plan.reason.startswith("forced: tensor_ops (impl='tensor_ops'); backward: FlashAttention-2")
    assert "P and dS rounded to the input dtype" in plan.reason


@pytest.mark.parametrize("gpu, dtype, d, picked, words", [
    ("m5+tensor_ops", torch.float16, 128, True, "tensor ops: an Apple 10 GPU"),
    ("m5-max+tensor_ops", torch.bfloat16, 96, True, "equal q/k and v dims"),
    ("m5", torch.float16, 64, False, "tensor ops not used: planned without a Mac"),
    ("m5+tensor_ops", torch.float32, 64, False, "tensor ops not used: float32 stays on simdgroup matrices"),
    ("m5+tensor_ops", torch.float16, 80, False, "head dims 80 / 80"),
    ("m4-max+tensor_ops", torch.float16, 64, False, "backward: FlashAttention-2 with recomputation"),
])
def test_auto_takes_it_only_where_the_gate_holds(gpu, dtype, d, picked, words):
    plan = _explain(dtype, d, gpu, "auto")
    assert all(("_mpp_" in x.kernel_name) == picked for x in plan.dispatches), plan.reason
    assert words in plan.reason
    if gpu.startswith("m4"):  # not a candidate there: no word of it
        assert "tensor ops" not in plan.reason


def test_the_switch_keeps_auto_off_it(monkeypatch):
    assert "_mpp_" in _explain(gpu="m5+tensor_ops", impl="auto").dispatches[0].kernel_name
    monkeypatch.setenv("FLASH_METAL_DISABLE_TENSOR_OPS", "1")
    plan = _explain(gpu="m5+tensor_ops", impl="auto")
    assert "_mpp_" not in plan.dispatches[0].kernel_name
    assert "tensor ops not used: FLASH_METAL_DISABLE_TENSOR_OPS=1 turns them off" in plan.reason
    assert "_mpp_" in _explain(gpu="m5+tensor_ops").dispatches[0].kernel_name  # forcing still works


@pytest.mark.parametrize("options", [dict(window_left=8), dict(softcap=5.0), dict(sinks=torch.zeros(4)),
                                     dict(attn_mask=torch.ones(40, 60, dtype=torch.bool))],
                         ids=["window", "softcap", "sinks", "mask"])
def test_auto_takes_the_options(options):
    plan = _explain(gpu="m5+tensor_ops", impl="auto", **options)
    assert "_mpp_" in plan.dispatches[0].kernel_name and "_mpp_" in plan.dispatches[1].kernel_name, plan.reason
    assert "options (masks, windows, softcap, varlen, sinks)" in plan.reason
    assert ("flash_sinks_grad" in [d.kernel_name for d in plan.dispatches]) == ("sinks" in options)


def test_a_v_head_dim_of_its_own_stays_on_the_simdgroup_backward():
    # (64, 128), not the MLA pair the kernels serve (tests/metal/test_metal_tensor_ops_mla.py): Auto runs the
    # simdgroup backward, saying why; forced: refused, naming the dims.
    q = torch.randn(1, 4, 40, 64).half()
    k = torch.randn(1, 2, 60, 64).half()
    v = torch.randn(1, 2, 60, 128).half()
    out = torch.randn(1, 4, 40, 128).half()
    args = dict(backward=True, grad_out=out, out=out, lse=torch.zeros(1, 4, 40))
    plan = flash_metal.explain(q, k, v, True, None, "auto", "m5+tensor_ops", **args)
    assert "_mpp_" not in plan.dispatches[0].kernel_name
    assert "tensor ops not used: head dims 64 / 128" in plan.reason
    with pytest.raises(ValueError, match="with v's head dim equal, or the MLA pair q/k 192 with v 128"):
        flash_metal.explain(q, k, v, True, None, "tensor_ops", **args)


def test_refuses_float32_and_other_head_dims_naming_the_argument():
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        _explain(torch.float32)
    with pytest.raises(ValueError, match="head_dim 64, 96, 128 or 256"):  # 256: the split-D backward
        _explain(d=80)


def test_auto_routed_backward_runs_the_tensor_op_kernels():
    case = _case(1, 2, 1, 30, 40, 96, torch.float16, False, seed=30)
    q, k, v, out, lse, grad_out, gl = case
    grads = emulated_metal_attention_backward(grad_out, q, k, v, out, lse, False, gpu="m5+tensor_ops",
                                              mpp_layout="scrambled")
    assert [d.kernel_name for d, _ in LAST_DISPATCHES] == list(names(torch.float16, 96))
    assert_gradients_close(grads, q, k, v, grad_out, False)


def test_library_holds_the_backward_instantiations():
    lib = metal_mpp_library(False)
    want = {n for dt in DTYPES for d in DQ_WM for n in names(dt, d)}
    assert want <= set(lib.kernel_names())
    for name in want:
        assert lib.max_threads(name) == 128


# ---- planted bugs -----------------------------------------------------------------------------------------


def _planted_library(tmp_path, monkeypatch, old, new):
    """A copy of shaders/ with `old` (once in attention_backward_mpp.h) replaced by `new`; the float16 D = 64
    backward kernels alone in an instrumented partial library (`kernel` planted), which the backend runs."""
    root = ROOT_DIR
    shutil.copytree(os.path.join(root, "shaders"), tmp_path / "shaders")
    header = tmp_path / "shaders" / "tensor_ops" / "attention_backward_mpp.h"
    text = header.read_text()
    assert text.count(old) == 1, old
    header.write_text(text.replace(old, new))
    lib = compile_library([str(tmp_path / "shaders" / "attention_mpp.metal")], instrumented=True, msl=4,
                          only=list(names(torch.float16, 64)))
    monkeypatch.setattr(backends, "metal_mpp_library", lambda instrumented, fast_math=False: lib)
    return lib


def _planted_case():
    return _case(1, 2, 1, 37, 50, 64, torch.float16, True, seed=37)


def _caught(case, layout):
    """Whether the planted kernels fail: an emulator finding, or gradients outside the 2x rule."""
    q, k, v, out, lse, grad_out, gl = case
    try:
        grads = emulated_metal_attention_backward(grad_out, q, k, v, out, lse, True, impl="tensor_ops",
                                                  instrumented=True, mpp_layout=layout)
        assert_gradients_close(grads, q, k, v, grad_out, True)
    except (AssertionError, EmulatorError):
        return True
    return False


# MLX's hard-coded Apple10 map of a 16 x 32 destination (BaseNAXFrag::get_coord; slots 0-7 the first 16
# columns, 8-15 the second) as the dQ kernel's code tensor of S, in place of asking the layout: right under
# "m5" only.
HARDCODED = """  FM_UNROLL
  for (int i = 0; i < s_at.get_capacity(); ++i) {
    const int l = int(lane), half = i / 8, j = i % 8;
    const int row = (((l / 4) & 4) | ((l / 2) & 3)) + 8 * (j / 4);
    s_at[i] = float(row * BK + half * 16 + ((((l / 4) & 2) | (l & 1)) * 4) + j % 4);
  }
"""


def test_planted_hardcoded_lane_map_is_caught_under_scrambled(tmp_path, monkeypatch):
    _planted_library(tmp_path, monkeypatch, "  mpp_slot_codes<BK>(s_at);\n", HARDCODED)
    case = _planted_case()
    assert not _caught(case, "m5")  # the map is M5's: right there
    assert _caught(case, "scrambled")


def test_planted_missing_barrier_before_the_dq_product_is_a_race(tmp_path, monkeypatch):
    barrier = "    simdgroup_barrier(mem_flags::mem_threadgroup);  // dS written before"
    _planted_library(tmp_path, monkeypatch, barrier, "    // (planted: no barrier) dS written before")
    q, k, v, out, lse, grad_out, gl = _planted_case()
    with pytest.raises(EmulatorError) as info:
        emulated_metal_attention_backward(grad_out, q, k, v, out, lse, True, impl="tensor_ops", instrumented=True,
                                          mpp_layout="m5")
    assert "race" in info.value.kinds


def test_planted_stats_along_the_wrong_dimension_is_caught(tmp_path, monkeypatch):
    # The dK/dV kernel's per-query lse and Delta looked up by the key's index (code / BQ) instead of the
    # query's (qi, code % BQ): a row quantity broadcast along the wrong dimension.
    old = "          threadgroup const float* st = stats + qi * kMppStats;\n"
    new = "          threadgroup const float* st = stats + (code / BQ) * kMppStats;\n"
    _planted_library(tmp_path, monkeypatch, old, new)
    case = _planted_case()
    assert _caught(case, "m5") and _caught(case, "scrambled")


def test_planted_missing_barrier_after_staging_the_shared_block_is_a_race(tmp_path, monkeypatch):
    # The dK/dV kernel's SIMD-groups share the Q / dO block one threadgroup stages: without the threadgroup
    # barrier after the staging, a SIMD-group's matmul2d reads elements other SIMD-groups are still writing.
    barrier = "      threadgroup_barrier(mem_flags::mem_threadgroup);  // the block staged before"
    _planted_library(tmp_path, monkeypatch, barrier, "      // (planted: no barrier) the block staged before")
    # One threadgroup of 4 SIMD-groups (64 keys), one query head and block: the smallest case that stages.
    q, k, v, out, lse, grad_out, gl = _case(1, 1, 1, 20, 64, 64, torch.float16, True, seed=20)
    with pytest.raises(EmulatorError) as info:
        emulated_metal_attention_backward(grad_out, q, k, v, out, lse, True, impl="tensor_ops", instrumented=True,
                                          mpp_layout="m5")
    assert "race" in info.value.kinds


def test_planted_softcap_derivative_left_out_is_caught(tmp_path, monkeypatch):
    # The options' checker bites: the dQ kernel's dS without softcap's derivative (1 - tanh^2) fails the 2x
    # rule against the float64 oracle with softcap (the dK/dV kernel keeps it, so only grad_q is wrong).
    old = "      ds_tile[code] = static_cast<T>(pw * (dp[i] - st[2]) * cap_grad);\n"
    _planted_library(tmp_path, monkeypatch, old, old.replace(" * cap_grad", ""))
    g = torch.Generator().manual_seed(5)
    q, k, v = make_qkv(1, 2, 1, 37, 50, 64, torch.float16, generator=g)
    opts = dict(softcap=2.0)
    out, lse = attention_reference(q, k, v, True, None, **opts)
    grad_out = make_tensor(q.shape, "contiguous", torch.float16, g)
    grads = emulated_metal_attention_backward(grad_out, q, k, v, out.half(), lse.float(), True, impl="tensor_ops",
                                              instrumented=True, mpp_layout="m5", **opts)
    with pytest.raises(AssertionError, match="grad_q"):
        assert_gradients_close(grads, q, k, v, grad_out, True, None, None, **opts)


def test_planted_static_k_on_the_ragged_key_block_is_nan(tmp_path, monkeypatch):
    """dQ += dS.K with a static K = 32 (the kernel before issue 40) on a sequence of 50 keys: its last block reads
    K rows past the block's valid keys, undefined on Apple's GPUs (NaN on M5s, llama.cpp PR #27450) and NaN in
    the emulator, so grad_q is NaN under both layouts; the dynamic K (mpp_accumulate_descriptor) is right (the other tests)."""
    _planted_library(tmp_path, monkeypatch,
                     "  constexpr auto dq_desc = mpp_accumulate_descriptor(D, mpp_relaxed(sizeof(T)));\n",
                     "  constexpr auto dq_desc = mpp::tensor_ops::matmul2d_descriptor(kMppRowsPerSimd, D, BK, false, "
                     "false, true, mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate);\n")
    q, k, v, out, lse, grad_out, _ = _planted_case()
    for layout in LAYOUTS:
        dq, dk, dv = emulated_metal_attention_backward(grad_out, q, k, v, out, lse, True, impl="tensor_ops",
                                                       instrumented=True, mpp_layout=layout)[:3]
        assert dq.isnan().any() and not dk.isnan().any() and not dv.isnan().any(), layout
