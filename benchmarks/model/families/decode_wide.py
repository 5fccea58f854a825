"""Decode (Nq <= 8) at head dims above 256 on Metal (issue 20 sections 2/3):
the fused decode kernels in the decode-only buckets 512 and 576 against the
composite path they replace. Nothing here ran on a GPU: every figure is a
prediction.

    python -m benchmarks.model decode-wide

The issue's rule: a fused plan above 256 is routed only where the model puts
it ahead of unfused. Prefill at 512 lost (families/d512.py:
latency-bound 8 x 8 blocks). Decode is memory-bound: the fused decode reads
each K/V row once per (batch, kv head[, row chunk]) for the whole GQA group,
while the unfused plan writes and re-reads the scores and pays a dispatch
per step.

Fused side: Records of the planner's own plan (explain at the shape and
chip: one pass or split, grid, threadgroup, residency), with counts from
closed forms of the kernels' traffic (fused_counts) that
tests/model/test_metal_model_decode_wide.py holds equal to the instrumented
emulator's at small shapes; priced by core/timing.py (memory, Little's
law at the planner's residency, dispatch overhead). The wide buckets hold
103-119 live values per lane (csrc/metal/plan_detail.h), past the 72-value
budget, so the planner's residency is lower and Little's law term larger:
priced as such.

Unfused side, two prices:
  * unfused: the plan families/d512.py prices (S = Q K^T, softmax, O = P V,
    core/unfused.py unfused_seconds' kernels), K and V read once per
    kv head (the composite groups a GQA group's rows in one matmul), at the
    full MMA rate and streaming ceiling: generous to it;
  * composite: the ATen ops csrc/composite.cpp runs (K and V converted to
    float32 and re-read, the scores written and re-read by scale, max,
    subtract, exp, sum and normalize, out and lse copied), each a dispatch.
The verdict (the test's gate; the table below, python -m ...): up to 16
query rows per kv head (gqa_ratio * Nq) the fused decode's slow end beats
the composite path at every context, chip and dtype, by 2.4x to 6x at the
point; at 128 rows (MLA's 128 heads, or 16 heads x 8 rows) each row's
SIMD-group pulls every K/V row through L1 and the composite path is ahead
(0.3-1.1x): the planner routes the fused decode up to 16 rows only
(csrc/metal/plan.h kWideDecodeMaxRows). Against the generous unfused
plan (which nothing here runs: it reads 16-bit K/V straight into its
matmuls) the fused decode is at parity at 2 rows per kv head (memory-bound,
1.0-1.1x) and behind at 16 (0.5-0.8x, on-core data): a decode kernel that
shares K/V fragments across rows (simdgroup matrices) is what would win
there, and MLA's 128 heads need it.
"""
import torch

import flash_metal

from ..core import counts as M
from ..core import gpus as G
from ..core import timing as T
from ..core.unfused import kernels_seconds

CHIPS = ("M1", "M1 Max", "M2", "M3 Max", "M4", "M4 Pro", "M5 (10-core)")
DTYPES = (torch.float16, torch.bfloat16)
# (label, B, Hq, Hkv, D_qk, D_v): absorbed MLA (DeepSeek-V2/V3: one latent
# head for all query heads, 16 to 128 of them) and Gemma-like global layers.
MODELS = (("MLA h16", 1, 16, 1, 576, 512), ("MLA h128", 1, 128, 1, 576, 512), ("MLA h128 B8", 8, 128, 1, 576, 512),
          ("Gemma-like", 1, 8, 4, 512, 512), ("Gemma-like B8", 8, 8, 4, 512, 512))
CONTEXTS = (1024, 8192, 32768)
QUERY_ROWS = (1, 8)
# Extra small ATen dispatches of the composite forward per chunk beyond the
# priced ones (where/isneginf/zeros_like for the shift, the reciprocal and
# its where, log and add for lse): each costs a dispatch's overhead.
COMPOSITE_SMALL_DISPATCHES = 6


def _views(b, hq, hkv, nq, nk, dqk, dv, dtype):
    one = torch.empty(1, 1, 1, max(dqk, dv), dtype=dtype)
    return (one[..., :dqk].expand(b, hq, nq, dqk), one[..., :dqk].expand(b, hkv, nk, dqk),
            one[..., :dv].expand(b, hkv, nk, dv))


# Query rows per kv head impl='auto' sends to the wide decode (csrc/metal/plan.h kWideDecodeMaxRows).
ROUTED_ROWS = 16


def plan(b, hq, hkv, nq, nk, dqk, dv, dtype, chip="base"):
    """The planner's fused plan: impl='auto' where it routes the wide decode; past ROUTED_ROWS rows per kv
    head (the composite path's) the plan a forced impl='decode' runs (one pass: row chunks fill the grid)."""
    impl = "auto" if hq // hkv * nq <= ROUTED_ROWS else "decode"
    return flash_metal.explain(*_views(b, hq, hkv, nq, nk, dqk, dv, dtype), False, None, impl, chip)


def fused_counts(d, b, hq, hkv, nq, nk, dqk, dv, elem):
    """Closed-form counts of one decode dispatch `d` (a plan's): device bytes by tensor and threadgroups.

    The kernel (shaders/decode/attention_decode.h): each threadgroup (kv head, row chunk[, split]) walks its keys;
    each of its RGL row groups loads every K and V row of its key group (read_), counted once per threadgroup
    as bytes new to it (dram_: the row groups' loads of one line share the core's L1, the model's
    assumption); the lanes' loads are distinct addresses (req_ = read_). q is loaded once per key group.
    """
    grid, tg = d.grid, d.threadgroup
    tgs = grid[0] * grid[1] * grid[2]
    kg, rgl = tg[1], tg[2]
    out = {"threadgroups": tgs, "threads": tgs * tg[0] * tg[1] * tg[2], "exp2_calls": 0,
           "threadgroup_barriers": 0, "simdgroup_mmas": 0, "threadgroup_bytes_read": 0, "threadgroup_bytes_written": 0}
    rows = b * hq * nq
    if d.kernel_name.startswith("flash_decode_merge_"):
        return out  # filled by records() (it needs the split count)
    chunks = grid[0] // hkv
    k_once = chunks * b * hkv * nk * dqk * elem
    v_once = chunks * b * hkv * nk * dv * elem
    out.update(dram_k=k_once, dram_v=v_once, read_k=k_once * rgl, read_v=v_once * rgl,
               req_k=k_once * rgl, req_v=v_once * rgl)
    out.update(read_q=rows * dqk * elem * kg, req_q=rows * dqk * elem * kg, dram_q=rows * dqk * elem)
    # key-group merge through threadgroup memory: each SIMD-group writes its slice and state, once per round
    merge = (tgs * tg[1] * tg[2] * (dv + 2) * 4) if kg > 1 else 0
    out.update(threadgroup_bytes_read=merge, threadgroup_bytes_written=merge)
    return out


def records(b, hq, hkv, nq, nk, dqk, dv, dtype, chip):
    """The planner's plan on `chip` as counts.Record records with fused_counts, and the plan."""
    elem = torch.empty((), dtype=dtype).element_size()
    p = plan(b, hq, hkv, nq, nk, dqk, dv, dtype, G.BY_NAME[chip].key)
    rows = b * hq * nq
    splits = p.dispatches[0].grid[2]
    recs = []
    for d in p.dispatches:
        c = fused_counts(d, b, hq, hkv, nq, nk, dqk, dv, elem)
        if d.kernel_name.startswith("flash_decode_merge_"):
            part = rows * splits * (dv + 2) * 4
            c.update(read_partial_out=part, req_partial_out=part, dram_partial_out=part,
                     write_out=rows * dv * elem, write_lse=rows * 4, exp2_calls=2 * rows * splits)
        elif splits > 1:
            c.update(write_partial_out=rows * splits * dv * 4, write_partial_stats=rows * splits * 2 * 4)
        else:
            c.update(write_out=rows * dv * elem, write_lse=rows * 4)
        recs.append(M.Record(d.kernel_name, d.grid, d.threadgroup, d.threadgroup_memory, c, True, None))
    return recs, p


def fused_seconds(b, hq, hkv, nq, nk, dqk, dv, dtype, chip):
    """(low, point, high) seconds and the point's largest term."""
    s = M.Shape(b, hq, hkv, nq, nk, dqk)
    recs, p = records(b, hq, hkv, nq, nk, dqk, dv, dtype, chip)
    gpu = G.BY_NAME[chip]
    # The planner's residency for this very plan (timing.py re-plans from the Shape, which has one
    # head dim: D_v = 576 is no valid problem).
    saved = T.planner_residency
    T.planner_residency = lambda r, i, *_: (p.dispatches[i].threadgroups_per_core, p.dispatches[i].occupancy_limit)
    try:
        terms = T.predict(recs, gpu, s, dtype, False)[1]
        band = T.predict_band(recs, gpu, s, dtype, False)
    finally:
        T.planner_residency = saved
    return band, max(terms, key=terms.get)


def unfused_seconds(b, hq, hkv, nq, nk, dqk, dv, dtype, chip):
    """The generous unfused plan: 3 kernels, K and V read once per kv head in the input dtype."""
    elem = torch.empty((), dtype=dtype).element_size()
    scores = b * hq * nq * nk
    kernels = [
        (2 * scores * dqk, (scores + b * hkv * nk * dqk + b * hq * nq * dqk) * elem),  # S = Q K^T
        (0, 2 * scores * elem),  # P = softmax(S * scale)
        (2 * scores * dv, (scores + b * hkv * nk * dv + b * hq * nq * dv) * elem),  # O = P V
    ]
    return kernels_seconds(kernels, G.BY_NAME[chip])


def composite_seconds(b, hq, hkv, nq, nk, dqk, dv, dtype, chip):
    """The composite forward as csrc/composite.cpp runs it (one chunk: decode's scores fit)."""
    elem = torch.empty((), dtype=dtype).element_size()
    S = b * hq * nq * nk * 4  # float32 scores, bytes
    kf, vf, qf = b * hkv * nk * dqk, b * hkv * nk * dv, b * hq * nq * dqk
    o = b * hq * nq * dv
    kernels = [
        (0, kf * (elem + 4)), (0, vf * (elem + 4)), (0, qf * (elem + 4)),  # .to(float32)
        (2 * b * hq * nq * nk * dqk, qf * 4 + kf * 4 + S),  # matmul S = Qg Kf^T
        (0, 2 * S), (0, S),  # mul_(scale), amax
        (0, 2 * S), (0, 2 * S), (0, S), (0, 2 * S),  # s - shift, exp, sum, mul_(1 / sum)
        (2 * b * hq * nq * nk * dv, S + vf * 4 + o * 4),  # matmul O = P Vf
        (0, o * (4 + elem)),  # out.copy_
    ] + [(0, 0)] * COMPOSITE_SMALL_DISPATCHES
    return kernels_seconds(kernels, G.BY_NAME[chip])


def table():
    """[(model label, B, Hq, Hkv, D_qk, D_v, Nq, Nk, dtype, chip, fused band, bound, unfused, composite)]."""
    rows = []
    for label, b, hq, hkv, dqk, dv in MODELS:
        for nq in QUERY_ROWS:
            for nk in CONTEXTS:
                for dtype in DTYPES:
                    for chip in CHIPS:
                        band, bound = fused_seconds(b, hq, hkv, nq, nk, dqk, dv, dtype, chip)
                        rows.append((label, b, hq, hkv, dqk, dv, nq, nk, dtype, chip, band, bound,
                                     unfused_seconds(b, hq, hkv, nq, nk, dqk, dv, dtype, chip),
                                     composite_seconds(b, hq, hkv, nq, nk, dqk, dv, dtype, chip)))
    return rows


def speedups(rows=None, over="unfused"):
    """(least, most) of (unfused or composite) / fused point over the table."""
    rows = table() if rows is None else rows
    col = 12 if over == "unfused" else 13
    ratios = [r[col] / r[10][1] for r in rows]
    return min(ratios), max(ratios)


def report():
    rows = table()
    print("## Decode above 256 on Metal: fused decode vs unfused and the composite path (model, not measurement)")
    print("| model | B x Hq/Hkv | D_qk/D_v | Nq | Nk | dtype | chip | fused us (band) | bound | unfused us | "
          "composite us | unfused / fused |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (label, b, hq, hkv, dqk, dv, nq, nk, dtype, chip, (lo, pt, hi), bound, un, comp) in rows:
        print(f"| {label} | {b} x {hq}/{hkv} | {dqk}/{dv} | {nq} | {nk} | {str(dtype)[6:]} | {chip} | "
              f"{pt * 1e6:.1f} ({lo * 1e6:.1f}-{hi * 1e6:.1f}) | {bound} | {un * 1e6:.1f} | {comp * 1e6:.1f} | "
              f"{un / pt:.2f}x |")
    for over in ("unfused", "composite"):
        lo, hi = speedups(rows, over)
        print(f"\n{over} / fused: {lo:.2f}x to {hi:.2f}x")
