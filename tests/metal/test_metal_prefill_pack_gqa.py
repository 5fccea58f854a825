"""The prefill's pack GQA (fc_pack_gqa; issue 20, section 4).

With G = Hq / Hkv > 1 and a short chunk of queries (2 * Nq <= BQ: one head's
rows fill at most half a block) the planner (csrc/metal/families/prefill.cpp,
prefill_pack_gqa) launches the prefill kernel with one threadgroup per (batch, kv head, block
of BQ packed rows), packed row m being query row m / G of query head
kv * G + m % G (shaders/prefill/attention_prefill.h), so the group's heads share the
K/V tiles a threadgroup loads. An idea of FlashAttention-3's and
FlashInfer's; the code is the project's own. Longer queries are not packed
(the Metal model predicts it level or slower there), but the kernel takes any
Nq: packed_plan forces it, so the tests cover ragged multi-block packing too.

Every kernel case runs in the emulator's sanitizing build (races, bounds)
with outputs poisoned with NaN (tests/backends.py), fresh random inputs, and
is compared with the float64 oracle (2x rule). The unpacked baseline is the
same kernel with fc_pack_gqa false on the grid it had before (unpacked_plan):
integrate's launch, run in the same test for the byte counts and the
bit-for-bit comparison.
"""
import math
import shutil

import pytest
import torch

import flash_metal
from backends import LAST_DISPATCHES, SHADER, _run_plan, emulated_metal_attention, emulated_metal_kvcache
from backends import emulated_metal_varlen
from numerics import assert_attention_close, assert_varlen_close, make_qkv
from test_metal_decode_paged import check_against_oracle, make_paged_cache
from repo_paths import ROOT_DIR

PACK, ALIGN_Q, DENSE, VARLEN = 13, 1, 10, 9  # kPackGqa / kAlignQ / kDense / kVarlen FunctionConstant (csrc/metal/plan.h)


def blocks(d):
    """(block_q, block_k) of a prefill dispatch, from its kernel name."""
    name = d.kernel_name
    return int(name.split("_bq")[1].split("_")[0]), int(name.split("_bk")[1].split("_")[0])


def unpacked_plan(plan, hq, nq, varlen=False):
    """The same plan with fc_pack_gqa false on the unpacked grid (ceil(Nq / BQ), Hq, B) and align_q for Nq
    (the launch integrate made before packing): the baseline."""
    d = plan.dispatches[0]
    bq, _ = blocks(d)
    fc = list(d.function_constants)
    fc[PACK] = False
    fc[ALIGN_Q] = not varlen and nq % bq == 0
    grid = (math.ceil(nq / bq), hq, d.grid[2])
    return plan._replace(dispatches=(d._replace(function_constants=tuple(fc), grid=grid),))


def packed_plan(plan, hq, hkv, nq):
    """The same prefill plan with fc_pack_gqa forced on its packed grid (ceil(Nq * G / BQ), Hkv, B) and align_q
    over the packed rows: the kernel at a length the planner does not pack (contiguous, not varlen)."""
    d = plan.dispatches[0]
    bq, _ = blocks(d)
    fc = list(d.function_constants)
    fc[PACK] = True
    fc[ALIGN_Q] = nq * (hq // hkv) % bq == 0
    grid = (math.ceil(nq * (hq // hkv) / bq), hkv, d.grid[2])
    return plan._replace(dispatches=(d._replace(function_constants=tuple(fc), grid=grid),))


def assert_packed(plan, hq, hkv, nq, batch, routed=True):
    """The plan runs the packed prefill: constant, grid and (routed) the reason."""
    d = plan.dispatches[0]
    assert len(plan.dispatches) == 1 and d.kernel_name.startswith("flash_attention_prefill_"), d.kernel_name
    assert "mpp" not in d.kernel_name
    bq, _ = blocks(d)
    g = hq // hkv
    assert len(d.function_constants) == 14 and d.function_constants[PACK], d.function_constants
    assert d.grid == (math.ceil(nq * g / bq), hkv, batch), d.grid
    assert d.function_constants[ALIGN_Q] == (not d.function_constants[VARLEN] and nq * g % bq == 0)
    assert ("pack GQA (fc_pack_gqa)" in plan.reason) == routed, plan.reason
    return d


# ---- routing (no emulator) -----------------------------------------------------------------

def _explain(b, hq, hkv, nq, nk, d, dtype=torch.float16, **kw):
    one = torch.empty(1, 1, 1, d, dtype=dtype)
    return flash_metal.explain(one.expand(b, hq, nq, d), one.expand(b, hkv, nk, d), one.expand(b, hkv, nk, d),
                               True, None, kw.pop("impl", "auto"), **kw)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2), (32, 1)])
def test_routing_packs_short_gqa_prefills(hq, hkv):
    # Contiguous, impl='prefill' too. G = 1 does not pack (nothing to share), nor does Nq past half a block
    # (BQ 32 here): both keep (ceil(Nq / BQ), Hq, B), the second saying why.
    for nq in (9, 16, 17, 40, 64):
        for impl in ("auto", "prefill"):
            plan = _explain(2, hq, hkv, nq, 100, 64, impl=impl)
            d = plan.dispatches[0]
            bq, _ = blocks(d)
            assert bq == 32
            if hq == hkv or 2 * nq > bq:
                assert not d.function_constants[PACK] and d.grid == (math.ceil(nq / bq), hq, 2)
                assert "pack GQA" not in plan.reason
                assert ("GQA heads not packed (Nq = %d fills more than half a block" % nq in plan.reason) == (hq != hkv)
            else:
                assert_packed(plan, hq, hkv, nq, 2)
                bq, _ = blocks(d)
                g = hq // hkv
                # The reason gives both threadgroup counts, and packing never adds one.
                assert (f"{math.ceil(nq * g / bq) * hkv} threadgroups per batch read the K/V they see instead "
                        f"of {math.ceil(nq / bq) * hq}") in plan.reason, plan.reason
                assert math.ceil(nq * g / bq) * hkv <= math.ceil(nq / bq) * hq


def test_routing_packs_paged_and_varlen_prefills():
    # attention_kvcache's prefill (Nq > 8), packed queries with and without a table.
    q = torch.randn(2, 8, 12, 64).half()
    cache = torch.randn(6, 16, 2, 64).half()
    table = torch.tensor([[0, 2], [5, 1]], dtype=torch.int32)
    lengths = torch.tensor([30, 17], dtype=torch.int32)
    plan = flash_metal.explain(q, cache, cache, True, None, "auto", block_table=table, cache_seqlens=lengths)
    assert_packed(plan, 8, 2, 12, 2)
    assert "for all the GQA group's heads" in plan.reason, plan.reason
    qp, kp = torch.randn(20, 8, 64).half(), torch.randn(30, 2, 64).half()
    cu_q, cu_k = torch.tensor([0, 9, 20], dtype=torch.int32), torch.tensor([0, 13, 30], dtype=torch.int32)
    plan = flash_metal.explain(qp, kp, kp, True, None, "auto", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                               max_seqlen_q=11, max_seqlen_k=17)
    d = assert_packed(plan, 8, 2, 11, 2)
    assert d.function_constants[VARLEN] and "each sequence's queries pack the same way" in plan.reason
    plan = flash_metal.explain(qp, cache, cache, True, None, "auto", cu_seqlens_q=cu_q, max_seqlen_q=11,
                               block_table=table, cache_seqlens=lengths)
    assert_packed(plan, 8, 2, 11, 2)
    # The decode kernels keep their own GQA sharing (Nq <= 8): no prefill, no fc_pack_gqa.
    plan = _explain(1, 8, 2, 4, 100, 64)
    assert plan.dispatches[0].kernel_name.startswith("flash_decode") and "pack GQA" not in plan.reason


# ---- the kernel against the float64 oracle ------------------------------------------------------

# (B, Hq, Hkv, Nq, Nk, D, dtype, layout, causal, window_left, softcap, sinks, mask). Small ragged shapes
# (CI time); blocks (csrc/metal/families/prefill.cpp): D 32 float32 bq 32 bk 32, D 64 half/bfloat16 bq 32 bk 32.
CASES = [
    # G = 2, causal, BNHD layout (q's dense loader reads packed rows from two heads), two batches
    (2, 4, 2, 13, 29, 32, torch.float32, "transposed", True, -1, 0.0, False, False),
    # G = 4, causal left window, sinks per query head, strided views (the general per-element loader)
    (1, 8, 2, 9, 40, 64, torch.float16, "offset_slice", True, 7, 0.0, True, False),
    # G = 4, one kv head, softcap, not causal; Nq * G = 44 packed rows: a ragged second block
    (1, 4, 1, 11, 21, 64, torch.bfloat16, "contiguous", False, -1, 20.0, False, False),
    # G = 2, a bool mask of its own per query head (the mask slice follows each packed row's head)
    (1, 4, 2, 10, 37, 32, torch.float16, "contiguous", False, -1, 0.0, False, True),
    # G = 2, Nk < Nq causal: the first rows see no key (zeros, lse -inf) in a packed block mixing heads
    (1, 2, 1, 16, 9, 32, torch.float32, "contiguous", True, -1, 0.0, False, False),
]


def _case_id(c):
    B, Hq, Hkv, Nq, Nk, D, dtype, layout, causal, wl, cap, sinks, mask = c
    return (f"{str(dtype)[6:]}-d{D}-h{Hq}/{Hkv}-q{Nq}-k{Nk}-{layout}{'-causal' if causal else ''}"
            f"{f'-wl{wl}' if wl >= 0 else ''}{f'-cap{cap:g}' if cap else ''}{'-sinks' if sinks else ''}"
            f"{'-mask' if mask else ''}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_packed_prefill_against_oracle(case):
    B, Hq, Hkv, Nq, Nk, D, dtype, layout, causal, wl, cap, with_sinks, with_mask = case
    g = torch.Generator().manual_seed(Nq * 31 + Nk + D)
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, layout, g)
    options = dict(window_left=wl, softcap=cap)
    if with_sinks:
        options["sinks"] = torch.randn(Hq, generator=g)
    if with_mask:
        options["attn_mask"] = torch.rand(B, Hq, Nq, Nk, generator=g) > 0.3
    plan = flash_metal.explain(q, k, v, causal, None, "auto", **options)
    d = assert_packed(plan, Hq, Hkv, Nq, B)
    assert d.function_constants[DENSE] == (layout != "offset_slice")
    out, lse = emulated_metal_attention(q, k, v, causal, instrumented=True, **options)
    ran = LAST_DISPATCHES[0][0]
    assert (ran.kernel_name, ran.grid, ran.function_constants) == (d.kernel_name, d.grid, d.function_constants)
    assert not out.isnan().any() and not lse.isnan().any()  # every element written (poisoned with NaN)
    assert_attention_close(out, lse, q, k, v, causal, **options)


def test_packed_paged_prefill_against_oracle():
    # G = 4 through a scattered, shuffled cache (5-key pages: tiles cross pages, the row-by-row loader),
    # unused entries out of range and rows past a sequence NaN; causal window, sinks.
    g = torch.Generator().manual_seed(41)
    B, Hq, Hkv, Nq, D, dtype, page, seqlens = 2, 8, 2, 10, 32, torch.float16, 5, [33, 12]
    k_cache, v_cache, table, k_contig, v_contig = make_paged_cache(B, Hkv, D, dtype, page, seqlens, g)
    q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype)
    sinks = torch.randn(Hq, generator=g)
    lengths = torch.tensor(seqlens, dtype=torch.int32)
    plan = flash_metal.explain(q, k_cache, v_cache, True, None, "auto", block_table=table, cache_seqlens=lengths,
                               window_left=6, sinks=sinks)
    assert_packed(plan, Hq, Hkv, Nq, B)
    out, lse = emulated_metal_kvcache(q, k_cache, v_cache, lengths, table, True, instrumented=True, window_left=6,
                                      sinks=sinks)
    assert LAST_DISPATCHES[0][0].function_constants[PACK]
    assert not out.isnan().any() and not lse.isnan().any()
    check_against_oracle(out, lse, q, k_contig, v_contig, seqlens, True, 6, sinks)


def test_packed_varlen_prefill_against_oracle():
    # G = 2, packed queries of their own lengths (an empty one, one longer than its keys), causal.
    g = torch.Generator().manual_seed(43)
    q_lens, k_lens, Hq, Hkv, D = [7, 0, 15, 4], [30, 5, 12, 9], 4, 2, 32
    cu = lambda n: torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    q = torch.randn(sum(q_lens), Hq, D, generator=g)
    k, v = torch.randn(sum(k_lens), Hkv, D, generator=g), torch.randn(sum(k_lens), Hkv, D, generator=g)
    out, lse = emulated_metal_varlen(q, k, v, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens), True,
                                     instrumented=True)
    d = LAST_DISPATCHES[0][0]
    assert d.function_constants[PACK] and d.function_constants[VARLEN]
    assert d.grid == (math.ceil(max(q_lens) * 2 / blocks(d)[0]), Hkv, len(q_lens)), d.grid
    assert not out.isnan().any() and not lse.isnan().any()
    assert_varlen_close(out, lse, q, k, v, cu(q_lens), cu(k_lens), True)


# ---- K/V bytes: once per (packed query block, kv head) threadgroup -------------------------------------

def run_plan(plan, q, k, v, table=None, lengths=None, instrumented=True, library=None):
    """One prefill plan of (B, Hq, Nq, D) q on k and v (4-D tensors, or paged caches with their table and
    lengths, bound as the MPS host binds them) in the emulator, outputs poisoned with NaN: (out, lse, counts).
    library: a planted copy's library instead of the shipped one. The model's paged family
    (benchmarks/model/families/paged.py, pack_rows) runs the packed and unpacked plans through it."""
    B, H, N, _ = q.shape
    out = torch.full((B, H, N, v.shape[-1]), float("nan"), dtype=q.dtype)
    lse = torch.full((B, H, N), float("nan"))
    tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "attn_mask": q, "cu_seqlens_q": q,
               "cu_seqlens_k": q, "sinks": q, "block_table": q if table is None else table,
               "cache_seqlens": q if lengths is None else lengths}
    if library is None:
        _run_plan(plan, tensors, instrumented, False)
        return out, lse, LAST_DISPATCHES[0][1]
    d = plan.dispatches[0]
    counts = library.dispatch(d.kernel_name, buffers={i: tensors[n] for n, i in d.buffers.items()},
                              bytes={d.params_index: d.params}, function_constants=dict(enumerate(d.function_constants)),
                              grid=d.grid, threadgroup=d.threadgroup,
                              threadgroup_memory={d.threadgroup_memory_index: d.threadgroup_memory})
    return out, lse, counts


@pytest.mark.parametrize("nq", [16, 40], ids=["group-in-one-block", "ragged"])
def test_kv_bytes_once_per_packed_block_and_kv_head(nq):
    """Not causal, so every threadgroup reads every key of its kv head: K and V bytes (unique == raw, exact)
    are one read per (packed query block, kv head) threadgroup. Nq = 16, G = 2, BQ = 32: the whole GQA group
    is one block, each K/V byte read once per group (G times less than unpacked); Nq = 40: 3 packed blocks
    per kv head instead of 2 blocks per query head (4 per group), forced (the planner packs Nq <= 16 only).
    The unpacked baseline (fc_pack_gqa false)
    in the same run gives the same output bit for bit (each row's products and softmax are unchanged)."""
    g = torch.Generator().manual_seed(50 + nq)
    B, Hq, Hkv, Nk, D = 1, 4, 2, 45, 32
    q, k, v = make_qkv(B, Hq, Hkv, nq, Nk, D, torch.float32, "contiguous", g)
    plan = flash_metal.explain(q, k, v, False)
    if nq > 16:
        assert "GQA heads not packed" in plan.reason, plan.reason
        plan = packed_plan(plan, Hq, Hkv, nq)
    d = assert_packed(plan, Hq, Hkv, nq, B, routed=nq <= 16)
    bq, _ = blocks(d)
    out, lse, packed = run_plan(plan, q, k, v)
    out0, lse0, unpacked = run_plan(unpacked_plan(plan, Hq, nq), q, k, v)
    assert not out.isnan().any() and torch.equal(out, out0) and torch.equal(lse, lse0)
    assert_attention_close(out, lse, q, k, v, False)
    per_head = Nk * D * 4
    readers = math.ceil(nq * 2 / bq) * Hkv
    readers0 = math.ceil(nq / bq) * Hq
    assert (readers, readers0) == ((2, 4) if nq == 16 else (6, 8))
    for buf in (1, 2):
        assert packed.device_unique_bytes_read_by_index[buf] == packed.device_bytes_read_by_index[buf] \
            == readers * per_head
        assert unpacked.device_bytes_read_by_index[buf] == readers0 * per_head
    # Q and the outputs: each element once either way (packing moves rows between threadgroups only).
    assert packed.device_bytes_read_by_index[0] == unpacked.device_bytes_read_by_index[0] == q.numel() * 4
    assert packed.device_bytes_written_by_index[3] == unpacked.device_bytes_written_by_index[3] == out.numel() * 4
    # Causal with a left window: packed blocks skip other key blocks than unpacked ones, yet a row's visible
    # keys are one run, so the blocks either grouping adds or skips for it are all masked (weight 0, alpha 1):
    # bit for bit equal still.
    plan = flash_metal.explain(q, k, v, True, window_left=9)
    if nq > 16:
        plan = packed_plan(plan, Hq, Hkv, nq)
    out, lse, _ = run_plan(plan, q, k, v)
    out0, lse0, _ = run_plan(unpacked_plan(plan, Hq, nq), q, k, v)
    assert plan.dispatches[0].function_constants[PACK] and not out.isnan().any()
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


# ---- planted bugs -------------------------------------------------------------------------------------

PLANTS = {
    # a packed row's output stored to the wrong head of its group (heads reversed): every element written
    "wrong-head-store": ("int64_t(hoff) * p.o_head_stride", "int64_t(G - 1 - hoff) * p.o_head_stride"),
    # the key bounds from packed rows instead of query rows: causal blocks wrongly skipped or visited
    "packed-row-bounds": ("  const int sg_qlast = (sg_row0 + 7) / G;", "  const int sg_qlast = sg_qfirst;"),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_planted_bug_fails(plant, tmp_path):
    """A copy of shaders/ with one planted bug, built as a partial library of the one kernel the case runs
    (compile_library(only=...)): the oracle comparison fails where the shipped kernel passes."""
    from metal_emulator import compile_library
    from numerics import NotClose

    old, new = PLANTS[plant]
    shutil.copytree(SHADER.rsplit("/", 1)[0], tmp_path / "shaders")
    header = tmp_path / "shaders" / "prefill" / "attention_prefill.h"
    text = header.read_text()
    assert text.count(old) == 1, plant
    header.write_text(text.replace(old, new))
    g = torch.Generator().manual_seed(60)
    # causal, two key blocks: a SIMD-group's last query rows see block 1 where its first do not
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 40, 70, 32
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, torch.float32, "contiguous", g)
    plan = packed_plan(flash_metal.explain(q, k, v, True), Hq, Hkv, Nq)  # forced: 3 packed blocks
    d = assert_packed(plan, Hq, Hkv, Nq, B, routed=False)
    lib = compile_library([str(tmp_path / "shaders" / "attention.metal")], only=[d.kernel_name])
    out, lse, _ = run_plan(plan, q, k, v)  # the shipped kernel passes
    assert_attention_close(out, lse, q, k, v, True)
    out, lse, _ = run_plan(plan, q, k, v, library=lib)
    with pytest.raises(NotClose):
        assert_attention_close(out, lse, q, k, v, True)


# ---- the Metal model prices the packed launch ----------------------------------------------------------

def test_model_prices_the_packed_grid():
    """The model's FlashAttention-2 I/O model (benchmarks/model/core/iomodel.py) and the timing model's key
    blocks follow the packed grid: K/V bytes equal to the emulator's exact counts (not causal) and within 10 %
    (causal), one key block list entry per packed block, and the scaling rule's unit a kv head with its G query
    heads."""
    import os
    import sys

    sys.path.insert(0, ROOT_DIR)
    from benchmarks.model.core import counts as M
    from benchmarks.model.core import iomodel as IO
    from benchmarks.model.core import timing as T

    s = M.Shape(1, 4, 2, 16, 200, 32)
    for causal in (False, True):
        recs = M.emulate("prefill", s, torch.float16, causal)
        assert T.packed_group(recs[0], s) == 2 and M.pack_group("prefill", s, torch.float16, causal) == 2
        measured, model = IO.io_row("prefill", s, torch.float16, causal, recs)
        assert measured == model if not causal else 1.0 <= measured / model <= 1.10, (causal, measured, model)
        # the unpacked model would price 4 query heads x 1 block: twice the packed bytes (2 kv heads x 1) here
        assert IO.fa2_kv_bytes(s, 2, 32, False) == IO.fa2_kv_bytes(s, 2, 32, False, 2) * 2
        blocks, bk = T.key_blocks(recs[0].kernel, s, causal, 2)
        assert len(blocks) == math.ceil(16 * 2 / 32) and bk == blocks_of_name(recs[0].kernel)[1]


def blocks_of_name(name):
    return int(name.split("_bq")[1].split("_")[0]), int(name.split("_bk")[1].split("_")[0])
