"""Apple GPUs for the Metal performance model (benchmarks/model), with a
source for every figure.

Source keys (SOURCES below says what each is). A figure whose key starts
with "estimate" is not published anywhere we could read; the key says how it
was derived. Clocks not published by Apple are derived as
peak FP32 FLOPS / (cores x 256 FLOPs per core-cycle), the per-core rate
metal-benchmarks gives for M1/A15 and later.
"""
from typing import NamedTuple

SOURCES = {
    "mb": "philipturner/metal-benchmarks README @dc2adc6: GPU table (GHz, cores, GOPS32), 'Per Core-Cycle' tables "
          "(256 F32/F16 FLOPs, 32 exp2, Matrix FFMA32 101.7 / FFMA16 102.5), On-Chip Memory (~60 KB shared memory "
          "per core, Apple 7/8), FFMA latency tables by occupancy",
    "mb-old": "philipturner/metal-benchmarks README @007b009 (older revision): M2 Ultra 76 cores, >= 27200 GFLOPS F32",
    "notes": "/work/shared/notes/fast-kernels.md 'Apple GPU numbers for a performance model' (peak FP32 TFLOPS and "
             "bandwidth per chip; threadgroup memory report: ~23-24 KB threadgroups run one per core on M3-class "
             "chips, <= ~15 KB two)",
    "apple-m5": "Apple's M5 announcement (Oct 2025), as reported by tomshardware.com and fonearena.com: 10-core GPU, "
                "153 GB/s unified memory bandwidth",
    "stinkerings-m5": "michaelstinkerings.org 'Apple M5 GPU Roofline Analysis' (via reddit r/mctk): measured FP32 "
                      "3760 GFLOPS = 94.4% of peak at 1578 MHz, 122 GB/s measured bandwidth (79% of nominal). "
                      "(hmc-tech.com lists 1740 MHz for the 10-core M5: a second, unmeasured figure)",
    "apple-m4": "Apple's M4 Pro / M4 Max announcements (Oct 2024, via techmoran.com, macmegasite.com): M4 Pro up to "
                "20-core GPU, M4 Max up to 40-core GPU",
    "apple-m3": "M3 Max 40-core GPU: macmegasite.com's M4 Max announcement (compares with the M3 Max); M3 10-core and "
                "M3 Pro 18-core: Apple's M3 specifications, not re-read for this table",
    "apple-m4-base": "howtogeek.com on Apple's M4 family announcement: the M4 GPU 'is still a 10-core design'",
    "estimate-same-clock": "estimate: same GPU clock as the family's chip with a published figure (Apple uses one "
                           "GPU clock per generation in the metal-benchmarks table: 1.296 GHz for M1 Pro/Max/Ultra, "
                           "1.398 GHz for M2/M2 Pro/M2 Max)",
    "estimate-tgmem-m3": "estimate: 32 KiB of threadgroup memory per core for Apple 9 and later (Dynamic Caching, no "
                         "fixed size published); the smallest budget consistent with the notes' report that "
                         "~15-16 KB threadgroups run two per core and ~23-24 KB one",
    "apple-ultra-bw": "Apple's published Ultra bandwidth: M1 Ultra and M2 Ultra 800 GB/s (as quoted by wccftech.com / "
                      "tinydeals.net on the M4 Max launch), M3 Ultra 819 GB/s (Apple's Mac Studio 2025 specifications)",
    "apple-m3-ultra": "Apple's Mac Studio (2025) specifications: M3 Ultra up to an 80-core GPU; the chip MLX PR #4330 "
                      "measured is assumed to be the 80-core one (the PR does not say)",
    "hmc-m4max": "hmc-tech.com '32-Core M4 Max vs 40-Core M3 Max': M4 Max GPU 1678 MHz, M3 Max 1398 MHz",
    "apple-m5-pro": "Apple's M5 Pro / M5 Max announcement (Mar 2026, via lowyat.net, traitcraft.com): M5 Pro up to a "
                    "20-core GPU, 307 GB/s",
    "mlx-1610": "MLX PR #1610 (steel attention): M3 Max, float16, 1x32xNx64, printed seconds per 320 calls: N = 256 "
                "0.103 ms, 512 0.241, 1024 0.784, 2048 2.98, 4096 11.71 ms per call",
    "mlx-4330": "MLX PR #4330: M3 Ultra, bfloat16, 1x16x8192x72, fused 14.30 ms per call",
    "mfa-m3": "philipturner/metal-flash-attention README: forward ALU utilization 91-94% on M3 at D = 64-128 (86% on M1)",
    "mlx-3837": "MLX issue #3837: an M1 Ultra sustains ~680 GB/s on a plain reduction over a large array (0.85 of 800)",
    "mlx-4076": "MLX issue #4076: M5 Pro, float16 decode (q_len 1, K/V bytes counted once): 239-282 GB/s at GQA 1, "
                "234-264 at GQA 4, 130-190 at GQA 8 D=128, 76-119 at GQA 8 D=64; a dense fp16 qmv streams at 266 GB/s "
                "(0.87 of 307)",
    "estimate-clock-band": "estimate: the band between the conservative clock (derived from a published FP32 peak) and "
                           "hmc-tech.com's listed clock for the same generation (M5 1.578-1.740 GHz, M4 1.398-1.678)",
    "estimate-dispatch": "estimate: no published figure; 5 us per dispatch encoded into an open compute encoder (a few "
                         "microseconds is what MLX and PyTorch MPS profiles show for small kernels); band 2-10 us",
    "estimate-dram-latency": "estimate: ~300 ns DRAM load latency on Apple GPUs (the figure issue 19 gives; no Apple "
                             "source), band 250-400 ns",
    "apple-m5-max": "Apple's M5 Pro / M5 Max announcement (Mar 2026) as listed by notebookcheck.net ('Apple M5 Max "
                    "40-Core GPU'): 40 GPU cores, each with a neural accelerator, 614 GB/s",
    "apple-metal4-ml": "Apple's 'Running inline ML operations in a shader with Metal 4' and WWDC26 session 330: on "
                       "MTLGPUFamily.apple10 (M5) each GPU core has a neural accelerator that tensor ops use",
    "tzakharko-nax": "tzakharko.github.io apple-neural-accelerators-benchmark: A19 (5 GPU cores) fp16 matrix "
                     "7.5 TFLOPS; the author's estimate: 1024 fp16 FLOPs per core per clock",
    "mtlattn-m5pro": "lastowl/mtlattn PERFORMANCE.md: a matmul2d microbenchmark (M = N = K = 64, 4 SIMD-groups) on a "
                     "20-core M5 Pro: 32.3 TFLOPS half/bfloat16 -> float (= 1023 FLOPs per core-cycle at 1.578 GHz, "
                     "928 at 1.740)",
    "rigel-m4": "Rigel (arXiv 2606.12765): on an M4 Max, matmul2d runs on the shader cores (no accelerator) and "
                "accumulates in at least float32",
    "mlx-3943": "MLX PR #3943 (quoted in aosama/astronomical#156): accelerator attention (steel_attention_nax), M5 "
                "Max, float16, B = 1, 32 query / 8 KV heads, L = 4096, D = 96, no mask: 4.127 ms per call",
    "estimate-accel-overlap": "estimate: whether a core's neural accelerator and its ALUs (the softmax) work at the "
                              "same time is not published; the point adds their times (the softmax of a block "
                              "waits on its product, the next product on the softmax), the fast end overlaps them",
    "estimate-gpu-latencies": "estimate, no Apple source: 36 cycles for one 8x8 float32 simdgroup MMA to feed the next "
                              "(issue 19's figure), 24 for a threadgroup load, 16 per SIMD shuffle and per exp2 result, "
                              "40 per threadgroup barrier",
}




class AppleGPU(NamedTuple):
    name: str
    cores: int
    clock_ghz: float
    bandwidth_gbs: float
    tgmem_per_core: int    # bytes of threadgroup memory one core holds for resident threadgroups
    sources: dict          # field -> source key in SOURCES
    key: str = None        # the planner's spelling (explain(gpu=key)); None: not in csrc/metal/gpus.cpp
    clock_band: tuple = None  # (low, high) GHz; None: the point figure only
    generation: int = 1    # M-generation (1..5): picks the MMA rate


# Figures common to every chip here (all M1/A15 or later), per core per cycle.
FP32_FLOPS_PER_CORE_CYCLE = 256   # mb: "F32 OPs (FMA)" M1, A15: 128 FMA lanes x 2
FP16_FLOPS_PER_CORE_CYCLE = 256   # mb: "F16 OPs (FMA)" M1, A15: F16 is not faster than F32 on the ALU
MMA_FFMA32_PER_CORE_CYCLE = 101.7  # mb: "Matrix FFMA32" A15+/M1+, inside a matrix multiplication (~80% of 128)
MMA_FFMA16_PER_CORE_CYCLE = 102.5  # mb: "Matrix FFMA16" A15+/M1+
EXP2_PER_CORE_CYCLE = 32          # mb: "F32 Exp2" M1, A15
SCHEDULERS_PER_CORE = 4           # mb, ALU Layout: four schedulers, one instruction from one simd per cycle each
COMMON_SOURCES = {"fp32_flops": "mb", "fp16_flops": "mb", "mma_ffma32": "mb", "mma_ffma16": "mb",
                  "exp2": "mb", "schedulers": "mb", "ffma_latency_table": "mb", "mma_rate_m3": "mfa-m3",
                  "mma_rate_m3_check": "mlx-1610", "stream_ceiling": "stinkerings-m5", "stream_ceiling_hi": "mlx-4076",
                  "stream_ceiling_ultra": "mlx-3837", "dispatch": "estimate-dispatch",
                  "dram_latency": "estimate-dram-latency", "latencies": "estimate-gpu-latencies",
                  "accelerator": "apple-metal4-ml", "accel_rate": "tzakharko-nax", "accel_rate_low": "mtlattn-m5pro",
                  "tensor_ops_pre_m5": "rigel-m4", "accel_anchor": "mlx-3943", "accel_overlap": "estimate-accel-overlap"}

# simdgroup-matrix FFMAs per core-cycle inside a GEMM, (low, point, high), by
# M-generation. M1/M2 (Apple 7/8): measured, metal-benchmarks' 101.7 (f32) /
# 102.5 (f16), the band +-5 % around it. M3 and later (Apple 9+): inferred,
# not measured: metal-flash-attention measures 91-94 % ALU utilization for its
# forward on M3 (117-120 of 128), and MLX's own N = 4096 timing (mlx-1610)
# needs at least 11.73e12 / (40 x 1.398e9 x 2) = 105 from the attention
# products alone; the point is 90 % of 128. M5's neural accelerators (Metal 4
# tensor ops) are a separate unit this model does not describe.
MMA_RATE = {1: (96.6, 102.5, 107.6), 2: (96.6, 102.5, 107.6), 3: (105.0, 115.2, 120.3),
            4: (105.0, 115.2, 120.3), 5: (105.0, 115.2, 120.3)}

# Tensor-op (Metal 4 matmul2d) FLOPs per core-cycle, 16-bit operands and a
# float accumulator, (low, point, high), by M-generation. M5 (Apple 10) has a
# neural accelerator in every core (apple-metal4-ml): 1024 is the estimate of
# tzakharko-nax from an A19's measured rate; mtlattn-m5pro's microbenchmark
# gives 1023 at the M5's measured clock and 928 at its listed one, the low
# end. Nothing suggests more, so the high end is the point. No Apple figure.
# float32 with relaxed precision (TF32-style, MLX's default for float32 on
# the accelerators) is ASSUMED to run at the same rate: nobody has published
# it. Earlier generations have no accelerator: matmul2d runs on the shader
# cores (rigel-m4), at the simdgroup-matrix rate (2 FLOPs per FFMA).
ACCEL_FLOPS_PER_CORE_CYCLE = {5: (928.0, 1024.0, 1024.0)}


def tensor_op_rate(generation):
    """(low, point, high) matmul2d FLOPs per core-cycle on this M-generation."""
    if generation in ACCEL_FLOPS_PER_CORE_CYCLE:
        return ACCEL_FLOPS_PER_CORE_CYCLE[generation]
    return tuple(2 * r for r in MMA_RATE[generation])


# FFMA32 cost in cycles per instruction (1.0 = full rate) by instruction-level
# parallelism and resident SIMD-groups per core: metal-benchmarks' "Tables for
# FMUL, FADD, IADD, FFMA" (FP32 column). timing.ffma_cycles
# interpolates it (log of the SIMD-group count) for the post's scalar loops.
FFMA32_CYCLES = {1: {4: 11.34, 8: 5.71, 88: 1.99}, 4: {4: 2.75, 8: 1.60, 88: 1.02}}

# Streaming ceiling: the fraction of nominal bandwidth a plain streaming read
# reaches, measured: 0.79 on the M5 (stinkerings-m5, 122 of 153 GB/s), 0.85 on
# an M1 Ultra (mlx-3837, 680 of 800), 0.87 on an M5 Pro (mlx-4076, 266 of 307).
STREAM_CEILING = (0.79, 0.83, 0.87)
DRAM_LATENCY_NS = (250.0, 300.0, 400.0)  # estimate-dram-latency
DISPATCH_OVERHEAD_S = (2e-6, 5e-6, 10e-6)  # estimate-dispatch

_M12_TG = 60 * 1024  # mb: "Shared Memory ~60 KB" per core, Apple 7 and 8 (M1, M2)
_M3_TG = 32 * 1024   # estimate-tgmem-m3
_SRC12 = {"cores": "mb", "clock": "mb", "bandwidth": "notes", "tgmem": "mb"}
_SRC3 = {"cores": "apple-m3", "clock": "hmc-m4max", "bandwidth": "notes", "tgmem": "estimate-tgmem-m3"}
_SRC4 = {"cores": "apple-m4", "clock": "hmc-m4max", "bandwidth": "notes", "tgmem": "estimate-tgmem-m3"}


def _g(name, cores, ghz, bw, tg, src, key, gen, band=None):
    return AppleGPU(name, cores, ghz, bw, tg, src, key, band, gen)


GPUS = [
    _g("M1", 8, 1.278, 68.0, _M12_TG, _SRC12, "m1", 1),
    _g("M1 Pro", 16, 1.296, 200.0, _M12_TG, _SRC12, "m1-pro", 1),
    _g("M1 Max", 32, 1.296, 400.0, _M12_TG, _SRC12, "m1-max", 1),
    _g("M1 Ultra", 64, 1.296, 800.0, _M12_TG, dict(_SRC12, bandwidth="apple-ultra-bw"), "m1-ultra", 1),
    _g("M2", 10, 1.398, 100.0, _M12_TG, _SRC12, "m2", 2),
    _g("M2 Pro", 19, 1.398, 200.0, _M12_TG, _SRC12, "m2-pro", 2),
    _g("M2 Max", 38, 1.398, 400.0, _M12_TG, _SRC12, "m2-max", 2),
    _g("M2 Ultra", 76, 1.398, 800.0, _M12_TG,
       {"cores": "mb-old", "clock": "estimate-same-clock", "bandwidth": "apple-ultra-bw", "tgmem": "mb"}, "m2-ultra", 2),
    # M3 family: hmc-tech lists 1398 MHz for the M3 Max (= the notes' 14.3 TFLOPS / (40 x 256)); one clock per
    # generation assumed for M3 and M3 Pro.
    _g("M3", 10, 1.398, 100.0, _M3_TG, dict(_SRC3, clock="estimate-same-clock"), "m3", 3),
    _g("M3 Pro", 18, 1.398, 150.0, _M3_TG, dict(_SRC3, clock="estimate-same-clock"), "m3-pro", 3),
    _g("M3 Max", 40, 1.398, 400.0, _M3_TG, _SRC3, "m3-max", 3),
    _g("M3 Ultra", 80, 1.398, 819.0, _M3_TG,
       {"cores": "apple-m3-ultra", "clock": "estimate-same-clock", "bandwidth": "apple-ultra-bw",
        "tgmem": "estimate-tgmem-m3"}, "m3-ultra", 3),
    # M4: 1.678 GHz for the M4 Max (hmc-m4max); the 10-core M4's conservative 1.398 (the notes' 3.58 TFLOPS /
    # (10 x 256)) up to 1.678 is its band. Pro at the Max's clock (one GPU clock per generation).
    _g("M4", 10, 1.398, 120.0, _M3_TG, dict(_SRC4, cores="apple-m4-base", clock="estimate-clock-band"), "m4", 4,
       (1.398, 1.678)),
    _g("M4 Pro", 20, 1.678, 273.0, _M3_TG, dict(_SRC4, clock="estimate-same-clock"), "m4-pro", 4),
    _g("M4 Max", 40, 1.678, 546.0, _M3_TG, _SRC4, "m4-max", 4),
    # The post's machine: the measured 1.578 GHz (stinkerings-m5) up to hmc-tech's listed 1.740.
    _g("M5 (10-core)", 10, 1.578, 153.0, _M3_TG,
       {"cores": "apple-m5", "clock": "stinkerings-m5", "bandwidth": "apple-m5", "tgmem": "estimate-tgmem-m3"}, "m5", 5,
       (1.578, 1.740)),
    # MLX #4076's machine. Not in the planner's table: planned as the 20-core M4 Pro (same threadgroup memory and
    # register file estimates, same core count), clocked as the M5.
    _g("M5 Pro", 20, 1.578, 307.0, _M3_TG,
       {"cores": "apple-m5-pro", "clock": "estimate-same-clock", "bandwidth": "apple-m5-pro",
        "tgmem": "estimate-tgmem-m3"}, "m4-pro", 5, (1.578, 1.740)),
    # MLX #3943's machine (the accelerator anchor). Planned as the 40-core M4 Max, clocked as the M5.
    _g("M5 Max", 40, 1.578, 614.0, _M3_TG,
       {"cores": "apple-m5-max", "clock": "estimate-same-clock", "bandwidth": "apple-m5-max",
        "tgmem": "estimate-tgmem-m3"}, "m4-max", 5, (1.578, 1.740)),
]
BY_NAME = {g.name: g for g in GPUS}
POST_GPU = "M5 (10-core)"
# Chips planned under another chip's key (their own is not in csrc/metal/gpus.cpp).
PLANNED_AS = {"M5 Pro": "M4 Pro", "M5 Max": "M4 Max"}
