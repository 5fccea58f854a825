"""The prefill kernel reading a paged KV cache (fc_paged; issue 20, section 4).

attention_kvcache with more than 8 query rows (or impl='prefill') runs the
FlashAttention-2 prefill kernel on the caches themselves: key j of sequence b
is row j % page_size of page block_table[b][j // page_size], each sequence
with its own key count cache_seqlens[b], causal and window aligned to it
(shaders/prefill/attention_prefill.h, attention_prefill_paged.h). Nothing is gathered.

Every case runs in the emulator's sanitizing build with the pages scattered
and shuffled (test_metal_decode_paged.make_paged_cache), every unused table
entry an out-of-range page id and every cache row past a sequence's length
NaN: a kernel reading either trips the bounds checker or turns the output
NaN. Outputs are poisoned with NaN (backends.emulated_metal_kvcache). Each
sequence is compared bit for bit with the same prefill kernel on its keys
copied contiguous (the same products in the same order), and with the
float64 oracle (2x rule).
"""
import math

import pytest
import torch

import flash_metal
from numerics import assert_attention_close
from backends import LAST_DISPATCHES, _run_plan, emulated_metal_attention, emulated_metal_kvcache
from test_metal_decode_paged import POISON, SEQLENS, TABLE, check_against_oracle, make_paged_cache

PAGED = 12  # fc_paged (csrc/metal/plan.h, kPagedFunctionConstant)
DENSE = 10  # fc_dense

# (B, Hq, Hkv, Nq, D, dtype, page, seqlens, causal, window_left, softcap, sinks)
# Small shapes (CI time). Blocks (csrc/metal/families/prefill.cpp): D 32 float32: 32
# keys; D 64 half: 32 keys (float32: 16); D 128 half: 16 keys.
CASES = [
    # page 1: every key its own page (the row-by-row loader), GQA, causal
    (2, 4, 2, 12, 32, torch.float32, 1, [21, 9], True, -1, 0.0, False),
    # page 5 (odd, crosses tiles), an empty sequence, a window whose edge falls on page boundaries
    (3, 4, 2, 16, 64, torch.float16, 5, [37, 0, 23], True, 10, 0.0, False),
    # page 16 < BK 32: tiles span two pages; softcap, not causal
    (2, 2, 2, 9, 64, torch.bfloat16, 16, [40, 17], False, -1, 20.0, False),
    # page 64, a multiple of the 16-key block: whole tiles from one page (dense loader); sinks
    (2, 2, 1, 20, 128, torch.float16, 64, [100, 64], True, -1, 0.0, True),
    # page 32 == BK (float32 D 32): one page per tile; a sequence shorter than Nq (causal rows see nothing)
    (2, 2, 1, 24, 32, torch.float32, 32, [70, 13], True, -1, 0.0, False),
]


def _case_id(c):
    B, Hq, Hkv, Nq, D, dtype, page, seqlens, causal, wl, cap, sinks = c
    return (f"{str(dtype)[6:]}-d{D}-q{Nq}-h{Hq}/{Hkv}-page{page}-{'-'.join(map(str, seqlens))}"
            f"{'-causal' if causal else ''}{f'-wl{wl}' if wl >= 0 else ''}{f'-cap{cap:g}' if cap else ''}"
            f"{'-sinks' if sinks else ''}")


def _plan(q, k_cache, v_cache, lengths, table, causal, **options):
    return flash_metal.explain(q, k_cache, v_cache, causal, None, "auto", block_table=table, cache_seqlens=lengths,
                               **options)


def _check_oracle(out, lse, q, k_contig, v_contig, seqlens, causal, wl=-1, cap=0.0, sinks=None):
    """Each sequence against the float64 oracle on its own keys (2x rule), softcap included; an
    empty one as test_metal_decode_paged.check_against_oracle has it."""
    if not cap:
        return check_against_oracle(out, lse, q, k_contig, v_contig, seqlens, causal, wl, sinks)
    assert sinks is None and 0 not in seqlens
    for b, n in enumerate(seqlens):
        assert_attention_close(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_contig[b:b + 1, :, :n],
                               v_contig[b:b + 1, :, :n], causal, window_left=wl, softcap=cap)


def _assert_paged_prefill_ran(reason):
    d, _ = LAST_DISPATCHES[0]
    assert len(LAST_DISPATCHES) == 1 and d.kernel_name.startswith("flash_attention_prefill_"), d.kernel_name
    assert d.function_constants[PAGED], d.function_constants
    assert d.buffers["block_table"] == TABLE and d.buffers["cache_seqlens"] == SEQLENS
    assert "gather path" not in reason and "the prefill kernel reads K/V through the block table" in reason, reason
    return d


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_paged_prefill_equals_contiguous(case):
    B, Hq, Hkv, Nq, D, dtype, page, seqlens, causal, wl, cap, with_sinks = case
    g = torch.Generator().manual_seed(sum(seqlens) + page + D)
    k_cache, v_cache, table, k_contig, v_contig = make_paged_cache(B, Hkv, D, dtype, page, seqlens, g)
    q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype)
    sinks = torch.randn(Hq, generator=g) if with_sinks else None
    lengths = torch.tensor(seqlens, dtype=torch.int32)
    options = dict(window_left=wl, softcap=cap, sinks=sinks)
    plan = _plan(q, k_cache, v_cache, lengths, table, causal, **options)
    out, lse = emulated_metal_kvcache(q, k_cache, v_cache, lengths, table, causal, instrumented=True, **options)
    d = _assert_paged_prefill_ran(plan.reason)
    bk = int(d.kernel_name.split("_bk")[1].split("_")[0])
    tiles_in_a_page = page % bk == 0
    assert ("lies in one page" in plan.reason) == tiles_in_a_page, plan.reason
    assert ("tiles may cross pages" in plan.reason) == (not tiles_in_a_page), plan.reason
    assert not tiles_in_a_page or d.function_constants[DENSE] or D % 8  # whole tiles: dense where it applies
    assert tiles_in_a_page or not d.function_constants[DENSE]
    assert not out.isnan().any() and not lse.isnan().any()  # every element written (poisoned with NaN)
    _check_oracle(out, lse, q, k_contig, v_contig, seqlens, causal, wl, cap, sinks)
    # The same kernel on each sequence's keys copied contiguous: equal bit for bit.
    for b, n in enumerate(seqlens):
        if n == 0:
            continue
        ko, kl = emulated_metal_attention(q[b:b + 1], k_contig[b:b + 1, :, :n].contiguous(),
                                          v_contig[b:b + 1, :, :n].contiguous(), causal, None, "prefill",
                                          instrumented=True, **options)
        assert LAST_DISPATCHES[0][0].kernel_name == d.kernel_name
        assert torch.equal(out[b:b + 1], ko) and torch.equal(lse[b:b + 1], kl), b


def test_cases_cover_the_edges():
    pages = {c[6] for c in CASES}
    assert {1, 5, 16, 64} <= pages
    assert {torch.float32, torch.float16, torch.bfloat16} == {c[5] for c in CASES}
    assert any(c[1] != c[2] for c in CASES) and any(c[11] for c in CASES) and any(c[10] for c in CASES)
    assert any(0 in c[7] for c in CASES) and any(min(c[7]) < c[3] for c in CASES if c[8])
    # a page boundary inside some row's window, and one at some row's causal edge
    assert any(c[9] >= 0 and any(k % c[6] == 0 for n in c[7] for k in range(max(1, n - c[3] - c[9]), n))
               for c in CASES)
    assert any(c[8] and any((n - c[3] + i + 1) % c[6] == 0 for n in c[7] if n for i in range(c[3])) for c in CASES)


def test_plain_cache_reads_in_place():
    # A plain cache (no table: row b is sequence b, one page of seqlen keys):
    # the prefill reads it in place through the op's identity table, one page per sequence.
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, S, Nq, D = 2, 2, 1, 45, 11, 32
    k_cache = torch.randn(B, S, Hkv, D, generator=g)
    v_cache = torch.randn(B, S, Hkv, D, generator=g)
    lengths = torch.tensor([45, 30], dtype=torch.int32)
    k_cache[1, 30:] = float("nan")  # past sequence 1's length: never read
    v_cache[1, 30:] = float("nan")
    q = torch.randn(B, Hq, Nq, D, generator=g)
    plan = _plan(q, k_cache, v_cache, lengths, None, True)
    out, lse = emulated_metal_kvcache(q, k_cache, v_cache, lengths, None, True, instrumented=True)
    _assert_paged_prefill_ran(plan.reason)
    assert "one page per sequence" in plan.reason, plan.reason
    check_against_oracle(out, lse, q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), lengths.tolist(), True)


def test_gather_path_remains_for_wide_heads():
    # Head dims past the prefill's widest bucket (256) still gather (then the composite path).
    q = torch.randn(1, 2, 12, 320)
    cache = torch.randn(3, 16, 1, 320)
    plan = _plan(q, cache, cache, torch.tensor([20], dtype=torch.int32), torch.tensor([[2, 0]], dtype=torch.int32),
                 True)
    assert "gather path" in plan.reason, plan.reason


def _tiles(seqlens, nq, bk):
    return sum(math.ceil(n / bk) for n in seqlens)


@pytest.mark.parametrize("page", [5, 32])
def test_paged_prefill_reads_each_page_once_per_threadgroup(page):
    """What the kernel reads (not causal, so every key is visible): one
    threadgroup per (packed query block, kv head, sequence) reads each key in
    use of its kv head once, K and V, from its page, and no other row (unique
    == raw bytes, both exactly that). GQA heads share the reads (pack GQA,
    fc_pack_gqa, a chunk of Nq = 16 queries): a threadgroup's 32 packed rows
    are the group's 2 heads' rows, so the kv head's keys are read once per
    sequence, not once per query head (2 per group). The table:
    pages of whole blocks (32 here: BK for float32 D 32), one entry read per
    key block per threadgroup (the same for every thread); otherwise each
    thread reads an entry on entering a page, never one past the sequence's
    last page (the unused entries are out of range: the sanitizer would
    report them)."""
    g = torch.Generator().manual_seed(11 + page)
    B, Hq, Hkv, Nq, D, dtype, seqlens = 2, 4, 2, 16, 32, torch.float32, [70, 33]
    k_cache, v_cache, table, _, _ = make_paged_cache(B, Hkv, D, dtype, page, seqlens, g)
    q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype)
    lengths = torch.tensor(seqlens, dtype=torch.int32)
    plan = _plan(q, k_cache, v_cache, lengths, table, False)
    emulated_metal_kvcache(q, k_cache, v_cache, lengths, table, False, instrumented=True)
    d = _assert_paged_prefill_ran(plan.reason)
    counts = LAST_DISPATCHES[0][1]
    bq = int(d.kernel_name.split("_bq")[1].split("_")[0])
    bk = int(d.kernel_name.split("_bk")[1].split("_")[0])
    assert d.function_constants[13] and d.grid == (math.ceil(Nq * Hq // Hkv / bq), Hkv, B)  # fc_pack_gqa
    readers = math.ceil(Nq * (Hq // Hkv) / bq) * Hkv  # (packed query block, kv head) threadgroups per sequence
    assert readers == 2 < math.ceil(Nq / bq) * Hq == 4
    per_head = sum(seqlens) * D * 4  # bytes of one kv head's keys in use
    unique, raw = counts.device_unique_bytes_read_by_index, counts.device_bytes_read_by_index
    for buf in (1, 2):
        assert unique[buf] == raw[buf] == readers * per_head, (buf, unique[buf], raw[buf])
    entries_in_use = sum(math.ceil(n / page) for n in seqlens)
    if page % bk == 0:
        assert unique[TABLE] == 4 * readers * _tiles(seqlens, Nq, bk), unique[TABLE]
    else:
        assert 4 * readers * entries_in_use <= unique[TABLE], unique[TABLE]
    assert 0 < unique[SEQLENS] <= 4 * readers * B


def test_poisoned_entry_in_use_trips_the_bounds_checker():
    # The poison proves itself: one entry a sequence uses set out of range
    # makes the sanitizing build report the read, so the passing cases'
    # poisoned unused entries were never read.
    from metal_emulator import EmulatorError

    g = torch.Generator().manual_seed(6)
    seqlens, page = [37, 20], 8
    k_cache, v_cache, table, _, _ = make_paged_cache(2, 1, 32, torch.float32, page, seqlens, g)
    q = torch.randn(2, 2, 12, 32, generator=g)
    lengths = torch.tensor(seqlens, dtype=torch.int32)
    plan = _plan(q, k_cache, v_cache, lengths, table, True)  # planned with the good table (the CPU op checks entries)

    def run(t):
        out = torch.full((2, 2, 12, 32), float("nan"))
        lse = torch.full((2, 2, 12), float("nan"))
        tensors = {"q": q, "k": k_cache, "v": v_cache, "out": out, "lse": lse, "attn_mask": q, "cu_seqlens_q": q,
                   "cu_seqlens_k": q, "sinks": q, "block_table": t, "cache_seqlens": lengths}
        _run_plan(plan, tensors, True, False)
        return out

    assert not run(table).isnan().any()
    _assert_paged_prefill_ran(plan.reason)
    table[1, 2] = POISON  # sequence 1's third page (keys 16..19)
    with pytest.raises(EmulatorError, match="(?i)out.of.bounds|bounds"):
        run(table)


def test_paged_prefill_own_value_dim():
    # MLA-style D_v != D_qk (issue 20 section 2): k_cache 64 wide, v_cache 32,
    # one table for both; 5-key pages (row by row). Against the oracle, and
    # bit for bit against the contiguous prefill.
    from test_head_dims import _paged

    seqlens = [37, 23]
    kc, vc, table, kcont, vcont = _paged(2, 2, 64, 32, torch.float16, 5, seqlens, 17)
    q = torch.randn(2, 4, 12, 64, generator=torch.Generator().manual_seed(17)).half()
    lengths = torch.tensor(seqlens, dtype=torch.int32)
    plan = _plan(q, kc, vc, lengths, table, True)
    out, lse = emulated_metal_kvcache(q, kc, vc, lengths, table, True, instrumented=True)
    d = _assert_paged_prefill_ran(plan.reason)
    assert out.shape == (2, 4, 12, 32)
    _check_oracle(out, lse, q, kcont, vcont, seqlens, True)
    for b, n in enumerate(seqlens):
        ko, kl = emulated_metal_attention(q[b:b + 1], kcont[b:b + 1, :, :n].contiguous(),
                                          vcont[b:b + 1, :, :n].contiguous(), True, None, "prefill",
                                          instrumented=True)
        assert LAST_DISPATCHES[0][0].kernel_name == d.kernel_name
        assert torch.equal(out[b:b + 1], ko) and torch.equal(lse[b:b + 1], kl), b


def test_tensor_op_route_leaves_paged_caches_to_the_simdgroup_prefill():
    # On an Apple 10 GPU with the tensor-op library, Auto's prefill runs on the
    # tensor-op kernels (issue 21), which do not read the block table: a paged
    # cache keeps the simdgroup prefill, and the reason says why.
    q = torch.randn(1, 4, 16, 64).half()
    cache = torch.randn(4, 16, 2, 64).half()
    lengths, table = torch.tensor([40], dtype=torch.int32), torch.tensor([[3, 0, 2]], dtype=torch.int32)
    contiguous = flash_metal.explain(q, cache[:1].transpose(1, 2), cache[:1].transpose(1, 2), True, None, "auto",
                                     "m5+tensor_ops")
    assert contiguous.dispatches[0].kernel_name.startswith("flash_attention_prefill_mpp_"), contiguous.reason
    plan = flash_metal.explain(q, cache, cache, True, None, "auto", "m5+tensor_ops", block_table=table,
                               cache_seqlens=lengths)
    d = plan.dispatches[0]
    assert d.kernel_name.startswith("flash_attention_prefill_") and "mpp" not in d.kernel_name
    assert d.function_constants[PAGED] and "tensor ops not used: a paged KV cache" in plan.reason, plan.reason
