"""The split-D backward for head dim 512 on Metal (issue 20, section 3),
priced by the model against the composite (unfused) backward: the verdict
csrc/metal/families/backward_splitd.cpp routes auto backward calls on. Nothing here ran
on a GPU: every time is a prediction ("model, not measurement").

    python -m benchmarks.model splitd-backward

The kernels are the shipped ones (shaders/backward/attention_backward_splitd.h): a
dQ kernel over 8 query rows and a dK/dV kernel over 8 keys, each on 8
SIMD-groups of 64 features that read their operands from device memory, S
and dP summed over the parts through threadgroup memory (2 barriers per
block). Their counts come from the instrumented emulator on the planner's own
launches (impl='prefill' at D = 512, tests/backends.py
emulated_metal_attention_backward), N = 128, 192, 256 for one head, scaled
by the quadratic rule (core/backward_counts.py scaled_counts); their time from
core/timing.py predict / predict_band (its "flash_backward_splitd_"
branch: two DRAM latencies, two barriers, the S then dP chains per block) and
the planner's residency estimates. The composite side is
core/unfused.py unfused_seconds: 4 GEMMs with P saved by the forward,
5 kernels, dense even when causal, at the same MMA rate and streaming
ceiling: generous to it (the composite path recomputes P, one more GEMM, and
runs in chunks of query rows).
"""
import torch

from ..core import backward_counts as BM
from ..core import counts as M
from ..core import gpus as G
from ..core import timing as T
from ..core.unfused import unfused_seconds

D = 512
CHIPS = ("M1 Max", "M3 Max", "M4 Pro", "M5 (10-core)")
LENGTHS = (1024, 4096)
IMPL = "prefill"  # the backward's forcing impl at D = 512: the split-D pair


def records(s: M.Shape, causal, dtype=torch.float16):
    """The split-D backward's dispatch records at shape s (Nq = Nk a multiple of 64, Hq = Hkv)."""
    recs = BM.scaled_counts(s, dtype, causal, impl=IMPL)
    assert [r.kernel.split("_d512")[0] for r in recs] == [
        f"flash_backward_splitd_dq_{str(dtype)[6:]}", f"flash_backward_splitd_dkdv_{str(dtype)[6:]}"], recs
    return recs


def compare(s: M.Shape, causal, chip, dtype=torch.float16):
    """{'fused': (low, point, high) s, 'unfused': s, 'bound': the largest term}."""
    gpu = G.BY_NAME[chip]
    recs = records(s, causal, dtype)
    terms = T.predict(recs, gpu, s, dtype, causal)[1]
    return {"fused": T.predict_band(recs, gpu, s, dtype, causal),
            "unfused": unfused_seconds(s, dtype, gpu),
            "unfused_accel": unfused_seconds(s, dtype, gpu,
                                             flops_per_core_cycle=G.tensor_op_rate(gpu.generation)[1]),
            "bound": max(terms, key=terms.get)}


def band_ahead(r):
    """The share of the fused band [low, high] below unfused's time (0 to 1)."""
    lo, _, hi = r["fused"]
    return min(1.0, max(0.0, (r["unfused"] - lo) / (hi - lo))) if hi > lo else float(hi < r["unfused"])


def verdicts():
    """{(causal, n, chip): (unfused / point, band share ahead, bound, row)} over the grid."""
    out = {}
    for causal in (False, True):
        for n in LENGTHS:
            s = M.Shape(1, 8, 8, n, n, D)
            for chip in CHIPS:
                a = compare(s, causal, chip)
                out[(causal, n, chip)] = (a["unfused"] / a["fused"][1], band_ahead(a), a["bound"], a)
    return out


def routed(v, causal):
    """The routing rule: auto takes the split-D backward for this causal setting only where the whole band
    is ahead of unfused on every chip and length of the grid."""
    return all(share >= 1.0 for (c, _, _), (_, share, _, _) in v.items() if c == causal)


def report():
    v = verdicts()
    print("\n## Head dim 512, float16, split-D backward vs the composite (unfused) backward: model, not measurement")
    print("(fused band: every uncertain figure at its fast end, then its slow end; unfused: 4 GEMMs with P saved, "
          "dense even when causal, at the same MMA rate and streaming ceiling)")
    print("| chip | shape | causal | unfused ms | split-D ms (band) | unfused / split-D | band ahead | bound | "
          "unfused, matmuls on M5's accelerators ms |")
    print("|" + "---|" * 9)
    for (causal, n, chip), (ratio, share, bound, a) in v.items():
        lo, pt, hi = a["fused"]
        accel = f"{a['unfused_accel'] * 1e3:.2f}" if G.BY_NAME[chip].generation == 5 else "-"
        print(f"| {chip} | 1x8x{n}x512 | {causal} | {a['unfused'] * 1e3:.2f} | {pt * 1e3:.2f} "
              f"({lo * 1e3:.2f}-{hi * 1e3:.2f}) | {ratio:.2f}x | {share:.0%} | {bound} | {accel} |")
    for causal in (True, False):
        print(f"causal={causal}: routed by auto: {routed(v, causal)} (the whole band ahead on every chip and length)")

