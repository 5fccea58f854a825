"""Performance model of the Metal kernels, built on the Metal emulator's exact
per-dispatch counts (issue 9, "Performance, measured as far as this machine
allows"). Nothing here is a measurement of a GPU: every time it prints is a
prediction, labelled as such.

    python -m benchmarks.metal_model [--quick]

1. Counts. Each kernel runs in the instrumented emulator (tests/backends.py
   emulated_metal_attention, launched from the host's own plan), which counts
   per dispatch: device bytes read/written per tensor, threadgroup bytes,
   simdgroup MMAs, exp2 calls, barriers, threadgroups. Problems too big to
   emulate are SCALED (marked "scaled" in every table) by the rule of
   `scaled_counts`: heads are independent (linear in B * Hq), and for
   Nq = Nk = n * UNIT every count is a polynomial of degree <= 2 in n (each
   query block does work linear in its visible key blocks, and there are n
   of them), so three emulated sizes fix it exactly; tests/test_metal_model.py
   checks the fit against a fourth emulated size.
2. I/O model (FlashAttention-2): Q read and O, lse written once; K and V read
   once per query block, only up to the block's last visible key under
   causal masking. Printed next to the measured K/V bytes and their ratio.
3. Time model on named Apple GPUs (benchmarks/apple_gpus.py, every figure
   with its source): see `predict`.
4. Calibration against the post's M5 measurements, 5. the claims block.
"""
import argparse
import math
import os
import re
import sys
import time
from fractions import Fraction
from typing import NamedTuple

import torch

import flash_metal

from . import apple_gpus as G

_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)  # the emulator and its launcher live in tests/ (not shipped)

import backends  # noqa: E402  (needs tests/ on sys.path)

IMPLS = ("untiled", "tiled", "prefill", "decode", "decode_split")
# Aligned-size unit of the scaling rule: a multiple of every query block (32
# rows) and key block (8, 16, 32 keys) the planner picks, so that n -> n + 1
# adds whole blocks and every block keeps the same shape.
UNIT = 64
BASE_NS = (2, 3, 4)  # the three emulated sizes n * UNIT that fix the quadratic
# Largest problem (query-key pairs summed over heads) emulated directly; above
# it the scaling rule is used. 512 x 512 runs in about a second.
MAX_EMULATED_PAIRS = 512 * 512
# Per-dispatch launch cost, seconds. Estimate, no source: a few microseconds
# for encoding one compute command into an already open encoder; it only
# matters for the smallest problems.
DISPATCH_OVERHEAD_S = 5e-6
# FFMA32 dependent-issue latency, cycles: metal-benchmarks README ("Later
# benchmarks reduced the absolute latency to ... 6 cycles (FFMA32)").
FFMA32_LATENCY = 6
# On-core data bandwidth, bytes per core-cycle (threadgroup memory and L1):
# metal-benchmarks "On-Core Data BW/Cycle 64 B" (Apple 7, 8; assumed later).
ON_CORE_BYTES_PER_CYCLE = 64
# Bytes per core-cycle one core can move to and from the rest of the GPU
# (L2, memory): metal-benchmarks "On-GPU Data BW/Cycle ~32 B". A grid on few
# cores cannot use the whole memory bandwidth.
ON_GPU_BYTES_PER_CYCLE = 32
# Resident SIMD-groups per core beyond which ALU utilization no longer grows
# (metal-benchmarks: "ALU utilization maxes out at 24 simds/core").
MAX_USEFUL_SIMDS = 24
# FFMAs in one 8x8x8 simdgroup_multiply_accumulate (8 * 8 * 8).
FFMA_PER_MMA = 512
# FP32 lanes per core issuing one FFMA per cycle at full rate (metal-benchmarks: 128 ALUs per core).
LANES_PER_CORE = 128
# Independent FFMA chains credited to the post's acc update (DMAX of them in
# the source): metal-benchmarks' tables stop at ILP 4, where one SIMD-group
# per scheduler is already within 1.5x of full rate; more is not credited.
ACC_ILP = 4
# Chains in the post's dot product: the source's one accumulator (score +=).
# Fast-math reassociation could split it; unknown, so this is the slow case.
DOT_ILP = 1
# Scalar lane-ops per exp2 call in the MMA kernels (scale, two mask tests,
# max, subtract, select, sum, the O rescale's share): counted by eye from
# attention_prefill.h, an estimate (the emulator does not count scalar ops).
SCALAR_OPS_PER_EXP2 = 8
POST_MS = {("untiled", 2048, 64, True): 3.066, ("tiled", 2048, 64, True): 2.159}  # the post, Apple M5, float32


class Shape(NamedTuple):
    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int


class Record(NamedTuple):
    """One dispatch: the plan's launch and its counts (exact or scaled)."""
    kernel: str
    grid: tuple
    threadgroup: tuple
    tg_memory: int
    counts: dict
    scaled: bool


def _dtype_name(dt):
    return str(dt).replace("torch.", "")


def _inputs(s: Shape, dtype, real: bool):
    if real:
        g = torch.Generator().manual_seed(0)
        return (torch.randn(s.b, s.hq, s.nq, s.d, generator=g).to(dtype),
                torch.randn(s.b, s.hkv, s.nk, s.d, generator=g).to(dtype),
                torch.randn(s.b, s.hkv, s.nk, s.d, generator=g).to(dtype))
    # planning only: zero-stride views, no memory
    one = torch.empty(1, 1, 1, s.d, dtype=dtype)
    return one.expand(s.b, s.hq, s.nq, s.d), one.expand(s.b, s.hkv, s.nk, s.d), one.expand(s.b, s.hkv, s.nk, s.d)


def plan(impl, s: Shape, dtype, causal):
    return flash_metal.explain(*_inputs(s, dtype, real=False), causal, None, impl, "base")


def available(impl) -> bool:
    """The plan for impl names kernels the emulator's library has (the new kernels land during issue 9)."""
    s = Shape(1, 1, 1, 4 if impl.startswith("decode") else 64, 64, 64)
    try:
        names = set(backends.metal_library(True).kernel_names())
        return all(d.kernel_name in names for d in plan(impl, s, torch.float16, False).dispatches)
    except Exception:  # noqa: BLE001  (a planner that refuses the impl means: not available)
        return False


def _count_dict(d, c):
    out = {f: getattr(c, f) for f in ("threadgroups", "threads", "threadgroup_barriers", "simdgroup_mmas",
                                      "exp2_calls", "threadgroup_bytes_read", "threadgroup_bytes_written")}
    for name, index in d.buffers.items():  # tensors by name; the params struct (bytes=) is left out
        out["read_" + name] = c.device_bytes_read_by_index[index]
        out["write_" + name] = c.device_bytes_written_by_index[index]
    return out


_CACHE = {}


def emulate(impl, s: Shape, dtype, causal):
    """Runs the plan's dispatches in the instrumented emulator; exact counts."""
    key = (impl, s, dtype, causal)
    if key not in _CACHE:
        backends.emulated_metal_attention(*_inputs(s, dtype, real=True), causal, None, impl, instrumented=True)
        _CACHE[key] = [Record(d.kernel_name, d.grid, d.threadgroup, d.threadgroup_memory, _count_dict(d, c), False)
                       for d, c in backends.LAST_DISPATCHES]
    return _CACHE[key]


def _quadratic_at(points, x):
    """The degree-2 polynomial through three (n, value) points, at x (exact, Lagrange)."""
    total = Fraction(0)
    for i, (xi, yi) in enumerate(points):
        term = Fraction(yi)
        for j, (xj, _) in enumerate(points):
            if j != i:
                term *= Fraction(x - xj, xi - xj)
        total += term
    return total


def scaled_counts(impl, s: Shape, dtype, causal, base_ns=BASE_NS):
    """Counts of a problem too big to emulate, from three emulated ones.

    Rule: every (batch, query head) runs the same dispatches on its own data,
    so counts are linear in B * Hq; for Nq = Nk = n * UNIT, counts of one head
    are a polynomial of degree <= 2 in n, fixed by n in base_ns. Only for
    query-block kernels (not decode) with Nq = Nk a multiple of UNIT."""
    if s.nq != s.nk or s.nq % UNIT or impl.startswith("decode"):
        raise ValueError(f"the scaling rule needs Nq = Nk, a multiple of {UNIT}, and a query-block kernel; got {s}")
    bases = [emulate(impl, Shape(1, 1, 1, n * UNIT, n * UNIT, s.d), dtype, causal) for n in base_ns]
    full = plan(impl, s, dtype, causal).dispatches
    n = s.nq // UNIT
    heads = s.b * s.hq
    records = []
    for i, d in enumerate(full):
        counts = {}
        for field in bases[0][i].counts:
            v = _quadratic_at([(m, b[i].counts[field]) for m, b in zip(base_ns, bases)], n) * heads
            if v.denominator != 1:
                raise AssertionError(f"scaling rule gave a fractional {field}: {v}")
            counts[field] = int(v)
        records.append(Record(d.kernel_name, d.grid, d.threadgroup, d.threadgroup_memory, counts, True))
    return records


def counts_for(impl, s: Shape, dtype, causal):
    if s.b * s.hq * s.nq * s.nk <= MAX_EMULATED_PAIRS or impl.startswith("decode"):
        return emulate(impl, s, dtype, causal)
    return scaled_counts(impl, s, dtype, causal)


# ---------------------------------------------------------------- I/O model

def visible(row, s: Shape, causal):
    """Keys query row `row` sees (bottom-right causal alignment, attention_common.h)."""
    return min(max(row + s.nk - s.nq + 1, 0), s.nk) if causal else s.nk


def block_rows(impl, kernel):
    """Query rows that share one K/V stream in this kernel (its FA2 "query block")."""
    m = re.search(r"_bq(\d+)_", kernel) or re.search(r"_t(\d+)$", kernel)
    return int(m.group(1)) if m else None


def fa2_kv_bytes(s: Shape, elem, rows, causal):
    """FlashAttention-2's K (= V) bytes: each query block of `rows` rows of one
    query head reads the keys its last row sees, once."""
    per_head = sum(visible(min(q0 + rows, s.nq) - 1, s, causal) for q0 in range(0, s.nq, rows)) * s.d * elem
    return per_head * s.b * s.hq


def fa2_decode_kv_bytes(s: Shape, elem):
    """Decode: each (batch, kv head) reads its K (= V) once for all its query rows."""
    return s.b * s.hkv * s.nk * s.d * elem


def io_row(impl, s, dtype, causal, records):
    elem = torch.empty((), dtype=dtype).element_size()
    """(measured, model) bytes of K plus V read, summed over the call's dispatches."""
    measured = sum(r.counts.get("read_k", 0) + r.counts.get("read_v", 0) for r in records)
    if impl.startswith("decode"):
        model = 2 * fa2_decode_kv_bytes(s, elem)
    else:
        model = 2 * fa2_kv_bytes(s, elem, block_rows(impl, records[0].kernel), causal)
    return measured, model


# --------------------------------------------------------------- time model

def useful_flops(s: Shape, causal):
    """4 * B * Hq * D * (visible query-key pairs): the two products' FLOPs."""
    pairs = sum(visible(r, s, causal) for r in range(s.nq))
    return 4 * s.b * s.hq * s.d * pairs


def _dmax(kernel):
    return int(re.search(r"_d(\d+)", kernel).group(1))


def predict(records, gpu: G.AppleGPU, s: Shape, dtype, causal):
    """Predicted seconds for one call: the sum over its dispatches of
    overhead + max(compute, exp2, memory, on-core data), each per dispatch:

    - compute: simdgroup MMAs x 512 FFMA at metal-benchmarks' in-GEMM rate
      (101.7 FFMA32 / 102.5 FFMA16 per core-cycle), plus scalar FFMAs. The
      post's kernels do per visible (row, key) pair (= exp2_calls / 2, two
      exp2 per key in OnlineSoftmax.update) DMAX dependent FFMAs (the dot
      product, one chain) and 2 DMAX independent ones (acc = acc * alpha +
      w * v). A dependent chain issues once per FFMA32_LATENCY / (resident
      SIMD-groups per scheduler) cycles, independent work at full rate once
      the latency is covered (Little's law on 4 schedulers). MMA kernels add
      8 scalar ops per exp2 call (scale, mask tests, max, subtract, sum,
      the O rescale share: an estimate) at full rate. Decode kernels: 2 D
      FFMAs per visible (row, key) at full rate.
    - exp2: exp2 calls / (32 per core-cycle).
    - memory: device bytes / bandwidth, the bandwidth capped at 32 B per
      cycle per active core (metal-benchmarks' on-GPU data rate). Counted bytes are what each lane
      asks for; the untiled kernel's K/V loads are the same address in all
      32 lanes of a SIMD-group (one request), so they count 1/32.
    - on-core data: threadgroup bytes plus device bytes as counted per lane,
      at 64 B per core-cycle (metal-benchmarks' on-core data bandwidth; no
      broadcast merging assumed, Apple does not document it).
    Occupancy: threadgroups resident per core = tgmem_per_core // threadgroup
    memory (no limit without), capped so that SIMD-groups stay <= 24; the
    grid's share per core can be smaller. A last partial wave costs a whole
    one (ceil(waves) / waves), and a grid smaller than the core count leaves
    cores idle. Returns (seconds, {term: seconds}, resident SIMD-groups)."""
    total, terms_sum = 0.0, {}
    hz = gpu.clock_ghz * 1e9
    elem = torch.empty((), dtype=dtype).element_size()
    resident_sgs = None
    for r in records:
        c = r.counts
        sg_per_tg = max(1, math.ceil(r.threadgroup[0] * r.threadgroup[1] * r.threadgroup[2] / 32))
        by_mem = gpu.tgmem_per_core // r.tg_memory if r.tg_memory else 10**6
        tgs_resident = max(1, min(by_mem, MAX_USEFUL_SIMDS // sg_per_tg))
        grid_tgs = c["threadgroups"]
        active = min(gpu.cores, grid_tgs)
        per_core = min(tgs_resident, grid_tgs / active)
        sgs = per_core * sg_per_tg
        resident_sgs = sgs if resident_sgs is None else resident_sgs
        waves = grid_tgs / (active * tgs_resident)
        quant = math.ceil(waves) / waves if waves > 1 else 1.0
        lanes = active * LANES_PER_CORE * hz  # FFMA lane-instructions per second at full rate
        mma_rate = G.MMA_FFMA16_PER_CORE_CYCLE if elem == 2 else G.MMA_FFMA32_PER_CORE_CYCLE
        dmax = _dmax(r.kernel)
        t_mma = c["simdgroup_mmas"] * FFMA_PER_MMA / (active * mma_rate * hz)
        if "untiled" in r.kernel or "tiled" in r.kernel:
            pairs = c["exp2_calls"] / 2
            per_sched = sgs / G.SCHEDULERS_PER_CORE
            # cycles per FFMA: latency over the chains in flight per scheduler (Little's law), at least 1
            dep = max(1.0, FFMA32_LATENCY / (DOT_ILP * max(per_sched, 1e-9)))
            indep = max(1.0, FFMA32_LATENCY / (ACC_ILP * max(per_sched, 1e-9)))
            t_scalar = pairs * (dmax * dep + 2 * dmax * indep) / lanes
        elif "decode" in r.kernel:
            t_scalar = 2 * s.d * s.nq * s.hq * s.b * s.nk / lanes if "merge" not in r.kernel else 0.0
        else:
            t_scalar = SCALAR_OPS_PER_EXP2 * c["exp2_calls"] / lanes
        t_compute = (t_mma + t_scalar) * quant
        t_exp = c["exp2_calls"] / (active * G.EXP2_PER_CORE_CYCLE * hz) * quant
        dev = sum(v for f, v in c.items() if f.startswith(("read_", "write_")))
        if "untiled" in r.kernel:
            dev_dram = dev - (c["read_k"] + c["read_v"]) * 31 / 32
        else:
            dev_dram = dev
        t_mem = dev_dram / min(gpu.bandwidth_gbs * 1e9, active * ON_GPU_BYTES_PER_CYCLE * hz)
        onchip = c["threadgroup_bytes_read"] + c["threadgroup_bytes_written"] + dev
        t_data = onchip / (active * ON_CORE_BYTES_PER_CYCLE * hz) * quant
        terms = {"compute": t_compute, "exp2": t_exp, "memory": t_mem, "on-core data": t_data}
        total += DISPATCH_OVERHEAD_S + max(terms.values())
        for k, v in terms.items():
            terms_sum[k] = terms_sum.get(k, 0.0) + v
    return total, terms_sum, resident_sgs


def bound(terms):
    return max(terms, key=terms.get)


# ------------------------------------------------------------------ report

def _fmt_ms(x):
    return f"{x * 1e3:.4g}"


def post_grid(impls, quick):
    ns = (64, 256, 2048) if quick else (64, 256, 1024, 2048)
    gpu = G.BY_NAME[G.POST_GPU]
    print(f"\n## The post's grid (B = H = 1, float32), predicted on {gpu.name}: model, not measurement")
    print("| impl | N | d | causal | counts | K+V read (B) | FA2 model K+V (B) | ratio | MMAs | exp2 | TG bytes "
          "| threadgroups | barriers | predicted ms | bound |")
    print("|" + "---|" * 15)
    pred = {}
    for d in (32, 64):
        for causal in (False, True):
            for n in ns:
                s = Shape(1, 1, 1, n, n, d)
                for impl in impls:
                    if impl.startswith("decode"):
                        continue
                    recs = counts_for(impl, s, torch.float32, causal)
                    meas, model = io_row(impl, s, torch.float32, causal, recs)
                    t, terms, _ = predict(recs, gpu, s, torch.float32, causal)
                    pred[(impl, n, d, causal)] = t
                    c = recs[0].counts
                    print(f"| {impl} | {n} | {d} | {causal} | {'scaled' if recs[0].scaled else 'emulated'} | {meas} "
                          f"| {model} | {meas / model:.3f} | {c['simdgroup_mmas']} | {c['exp2_calls']} "
                          f"| {c['threadgroup_bytes_read'] + c['threadgroup_bytes_written']} | {c['threadgroups']} "
                          f"| {c['threadgroup_barriers']} | {_fmt_ms(t)} | {bound(terms)} |")
    return pred, ns


def calibration(pred, ns):
    gpu = G.BY_NAME[G.POST_GPU]
    print("\n## Calibration against the post (Apple M5 10-core, float32, N=2048, d=64, causal)")
    print("| kernel | predicted ms | measured ms (post) | predicted / measured | terms (ms) | resident SIMD-groups/core |")
    print("|---|---|---|---|---|---|")
    ratios = {}
    for (impl, n, d, causal), ms in POST_MS.items():
        s = Shape(1, 1, 1, n, n, d)
        p, terms, sgs = predict(counts_for(impl, s, torch.float32, causal), gpu, s, torch.float32, causal)
        ratios[impl] = p * 1e3 / ms
        parts = ", ".join(f"{k} {_fmt_ms(v)}" for k, v in terms.items())
        print(f"| {impl} | {_fmt_ms(p)} | {ms} | {ratios[impl]:.2f} | {parts} | {sgs:.1f} |")
    outside = [k for k, r in ratios.items() if not 0.5 <= r <= 2.0]
    configs = [(n, d, c) for d in (32, 64) for c in (False, True) for n in ns]
    wins = sum(pred[("tiled", n, d, c)] < pred[("untiled", n, d, c)] for n, d, c in configs)
    print(f"\nOrdering: the model predicts tiled faster than untiled in {wins} of {len(configs)} configurations "
          f"(the post measured 15 of 16 over its full grid).")
    if outside:
        print(f"NOT within 2x for: {', '.join(outside)}. Why: the post's kernels are latency-bound scalar loops with "
              "one SIMD-group per threadgroup and 64 threadgroups on 10 cores (<= 6.4 SIMD-groups per core, a quarter "
              "of what hides latency); every key costs each lane 2 x DMAX loads (device memory for untiled, "
              "threadgroup memory for tiled) whose latency and bank behaviour the model does not know (Apple "
              "publishes neither). The model's throughput terms are lower bounds there; no constant was tuned to "
              "close the gap.")
    else:
        print("Both kernels within 2x of the post's measurements.")
    return ratios


LLM_FULL = [Shape(1, 32, 32, 4096, 4096, 128), Shape(1, 8, 8, 8192, 8192, 64), Shape(4, 16, 16, 1024, 1024, 64),
            Shape(1, 32, 8, 4096, 4096, 128), Shape(1, 32, 8, 1, 4096, 128), Shape(1, 32, 8, 1, 32768, 128)]
LLM_QUICK = [Shape(1, 32, 32, 4096, 4096, 128), Shape(1, 32, 8, 1, 4096, 128)]


def llm(impls, quick):
    shapes = LLM_QUICK if quick else LLM_FULL
    dtypes = (torch.float16,) if quick else (torch.float32, torch.bfloat16, torch.float16)
    gpus = [G.BY_NAME[n] for n in (("M3 Max", G.POST_GPU) if quick else [g.name for g in G.GPUS])]
    print("\n## LLM preset: counts (exact or scaled) and predicted ms per GPU: model, not measurement")
    print("| shape | dtype | causal | impl | counts | K+V read (B) | FA2 model K+V (B) | ratio | MMAs | exp2 | "
          + " | ".join(g.name for g in gpus) + " |")
    print("|" + "---|" * (10 + len(gpus)))
    for s in shapes:
        for dt in dtypes:
            for causal in ((False,) if s.nq == 1 else (False, True)):
                for impl in impls:
                    if impl.startswith("decode") != (s.nq <= 8) or impl == "untiled":
                        continue
                    recs = counts_for(impl, s, dt, causal)
                    meas, model = io_row(impl, s, dt, causal, recs)
                    mmas = sum(r.counts["simdgroup_mmas"] for r in recs)
                    exps = sum(r.counts["exp2_calls"] for r in recs)
                    times = " | ".join(_fmt_ms(predict(recs, g, s, dt, causal)[0]) for g in gpus)
                    label = f"{s.b}x{s.hq}:{s.hkv}x{s.nq}/{s.nk}x{s.d}"
                    print(f"| {label} | {_dtype_name(dt)} | {causal} | {impl} | "
                          f"{'scaled' if recs[0].scaled else 'emulated'} | {meas} | {model} | {meas / model:.3f} "
                          f"| {mmas} | {exps} | {times} |")


def claims(impls):
    print("\n## Claims (predictions of this model, not measurements; not yet verified on Apple hardware)")
    if "prefill" not in impls:
        print("prefill kernel not available in the emulator library yet: no claim.")
        return
    for gname in ("M3 Max", G.POST_GPU):
        gpu = G.BY_NAME[gname]
        for s in (Shape(1, 8, 8, 4096, 4096, 64), Shape(1, 8, 8, 4096, 4096, 128), Shape(1, 8, 8, 8192, 8192, 64),
                  Shape(1, 8, 8, 8192, 8192, 128)):
            for causal in (False, True):
                recs = counts_for("prefill", s, torch.float16, causal)
                t, terms, sgs = predict(recs, gpu, s, torch.float16, causal)
                mma_peak = gpu.cores * gpu.clock_ghz * 1e9 * 2 * G.MMA_FFMA16_PER_CORE_CYCLE
                alu_peak = gpu.cores * gpu.clock_ghz * 1e9 * G.FP16_FLOPS_PER_CORE_CYCLE
                f = useful_flops(s, causal)
                print(f"prefill f16 {gname} B=1 H=8 N={s.nq} D={s.d} causal={causal}: predicted {_fmt_ms(t)} ms, "
                      f"{f / t / 1e12:.2f} TFLOP/s = {f / t / mma_peak:.0%} of simdgroup-matrix peak "
                      f"({mma_peak / 1e12:.2f} TFLOP/s) = {f / t / alu_peak:.0%} of ALU peak; bound: {bound(terms)}")
    # Decode: the fraction of memory bandwidth a token-generation step uses
    # (K/V bytes over predicted time), the figure MLX issue #3837 reports at
    # about 25% for MLX's decode on long GQA contexts. A roofline of a
    # memory-bound kernel predicts near 100% by construction; what the counts
    # add is that K and V are read exactly once per GQA group.
    for gname, s in (("M3 Max", Shape(1, 32, 8, 1, 32768, 128)), ("M1 Ultra", Shape(1, 16, 4, 1, 32768, 256))):
        gpu = G.BY_NAME[gname]
        for impl in ("decode", "decode_split"):
            recs = counts_for(impl, s, torch.float16, False)
            t = predict(recs, gpu, s, torch.float16, False)[0]
            kv = 2 * s.b * s.hkv * s.nk * s.d * 2
            print(f"{impl} f16 {gname} {s.b}x{s.hq}:{s.hkv} heads, 1 query, {s.nk} keys, D={s.d}: predicted "
                  f"{_fmt_ms(t)} ms = {kv / t / (gpu.bandwidth_gbs * 1e9):.0%} of memory bandwidth "
                  f"({len(recs)} dispatch{'es' if len(recs) > 1 else ''}, {recs[0].counts['threadgroups']} threadgroups)")
    gpu = G.BY_NAME[G.POST_GPU]
    for causal in (True, False):
        s = Shape(1, 1, 1, 2048, 2048, 64)
        for dt in (torch.float32, torch.float16):
            tp = predict(counts_for("prefill", s, dt, causal), gpu, s, dt, causal)[0]
            tt = predict(counts_for("tiled", s, torch.float32, causal), gpu, s, torch.float32, causal)[0]
            line = (f"prefill {_dtype_name(dt)} vs the post's tiled kernel (float32) on {gpu.name}, N=2048 d=64 "
                    f"causal={causal}: predicted {_fmt_ms(tp)} ms; model-vs-model ratio {tt / tp:.1f}x")
            if causal:
                line += f"; against the post's measured 2.159 ms: {2.159e-3 / tp:.1f}x"
            print(line)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small subset, under a minute once the emulator is built")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    impls = [i for i in IMPLS if available(i)]
    missing = [i for i in IMPLS if i not in impls]
    print("# Metal performance model (predictions from emulator counts; not measurements)")
    print(f"kernels in the emulator library: {', '.join(impls)}"
          + (f"; not yet available: {', '.join(missing)}" if missing else ""))
    print(f"scaling rule: counts of Nq = Nk = n*{UNIT} fitted exactly by a quadratic in n through n = {BASE_NS}, "
          "times B*Hq ('scaled' rows); 'emulated' rows are exact counts")
    print(f"per-dispatch overhead {DISPATCH_OVERHEAD_S * 1e6:.0f} us (estimate); devices: "
          + "; ".join(f"{g.name} {g.cores} cores {g.clock_ghz} GHz {g.bandwidth_gbs} GB/s" for g in G.GPUS))
    pred, ns = post_grid(impls, args.quick)
    calibration(pred, ns)
    llm(impls, args.quick)
    claims(impls)
    print(f"\n(wall time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
