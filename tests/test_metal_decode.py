"""The decode (Nq <= 8) Metal kernels: one pass, and the split-KV pair.

Every instantiation of shaders/attention_decode.metal runs through the
emulator's sanitizing build (races, barrier and SIMD divergence,
out-of-bounds, threadgroup overflow) on small ragged shapes: Nq 1..8, Nk from
1 to past one split block, causal on and off, GQA ratios 1, 4, 8 and MQA,
every layout of numerics.LAYOUTS, rows with no visible key, and split blocks
that lie past the end of the keys or wholly in a row's future. Results are
compared with the float64 oracle by FlashAttention's 2x rule
(tests/numerics.py). The fast build runs fast math with -inf keys and the
strict precision check at Nk = 8192 in float32.
"""
import functools
import math
import os
import struct

import pytest
import torch

import flash_metal
from numerics import DTYPES, LAYOUTS, assert_attention_close, dtype_id, make_qkv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHADER = os.path.join(ROOT, "shaders", "attention_decode.metal")
BUCKETS = [32, 64, 72, 80, 96, 128, 256]
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# Metal's limits on every Apple GPU family: threads and threadgroup memory per threadgroup.
MAX_THREADS = 1024
TG_LIMIT = 32 * 1024
# Keys per block of the kernels' softmax, and the granularity of split_keys.
BLOCK = 32
# shaders/attention_common.h: the finite sentinel a masked score becomes.
MASKED_SCORE = -(2.0**100)
# Offset of (kv_splits, split_keys) in the 200-byte AttentionParams (shaders/params.h).
SPLIT_FIELDS_OFFSET = 192


def bucket_of(d):
    """The smallest instantiated head_dim bucket that holds d."""
    return min(b for b in BUCKETS if b >= d)


def kernel_names(dtype, dmax):
    """(one pass, split pass 1, merge) host names."""
    t = DTYPE_NAMES[dtype]
    return f"flash_decode_{t}_d{dmax}", f"flash_decode_split_{t}_d{dmax}", f"flash_decode_merge_{t}_d{dmax}"


def rows_per_simd(dmax):
    return 8 if dmax <= 64 else (4 if dmax <= 128 else 2)


def decode_launch(B, Hq, Hkv, Nq, dmax, splits):
    """The launch formulas at the top of shaders/attention_decode.h.

    Returns {kernel: (grid, threadgroup, threadgroup memory bytes)} for
    "one_pass", "split" and "merge" (merge: no threadgroup memory).
    """
    rs = rows_per_simd(dmax)
    rg = math.ceil(Hq // Hkv * Nq / rs)
    rgl = min(rg, 32)
    kg = 8 // rg if rg <= 4 else 1
    dp32 = 32 * math.ceil(dmax / 32)
    mem = 16 * math.ceil(rgl * kg * (rs + 1 + dp32) * 4 / 16) if kg > 1 else 16
    tg = (32, kg, rgl)
    return {"one_pass": ((Hkv, B, 1), tg, mem), "split": ((Hkv, B, splits), tg, mem), "merge": ((Nq, Hq, B), (32, 1, 1), 0)}


def split_keys_of(nk, splits):
    """Keys per split block: ceil(Nk / splits) rounded up to a multiple of 32."""
    return BLOCK * math.ceil(math.ceil(nk / splits) / BLOCK)


@functools.lru_cache(maxsize=None)
def decode_library(instrumented, fast_math):
    from metal_emulator import compile_library

    return compile_library([SHADER], instrumented=instrumented, fast_math=fast_math)


def launch_decode(q, k, v, causal=False, scale=None, splits=1, instrumented=False, fast_math=False):
    """Launches the kernels directly; returns (out, lse, partial_o, partial_stats, counts).

    Outputs and partials are poisoned with NaN, so an element never written
    stays NaN. splits == 1: the one-pass kernel (no partials); else the split
    pass and the merge. counts: the emulator's per-dispatch counts.
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    dmax = bucket_of(D)
    one, split, merge = kernel_names(q.dtype, dmax)
    raw = bytearray(flash_metal.explain(q, k, v, causal, scale, impl="tiled").params.numpy().tobytes())
    assert len(raw) == 200
    struct.pack_into("<2i", raw, SPLIT_FIELDS_OFFSET, splits, split_keys_of(Nk, splits) if splits > 1 else Nk)
    params = torch.frombuffer(raw, dtype=torch.uint8)
    out = torch.full((B, Hq, Nq, D), float("nan"), dtype=q.dtype)
    lse = torch.full((B, Hq, Nq), float("nan"), dtype=torch.float32)
    lib = decode_library(instrumented, fast_math)
    shape = decode_launch(B, Hq, Hkv, Nq, dmax, splits)
    counts = []
    if splits == 1:
        grid, tg, mem = shape["one_pass"]
        counts.append(lib.dispatch(one, buffers={0: q, 1: k, 2: v, 3: out, 4: lse}, bytes={5: params},
                                   function_constants={0: causal}, grid=grid, threadgroup=tg,
                                   threadgroup_memory={0: mem}))
        return out, lse, None, None, counts
    part_o = torch.full((B, Hq, Nq, splits, D), float("nan"), dtype=torch.float32)
    part_s = torch.full((B, Hq, Nq, splits, 2), float("nan"), dtype=torch.float32)
    grid, tg, mem = shape["split"]
    counts.append(lib.dispatch(split, buffers={0: q, 1: k, 2: v, 6: part_o, 7: part_s}, bytes={5: params},
                               function_constants={0: causal}, grid=grid, threadgroup=tg,
                               threadgroup_memory={0: mem}))
    grid, tg, _ = shape["merge"]
    counts.append(lib.dispatch(merge, buffers={3: out, 4: lse, 6: part_o, 7: part_s}, bytes={5: params},
                               grid=grid, threadgroup=tg))
    return out, lse, part_o, part_s, counts


def run_decode(q, k, v, causal=False, scale=None, splits=1, instrumented=False, fast_math=False):
    """(out, lse) of the decode kernels, launched as the planner will launch them.

    splits == 1 runs the one-pass kernel, splits > 1 the split pass and the
    merge. (Until the planner routes decode shapes, this launches the
    kernels directly; the tests below depend only on this signature.)
    """
    out, lse, _, _, _ = launch_decode(q, k, v, causal, scale, splits, instrumented, fast_math)
    return out, lse


# ---- the instantiations and their launch shapes ----------------------------------------

def test_library_holds_exactly_the_instantiations():
    names = set(decode_library(False, False).kernel_names())
    assert names == {n for dt in DTYPES for b in BUCKETS for n in kernel_names(dt, b)}


@pytest.mark.parametrize("dmax", BUCKETS)
def test_launch_fits_metal_limits(dmax):
    # Every GQA group up to ratio 32 with Nq up to 8: at most 1024 threads,
    # whole SIMD-groups, threadgroup memory within 32 KiB and a multiple of 16.
    for ratio in range(1, 33):
        for nq in range(1, 9):
            for name, (grid, tg, mem) in decode_launch(2, 4 * ratio, 4, nq, dmax, 3).items():
                assert tg[0] == 32 and tg[0] * tg[1] * tg[2] <= MAX_THREADS, (ratio, nq, name, tg)
                assert mem <= TG_LIMIT and mem % 16 == 0, (ratio, nq, name, mem)


def test_one_key_read_per_group_up_to_the_row_limit():
    # With every row of the GQA group in one row group per key group (R <=
    # rows_per_simd), each K/V element is loaded exactly once per (batch,
    # kv_head): the sanitizing build's device read counts for k and v are
    # exactly their sizes, one pass or split.
    for dtype, d, ratio, nq, splits in [(torch.float16, 128, 4, 1, 1), (torch.float32, 64, 8, 1, 3),
                                        (torch.bfloat16, 40, 2, 4, 2)]:
        assert ratio * nq <= rows_per_simd(bucket_of(d))
        q, k, v = make_qkv(2, 2 * ratio, 2, nq, 200, d, dtype)
        out, lse, _, _, counts = launch_decode(q, k, v, splits=splits, instrumented=True)
        assert_attention_close(out, lse, q, k, v)
        read = counts[0].device_bytes_read_by_index
        assert read[1] == k.numel() * k.element_size() and read[2] == v.numel() * v.element_size(), read
