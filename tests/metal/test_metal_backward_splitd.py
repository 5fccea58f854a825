"""The split-D backward at head dim 512 (issue 20 section 3,
shaders/backward/attention_backward_splitd.h): its routing and explain() text, its
gradients through the sanitizing emulator against float64 autograd by the 2x
rule (tests/numerics.py), determinism, and planted bugs.

Routing (csrc/metal/families/backward_splitd.cpp, splitd_backward_takes): the model
(benchmarks/model/families/splitd_backward.py) puts the split-D backward behind
the composite backward at 1x8x{1024,4096}x512 on every named chip, so
impl='auto' keeps the composite path and says why; impl='prefill' (the
backward's forcing impl at D = 512) runs the two kernels. Every run here is
sanitized (races, out-of-bounds, barrier divergence raise), the gradients are
poisoned with NaN before the run (tests/backends.py), and each run proves the
split-D pair ran, from the partial library that holds only it (the default
emulator builds leave it out: tests/shader_builds.py). Shapes stay small and
ragged (CI time): Nq != Nk both ways, rows with no visible key, GQA 2:1.
"""
import math
import os
import shutil

import pytest
import torch

import backends
import flash_metal
from backends import emulated_metal_attention_backward
from flash_metal.reference import attention_reference, attention_varlen_reference
from numerics import (DTYPES, NotClose, assert_gradients_close, assert_varlen_gradients_close, dtype_id, make_qkv,
                      make_tensor)
from test_sinks import assert_sinks_grad_close
from repo_paths import ROOT_DIR

D = 512
DQ, DKV = "flash_backward_splitd_dq_", "flash_backward_splitd_dkdv_"


def _names(dtype):
    t = str(dtype)[6:]
    return [f"{DQ}{t}_d512_bq8_bk32_wm8", f"{DKV}{t}_d512_bq32_bk8_wm8"]


def _ran(dtype, sinks=False):
    """The last emulated backward ran the split-D pair of `dtype` (then flash_sinks_grad with sinks), from
    the split-D partial library, sanitizing."""
    names = [d.kernel_name for d, _ in backends.LAST_DISPATCHES]
    assert names == _names(dtype) + (["flash_sinks_grad"] if sinks else []), names
    assert set(names) <= set(backends.splitd_backward_library(True).dispatched_names())


def _case(B, Hq, Hkv, nq, nk, dtype, causal, seed, grad_lse=False, **options):
    """Fresh q, k, v, the float64 oracle's out (in dtype) and lse, grad_out and grad_lse."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = make_qkv(B, Hq, Hkv, nq, nk, D, dtype, generator=g)
    out, lse = attention_reference(q, k, v, causal, None, **options)
    grad_out = make_tensor((B, Hq, nq, D), "contiguous", dtype, g)
    gl = torch.randn(B, Hq, nq, generator=g) if grad_lse else None
    return q, k, v, out.to(dtype), lse.float(), grad_out, gl


def _run(case, causal, seed=0, **options):
    q, k, v, out, lse, grad_out, gl = case
    return emulated_metal_attention_backward(grad_out, q, k, v, out, lse, causal, None, gl, instrumented=True,
                                             impl="prefill", seed=seed, **options)


def _check(case, causal, **options):
    q, k, v, out, lse, grad_out, gl = case
    grads = _run(case, causal, **options)
    _ran(q.dtype, "sinks" in options)
    assert_gradients_close(grads[:3], q, k, v, grad_out, causal, None, gl, **options)
    return grads


def _explain(nq=64, nk=64, causal=True, impl="prefill", dv=D, **options):
    q = torch.empty(1, 2, nq, D, dtype=torch.float16)
    k = torch.empty(1, 1, nk, D, dtype=torch.float16)
    v = torch.empty(1, 1, nk, dv, dtype=torch.float16)
    return flash_metal.explain(q, k, v, causal, None, impl, backward=True, **options)


# ---------------------------------------------------------------- routing

def test_auto_keeps_the_composite_path_with_the_model_verdict():
    for causal in (True, False):
        plan = _explain(causal=causal, impl="auto")
        assert plan.dispatches == () and plan.reason.startswith("composite (backward)"), plan.reason
        assert "the model puts the split-D backward behind the composite backward" in plan.reason
        assert "a model, not a measurement" in plan.reason and "impl='prefill' runs the split-D backward" in plan.reason


def test_impl_prefill_forces_the_split_d_pair_with_its_launches():
    plan = _explain(nq=37, nk=11, grad_lse=torch.empty(1, 2, 37))
    dq, dkv = plan.dispatches
    assert [dq.kernel_name, dkv.kernel_name] == _names(torch.float16)
    assert dq.grid == (5, 2, 1) and dkv.grid == (2, 1, 1) and dq.threadgroup == dkv.threadgroup == (256, 1, 1)
    assert (dq.threadgroup_memory, dkv.threadgroup_memory) == (17664, 18432)
    assert dq.live_registers <= 72 and dkv.live_registers <= 72
    assert dq.function_constants[0] and dq.function_constants[3] and not dkv.function_constants[3]
    assert plan.reason.startswith("backward (split-D): requested by the caller (impl='prefill') at D = 512")
    assert "not yet verified on Apple hardware" in plan.reason and "deterministic" in plan.reason
    # Sinks add flash_sinks_grad after the pair.
    names = [d.kernel_name for d in _explain(sinks=torch.zeros(2)).dispatches]
    assert names == _names(torch.float16) + ["flash_sinks_grad"]


def test_what_the_split_d_backward_does_not_take():
    with pytest.raises(NotImplementedError, match="D_qk = D_v = 512 exactly"):
        _explain(dv=256)
    q = torch.empty(1, 1, 16, 128)
    with pytest.raises(ValueError, match="impl must be 'auto' or 'tensor_ops'"):  # 'prefill' names it at 512 only
        flash_metal.explain(q, q, q, True, None, "prefill", backward=True)


def test_autograd_forwards_impl_prefill_to_the_backward_at_512_on_metal():
    # flash_metal/ops.py: impl='prefill' at D_qk = D_v = 512 on an MPS tensor makes autograd's backward ask
    # for the split-D pair; everything else keeps 'auto'. (Stand-ins for the MPS tensors: only device and
    # shape are read; the fake MPS device of tests/mps_exec does not run autograd.)
    from types import SimpleNamespace

    from flash_metal import ops

    class Ctx:
        def save_for_backward(self, *tensors):
            self.saved_tensors = tensors

    def impl_for(device, d, impl):
        t = SimpleNamespace(device=torch.device(device), shape=(1, 2, 9, d), requires_grad=False)
        ctx = Ctx()
        ops._setup_context(ctx, (t, t, t, True, None, impl, None, -1, -1, 0.0, None), (None, None))
        return ctx.backward_impl

    assert impl_for("mps", 512, "prefill") == "prefill"
    assert impl_for("mps", 512, "auto") == impl_for("mps", 256, "prefill") == impl_for("cpu", 512, "prefill") == "auto"
    # _backward passes it on: the CPU op refuses 'prefill', which proves it arrived.
    q, k, v, out, lse, grad_out, _ = _case(1, 1, 1, 4, 4, torch.float32, True, seed=1)
    ctx = Ctx()
    ctx.save_for_backward(q, k, v, out, lse, None, None)
    ctx.options, ctx.features, ctx.mask_needs_grad, ctx.backward_impl = (True, None), (-1, 0, 0.0), False, "prefill"
    with pytest.raises(ValueError, match="impl='prefill'"):
        ops._backward(ctx, grad_out, None)


# ---------------------------------------------------------------- results

# (Nq, Nk): more keys than queries, and more queries than keys (causal: the
# first Nq - Nk rows see no key: grad_q 0, nothing added to grad_k / grad_v).
SHAPES = ((11, 37), (37, 11))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"q{s[0]}k{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_causal_gqa_grad_lse_matches_float64(dtype, shape):
    nq, nk = shape
    # Nq > Nk also runs 2 batches of 2 kv heads (GQA 2:1): the group's query heads and the batch offsets.
    B, Hq, Hkv = (2, 4, 2) if nq > nk else (1, 2, 1)
    case = _case(B, Hq, Hkv, nq, nk, dtype, True, seed=nq + 3 * nk, grad_lse=dtype != torch.bfloat16)
    dq, dk, dv = _check(case, True)
    if nq > nk:
        assert (dq[:, :, : nq - nk] == 0).all() and (dq[:, :, nq - nk:] != 0).any()


def _mask(kind, nq, nk, dtype, g):
    drop = torch.rand(1, 1, nq, nk, generator=g) < 0.1
    if kind == "bool":
        keep = ~drop
        keep[..., 0, :] = False  # row 0 sees no key
        return keep
    return torch.randn(1, 1, nq, nk, generator=g).masked_fill(drop, -math.inf).to(
        torch.float32 if kind == "float32" else dtype)


# Each option on its own (float16, GQA 2:1, 21 x 45), causal unless named; the input-dtype additive mask
# in bfloat16.
OPTIONS = ["not_causal", "window", "softcap", "bool_mask", "float32_mask", "input_mask", "sinks"]


@pytest.mark.parametrize("option", OPTIONS)
def test_options_match_float64(option):
    nq, nk, causal = 21, 45, option != "not_causal"
    dtype = torch.bfloat16 if option == "input_mask" else torch.float16
    g = torch.Generator().manual_seed(len(option))
    options = {}
    if option.endswith("mask"):
        options["attn_mask"] = _mask(option.split("_")[0], nq, nk, dtype, g)
    elif option == "window":
        options.update(window_left=9, window_right=3)  # blocks behind every row's window are skipped
    elif option == "softcap":
        options["softcap"] = 2.0
    elif option == "sinks":
        options["sinks"] = torch.tensor([0.5, -1.0])
    case = _case(1, 2, 1, nq, nk, dtype, causal, seed=17, grad_lse=option == "sinks", **options)
    grads = _check(case, causal, **options)
    if option == "sinks":
        q, k, v, _, _, grad_out, gl = case
        assert_sinks_grad_close(grads[3], q, k, v, options["sinks"], grad_out, gl, causal, {})


def test_varlen_two_sequences_match_float64():
    # Two sequences (Nq != Nk both ways), GQA 2:1, causal bottom-right per sequence, float32 (dK/dV summed
    # per head in memory).
    cq, ck = torch.tensor([0, 13, 22], dtype=torch.int32), torch.tensor([0, 9, 40], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(22, 2, D, generator=g)
    k, v = torch.randn(40, 1, D, generator=g), torch.randn(40, 1, D, generator=g)
    out, lse = attention_varlen_reference(q, k, v, cq, ck, True, None)
    grad_out = torch.randn(q.shape, generator=g)
    grads = emulated_metal_attention_backward(grad_out, q, k, v, out.float(), lse.float(), True, None, None,
                                              instrumented=True, impl="prefill", cu_seqlens_q=cq, cu_seqlens_k=ck,
                                              max_seqlen_q=13, max_seqlen_k=31)
    _ran(torch.float32)
    assert_varlen_gradients_close(grads, q, k, v, grad_out, cq, ck, True, None, None)


def test_deterministic_across_runs_and_thread_schedules():
    # No atomics, one writer per element, every sum in a fixed order: bitwise equal, whatever order the
    # emulator runs the threads in (seed 0: fixed; 5: shuffled).
    case = _case(1, 2, 1, 19, 23, torch.bfloat16, True, seed=8, grad_lse=True)
    first = _run(case, True)
    _ran(torch.bfloat16)
    again = _run(case, True, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


# ---------------------------------------------------------------- planted bugs

@pytest.mark.parametrize("old, new, caught", [
    # the dQ kernel's second barrier removed: dS read before every part wrote it
    ("    threadgroup_barrier(mem_flags::mem_threadgroup);  // dS written before every part reads it (RAW)\n",
     "", "race"),
    # a wrong Delta: grad_lse added instead of subtracted
    ("if (fc_has_grad_lse) row_delta -= dlse", "if (fc_has_grad_lse) row_delta += dlse", "2x rule"),
    # the dK/dV kernel's causal bound off by one: each query's diagonal key dropped
    ("key_in_window(sv, qrow, b_key)", "b_key < qrow + sv.upper", "2x rule"),
], ids=["barrier", "delta", "causal"])
def test_planted_bugs_are_caught(tmp_path, monkeypatch, old, new, caught):
    # A copy of shaders/ with one bug in the split-D backward, its float16 pair built alone (sanitizing):
    # the sanitizer or the 2x rule must reject it.
    from metal_emulator import EmulatorError, compile_library

    root = ROOT_DIR
    shutil.copytree(os.path.join(root, "shaders"), tmp_path / "shaders")
    header = tmp_path / "shaders" / "backward" / "attention_backward_splitd.h"
    text = header.read_text()
    assert text.count(old) == 1
    header.write_text(text.replace(old, new))
    lib = compile_library([str(tmp_path / "shaders" / "attention.metal")], instrumented=True,
                          only=["flash_backward_splitd_*_float16_*"])
    monkeypatch.setattr(backends, "splitd_backward_library", lambda instrumented: lib)
    case = _case(1, 2, 1, 21, 37, torch.float16, True, seed=2, grad_lse=True)
    with pytest.raises(EmulatorError if caught == "race" else NotClose) as e:
        _check(case, True)
    assert caught != "race" or "race" in e.value.kinds
