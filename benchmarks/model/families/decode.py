"""The decode model (issue 43): what one token's attention costs a decode
DESIGN on a named Apple GPU, priced on the design's own launch. Nothing here
ran on a GPU: every time is a prediction.

    python -m benchmarks.model decode            # MLX #4076 beside the three designs
    python -m benchmarks.model decode --grid     # the decode grid, before / after issue 43, per chip

A design is its launch and its memory behaviour (DecodeDesign): threadgroups
of SIMD-groups, resident threadgroups per core, the K/V rows one SIMD-group
keeps in flight, the SIMD-groups that read the same rows (counted ONCE in
flight: a key group's row groups in ours, a GQA group's SIMD-groups in MLX's),
DRAM bytes, bytes re-requested from the core's L1 (siblings' loads of lines
already there), bytes re-read through the GPU's shared cache (other
threadgroups' loads of a kv head's rows), and each SIMD-group's fixed latency.

    seconds = dispatches x overhead + waves x fixed + max(stream, little, L1, link)

- stream: DRAM bytes over the decode's streaming fraction of nominal bandwidth, DECODE_STREAM_FRACTION:
  CALIBRATED on one point, MLX #4076's GQA 1 (core/anchors.py DECODE_ANCHORS, role "calibration":
  281 GB/s, 0.92 of nominal, above the prefill model's measured ceiling, 0.79-0.87) and VALIDATED on its
  GQA 4 and GQA 8 points (role "validation": they set nothing); band: the prefill model's point ceiling
  (0.83) to the calibrated fraction;
- little: Little's law, K/V bytes over (distinct bytes in flight per core x cores / DRAM latency);
- L1: every K/V byte requested (unique and re-requested by sibling SIMD-groups) over the core's L1 rate,
  64 B per core-cycle (metal-benchmarks' on-core data figure; band 32-64, an estimate: no decode point binds
  on it, see below);
- link: re-reads served by the shared cache over 32 B per core-cycle (metal-benchmarks' on-GPU figure);
- waves x fixed: a wave's SIMD-groups all pay their fixed latency (q load, the first K and V rows'
  exposed DRAM latency, the key-group merge's barriers) before and after their streaming; a second wave
  pays it again.

Why the calibrated figure is the streaming fraction, not the L1 rate (issue 43 asked for the latter): at
GQA 8, MLX's partials (128 blocks x 32 heads x 130 floats, written and read: 4.2 MB beside 16.8 MB of K/V),
its two dispatches and its waves' fixed latency already take 98 us at the model's point ceiling, longer than
the 88 us measured, so no L1 cost can be fitted there; the GQA-1 point fixes the fraction, and the GQA-4 and
GQA-8 points then test the model, L1 term included (it comes within 10 % of binding at GQA 8).

Designs: ours (from the planner's own plan on the chip: flash_metal.explain(gpu=key); the emulator's
counts check it, tests/model/test_metal_model_decode.py), ours before issue 43 (the same kernel's launch under the
old split rule, 2 rows in flight), MLX's sdpa_vector_2pass (hand count from its source:
scaled_dot_product_attention.cpp's block table and sdpa_vector.h) and llama.cpp's flash_attn_ext_vec (hand
count from ggml-metal: 32 workgroups per query head, 32-key phases; its SIMD-groups per threadgroup taken as 1).
"""
import math
from typing import NamedTuple

import torch

import flash_metal

from ..core import anchors as A
from ..core import gpus as G
from ..core import timing as T
from ..core.counts import Shape


class DecodeDesign(NamedTuple):
    name: str
    dispatches: int
    threadgroups: int
    sgs_per_tg: int
    resident_tgs: int      # resident threadgroups per core
    rows_in_flight: float  # K/V rows one SIMD-group has loads outstanding for together
    readers: int           # SIMD-groups of a threadgroup reading the same rows: counted once in flight
    kv_bytes: float        # K and V bytes from DRAM
    other_dram: float      # q, out, partials written and read back
    l1_rerequest: float    # K/V bytes requested again from the core's L1 by sibling SIMD-groups
    link_bytes: float      # K/V bytes re-read by other threadgroups through the GPU's shared cache
    fixed_cycles: float    # per SIMD-group: q load, exposed first-row latencies, merge barriers
    row_bytes: int         # one K (or V) row, bytes
    why: str = ""


# Constants derived from anchors, and how (the anchors' test reads DERIVATIONS: a validation anchor's value
# may not appear in it): calibrate() fills it from the calibration anchor alone.
DERIVATIONS = {}
# The L1 rate, bytes per core-cycle (low, point, high): metal-benchmarks' on-core 64 B, half of it at the
# slow end (an estimate; Apple publishes no L1 figure).
L1_BYTES_PER_CYCLE = (32.0, 64.0, 64.0)


def _arch(gpu):
    """MLX's device class letter (the last of its architecture name): base 'g', Pro 's', Max 'c', Ultra 'd'."""
    n = gpu.name
    return "d" if "Ultra" in n else "c" if "Max" in n else "s" if "Pro" in n else "g"


def _cores_hz(gpu, k):
    return gpu.cores, T._clock(gpu, k["clock"])


def stream_fraction(k):
    """The decode's streaming fraction of nominal bandwidth at the knobs: the calibrated point (fast end),
    the prefill model's point ceiling (slow end)."""
    cal = DERIVATIONS["DECODE_STREAM_FRACTION"]["value"] if "DECODE_STREAM_FRACTION" in DERIVATIONS else calibrate()
    return {0: G.STREAM_CEILING[1], 1: cal, 2: cal}[k["stream"]]


def predict(design: DecodeDesign, gpu, k=T.POINT, fraction=None):
    """(seconds, {term: seconds}) of one call of `design` on `gpu` at the knobs `k`."""
    cores, hz = _cores_hz(gpu, k)
    frac = fraction if fraction is not None else stream_fraction(k)
    l1 = L1_BYTES_PER_CYCLE[0 if k["stream"] == 0 else 1]
    lat = G.DRAM_LATENCY_NS[k["dram"]] * 1e-9
    slots = cores * design.resident_tgs
    waves = math.ceil(design.threadgroups / slots)
    active = min(cores, design.threadgroups)
    per_core_tgs = min(design.resident_tgs, design.threadgroups / active)
    readers = design.readers if k["lockstep"] else 1  # the fast end: siblings drift, each its own lines
    in_flight = per_core_tgs * design.sgs_per_tg / readers * design.rows_in_flight * design.row_bytes
    terms = {
        "stream": (design.kv_bytes + design.other_dram) / (frac * gpu.bandwidth_gbs * 1e9),
        "little": design.kv_bytes / (active * in_flight / lat),
        "L1": (design.kv_bytes + design.l1_rerequest) / (active * l1 * hz),
        "link": (design.kv_bytes + design.link_bytes) / (active * T.ON_GPU_BYTES_PER_CYCLE * hz),
    }
    fixed = waves * design.fixed_cycles / hz
    over = design.dispatches * G.DISPATCH_OVERHEAD_S[k["overhead"]]
    return over + fixed + max(terms.values()), dict(terms, fixed=fixed, overhead=over, waves=waves)


def predict_band(design, gpu):
    """(low, point, high) seconds over the band of every unmeasured input together (T.FAST / T.SLOW)."""
    t = [predict(design, gpu, kk)[0] for kk in (T.FAST, T.POINT, T.SLOW)]
    return min(t), t[1], max(t)


# ---------------------------------------------------------------- designs

def _fixed_cycles(gpu, k, barriers):
    """q's load, the first K row's and the first V row's DRAM latency, exposed once per SIMD-group, and the
    merge's barriers (BARRIER_CYCLES each)."""
    return 3 * G.DRAM_LATENCY_NS[k["dram"]] * 1e-9 * T._clock(gpu, k["clock"]) + barriers * T.BARRIER_CYCLES


def _plan(s, dtype, key):
    one = torch.empty(1, 1, 1, s.d, dtype=dtype)
    return flash_metal.explain(one.expand(s.b, s.hq, s.nq, s.d), one.expand(s.b, s.hkv, s.nk, s.d),
                               one.expand(s.b, s.hkv, s.nk, s.d), False, None, "auto", key)


def _split_fields(dispatch):
    import struct
    f = struct.unpack("<19q8i2f2i7q4q2i2f2i2i2i", dispatch.params.numpy().tobytes())
    return f[29], f[30]


def ours(s, gpu, dtype=torch.float16, k=T.POINT):
    """Our decode on the chip's own plan (planned under gpu.key: M5 Pro / Max as the M4 Pro / Max)."""
    elem = torch.empty((), dtype=dtype).element_size()
    plan = _plan(s, dtype, gpu.key)
    first = plan.dispatches[0]
    splits, _ = _split_fields(first)
    kg, rgl = first.threadgroup[1], first.threadgroup[2]
    tgs = first.grid[0] * first.grid[1] * first.grid[2]
    kv = 2 * s.b * s.hkv * s.nk * s.d * elem * first.grid[0] // s.hkv  # once per row chunk (grid x = Hkv * C)
    rows = s.b * s.hq * s.nq
    partials = rows * splits * (s.d + 2) * 4 * 2 if splits > 1 else 0
    rs = 4 if s.d <= 64 else 2 if s.d <= 128 else 1
    merge_barriers = (2 + 2 * rs) if kg > 1 else 0
    return DecodeDesign("ours", len(plan.dispatches), tgs, kg * rgl, first.threadgroups_per_core,
                        4 if s.d <= 256 else 2, rgl, kv, rows * s.d * elem * 2 + partials, (rgl - 1) * kv, 0.0,
                        _fixed_cycles(gpu, k, merge_barriers), s.d * elem,
                        f"{splits} blocks, {tgs} threadgroups of {kg * rgl} SIMD-groups ({kg} key groups x {rgl} "
                        f"row groups), {first.threadgroups_per_core} resident per core, 4 rows in flight")


def ours_before(s, gpu, dtype=torch.float16, k=T.POINT):
    """Ours before issue 43, priced by the same model: the split count of the old rule (24 key-group streams
    launched per core, blocks of 32-key multiples), one key prefetched (2 rows in flight), the old register
    model's residency (2 key slices, 2 values per row with a mask)."""
    now = ours(s, gpu, dtype, k)
    plan = _plan(s, dtype, gpu.key)
    first = plan.dispatches[0]
    kg, rgl = first.threadgroup[1], first.threadgroup[2]
    per_block = first.grid[0] * first.grid[1]
    streams = per_block * kg
    want = -(-gpu.cores * 24 // streams)
    limit = min(max(1, s.nk // 128), 256)
    wanted = max(1, min(want, limit))

    def blocks_for(asked):
        per = -(-(-(-s.nk // asked)) // 32) * 32
        return -(-s.nk // per)
    asked, splits = wanted, blocks_for(wanted)
    while splits < wanted and asked < limit:
        asked += 1
        splits = blocks_for(asked)
    rs = 4 if s.d <= 64 else 2 if s.d <= 128 else 1
    dpl = -(-s.d // 32)
    live = rs * (3 * dpl + 5) + 2 * dpl + 16
    resident = max(1, T.REGISTER_FILE_PER_CORE // (live * 4 * 32 * kg * rgl))
    rows = s.b * s.hq * s.nq
    partials = rows * splits * (s.d + 2) * 4 * 2 if splits > 1 else 0
    return now._replace(name="ours (before issue 43)", dispatches=2 if splits > 1 else 1,
                        threadgroups=per_block * splits, resident_tgs=resident, rows_in_flight=2,
                        other_dram=rows * s.d * now.row_bytes // s.d * 2 + partials,
                        why=f"{splits} blocks, {per_block * splits} threadgroups, {resident} resident per core, "
                            f"2 rows in flight")


def mlx_blocks(gpu, nk, n_simds):
    """MLX's sdpa_vector_2pass block count (scaled_dot_product_attention.cpp), by device class."""
    devc = _arch(gpu)
    if devc == "s":
        if nk > 1024 and n_simds > 4:
            return 128 if nk <= 8192 else 256 if nk <= 32768 else 512 if nk <= 65536 else 1024
        return 64
    if devc == "d":
        if n_simds <= 2 and nk > 8192:
            return 256
        if n_simds >= 6:
            return 512 if 16384 <= nk < 65536 else 1024 if nk >= 65536 else 128
        return 128
    return 64 if n_simds >= 4 else 32


def mlx_2pass(s, gpu, dtype=torch.float16, k=T.POINT):
    """MLX's sdpa_vector_2pass: pass 1 grid (Hkv, B, blocks), threadgroup (32, gqa, Nq), one SIMD-group per
    query row of the GQA group, each reading every key of its block (keys b, b + blocks, ...) one at a time
    (its K and V rows in flight: 2); the GQA group's SIMD-groups re-request the same rows (L1); partials
    (Hq x blocks x (D + 2) floats) written and merged by pass 2."""
    elem = torch.empty((), dtype=dtype).element_size()
    gqa = s.hq // s.hkv * s.nq
    blocks = mlx_blocks(gpu, s.nk, gqa)
    kv = 2 * s.b * s.hkv * s.nk * s.d * elem
    dpl = -(-s.d // 32)
    live = 4 * dpl + 8 + 16  # q, o, k, v slices, the softmax scalars, addresses (an estimate, as ours)
    resident = max(1, T.REGISTER_FILE_PER_CORE // (live * 4 * 32 * gqa))
    rows = s.b * s.hq * s.nq
    return DecodeDesign("MLX sdpa_vector_2pass", 2, s.b * s.hkv * blocks, gqa, resident, 2, gqa, kv,
                        rows * s.d * elem * 2 + rows * blocks * (s.d + 2) * 4 * 2, (gqa - 1) * kv, 0.0,
                        _fixed_cycles(gpu, k, 0), s.d * elem,
                        f"{blocks} blocks, {s.b * s.hkv * blocks} threadgroups of {gqa} SIMD-groups, 2 rows in "
                        f"flight, every row requested {gqa}x")


# -------------------------------------------- GQA >= 4: fewer row groups, more rows each (issue 43)

LIVE_OVERHEAD = 16     # csrc/metal/plan_detail.h kLiveOverhead: addresses, bounds, counters per lane
ADDRESSABLE_REGS = 128  # 32-bit registers a thread addresses: a design needing more spills


def _decode_live(d, rows):
    """csrc/metal/plan_detail.h decode_live_registers (no mask): each row's q and o slices, scores and
    softmax state, plus the K/V slices of the rows in flight, plus the overhead."""
    slice_ = -(-d // 32)
    in_flight = 4 if d <= 256 else 2
    return rows * (3 * slice_ + 5) + in_flight * slice_ + LIVE_OVERHEAD


def ours_fewer_row_groups(s, gpu, dtype=torch.float16, k=T.POINT):
    """The alternative issue 43 asked to weigh for GQA >= 4: the same launch with half the row groups, each
    SIMD-group holding twice the query rows (a kv head's rows shared by fewer SIMD-groups, so fewer L1
    re-requests of each K/V row), against ours (two or more row groups of the register budget's rows).
    Residency from the same register rule as the planner's (REGISTER_FILE_PER_CORE over the threadgroup's
    live registers); the split count kept, so a lower residency can cost waves. None where ours has one row
    group (nothing to fold) or the doubled rows exceed the registers a thread addresses (it would spill)."""
    now = ours(s, gpu, dtype, k)
    rgl, kg = now.readers, now.sgs_per_tg // now.readers
    if rgl < 2:
        return None
    rows = 2 * (4 if s.d <= 64 else 2 if s.d <= 128 else 1)
    live = _decode_live(s.d, rows)
    if live > ADDRESSABLE_REGS:
        return None
    half = rgl // 2
    resident = max(1, T.REGISTER_FILE_PER_CORE // (live * 4 * 32 * kg * half))
    merge_barriers = (2 + 2 * rows) if kg > 1 else 0
    return now._replace(name="ours, half the row groups", sgs_per_tg=kg * half, resident_tgs=resident,
                        readers=half, l1_rerequest=(half - 1) * now.kv_bytes,
                        fixed_cycles=_fixed_cycles(gpu, k, merge_barriers),
                        why=f"{kg} key groups x {half} row groups of {rows} rows, {live} live registers, "
                            f"{resident} resident per core")


def row_group_comparison(chips=None, k=T.POINT):
    """[(chip, model, B, Nk, ours us, alternative us, (ours' bound, the alternative's), alternative / ours)] over the decode grid's GQA >= 4
    shapes where the alternative exists, at the knobs k (T.SLOW: the L1 at its slow end, 32 B per
    core-cycle, where re-requests cost the most): predictions."""
    chips = chips or [g for g in G.GPUS if g.key]
    out = []
    for gpu in chips:
        for name, (hq, hkv, d) in GRID_MODELS.items():
            if hq // hkv < 4:
                continue
            for b in GRID_BATCHES:
                for nk in GRID_NK:
                    s = Shape(b, hq, hkv, 1, nk, d)
                    alt = ours_fewer_row_groups(s, gpu, k=k)
                    if alt is None:
                        continue
                    (t_now, terms_now), (t_alt, terms_alt) = predict(ours(s, gpu, k=k), gpu, k), predict(alt, gpu, k)
                    bound = tuple(max(("stream", "little", "L1", "link"), key=t.get) for t in (terms_now, terms_alt))
                    out.append((gpu.name, name, b, nk, t_now * 1e6, t_alt * 1e6, bound, t_alt / t_now))
    return out


def row_group_report():
    rows = row_group_comparison()
    ratios = sorted(r[-1] for r in rows)
    print("\n## GQA >= 4: ours (the register budget's rows, several row groups) against half the row groups "
          "with twice the rows each (predictions)")
    print(f"{len(rows)} grid points (the GQA >= 4 models, every named chip, batch 1 and 8, Nk 512-128k; at GQA 4 "
          "x D 128 ours is 2 row groups of 2 rows against 1 of 4, at GQA 8 x D 128 4 of 2 against 2 of 4). "
          f"Alternative / ours: min {ratios[0]:.3f}, median {ratios[len(ratios) // 2]:.3f}, max {ratios[-1]:.3f}.")
    worst = max(rows, key=lambda r: r[-1])
    best = min(rows, key=lambda r: r[-1])
    print(f"Largest gain for the alternative: {best[0]} {best[1]} B {best[2]} Nk {best[3]}: {best[5]:.1f} us "
          f"against {best[4]:.1f}; largest loss: {worst[0]} {worst[1]} B {worst[2]} Nk {worst[3]}: "
          f"{worst[5]:.1f} us against {worst[4]:.1f}.")
    slow_rows = row_group_comparison(k=T.SLOW)
    slow = sorted(r[-1] for r in slow_rows)
    l1 = [r for r in slow_rows if r[-2][0] == "L1"]
    print(f"At the slow end of every band (L1 32 B per core-cycle, DRAM latency 400 ns): min {slow[0]:.3f}, "
          f"median {slow[len(slow) // 2]:.3f}, max {slow[-1]:.3f}. Ours binds on the L1 at {len(l1)} of "
          f"{len(slow_rows)} points there (0 at the point figures), where the alternative saves at most "
          f"{(1 - min((r[-1] for r in l1), default=1)) * 100:.1f} %; elsewhere both stream K/V from DRAM or are "
          "bound by Little's law alike. The model cannot choose between them: ours is kept (no kernel change, "
          "and the register budget's rows hold the residency).")
    return rows


LLAMA_WORKGROUPS = 32  # ggml-metal flash_attn_ext_vec: nwg workgroups split the keys of each query head
LLAMA_PHASE = 32       # keys per phase (a SIMD-group's loads of 32 keys issued together)


def llamacpp_vec(s, gpu, dtype=torch.float16, k=T.POINT):
    """llama.cpp's flash_attn_ext_vec: one threadgroup per (query row, query head, workgroup) of 1 SIMD-group
    (an assumption: the host may pick more), 32-key phases in flight; each query head reads its kv head's
    rows itself, the GQA group's other heads' reads served by the shared cache (link); partials per workgroup
    merged by a reduce kernel."""
    elem = torch.empty((), dtype=dtype).element_size()
    gqa = s.hq // s.hkv * s.nq
    kv = 2 * s.b * s.hkv * s.nk * s.d * elem
    dpl = -(-s.d // 32)
    live = 3 * dpl + LLAMA_PHASE // 4 + 8 + 16  # q, o, one phase's row slices and scores (an estimate)
    resident = max(1, T.REGISTER_FILE_PER_CORE // (live * 4 * 32))
    rows = s.b * s.hq * s.nq
    tgs = rows * LLAMA_WORKGROUPS
    return DecodeDesign("llama.cpp flash_attn_ext_vec", 2, tgs, 1, resident, LLAMA_PHASE, 1, kv,
                        rows * s.d * elem * 2 + rows * LLAMA_WORKGROUPS * (s.d + 2) * 4 * 2, 0.0, (gqa - 1) * kv,
                        _fixed_cycles(gpu, k, 0), s.d * elem,
                        f"{tgs} threadgroups of 1 SIMD-group, 32-key phases in flight, every row read by {gqa} "
                        f"threadgroups (shared cache)")


# ------------------------------------------------------------ calibration

def calibrate():
    """DECODE_STREAM_FRACTION such that MLX's design, priced at the point figures, takes exactly the measured
    time of the ONE calibration anchor (core/anchors.py DECODE_ANCHORS, role "calibration"), with the
    stream term binding; records the derivation (the anchor and the values it read) in DERIVATIONS."""
    (a,) = [a for a in A.DECODE_ANCHORS if a.role == "calibration"]
    gpu = G.BY_NAME[a.gpu]
    d = mlx_2pass(a.shape, gpu)
    t_meas = d.kv_bytes / (a.measured_gbs * 1e9)
    probe = predict(d, gpu, T.POINT, fraction=1e9)[1]  # the other terms, the stream out of the way
    rest = probe["overhead"] + probe["fixed"]
    if t_meas - rest <= max(probe["little"], probe["L1"], probe["link"]):
        raise AssertionError(f"the calibration point {a.name} is not stream-bound by this model: nothing to fit")
    frac = (d.kv_bytes + d.other_dram) / (gpu.bandwidth_gbs * 1e9 * (t_meas - rest))
    DERIVATIONS["DECODE_STREAM_FRACTION"] = {"value": frac, "anchors": [a.name], "inputs": [a.measured_gbs]}
    return frac


# ----------------------------------------------------------------- report

def gbs(design, t):
    return design.kv_bytes / t / 1e9


def side_by_side(nk=8192):
    """MLX #4076's three measured points beside the three designs, on an M5 Pro (predictions)."""
    gpu = G.BY_NAME["M5 Pro"]
    print(f"\n## Decode designs on an M5 Pro, {nk} keys, float16, D = 128, 32 query heads: predictions (GB/s of "
          "K/V counted once), beside MLX #4076's measurements")
    frac = stream_fraction(T.POINT)
    print(f"Decode streaming fraction {frac:.3f} of nominal, calibrated on "
          f"{DERIVATIONS['DECODE_STREAM_FRACTION']['anchors'][0]} alone; the other MLX points validate it "
          f"(L1 rate {L1_BYTES_PER_CYCLE[1]:.0f} B per core-cycle, band {L1_BYTES_PER_CYCLE[0]:.0f}-"
          f"{L1_BYTES_PER_CYCLE[2]:.0f}: an estimate).")
    print("| GQA | role | MLX measured | MLX predicted (band) | within +-10% | ours predicted (band) | ours before "
          "issue 43 | llama.cpp vec predicted | bound (MLX / ours / llama.cpp) |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for a in A.DECODE_ANCHORS:
        out = {}
        for f in (mlx_2pass, ours, ours_before, llamacpp_vec):
            d = f(a.shape, gpu)
            lo, pt, hi = predict_band(d, gpu)
            terms = predict(d, gpu)[1]
            bound = max(("stream", "little", "L1", "link"), key=terms.get)
            out[f.__name__] = (gbs(d, hi), gbs(d, pt), gbs(d, lo), bound, d)
        m = out["mlx_2pass"]
        ok = abs(m[1] / a.measured_gbs - 1) <= 0.10
        rows.append((a, out, ok))
        print(f"| {a.shape.hq // a.shape.hkv} | {a.role} | {a.measured_gbs:.0f} | {m[1]:.0f} ({m[0]:.0f}-{m[2]:.0f}) "
              f"| {ok} | {out['ours'][1]:.0f} ({out['ours'][0]:.0f}-{out['ours'][2]:.0f}) "
              f"| {out['ours_before'][1]:.0f} | {out['llamacpp_vec'][1]:.0f} "
              f"| {m[3]} / {out['ours'][3]} / {out['llamacpp_vec'][3]} |")
    return rows


GRID_MODELS = {"Llama-3-8B": (32, 8, 128), "Llama-3-70B": (64, 8, 128), "Qwen2.5-7B": (28, 4, 128),
               "Mistral-7B": (32, 8, 128), "Gemma-2-9B": (16, 8, 256), "gpt-oss-20b": (64, 8, 64)}
GRID_BATCHES = (1, 8)
GRID_NK = (512, 4096, 32768, 131072)


def grid(chips=None, out=None):
    """Before / after issue 43, ours, every chip (planner-derived designs): predicted microseconds."""
    chips = chips or [g for g in G.GPUS if g.key]
    lines = ["| chip | model | B | Nk | before us (blocks, waves) | after us (blocks, waves) | after / before |",
             "|---|---|---|---|---|---|---|"]
    for gpu in chips:
        for name, (hq, hkv, d) in GRID_MODELS.items():
            for b in GRID_BATCHES:
                for nk in GRID_NK:
                    s = Shape(b, hq, hkv, 1, nk, d)
                    old, new = ours_before(s, gpu), ours(s, gpu)
                    to, tn = predict(old, gpu), predict(new, gpu)
                    lines.append(f"| {gpu.name} | {name} | {b} | {nk} | {to[0] * 1e6:.1f} ({old.why.split(',')[0]}, "
                                 f"{to[1]['waves']}) | {tn[0] * 1e6:.1f} ({new.why.split(',')[0]}, {tn[1]['waves']}) "
                                 f"| {tn[0] / to[0]:.2f} |")
    text = "\n".join(lines)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    return text
