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
   with its source): benchmarks/metal_model_timing.py (latency, occupancy,
   critical path, streaming ceiling; every prediction a band).
4. Calibration against the post's M5 measurements, 5. the claims block,
   6. the anchors (benchmarks/metal_model_anchors.py: MLX's and the post's
   published timings; `--anchors --csv PATH` alone), 7. M5's neural
   accelerators (benchmarks/metal_model_accel.py; `--accelerators` alone).
"""
import argparse
import contextlib
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
from . import metal_model_timing as T

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
# Dispatch overhead (point of its band; apple_gpus.DISPATCH_OVERHEAD_S, an estimate).
DISPATCH_OVERHEAD_S = G.DISPATCH_OVERHEAD_S[1]
ON_GPU_BYTES_PER_CYCLE = T.ON_GPU_BYTES_PER_CYCLE  # used by metal_backward_model's unfused baseline
POST_MS = {("untiled", 2048, 64, True): 3.066, ("tiled", 2048, 64, True): 2.159}  # the post, Apple M5, float32


class Shape(NamedTuple):
    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int
    dv: int = 0  # v's head dim when it has its own (MLA, issue 20 section 2); 0: d

    @property
    def d_v(self):
        return self.dv or self.d


class Record(NamedTuple):
    """One dispatch: the plan's launch and its counts (exact or scaled)."""
    kernel: str
    grid: tuple
    threadgroup: tuple
    tg_memory: int
    counts: dict
    scaled: bool
    source: tuple = None  # (impl, backward): the plan that launched it, for the planner's per-chip estimates


def _dtype_name(dt):
    return str(dt).replace("torch.", "")


def _inputs(s: Shape, dtype, real: bool):
    if real:
        g = torch.Generator().manual_seed(0)
        return (torch.randn(s.b, s.hq, s.nq, s.d, generator=g).to(dtype),
                torch.randn(s.b, s.hkv, s.nk, s.d, generator=g).to(dtype),
                torch.randn(s.b, s.hkv, s.nk, s.d_v, generator=g).to(dtype))
    # planning only: zero-stride views, no memory
    one = torch.empty(1, 1, 1, s.d, dtype=dtype)
    one_v = torch.empty(1, 1, 1, s.d_v, dtype=dtype)
    return one.expand(s.b, s.hq, s.nq, s.d), one.expand(s.b, s.hkv, s.nk, s.d), one_v.expand(s.b, s.hkv, s.nk, s.d_v)


def plan(impl, s: Shape, dtype, causal):
    return flash_metal.explain(*_inputs(s, dtype, real=False), causal, None, impl, "base")


def available(impl) -> bool:
    """The plan for impl names kernels the emulator's library has (the new kernels land during issue 9)."""
    s = Shape(1, 1, 1, 4 if impl.startswith("decode") else 64, 64, 64)
    names = set(backends.metal_library(True).kernel_names())  # no clang: the emulator's own error, not "absent"
    try:
        return all(d.kernel_name in names for d in plan(impl, s, torch.float16, False).dispatches)
    except Exception:  # noqa: BLE001  (a planner that refuses the impl means: not available)
        return False


def _count_dict(d, c):
    out = {f: getattr(c, f) for f in ("threadgroups", "threads", "threadgroup_barriers", "simdgroup_mmas",
                                      "exp2_calls", "threadgroup_bytes_read", "threadgroup_bytes_written")}
    if getattr(c, "mpp_flops", 0):  # Metal 4 tensor ops (impl='tensor_ops'): matmul2d runs and their 2 M N K
        out["mpp_runs"], out["mpp_flops"] = c.mpp_runs, c.mpp_flops
    for name, index in d.buffers.items():  # tensors by name; the params struct (bytes=) is left out
        out["read_" + name] = c.device_bytes_read_by_index[index]
        out["write_" + name] = c.device_bytes_written_by_index[index]
        # The traffic rules (issue 19, metal_model_timing.py): bytes new to their threadgroup (DRAM, if the L1
        # keeps what a threadgroup shares) and bytes requested after the broadcast rule.
        out["dram_" + name] = c.device_unique_bytes_read_by_index[index]
        out["req_" + name] = c.device_request_bytes_by_index[index]
    return out


_CACHE = {}
# The bucket padded_to() runs every plan in (None: the planner's own).
_PAD = None


def _source(impl, backward):
    """A Record's source: the plan, and under padded_to() the bucket it was planned in."""
    return (impl, backward) + ((_PAD,) if _PAD else ())


@contextlib.contextmanager
def padded_to(bucket):
    """Within it, every plan of a head dim under `bucket` is the one the
    planner makes for `bucket` (kernel, blocks, grid, threadgroup memory,
    alignment constants), carrying the real head dim's params and the general
    loader (fc_dense off, as for any padded D): the launch a padded bucket
    makes, such as D = 192 in the 256-wide kernels before the 192 bucket
    (issue 20 section 3), emulated exactly. Prefill and backward plans."""
    global _PAD
    real = flash_metal.explain

    def widened(t):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[-1] >= bucket:
            return t
        return torch.empty(1, dtype=t.dtype).expand(*t.shape[:-1], bucket)

    def explain(*args, **kw):
        own = real(*args, **kw)
        if args[0].shape[-1] >= bucket:
            return own
        wide = real(*(widened(a) for a in args), **{n: widened(a) for n, a in kw.items()})
        if any(d.kernel_name.startswith("flash_decode") for d in wide.dispatches):
            raise ValueError("padded_to: prefill and backward plans only (a decode split count depends on D)")
        dense = 10  # kDenseFunctionConstant (csrc/metal_plan.h)
        dispatches = tuple(w._replace(params=o.params, function_constants=w.function_constants[:dense] + (False,) +
                                      w.function_constants[dense + 1:])
                           for w, o in zip(wide.dispatches, own.dispatches))
        return own._replace(dispatches=dispatches, reason=wide.reason)

    saved, _PAD = _PAD, bucket
    flash_metal.explain = explain
    try:
        yield
    finally:
        flash_metal.explain, _PAD = real, saved


def emulate(impl, s: Shape, dtype, causal):
    """Runs the plan's dispatches in the instrumented emulator; exact counts."""
    key = (impl, s, dtype, causal, _PAD)
    if key not in _CACHE:
        # Tensor-op kernels in the published M5 lane layout: the scrambled one (the tests') has invalid
        # cooperative-tensor slots, which the kernel's element loops also visit (exp2 calls, loads).
        backends.emulated_metal_attention(*_inputs(s, dtype, real=True), causal, None, impl, instrumented=True,
                                          mpp_layout="m5")
        _CACHE[key] = [Record(d.kernel_name, d.grid, d.threadgroup, d.threadgroup_memory, _count_dict(d, c), False,
                              _source(impl, False))
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


# Index of fc_pack_gqa (kPackGqaFunctionConstant, csrc/metal_plan.h): the prefill packs a GQA group's heads.
PACK_GQA = 13


def pack_group(impl, s: Shape, dtype, causal):
    """G when the plan's prefill packs GQA (one threadgroup per (batch, kv head, packed block)), else 1."""
    fc = plan(impl, s, dtype, causal).dispatches[0].function_constants
    return s.hq // s.hkv if len(fc) > PACK_GQA and fc[PACK_GQA] else 1


def scaled_counts(impl, s: Shape, dtype, causal, base_ns=BASE_NS):
    """Counts of a problem too big to emulate, from three emulated ones.

    Rule: every (batch, query head) runs the same dispatches on its own data,
    so counts are linear in B * Hq; for Nq = Nk = n * UNIT, counts of one head
    are a polynomial of degree <= 2 in n, fixed by n in base_ns. Only for
    query-block kernels (not decode) with Nq = Nk a multiple of UNIT. A packed
    GQA prefill (fc_pack_gqa) shares K/V tiles within a group, so its unit is
    one (batch, kv head) with its G query heads: linear in B * Hkv."""
    if s.nq != s.nk or s.nq % UNIT or impl.startswith("decode"):
        raise ValueError(f"the scaling rule needs Nq = Nk, a multiple of {UNIT}, and a query-block kernel; got {s}")
    g = pack_group(impl, s, dtype, causal)
    bases = [emulate(impl, Shape(1, g, 1, n * UNIT, n * UNIT, s.d, s.dv), dtype, causal) for n in base_ns]
    full = plan(impl, s, dtype, causal).dispatches
    n = s.nq // UNIT
    heads = s.b * (s.hkv if g > 1 else s.hq)
    records = []
    for i, d in enumerate(full):
        counts = {}
        for field in bases[0][i].counts:
            v = _quadratic_at([(m, b[i].counts[field]) for m, b in zip(base_ns, bases)], n) * heads
            if v.denominator != 1:
                raise AssertionError(f"scaling rule gave a fractional {field}: {v}")
            counts[field] = int(v)
        records.append(Record(d.kernel_name, d.grid, d.threadgroup, d.threadgroup_memory, counts, True,
                              _source(impl, False)))
    return records


def counts_for(impl, s: Shape, dtype, causal, base_ns=BASE_NS):
    if s.b * s.hq * s.nq * s.nk <= MAX_EMULATED_PAIRS or impl.startswith("decode"):
        return emulate(impl, s, dtype, causal)
    return scaled_counts(impl, s, dtype, causal, base_ns)


# ---------------------------------------------------------------- I/O model

def visible(row, s: Shape, causal):
    """Keys query row `row` sees (bottom-right causal alignment, attention_common.h)."""
    return min(max(row + s.nk - s.nq + 1, 0), s.nk) if causal else s.nk


def block_rows(impl, kernel):
    """Query rows that share one K/V stream in this kernel (its FA2 "query block")."""
    m = re.search(r"_bq(\d+)_", kernel) or re.search(r"_t(\d+)$", kernel)
    return int(m.group(1)) if m else None


def fa2_kv_bytes(s: Shape, elem, rows, causal, group=1):
    """FlashAttention-2's K (= V) bytes: each query block of `rows` rows of one
    query head reads the keys its last row sees, once. group = G > 1: pack GQA
    (fc_pack_gqa), each block of `rows` packed rows of one kv head (query row
    m // G of head m % G) reads the keys its last query row sees, once: G
    times less than unpacked when Nq * G <= rows, the same when Nq is a
    multiple of rows (and not causal)."""
    packed = s.nq * group
    per_head = sum(visible((min(p0 + rows, packed) - 1) // group, s, causal)
                   for p0 in range(0, packed, rows)) * s.d * elem
    return per_head * s.b * (s.hkv if group > 1 else s.hq)


def fa2_decode_kv_bytes(s: Shape, elem):
    """Decode: each (batch, kv head) reads its K (= V) once for all its query rows."""
    return s.b * s.hkv * s.nk * s.d * elem


def io_row(impl, s, dtype, causal, records):
    """(measured, model) bytes of K plus V read, summed over the call's dispatches. Decode: the bytes that reach
    DRAM (the emulator's bytes new to their threadgroup, "dram_"): a key group's row groups read the same keys,
    their loads of a line hits in the core's L1 (an assumption, issue 19). Else the bytes the loads ask for."""
    elem = torch.empty((), dtype=dtype).element_size()
    field = "dram_" if impl.startswith("decode") else "read_"
    measured = sum(r.counts.get(field + "k", 0) + r.counts.get(field + "v", 0) for r in records)
    if impl.startswith("decode"):
        model = 2 * fa2_decode_kv_bytes(s, elem)
    else:
        group = pack_group(impl, s, dtype, causal)
        model = 2 * fa2_kv_bytes(s, elem, block_rows(impl, records[0].kernel), causal, group)
    return measured, model


# --------------------------------------------------------------- time model

def useful_flops(s: Shape, causal):
    """4 * B * Hq * D * (visible query-key pairs): the two products' FLOPs."""
    pairs = sum(visible(r, s, causal) for r in range(s.nq))
    return 4 * s.b * s.hq * s.d * pairs


def predict(records, gpu: G.AppleGPU, s: Shape, dtype, causal, knobs=T.POINT):
    """Predicted seconds for one call at the point figures: (seconds, {term: seconds}, resident SIMD-groups per
    core). The terms (compute with latency hiding, critical path, memory, Little's law, on-core data) are
    described in benchmarks/metal_model_timing.py."""
    return T.predict(records, gpu, s, dtype, causal, knobs)


def bound(terms):
    return max(terms, key=terms.get)


# ------------------------------------------------------------------ report

def _fmt_ms(x):
    return f"{x * 1e3:.4g}"


def _band_ms(records, gpu, s, dtype, causal):
    """'point (low-high)' in ms: every prediction is printed as its band (metal_model_timing.predict_band)."""
    low, point, high = T.predict_band(records, gpu, s, dtype, causal)
    return f"{_fmt_ms(point)} ({_fmt_ms(low)}-{_fmt_ms(high)})"


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
                          f"| {c['threadgroup_barriers']} | {_band_ms(recs, gpu, s, torch.float32, causal)} "
                          f"| {bound(terms)} |")
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
        print(f"| {impl} | {_band_ms(counts_for(impl, s, torch.float32, causal), gpu, s, torch.float32, causal)} | {ms} "
              f"| {ratios[impl]:.2f} | {parts} | {sgs:.1f} |")
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
        print("Both kernels within 2x of the post's measurements, untiled ranked slower. A comparison between "
              "different programs: the post's code as printed reads Q inside the key loop and divides by sqrt(D) per "
              "key; the emulated kernels read Q once and scale once.")
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
                    times = " | ".join(_band_ms(recs, g, s, dt, causal) for g in gpus)
                    label = f"{s.b}x{s.hq}:{s.hkv}x{s.nq}/{s.nk}x{s.d}"
                    print(f"| {label} | {_dtype_name(dt)} | {causal} | {impl} | "
                          f"{'scaled' if recs[0].scaled else 'emulated'} | {meas} | {model} | {meas / model:.3f} "
                          f"| {mmas} | {exps} | {times} |")


def claims(impls):
    print("\n## Claims (predictions of this model, not measurements; not yet verified on Apple hardware)")
    if "prefill" not in impls:
        print("prefill kernel not available in the emulator library yet: no claim.")
        return
    print("Prefill: the same counts as MLX's steel kernel (hand count = emulator counts, "
          "tests/test_metal_model_anchors.py): predicted at MLX's measured speed if the code is as efficient; "
          "unmeasured. Bands: clock, MMA rate, "
          "threadgroup memory per core, DRAM latency, dispatch overhead, streaming ceiling. M5's neural "
          "accelerators: --accelerators (our tensor-op forward from its own emulated counts).")
    for gname in ("M3 Max", G.POST_GPU):
        gpu = G.BY_NAME[gname]
        for s in (Shape(1, 8, 8, 4096, 4096, 64), Shape(1, 8, 8, 8192, 8192, 128)):
            for causal in (False, True):
                recs = counts_for("prefill", s, torch.float16, causal)
                t, terms, _ = predict(recs, gpu, s, torch.float16, causal)
                print(f"prefill f16 {gname} B=1 H=8 N={s.nq} D={s.d} causal={causal}: predicted "
                      f"{_band_ms(recs, gpu, s, torch.float16, causal)} ms; bound: {bound(terms)}")
    # Decode: what the counts add is that K and V are read exactly once per
    # GQA group; the time is that traffic under the measured streaming ceiling
    # and Little's law per core (not a roofline).
    for gname, s in (("M3 Max", Shape(1, 32, 8, 1, 32768, 128)), ("M1 Ultra", Shape(1, 16, 4, 1, 32768, 256))):
        gpu = G.BY_NAME[gname]
        for impl in ("decode", "decode_split"):
            recs = counts_for(impl, s, torch.float16, False)
            low, t, high = T.predict_band(recs, gpu, s, torch.float16, False)
            kv = 2 * s.b * s.hkv * s.nk * s.d * 2
            print(f"{impl} f16 {gname} {s.b}x{s.hq}:{s.hkv} heads, 1 query, {s.nk} keys, D={s.d}: K/V read once per "
                  f"GQA group ({kv} B); predicted {_fmt_ms(t)} ms ({_fmt_ms(low)}-{_fmt_ms(high)}) = "
                  f"{kv / t / (gpu.bandwidth_gbs * 1e9):.0%} of nominal bandwidth (streaming ceiling "
                  f"{G.STREAM_CEILING[0]:.0%}-{G.STREAM_CEILING[2]:.0%}; {len(recs)} dispatch(es))")
    from . import metal_model_anchors
    metal_model_anchors.decode_vs_mlx()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small subset, under a minute once the emulator is built")
    ap.add_argument("--anchors", action="store_true",
                    help="only the anchors: MLX's and the post's published timings against the model")
    ap.add_argument("--csv", metavar="PATH", help="with --anchors: write one row per anchor to PATH")
    ap.add_argument("--accelerators", action="store_true",
                    help="only M5's neural accelerators: our kernels' counts on tensor ops, and MLX's NAX kernel")
    args = ap.parse_args(argv)
    if args.csv and not args.anchors:
        ap.error("--csv needs --anchors")
    if args.accelerators:
        from . import metal_model_accel
        metal_model_accel.accelerators(args.quick)
        return
    if args.anchors:
        from . import metal_model_anchors
        metal_model_anchors.anchors(args.csv)
        return
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
    from . import metal_model_anchors
    metal_model_anchors.anchors()
    from . import metal_model_accel
    metal_model_accel.accelerators(args.quick)
    print(f"\n(wall time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
