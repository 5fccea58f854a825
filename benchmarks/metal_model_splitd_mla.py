"""The split-D forward at MLA's head dims on Metal (issue 20 sections 2 and 3),
priced by the model: the verdicts csrc/metal_routing_splitd.cpp routes on.
Nothing here ran on a GPU: every time is a prediction ("model, not
measurement").

    python -m benchmarks.metal_model_splitd_mla

The kernel is shaders/attention_prefill_splitd.h at (D_qk, D_v) = (576, 512)
and (256, 512): 8 query rows per threadgroup, 8 SIMD-groups each holding
D_qk / 8 features of Q and 64 of O in registers, K/V read from device memory
per part; and the absorbed-MLA decode, the same kernel packed over the query
heads of one latent kv head (fc_pack_gqa: a threadgroup's 8 rows are 8
heads' rows, so K/V are read once per 8 heads).

Counts: the instrumented emulator on the planner's own launch (explain,
impl='prefill'). Prefill: N = 128, 192, 256 for one head, scaled by
metal_model's quadratic rule (as benchmarks/metal_model_d512.py). Decode:
one packed threadgroup (8 heads on one kv head, Nq = 1) at Nk = 256 and 512,
linear in Nk (whole 32-key blocks), times the plan's threadgroups. Time:
metal_model_timing.predict / predict_band (the "_splitd_" serial section;
the packed grid through packed_group), residency by the planner's rule on
live_values and the threadgroup memory.

Baselines, from benchmarks/metal_model_decode_wide.py:
  * unfused: S = Q K^T, softmax, O = P V at the full MMA rate and streaming
    ceiling, K and V read once per kv head, full S even when causal:
    generous to it (the prefill verdict's baseline, as at D = 512);
  * composite: the ATen ops csrc/composite.cpp runs (K/V converted to
    float32, the scores written and re-read per step, a dispatch each):
    what impl='auto' runs today where split-D is not routed;
  * wide decode: the decode kernels' plan in the 576 bucket
    (flash_decode*_d576, impl='decode' past 16 rows per kv head).
K and V are priced as separate tensors even where they are views of one
latent cache (v = k[..., :512]): on a GPU the shared lines would be read
once, which favours the fused kernels further.
"""
import math

import torch

import flash_metal

from . import apple_gpus as G
from . import metal_model as M
from . import metal_model_d512 as W
from . import metal_model_decode_wide as DW
from . import metal_model_timing as T

KERNELS = ("flash_attention_prefill_splitd_*",)  # the partial emulator library the counts run on
PAIRS = ((576, 512), (256, 512))
CHIPS = W.CHIPS  # M1 Max, M3 Max, M4 Pro, M5 (10-core)
PREFILL_NS = (1024, 4096)
# (B, Hq): DeepSeek's absorbed MLA on one latent kv head, per GPU shard (16) and whole (128).
DECODE_SHAPES = ((1, 16), (8, 16), (1, 128), (2, 128), (4, 128), (8, 128))
DECODE_NKS = (4096, 32768)
DECODE_BASE_NKS = (256, 512)  # the linear rule's two points (whole 32-key blocks)
LIVE_OVERHEAD = 16  # kLiveOverhead (csrc/metal_plan_detail.h)
FIELDS = ("threadgroups", "threads", "threadgroup_barriers", "simdgroup_mmas", "exp2_calls",
          "threadgroup_bytes_read", "threadgroup_bytes_written")


def live_values(dqk, dv, bk=32, parts=8):
    """The planner's live values per lane (csrc/metal_routing_splitd.cpp splitd_live_registers)."""
    return (dqk + dv) // 4 // parts + bk // 4 + 2 + 4 + LIVE_OVERHEAD + 1


def library(instrumented=True):
    from shader_builds import shipped_library  # tests/ on sys.path (metal_model imports tests/backends)

    return shipped_library(instrumented=instrumented, only=KERNELS)


def run(q, k, v, causal, instrumented=True):
    """(out, lse, counts, plan dispatch) of the split-D kernel on the planner's launch (impl='prefill');
    outputs poisoned with NaN."""
    B, H, N, _ = q.shape
    dv = v.shape[-1]
    (d,) = flash_metal.explain(q, k, v, causal, None, "prefill").dispatches
    assert "_splitd_" in d.kernel_name, d.kernel_name
    out = torch.full((B, H, N, dv), float("nan"), dtype=q.dtype)
    lse = torch.full((B, H, N), float("nan"))
    tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse}
    counts = library(instrumented).dispatch(
        d.kernel_name, buffers={i: tensors.get(name, q) for name, i in d.buffers.items()},
        bytes={d.params_index: d.params}, function_constants=dict(enumerate(d.function_constants)),
        grid=d.grid, threadgroup=d.threadgroup, threadgroup_memory={d.threadgroup_memory_index: d.threadgroup_memory})
    return out, lse, counts, d


def _fields(c, d):
    r = {f: getattr(c, f) for f in FIELDS}
    for name in ("q", "k", "v", "out", "lse"):
        i = d.buffers[name]
        r["read_" + name] = c.device_bytes_read_by_index[i]
        r["write_" + name] = c.device_bytes_written_by_index[i]
        r["dram_" + name] = c.device_unique_bytes_read_by_index[i]
        r["req_" + name] = c.device_request_bytes_by_index[i]
    return r


def _inputs(b, hq, hkv, nq, nk, dqk, dv, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, dqk, generator=g).to(torch.float16)
    k = torch.randn(b, hkv, nk, dqk, generator=g).to(torch.float16)
    if dv > dqk:
        return q, k, torch.randn(b, hkv, nk, dv, generator=g).to(torch.float16)
    return q, k, k[..., :dv]  # v: a view of the latent cache, as absorbed MLA has it


_CACHE = {}


def prefill_records(s: M.Shape, dv, causal):
    """The kernel's counts at s (Nq = Nk a multiple of 64, Hq = Hkv, d = D_qk) as one Record."""
    assert s.nq == s.nk and s.nq % 64 == 0 and s.hq == s.hkv
    key = ("prefill", s.d, dv, causal)
    if key not in _CACHE:
        base = []
        for n in W.BASE_NS:
            _, _, c, d = run(*_inputs(1, 1, 1, n * 64, n * 64, s.d, dv, n), causal)
            base.append((n, _fields(c, d), d))
        _CACHE[key] = base
    base = _CACHE[key]
    counts = {}
    for f in base[0][1]:
        v = M._quadratic_at([(n, c[f]) for n, c, _ in base], s.nq // 64) * s.b * s.hq
        assert v.denominator == 1, f"scaling rule gave a fractional {f}"
        counts[f] = int(v)
    d = base[0][2]
    return [M.Record(d.kernel_name, (math.ceil(s.nq / 8), s.hq, s.b), d.threadgroup, d.threadgroup_memory, counts,
                     True, ("live", live_values(s.d, dv)))]


def decode_records(b, hq, nk, dqk=576, dv=512):
    """The packed decode (Hkv = 1, Nq = 1, Hq a multiple of 8): one threadgroup's counts, linear in Nk, times
    the plan's b * Hq / 8 threadgroups."""
    key = ("decode", dqk, dv)
    if key not in _CACHE:
        base = []
        for n in DECODE_BASE_NKS:
            _, _, c, d = run(*_inputs(1, 8, 1, 1, n, dqk, dv, n), False)
            assert d.grid == (1, 1, 1) and d.function_constants[13], d  # one packed threadgroup
            base.append((n, _fields(c, d), d))
        _CACHE[key] = base
    (n0, c0, d), (n1, c1, _) = _CACHE[key]
    tgs = b * math.ceil(hq / 8)
    counts = {f: (c0[f] + (c1[f] - c0[f]) * (nk - n0) // (n1 - n0)) * tgs for f in c0}
    return [M.Record(d.kernel_name, (math.ceil(hq / 8), 1, b), d.threadgroup, d.threadgroup_memory, counts, True,
                     ("live", live_values(dqk, dv)))]


def _band(recs, chip, s, causal):
    gpu = G.BY_NAME[chip]
    terms = T.predict(recs, gpu, s, torch.float16, causal)[1]
    return T.predict_band(recs, gpu, s, torch.float16, causal), max(terms, key=terms.get)


def prefill_row(n, dqk, dv, causal, chip):
    """{'fused': band, 'bound', 'unfused', 'composite'} at 1 x 8 x n x (dqk, dv), float16."""
    s = M.Shape(1, 8, 8, n, n, dqk)
    band, bound = _band(prefill_records(s, dv, causal), chip, s, causal)
    args = (1, 8, 8, n, n, dqk, dv, torch.float16, chip)
    return {"fused": band, "bound": bound, "unfused": DW.unfused_seconds(*args),
            "composite": DW.composite_seconds(*args)}


def decode_row(b, hq, nk, chip, dqk=576, dv=512):
    """{'fused': band, 'bound', 'composite', 'unfused', 'wide': the wide decode's band} at b x hq/1, Nq 1."""
    s = M.Shape(b, hq, 1, 1, nk, dqk)
    band, bound = _band(decode_records(b, hq, nk, dqk, dv), chip, s, False)
    args = (b, hq, 1, 1, nk, dqk, dv, torch.float16, chip)
    return {"fused": band, "bound": bound, "composite": DW.composite_seconds(*args),
            "unfused": DW.unfused_seconds(*args), "wide": DW.fused_seconds(*args)[0]}


def ahead(r, over):
    """Whether the fused band's slow end beats `over`'s time (a band for 'wide': its point)."""
    base = r[over][1] if isinstance(r[over], tuple) else r[over]
    return r["fused"][2] < base


def prefill_table():
    return [(dqk, dv, causal, n, chip, prefill_row(n, dqk, dv, causal, chip))
            for dqk, dv in PAIRS for causal in (False, True) for n in PREFILL_NS for chip in CHIPS]


def decode_table():
    return [(b, hq, nk, chip, decode_row(b, hq, nk, chip)) for b, hq in DECODE_SHAPES for nk in DECODE_NKS
            for chip in CHIPS]


# The least packed grid csrc/metal_routing_splitd.cpp routes the MLA decode to
# split-D with (kSplitDMlaDecodeMinThreadgroups).
ROUTED_DECODE_THREADGROUPS = 32


def verdicts(prefill=None, decode=None):
    """The routing's figures: {'causal': (least, most) unfused / split-D and whether every band is ahead,
    'level': the same not causal, 'decode': (least, most) composite / split-D over the routed decode rows
    (B x Hq / 8 >= ROUTED_DECODE_THREADGROUPS, Hq past the wide decode's 16) and whether every band is ahead,
    'decode_wide': (least, most) wide / split-D there, 'small': the unrouted rows' composite / split-D and
    whether any band is behind}."""
    prefill = prefill_table() if prefill is None else prefill
    decode = decode_table() if decode is None else decode
    out = {}
    for name, causal in (("causal", True), ("level", False)):
        rows = [r for _, _, c, _, _, r in prefill if c == causal]
        ratios = [r["unfused"] / r["fused"][1] for r in rows]
        out[name] = (min(ratios), max(ratios), all(ahead(r, "unfused") for r in rows))
    routed = [r for b, hq, _, _, r in decode if hq > 16 and b * hq // 8 >= ROUTED_DECODE_THREADGROUPS]
    small = [r for b, hq, _, _, r in decode if hq > 16 and b * hq // 8 < ROUTED_DECODE_THREADGROUPS]
    ratios = [r["composite"] / r["fused"][1] for r in routed]
    out["decode"] = (min(ratios), max(ratios), all(ahead(r, "composite") for r in routed))
    ratios = [r["wide"][1] / r["fused"][1] for r in routed]
    out["decode_wide"] = (min(ratios), max(ratios), all(ahead(r, "wide") for r in routed))
    ratios = [r["composite"] / r["fused"][1] for r in small]
    out["small"] = (min(ratios), max(ratios), not all(ahead(r, "composite") for r in small))
    return out


def main():
    print("\n## MLA head dims, float16, split-D prefill vs unfused and composite: model, not measurement")
    print("| chip | shape | causal | split-D ms (band) | bound | unfused ms | composite ms | unfused / split-D | "
          "band ahead of unfused |")
    print("|" + "---|" * 9)
    for dqk, dv, causal, n, chip, r in prefill_table():
        lo, pt, hi = r["fused"]
        print(f"| {chip} | 1x8x{n}x({dqk},{dv}) | {causal} | {pt * 1e3:.2f} ({lo * 1e3:.2f}-{hi * 1e3:.2f}) | "
              f"{r['bound']} | {r['unfused'] * 1e3:.2f} | {r['composite'] * 1e3:.2f} | {r['unfused'] / pt:.2f}x | "
              f"{'yes' if ahead(r, 'unfused') else 'no'} |")
    print("\n## Absorbed-MLA decode (576, 512), Hkv 1, Nq 1, float16: packed split-D vs the composite path and the "
          "wide decode: model, not measurement")
    print("| chip | B x Hq | Nk | split-D us (band) | bound | composite us | wide decode us (band) | unfused us | "
          "composite / split-D | wide / split-D | band ahead of composite | of wide |")
    print("|" + "---|" * 12)
    for b, hq, nk, chip, r in decode_table():
        lo, pt, hi = r["fused"]
        wl, wp, wh = r["wide"]
        print(f"| {chip} | {b} x {hq} | {nk} | {pt * 1e6:.1f} ({lo * 1e6:.1f}-{hi * 1e6:.1f}) | {r['bound']} | "
              f"{r['composite'] * 1e6:.1f} | {wp * 1e6:.1f} ({wl * 1e6:.1f}-{wh * 1e6:.1f}) | "
              f"{r['unfused'] * 1e6:.1f} | {r['composite'] / pt:.2f}x | {wp / pt:.2f}x | "
              f"{'yes' if ahead(r, 'composite') else 'no'} | {'yes' if ahead(r, 'wide') else 'no'} |")
    for name, (lo, hi, flag) in verdicts().items():
        print(f"\n{name}: {lo:.2f}x to {hi:.2f}x ({flag})")


if __name__ == "__main__":
    main()
