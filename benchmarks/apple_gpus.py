"""Apple GPUs for the performance model (benchmarks/metal_model.py), with a
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
    "estimate-ultra-bw": "estimate: an Ultra is two Max dies, so twice the Max's bandwidth (800 GB/s, Apple's M1/M2 "
                         "Ultra figure, not in the notes)",
}


class AppleGPU(NamedTuple):
    name: str
    cores: int
    clock_ghz: float
    bandwidth_gbs: float
    tgmem_per_core: int    # bytes of threadgroup memory one core holds for resident threadgroups
    sources: dict          # field -> source key in SOURCES


# Figures common to every chip here (all M1/A15 or later), per core per cycle.
FP32_FLOPS_PER_CORE_CYCLE = 256   # mb: "F32 OPs (FMA)" M1, A15: 128 FMA lanes x 2
FP16_FLOPS_PER_CORE_CYCLE = 256   # mb: "F16 OPs (FMA)" M1, A15: F16 is not faster than F32 on the ALU
MMA_FFMA32_PER_CORE_CYCLE = 101.7  # mb: "Matrix FFMA32" A15+/M1+, inside a matrix multiplication (~80% of 128)
MMA_FFMA16_PER_CORE_CYCLE = 102.5  # mb: "Matrix FFMA16" A15+/M1+
EXP2_PER_CORE_CYCLE = 32          # mb: "F32 Exp2" M1, A15
SCHEDULERS_PER_CORE = 4           # mb, ALU Layout: four schedulers, one instruction from one simd per cycle each
COMMON_SOURCES = {"fp32_flops": "mb", "fp16_flops": "mb", "mma_ffma32": "mb", "mma_ffma16": "mb",
                  "exp2": "mb", "schedulers": "mb", "ffma_latency_table": "mb"}

# FFMA32 cost in cycles per instruction (1.0 = full rate) by instruction-level
# parallelism and resident SIMD-groups per core: metal-benchmarks' "Tables for
# FMUL, FADD, IADD, FFMA" (FP32 column). The model interpolates between them.
FFMA32_CYCLES = {1: {4: 11.34, 8: 5.71, 88: 1.99}, 4: {4: 2.75, 8: 1.60, 88: 1.02}}

_M12_TG = 60 * 1024  # mb: "Shared Memory ~60 KB" per core, Apple 7 and 8 (M1, M2)
_M3_TG = 32 * 1024   # estimate-tgmem-m3


def _g(name, cores, ghz, bw, tg, src):
    return AppleGPU(name, cores, ghz, bw, tg, src)


GPUS = [
    _g("M1", 8, 1.278, 68.0, _M12_TG, {"cores": "mb", "clock": "mb", "bandwidth": "notes", "tgmem": "mb"}),
    _g("M1 Pro", 16, 1.296, 200.0, _M12_TG, {"cores": "mb", "clock": "mb", "bandwidth": "notes", "tgmem": "mb"}),
    _g("M1 Max", 32, 1.296, 400.0, _M12_TG, {"cores": "mb", "clock": "mb", "bandwidth": "notes", "tgmem": "mb"}),
    _g("M1 Ultra", 64, 1.296, 800.0, _M12_TG,
       {"cores": "mb", "clock": "mb", "bandwidth": "estimate-ultra-bw", "tgmem": "mb"}),
    _g("M2", 10, 1.398, 100.0, _M12_TG, {"cores": "mb", "clock": "mb", "bandwidth": "notes", "tgmem": "mb"}),
    _g("M2 Pro", 19, 1.398, 200.0, _M12_TG, {"cores": "mb", "clock": "mb", "bandwidth": "notes", "tgmem": "mb"}),
    _g("M2 Max", 38, 1.398, 400.0, _M12_TG, {"cores": "mb", "clock": "mb", "bandwidth": "notes", "tgmem": "mb"}),
    _g("M2 Ultra", 76, 1.398, 800.0, _M12_TG,
       {"cores": "mb-old", "clock": "estimate-same-clock", "bandwidth": "estimate-ultra-bw", "tgmem": "mb"}),
    # M3 Max: notes give ~14.3 TFLOPS for 40 cores -> 14.3e12 / (40 * 256) = 1.396 GHz.
    _g("M3", 10, 1.396, 100.0, _M3_TG,
       {"cores": "apple-m3", "clock": "notes", "bandwidth": "notes", "tgmem": "estimate-tgmem-m3"}),
    _g("M3 Pro", 18, 1.396, 150.0, _M3_TG,
       {"cores": "apple-m3", "clock": "notes", "bandwidth": "notes", "tgmem": "estimate-tgmem-m3"}),
    _g("M3 Max", 40, 1.396, 400.0, _M3_TG,
       {"cores": "apple-m3", "clock": "notes", "bandwidth": "notes", "tgmem": "estimate-tgmem-m3"}),
    # M4: notes give 3.58 TFLOPS for the 10-core M4 -> 1.398 GHz (hmc-tech lists 1.47-1.58 GHz: the notes' figure
    # is the conservative one). Pro and Max assumed at the same clock.
    _g("M4", 10, 1.398, 120.0, _M3_TG,
       {"cores": "apple-m4-base", "clock": "notes", "bandwidth": "notes", "tgmem": "estimate-tgmem-m3"}),
    _g("M4 Pro", 20, 1.398, 273.0, _M3_TG,
       {"cores": "apple-m4", "clock": "estimate-same-clock", "bandwidth": "notes", "tgmem": "estimate-tgmem-m3"}),
    _g("M4 Max", 40, 1.398, 546.0, _M3_TG,
       {"cores": "apple-m4", "clock": "estimate-same-clock", "bandwidth": "notes", "tgmem": "estimate-tgmem-m3"}),
    # The post's machine.
    _g("M5 (10-core)", 10, 1.578, 153.0, _M3_TG,
       {"cores": "apple-m5", "clock": "stinkerings-m5", "bandwidth": "apple-m5", "tgmem": "estimate-tgmem-m3"}),
]
BY_NAME = {g.name: g for g in GPUS}
POST_GPU = "M5 (10-core)"
