"""The tensor-op prefill at head dim 256, split along D (issue 21, item 1): shaders/attention_prefill_mpp_dsplit.h.

Pairs of SIMD-groups share 16 query rows, each half owning 128 features of Q
and O; their partial scores meet in threadgroup memory. The kernels run from a
partial MSL 4 build of their own (backends.metal_mpp_dsplit_library: only the
two dsplit instantiations, seconds to build), launched from the op's plan
(csrc/metal_launch.cpp), under both cooperative-tensor lane layouts ("m5",
the published Apple10 map, and "scrambled"), with outputs NaN-poisoned before
each launch and compared with the float64 oracle by the 2x rule. Proof the
kernel ran: the plan's kernel name, the library's dispatched_names() and the
exact number of matmul2d runs and threadgroup barriers.

Planted bugs (kept below): the threadgroup barrier between the partials'
write and their sum removed (the sanitizer reports a race), and each half
adding its own partial instead of the other's (NotClose).
"""
import math
import os
import shutil

import pytest
import torch

import backends
import flash_metal
from backends import LAST_DISPATCHES, emulated_metal_attention, emulated_metal_varlen, metal_mpp_dsplit_library
from metal_emulator import EmulatorError, compile_library
from numerics import NotClose, assert_attention_close, assert_varlen_close, dtype_id, make_qkv
from test_metal_features import make_mask, packed

LAYOUTS = ("m5", "scrambled")
NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
D, BQ, BK, ROWS, HALVES = 256, 32, 32, 16, 2  # head dim, query rows per threadgroup, keys per block, rows per pair


def kernel_name(dtype):
    return f"flash_attention_prefill_mpp_dsplit_{NAMES[dtype]}_d{D}_bq{BQ}_bk{BK}_wn{HALVES}"


def key_blocks(Nq, Nk, q0, causal):
    """Key blocks threadgroup `q0` runs: the threadgroup's, up to what its last real row sees (bottom-right)."""
    last = min(q0 + BQ, Nq) - 1
    visible = min(max(last + (Nk - Nq) + 1, 0), Nk) if causal else Nk
    return math.ceil(visible / BK)


def expected(B, Hq, Nq, Nk, causal):
    """(matmul2d runs, threadgroup barriers) of one launch: per threadgroup and key block, 2 runs (Q.K^T, P.V)
    by each of its 4 SIMD-groups and 2 barriers (partials written; partials read), as the emulator counts a
    barrier: once per threadgroup."""
    blocks = sum(key_blocks(Nq, Nk, q0, causal) for q0 in range(0, Nq, BQ))
    return B * Hq * blocks * 2 * 2 * HALVES, B * Hq * blocks * 2


def run(q, k, v, causal, layout, instrumented=False, counted=True, **options):
    """The forced tensor_ops launch at D = 256 under `layout`; checks the plan and, with counted, the counts."""
    plan = flash_metal.explain(q, k, v, causal, None, "tensor_ops", **options)
    B, Hq, Nq, _ = q.shape
    assert plan.kernel_name == kernel_name(q.dtype)
    assert plan.grid == (math.ceil(Nq / BQ), Hq, B) and plan.threadgroup == (128, 1, 1)
    # Per SIMD-group: P (16 x 32) and its Q slice (16 x 128) in the dtype, a float per row; per pair two float
    # slots of partial S (16 x 32).
    assert plan.threadgroup_memory == 4 * (ROWS * (BK + D // 2) * 2 + ROWS * 4) + 2 * 2 * ROWS * BK * 4 == 28928
    out, lse = emulated_metal_attention(q, k, v, causal, None, "tensor_ops", instrumented=instrumented,
                                        mpp_layout=layout, **options)
    ((d, counts),) = LAST_DISPATCHES
    assert d.kernel_name in metal_mpp_dsplit_library(instrumented).dispatched_names()
    assert counts.mpp_runs > 0
    if counted:
        assert (counts.mpp_runs, counts.threadgroup_barriers) == expected(B, Hq, Nq, k.shape[2], causal)
    return out, lse


# (Nq, Nk): one row and one key; a ragged block of each; two threadgroups, the second's second row group with
# no row; more queries than keys (causal: the first rows see no key).
SHAPES = ((1, 1), (17, 33), (40, 70), (40, 20))
CASES = [(torch.float16, s) for s in SHAPES] + [(torch.bfloat16, (17, 33)), (torch.bfloat16, (40, 70))]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, shape", CASES, ids=lambda c: dtype_id(c) if isinstance(c, torch.dtype)
                         else f"{c[0]}x{c[1]}")
def test_matches_float64(dtype, shape, causal, layout):
    Nq, Nk = shape
    g = torch.Generator().manual_seed(hash((causal, Nq, Nk, str(dtype))) % 2**31)
    q, k, v = make_qkv(1, 2, 1, Nq, Nk, D, dtype, generator=g)  # GQA 2
    out, lse = run(q, k, v, causal, layout)
    assert_attention_close(out, lse, q, k, v, causal)
    if causal and Nq > Nk:  # rows that see no key: zeros and lse = -inf
        blind = Nq - Nk
        assert torch.all(out[:, :, :blind] == 0) and torch.all(lse[:, :, :blind] == float("-inf"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sanitized_ragged(layout):
    # The instrumented build: device bounds exact (ragged Q, K, V blocks and the second threadgroup's empty row
    # group read nothing past the ends), threadgroup races between SIMD-groups (the partials) and lanes (Q, P).
    q, k, v = make_qkv(1, 2, 1, 40, 45, D, torch.float16, generator=torch.Generator().manual_seed(40))
    out, lse = run(q, k, v, True, layout, instrumented=True)
    assert_attention_close(out, lse, q, k, v, True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_inputs_and_batches(layout):
    # Batch 2, GQA 3, q and k transposed (row stride H * D), v with a feature stride of 2 (each half's slice
    # starts at feature 128, element 256 of the row), a scale of its own.
    g = torch.Generator().manual_seed(5)
    q, k, v = make_qkv(2, 3, 1, 20, 37, D, torch.bfloat16, layout=("transposed", "transposed", "every_other"),
                       generator=g)
    plan = flash_metal.explain(q, k, v, False, 0.3, "tensor_ops")
    assert plan.kernel_name == kernel_name(torch.bfloat16)
    out, lse = emulated_metal_attention(q, k, v, False, 0.3, "tensor_ops", mpp_layout=layout)
    assert LAST_DISPATCHES[0][1].mpp_runs == expected(2, 3, 20, 37, False)[0]
    assert_attention_close(out, lse, q, k, v, False, 0.3)


# ---- the options, each once (the layouts alternate) ----------------------------------------------------------

OPTION_CASES = {
    "window": (False, dict(window_left=20, window_right=5)),
    "causal-window": (True, dict(window_left=24)),
    "softcap": (True, dict(softcap=3.0)),
    "sinks": (False, dict(sinks=True)),
    "mask-bool": (True, dict(attn_mask="bool")),
    "mask-float32": (False, dict(attn_mask="float32")),
}


def _options(case, q, k, g):
    causal, opts = OPTION_CASES[case]
    opts = dict(opts)
    if "attn_mask" in opts:
        opts["attn_mask"] = make_mask(opts["attn_mask"], q.shape[:3] + k.shape[2:3], q.dtype, g)
    if opts.get("sinks"):
        opts["sinks"] = torch.randn(q.shape[1], generator=g)
    return causal, opts


@pytest.mark.parametrize("case, layout", [(c, LAYOUTS[i % 2]) for i, c in enumerate(OPTION_CASES)])
def test_options_match_float64(case, layout):
    g = torch.Generator().manual_seed(hash(case) % 2**31)
    q, k, v = make_qkv(1, 2, 1, 40, 70, D, torch.float16, generator=g)
    causal, opts = _options(case, q, k, g)
    out, lse = run(q, k, v, causal, layout, counted=False, **opts)
    assert_attention_close(out, lse, q, k, v, causal, **opts)


def test_every_option_at_once_sanitized():
    g = torch.Generator().manual_seed(9)
    q, k, v = make_qkv(1, 2, 1, 37, 45, D, torch.bfloat16, generator=g)
    opts = dict(attn_mask=make_mask("bool", (1, 2, 37, 45), q.dtype, g), window_left=30, softcap=4.0,
                sinks=torch.randn(2, generator=g))
    out, lse = run(q, k, v, True, "scrambled", instrumented=True, counted=False, **opts)
    assert_attention_close(out, lse, q, k, v, True, **opts)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_varlen_matches_float64(layout):
    # Packed sequences, empty ones included; causal with a left window; GQA 2. A threadgroup past its
    # sequence leaves whole (before any barrier).
    g = torch.Generator().manual_seed(21)
    q, k, v, cu_q, cu_k, mq, mk = packed([(40, 20), (1, 1), (0, 4), (4, 0), (17, 33)], 2, 1, D, torch.float16, g)
    out, lse = emulated_metal_varlen(q, k, v, cu_q, cu_k, mq, mk, True, None, "tensor_ops", mpp_layout=layout,
                                     window_left=12)
    ((d, counts),) = LAST_DISPATCHES
    assert d.kernel_name == kernel_name(torch.float16) and d.function_constants[9] and counts.mpp_runs > 0
    assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, True, None, window_left=12)


# ---- routing ----------------------------------------------------------------------------------------------

def _qkv(dtype, dqk=D, dv=D, nq=64):
    g = torch.Generator().manual_seed(nq + dqk)
    return (torch.randn(1, 4, nq, dqk, generator=g).to(dtype), torch.randn(1, 2, 200, dqk, generator=g).to(dtype),
            torch.randn(1, 2, 200, dv, generator=g).to(dtype))


def test_forced_plan_and_reason():
    plan = flash_metal.explain(*_qkv(torch.float16), True, None, "tensor_ops")
    assert plan.kernel_name == kernel_name(torch.float16)
    assert plan.reason.startswith("forced: tensor_ops (impl='tensor_ops'); FlashAttention-2 on Metal 4 tensor ops")
    assert "split along D" in plan.reason and "28928 bytes of threadgroup memory" in plan.reason


# (gpu, dtype, D_v, Nq, picked, words in the reason)
GATE = [
    ("m5+tensor_ops", torch.float16, D, 128, True, "a model, not a measurement"),
    ("m5-max+tensor_ops", torch.bfloat16, D, 4096, True, "ahead of the simdgroup prefill at D = 256"),
    ("m5", torch.float16, D, 128, False, "tensor ops not used: planned without a Mac"),
    ("m4-max+tensor_ops", torch.float16, D, 128, False, "prefill: Nq = 128"),
    ("m5+tensor_ops", torch.float32, D, 128, False, "float32 stays on simdgroup matrices"),
    ("m5+tensor_ops", torch.float16, 128, 128, False, "head dims 256 / 128"),
    ("m5+tensor_ops", torch.float16, D, 8, False, "decode: Nq = 8"),
]


@pytest.mark.parametrize("gpu, dtype, dv, nq, picked, words", GATE)
def test_auto_takes_it_only_where_the_gate_and_the_model_hold(gpu, dtype, dv, nq, picked, words):
    plan = flash_metal.explain(*_qkv(dtype, dv=dv, nq=nq), True, None, "auto", gpu)
    assert (plan.kernel_name == kernel_name(dtype) if picked else "_mpp_" not in plan.kernel_name), plan.reason
    assert words in plan.reason, plan.reason
    if gpu.startswith("m4"):
        assert "tensor ops" not in plan.reason


def test_the_switch_keeps_auto_off_it(monkeypatch):
    qkv = _qkv(torch.float16)
    assert flash_metal.explain(*qkv, True, None, "auto", "m5+tensor_ops").kernel_name == kernel_name(torch.float16)
    monkeypatch.setenv("FLASH_METAL_DISABLE_TENSOR_OPS", "1")
    plan = flash_metal.explain(*qkv, True, None, "auto", "m5+tensor_ops")
    assert "_mpp_" not in plan.kernel_name and "FLASH_METAL_DISABLE_TENSOR_OPS=1" in plan.reason


def test_an_auto_routed_plan_runs_it():
    g = torch.Generator().manual_seed(27)
    q, k, v = make_qkv(1, 2, 1, 33, 40, D, torch.bfloat16, generator=g)
    out, lse = emulated_metal_attention(q, k, v, True, None, "auto", gpu="m5+tensor_ops", mpp_layout="scrambled")
    ((d, counts),) = LAST_DISPATCHES
    assert d.kernel_name == kernel_name(torch.bfloat16) and counts.mpp_runs == expected(1, 2, 33, 40, True)[0]
    assert_attention_close(out, lse, q, k, v, True)


@pytest.mark.parametrize("what, dv, dtype, err, words", [
    ("float32", D, torch.float32, TypeError, ["float16 or bfloat16", "float32"]),
    ("v head dim 128", 128, torch.float16, ValueError, ["v's head dim 256", "128"]),
])
def test_forced_refuses_what_it_does_not_cover(what, dv, dtype, err, words):
    with pytest.raises(err) as info:
        flash_metal.explain(*_qkv(dtype, dv=dv), False, None, "tensor_ops")
    for w in words + ["impl='tensor_ops'"]:
        assert w in str(info.value), (w, str(info.value))


def test_the_backward_at_256_runs_the_split_d_backward():
    # The tensor-op backward at D = 256 has split-D kernels of its own (attention_backward_mpp_dsplit.h;
    # tests/test_metal_tensor_ops_backward_d256.py runs them): forced, and by Auto on an M5 with the library.
    q, k, v = _qkv(torch.float16)
    lse = torch.zeros(1, 4, 64)
    for impl, gpu in (("tensor_ops", "base"), ("auto", "m5+tensor_ops")):
        plan = flash_metal.explain(q, k, v, False, None, impl, gpu, backward=True, grad_out=q, out=q, lse=lse)
        assert [d.kernel_name for d in plan.dispatches] == [
            "flash_backward_mpp_dsplit_dq_float16_d256_bq16_bk32_wn2",
            "flash_backward_mpp_dsplit_dkdv_float16_d256_bk32_bq16_wn2"], plan.reason


def test_library_holds_the_two_instantiations_apart_from_the_default_build():
    lib = metal_mpp_dsplit_library(False)
    assert sorted(lib.kernel_names()) == sorted(kernel_name(dt) for dt in NAMES)
    assert all(lib.max_threads(n) == 128 for n in lib.kernel_names())
    assert not any("dsplit" in n for n in backends.metal_mpp_library(False).kernel_names())


# ---- planted bugs ----------------------------------------------------------------------------------------

def _planted(tmp_path, monkeypatch, old, new):
    """A copy of shaders/ with `old` (once in attention_prefill_mpp_dsplit.h) replaced by `new`, its float16
    kernel alone in an instrumented partial library the emulated backend then runs."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shutil.copytree(os.path.join(root, "shaders"), tmp_path / "shaders")
    header = tmp_path / "shaders" / "attention_prefill_mpp_dsplit.h"
    text = header.read_text()
    assert text.count(old) == 1
    header.write_text(text.replace(old, new))
    lib = compile_library([str(tmp_path / "shaders" / "attention_mpp.metal")], instrumented=True, msl=4,
                          only=[kernel_name(torch.float16)])
    monkeypatch.setattr(backends, "metal_mpp_dsplit_library", lambda instrumented, fast_math=False: lib)
    return lib


def test_planted_missing_barrier_before_the_sum_is_a_race(tmp_path, monkeypatch):
    barrier = "    threadgroup_barrier(mem_flags::mem_threadgroup);  // both halves' partials written"
    _planted(tmp_path, monkeypatch, barrier, "    // (planted: no barrier) both halves' partials written")
    q, k, v = make_qkv(1, 1, 1, 17, 33, D, torch.float16, generator=torch.Generator().manual_seed(72))
    with pytest.raises(EmulatorError) as info:
        emulated_metal_attention(q, k, v, False, None, "tensor_ops", instrumented=True, mpp_layout="m5")
    assert "race" in info.value.kinds


def test_planted_summing_the_wrong_partial_is_not_close(tmp_path, monkeypatch):
    # Each half adds its own partial (2 S_h) instead of the other's: the kernel runs clean, the numbers fail.
    right = "s[i] + other[idx[1] * BK + idx[0]]"
    lib = _planted(tmp_path, monkeypatch, right, "s[i] + mine[idx[1] * BK + idx[0]]")
    q, k, v = make_qkv(1, 1, 1, 17, 33, D, torch.float16, generator=torch.Generator().manual_seed(73))
    out, lse = emulated_metal_attention(q, k, v, False, None, "tensor_ops", instrumented=True, mpp_layout="m5")
    assert LAST_DISPATCHES[0][0].kernel_name in lib.dispatched_names()
    with pytest.raises(NotClose):
        assert_attention_close(out, lse, q, k, v, False)
