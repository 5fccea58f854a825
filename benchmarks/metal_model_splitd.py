"""A split-D forward for head dim 512 on Metal (issue 20, section 3), priced
by the model before anything routes to it. Nothing here ran on a GPU: every
time is a prediction ("model, not measurement").

The kernel is a probe (tests/prefill_splitd_probe.metal, never shipped): one
threadgroup per 8 (or 16) query rows, 8 SIMD-groups per 8-row group each
owning 64 of the 512 features of Q and O in registers, K and V read straight
from device memory per part, S summed over the parts through a
double-buffered threadgroup scratch (one barrier per key block of 32 keys).
Its counts come from the instrumented emulator exactly as
benchmarks/metal_model_d512.py takes the FA2 template's (512-strided views
planned in the D = 256 bucket, params patched to 512, N = 128, 192, 256 for
one head, scaled by the quadratic rule); its time from
metal_model_timing.predict / predict_band with the split-D serial section
(metal_model_timing, "_splitd_") and the planner's residency rule applied to
its live values (LIVE) and threadgroup memory; unfused from
metal_backward_model.unfused_seconds(forward=True), which prices the
composite path's full S (it does not skip causal blocks: the composite path
computes every score and masks them).
"""
import functools
import math
import os

import torch

from . import apple_gpus as G
from . import metal_backward_model as BM
from . import metal_model as M
from . import metal_model_d512 as W
from . import metal_model_timing as T

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(_ROOT, "tests", "prefill_splitd_probe.metal")
D = W.D
# (family, BQ, BK, WM) of the probe's float16 instantiations; the first is the plan.
PLANS = (("splitd_coop", 8, 32, 8), ("splitd", 8, 32, 8), ("splitd", 8, 16, 8), ("splitd", 16, 32, 16))
PLAN = PLANS[0]
PARTS = 8  # SIMD-groups per 8-row group: 64 features each (the probe's comment says why)
# kLiveOverhead (csrc/metal_plan_detail.h): addresses, loop counters, the row's indices.
LIVE_OVERHEAD = 16


def live_values(bk, parts=PARTS):
    """Live 32-bit values per lane, the planner's prefill formula
    (prefill_live_registers) plus Q's fragments, which the template keeps in
    threadgroup memory and this kernel in registers: O and Q (D / 4 / parts
    each), one block of S (bk / 4), the row max and sum (2), two operand
    fragments (4), kLiveOverhead."""
    return 2 * (D // 4 // parts) + bk // 4 + 2 + 4 + LIVE_OVERHEAD


def tg_bytes(family, bq, bk, wm):
    """Threadgroup memory: the simple kernel's double-buffered partial S (2 x WM SIMD-groups x BK / 8
    fragments x 256 bytes); coop's single partials, the block's P and two rows of 8 per part, in floats."""
    if family == "splitd_coop":
        return (wm * 8 * bk + 8 * bk + 2 * wm * 8) * 4
    return 2 * wm * (bk // 8) * 256


def library(instrumented=True):
    from metal_emulator import compile_library  # tests/ on sys.path (metal_model imports tests/backends)

    return compile_library([PROBE], instrumented=instrumented)


def run(q, k, v, causal, bq, bk, wm, instrumented=True, family="splitd"):
    """(out, lse, counts, (plan, tg bytes)) of the split-D probe: q, k, v (B, H, N, 512), float16 or bfloat16."""
    B, H, N, d = q.shape
    assert d == D and q.dtype in (torch.float16, torch.bfloat16)
    plan, params = W._plan_at_d512(q, k, v, causal)
    dt = "float16" if q.dtype == torch.float16 else "bfloat16"
    out = torch.full((B, H, N, D), float("nan"), dtype=q.dtype)
    lse = torch.full((B, H, N), float("nan"))
    tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse}
    # The kernel's own buffers only (the plan also binds the options' buffers, which it does not declare).
    buffers = {i: tensors[name] for name, i in plan.buffers.items() if name in tensors}
    unused = torch.zeros(B + 1, dtype=torch.int32)  # cu_seqlens: declared for sequence_view, read only under varlen
    buffers.update({15: unused, 16: unused})
    nbytes = tg_bytes(family, bq, bk, wm)
    counts = library(instrumented).dispatch(
        f"flash_attention_{family}_{dt}_d512_bq{bq}_bk{bk}_wm{wm}", buffers=buffers,
        bytes={plan.params_index: params}, function_constants=dict(enumerate(plan.function_constants)),
        grid=(math.ceil(N / bq), H, B), threadgroup=(32 * wm, 1, 1), threadgroup_memory={0: nbytes})
    return out, lse, counts, (plan, nbytes)


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
            "unfused": BM.unfused_seconds(s, torch.float16, gpu, forward=True),
            # the same, its matmuls on M5's neural accelerators (tensor ops; elsewhere the same rate)
            "unfused_accel": BM.unfused_seconds(s, torch.float16, gpu, forward=True,
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


def main():
    print("\n## Head dim 512, float16, split-D probe vs unfused: model, not measurement")
    print("(fused band: every uncertain figure at its fast end, then its slow end; unfused: the composite "
          "path's three kernels at the same MMA rate and streaming ceiling, full S even when causal)")
    name = lambda p: f"{p[0].replace('splitd', 'split-D').replace('_', ' ')} bq{p[1]} bk{p[2]}"  # noqa: E731
    print(f"| chip | shape | causal | unfused ms | {name(PLAN)} ms (band) | unfused / split-D | band ahead | "
          "bound | TGs/core | verdict | " + " | ".join(name(p) + " ms" for p in PLANS[1:])
          + " | unfused, matmuls on M5's accelerators ms |")
    print("|" + "---|" * (11 + len(PLANS) - 1))
    for causal in (False, True):
        for n in (1024, 4096):
            s = M.Shape(1, 8, 8, n, n, D)
            for chip in W.CHIPS:
                a = compare(s, causal, chip)
                others = [compare(s, causal, chip, p)["fused"][1] for p in PLANS[1:]]
                lo, pt, hi = a["fused"]
                print(f"| {chip} | 1x8x{n}x512 | {causal} | {a['unfused'] * 1e3:.2f} | {pt * 1e3:.2f} "
                      f"({lo * 1e3:.2f}-{hi * 1e3:.2f}) | {a['unfused'] / pt:.2f}x | {band_ahead(a):.0%} | "
                      f"{a['bound']} | {a['residency']} | {verdict(a)} | "
                      + " | ".join(f"{t * 1e3:.2f}" for t in others)
                      + (f" | {a['unfused_accel'] * 1e3:.2f} |" if G.BY_NAME[chip].generation == 5 else " | - |"))
