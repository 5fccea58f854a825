"""The FlashAttention-2 forward ("prefill") kernel, shaders/prefill/attention_prefill.h.

Every instantiation runs through the Metal emulator's sanitizing build
(races, barrier and SIMD divergence, out-of-bounds, threadgroup overflow) on
small shapes covering both edge alignments, causal on and off, GQA, MQA and
strided layouts, and is compared with the float64 oracle by FlashAttention's
2x rule (tests/numerics.py). The fast build runs the larger cases: every
head_dim, every layout, fast math with -inf keys, and the precision check at
Nk = 8192 in float32 under the strict rule (no float32 floor), which the
post's tiled kernel (one rescale per key) does not meet. The emulator's
counters check the structure: 4 barriers and one alpha per key block,
causal blocks skipped, FlashAttention-2's device traffic. run_prefill
launches the kernel as csrc/metal/launch.cpp will (grid, threadgroup,
function constants, threadgroup memory).
"""
import math
import os

import numpy as np
import pytest
import torch

import flash_metal
from backends import LAST_DISPATCHES, emulated_metal_attention, metal_library
from numerics import DTYPES, LAYOUTS, assert_attention_close, dtype_id, make_qkv
from test_metal_dense_loader import dense_expected
from test_nonfinite import CASES, POSITIONS, SHAPES, check_case, make_case
from repo_paths import ROOT_DIR as ROOT

LANES_SHADER = os.path.join(ROOT, "tests", "prefill_lanes.metal")

# (BQ, BK, WM) per head_dim bucket: the instantiations in shaders/attention.metal
# (finish_prefill in csrc/metal/families/prefill.cpp says why), float16/bfloat16;
# WM * 8 / BQ SIMD-groups per 8-row group (feature parts of O).
BLOCKS = {32: (32, 32, 4), 64: (32, 32, 4), 72: (32, 32, 4), 80: (32, 32, 4), 96: (32, 32, 4),
          128: (32, 16, 4), 192: (32, 8, 4), 256: (16, 8, 4)}
# float32's (its rows are twice the bytes: shorter key blocks, more parts; at 192 16 query rows,
# the only way to 8 resident SIMD-groups per core).
FLOAT_BLOCKS = {32: (32, 32, 4), 64: (32, 16, 4), 72: (32, 16, 4), 80: (32, 16, 4), 96: (32, 8, 4),
                128: (32, 16, 8), 192: (16, 16, 8), 256: (16, 8, 8)}


def blocks_of(dtype, dmax):
    return (FLOAT_BLOCKS if dtype == torch.float32 else BLOCKS)[dmax]
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# Metal's threadgroup memory limit (32 KiB on every Apple GPU family).
TG_LIMIT = 32 * 1024


def bucket_of(d):
    """The smallest instantiated head_dim bucket that holds d."""
    return min(b for b in BLOCKS if b >= d)


def kernel_name(dtype, dmax):
    bq, bk, wm = blocks_of(dtype, dmax)
    return f"flash_attention_prefill_{DTYPE_NAMES[dtype]}_d{dmax}_bq{bq}_bk{bk}_wm{wm}"


def tg_bytes(bq, bk, dmax, elem_size, wm=None):
    """Threadgroup memory of the kernel: the tiles (attention_prefill.h), plus with feature parts
    (WM * 8 / BQ > 1) each SIMD-group's partial S for the split-K sum (BK / 8 fragments of 256 bytes)."""
    parts = wm * 8 // bq if wm else 1
    return (bq + bk) * (dmax * elem_size + 16) + (wm * (bk // 8) * 256 if parts > 1 else 0)


def prefill_library(instrumented, fast_math):
    return metal_library(instrumented, fast_math)


def run_prefill(q, k, v, causal=False, scale=None, instrumented=False, fast_math=False):
    """The prefill kernel through the emulator, launched by the planner (impl="prefill").

    Returns (out, lse), packed (B, Hq, Nq, D) and (B, Hq, Nq), poisoned with
    NaN before the launch so an element never written stays NaN.
    """
    plan = flash_metal.explain(q, k, v, causal, scale, impl="prefill")
    dmax = bucket_of(q.shape[-1])
    bq, bk, wm = blocks_of(q.dtype, dmax)
    # The planner's launch is the one this file's formulas describe.
    assert plan.kernel_name == kernel_name(q.dtype, dmax)
    # Short GQA queries (2 * Nq <= BQ) pack the group's heads into each block (fc_pack_gqa,
    # tests/metal/test_metal_prefill_pack_gqa.py).
    g = q.shape[1] // k.shape[1]
    packs = g > 1 and 2 * q.shape[2] <= bq
    rows, heads = (q.shape[2] * g, k.shape[1]) if packs else (q.shape[2], q.shape[1])
    assert plan.grid == (math.ceil(rows / bq), heads, q.shape[0]) and plan.threadgroup == (32 * wm, 1, 1)
    dense = dense_expected(q, k, v)  # fc_dense (index 10): tests/metal/test_metal_dense_loader.py
    # fc_paged (12) off: a contiguous K/V; fc_pack_gqa (13) as above, align_q then over the packed rows
    assert plan.function_constants == ((causal, rows % bq == 0, k.shape[2] % bk == 0) + (False,) * 7 +
                                       (dense, False, False, packs))
    assert plan.threadgroup_memory == tg_bytes(bq, bk, dmax, q.element_size(), wm)
    return emulated_metal_attention(q, k, v, causal, scale, "prefill", instrumented, fast_math)


def _launch_counts(q, k, v, causal, instrumented=False):
    """run_prefill's dispatch, returning the emulator's counts."""
    out, lse = run_prefill(q, k, v, causal, None, instrumented)
    assert_attention_close(out, lse, q, k, v, causal)
    ((_, counts),) = LAST_DISPATCHES
    return counts


# ---- the instantiations and their threadgroup memory --------------------------------

def _prefill_only(names):
    """The FA2 template's instantiations (the split-D forward at 512 has its own file,
    tests/metal/test_metal_prefill_splitd.py)."""
    return {n for n in names if n.startswith("flash_attention_prefill_") and "_splitd_" not in n}


def test_library_holds_exactly_the_instantiations():
    names = _prefill_only(prefill_library(False, False).kernel_names())
    assert names == {kernel_name(dt, b) for dt in DTYPES for b in BLOCKS}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_threadgroup_memory_fits_metal(dtype):
    size = torch.tensor([], dtype=dtype).element_size()
    for dmax in BLOCKS:
        bq, bk, wm = blocks_of(dtype, dmax)
        assert (8 * wm) % bq == 0 and dmax % (8 * wm * 8 // bq) == 0  # 8-row groups of whole feature parts
        n = tg_bytes(bq, bk, dmax, size, wm)
        assert n <= TG_LIMIT and n % 16 == 0, (dmax, n)


# ---- the lane layout the kernel relies on -------------------------------------------

def mlx_coord(lane):
    """(row, col) of a lane's first thread_elements() entry: MLX's BaseMMAFrag::get_coord."""
    qid = lane // 4
    return (qid & 4) + (lane // 2) % 4, (qid & 2) * 2 + (lane % 2) * 2


def test_kernel_lane_layout_is_mlx_layout():
    # The kernel computes each lane's (row, col) itself (prefill_frag_row /
    # prefill_frag_col) to mask, reduce rows and store. Those must be MLX's
    # documented layout, and the fragments the kernel builds from threadgroup
    # memory must equal what simdgroup_load gives (the emulator models MLX's
    # layout, pinned on its own side by test_emu_matrix.py), so the kernel
    # and the emulator cannot agree on a wrong layout.
    from metal_emulator import compile_library

    lib = compile_library([LANES_SHADER], instrumented=True)
    index = np.arange(128, dtype=np.float32).reshape(8, 16)  # element (r, c) = 16 r + c
    coords = np.full(64, -1, np.int32)
    read, loaded, read_t, loaded_t = (np.full(64, np.nan, np.float32) for _ in range(4))
    lib.dispatch("prefill_lanes", buffers={0: index, 1: coords, 2: read, 3: loaded, 4: read_t, 5: loaded_t},
                 grid=(1,), threadgroup=(32,), threadgroup_memory={0: index.nbytes})
    cells = set()
    for lane in range(32):
        r, c = mlx_coord(lane)
        assert (coords[2 * lane], coords[2 * lane + 1]) == (r, c), lane
        for j in range(2):
            cells.add((r, c + j))
            assert read[2 * lane + j] == index[r, 8 + c + j], lane  # block (rows 0..7, cols 8..15)
            assert read_t[2 * lane + j] == index[c + j, 8 + r], lane  # its transpose
    assert len(cells) == 64  # every element of the 8x8 fragment, once
    np.testing.assert_array_equal(read, loaded)
    np.testing.assert_array_equal(read_t, loaded_t)
    # The 4 lanes of a row are l, l^1, l^8, l^9: the kernel's simd_shuffle_xor 1 and 8.
    for lane in range(32):
        assert {mlx_coord(lane ^ x)[0] for x in (1, 8, 9)} == {mlx_coord(lane)[0]}


# ---- every instantiation, sanitized -------------------------------------------------

# One head_dim per bucket, ragged inside it where the bucket allows (72, 96
# and 256 also run full).
BUCKET_DIMS = {32: 17, 64: 63, 72: 72, 80: 77, 96: 96, 128: 100, 192: 160, 256: 256}
# (Nq, Nk) with every pair of (Nq % BQ == 0, Nk % BK == 0) for every block
# size in BLOCKS (checked below), Nk < Nq so causal rows see no key, and a
# single query row. Each paired with a layout: the storage_end ones put the
# element after a view's last row or feature past the buffer, so any
# over-read is reported; every_other and d_outer have feature strides != 1.
SANITIZED_CASES = [((64, 64), "offset_slice"), ((32, 45), "storage_end"), ((40, 32), "every_other"),
                   ((33, 17), "storage_end_bnhd"), ((1, 23), "d_outer")]


def test_sanitized_shapes_cover_both_alignments():
    for bq, bk, _ in list(BLOCKS.values()) + list(FLOAT_BLOCKS.values()):
        combos = {(nq % bq == 0, nk % bk == 0) for (nq, nk), _ in SANITIZED_CASES}
        assert combos == {(True, True), (True, False), (False, True), (False, False)}, (bq, bk)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("bucket", list(BUCKET_DIMS), ids=[f"d{b}" for b in BUCKET_DIMS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_instantiation_sanitized(dtype, bucket, causal):
    d = BUCKET_DIMS[bucket]
    assert bucket_of(d) == bucket
    for i, ((nq, nk), layout) in enumerate(SANITIZED_CASES):
        g = torch.Generator().manual_seed(3000 + i)
        q, k, v = make_qkv(1, 2, 1, nq, nk, d, dtype, layout=layout, generator=g)
        out, lse = run_prefill(q, k, v, causal, instrumented=True)
        assert_attention_close(out, lse, q, k, v, causal)
    assert kernel_name(dtype, bucket) in prefill_library(True, False).dispatched_names()


@pytest.mark.parametrize("hkv", [2, 1, 6], ids=["gqa", "mqa", "mha"])
def test_sanitized_gqa_mqa_batch(hkv):
    # Query head h reads kv head h // (Hq / Hkv); two batch entries, a
    # transposed (B, N, H, D) layout, a scale of our own.
    q, k, v = make_qkv(2, 6, hkv, 40, 37, 64, torch.float16, layout="transposed")
    for causal in (False, True):
        out, lse = run_prefill(q, k, v, causal, 0.2, instrumented=True)
        assert_attention_close(out, lse, q, k, v, causal, 0.2)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_sanitized_causal_rows_without_keys(dtype):
    # Nk < Nq, bottom-right causal: query i sees keys j <= i - (Nq - Nk). The
    # first Nq - Nk rows see nothing: exact zeros and lse = -inf. With
    # (70, 3) whole threadgroups (rows 0..63) run no key block at all.
    for nq, nk in [(50, 21), (70, 3)]:
        q, k, v = make_qkv(1, 2, 2, nq, nk, 40, dtype, layout="offset_slice")
        out, lse = run_prefill(q, k, v, True, instrumented=True)
        assert_attention_close(out, lse, q, k, v, True)
        empty = nq - nk
        assert torch.isinf(lse[:, :, :empty]).all() and (lse[:, :, :empty] < 0).all()
        assert torch.equal(out[:, :, :empty], torch.zeros_like(out[:, :, :empty]))
        assert torch.isfinite(lse[:, :, empty:]).all()


# ---- the fast build: wider sweeps ---------------------------------------------------

def test_every_head_dim_in_its_bucket():
    # Each D in 1..256 runs in the next bucket with zero padding. storage_end
    # views end at their buffer's end, where the fast build's guard page
    # faults on any read past the last row's feature D - 1.
    for d in range(1, 257):
        dtype = DTYPES[d % 3]
        g = torch.Generator().manual_seed(d)
        q, k, v = make_qkv(1, 1, 1, 9, 11, d, dtype, layout="storage_end", generator=g)
        out, lse = run_prefill(q, k, v, causal=d % 2 == 0)
        assert_attention_close(out, lse, q, k, v, d % 2 == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_every_layout(dtype):
    # Each layout of numerics.LAYOUTS for q, k and v, mixed across the three.
    for i, layout in enumerate(LAYOUTS):
        layouts = (layout, LAYOUTS[(i + 1) % len(LAYOUTS)], LAYOUTS[(i + 2) % len(LAYOUTS)])
        g = torch.Generator().manual_seed(4000 + i)
        q, k, v = make_qkv(2, 4, 2, 45, 70, 80, dtype, layout=layouts, generator=g)
        for causal in (False, True):
            out, lse = run_prefill(q, k, v, causal)
            assert_attention_close(out, lse, q, k, v, causal)


def test_longer_sequences_every_bucket():
    # Many key blocks per threadgroup, several query blocks, ragged edges.
    for bucket, d in BUCKET_DIMS.items():
        g = torch.Generator().manual_seed(bucket)
        q, k, v = make_qkv(1, 2, 1, 150, 333, d, torch.float16, generator=g)
        for causal in (False, True):
            out, lse = run_prefill(q, k, v, causal)
            assert_attention_close(out, lse, q, k, v, causal)


def test_barriers_exp2_and_mmas_per_key_block():
    # Aligned, not causal: every threadgroup walks Nk / BK blocks with 4
    # barriers each; each lane calls exp2 once per weight it holds (2 of
    # each of the BK / 8 fragments of P) plus once per block for alpha (one
    # rescale per block, not one per key); each SIMD-group runs BK / 8 * ceil(D / 8) MMAs for Q.K^T and
    # as many for P.V per block.
    q, k, v = make_qkv(1, 2, 1, 64, 128, 40, torch.float16)
    bq, bk, wm = blocks_of(torch.float16, 64)
    c = _launch_counts(q, k, v, False)
    groups, blocks = 2 * 2, 128 // bk
    assert c.threadgroups == groups
    assert c.threadgroup_barriers == groups * blocks * 4
    assert c.exp2_calls == groups * 32 * wm * blocks * (2 * bk // 8 + 1)
    assert c.simdgroup_mmas == groups * wm * blocks * 2 * (bk // 8) * math.ceil(40 / 8)
    # Ragged Nq = 9: SIMD-groups 2 and 3 hold no real row and skip the math.
    q, k, v = make_qkv(1, 1, 1, 9, 64, 64, torch.float16)
    c = _launch_counts(q, k, v, False)
    assert c.simdgroup_mmas == 2 * (64 // bk) * 2 * (bk // 8) * (64 // 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
def test_device_traffic_is_flash_attention_2s(dtype):
    # FlashAttention-2's I/O: Q read and O, lse written once; K and V read
    # once per query block, and nothing else (D = DMAX, so no padding; two
    # query blocks, GQA 2, non-causal, aligned). Counted by the sanitizing
    # build, byte by byte, per buffer.
    B, hq, hkv, nq, nk, d = 1, 4, 2, 64, 96, 64
    q, k, v = make_qkv(B, hq, hkv, nq, nk, d, dtype)
    bq = blocks_of(dtype, d)[0]
    c = _launch_counts(q, k, v, False, instrumented=True)
    size = q.element_size()
    reads, writes = c.device_bytes_read_by_index, c.device_bytes_written_by_index
    assert reads[0] == B * hq * nq * d * size
    assert reads[1] == reads[2] == B * hq * (nq // bq) * nk * d * size
    assert writes[3] == B * hq * nq * d * size and writes[4] == B * hq * nq * 4
    assert reads[3] == reads[4] == 0 and writes[0] == writes[1] == writes[2] == 0


def test_causal_skips_blocks_in_the_future():
    # Causal, Nq = Nk = 128, D = 128 (BQ = 32, BK = 16): query block x walks
    # key blocks 0..2x+1 only (2 + 4 + 6 + 8 = 20 per head instead of 32),
    # and a SIMD-group skips the math of a block in the future of all its 8
    # rows (SIMD-groups 0 and 1 of block 2x+1).
    q, k, v = make_qkv(1, 1, 1, 128, 128, 128, torch.float32)
    bq, bk, wm = blocks_of(torch.float32, 128)
    rowg, parts = bq // 8, wm * 8 // bq  # 8-row groups, and SIMD-groups (feature parts of O) per group
    assert parts == 2
    c = _launch_counts(q, k, v, True)
    walks = [(x * bq + bq) // bk for x in range(128 // bq)]
    assert walks == [2, 4, 6, 8]
    assert c.threadgroup_barriers == 4 * sum(walks)
    active = sum(1 for x, n in enumerate(walks) for s in range(rowg) for kb in range(n)
                 if kb * bk <= x * bq + 8 * s + 7)
    assert active == rowg * sum(walks) - 2 * len(walks)
    # Each part: its half of Q.K^T (split-K: D / 8 / F fragments per key
    # fragment) and its half of P.V, so the parts together run the products
    # of whole-feature SIMD-groups once (planted: a part computing all of
    # Q.K^T, as before split-K, counts (F + 1) / 2 times this).
    assert c.simdgroup_mmas == active * parts * (bk // 8) * (128 // 8 // parts + 128 // 8 // parts)
    assert "split-K" in flash_metal.explain(q, k, v, True).reason
    # With Nk = Nq + 100 every row sees the first 100 keys: nothing is skipped
    # before the diagonal, and the offset moves it.
    q, k, v = make_qkv(1, 1, 1, 64, 164, 128, torch.float32)
    c = _launch_counts(q, k, v, True)
    walks = [math.ceil(min(x * bq + bq - 1 + 100 + 1, 164) / bk) for x in range(2)]
    assert c.threadgroup_barriers == 4 * sum(walks)


# ---- fast math -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_fast_math_ragged(dtype):
    for i, (nq, nk) in enumerate([(33, 17), (45, 70), (64, 64)]):
        g = torch.Generator().manual_seed(5000 + i)
        q, k, v = make_qkv(1, 2, 1, nq, nk, 63, dtype, layout="offset_slice", generator=g)
        for causal in (False, True):
            out, lse = run_prefill(q, k, v, causal, fast_math=True)
            assert_attention_close(out, lse, q, k, v, causal)
    assert prefill_library(False, True).fast_math


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype,kind", CASES, ids=[f"{dtype_id(d)}-{k}" for d, k in CASES])
def test_fast_math_nonfinite_keys(dtype, kind, causal):
    # test_nonfinite.py's cases (-inf keys, overflowing and huge scores, at
    # the first key, the middle, the end, a whole first block, everywhere),
    # in the fast-math build: masked keys weigh exactly 0 and rows with
    # nothing visible give zeros and -inf, with no infinity ever computed.
    for position, masked_of in POSITIONS.items():
        for i, (nq, nk) in enumerate(SHAPES):
            masked = masked_of(nk)
            q, k, v = make_case(nq, nk, dtype, kind, masked, seed=100 + i)
            out, lse = run_prefill(q, k, v, causal, fast_math=True)
            check_case(out, lse, q, k, v, causal, kind, masked)


# ---- precision at long context --------------------------------------------------------

LONG = (64, 8192, 64)  # Nq, Nk, D


def _long_case(seed):
    nq, nk, d = LONG
    return make_qkv(1, 1, 1, nq, nk, d, torch.float32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strict_precision_at_8192_keys(causal):
    # FlashAttention's 2x rule with no float32 floor: the kernel's error is
    # at most twice PyTorch's own float32 error (plus the output rounding).
    # One rescale per key block, a blocked P.V sum and a two-level row sum
    # keep it there (attention_prefill.h).
    for seed in (0, 1):
        q, k, v = _long_case(seed)
        out, lse = run_prefill(q, k, v, causal)
        assert_attention_close(out, lse, q, k, v, causal, strict=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_post_tiled_kernel_misses_strict_precision(causal):
    # The comparison point: the post's tiled kernel rescales its accumulator
    # once per key and passes the default rule at Nk = 8192 only through its
    # float32 floor; the strict rule rejects it on the same inputs.
    from backends import emulated_metal_attention

    q, k, v = _long_case(0)
    out, lse = emulated_metal_attention(q, k, v, causal, None, "tiled")
    assert_attention_close(out, lse, q, k, v, causal)
    with pytest.raises(AssertionError, match="max error"):
        assert_attention_close(out, lse, q, k, v, causal, strict=True)
