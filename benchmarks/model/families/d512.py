"""Head dim 512 on Metal (issue 20, section 3): is a fused plan worth routing?
Nothing here ran on a GPU: every figure is a prediction.

    python -m benchmarks.model d512      # this table, then splitd's and splitd-mla's

The issue's rule: a naive fused D = 512 is reported 2-3x slower than unfused
(uzu #412), so the performance model must put a fused plan ahead of the
unfused one before anything routes to it. This module prices the one fused
plan the existing kernels can express: the FlashAttention-2 prefill template
(shaders/prefill/attention_prefill.h) at D = 512 with feature parts (split-K over
the features, issue 19), instantiated for this purpose only in
tests/prefill_d512_probe.metal. Its 512-wide K/V tile leaves room for 8 keys
and 8 query rows within 32 KiB (float16; float32 does not fit at all), so
every 8 x 8 block pays a DRAM latency, four barriers and an 8-part
reduction: the model finds it latency-bound and 2-3x slower than unfused
when not causal. That is why the planner refuses head dims above 256 on
Metal (csrc/metal/routing.cpp) rather than routing them to this plan.
The `d512` command also prints the split-D kernel's table (families/splitd.py:
about 2x ahead of unfused when causal, level when not) and MLA's
(families/splitd_mla.py).

How the counts are made: the probe kernel runs in the instrumented emulator
on 512-strided views whose launch plan is the D = 256 bucket's (the
planner has no 512 bucket), with the params' head dims and out's strides
patched to 512 (offsets parsed from shaders/common/params.h), at N = 128, 192,
256 for one head; core/counts.py's quadratic rule scales them to the shape.
The unfused side is core/unfused.py unfused_seconds(forward=True):
S = Q K^T written, the softmax read and written, O = P V, each kernel at the
same MMA rate and streaming ceiling as ours, generous to unfused (no
occupancy or cache effects).
"""
import math
import os
import re
import struct

import torch

import flash_metal
from flash_metal import reference

from ..core import counts as M
from ..core import gpus as G
from ..core import timing as T
from ..core.emulator import SHADERS, TESTS, tests_module
from ..core.unfused import unfused_seconds

PROBE = os.path.join(TESTS, "prefill_d512_probe.metal")
PARAMS_H = os.path.join(SHADERS, "common", "params.h")
D = 512
# (BQ, BK, WM) of the probe's instantiations; the first is within the register budget.
PLANS = ((8, 8, 8), (16, 8, 8))
BASE_NS = (2, 3, 4)  # N = n * 64 for the quadratic rule, as counts.BASE_NS
CHIPS = ("M1 Max", "M3 Max", "M4 Pro", "M5 (10-core)")
_SIZES = {"int64_t": 8, "int32_t": 4, "float": 4, "uint32_t": 4}


def params_offsets(path=PARAMS_H):
    """{field: (offset, C type)} of AttentionParams, from its declaration (natural alignment)."""
    text = open(path).read()
    body = text[text.index("struct AttentionParams {"):]
    body = body[:body.index("};")]
    offsets, at = {}, 0
    for ctype, name in re.findall(r"^\s*(int64_t|int32_t|uint32_t|float)\s+(\w+);", body, re.M):
        size = _SIZES[ctype]
        at = (at + size - 1) // size * size
        offsets[name] = (at, ctype)
        at += size
    return offsets


def _patch(params, offsets, **fields):
    out = bytearray(params)
    for name, value in fields.items():
        if name not in offsets:
            continue  # a field this layout does not have (head_dim_v before issue 20's MLA work)
        at, ctype = offsets[name]
        struct.pack_into("q" if ctype == "int64_t" else "i", out, at, value)
    return bytes(out)


def probe_library(instrumented=True):
    return tests_module("metal_emulator").compile_library([PROBE], instrumented=instrumented)


def _plan_at_d512(q, k, v, causal):
    """(the D = 256 bucket's prefill plan of 512-strided views, its params patched to D = 512)."""
    B, H, N, d = q.shape
    assert d == D
    narrow = [t[..., :256] for t in (q, k, v)]  # 512-strided views: the D = 256 plan's strides are 512's
    (plan,) = flash_metal.explain(*narrow, causal, 1 / math.sqrt(D), "prefill").dispatches
    offsets = params_offsets()
    raw = plan.params.numpy().tobytes() if isinstance(plan.params, torch.Tensor) else bytes(plan.params)
    assert struct.unpack_from("i", raw, offsets["head_dim"][0])[0] == 256, "params.h and the plan disagree"
    params = _patch(raw, offsets, head_dim=D, head_dim_v=D, o_batch_stride=H * N * D,
                    o_head_stride=N * D, o_row_stride=D)
    return plan, torch.frombuffer(bytearray(params), dtype=torch.uint8)


def run_probe(q, k, v, causal, bq, bk, wm, instrumented=True):
    """(out, lse, counts, dispatch) of the probe at D = 512: q, k, v (B, H, N, 512) float16."""
    B, H, N, d = q.shape
    assert d == D and q.dtype == torch.float16
    plan, params = _plan_at_d512(q, k, v, causal)
    parts = 8 * wm // bq
    row = (D + 8) * 2  # a padded float16 tile row (kPrefillRowPadBytes = 16)
    tg_bytes = (bq + bk) * row + (bq // 8 * parts * (bk // 8) * 256 if parts > 1 else 0)
    out = torch.full((B, H, N, D), float("nan"), dtype=q.dtype)
    lse = torch.full((B, H, N), float("nan"))
    tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse}
    counts = probe_library(instrumented).dispatch(
        f"flash_attention_prefill_float16_d512_bq{bq}_bk{bk}_wm{wm}",
        buffers={i: tensors.get(name, q) for name, i in plan.buffers.items()},
        bytes={plan.params_index: params}, function_constants=dict(enumerate(plan.function_constants)),
        grid=(math.ceil(N / bq), H, B), threadgroup=(32 * wm, 1, 1),
        threadgroup_memory={plan.threadgroup_memory_index: tg_bytes})
    return out, lse, counts, (plan, tg_bytes)


def _counts(n, causal, plan_blocks, run):
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, 1, n, D, generator=g).to(torch.float16) for _ in range(3))
    _, _, c, (plan, tg_bytes) = run(q, k, v, causal, *plan_blocks)
    r = {f: getattr(c, f) for f in ("threadgroups", "threads", "threadgroup_barriers", "simdgroup_mmas",
                                    "exp2_calls", "threadgroup_bytes_read", "threadgroup_bytes_written")}
    for name in ("q", "k", "v", "out", "lse"):
        i = plan.buffers[name]
        r["read_" + name] = c.device_bytes_read_by_index[i]
        r["write_" + name] = c.device_bytes_written_by_index[i]
        r["dram_" + name] = c.device_unique_bytes_read_by_index[i]
        r["req_" + name] = c.device_request_bytes_by_index[i]
    return r, tg_bytes


_CACHE = {}


def records(s: M.Shape, causal, plan_blocks, run=None, family="prefill", source=None):
    """The probe's counts at shape s (Nq = Nk a multiple of 64, Hq = Hkv), as one counts.Record.
    run / family / source: another probe's launcher, kernel family and Record.source (families/splitd.py)."""
    if s.nq != s.nk or s.nq % 64 or s.hq != s.hkv or s.d != D:
        raise ValueError(f"the scaling rule needs Nq = Nk (a multiple of 64), Hq = Hkv and D = {D}; got {s}")
    key = (family, causal, plan_blocks)
    if key not in _CACHE:
        _CACHE[key] = [(n, _counts(n * 64, causal, plan_blocks, run or run_probe)) for n in BASE_NS]
    base = _CACHE[key]
    counts = {}
    for f in base[0][1][0]:
        v = _quadratic([(n, c[0][f]) for n, c in base], s.nq // 64) * s.b * s.hq
        assert v.denominator == 1, f"scaling rule gave a fractional {f}"
        counts[f] = int(v)
    bq, bk, wm = plan_blocks
    name = f"flash_attention_{family}_float16_d512_bq{bq}_bk{bk}_wm{wm}"
    return [M.Record(name, (math.ceil(s.nq / bq), s.hq, s.b), (32 * wm, 1, 1), base[0][1][1], counts, True,
                     source)]


def _quadratic(points, x):
    return M.quadratic_at(points, x)


def compare(s: M.Shape, causal, chip, plan_blocks=PLANS[0]):
    """{'fused': (low, point, high) s, 'unfused': s, 'bound': the fused plan's largest term}."""
    gpu = G.BY_NAME[chip]
    recs = records(s, causal, plan_blocks)
    terms = T.predict(recs, gpu, s, torch.float16, causal)[1]
    return {"fused": T.predict_band(recs, gpu, s, torch.float16, causal),
            "unfused": unfused_seconds(s, torch.float16, gpu, forward=True),
            "bound": max(terms, key=terms.get)}


def check_probe(n=40, causal=True):
    """Max |error| of the probe against the float64 oracle (out, lse): it computes attention at D = 512."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, n, D, generator=g).to(torch.float16) for _ in range(3))
    out, lse, _, _ = run_probe(q, k, v, causal, *PLANS[0])
    ref_out, ref_lse = reference.attention_reference(q, k, v, causal=causal, scale=1 / math.sqrt(D))
    return (out.double() - ref_out).abs().max().item(), (lse.double() - ref_lse).abs().max().item()


def report():
    print("## Head dim 512, float16, fused FA2 template (feature parts) vs unfused: model, not measurement")
    print("| chip | shape | causal | unfused ms | fused bq8 ms (band) | unfused / fused | bound | "
          "fused bq16 ms (over the register budget) |")
    print("|---|---|---|---|---|---|---|---|")
    for causal in (False, True):
        for n in (1024, 4096):
            s = M.Shape(1, 8, 8, n, n, D)
            for chip in CHIPS:
                a = compare(s, causal, chip)
                b = compare(s, causal, chip, PLANS[1])
                lo, pt, hi = a["fused"]
                print(f"| {chip} | 1x8x{n}x512 | {causal} | {a['unfused'] * 1e3:.2f} | {pt * 1e3:.2f} "
                      f"({lo * 1e3:.2f}-{hi * 1e3:.2f}) | {a['unfused'] / pt:.2f}x | {a['bound']} | "
                      f"{b['fused'][1] * 1e3:.2f} |")
