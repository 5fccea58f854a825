"""Anchors of the Metal performance model (issue 19): published timings of
other programs, and the hand counts that place them against this model's
predictions. Nothing here ran on a GPU; the measured figures are MLX's and
the post's. The report: families/anchors.py,

    python -m benchmarks.model anchors [--csv PATH]

1. MLX's steel attention (PR #1610, M3 Max; PR #4330, M3 Ultra). Its counts
   are hand-counted below from its source (steel_attention.h: BQ = 32,
   BK = 32 for D <= 96, 4 SIMD-groups of 8 rows, the Q tile loaded once, K
   and V through one shared tile, both products on 8x8 fragments read back
   from threadgroup memory per key block), and tests/model/test_metal_model_anchors.py
   checks that they equal the prefill kernel's emulator counts field by field.
   So this model, fed the prefill kernel's counts, predicts MLX's kernel; the
   claim is +-15 % where MLX runs at high occupancy (in_regime). N = 256 is
   outside: 256 threadgroups on 40 cores are under two waves, and MLX
   measured 0.103 ms there, slower than the model.
   The M3 MMA rate is INFERRED (gpus.MMA_RATE), with MLX's N = 4096
   timing as a lower bound on it; so N = 4096 is not independent evidence,
   N = 512-2048 and the M3 Ultra anchor are.
2. MLX's accelerator attention (PR #3943, M5 Max, float16, D = 96), hand-
   counted below (nax_counts): it anchors the tensor-op rate, +-25 %.
3. The post's untiled and tiled kernels (Apple M5, float32, N = 2048, d = 64,
   causal). A comparison between DIFFERENT PROGRAMS: the post's code as
   printed reads Q inside the key loop and divides by sqrt(D) per key; the
   emulated kernels read Q once and scale once. The band is 2x.
4. MLX's decode (issue #4076, M5 Pro): DECODE_ANCHORS, the decode model's
   calibration and validation points (families/decode.py).
"""
from typing import NamedTuple

import torch

from . import counts as M
from . import gpus as G
from . import iomodel as IO
from . import timing as T


class Anchor(NamedTuple):
    name: str
    gpu: str
    shape: M.Shape
    dtype: torch.dtype
    causal: bool
    impl: str
    measured_ms: float
    in_regime: bool   # inside the regime the model claims (high occupancy, MMA kernels)
    tolerance: float  # the claimed band around the point prediction, as a ratio
    role: str = "validation"  # "calibration": it set a constant (DERIVATIONS names it); "validation": it set nothing


MLX_TOL = 0.15  # issue 19: +-15 % where MLX runs at high occupancy
NAX_TOL = 0.25  # issue 21: MLX's accelerator attention within +-25 %
POST_TOL = 1.0  # within 2x: the post's kernels are other programs (see the docstring)

ANCHORS = [
    Anchor("mlx-1610-n256", "M3 Max", M.Shape(1, 32, 32, 256, 256, 64), torch.float16, False, "prefill", 0.103, False,
           MLX_TOL, "calibration"),
    Anchor("mlx-1610-n512", "M3 Max", M.Shape(1, 32, 32, 512, 512, 64), torch.float16, False, "prefill", 0.241, True,
           MLX_TOL),
    Anchor("mlx-1610-n1024", "M3 Max", M.Shape(1, 32, 32, 1024, 1024, 64), torch.float16, False, "prefill", 0.784,
           True, MLX_TOL),
    Anchor("mlx-1610-n2048", "M3 Max", M.Shape(1, 32, 32, 2048, 2048, 64), torch.float16, False, "prefill", 2.98, True,
           MLX_TOL),
    Anchor("mlx-1610-n4096", "M3 Max", M.Shape(1, 32, 32, 4096, 4096, 64), torch.float16, False, "prefill", 11.71,
           True, MLX_TOL, "calibration"),
    Anchor("mlx-4330-d72", "M3 Ultra", M.Shape(1, 16, 16, 8192, 8192, 72), torch.bfloat16, False, "prefill", 14.30,
           True, MLX_TOL),
    Anchor("mlx-nax-m5-max", "M5 Max", M.Shape(1, 32, 8, 4096, 4096, 96), torch.float16, False, "mlx-nax", 4.127,
           True, NAX_TOL, "calibration"),
    # MLX, M3 Max, (1, 24, 8192, 128) float16: 75.2 ms (the notes' "75 ms" row; issue 43). Set nothing.
    Anchor("mlx-m3max-d128", "M3 Max", M.Shape(1, 24, 24, 8192, 8192, 128), torch.float16, False, "prefill", 75.2,
           True, MLX_TOL),
    Anchor("post-untiled", G.POST_GPU, M.Shape(1, 1, 1, 2048, 2048, 64), torch.float32, True, "untiled", 3.066, False,
           POST_TOL),
    Anchor("post-tiled", G.POST_GPU, M.Shape(1, 1, 1, 2048, 2048, 64), torch.float32, True, "tiled", 2.159, False,
           POST_TOL),
]
CSV_COLUMNS = ["anchor", "gpu", "shape", "measured_ms", "predicted_low_ms", "predicted_ms", "predicted_high_ms",
               "ratio", "in_regime", "role"]

# How each constant was derived from anchors (a validation anchor's value may appear in none of them:
# tests/model/test_metal_model_anchors.py). gpus.MMA_RATE[3] (M3 and later): its low end, 105 FFMAs per
# core-cycle, is MLX's N = 4096 timing's lower bound (11.73e12 / (40 x 1.398e9 x 2)); the tensor-op
# softmax rule (additive, timing.py "overlap" at the point) was chosen on the NAX row.
# PER_CALL_FLOOR: per_call_floor() below, on the two calibration rows of MLX #1610.
PREFILL_DERIVATIONS = {
    "MMA_RATE[3..5] low end": {"anchors": ["mlx-1610-n4096"], "inputs": [11.71]},
    "tensor-op softmax rule": {"anchors": ["mlx-nax-m5-max"], "inputs": [4.127]},
}


def per_call_floor():
    """MLX's steel attention on the M3 Max as a per-call floor plus FLOPs at one rate (issue 43's fit,
    replacing the whole-wave rule and the 5 us dispatch for these rows), fitted EXACTLY on the two
    calibration rows (N = 256 and 4096; no validation row enters it): (floor seconds, FLOPs per second).
    Recorded in PREFILL_DERIVATIONS."""
    cal = [a for a in ANCHORS if a.role == "calibration" and a.name.startswith("mlx-1610")]
    (a0, a1) = sorted(cal, key=lambda a: a.shape.nq)
    f0, f1 = (IO.useful_flops(a.shape, a.causal) for a in (a0, a1))
    rate = (f1 - f0) / ((a1.measured_ms - a0.measured_ms) * 1e-3)
    floor = a0.measured_ms * 1e-3 - f0 / rate
    PREFILL_DERIVATIONS["PER_CALL_FLOOR"] = {"anchors": [a0.name, a1.name], "inputs": [a0.measured_ms, a1.measured_ms],
                                             "value": (floor, rate)}
    return floor, rate


def floor_applies(a):
    """Rows the per-call floor prices: MLX's steel attention on the chip it was fitted on (M3 Max, prefill)."""
    return a.impl == "prefill" and a.gpu == "M3 Max" and a.name.startswith("mlx")


def steel_counts(s: M.Shape, elem: int, bq=32, bk=32, wm=4):
    """MLX steel attention's counts, by hand from its source, for a
    non-causal problem with Nq a multiple of bq, Nk of bk and D of 8, in the
    emulator's units (MMAs once per SIMD-group per call, exp2 per thread per
    element, barriers once per threadgroup, threadgroup and device bytes as
    each lane asks for them). Per threadgroup (bq query rows of one head):
    - Q: bq x D elements to threadgroup memory once; K and V blocks of
      bk x D each, once per key block (one shared tile).
    - per key block and SIMD-group (8 rows): S = Q K^T is (D/8) x (bk/8)
      MMAs, reading D/8 Q fragments and (D/8)(bk/8) K fragments; O += P V is
      (bk/8) x (D/8) MMAs reading (bk/8)(D/8) V fragments (64 elements each).
    - exp2: each lane holds one row's 2 columns of each of the bk/8 score
      fragments, bk/4 exp2(S - max), plus 1 for the row's rescale factor.
    - barriers: 4 per key block (before and after the K load, before and
      after the V load). MLX adds 2 per threadgroup (before the Q load, after
      the loop; `barriers_outside_loop`), which the prefill kernel does not have.
    - device: Q read and O written once; K and V once per query block."""
    if s.nq % bq or s.nk % bk or s.d % 8:
        raise ValueError(f"hand count needs Nq % {bq} == Nk % {bk} == D % 8 == 0; got {s}")
    tgs = s.b * s.hq * (s.nq // bq)
    blocks = tgs * (s.nk // bk)
    df, kf = s.d // 8, bk // 8
    frag_bytes = 64 * elem
    return {
        "threadgroups": tgs,
        "threads": tgs * 32 * wm,
        "simdgroup_mmas": blocks * wm * 2 * df * kf,
        "exp2_calls": blocks * wm * 32 * (bk // 4 + 1),
        "threadgroup_barriers": blocks * 4,
        "threadgroup_bytes_written": tgs * bq * s.d * elem + blocks * 2 * bk * s.d * elem,
        "threadgroup_bytes_read": blocks * wm * (df + 2 * df * kf) * frag_bytes,
        "read_q": s.b * s.hq * s.nq * s.d * elem,
        "read_k": blocks * bk * s.d * elem,
        "read_v": blocks * bk * s.d * elem,
        "write_out": s.b * s.hq * s.nq * s.d * elem,
    }


def nax_counts(s: M.Shape, elem: int, bq=64, bk=32, wm=4):
    """MLX's accelerator attention's counts, by hand from its source, for a
    non-causal problem with Nq % bq == Nk % bk == 0 and D % 32 == 0, in the
    emulator's units. Per threadgroup (bq query rows of one head, wm
    SIMD-groups of 16 rows each, no threadgroup memory):
    - each SIMD-group loads its Q rows once, and every K and V block of
      bk x D itself, straight from device memory into its fragments: wm
      requests per byte per threadgroup (req_), one of them new to the
      threadgroup (dram_; the others meet it in the core's L1, an assumption);
    - per key block and SIMD-group: S = Q K^T (16 x bk x D) and O += P V
      (16 x D x bk) as matmul2d on execution_simdgroup: 4 * 16 * bk * D
      FLOPs (mpp_flops), no simdgroup MMAs;
    - exp2: a lane holds 8 elements of each 16 x 16 fragment of S (bk / 2
      per block) plus the rescale factors of its 2 rows;
    - no barriers (D = 128 adds one halfway through P V; not counted here).
    """
    if s.nq % bq or s.nk % bk or s.d % 32:
        raise ValueError(f"hand count needs Nq % {bq} == Nk % {bk} == D % 32 == 0; got {s}")
    tgs = s.b * s.hq * (s.nq // bq)
    blocks = tgs * (s.nk // bk)
    kv = blocks * bk * s.d * elem
    return {
        "threadgroups": tgs,
        "threads": tgs * 32 * wm,
        "simdgroup_mmas": 0,
        "mpp_flops": blocks * wm * 4 * 16 * bk * s.d,
        "exp2_calls": blocks * wm * 32 * (bk // 2 + 2),
        "threadgroup_barriers": 0,
        "threadgroup_bytes_written": 0,
        "threadgroup_bytes_read": 0,
        "read_q": s.b * s.hq * s.nq * s.d * elem,
        "read_k": wm * kv, "req_k": wm * kv, "dram_k": kv,
        "read_v": wm * kv, "req_v": wm * kv, "dram_v": kv,
        "write_out": s.b * s.hq * s.nq * s.d * elem,
    }


def nax_records(s: M.Shape, dtype, bq=64, bk=32, wm=4):
    """One synthetic dispatch with MLX's accelerator-attention counts (no plan of ours behind it)."""
    elem = torch.empty((), dtype=dtype).element_size()
    name = f"mlx_nax_attention_{M.dtype_name(dtype)}_d{s.d}_bq{bq}_bk{bk}_wm{wm}"
    return [M.Record(name, (s.nq // bq, s.hq, s.b), (32, wm, 1), 0, nax_counts(s, elem, bq, bk, wm), False)]


BARRIERS_OUTSIDE_LOOP = 2  # MLX's per-threadgroup barriers outside the key loop (steel_attention.h)


def anchor_row(a: Anchor):
    gpu = G.BY_NAME[a.gpu]
    if floor_applies(a):
        # MLX on the M3 Max: the per-call floor plus the FLOPs at the fitted rate; its band, the time model's
        # relative band (every unmeasured input: clock, MMA rate, ...) around it.
        floor, rate = per_call_floor()
        point = floor + IO.useful_flops(a.shape, a.causal) / rate
        recs = M.counts_for(a.impl, a.shape, a.dtype, a.causal)
        lo, pt, hi = T.predict_band(recs, gpu, a.shape, a.dtype, a.causal)
        low, high = point * lo / pt, point * hi / pt
    else:
        recs = nax_records(a.shape, a.dtype) if a.impl == "mlx-nax" else M.counts_for(a.impl, a.shape, a.dtype,
                                                                                        a.causal)
        low, point, high = T.predict_band(recs, gpu, a.shape, a.dtype, a.causal)
    ratio = point * 1e3 / a.measured_ms
    s = a.shape
    return {"anchor": a.name, "gpu": a.gpu,
            "shape": f"{s.b}x{s.hq}x{s.nq}x{s.d} {M.dtype_name(a.dtype)}{' causal' if a.causal else ''} {a.impl}",
            "measured_ms": a.measured_ms, "predicted_low_ms": round(low * 1e3, 4), "predicted_ms": round(point * 1e3, 4),
            "predicted_high_ms": round(high * 1e3, 4), "ratio": round(ratio, 3), "in_regime": a.in_regime,
            "role": a.role}


def in_band(row):
    """The measurement lies inside the predicted band."""
    return row["predicted_low_ms"] <= row["measured_ms"] <= row["predicted_high_ms"]


def within(row, a: Anchor):
    """The point prediction is within the anchor's band of the measurement."""
    if a.tolerance < 1:
        return abs(row["ratio"] - 1) <= a.tolerance
    return 1 / (1 + a.tolerance) <= row["ratio"] <= 1 + a.tolerance


class DecodeAnchor(NamedTuple):
    """A measured decode bandwidth (K/V bytes counted once over the time per call) and its role: "calibration"
    (it set a constant: families/decode.py DERIVATIONS names it) or "validation" (it set nothing)."""
    name: str
    gpu: str
    shape: M.Shape
    measured_gbs: float
    role: str


# MLX issue #4076, M5 Pro, float16, one query row, 8K keys, D = 128, 32 query heads: sdpa_vector_2pass at
# GQA 1 / 4 / 8, as issue 43 quotes them (281 / 264 / 190 GB/s). GQA 1 calibrates the decode's streaming
# fraction (families/decode.py calibrate); GQA 4 and 8 validate the model, its L1 term included.
DECODE_ANCHORS = [
    DecodeAnchor("mlx-4076-gqa1", "M5 Pro", M.Shape(1, 32, 32, 1, 8192, 128), 281.0, "calibration"),
    DecodeAnchor("mlx-4076-gqa4", "M5 Pro", M.Shape(1, 32, 8, 1, 8192, 128), 264.0, "validation"),
    DecodeAnchor("mlx-4076-gqa8", "M5 Pro", M.Shape(1, 32, 4, 1, 8192, 128), 190.0, "validation"),
]


# Decode against MLX's measured decode (mlx-4076, M5 Pro, float16, q_len 1, 8K context; its 8K column, which
# the emulator runs in seconds): (Hq, Hkv, D, GB/s).
MLX_DECODE = [(32, 32, 128, 282.0), (32, 8, 128, 263.0), (32, 4, 128, 184.0), (64, 8, 64, 113.0)]
