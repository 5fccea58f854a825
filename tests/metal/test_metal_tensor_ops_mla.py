"""The tensor-op forward and backward at DeepSeek's MLA pair, q/k 192 and v 128 (issues 20 section 2 and 21).

shaders/tensor_ops/attention_prefill_mpp.h and attention_backward_mpp.h instantiated with D = 192, DV = 128
(names _dqk192_dv128_): S = Q.K^T reduces over 192 features, O += P.V is 128 wide; in the backward
dP = dO.V^T reduces over 128, dQ and dK are 192 wide, dV 128. The backward's S and dP are two runs of one
matmul2d type whose K is dynamic (read from each run's left operand), so dS is still formed slot by slot.
Only the pair's kernels are built, in a partial MSL 4 library of their own (backends.metal_mpp_mla_library).

Every numerical case runs under both lane layouts ("m5" and "scrambled"), with outputs and gradients
NaN-poisoned by the backend, against the float64 oracle by FlashAttention's 2x rule. Proof the pair's kernels
ran: the plan's kernel names, the library's dispatched_names() and exact matmul2d run counts.
Planted bugs (a one- or two-line change to a copy of the header, one kernel built): dP reduced over D_qk
instead of D_v (dO's tile read 192 wide), and dK written with D_v's row stride: both caught by the 2x rule;
S and dP from two static-K ops (two types) combined slot by slot: right under "m5", caught under "scrambled"
(why the shared op's K is dynamic).
"""
import math
import os
import shutil

import pytest
import torch

import backends
import flash_metal
from backends import (LAST_DISPATCHES, emulated_metal_attention, emulated_metal_attention_backward,
                      emulated_metal_varlen, metal_mpp_mla_library)
from flash_metal.reference import attention_reference
from flash_metal.testing import assert_attention_close, assert_gradients_close
from metal_emulator import EmulatorError, compile_library
from numerics import assert_varlen_close, dtype_id
from test_sinks import assert_sinks_grad_close
from repo_paths import ROOT_DIR

LAYOUTS = ("m5", "scrambled")
DTYPES = (torch.float16, torch.bfloat16)
NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
DQK, DV = 192, 128
ROWS, BK = 16, 32  # rows per SIMD-group; keys per forward / dQ block, query rows per dK/dV block
# Threadgroups (csrc/metal/plan_detail.h): the forward 4 SIMD-groups (28,928 bytes: P 16 x 32 and Q 16 x 192
# per SIMD-group, a float per row); dQ 2 (23,040: Q 16 x 192, dO 16 x 128, dS 16 x 32, 4 floats per row, per
# SIMD-group); dK/dV 4 (29,184: the shared Q 32 x 192 and dO 32 x 128 block and 4 floats per query, then P^T
# and dS^T 16 x 32 per SIMD-group).
FWD_WM, DQ_WM, DKV_WM = 4, 2, 4
FWD_BYTES = FWD_WM * ROWS * ((BK + DQK) * 2 + 4)
DQ_BYTES = DQ_WM * (ROWS * (DQK + DV) * 2 + ROWS * BK * 2 + ROWS * 16)
DKV_BYTES = BK * (DQK + DV) * 2 + BK * 16 + DKV_WM * 2 * ROWS * BK * 2


def fwd_name(dtype):
    return f"flash_attention_prefill_mpp_{NAMES[dtype]}_dqk{DQK}_dv{DV}_bq64_bk{BK}"


def bwd_names(dtype):
    return (f"flash_backward_mpp_dq_{NAMES[dtype]}_dqk{DQK}_dv{DV}_bq{16 * DQ_WM}_bk{BK}",
            f"flash_backward_mpp_dkdv_{NAMES[dtype]}_dqk{DQK}_dv{DV}_bk{16 * DKV_WM}_bq{BK}")


def visible(r0, Nq, Nk, causal):
    """Keys the 16 rows from r0 see (bottom-right causal: row i sees keys j <= i + Nk - Nq)."""
    last = min(r0 + ROWS, Nq) - 1
    return min(max(last + Nk - Nq + 1, 0), Nk) if causal else Nk


def fwd_runs(B, Hq, Nq, Nk, causal):
    return B * Hq * sum(2 * math.ceil(visible(r0, Nq, Nk, causal) / BK) for r0 in range(0, Nq, ROWS))


def bwd_runs(B, Hq, Nq, Nk, causal):
    dq = sum(3 * math.ceil(visible(r0, Nq, Nk, causal) / BK) for r0 in range(0, Nq, ROWS))
    dkv = 0
    for k0 in range(0, Nk, ROWS):
        first = min(max(k0 - (Nk - Nq), 0), Nq) if causal else 0
        dkv += 4 * (math.ceil(Nq / BK) - first // BK)
    return B * Hq * dq, B * Hq * dkv


def make_mla(B, Hq, Hkv, Nq, Nk, dtype, seed, latent=False):
    """Fresh q (.., 192), k (.., 192), v (.., 128). latent: k and v views of one (B, Hkv, Nk, 320) tensor (v's
    rows 320 elements apart, its first element 192 in), as a latent cache keeps them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, DQK, generator=g).to(dtype)
    if latent:
        kv = torch.randn(B, Hkv, Nk, DQK + DV, generator=g).to(dtype)
        return q, kv[..., :DQK], kv[..., DQK:], g
    k = torch.randn(B, Hkv, Nk, DQK, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Nk, DV, generator=g).to(dtype)
    return q, k, v, g


def run_forward(q, k, v, causal, layout, instrumented=False, runs=True, **options):
    plan = flash_metal.explain(q, k, v, causal, None, "tensor_ops", **options)
    B, Hq, Nq, _ = q.shape
    assert plan.kernel_name == fwd_name(q.dtype), plan.kernel_name
    assert plan.grid == (math.ceil(Nq / 64), Hq, B) and plan.threadgroup == (32 * FWD_WM, 1, 1)
    assert plan.threadgroup_memory == FWD_BYTES == 28928
    out, lse = emulated_metal_attention(q, k, v, causal, None, "tensor_ops", instrumented=instrumented,
                                        mpp_layout=layout, **options)
    ((d, counts),) = LAST_DISPATCHES
    assert d.kernel_name in metal_mpp_mla_library(instrumented).dispatched_names()
    assert out.shape == q.shape[:-1] + (DV,)
    if runs:
        assert counts.mpp_runs == fwd_runs(B, Hq, Nq, k.shape[2], causal)
    if instrumented:  # Q (buffer 0) read from device memory once, 192 wide
        assert counts.device_bytes_read_by_index[0] == q.numel() * q.element_size()
    return out, lse


def run_backward(case, causal, layout, instrumented=False, runs=True, **options):
    q, k, v, out, lse, grad_out, gl = case
    B, Hq, Nq, _ = q.shape
    plan = flash_metal.explain(q, k, v, causal, None, "tensor_ops", backward=True, grad_out=grad_out, out=out,
                               lse=lse, grad_lse=gl, **options)
    dq_name, dkv_name = bwd_names(q.dtype)
    assert [d.kernel_name for d in plan.dispatches][:2] == [dq_name, dkv_name]
    dq_plan, dkv_plan = plan.dispatches[:2]
    assert dq_plan.threadgroup == (32 * DQ_WM, 1, 1) and dkv_plan.threadgroup == (32 * DKV_WM, 1, 1)
    assert (dq_plan.threadgroup_memory, dkv_plan.threadgroup_memory) == (DQ_BYTES, DKV_BYTES) == (23040, 29184)
    grads = emulated_metal_attention_backward(grad_out, q, k, v, out, lse, causal, None, gl, impl="tensor_ops",
                                              instrumented=instrumented, mpp_layout=layout, **options)
    (d1, c1), (d2, c2) = LAST_DISPATCHES[:2]
    assert {d1.kernel_name, d2.kernel_name} == {dq_name, dkv_name}
    assert {dq_name, dkv_name} <= set(metal_mpp_mla_library(instrumented).dispatched_names())
    assert [t.shape[-1] for t in grads[:3]] == [DQK, DQK, DV]
    if runs:
        assert (c1.mpp_runs, c2.mpp_runs) == bwd_runs(B, Hq, Nq, k.shape[2], causal)
    return grads


def backward_case(B, Hq, Hkv, Nq, Nk, dtype, causal, seed, latent=False, grad_lse=False, **options):
    """Inputs, the oracle's out and lse (rounded), grad_out (128 wide), grad_lse."""
    q, k, v, g = make_mla(B, Hq, Hkv, Nq, Nk, dtype, seed, latent)
    out, lse = attention_reference(q, k, v, causal, None, **options)
    grad_out = torch.randn(B, Hq, Nq, DV, generator=g).to(dtype)
    gl = torch.randn(B, Hq, Nq, generator=g) if grad_lse else None
    return q, k, v, out.to(dtype), lse.float(), grad_out, gl


# ---- forward and backward, plain and causal ---------------------------------------------------------------

# (Nq, Nk): ragged query and key blocks; more queries than keys (causal: early rows see no key).
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal, shape", [(False, (37, 50)), (True, (70, 45))], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_forward_matches_float64(dtype, causal, shape, layout):
    q, k, v, _ = make_mla(1, 2, 1, *shape, dtype, seed=hash((causal, str(dtype))) % 2**31, latent=causal)
    out, lse = run_forward(q, k, v, causal, layout)
    assert_attention_close(out, lse, q, k, v, causal)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal, shape", [(False, (37, 50)), (True, (50, 33))], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_backward_matches_float64(dtype, causal, shape, layout):
    case = backward_case(1, 2, 1, *shape, dtype, causal, seed=hash((shape, str(dtype))) % 2**31, latent=not causal)
    grads = run_backward(case, causal, layout)
    q, k, v, out, lse, grad_out, gl = case
    assert_gradients_close(grads[:3], q, k, v, grad_out, causal, None, gl)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sanitized(layout):
    # The instrumented build (exact device bounds, threadgroup races): batch 2, GQA 2, causal with more
    # queries than keys, a gradient into lse, v a view of a latent tensor.
    q, k, v, _ = make_mla(2, 2, 1, 40, 27, torch.float16, seed=40, latent=True)
    out, lse = run_forward(q, k, v, True, layout, instrumented=True)
    assert_attention_close(out, lse, q, k, v, True)
    case = backward_case(2, 2, 1, 40, 27, torch.bfloat16, True, seed=41, latent=True, grad_lse=True)
    grads = run_backward(case, True, layout, instrumented=True)
    q, k, v, out, lse, grad_out, gl = case
    assert_gradients_close(grads[:3], q, k, v, grad_out, True, None, gl)


# ---- the options, each once per layout ----------------------------------------------------------------------

OPTIONS = {
    "window": (True, dict(window_left=11, window_right=0)),
    "softcap": (False, dict(softcap=3.0)),
    "mask-bool": (False, dict(attn_mask="bool")),
    "mask-additive": (True, dict(attn_mask="float32")),
    "sinks": (True, dict(sinks=True)),
}


def _options(name, Nq, Nk, g, dtype):
    causal, opts = OPTIONS[name]
    opts = dict(opts)
    kind = opts.get("attn_mask")
    if kind is not None:
        drop = torch.rand(1, 2, Nq, Nk, generator=g) < 0.3
        opts["attn_mask"] = ~drop if kind == "bool" else torch.randn(1, 2, Nq, Nk, generator=g).masked_fill(
            drop, float("-inf"))
    if opts.get("sinks"):
        opts["sinks"] = torch.randn(2, generator=g)
    return causal, opts


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_options_forward_and_backward(name, layout):
    dtype = torch.float16 if name in ("window", "mask-bool", "sinks") else torch.bfloat16
    q, k, v, g = make_mla(1, 2, 1, 45, 52, dtype, seed=hash(name) % 2**31)
    causal, opts = _options(name, 45, 52, g, dtype)
    out, lse = run_forward(q, k, v, causal, layout, runs="window_left" not in opts, **opts)
    assert_attention_close(out, lse, q, k, v, causal, None, **opts)
    ro, rl = attention_reference(q, k, v, causal, None, **opts)
    grad_out = torch.randn(1, 2, 45, DV, generator=g).to(dtype)
    case = (q, k, v, ro.to(dtype), rl.float(), grad_out, None)
    grads = run_backward(case, causal, layout, runs="window_left" not in opts, **opts)
    assert [d.kernel_name for d, _ in LAST_DISPATCHES][2:] == (["flash_sinks_grad"] if "sinks" in opts else [])
    assert_gradients_close(grads[:3], q, k, v, grad_out, causal, None, None, **opts)
    if "sinks" in opts:
        assert_sinks_grad_close(grads[3], q, k, v, opts["sinks"], grad_out, torch.zeros_like(rl.float()), causal,
                                {})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_varlen(layout):
    # Packed sequences (an empty one included), GQA 2, causal: forward and backward.
    lengths = [(20, 33), (0, 5), (37, 17)]
    cq = torch.tensor([0, 20, 20, 57], dtype=torch.int32)
    ck = torch.tensor([0, 33, 38, 55], dtype=torch.int32)
    g = torch.Generator().manual_seed(57)
    q = torch.randn(57, 4, DQK, generator=g).half()
    k = torch.randn(55, 2, DQK, generator=g).half()
    v = torch.randn(55, 2, DV, generator=g).half()
    mq, mk = max(a for a, _ in lengths), max(b for _, b in lengths)
    out, lse = emulated_metal_varlen(q, k, v, cq, ck, mq, mk, True, None, "tensor_ops", mpp_layout=layout)
    assert [d.kernel_name for d, _ in LAST_DISPATCHES] == [fwd_name(torch.float16)]
    assert_varlen_close(out, lse, q, k, v, cq, ck, True)
    from flash_metal.reference import attention_varlen_reference
    from numerics import assert_varlen_gradients_close
    ro, rl = attention_varlen_reference(q, k, v, cq, ck, True, None)
    grad_out = torch.randn(57, 4, DV, generator=g).half()
    grads = emulated_metal_attention_backward(grad_out, q, k, v, ro.half(), rl.float(), True, None, None,
                                              impl="tensor_ops", mpp_layout=layout, cu_seqlens_q=cq,
                                              cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk)
    assert [d.kernel_name for d, _ in LAST_DISPATCHES] == list(bwd_names(torch.float16))
    assert_varlen_gradients_close(grads, q, k, v, grad_out, cq, ck, True, None, None)


# ---- routing (csrc/metal/families/tensor_ops.cpp) ------------------------------------------------------------

def _explain(impl, gpu, dqk=DQK, dv=DV, dtype=torch.float16, backward=False):
    q = torch.randn(1, 4, 40, dqk).to(dtype)
    k = torch.randn(1, 2, 60, dqk).to(dtype)
    v = torch.randn(1, 2, 60, dv).to(dtype)
    extra = {}
    if backward:
        out = torch.randn(1, 4, 40, dv).to(dtype)
        extra = dict(backward=True, grad_out=out, out=out, lse=torch.zeros(1, 4, 40))
    return flash_metal.explain(q, k, v, True, None, impl, gpu, **extra)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_auto_takes_the_pair_behind_the_gate_on_the_models_word(backward):
    plan = _explain("auto", "m5-max+tensor_ops", backward=backward)
    assert all("_dqk192_dv128_" in d.kernel_name for d in plan.dispatches), plan.reason
    assert "a model, not a measurement" in plan.reason and "(192, 128)" in plan.reason
    assert "zero-padded" not in plan.reason  # each dim at its own width: no padding bucket on this path
    # Without the accelerator gate (no Mac, or an M4): the simdgroup kernels.
    for gpu in ("m5", "m4-max+tensor_ops"):
        assert not any("_mpp_" in d.kernel_name for d in _explain("auto", gpu, backward=backward).dispatches)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_other_pairs_stay_on_the_simdgroup_kernels(backward):
    plan = _explain("auto", "m5+tensor_ops", 128, 64, backward=backward)
    assert not any("_mpp_" in d.kernel_name for d in plan.dispatches)
    assert "tensor ops not used: head dims 128 / 64" in plan.reason
    with pytest.raises(ValueError, match="or the MLA pair q/k 192 with v 128"):
        _explain("tensor_ops", "m5", 128, 64, backward=backward)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        _explain("tensor_ops", "m5", dtype=torch.float32, backward=backward)


def test_library_holds_the_pair():
    lib = metal_mpp_mla_library(False)
    want = {fwd_name(dt) for dt in DTYPES} | {n for dt in DTYPES for n in bwd_names(dt)}
    assert set(lib.kernel_names()) == want
    assert all(lib.max_threads(n) == 128 for n in want)


# ---- planted bugs -------------------------------------------------------------------------------------------


class _Mixed:
    """The pair's library with the kernels named in `use` taken from a planted build, the rest from the real one."""

    def __init__(self, planted, real, use):
        self.planted, self.real, self.use = planted, real, set(use)

    def dispatch(self, name, **kw):
        return (self.planted if name in self.use else self.real).dispatch(name, **kw)

    def dispatched_names(self):
        return set(self.planted.dispatched_names()) | set(self.real.dispatched_names())


def _plant(tmp_path, kernels, *changes):
    """A copy of shaders/ with each (old, new) of `changes` made once in attention_backward_mpp.h; `kernels`
    alone built from it (a partial, instrumented MSL 4 library)."""
    root = ROOT_DIR
    shutil.copytree(os.path.join(root, "shaders"), tmp_path / "shaders")
    header = tmp_path / "shaders" / "tensor_ops" / "attention_backward_mpp.h"
    text = header.read_text()
    for old, new in changes:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    header.write_text(text)
    return compile_library([str(tmp_path / "shaders" / "attention_mpp.metal")], instrumented=True, msl=4,
                           only=list(kernels))


def _caught(monkeypatch, planted, use, layout="m5"):
    """Whether the backward with `use` from `planted` fails: an emulator finding, or the 2x rule."""
    mixed = _Mixed(planted, metal_mpp_mla_library(True), use)
    monkeypatch.setattr(backends, "metal_mpp_mla_library", lambda instrumented, fast_math=False: mixed)
    case = backward_case(1, 2, 1, 37, 45, torch.float16, True, seed=37)
    q, k, v, out, lse, grad_out, gl = case
    try:
        grads = emulated_metal_attention_backward(grad_out, q, k, v, out, lse, True, impl="tensor_ops",
                                                  instrumented=True, mpp_layout=layout)
        assert_gradients_close(grads[:3], q, k, v, grad_out, True)
    except (AssertionError, EmulatorError):
        return True
    return False


def test_planted_dp_over_dqk_and_dk_with_dv_columns_are_caught(tmp_path, monkeypatch):
    # One planted build of both kernels, each bug run alone (the other kernel from the real library):
    # dQ kernel: dO's tile read as 192 wide, so dP = dO.V^T is reduced over D_qk, past dO's 128 features;
    # dK/dV kernel: dK's packed rows laid out 128 apart (D_v's row stride) instead of 192.
    dq, dkdv = bwd_names(torch.float16)
    at = "    const int64_t at = mpp_packed_row(packed_b, kv_head, p.kv_heads, packed_k, seq.k_row0 + key, D) + idx[0];"
    planted = _plant(tmp_path, (dq, dkdv),
                     ("  const MppStaticTileTensor<T, DV, R> tdo = mpp_static_tile<DV, R>(do_tile, DV);",
                      "  const MppStaticTileTensor<T, D, R> tdo = mpp_static_tile<D, R>(do_tile, D);"),
                     (at, at.replace(", D)", ", DV)")))
    assert not _caught(monkeypatch, planted, ())  # the case passes with the real kernels
    assert _caught(monkeypatch, planted, (dq,))
    assert _caught(monkeypatch, planted, (dkdv,))


def test_planted_scores_and_dp_of_two_static_ops_are_caught_under_scrambled(tmp_path, monkeypatch):
    # Why K is dynamic: dP from an op of its own (K = 128 static: another type, so another layout) combined
    # slot by slot with S (K = 192) is right under "m5", where both map slots alike, and wrong under
    # "scrambled", whose layouts are keyed by the descriptor.
    dq = bwd_names(torch.float16)[0]
    planted = _plant(tmp_path, (dq,),
                     ("  auto dp = s_op.template get_destination_cooperative_tensor<QT, KT, float>();",
                      "  typename MppRowStep<DV, BK, T>::Scores dp_op;\n"
                      "  auto dp = dp_op.template get_destination_cooperative_tensor<QT, KT, float>();"),
                     ("      s_op.run(tdo, v_blk, dp);\n    } else {",
                      "      dp_op.run(tdo, v_blk, dp);\n    } else {"),
                     ("      s_op.run(tdo, v_blk, dp);\n    }\n", "      dp_op.run(tdo, v_blk, dp);\n    }\n"))
    assert not _caught(monkeypatch, planted, (dq,), "m5")
    assert _caught(monkeypatch, planted, (dq,), "scrambled")
