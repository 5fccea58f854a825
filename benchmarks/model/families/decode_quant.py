"""Quantized KV caches in the Metal decode (issue 44): bytes per decode step per format, and the
bandwidth-bound time they predict on named Apple GPUs.

The quantized decode kernels (shaders/decode/attention_decode_quant.h) read each K/V code byte and each
scale once per (batch, kv head), as the native decode reads each element: the emulator's unique-byte
counts in tests/metal/test_metal_decode_quant.py (test_kv_bytes_drop_by_the_format_ratio) equal
`row_bytes` below exactly, per format. A decode step at long context is bound by those bytes, so its time
is predicted here as bytes / (nominal bandwidth x the streaming ceiling), core/gpus.py's figures: a
prediction, not a measurement (no Mac has run these kernels), and a lower bound: dispatch, the q/out
traffic and the dequantizing ALU work (a few instructions per feature per lane, not modelled here) are
left out.
"""
from ..core.gpus import GPUS, STREAM_CEILING

# (format, K/V bytes per token per kv head per side at head dim D): codes + scales.
#   float16 / bfloat16: 2 D
#   int8: D codes + one float32 scale per token
#   fp8_e4m3: D codes (the descale per (sequence, kv head) is 4 bytes per step, not per token)
#   q4 (group g, scales in s bytes): D / 2 codes + 2 (scale and bias) x (D / g) x s
FORMATS = [("float16", None, None), ("int8", None, None), ("fp8_e4m3", None, None),
           ("q4 g32 f16", 32, 2), ("q4 g64 f16", 64, 2), ("q4 g128 f16", 128, 2), ("q4 g64 f32", 64, 4)]


def row_bytes(fmt: str, D: int, group=None, scale_bytes=None) -> int:
    """K (or V) bytes per token per kv head in `fmt` at head dim D."""
    if fmt in ("float16", "bfloat16"):
        return 2 * D
    if fmt == "int8":
        return D + 4
    if fmt == "fp8_e4m3":
        return D
    return D // 2 + 2 * (D // group) * scale_bytes


def step_bytes(fmt, D, kv_heads, layers, context, group=None, scale_bytes=None) -> int:
    """K and V bytes one decode step reads over all layers (one sequence)."""
    return 2 * layers * kv_heads * context * row_bytes(fmt, D, group, scale_bytes)


# Llama-3-8B-like (32 layers, 8 kv heads, D = 128) at 32k tokens of context, one sequence.
SHAPE = dict(D=128, kv_heads=8, layers=32, context=32768)
CHIPS = ("M3", "M3 Max", "M4 Pro", "M5 (10-core)")


def report(chips=CHIPS, shape=SHAPE):
    gpus = {g.name: g for g in GPUS}
    base = step_bytes("float16", **shape)
    print(f"K/V bytes per decode step, {shape['layers']} layers x {shape['kv_heads']} kv heads x D = "
          f"{shape['D']} at {shape['context']} tokens (one sequence); time = bytes / (bandwidth x streaming "
          f"ceiling {STREAM_CEILING[0]:.2f}-{STREAM_CEILING[2]:.2f}): a bandwidth-bound prediction, not a "
          f"measurement")
    head = f"{'format':<14}{'MB/step':>9}{'vs f16':>8}" + "".join(f"{c + ' ms':>20}" for c in chips)
    print(head)
    for fmt, g, s in FORMATS:
        name = fmt.split()[0]
        b = step_bytes(name, **shape, group=g, scale_bytes=s)
        cells = []
        for c in chips:
            bw = gpus[c].bandwidth_gbs * 1e9
            lo, hi = b / (bw * STREAM_CEILING[2]) * 1e3, b / (bw * STREAM_CEILING[0]) * 1e3
            cells.append(f"{lo:8.2f}-{hi:<8.2f}   ")
        print(f"{fmt:<14}{b / 1e6:9.1f}{base / b:7.2f}x" + "".join(f"{x:>20}" for x in cells))
