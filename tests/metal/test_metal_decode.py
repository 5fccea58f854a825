"""The decode (Nq <= 8) Metal kernels: one pass, and the split-KV pair.

Every decode instantiation (shaders/decode/attention_decode.h, instantiated in
shaders/attention.metal) runs through the
emulator's sanitizing build (races, barrier and SIMD divergence,
out-of-bounds, threadgroup overflow) on small ragged shapes: Nq 1..8, Nk from
1 to past one split block, causal on and off, GQA ratios 1, 4, 8 and MQA,
every layout of numerics.LAYOUTS, rows with no visible key, and split blocks
that lie past the end of the keys or wholly in a row's future. Results are
compared with the float64 oracle by FlashAttention's 2x rule
(tests/numerics.py). The fast build runs fast math with -inf keys and the
strict precision check at Nk = 8192 in float32.
"""
import dataclasses
import math
import struct

import pytest
import torch

import flash_metal
from backends import emulated_metal_attention, metal_library
from numerics import DTYPES, LAYOUTS, assert_attention_close, dtype_id, make_qkv

BUCKETS = [32, 64, 72, 80, 96, 128, 192, 256]
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# Threads per threadgroup the decode kernels declare ([[max_total_threads_per_threadgroup]],
# kDecodeMaxThreads in shaders/common/params.h), and Metal's threadgroup memory limit.
MAX_THREADS = 256
TG_LIMIT = 32 * 1024
# Keys per block of the kernels' softmax, and the granularity of split_keys.
BLOCK = 32
# shaders/common/attention_common.h: the finite sentinel a masked score becomes.
MASKED_SCORE = -(2.0**100)
# Offset of (kv_splits, split_keys) in the 328-byte AttentionParams (shaders/common/params.h).
SPLIT_FIELDS_OFFSET = 192


# The options' inputs (attn_mask, cu_seqlens, sinks): every forward feature kernel binds them;
# the decode kernels also the paged cache's block_table and cache_seqlens (q when not paged).
OPTION_SLOTS = {"attn_mask": 14, "cu_seqlens_q": 15, "cu_seqlens_k": 16, "sinks": 17}
PAGED_SLOTS = {"block_table": 19, "cache_seqlens": 20}


def _no_options(q):
    # As the host binds them when there is no mask, no varlen, no sinks and no paging: q in each slot, never read.
    return {14: q, 15: q, 16: q, 17: q, 19: q, 20: q}


DENSE = 10  # fc_dense (csrc/metal/plan.h, kDenseFunctionConstant): the lanes' contiguous runs, vector loads
SINKS = 11  # fc_has_sinks (kSinksFunctionConstant)
PAGED = 12  # fc_paged (kPagedFunctionConstant): the paged KV cache, tests/metal/test_metal_decode_paged.py


def _constants(causal, dense=False):
    # Function constants 0-9 (csrc/metal/plan.h): causal, and every option off; 10: fc_dense; 11: no sinks;
    # 12: not paged.
    return {**{i: (causal if i == 0 else False) for i in range(10)}, DENSE: dense, SINKS: False, PAGED: False}

def bucket_of(d):
    """The smallest instantiated head_dim bucket that holds d."""
    return min(b for b in BUCKETS if b >= d)


def kernel_names(dtype, dmax):
    """(one pass, split pass 1, merge) host names."""
    t = DTYPE_NAMES[dtype]
    return f"flash_decode_{t}_d{dmax}", f"flash_decode_split_{t}_d{dmax}", f"flash_decode_merge_{t}_d{dmax}"


def rows_per_simd(dmax):
    # decode_rows_per_simd (shaders/decode/attention_decode_rows.h): the most rows within the register budget.
    return 4 if dmax <= 64 else (2 if dmax <= 128 else 1)


def row_groups(Hq, Hkv, Nq, dmax):
    return math.ceil(Hq // Hkv * Nq / rows_per_simd(dmax))


def decode_launch(B, Hq, Hkv, Nq, dmax, splits, elem_size, chunks=None, rgl=None):
    """The launch formulas at the top of shaders/decode/attention_decode.h.

    Returns {kernel: (grid, threadgroup, threadgroup memory bytes)} for
    "one_pass", "split" and "merge" (merge: no threadgroup memory). chunks
    and rgl (row chunks, row groups per threadgroup) default to the
    planner's: C = ceil(RG / 8), RGL = ceil(RG / C); fewer chunks make the
    SIMD-groups loop over the row groups in rounds.
    """
    rs = rows_per_simd(dmax)
    rg = row_groups(Hq, Hkv, Nq, dmax)
    chunks = math.ceil(rg / 8) if chunks is None else chunks
    rgl = math.ceil(rg / chunks) if rgl is None else rgl
    kg = max(1, 8 // rgl)  # key groups: as many as fill 8 SIMD-groups beside the row groups
    dp32 = 32 * math.ceil(dmax / 32)
    # several key groups: their merge (floats); one: none used, 16 bytes (the least Metal takes)
    mem = 16 * math.ceil(kg * rgl * (rs + 1 + dp32) * 4 / 16) if kg > 1 else 16
    tg = (32, kg, rgl)
    return {"one_pass": ((Hkv * chunks, B, 1), tg, mem), "split": ((Hkv * chunks, B, splits), tg, mem),
            "merge": ((Nq, Hq, B), (32, 1, 1), 0)}


def split_keys_of(nk, splits, quantum=BLOCK):
    """Keys per split block: ceil(Nk / splits) rounded up to a multiple of `quantum` (the planner passes key
    groups x 32, issue 43; the kernels take any multiple of 32, which the tests' own launches use)."""
    return quantum * math.ceil(math.ceil(nk / splits) / quantum)


def decode_library(instrumented, fast_math):
    return metal_library(instrumented, fast_math)


def launch_decode(q, k, v, causal=False, scale=None, splits=1, instrumented=False, fast_math=False, chunks=None,
                  rgl=None, dense=False):
    """Launches the kernels directly; returns (out, lse, partial_o, partial_stats, counts).

    Outputs and partials are poisoned with NaN, so an element never written
    stays NaN. splits == 1: the one-pass kernel (no partials); else the split
    pass and the merge. chunks, rgl: as decode_launch. dense: fc_dense (the
    caller vouches for the host's condition: unit feature stride, D == the
    bucket, 16-byte aligned K/V rows). counts: the emulator's per-dispatch
    counts.
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    dmax = bucket_of(D)
    one, split, merge = kernel_names(q.dtype, dmax)
    raw = bytearray(flash_metal.explain(q, k, v, causal, scale, impl="tiled").params.numpy().tobytes())
    assert len(raw) == 328
    struct.pack_into("<2i", raw, SPLIT_FIELDS_OFFSET, splits, split_keys_of(Nk, splits) if splits > 1 else Nk)
    params = torch.frombuffer(raw, dtype=torch.uint8)
    out = torch.full((B, Hq, Nq, D), float("nan"), dtype=q.dtype)
    lse = torch.full((B, Hq, Nq), float("nan"), dtype=torch.float32)
    lib = decode_library(instrumented, fast_math)
    shape = decode_launch(B, Hq, Hkv, Nq, dmax, splits, q.element_size(), chunks, rgl)
    counts = []
    if splits == 1:
        grid, tg, mem = shape["one_pass"]
        counts.append(lib.dispatch(one, buffers={0: q, 1: k, 2: v, 3: out, 4: lse, **_no_options(q)}, bytes={5: params},
                                   function_constants=_constants(causal, dense), grid=grid, threadgroup=tg,
                                   threadgroup_memory={0: mem}))
        return out, lse, None, None, counts
    part_o = torch.full((B, Hq, Nq, splits, D), float("nan"), dtype=torch.float32)
    part_s = torch.full((B, Hq, Nq, splits, 2), float("nan"), dtype=torch.float32)
    grid, tg, mem = shape["split"]
    counts.append(lib.dispatch(split, buffers={0: q, 1: k, 2: v, 6: part_o, 7: part_s, **_no_options(q)},
                               bytes={5: params}, function_constants=_constants(causal, dense), grid=grid, threadgroup=tg,
                               threadgroup_memory={0: mem}))
    grid, tg, _ = shape["merge"]
    counts.append(lib.dispatch(merge, buffers={3: out, 4: lse, 6: part_o, 7: part_s}, bytes={5: params},
                               grid=grid, threadgroup=tg))
    return out, lse, part_o, part_s, counts


def run_decode(q, k, v, causal=False, scale=None, splits=1, instrumented=False, fast_math=False):
    """(out, lse) of the decode kernels, launched as the planner launches them, with `splits` blocks.

    splits == 1 runs the one-pass kernel, splits > 1 the split pass and the
    merge. The planner picks its own split count; this takes any, so the
    kernels meet block counts the planner would not choose on these small
    shapes. test_planner_launches_exactly_these_shapes pins the two launches
    to each other, and test_planner_routes_through_the_emulator runs the
    planner's own plans.
    """
    out, lse, _, _, _ = launch_decode(q, k, v, causal, scale, splits, instrumented, fast_math)
    return out, lse


# ---- the instantiations and their launch shapes ----------------------------------------

def test_library_holds_exactly_the_instantiations():
    lib = decode_library(False, False)
    names = {n for n in lib.kernel_names() if n.startswith("flash_decode")}
    assert names == {n for dt in DTYPES for b in BUCKETS for n in kernel_names(dt, b)}
    # The decode-only 512 and 576: in the source, left out of the default build (tests/shader_builds.py;
    # their runs and their own partial builds: tests/metal/test_metal_decode_wide.py). The build leaves out the
    # split-D backward too (is_splitd_backward: tests/metal/test_metal_backward_splitd.py builds its own).
    # The quantized-cache decode (issue 44) is left out too: tests/metal/test_metal_decode_quant.py builds its own.
    omitted = {n for n in lib.omitted_names() if n.startswith("flash_decode") and not n.startswith("flash_decode_quant_")}
    assert omitted == {n for dt in DTYPES for b in (512, 576) for n in kernel_names(dt, b)}
    quant = {n for n in lib.omitted_names() if n.startswith("flash_decode_quant_")}
    assert quant == {f"flash_decode_quant_{k}{DTYPE_NAMES[dt]}_d{b}" for dt in DTYPES for b in BUCKETS
                     for k in ("", "split_")}


# (B, Hq, Hkv, Nq, Nk, D, dtype, impl): one row group and several, MQA, a
# group cut into 8 row chunks, one pass and split, every dtype.
PLANNER_CASES = [(1, 8, 2, 1, 300, 128, torch.float16, "decode"), (2, 32, 8, 1, 8192, 128, torch.bfloat16, "auto"),
                 (1, 16, 1, 4, 700, 64, torch.float32, "decode_split"), (3, 4, 4, 8, 9, 80, torch.float16, "decode"),
                 (1, 32, 2, 8, 40_000, 256, torch.float32, "auto"), (1, 6, 3, 2, 20, 17, torch.bfloat16, "decode_split")]


@pytest.mark.parametrize("case", PLANNER_CASES, ids=lambda c: f"{c[0]}x{c[1]}:{c[2]}-{c[3]}x{c[4]}-d{c[5]}-{c[7]}")
def test_planner_launches_exactly_these_shapes(case):
    # csrc/metal/launch.cpp and decode_launch() both transcribe the formulas at
    # the top of attention_decode.h; they must agree on every field.
    B, Hq, Hkv, Nq, Nk, D, dtype, impl = case
    q, k = torch.empty(B, Hq, Nq, D, dtype=dtype), torch.empty(B, Hkv, Nk, D, dtype=dtype)
    plan = flash_metal.explain(q, k, k, impl=impl)
    fields = struct.unpack_from("<2i", plan.dispatches[0].params.numpy().tobytes(), SPLIT_FIELDS_OFFSET)
    splits, per = fields
    shape = decode_launch(B, Hq, Hkv, Nq, bucket_of(D), splits, q.element_size())
    one, split, merge = kernel_names(dtype, bucket_of(D))
    if splits == 1:
        assert per == Nk
        (d,) = plan.dispatches
        assert (d.kernel_name, d.grid, d.threadgroup, d.threadgroup_memory) == (one, *shape["one_pass"])
        assert d.buffers == {"q": 0, "k": 1, "v": 2, "out": 3, "lse": 4, **OPTION_SLOTS, **PAGED_SLOTS}
        # no causal, no option (indices: csrc/metal/plan.h); fc_dense for packed K/V with D == its bucket;
        # no sinks, not paged
        assert d.function_constants == (False,) * 10 + (D == bucket_of(D), False, False)
        return
    d1, d2 = plan.dispatches
    assert per == split_keys_of(Nk, splits, BLOCK * d1.threadgroup[1])  # whole quanta of key groups x 32
    assert (d1.kernel_name, d1.grid, d1.threadgroup, d1.threadgroup_memory) == (split, *shape["split"])
    assert (d2.kernel_name, d2.grid, d2.threadgroup, d2.threadgroup_memory) == (merge, *shape["merge"])
    assert d1.buffers == {"q": 0, "k": 1, "v": 2, "partial_out": 6, "partial_stats": 7, **OPTION_SLOTS,
                          **PAGED_SLOTS}
    assert d2.buffers == {"out": 3, "lse": 4, "partial_out": 6, "partial_stats": 7}
    assert d2.function_constants == ()
    assert d1.function_constants == (False,) * 10 + (D == bucket_of(D), False, False)
    assert plan.scratch == {"partial_out": B * Hq * Nq * splits * D, "partial_stats": B * Hq * Nq * splits * 2}


@pytest.mark.parametrize("impl", ["auto", "decode", "decode_split"])
def test_planner_routes_through_the_emulator(impl):
    # The planner's own plans, end to end through the emulated backend and
    # the sanitizing build: routing, bindings, scratch and params included.
    for i, (B, Hq, Hkv, Nq, Nk, D, dtype) in enumerate([(1, 8, 2, 1, 600, 64, torch.float16),
                                                        (2, 4, 1, 5, 70, 100, torch.float32),
                                                        (1, 6, 3, 8, 3, 256, torch.bfloat16)]):
        q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, layout="offset_slice", generator=torch.Generator().manual_seed(i))
        for causal in (False, True):
            out, lse = emulated_metal_attention(q, k, v, causal, None, impl, instrumented=True)
            assert_attention_close(out, lse, q, k, v, causal)


@pytest.mark.parametrize("dmax", BUCKETS)
def test_launch_fits_metal_limits(dmax):
    # Every GQA group up to ratio 32 with Nq up to 8: at most the 256 threads
    # the kernels declare, whole SIMD-groups, threadgroup memory within 32 KiB
    # and a multiple of 16.
    for ratio in range(1, 33):
        for nq in range(1, 9):
            for size in (4, 2):
                for name, (grid, tg, mem) in decode_launch(2, 4 * ratio, 4, nq, dmax, 3, size).items():
                    assert tg[0] == 32 and tg[0] * tg[1] * tg[2] <= MAX_THREADS, (ratio, nq, name, tg)
                    assert mem <= TG_LIMIT and mem % 16 == 0, (ratio, nq, name, mem)


# (dtype, D, gqa_ratio, Nq, splits): one row group (8 key groups, each
# reading its own keys), several row groups (2 and 4 SIMD-groups all reading
# the same keys), and more row groups than 8 SIMD-groups: ratio 8, Nq 8 at
# D 64 (16 row groups, 2 row chunks), D 72 (32, 4 chunks) and D 256 (64 row
# groups, 8 row chunks).
READ_CASES = [(torch.float16, 128, 2, 1, 1), (torch.float32, 64, 8, 1, 3), (torch.bfloat16, 128, 8, 1, 2),
              (torch.float16, 64, 8, 8, 1), (torch.float16, 72, 8, 8, 1), (torch.float16, 256, 8, 8, 2)]


def check_kv_read_once(counts, k, v, chunks, readers):
    """K and V reach DRAM once per row chunk and each reading SIMD-group loads them once.

    DRAM: the emulator's unique bytes per threadgroup (the L1 keeps what a
    threadgroup's SIMD-groups share: the model's assumption) are `chunks`
    times each tensor's size. Loads: the raw bytes are `readers` times it,
    readers = the live row groups: each reads every key once (its
    threadgroup's key groups split the keys between them).
    """
    unique, raw = counts.device_unique_bytes_read_by_index, counts.device_bytes_read_by_index
    for buf, t in ((1, k), (2, v)):
        size = t.numel() * t.element_size()
        assert unique[buf] == chunks * size, (buf, unique[buf], chunks, size)
        assert raw[buf] == readers * size, (buf, raw[buf], readers, size)


def test_each_key_is_read_once_per_group():
    # The sanitizing build's counts for k and v, one pass or split: while
    # the GQA group fits one threadgroup (at most 8 row groups) its rows
    # share every K/V byte at DRAM, and each SIMD-group loads each key once.
    # A bigger group is cut into row chunks of at most 8 row groups (the
    # kernels' 256-thread limit), and each chunk reads K/V once.
    for dtype, d, ratio, nq, splits in READ_CASES:
        q, k, v = make_qkv(1, 2 * ratio, 2, nq, 70, d, dtype)
        out, lse, _, _, counts = launch_decode(q, k, v, splits=splits, instrumented=True)
        assert_attention_close(out, lse, q, k, v)
        rg = row_groups(2 * ratio, 2, nq, bucket_of(d))
        check_kv_read_once(counts[0], k, v, math.ceil(rg / 8), rg)
    assert {math.ceil(r * nq / rows_per_simd(bucket_of(d)) / 8) for _, d, r, nq, _ in READ_CASES} == {1, 2, 4, 8}


def test_read_once_check_catches_a_second_read():
    # Planted: a layout that reads K/V twice. (a) Two row chunks where one
    # threadgroup would do (the chunks each read K/V from DRAM); (b) the
    # counts of a kernel whose SIMD-groups load each key twice (raw bytes
    # doubled; their unique bytes unchanged). Both fail the check.
    q, k, v = make_qkv(1, 8, 2, 1, 70, 128, torch.float16)  # 2 row groups: one threadgroup
    _, _, _, _, counts = launch_decode(q, k, v, instrumented=True)
    check_kv_read_once(counts[0], k, v, 1, 2)
    _, _, _, _, two = launch_decode(q, k, v, instrumented=True, chunks=2, rgl=1)
    with pytest.raises(AssertionError):
        check_kv_read_once(two[0], k, v, 1, 2)
    twice = dataclasses.replace(counts[0], device_bytes_read_by_index={
        i: 2 * n for i, n in counts[0].device_bytes_read_by_index.items()})
    with pytest.raises(AssertionError):
        check_kv_read_once(twice, k, v, 1, 2)


# ---- fc_dense: each lane's contiguous run of a K/V row, as vector loads (issue 19) ---------

def features_per_lane(dmax):
    return math.ceil(dmax / 32)


def vector_width(dmax):
    # decode_vector_width (attention_decode.h): the widest of 4, 2, 1 elements dividing a lane's run.
    dpl = features_per_lane(dmax)
    return 4 if dpl % 4 == 0 else (2 if dpl % 2 == 0 else 1)


def kv_loads(nk, d, elem, readers, dense):
    """{bytes: load instructions} the decode kernels issue on one of k, v (D == its bucket).

    Each of `readers` row groups reads every key once (row groups of a key
    group read the same keys; the key groups split them).
    General path: one scalar load per feature, D per key. fc_dense: each
    lane reads its run of DPL features as DPL / VW loads of VW elements;
    with VW = 1 (DMAX 72, 80, 96) only the lanes whose run lies in the row
    load, so D loads per key.
    """
    if not dense:
        return {elem: readers * nk * d}
    vw = vector_width(d)
    return {vw * elem: readers * nk * (32 * features_per_lane(d) // vw if vw > 1 else d)}


# (dtype, D, gqa ratio, Nq): every bucket at D == bucket, with one row group
# (8 key groups) or several (every row group reading every key).
DENSE_CASES = [(torch.float16, 128, 1, 1), (torch.bfloat16, 64, 2, 1), (torch.float32, 256, 1, 1),
               (torch.float16, 256, 1, 1), (torch.float32, 32, 1, 1), (torch.float16, 80, 1, 1),
               (torch.bfloat16, 96, 1, 1), (torch.float16, 128, 4, 2), (torch.float32, 72, 8, 1),
               (torch.bfloat16, 256, 2, 1), (torch.float16, 192, 1, 1)]


def test_dense_cases_cover_both_paths_and_every_bucket():
    assert {d for _, d, _, _ in DENSE_CASES} == set(BUCKETS)
    assert {row_groups(r, 1, nq, d) > 1 for _, d, r, nq in DENSE_CASES} == {True, False}
    assert {vector_width(d) for _, d, _, _ in DENSE_CASES} == {1, 2, 4}


@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: f"{dtype_id(c[0])}-d{c[1]}-gqa{c[2]}-nq{c[3]}")
def test_dense_loads_are_vectors_and_match_the_general_path(case):
    # The same problem under fc_dense and without, sanitized: both within
    # the 2x rule, K/V read once (check_kv_read_once), and the load
    # instructions per K/V buffer exactly kv_loads' (so the dense path ran:
    # its widths differ from the general path's wherever a lane holds 2 or
    # more features). K/V in the transposed layout (B, N, H, D): unit
    # feature stride, aligned rows, row stride H * D.
    dtype, d, ratio, nq = case
    g = torch.Generator().manual_seed(7000 + d + ratio)
    nk, causal = 45, ratio > 1
    q, k, v = make_qkv(2, 2 * ratio, 2, nq, nk, d, dtype, layout=("offset_slice", "transposed", "transposed"),
                       generator=g)
    readers = row_groups(2 * ratio, 2, nq, d)
    elem = q.element_size()
    for dense in (False, True):
        out, lse, _, _, counts = launch_decode(q, k, v, causal, splits=2 if readers > 1 else 1, instrumented=True,
                                               dense=dense)
        assert_attention_close(out, lse, q, k, v, causal)
        loads = counts[0].device_loads_by_index
        check_kv_read_once(counts[0], k, v, 1, readers)
        for buf in (1, 2):
            assert loads[buf] == kv_loads(2 * 2 * nk, d, elem, readers, dense), (dense, buf, loads[buf])


def test_dense_load_check_catches_scalar_loads():
    # Planted: the general path's counts where dense ones are expected (the
    # kernel ignoring fc_dense) fail the check, at every vector width > 1,
    # with one reader and with several.
    for d, readers in ((64, 1), (128, 1), (256, 1), (128, 2), (64, 4)):
        for elem in (2, 4):
            assert kv_loads(10, d, elem, readers, False) != kv_loads(10, d, elem, readers, True), (d, readers, elem)


def test_planner_sets_fc_dense_for_aligned_unit_stride_kv_only():
    # decode_dense_loads (csrc/metal/launch.cpp): K and V feature stride 1,
    # D == bucket, 16-byte aligned rows; q's layout does not matter (read once).
    def dense_and_reason(q, k, v):
        plan = flash_metal.explain(q, k, v, impl="decode")
        (d,) = plan.dispatches
        return d.function_constants[DENSE], plan.reason

    q, k, v = make_qkv(1, 4, 2, 1, 40, 64, torch.float16, layout=("d_outer", "transposed", "contiguous"))
    dense, why = dense_and_reason(q, k, v)
    assert dense and "vector loads (fc_dense)" in why, why
    for d, layout, expect in ((64, "d_outer", "k's feature stride is"), (60, "contiguous", "below its bucket"),
                              (64, "storage_end", "k's storage offset is not a multiple of 16 bytes")):
        q, k, v = make_qkv(1, 4, 2, 1, 40, d, torch.float16, layout=("contiguous", layout, "contiguous"))
        dense, why = dense_and_reason(q, k, v)
        assert not dense and expect in why, why


# ---- every instantiation, sanitized --------------------------------------------------------

# One head_dim per bucket, most of them ragged inside it (a lane's last slice
# is partly padding; 72 and 80 leave whole lanes of padding in the third).
BUCKET_DIMS = {32: 17, 64: 40, 72: 72, 80: 75, 96: 90, 128: 128, 192: 150, 256: 200}
# (B, Hq, Hkv, Nq, Nk, splits, layout): Nk = 1; Nk < Nq (causal rows with no
# key, and a split block past the end); a block with one key and empty
# blocks past Nk; MHA with four splits, the last ragged; MQA with 16 rows.
# In every bucket both kernels run with one row group (8 key groups) and
# with several (each reading every key).
SANITIZED_CASES = [
    (1, 2, 2, 1, 1, 1, "offset_slice"),
    (1, 4, 1, 8, 7, 2, "storage_end"),
    (1, 8, 2, 3, 33, 3, "every_other"),
    (2, 3, 3, 1, 100, 4, "storage_end_bnhd"),
    (1, 8, 1, 2, 70, 1, "d_outer"),
]


def test_sanitized_cases_cover_the_edges():
    # Both kernels, Nk from 1 to past one split block, Nk < Nq, a split
    # block past the end of the keys.
    assert {c[5] == 1 for c in SANITIZED_CASES} == {True, False}
    nks = [c[4] for c in SANITIZED_CASES]
    assert min(nks) == 1 and max(nks) > BLOCK
    assert any(c[4] < c[3] for c in SANITIZED_CASES)
    assert any(c[5] > 1 and (c[5] - 1) * split_keys_of(c[4], c[5]) >= c[4] for c in SANITIZED_CASES)
    assert all(1 <= c[3] <= 8 for c in SANITIZED_CASES)
    for dmax in BUCKETS:
        paths = {(c[5] > 1, math.ceil(c[1] // c[2] * c[3] / rows_per_simd(dmax)) > 1) for c in SANITIZED_CASES}
        assert paths == {(False, False), (False, True), (True, False), (True, True)}, dmax


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("bucket", BUCKETS, ids=[f"d{b}" for b in BUCKETS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_instantiation_sanitized(dtype, bucket, causal):
    d = BUCKET_DIMS[bucket]
    assert bucket_of(d) == bucket
    for i, (b, hq, hkv, nq, nk, splits, layout) in enumerate(SANITIZED_CASES):
        g = torch.Generator().manual_seed(4000 + i)
        q, k, v = make_qkv(b, hq, hkv, nq, nk, d, dtype, layout=layout, generator=g)
        out, lse = run_decode(q, k, v, causal, splits=splits, instrumented=True)
        assert_attention_close(out, lse, q, k, v, causal)
    dispatched = decode_library(True, False).dispatched_names()
    assert set(kernel_names(dtype, bucket)) <= dispatched


# (Hq, Hkv, Nq, D): GQA ratios 1, 4, 8 and 9, MQA; rows per GQA group from 1
# to 64, so one row group (8 key groups), 2 to 8 row groups sharing K/V
# through the L1 (in 4, 2 or 1 key groups), and more than 8, cut into row chunks: 16 row groups into 2
# chunks of 8, 9 into 2 chunks of 5 (the last with a row group past R), 64
# (ratio 8, Nq 8, D 256) into 8 chunks of 8.
GQA_CASES = [(4, 4, 1, 64), (8, 2, 3, 128), (8, 1, 4, 96), (16, 2, 2, 64), (8, 1, 8, 256), (8, 8, 8, 32),
             (9, 1, 4, 64)]


def test_gqa_cases_cover_every_threadgroup_shape():
    # 8 key groups of one row group; key groups of 2 and 4 row groups
    # sharing their keys (merged); one key group of 5 to 8 row groups; row
    # chunks, even and with a dead row group in the last.
    launches = [decode_launch(1, hq, hkv, nq, bucket_of(d), 2, 2)["split"] for hq, hkv, nq, d in GQA_CASES]
    shapes = {tg[1:] for _, tg, _ in launches}
    assert {(8, 1), (4, 2), (2, 4), (1, 8)} <= shapes and any(kg == 1 and 1 < rgl < 8 for kg, rgl in shapes)
    chunks = [grid[0] // hkv for (grid, _, _), (_, hkv, _, _) in zip(launches, GQA_CASES)]
    assert {1, 2, 8} <= set(chunks)
    groups = [row_groups(hq, hkv, nq, bucket_of(d)) for hq, hkv, nq, d in GQA_CASES]
    assert any(c * tg[2] > rg for c, (_, tg, _), rg in zip(chunks, launches, groups))  # a dead row group


@pytest.mark.parametrize("case", [(8, 1, 8, 256, 1, 8), (8, 1, 6, 96, 1, 8), (9, 1, 4, 128, 2, 3)],
                         ids=lambda c: f"hq{c[0]}-nq{c[2]}-d{c[3]}-c{c[4]}-rgl{c[5]}")
def test_sanitized_rounds_with_fewer_chunks(case):
    # The kernels loop over row groups in rounds when a launch has fewer row
    # chunks than it needs (threadgroups_per_grid.x / Hkv): every row is
    # still written once, and K/V is read once per (chunk, round) from DRAM
    # (the rounds re-read more than the L1 window) and once per row group.
    hq, hkv, nq, d, chunks, rgl = case
    rounds = math.ceil(row_groups(hq, hkv, nq, bucket_of(d)) / (chunks * rgl))
    assert rounds > 1
    g = torch.Generator().manual_seed(5100 + hq + nq)
    q, k, v = make_qkv(1, hq, hkv, nq, 45, d, torch.float16, layout="offset_slice", generator=g)
    for causal, splits in [(False, 1), (True, 2)]:
        out, lse, _, _, counts = launch_decode(q, k, v, causal, 0.3, splits=splits, instrumented=True, chunks=chunks,
                                               rgl=rgl)
        assert_attention_close(out, lse, q, k, v, causal, 0.3)
        if not causal:
            check_kv_read_once(counts[0], k, v, chunks * rounds, row_groups(hq, hkv, nq, bucket_of(d)))


@pytest.mark.parametrize("case", GQA_CASES, ids=lambda c: f"hq{c[0]}-hkv{c[1]}-nq{c[2]}-d{c[3]}")
def test_sanitized_gqa_mqa(case):
    hq, hkv, nq, d = case
    g = torch.Generator().manual_seed(5000 + hq + nq)
    q, k, v = make_qkv(2, hq, hkv, nq, 45, d, torch.float16, layout="transposed", generator=g)
    for causal, splits in [(False, 1), (True, 2)]:
        out, lse = run_decode(q, k, v, causal, 0.3, splits=splits, instrumented=True)
        assert_attention_close(out, lse, q, k, v, causal, 0.3)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sanitized_layouts(layout):
    # Each of numerics.LAYOUTS for q, k and v alike, and mixed with another.
    for i, layouts in enumerate([layout, (layout, "every_other", layout), ("transposed", layout, "d_outer")]):
        g = torch.Generator().manual_seed(6000 + i)
        q, k, v = make_qkv(1, 4, 2, 3, 50, 40, torch.bfloat16, layout=layouts, generator=g)
        for causal, splits in [(True, 1), (False, 2)]:
            out, lse = run_decode(q, k, v, causal, splits=splits, instrumented=True)
            assert_attention_close(out, lse, q, k, v, causal)


# ---- rows and split blocks with no visible key ---------------------------------------------

@pytest.mark.parametrize("splits", [1, 3])
def test_causal_rows_with_no_key_are_zeros_and_minus_inf(splits):
    # Nk < Nq, bottom-right causal: query row i sees keys j <= i - (Nq - Nk),
    # so rows 0..Nq-Nk-1 see nothing.
    nq, nk = 8, 3
    q, k, v = make_qkv(1, 4, 2, nq, nk, 64, torch.float32, generator=torch.Generator().manual_seed(7))
    out, lse = run_decode(q, k, v, True, splits=splits, instrumented=True)
    assert_attention_close(out, lse, q, k, v, True)
    empty = nq - nk
    assert torch.equal(out[:, :, :empty], torch.zeros_like(out[:, :, :empty]))
    assert torch.isinf(lse[:, :, :empty]).all() and (lse[:, :, :empty] < 0).all()
    assert torch.isfinite(lse[:, :, empty:]).all()


def test_split_blocks_without_visible_keys_write_the_empty_partial():
    # Nq 8, Nk 35, 4 splits of 32 keys: block 1 holds keys 32..34, which rows
    # 0..4 cannot see under causal masking (row i sees j <= i + 27); blocks 2
    # and 3 lie past the end for every row. Such a partial is exactly
    # (m, l) = (kMaskedScore, 0) and zeros; every other is finite with l >= 1.
    nq, nk, splits = 8, 35, 4
    q, k, v = make_qkv(1, 2, 1, nq, nk, 48, torch.float32, generator=torch.Generator().manual_seed(8))
    out, lse, part_o, part_s, _ = launch_decode(q, k, v, True, splits=splits, instrumented=True)
    assert_attention_close(out, lse, q, k, v, True)
    assert not torch.isnan(part_o).any() and not torch.isnan(part_s).any()
    sk = split_keys_of(nk, splits)
    for i in range(nq):
        for s in range(splits):
            sees = s * sk <= i + (nk - nq)  # the row sees the block's first key
            m, l = part_s[0, :, i, s, 0], part_s[0, :, i, s, 1]
            if sees:
                assert (l >= 1).all() and (m > MASKED_SCORE).all(), (i, s)
            else:
                assert (m == MASKED_SCORE).all() and (l == 0).all(), (i, s)
                assert torch.equal(part_o[0, :, i, s], torch.zeros_like(part_o[0, :, i, s])), (i, s)


# ---- fast math with non-finite keys --------------------------------------------------------

def _nonfinite():
    import test_nonfinite

    return test_nonfinite


# Decode shapes for test_nonfinite's cases: Nq 8 over 45 keys (two 32-key
# blocks), and Nq 6 over 3 keys (causal rows with no key).
NONFINITE_SHAPES = [(8, 45), (6, 3)]


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", range(8), ids=lambda i: f"case{i}")
def test_fast_math_nonfinite_keys(case, causal, splits):
    # test_nonfinite.py's cases (-inf keys, overflowing and huge scores, at
    # the first key, the middle, the end, a whole first block, everywhere),
    # in the fast-math build: masked keys weigh exactly 0 and rows with
    # nothing visible give zeros and -inf, with no infinity ever computed.
    nf = _nonfinite()
    dtype, kind = nf.CASES[case]
    for position, masked_of in nf.POSITIONS.items():
        for i, (nq, nk) in enumerate(NONFINITE_SHAPES):
            masked = masked_of(nk)
            q, k, v = nf.make_case(nq, nk, dtype, kind, masked, seed=100 + i)
            out, lse = run_decode(q, k, v, causal, splits=splits, fast_math=True)
            nf.check_case(out, lse, q, k, v, causal, kind, masked)


def test_fast_math_cases_are_all_taken():
    assert len(_nonfinite().CASES) == 8


# ---- precision at long context ------------------------------------------------------------

LONG_NK = 8192


@pytest.mark.parametrize("hq", [2, 8], ids=["one_row_group", "four_row_groups"])
@pytest.mark.parametrize("splits", [1, 8], ids=["one_pass", "split8"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strict_precision_at_8192_keys(causal, splits, hq):
    # FlashAttention's 2x rule with no float32 floor: the error is at most
    # twice PyTorch's own float32 error (plus the output rounding). One
    # rescale per 32-key block and a blocked P.V sum keep it there
    # (attention_decode.h). 4 query rows of 2 heads (8 rows: one row group,
    # 8 key groups merged) or of 8 heads (32 rows: 8 row groups, each
    # walking every block).
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        q, k, v = make_qkv(1, hq, 1, 4, LONG_NK, 64, torch.float32, generator=g)
        out, lse = run_decode(q, k, v, causal, splits=splits)
        assert_attention_close(out, lse, q, k, v, causal, strict=True)



# ---- merges where one block dominates -------------------------------------------------------

@pytest.mark.parametrize("splits", [1, 4])
def test_merges_follow_the_block_that_holds_the_max(splits):
    # One key scores about 2000 above the others (natural log), in the first,
    # a middle, the eighth (key group 7 of 8 in the one-pass threadgroup) or
    # the last 32-key block: it must carry all the weight. A
    # merge (of key groups in the threadgroup, or of split partials) that
    # rescales by anything but the true max multiplies some partial by
    # exp2(+2000 * log2 e) = inf and the row turns inf or NaN; one that
    # drops a block loses the key.
    nk = 260
    for key in (3, 100, 230, nk - 1):
        g = torch.Generator().manual_seed(key)
        q, k, v = make_qkv(1, 4, 1, 2, nk, 64, torch.float32, generator=g)
        k[0, 0, key] = q[0, 0, 0] * (2000.0 * 8 / q[0, 0, 0].dot(q[0, 0, 0]))  # score 2000 with scale 1/8
        out, lse = run_decode(q, k, v, False, splits=splits, instrumented=splits > 1)
        assert_attention_close(out, lse, q, k, v)
