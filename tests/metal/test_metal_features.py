"""The Metal forward kernels with issue 11's options: attn_mask, sliding
windows, softcap and packed variable-length sequences.

shaders/prefill/attention_prefill.h (FlashAttention-2 prefill) and
shaders/decode/attention_decode.h (one-pass decode, split-KV decode and its merge)
serve every option through the function constants of
shaders/common/attention_features.h. Each run here goes through the op's own plan
(tests/backends.py: the planner chooses the kernel, its function constants
and bindings, exactly as the MPS host launches them) and is compared with
the float64 oracle by FlashAttention's 2x rule (tests/numerics.py).

- Sanitizing build (races, barrier and SIMD divergence, out-of-bounds,
  threadgroup overflow), small ragged shapes: every combination of the
  forward function constants (causal, mask none/bool/additive in q's
  dtype/additive float32, left window, softcap) on each kernel family
  (prefill, decode, decode_split), each dtype, head_dim buckets rotating;
  the aligned prefill with every option; varlen (prefill only) with its
  own combinations; and the counters: K/V
  bytes read with and without a window, mask bytes read exactly once per
  visible (row, key) pair.
- Fast build, wider: every broadcast shape of the mask, in each kind; mask
  plus causal; fully masked rows; windows smaller than a block, straddling
  block edges, left-only, right-only, and windows that leave rows empty;
  softcap with large logits; varlen with empty and length-1 sequences;
  GQA with per-head masks (decode serves a whole GQA group per
  threadgroup); block skipping proven by NaN-poisoned keys outside the
  window.
"""
import itertools
import math

import pytest
import torch

from backends import LAST_DISPATCHES, run_attention, run_varlen
from flash_metal.reference import visible_keys
from numerics import DTYPES, assert_attention_close, assert_varlen_close, dtype_id, make_qkv

SANITIZED = "metal-emu-sanitized"
FAST = "metal-emu"
FAMILIES = ["prefill", "decode", "decode_split"]
MASK_KINDS = [None, "bool", "input", "float32"]
# (BQ, BK) of the prefill instantiation per head_dim bucket (shaders/attention.metal).
PREFILL_BLOCKS = {32: (32, 32), 64: (32, 32), 72: (32, 32), 80: (32, 32), 96: (32, 32), 128: (32, 16),
                  256: (16, 8)}
# float32's key blocks where they differ (choose_metal_kernel: its rows are twice the bytes).
FLOAT_PREFILL_BK = {64: 16, 72: 16, 80: 16, 96: 8}


def prefill_blocks(dtype, bucket):
    bq, bk = PREFILL_BLOCKS[bucket]
    return bq, FLOAT_PREFILL_BK.get(bucket, bk) if dtype == torch.float32 else bk


def bucket_of(d):
    return min(b for b in PREFILL_BLOCKS if b >= d)


def make_mask(kind, shape, q_dtype, g, keep=0.75):
    """A fresh random attn_mask of `shape`: bool (True = attend, `keep` of them),
    or additive (in q's dtype, or float32) with random values and -inf where
    a bool mask would drop."""
    drop = torch.rand(shape, generator=g) >= keep
    if kind == "bool":
        return ~drop
    add = (torch.randn(shape, generator=g) * 2.0).masked_fill(drop, float("-inf"))
    return add.to(q_dtype if kind == "input" else torch.float32)


def family_shape(family, variant):
    """(B, Hq, Hkv, Nq, Nk) per family; variant 0/1 alternates GQA shapes.

    Prefill: ragged Nq and Nk (no aligned block), Nk - Nq large enough that a
    left window skips whole key blocks. Decode: variant 0 is one row
    (a single row group: 8 key groups, unstaged), variant 1 three rows of an
    8:2 GQA group (12 rows: several row groups, staged K/V). Split decode:
    300 keys in two forced splits, so a window leaves the first wholly
    outside (the "no key" partial).
    """
    if family == "prefill":
        return (2, 4, 2, 37, 100)
    nk = 300 if family == "decode_split" else 75
    return (2, 2, 2, 1, nk) if variant == 0 else (1, 8, 2, 3, nk)


def run_checked(backend, q, k, v, causal, impl, **options):
    out, lse = run_attention(backend, q, k, v, causal, None, impl, **options)
    assert_attention_close(out, lse, q, k, v, causal, None, **options)
    return out, lse


def planned(family):
    """The kernel names of the last emulated call, checked against the family asked for."""
    names = [d.kernel_name for d, _ in LAST_DISPATCHES]
    want = {"prefill": ["flash_attention_prefill_"], "decode": ["flash_decode_"],
            "decode_split": ["flash_decode_split_", "flash_decode_merge_"]}[family]
    assert len(names) == len(want) and all(n.startswith(w) for n, w in zip(names, want)), names
    return names


# ---- every function-constant combination, sanitized -------------------------------------------

COMBOS = list(itertools.product([False, True], MASK_KINDS, [False, True], [False, True]))
# head_dim per combination index, rotating through buckets (32, 64, 80, 128, 256) with ragged values.
COMBO_DIMS = [24, 64, 80, 100, 200]


def combo_id(c):
    causal, mask, window, softcap = c
    return "-".join([("causal" if causal else "full"), f"mask_{mask}", ("win" if window else "nowin"),
                     ("cap" if softcap else "nocap")])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_constant_combination_sanitized(family, combo, dtype):
    causal, mask_kind, window, softcap = combo
    i = COMBOS.index(combo) + DTYPES.index(dtype)
    g = torch.Generator().manual_seed(1000 + 97 * i + FAMILIES.index(family))
    B, Hq, Hkv, Nq, Nk = family_shape(family, i % 2)
    D = COMBO_DIMS[i % len(COMBO_DIMS)]
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, generator=g, scale_inputs=2.0 if softcap else 1.0)
    options = {}
    if mask_kind is not None:
        options["attn_mask"] = make_mask(mask_kind, (B, Hq, Nq, Nk), dtype, g)
    if window:
        options["window_left"] = 9  # under a block: row 0's window starts inside a later block
    if softcap:
        options["softcap"] = 3.0
    run_checked(SANITIZED, q, k, v, causal, family, **options)
    names = planned(family)
    d = LAST_DISPATCHES[0][0]
    # The planner's function constants: 0 causal, 4 mask, 5 bool, 6 float32, 7 left window, 8 softcap, 9 varlen.
    fc = d.function_constants
    f32_mask = mask_kind == "float32" and dtype != torch.float32  # a float32 mask on float32 q is "in q's dtype"
    assert (fc[0], fc[4], fc[5], fc[6], fc[7], fc[8], fc[9]) == (
        causal, mask_kind is not None, mask_kind == "bool", f32_mask, window, softcap, False), names


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_aligned_prefill_with_every_option_sanitized(causal, dtype):
    # Nq and Nk multiples of the blocks: the align constants (1, 2) are set,
    # which compiles out the edge tests, the options' included.
    g = torch.Generator().manual_seed(900 + DTYPES.index(dtype) + 3 * causal)
    for D, kind in ((64, "bool"), (128, "input"), (256, "float32")):
        q, k, v = make_qkv(1, 2, 1, 64, 96, D, dtype, generator=g, scale_inputs=2.0)
        mask = make_mask(kind, (1, 2, 64, 96), dtype, g)
        run_checked(SANITIZED, q, k, v, causal, "prefill", attn_mask=mask, window_left=21, softcap=4.0)
        fc = LAST_DISPATCHES[0][0].function_constants
        assert fc[1] and fc[2] and fc[4] and fc[7] and fc[8]


# Varlen sequences (q rows, k rows): an empty query sequence with keys, a
# sequence with queries and no key, length 1, Nq_b < Nk_b, Nq_b > Nk_b, and
# one longer than a query block.
VARLEN_LENGTHS = [(1, 5), (0, 3), (37, 40), (7, 0), (3, 70), (20, 6)]


def packed(lengths, Hq, Hkv, D, dtype, g, scale_inputs=1.0):
    lq = [a for a, _ in lengths]
    lk = [b for _, b in lengths]
    cu_q = torch.tensor([0] + list(itertools.accumulate(lq)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(itertools.accumulate(lk)), dtype=torch.int32)
    q = (torch.randn(sum(lq), Hq, D, generator=g) * scale_inputs).to(dtype)
    k = (torch.randn(sum(lk), Hkv, D, generator=g) * scale_inputs).to(dtype)
    v = torch.randn(sum(lk), Hkv, D, generator=g).to(dtype)
    return q, k, v, cu_q, cu_k, max(lq), max(lk)


VARLEN_COMBOS = list(itertools.product([False, True], [False, True], [False, True]))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("combo", VARLEN_COMBOS, ids=lambda c: "-".join(
    [("causal" if c[0] else "full"), ("win" if c[1] else "nowin"), ("cap" if c[2] else "nocap")]))
def test_varlen_combination_sanitized(combo, dtype):
    causal, window, softcap = combo
    i = VARLEN_COMBOS.index(combo) + DTYPES.index(dtype)
    g = torch.Generator().manual_seed(2000 + 31 * i)
    D = COMBO_DIMS[i % len(COMBO_DIMS)]
    q, k, v, cu_q, cu_k, mq, mk = packed(VARLEN_LENGTHS, 4, 2, D, dtype, g, 2.0 if softcap else 1.0)
    options = {}
    if window:
        options["window_left"] = 4
    if softcap:
        options["softcap"] = 3.0
    out, lse = run_varlen(SANITIZED, q, k, v, cu_q, cu_k, mq, mk, causal, None, "auto", **options)
    assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, causal, None, **options)
    ((d, _),) = LAST_DISPATCHES
    assert d.kernel_name.startswith("flash_attention_prefill_") and d.function_constants[9]
    assert not d.function_constants[1] and not d.function_constants[2]  # no alignment under varlen


# ---- the counters: what a window saves, and where the mask is read ----------------------------

def prefill_kv_rows(Nq, Nk, bq, bk, causal, window_left):
    """K rows the prefill kernel loads per (batch, head): for each query block,
    the key blocks from the one holding its first row's first visible key
    (left window) to the one holding its last row's last (causal), a
    partial last block only up to Nk."""
    rows = 0
    for q0 in range(0, Nq, bq):
        last_row = min(q0 + bq, Nq) - 1
        first = min(max(q0 + Nk - Nq - window_left, 0), Nk) if window_left >= 0 else 0
        end = min(max(last_row + Nk - Nq + 1, 0), Nk) if causal else Nk
        for k0 in range(first // bk * bk, end, bk):
            rows += min(bk, Nk - k0)
    return rows


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=dtype_id)
def test_prefill_window_reads_fewer_kv_bytes(dtype):
    # One head, Nq = Nk = 300, causal with window_left 20: every query block
    # loads only the key blocks its rows' windows touch, so K/V traffic grows
    # with N * window instead of N^2 / 2. Mask bytes: once per visible pair.
    B, H, N, D, W = 1, 1, 300, 64, 20
    g = torch.Generator().manual_seed(5)
    q, k, v = make_qkv(B, H, H, N, N, D, dtype, generator=g)
    mask = make_mask("bool", (N, N), dtype, g)
    bq, bk = prefill_blocks(dtype, bucket_of(D))
    elem = q.element_size()
    read = {}
    for window in (-1, W):
        run_checked(SANITIZED, q, k, v, True, "prefill", attn_mask=mask, window_left=window)
        ((d, c),) = LAST_DISPATCHES
        by_name = {name: c.device_bytes_read_by_index[i] for name, i in d.buffers.items()}
        vis = visible_keys(N, N, True, window)
        assert by_name["k"] == by_name["v"] == prefill_kv_rows(N, N, bq, bk, True, window) * D * elem
        assert by_name["attn_mask"] == int(vis.sum())  # bool: 1 byte per visible (row, key), none elsewhere
        read[window] = by_name["k"]
    # Causal alone: query block b loads keys up to its last row, b + 1
    # blocks (1,740 rows over the 10 query blocks); window 20: the BQ + 20
    # keys a query block's rows see span at most ceil((BQ + 20) / BK) + 1
    # blocks (float16: 3 of 32 keys; float32: 5 of 16).
    assert read[-1] == sum(min(q0 + bq, N) for q0 in range(0, N, bq)) * D * elem
    per_block = math.ceil((bq + W) / bk) + 1
    assert read[W] <= math.ceil(N / bq) * per_block * bk * D * elem and 2 * read[W] < read[-1]


@pytest.mark.parametrize("family", ["decode", "decode_split"])
def test_decode_window_reads_only_the_window(family):
    # 1100 keys, Nq 2 of an 8:2 GQA group, window_left 40: the decode kernels
    # read K/V only from row 0's first visible key on, once per (batch, kv
    # head) for all rows from DRAM (the emulator's bytes new to a
    # threadgroup) and once per row group (2 of 4 rows) by the loads; the
    # split kernel's splits before the window read nothing. The mask (per
    # query head) is read once per visible pair.
    B, Hq, Hkv, Nq, Nk, D, W = 1, 8, 2, 2, 1100, 64, 40
    g = torch.Generator().manual_seed(6)
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, torch.float16, generator=g)
    mask = make_mask("float32", (B, Hq, Nq, Nk), torch.float16, g)
    for window in (-1, W):
        run_checked(SANITIZED, q, k, v, False, family, attn_mask=mask, window_left=window)
        planned(family)
        d, c = LAST_DISPATCHES[0]
        by_name = {name: c.device_bytes_read_by_index[i] for name, i in d.buffers.items()}
        dram = {name: c.device_unique_bytes_read_by_index[i] for name, i in d.buffers.items()}
        vis = visible_keys(Nq, Nk, False, window)
        first = int(vis[0].nonzero().min())
        assert dram["k"] == dram["v"] == B * Hkv * (Nk - first) * D * 2
        assert by_name["k"] == by_name["v"] == 2 * dram["k"]
        assert by_name["attn_mask"] == 4 * B * Hq * int(vis.sum())
        if family == "decode_split":
            assert d.grid[2] > 2  # several splits, so some lie wholly behind the window


# ---- masks: every broadcast shape, every kind ------------------------------------------------

def mask_shapes(B, Hq, Nq, Nk):
    return [(Nq, Nk), (1, 1, Nq, Nk), (B, 1, Nq, Nk), (1, Hq, Nq, Nk), (B, Hq, Nq, Nk), (B, 1, 1, Nk), (Nk,),
            (Nq, 1), (B, Hq, Nq, 1), (1, Hq, 1, Nk)]


FAST_SHAPES = {"prefill": (2, 4, 2, 45, 70), "decode": (2, 8, 2, 3, 70), "decode_split": (2, 4, 1, 5, 600)}


@pytest.mark.parametrize("kind", MASK_KINDS[1:])
@pytest.mark.parametrize("family", FAMILIES)
def test_mask_broadcast_shapes(family, kind):
    B, Hq, Hkv, Nq, Nk = FAST_SHAPES[family]
    g = torch.Generator().manual_seed(60 + 4 * FAMILIES.index(family) + MASK_KINDS.index(kind))
    for n, shape in enumerate(mask_shapes(B, Hq, Nq, Nk)):
        dtype = DTYPES[n % 3]
        q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, 40, dtype, generator=g)
        mask = make_mask(kind, shape, dtype, g)
        run_checked(FAST, q, k, v, n % 2 == 1, family, attn_mask=mask)
        planned(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_mask_views_strided_and_expanded(family):
    # The mask is read through its strides: a transposed buffer, a slice of
    # a larger one, and an expand()ed stride-0 view passed as is.
    B, Hq, Hkv, Nq, Nk = FAST_SHAPES[family]
    g = torch.Generator().manual_seed(11)
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, 64, torch.float16, generator=g)
    transposed = make_mask("input", (B, Hq, Nk, Nq), torch.float16, g).transpose(2, 3)
    sliced = make_mask("bool", (B + 1, Hq, Nq + 3, 2 * Nk), torch.float16, g)[1:, :, 2:Nq + 2, ::2]
    expanded = make_mask("float32", (B, 1, 1, Nk), torch.float16, g).expand(B, Hq, Nq, Nk)
    for mask in (transposed, sliced, expanded):
        for causal in (False, True):
            run_checked(FAST, q, k, v, causal, family, attn_mask=mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("family", FAMILIES)
def test_fully_masked_rows_are_zero_and_minus_inf(family, dtype):
    # Rows whose every key is masked: by a bool False, by float32's finfo.min
    # (below the masked-key threshold), by -inf in q's dtype, and by causal
    # plus a mask that drops the few keys the row may see. Out 0, lse -inf,
    # never NaN; the other rows are unaffected.
    B, Hq, Hkv, Nq, Nk = FAST_SHAPES[family]
    g = torch.Generator().manual_seed(12 + DTYPES.index(dtype))
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, 32, dtype, generator=g)
    dead = torch.zeros(B, Hq, Nq, dtype=torch.bool)
    dead[0, 1, 0] = dead[B - 1, Hq - 1, Nq - 1] = dead[0, 0, Nq // 2] = True
    cases = []
    bool_mask = make_mask("bool", (B, Hq, Nq, Nk), dtype, g) & ~dead.unsqueeze(-1)
    cases.append((False, bool_mask))
    lowest = torch.finfo(torch.float32).min
    f32 = make_mask("float32", (B, Hq, Nq, Nk), dtype, g).masked_fill(dead.unsqueeze(-1), lowest)
    cases.append((True, f32))
    same = make_mask("input", (B, Hq, Nq, Nk), dtype, g).masked_fill(dead.unsqueeze(-1), float("-inf"))
    cases.append((False, same))
    # Causal with Nk - Nq = off: row i sees keys <= i + off; drop exactly those for the dead rows.
    off = Nk - Nq
    seen = torch.arange(Nk).unsqueeze(0) <= torch.arange(Nq).unsqueeze(1) + off
    cases.append((True, ~(dead.unsqueeze(-1) & seen)))
    for causal, mask in cases:
        out, lse = run_checked(FAST, q, k, v, causal, family, attn_mask=mask)
        assert torch.equal(out[dead], torch.zeros_like(out[dead]))
        assert torch.isneginf(lse[dead]).all() and torch.isfinite(lse[~dead]).all()


@pytest.mark.parametrize("family", ["prefill", "decode"])
def test_gqa_mask_is_read_per_query_head(family):
    # Each query head's mask lets through one key only, different per head,
    # so each head's output is exactly that key's value row: a mask read
    # with the kv head's (or another row's) slice gives another row of v.
    B, Hq, Hkv, Nq, Nk = (1, 8, 2, 40, 50) if family == "prefill" else (1, 8, 2, 3, 50)
    g = torch.Generator().manual_seed(13)
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, 32, torch.float32, generator=g)
    key_of = torch.randint(Nk, (Hq, Nq), generator=g)
    mask = torch.zeros(B, Hq, Nq, Nk, dtype=torch.bool)
    mask[0, torch.arange(Hq).unsqueeze(1), torch.arange(Nq).unsqueeze(0), key_of] = True
    out, _ = run_checked(FAST, q, k, v, False, family, attn_mask=mask)
    group = Hq // Hkv
    want = v[0, torch.arange(Hq).unsqueeze(1) // group, key_of]
    torch.testing.assert_close(out[0], want, rtol=1e-6, atol=1e-6)


# ---- windows ---------------------------------------------------------------------------------

# (causal, window_left, window_right): smaller than a block, straddling block
# edges, left-only, right-only, both, the diagonal alone, and windows wider
# than the keys.
WINDOWS = [(True, 3, -1), (True, 40, -1), (False, 5, -1), (False, 33, -1), (False, -1, 4), (False, -1, 35),
           (False, 6, 2), (False, 0, 0), (True, 0, -1), (False, 500, 500), (False, 17, 31)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("family", FAMILIES)
def test_windows(family, dtype):
    B, Hq, Hkv, Nq, Nk = FAST_SHAPES[family]
    g = torch.Generator().manual_seed(20 + DTYPES.index(dtype))
    for n, (causal, left, right) in enumerate(WINDOWS):
        q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, [24, 64, 128][n % 3], dtype, generator=g)
        run_checked(FAST, q, k, v, causal, family, window_left=left, window_right=right)


@pytest.mark.parametrize("family", ["prefill", "decode"])
def test_windows_that_leave_rows_empty(family):
    # Nk < Nq, bottom-right aligned: with a right window of 1 the first
    # Nq - Nk - 1 rows see no key at all (zeros, -inf), the others a few.
    Nq, Nk = (70, 20) if family == "prefill" else (8, 3)
    g = torch.Generator().manual_seed(21)
    q, k, v = make_qkv(1, 2, 1, Nq, Nk, 32, torch.float16, generator=g)
    for left, right in ((2, 1), (-1, 1), (0, 0)):
        out, lse = run_checked(FAST, q, k, v, False, family, window_left=left, window_right=right)
        empty = Nq - Nk - right
        assert torch.isneginf(lse[:, :, :empty]).all() and (out[:, :, :empty] == 0).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_windows_near_the_int32_limit(family):
    # The op takes windows up to 2^31 - 1: the bounds (Nk - Nq +- window)
    # must not overflow int32 in the kernels, with Nk > Nq and Nk < Nq.
    big = 2**31 - 1
    g = torch.Generator().manual_seed(23)
    shapes = [FAST_SHAPES[family], (1, 2, 1, 45, 20) if family == "prefill" else (1, 2, 1, 8, 3)]
    for B, Hq, Hkv, Nq, Nk in shapes:
        q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, 32, torch.float32, generator=g)
        for left, right in ((big, big), (big, -1), (-1, big), (big, 0), (0, big)):
            run_checked(FAST, q, k, v, False, family, window_left=left, window_right=right)


@pytest.mark.parametrize("family", FAMILIES)
def test_window_combined_with_mask_and_softcap(family):
    B, Hq, Hkv, Nq, Nk = FAST_SHAPES[family]
    g = torch.Generator().manual_seed(22)
    for n, dtype in enumerate(DTYPES):
        q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, 80, dtype, generator=g, scale_inputs=3.0)
        mask = make_mask(MASK_KINDS[1 + n], (B, 1, Nq, Nk), dtype, g)
        run_checked(FAST, q, k, v, n == 1, family, attn_mask=mask, window_left=12, window_right=7, softcap=5.0)


# ---- softcap ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("family", FAMILIES)
def test_softcap_with_large_logits(family, dtype):
    # Inputs scaled by 8 (D = 64: raw scores in the tens to hundreds): the
    # cap decides the softmax. Caps of 1 (everything saturates), 20 and
    # Gemma 2's 50.
    B, Hq, Hkv, Nq, Nk = FAST_SHAPES[family]
    g = torch.Generator().manual_seed(30 + DTYPES.index(dtype))
    for n, cap in enumerate((1.0, 20.0, 50.0)):
        q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, 64, dtype, generator=g, scale_inputs=8.0)
        run_checked(FAST, q, k, v, n == 1, family, softcap=cap)


# ---- varlen ----------------------------------------------------------------------------------

VARLEN_SETS = [
    [(1, 1)],
    [(0, 0), (5, 5), (0, 7)],
    [(1, 70), (70, 1), (33, 33), (0, 4), (4, 0)],
    [(40, 100), (100, 40), (1, 1), (64, 64), (2, 3)],
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("lengths", range(len(VARLEN_SETS)), ids=lambda i: f"set{i}")
def test_varlen_sequences(lengths, dtype):
    g = torch.Generator().manual_seed(40 + lengths)
    opts = [dict(), dict(causal=True), dict(window_left=8), dict(causal=True, window_left=20, softcap=4.0),
            dict(window_left=3, window_right=5), dict(softcap=2.0)]
    for n, o in enumerate(opts):
        o = dict(o)
        causal = o.pop("causal", False)
        q, k, v, cu_q, cu_k, mq, mk = packed(VARLEN_SETS[lengths], 4, [1, 2, 4][n % 3], [32, 72, 128][n % 3], dtype, g)
        out, lse = run_varlen(FAST, q, k, v, cu_q, cu_k, mq, mk, causal, None, "auto", **o)
        assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, causal, None, **o)


def nan_after(t, rows):
    """t's values in a view whose storage holds `rows` more rows of NaN after it."""
    return torch.cat([t, torch.full((rows,) + t.shape[1:], float("nan"), dtype=t.dtype)])[: t.shape[0]]


def test_varlen_reads_only_its_own_rows():
    # Each sequence starts at its own row (cu_seqlens) through the row
    # stride: once packed (total, H, D), and once as a (H, total, D) buffer
    # seen as (total, H, D), so the row stride is D, not H * D. The storage
    # holds NaN rows after the last sequence: a kernel that reads past a
    # sequence's end picks them up (or another sequence's rows, which the
    # oracle catches).
    g = torch.Generator().manual_seed(41)
    lengths = [(9, 30), (33, 2), (1, 65)]
    q, k, v, cu_q, cu_k, mq, mk = packed(lengths, 2, 2, 48, torch.float32, g)
    heads_outer = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v)]
    for q, k, v in ((nan_after(t, 40) for t in (q, k, v)), heads_outer):
        assert q.stride(0) in (q.shape[1] * q.shape[2], q.shape[2])
        for causal in (False, True):
            out, lse = run_varlen(FAST, q, k, v, cu_q, cu_k, mq, mk, causal, window_left=20)
            assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, causal, window_left=20)


# ---- block skipping, proven by poison -------------------------------------------------------

def poison_before(t, first):
    """t with rows [0, first) of every head set to NaN (a kernel that reads them outputs NaN)."""
    t = t.clone()
    t[:, :, :first] = float("nan")
    return t


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_prefill_skips_key_blocks_behind_the_window(dtype):
    # Nq 40 over Nk 300, window_left 30: row 0's first visible key is
    # 300 - 40 - 30 = 230, so for every query block the key blocks before
    # 230's block are outside every row's window. NaN there (K and V) must
    # not reach the output: a block a SIMD-group multiplies puts
    # 0 * NaN = NaN into P.V. (This proves such blocks never enter the
    # math; that they are not even loaded, the byte counts of
    # test_prefill_window_reads_fewer_kv_bytes prove: a block loaded but
    # skipped by every SIMD-group would pass here.)
    Nq, Nk, W = 40, 300, 30
    g = torch.Generator().manual_seed(50 + DTYPES.index(dtype))
    for D in (64, 128, 256):
        bk = prefill_blocks(dtype, D)[1]
        q, k, v = make_qkv(1, 2, 1, Nq, Nk, D, dtype, generator=g)
        first = (Nk - Nq - W) // bk * bk
        k_bad, v_bad = poison_before(k, first), poison_before(v, first)
        for causal in (False, True):
            out, lse = run_attention(FAST, q, k_bad, v_bad, causal, None, "prefill", window_left=W)
            assert_attention_close(out, lse, q, k, v, causal, None, window_left=W)


@pytest.mark.parametrize("family", ["decode", "decode_split"])
def test_decode_never_reads_keys_behind_the_window(family):
    # Decode starts at row 0's first visible key exactly (blocks of 32 keys
    # start there): every key before it may be NaN, across splits too.
    Nq, Nk, W = 4, 700, 50
    g = torch.Generator().manual_seed(51)
    q, k, v = make_qkv(2, 8, 2, Nq, Nk, 64, torch.bfloat16, generator=g)
    first = Nk - Nq - W
    k_bad, v_bad = poison_before(k, first), poison_before(v, first)
    for causal in (False, True):
        mask = make_mask("input", (2, 8, Nq, Nk), torch.bfloat16, g)
        out, lse = run_attention(FAST, q, k_bad, v_bad, causal, None, family, window_left=W, attn_mask=mask)
        assert_attention_close(out, lse, q, k, v, causal, None, window_left=W, attn_mask=mask)
        planned(family)


# ---- fast math: masked keys stay masked when the compiler assumes no infinity -------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_masks_and_softcap_under_fast_math(family):
    # Apple's compiler defaults to fast math (no value is ever infinite). An
    # additive -inf (or float32's finfo.min, which overflows to -inf in base
    # 2) must still drop its key, fully masked rows still give 0 and -inf,
    # and softcap's tanh must saturate cleanly (tests/metal/test_fast_math.py).
    B, Hq, Hkv, Nq, Nk = FAST_SHAPES[family]
    g = torch.Generator().manual_seed(70 + FAMILIES.index(family))
    dead = torch.zeros(B, Hq, Nq, 1, dtype=torch.bool)
    dead[0, 1, 0] = True
    for n, dtype in enumerate(DTYPES):
        q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, 64, dtype, generator=g, scale_inputs=4.0)
        kind = ["float32", "input", "bool"][n]
        mask = make_mask(kind, (B, Hq, Nq, Nk), dtype, g)
        mask = mask & ~dead if kind == "bool" else mask.masked_fill(dead, torch.finfo(torch.float32).min
                                                                    if kind == "float32" else float("-inf"))
        out, lse = run_checked("metal-emu-fast-math", q, k, v, n == 1, family, attn_mask=mask, window_left=30,
                               softcap=10.0)
        assert torch.isneginf(lse[dead[..., 0]]).all() and (out[dead[..., 0]] == 0).all()
