"""The split-D forward for head dim 512 on Metal (issue 20, section 3), priced
by the model: the verdict csrc/metal/families/prefill_splitd.cpp routes on. Nothing
here ran on a GPU: every time is a prediction ("model, not measurement").

    python -m benchmarks.model splitd

The kernel is the shipped one (shaders/prefill/attention_prefill_splitd.h, first
written as a probe): one threadgroup per 8 query rows, 8 SIMD-groups each
owning 64 of the 512 features of Q and O in registers, K and V read straight
from device memory per part, S summed over the parts through threadgroup
memory and the softmax shared among them (3 barriers per 32-key block).
Its counts come from the instrumented emulator on the planner's own launch
(impl='prefill' at D = 512), N = 128, 192, 256 for one head, scaled by the
quadratic rule (families/d512.py records); its time from
core/timing.py predict / predict_band with the split-D serial section
(timing.py, "_splitd_") and the planner's residency rule applied to
its live values (live_values) and threadgroup memory; unfused from
core/unfused.py unfused_seconds(forward=True), which prices the
composite path's full S (it does not skip causal blocks: the composite path
computes every score and masks them).
"""
import functools
import math
import os

import torch

import flash_metal

from ..core import counts as M
from ..core import gpus as G
from ..core import timing as T
from ..core.emulator import SHADERS, tests_module
from ..core.unfused import unfused_seconds
from . import d512 as W

HEADER = os.path.join(SHADERS, "prefill", "attention_prefill_splitd.h")
D = W.D
# (family, BQ, BK, WM) of the shipped instantiation (its host name's parameters).
PLANS = (("prefill_splitd", 8, 32, 8),)
PLAN = PLANS[0]
PARTS = 8  # SIMD-groups per 8-row group: 64 features each (the header says why)
KERNELS = ("flash_attention_prefill_splitd_*",)  # the partial emulator library run() uses
# kLiveOverhead (csrc/metal/plan_detail.h): addresses, loop counters, the row's indices.
LIVE_OVERHEAD = 16


def live_values(bk, parts=PARTS):
    """Live 32-bit values per lane, the planner's (csrc/metal/families/prefill_splitd.cpp splitd_live_registers):
    the prefill formula (prefill_live_registers) plus Q's fragments, which the template keeps in
    threadgroup memory and this kernel in registers: O and Q (D / 4 / parts each), one block of S
    (bk / 4), the row max and sum (2), two operand fragments (4), kLiveOverhead, and the shared
    step's second running max (1)."""
    return 2 * (D // 4 // parts) + bk // 4 + 2 + 4 + LIVE_OVERHEAD + 1


def tg_bytes(bk=PLAN[2], wm=PLAN[3]):
    """Threadgroup memory (splitd_threadgroup_bytes): WM x 8 x BK partials, the block's P and two rows of
    8 per part, in floats."""
    return (wm * 8 * bk + 8 * bk + 2 * wm * 8) * 4


def library(instrumented=True):
    return tests_module("shader_builds").shipped_library(instrumented=instrumented, only=KERNELS)


def run(q, k, v, causal, bq=PLAN[1], bk=PLAN[2], wm=PLAN[3], instrumented=True, family=PLAN[0]):
    """(out, lse, counts, (plan, tg bytes)) of the shipped split-D kernel, on the planner's launch
    (impl='prefill'): q, k, v (B, H, N, 512), outputs poisoned with NaN."""
    B, H, N, d = q.shape
    assert d == D
    (plan,) = flash_metal.explain(q, k, v, causal, 1 / math.sqrt(D), "prefill").dispatches
    assert plan.kernel_name == f"flash_attention_{family}_{str(q.dtype)[6:]}_d512_bq{bq}_bk{bk}_wm{wm}", plan
    assert plan.threadgroup_memory == tg_bytes(bk, wm)
    out = torch.full((B, H, N, D), float("nan"), dtype=q.dtype)
    lse = torch.full((B, H, N), float("nan"))
    tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse}
    # The options' slots hold q, as the MPS host binds them without options.
    buffers = {i: tensors.get(name, q) for name, i in plan.buffers.items()}
    counts = library(instrumented).dispatch(
        plan.kernel_name, buffers=buffers, bytes={plan.params_index: plan.params},
        function_constants=dict(enumerate(plan.function_constants)), grid=plan.grid,
        threadgroup=plan.threadgroup, threadgroup_memory={plan.threadgroup_memory_index: plan.threadgroup_memory})
    return out, lse, counts, (plan, plan.threadgroup_memory)


def records(s: M.Shape, causal, plan=PLAN):
    family, *blocks = plan
    return W.records(s, causal, tuple(blocks), run=functools.partial(run, family=family), family=family,
                     source=("live", live_values(blocks[1])))


def compare(s: M.Shape, causal, chip, plan=PLAN):
    """{'fused': (low, point, high) s, 'unfused': s, 'bound': the largest term, 'residency': threadgroups per core}."""
    gpu = G.BY_NAME[chip]
    recs = records(s, causal, plan)
    terms = T.predict(recs, gpu, s, torch.float16, causal)[1]
    return {"fused": T.predict_band(recs, gpu, s, torch.float16, causal),
            "unfused": unfused_seconds(s, torch.float16, gpu, forward=True),
            # the same, its matmuls on M5's neural accelerators (tensor ops; elsewhere the same rate)
            "unfused_accel": unfused_seconds(s, torch.float16, gpu, forward=True,
                                             flops_per_core_cycle=G.tensor_op_rate(gpu.generation)[1]),
            "bound": max(terms, key=terms.get),
            "residency": T.probe_residency(recs[0], gpu)[0]}


def band_ahead(r):
    """The share of the fused band [low, high] below unfused's time (0 to 1)."""
    lo, _, hi = r["fused"]
    return min(1.0, max(0.0, (r["unfused"] - lo) / (hi - lo))) if hi > lo else float(hi < r["unfused"])


def verdict(r):
    """The issue's gate: 'ahead' when the point and most of the band beat unfused, 'point only' when
    the point does but most of the band does not, 'behind' otherwise."""
    if r["fused"][1] >= r["unfused"]:
        return "behind"
    return "ahead" if band_ahead(r) >= 0.5 else "point only"


def report():
    print("\n## Head dim 512, float16, split-D (shipped) vs unfused: model, not measurement")
    print("(fused band: every uncertain figure at its fast end, then its slow end; unfused: the composite "
          "path's three kernels at the same MMA rate and streaming ceiling, full S even when causal)")
    print("| chip | shape | causal | unfused ms | split-D bq8 bk32 ms (band) | unfused / split-D | band ahead | "
          "bound | TGs/core | verdict | unfused, matmuls on M5's accelerators ms |")
    print("|" + "---|" * 11)
    for causal in (False, True):
        for n in (1024, 4096):
            s = M.Shape(1, 8, 8, n, n, D)
            for chip in W.CHIPS:
                a = compare(s, causal, chip)
                lo, pt, hi = a["fused"]
                print(f"| {chip} | 1x8x{n}x512 | {causal} | {a['unfused'] * 1e3:.2f} | {pt * 1e3:.2f} "
                      f"({lo * 1e3:.2f}-{hi * 1e3:.2f}) | {a['unfused'] / pt:.2f}x | {band_ahead(a):.0%} | "
                      f"{a['bound']} | {a['residency']} | {verdict(a)} | "
                      + (f"{a['unfused_accel'] * 1e3:.2f} |" if G.BY_NAME[chip].generation == 5 else "- |"))
