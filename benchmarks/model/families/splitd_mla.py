"""The split-D forward at MLA's head dims on Metal (issue 20 sections 2 and 3),
priced by the model: the verdicts csrc/metal/families/prefill_splitd.cpp routes on.
Nothing here ran on a GPU: every time is a prediction ("model, not
measurement").

    python -m benchmarks.model splitd-mla

The kernel is shaders/prefill/attention_prefill_splitd.h at (D_qk, D_v) = (576, 512)
and (256, 512): 8 query rows per threadgroup, 8 SIMD-groups each holding
D_qk / 8 features of Q and 64 of O in registers, K/V read from device memory
per part; and the absorbed-MLA decode, the same kernel packed over the query
heads of one latent kv head (fc_pack_gqa: a threadgroup's 8 rows are 8
heads' rows, so K/V are read once per 8 heads).

Counts: the instrumented emulator on the planner's own launch (explain,
impl='prefill'). Prefill: N = 128, 192, 256 for one head, scaled by
core/counts.py's quadratic rule (as families/d512.py). Decode:
one packed threadgroup (8 heads on one kv head, Nq = 1) at Nk = 256 and 512,
linear in Nk (whole 32-key blocks), times the plan's threadgroups. Time:
core/timing.py predict / predict_band (the "_splitd_" serial section;
the packed grid through packed_group), residency by the planner's rule on
live_values and the threadgroup memory.

Split along keys (fc_split_kv, the packed decode below 32 threadgroups): the
planner's own split count per chip (explain(gpu=...)), the split pass priced
as the packed kernel on Nk / splits keys (one split threadgroup's counts from
exact emulator runs at 256 and 512 keys per split, linear, times the grid;
the last, shorter split priced as a whole one), plus the merge pass
(flash_decode_merge_*_d512: exact counts at 2 and 8 splits per row, linear
in splits, times the rows; run in bfloat16, whose bytes are float16's).

Baselines, from families/decode_wide.py:
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
import struct

import torch

import flash_metal

from ..core import counts as M
from ..core import gpus as G
from ..core import timing as T
from ..core.emulator import backends, tests_module
from . import d512 as W
from . import decode_wide as DW

KERNELS = ("flash_attention_prefill_splitd_*",)  # the partial emulator library the counts run on
PAIRS = ((576, 512), (256, 512))
CHIPS = W.CHIPS  # M1 Max, M3 Max, M4 Pro, M5 (10-core)
PREFILL_NS = (1024, 4096)
# (B, Hq): DeepSeek's absorbed MLA on one latent kv head, per GPU shard (16) and whole (128).
DECODE_SHAPES = ((1, 16), (8, 16), (1, 128), (2, 128), (4, 128), (8, 128))
DECODE_NKS = (4096, 32768)
DECODE_BASE_NKS = (256, 512)  # the linear rule's two points (whole 32-key blocks)
LIVE_OVERHEAD = 16  # kLiveOverhead (csrc/metal/plan_detail.h)
FIELDS = ("threadgroups", "threads", "threadgroup_barriers", "simdgroup_mmas", "exp2_calls",
          "threadgroup_bytes_read", "threadgroup_bytes_written")


def live_values(dqk, dv, bk=32, parts=8):
    """The planner's live values per lane (csrc/metal/families/prefill_splitd.cpp splitd_live_registers)."""
    return (dqk + dv) // 4 // parts + bk // 4 + 2 + 4 + LIVE_OVERHEAD + 1


def library(instrumented=True):
    return tests_module("shader_builds").shipped_library(instrumented=instrumented, only=KERNELS)


def run(q, k, v, causal, instrumented=True):
    """(out, lse, counts, plan dispatch) of the split-D kernel on the planner's launch (impl='prefill');
    outputs poisoned with NaN."""
    B, H, N, _ = q.shape
    dv = v.shape[-1]
    ds = flash_metal.explain(q, k, v, causal, None, "prefill").dispatches
    d = ds[0]
    assert "_splitd_" in d.kernel_name, d.kernel_name
    fcs, grid, params = dict(enumerate(d.function_constants)), d.grid, d.params
    if len(ds) > 1:  # the planner split it along keys (fc_split_kv): the one-pass kernel is priced here
        splits = struct.unpack_from("<2i", d.params.numpy().tobytes(), SPLIT_FIELDS_OFFSET)[0]
        fcs[14], grid, params = False, (grid[0] // splits, grid[1], grid[2]), _with_splits(d.params, 1, k.shape[2])
    out = torch.full((B, H, N, dv), float("nan"), dtype=q.dtype)
    lse = torch.full((B, H, N), float("nan"))
    tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse}
    counts = library(instrumented).dispatch(
        d.kernel_name, buffers={i: tensors.get(name, q) for name, i in d.buffers.items()},
        bytes={d.params_index: params}, function_constants=fcs,
        grid=grid, threadgroup=d.threadgroup, threadgroup_memory={d.threadgroup_memory_index: d.threadgroup_memory})
    return out, lse, counts, d._replace(grid=grid) if hasattr(d, "_replace") else d


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
        v = M.quadratic_at([(n, c[f]) for n, c, _ in base], s.nq // 64) * s.b * s.hq
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


# The split rows (issue 20): B 1 / 2 x Hq 16 / 128 on one latent kv head, Nq 1.
SPLIT_SHAPES = ((1, 16), (2, 16), (1, 128), (2, 128))
SPLIT_BASE_KEYS = (256, 512)  # keys per split of the linear rule's two points
MERGE_BASE_SPLITS = (2, 8)
SPLIT_FIELDS_OFFSET = 192  # (kv_splits, split_keys) in the 328-byte AttentionParams (shaders/common/params.h)


def _with_splits(params, splits, keys):
    raw = bytearray(params.numpy().tobytes())
    struct.pack_into("<2i", raw, SPLIT_FIELDS_OFFSET, splits, keys)
    return torch.frombuffer(raw, dtype=torch.uint8)


def run_split(q, k, v, splits, keys, instrumented=True):
    """(partial_o, partial_stats, counts, dispatch) of the split-D kernel split along keys (fc_split_kv) into
    `splits` ranges of `keys` keys, on the packed plan's launch; partials poisoned with NaN."""
    B, H, N, _ = q.shape
    dv = v.shape[-1]
    d = flash_metal.explain(q, k, v, False, None, "prefill").dispatches[0]
    assert "_splitd_" in d.kernel_name and d.function_constants[13], d
    fcs = dict(enumerate(d.function_constants))
    planned = struct.unpack_from("<2i", d.params.numpy().tobytes(), SPLIT_FIELDS_OFFSET)[0] if fcs[14] else 1
    fcs[14] = True
    po = torch.full((B * H * N * splits * dv,), float("nan"))
    ps = torch.full((B * H * N * splits * 2,), float("nan"))
    tensors = {"q": q, "k": k, "v": v, "partial_out": po, "partial_stats": ps}
    grid = (d.grid[0] // planned * splits, d.grid[1], d.grid[2])
    counts = library(instrumented).dispatch(
        d.kernel_name, buffers={i: tensors.get(name, q) for name, i in d.buffers.items()},
        bytes={d.params_index: _with_splits(d.params, splits, keys)}, function_constants=fcs, grid=grid,
        threadgroup=d.threadgroup, threadgroup_memory={d.threadgroup_memory_index: d.threadgroup_memory})
    return po, ps, counts, d


def merge_library():
    return backends.wide_decode_library(True)  # the sanitizing wide build: bfloat16's merge at d512


def run_merge(q, po, ps, splits, dv=512):
    """(out, lse, counts) of flash_decode_merge_bfloat16_d512 over the partials of q's rows (B, H, N)."""
    B, H, N, _ = q.shape
    bf = torch.bfloat16  # a params block with out's (B, H, N, D_v) strides and Hq, Nq
    d = flash_metal.explain(q.to(bf), torch.empty(B, 1, 1, q.shape[-1], dtype=bf), torch.empty(B, 1, 1, dv, dtype=bf),
                            False, None, "prefill").dispatches[0]
    out = torch.full((B, H, N, dv), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((B, H, N), float("nan"))
    params = _with_splits(d.params, splits, 32)
    tensors = {"out": out, "lse": lse, "partial_out": po, "partial_stats": ps}
    counts = merge_library().dispatch(
        "flash_decode_merge_bfloat16_d512", buffers={3: out, 4: lse, 6: po, 7: ps}, bytes={5: params},
        grid=(N, H, B), threadgroup=(32, 1, 1))
    return out, lse, counts


def _merge_fields(c):
    r = {f: getattr(c, f) for f in FIELDS}
    for name, i in (("out", 3), ("lse", 4), ("po", 6), ("ps", 7)):
        r["read_" + name] = c.device_bytes_read_by_index[i]
        r["write_" + name] = c.device_bytes_written_by_index[i]
    return r


def split_plan(b, hq, nk, chip, dqk=576, dv=512):
    """(splits, keys per split) of the planner's packed decode on `chip` (1, keys: one pass)."""
    one = torch.empty(1, 1, 1, dqk, dtype=torch.float16)
    q, k = one.expand(b, hq, 1, dqk), one.expand(b, 1, nk, dqk)
    ds = flash_metal.explain(q, k, k[..., :dv], False, None, "prefill", gpu=G.BY_NAME[chip].key).dispatches
    if len(ds) == 1:
        return 1, nk
    raw = ds[0].params.numpy().tobytes()
    return struct.unpack_from("<2i", raw, SPLIT_FIELDS_OFFSET)


def split_records(b, hq, nk, chip, dqk=576, dv=512):
    """(records of the split pass, its Shape, records of the merge, splits): the planner's split on `chip`."""
    splits, keys = split_plan(b, hq, nk, chip, dqk, dv)
    assert splits > 1, (b, hq, nk, chip)
    key = ("split", dqk, dv)
    if key not in _CACHE:
        base = []
        for n in SPLIT_BASE_KEYS:  # one packed threadgroup's 8 heads, 2 splits of n keys each
            q, k, v = _inputs(1, 8, 1, 1, 2 * n, dqk, dv, n)
            _, _, c, d = run_split(q, k, v, 2, n)
            assert c.threadgroups == 2, c.threadgroups
            base.append((n, {f: x / 2 for f, x in _fields(c, d).items() if not f.endswith(("_out", "_lse"))}, d))
        merges = []
        for s in MERGE_BASE_SPLITS:  # 8 rows' partials: random, l > 0
            g = torch.Generator().manual_seed(s)
            q = torch.empty(1, 8, 1, dqk)
            po = torch.randn(8 * s * dv, generator=g)
            ps = torch.stack([torch.randn(8 * s, generator=g), torch.rand(8 * s, generator=g) + 0.5], 1).flatten()
            merges.append((s, _merge_fields(run_merge(q, po, ps, s, dv)[2])))
        _CACHE[key] = base, merges
    (base, merges) = _CACHE[key]
    (n0, c0, d), (n1, c1, _) = base
    tgs = b * math.ceil(hq / 8) * splits
    counts = {f: round((c0[f] + (c1[f] - c0[f]) * (keys - n0) / (n1 - n0)) * tgs) for f in c0}
    # the partials the split pass writes: 8 rows x (D_v + 2) floats per threadgroup
    counts["write_partials"] = tgs * 8 * (dv + 2) * 4
    s_split = M.Shape(b * splits, hq, 1, 1, keys, dqk)
    split = M.Record(d.kernel_name, (math.ceil(hq / 8) * splits, 1, b), d.threadgroup, d.threadgroup_memory, counts,
                     True, ("live", live_values(dqk, dv)))
    (s0, m0), (s1, m1) = merges
    rows = b * hq
    mcounts = {f: round((m0[f] + (m1[f] - m0[f]) * (splits - s0) / (s1 - s0)) * rows / 8) for f in m0}
    merge = M.Record("flash_decode_merge_float16_d512", (1, hq, b), (32, 1, 1), 0, mcounts, True, None)
    return [split], s_split, [merge], splits


def split_band(b, hq, nk, chip, dqk=576, dv=512):
    """(low, point, high) seconds of the split plan (split pass + merge) on `chip`, float16, and its splits."""
    split, s_split, merge, splits = split_records(b, hq, nk, chip, dqk, dv)
    gpu = G.BY_NAME[chip]
    s = M.Shape(b, hq, 1, 1, nk, dqk)
    corners = [T.predict(split, gpu, s_split, torch.float16, False, k)[0]
               + T.predict(merge, gpu, s, torch.float16, False, k)[0] for k in (T.FAST, T.POINT, T.SLOW)]
    return (min(corners), corners[1], max(corners)), splits


def split_row(b, hq, nk, chip):
    """decode_row's figures plus 'split': the split plan's band and 'splits' (the planner's count on chip)."""
    r = decode_row(b, hq, nk, chip)
    splits, _ = split_plan(b, hq, nk, chip)
    r["splits"] = splits
    r["split"] = split_band(b, hq, nk, chip)[0] if splits > 1 else None
    return r


def split_table():
    return [(b, hq, nk, chip, split_row(b, hq, nk, chip)) for b, hq in SPLIT_SHAPES for nk in DECODE_NKS
            for chip in CHIPS]


def split_ahead(r, over):
    """Whether the split plan's slow end beats `over` ('composite': its time; 'fused', the unsplit packed
    kernel, and 'wide': their fast ends)."""
    base = r[over][0] if isinstance(r[over], tuple) else r[over]
    return r["split"] is not None and r["split"][2] < base


def split_verdicts(table=None):
    """The split's figures: {'routed': (least, most) composite / split, (least, most) unsplit / split over the
    rows auto splits (Hq past the wide decode's 16, B x Hq / 8 < 32, the planner's count > 1) and whether every
    band is ahead of both; 'one_pass': (least, most) composite / unsplit over the rows where the planner's rule
    leaves one split (M5) and whether every band is ahead; 'wide': wide / split at Hq 16 and whether every band is
    ahead (not routed: the wide decode keeps those)}."""
    table = split_table() if table is None else table
    small = [r for b, hq, _, _, r in table if hq > 16 and b * hq // 8 < ROUTED_DECODE_THREADGROUPS]
    routed = [r for r in small if r["split"] is not None]
    one = [r for r in small if r["split"] is None]
    comp = [r["composite"] / r["split"][1] for r in routed]
    uns = [r["fused"][1] / r["split"][1] for r in routed]
    out = {"routed": (min(comp), max(comp), min(uns), max(uns),
                      all(split_ahead(r, "composite") and split_ahead(r, "fused") for r in routed))}
    ratios = [r["composite"] / r["fused"][1] for r in one]
    out["one_pass"] = (min(ratios), max(ratios), all(ahead(r, "composite") for r in one)) if one else None
    wide = [r for b, hq, _, _, r in table if hq == 16 and r["split"] is not None]
    ratios = [r["wide"][1] / r["split"][1] for r in wide]
    out["wide"] = (min(ratios), max(ratios), all(split_ahead(r, "wide") for r in wide)) if wide else None
    return out


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


# The least packed grid csrc/metal/families/prefill_splitd.cpp routes the MLA decode to
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


def report():
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
    print("\n## Absorbed-MLA decode (576, 512), Hkv 1, Nq 1, float16: split along keys (fc_split_kv + merge) vs "
          "the unsplit packed kernel, the composite path and the wide decode: model, not measurement")
    print("| chip | B x Hq | Nk | splits | split us (band) | unsplit us (band) | composite us | wide us | "
          "unsplit / split | composite / split | wide / split | split band ahead of unsplit, composite |")
    print("|" + "---|" * 12)
    table = split_table()
    for b, hq, nk, chip, r in table:
        if r["split"] is None:
            print(f"| {chip} | {b} x {hq} | {nk} | 1 | - | {r['fused'][1] * 1e6:.1f} | {r['composite'] * 1e6:.1f} | "
                  f"{r['wide'][1] * 1e6:.1f} | - | - | - | - |")
            continue
        lo, pt, hi = r["split"]
        print(f"| {chip} | {b} x {hq} | {nk} | {r['splits']} | {pt * 1e6:.1f} ({lo * 1e6:.1f}-{hi * 1e6:.1f}) | "
              f"{r['fused'][1] * 1e6:.1f} ({r['fused'][0] * 1e6:.1f}-{r['fused'][2] * 1e6:.1f}) | "
              f"{r['composite'] * 1e6:.1f} | {r['wide'][1] * 1e6:.1f} | {r['fused'][1] / pt:.2f}x | "
              f"{r['composite'] / pt:.2f}x | {r['wide'][1] / pt:.2f}x | "
              f"{'yes' if split_ahead(r, 'fused') else 'no'}, {'yes' if split_ahead(r, 'composite') else 'no'} |")
    v = split_verdicts(table)
    print("\nrouted (B 1 x 128): composite / split {:.2f}-{:.2f}x, unsplit / split {:.2f}-{:.2f}x, "
          "every band ahead of both: {}".format(*v["routed"]))
    if v["one_pass"]:
        print("one split allowed (M5): composite / unsplit {:.2f}-{:.2f}x, every band ahead: {}".format(*v["one_pass"]))
    if v["wide"]:
        print("Hq 16 (not routed: the wide decode keeps it): wide / split {:.2f}-{:.2f}x, every band ahead: "
              "{}".format(*v["wide"]))
