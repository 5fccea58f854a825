"""The paged prefill with packed queries: flash_attn_varlen_func(..., block_table=...) without the gather
(issue 20, section 4).

attention_kvcache with cu_seqlens_q: q is packed (total_q, Hq, D), sequence
b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1, its keys
cache_seqlens[b] of them through table row b. The prefill kernel runs it with
fc_varlen and fc_paged together (shaders/prefill/attention_prefill_paged.h,
prefill_paged_sequence_view): nothing is gathered.

Every case runs in the emulator's sanitizing build on a scattered, shuffled
cache (test_metal_decode_paged.make_paged_cache: unused table entries out of
range, rows past a sequence's length NaN), outputs poisoned with NaN. Each is
compared bit for bit with the same prefill kernel on the gathered contiguous
varlen problem (the same products in the same order) and with the float64
oracle per sequence (2x rule).
"""
import math

import pytest
import torch

import flash_metal
from backends import LAST_DISPATCHES, _run_plan, emulated_metal_varlen
from numerics import assert_attention_close
from test_metal_decode_paged import SEQLENS, TABLE, make_paged_cache

PAGED, VARLEN, DENSE = 12, 9, 10  # fc_paged, fc_varlen, fc_dense (csrc/metal/plan.h)
CU_Q = 15  # [[buffer(15)]]: cu_seqlens_q

# (Hq, Hkv, D, dtype, page, q_lens, k_lens, causal, window_left, sinks). Small
# shapes (CI time). Blocks (csrc/metal/families/prefill.cpp): D 32 float32: 32 keys;
# D 64 half: 32 keys; D 64 bfloat16 likewise.
CASES = [
    # page 1 (every key its own page: the row-by-row loader), GQA, causal; a sequence with fewer keys than queries
    (4, 2, 32, torch.float32, 1, [5, 12, 9], [21, 12, 4], True, -1, False),
    # page 16 < BK: tiles span two pages; an empty sequence (no query, no key) and one with queries but no key;
    # window, sinks
    (2, 1, 64, torch.float16, 16, [7, 0, 4, 17], [40, 0, 0, 30], True, 10, True),
    # page 5 (odd, tiles cross pages), not causal, a sequence with keys but no query
    (2, 2, 64, torch.bfloat16, 5, [13, 0, 6], [37, 11, 6], False, -1, False),
    # page 32 == BK (float32 D 32): whole tiles from one page (dense loader); causal window edge on pages
    (2, 1, 32, torch.float32, 32, [20, 3], [70, 64], True, 31, True),
]


def _case_id(c):
    Hq, Hkv, D, dtype, page, ql, kl, causal, wl, sinks = c
    return (f"{str(dtype)[6:]}-d{D}-h{Hq}/{Hkv}-page{page}-q{'.'.join(map(str, ql))}-k{'.'.join(map(str, kl))}"
            f"{'-causal' if causal else ''}{f'-wl{wl}' if wl >= 0 else ''}{'-sinks' if sinks else ''}")


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


def run_paged_varlen(q, k_cache, v_cache, cu_q, max_q, lengths, table, causal, **options):
    """attention_kvcache with packed queries through the emulator's sanitizing build, bound as the MPS host
    binds it (attention_mps.mm: cu_seqlens_q in both offset slots, the table and lengths at theirs).
    Returns (out (total_q, Hq, D_v), lse (Hq, total_q), plan), outputs poisoned with NaN."""
    plan = flash_metal.explain(q, k_cache, v_cache, causal, None, "auto", cu_seqlens_q=cu_q, max_seqlen_q=max_q,
                               block_table=table, cache_seqlens=lengths, **options)
    T, Hq, _ = q.shape
    out = torch.full((T, Hq, v_cache.shape[3]), float("nan"), dtype=q.dtype)
    lse = torch.full((Hq, T), float("nan"), dtype=torch.float32)
    sinks = options.get("sinks")
    tensors = {"q": q, "k": k_cache, "v": v_cache, "out": out, "lse": lse, "attn_mask": q, "cu_seqlens_q": cu_q,
               "cu_seqlens_k": cu_q, "sinks": q if sinks is None else sinks.float().contiguous(),
               "block_table": table, "cache_seqlens": lengths}
    _run_plan(plan, tensors, True, False)
    return out, lse, plan


def _assert_paged_varlen_ran(plan):
    d, _ = LAST_DISPATCHES[0]
    assert len(LAST_DISPATCHES) == 1 and d.kernel_name.startswith("flash_attention_prefill_"), d.kernel_name
    assert d.function_constants[PAGED] and d.function_constants[VARLEN], d.function_constants
    assert d.buffers["block_table"] == TABLE and d.buffers["cache_seqlens"] == SEQLENS
    assert d.buffers["cu_seqlens_q"] == CU_Q
    assert "gather path" not in plan.reason and "packed queries of their own lengths" in plan.reason, plan.reason
    return d


def _gathered(k_contig, k_lens):
    # Each sequence's keys, packed (total_k, Hkv, D): the gather the kernel avoids.
    return torch.cat([k_contig[b, :, :n].transpose(0, 1) for b, n in enumerate(k_lens)])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_paged_varlen_prefill(case):
    Hq, Hkv, D, dtype, page, q_lens, k_lens, causal, wl, with_sinks = case
    g = torch.Generator().manual_seed(sum(k_lens) + page + D)
    B = len(q_lens)
    k_cache, v_cache, table, k_contig, v_contig = make_paged_cache(B, Hkv, D, dtype, page, k_lens, g)
    cu_q = _cu(q_lens)
    q = torch.randn(int(cu_q[-1]), Hq, D, generator=g).to(dtype)
    sinks = torch.randn(Hq, generator=g) if with_sinks else None
    lengths = torch.tensor(k_lens, dtype=torch.int32)
    options = dict(window_left=wl, sinks=sinks)
    out, lse, plan = run_paged_varlen(q, k_cache, v_cache, cu_q, max(q_lens), lengths, table, causal, **options)
    d = _assert_paged_varlen_ran(plan)
    bk = int(d.kernel_name.split("_bk")[1].split("_")[0])
    assert ("lies in one page" in plan.reason) == (page % bk == 0), plan.reason
    assert d.function_constants[DENSE] == (page % bk == 0), plan.reason  # whole tiles: the dense loader
    assert not out.isnan().any() and not lse.isnan().any()  # every element written (poisoned with NaN)

    # Bits: the same kernel on the gathered contiguous varlen problem.
    ko, kl = emulated_metal_varlen(q, _gathered(k_contig, k_lens), _gathered(v_contig, k_lens), cu_q, _cu(k_lens),
                                   max(q_lens), max(k_lens), causal, instrumented=True, **options)
    assert LAST_DISPATCHES[0][0].kernel_name == d.kernel_name
    assert torch.equal(out, ko) and torch.equal(lse, kl)

    # Each sequence against the float64 oracle (2x rule); no key: zeros and -inf (or the sink).
    for b, (s, e) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist())):
        ob, lb = out[s:e].transpose(0, 1)[None], lse[:, s:e][None]
        if e == s:
            continue
        if k_lens[b] == 0:
            assert torch.equal(ob, torch.zeros_like(ob)), b
            want = torch.full_like(lb, float("-inf")) if sinks is None else sinks[None, :, None].expand_as(lb)
            assert torch.allclose(lb, want, rtol=1e-6, atol=1e-6), b
            continue
        extra = {} if sinks is None else {"sinks": sinks}
        assert_attention_close(ob, lb, q[s:e].transpose(0, 1)[None], k_contig[b:b + 1, :, :k_lens[b]],
                               v_contig[b:b + 1, :, :k_lens[b]], causal, window_left=wl, **extra)


def test_cases_cover_the_edges():
    assert {1, 16, 5, 32} <= {c[4] for c in CASES}
    assert {torch.float32, torch.float16, torch.bfloat16} == {c[3] for c in CASES}
    assert any(c[0] != c[1] for c in CASES) and any(c[9] for c in CASES) and any(c[8] >= 0 for c in CASES)
    assert any(q == 0 and k == 0 for c in CASES for q, k in zip(c[5], c[6]))  # an empty sequence
    assert any(q > 0 and k == 0 for c in CASES for q, k in zip(c[5], c[6]))  # queries, no key
    assert any(q == 0 and k > 0 for c in CASES for q, k in zip(c[5], c[6]))  # keys, no query
    assert any(q > k for c in CASES if c[7] for q, k in zip(c[5], c[6]))  # causal rows that see nothing
    assert any(not c[7] for c in CASES)


@pytest.mark.parametrize("page", [5, 32])
def test_paged_varlen_reads_only_the_pages_in_use(page):
    """What the kernel reads (not causal: every key is visible). Each
    (packed query block, kv head) threadgroup of a sequence (pack GQA,
    fc_pack_gqa, short chunks of queries: a block's 32 packed rows are the
    GQA group's 2 heads' rows, ceil(2 * Nq / 32) blocks per kv head) reads that
    sequence's keys once, K and V, from its pages; a sequence without
    queries (here the first) is never read, nor any other row (unique ==
    raw bytes, both exactly that). Query blocks past a sequence's end return
    before reading. The table: whole-tile pages (32 = BK here) one entry per
    key block per threadgroup; otherwise at least one per page entered."""
    g = torch.Generator().manual_seed(21 + page)
    Hq, Hkv, D, dtype = 4, 2, 32, torch.float32
    q_lens, k_lens = [0, 9, 14], [30, 33, 70]
    k_cache, v_cache, table, _, _ = make_paged_cache(3, Hkv, D, dtype, page, k_lens, g)
    cu_q = _cu(q_lens)
    q = torch.randn(int(cu_q[-1]), Hq, D, generator=g)
    out, _, plan = run_paged_varlen(q, k_cache, v_cache, cu_q, max(q_lens), torch.tensor(k_lens, dtype=torch.int32),
                                    table, False)
    d = _assert_paged_varlen_ran(plan)
    assert not out.isnan().any()
    counts = LAST_DISPATCHES[0][1]
    bq = int(d.kernel_name.split("_bq")[1].split("_")[0])
    bk = int(d.kernel_name.split("_bk")[1].split("_")[0])
    assert d.function_constants[13] and d.grid[:2] == (1, Hkv)  # fc_pack_gqa: 2 x 14 rows, one block
    blocks = [math.ceil(n * Hq // Hkv / bq) for n in q_lens]  # threadgroups per kv head that read keys
    want = Hkv * sum(nb * n for nb, n in zip(blocks, k_lens)) * D * 4
    unique, raw = counts.device_unique_bytes_read_by_index, counts.device_bytes_read_by_index
    for buf in (1, 2):
        assert unique[buf] == raw[buf] == want, (buf, unique[buf], raw[buf], want)
    if page % bk == 0:
        assert unique[TABLE] == 4 * Hkv * sum(nb * math.ceil(n / bk) for nb, n in zip(blocks, k_lens)), unique[TABLE]
    else:
        assert 4 * Hkv * sum(nb * math.ceil(n / page) for nb, n in zip(blocks, k_lens)) <= unique[TABLE]


def test_flash_attn_varlen_func_routes_paged_caches_to_the_op(monkeypatch):
    # flash_attn_varlen_func with block_table calls attention_kvcache with the
    # packed queries (CPU: the op gathers for the varlen kernel; MPS: the
    # plan above). Against the contiguous varlen call, on CPU, bit for bit.
    g = torch.Generator().manual_seed(4)
    q_lens, k_lens, page = [6, 0, 11], [19, 7, 30], 8
    k_cache, v_cache, table, k_contig, v_contig = make_paged_cache(3, 1, 32, torch.float32, page, k_lens, g)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    q = torch.randn(int(cu_q[-1]), 2, 32, generator=g)
    calls = []
    real = flash_metal.ops.attention_kvcache_with_lse

    def spy(*args, **kwargs):
        calls.append(kwargs.get("cu_seqlens_q"))
        return real(*args, **kwargs)

    monkeypatch.setattr(flash_metal.ops, "attention_kvcache_with_lse", spy)
    out, lse, _ = flash_metal.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(q_lens), 0, causal=True,
                                                     block_table=table, return_attn_probs=True)
    assert len(calls) == 1 and torch.equal(calls[0], cu_q)
    ref, ref_lse, _ = flash_metal.flash_attn_varlen_func(q, _gathered(k_contig, k_lens), _gathered(v_contig, k_lens),
                                                         cu_q, cu_k, max(q_lens), max(k_lens), causal=True,
                                                         return_attn_probs=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def test_flash_attn_varlen_func_paged_gradients_gather():
    # With a gradient wanted, the paged call gathers (differentiably) for the
    # varlen op, whose backward runs: gradients equal to the contiguous call's.
    g = torch.Generator().manual_seed(9)
    q_lens, k_lens, page = [4, 7], [11, 6], 4
    k_cache, v_cache, table, k_contig, v_contig = make_paged_cache(2, 1, 16, torch.float32, page, k_lens, g,
                                                                   spare_blocks=0)
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)  # every block in use: no NaN to reach a grad
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    q = torch.randn(11, 2, 16, generator=g, requires_grad=True)
    kc, vc = k_cache.clone().requires_grad_(True), v_cache.clone().requires_grad_(True)
    out = flash_metal.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 7, 0, causal=True, block_table=table)
    grad_out = torch.randn(out.shape, generator=g)
    dq, dk, dv = torch.autograd.grad(out, (q, kc, vc), grad_out)
    kp, vp = _gathered(k_contig, k_lens).requires_grad_(True), _gathered(v_contig, k_lens).requires_grad_(True)
    ref = flash_metal.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 7, 11, causal=True)
    rq, rk, rv = torch.autograd.grad(ref, (q, kp, vp), grad_out)
    assert torch.equal(out, ref) and torch.equal(dq, rq)
    # each key's gradient lands on its page row
    for b, n in enumerate(k_lens):
        for j in range(n):
            row = int(cu_k[b]) + j
            assert torch.equal(dk[table[b, j // page], j % page], rk[row])
            assert torch.equal(dv[table[b, j // page], j % page], rv[row])


def test_wide_heads_with_packed_queries_still_gather():
    # Head dims past the prefill's widest bucket (256): the op gathers the
    # rows in use and keeps the packed queries (the varlen plan, here the
    # composite path); on CPU the same call equals the contiguous varlen one.
    g = torch.Generator().manual_seed(8)
    q_lens, k_lens = [3, 5], [20, 9]
    k_cache, v_cache, table, k_contig, v_contig = make_paged_cache(2, 1, 320, torch.float32, 16, k_lens, g)
    cu_q, lengths = _cu(q_lens), torch.tensor(k_lens, dtype=torch.int32)
    q = torch.randn(8, 2, 320, generator=g)
    plan = flash_metal.explain(q, k_cache, v_cache, True, None, "auto", cu_seqlens_q=cu_q, max_seqlen_q=5,
                               block_table=table, cache_seqlens=lengths)
    assert "gather path" in plan.reason, plan.reason
    out, lse = flash_metal.ops.attention_kvcache_with_lse(q, k_cache, v_cache, lengths, table, True,
                                                          cu_seqlens_q=cu_q, max_seqlen_q=5)
    ref, ref_lse = flash_metal.attention_varlen_with_lse(q, _gathered(k_contig, k_lens), _gathered(v_contig, k_lens),
                                                         cu_q, _cu(k_lens), 5, 20, True)
    assert out.shape == (8, 2, 320) and lse.shape == (2, 8)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def test_bad_packed_queries_name_the_argument():
    q = torch.randn(10, 2, 32)
    cache = torch.randn(4, 8, 1, 32)
    table, lengths = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([9, 16], dtype=torch.int32)
    op = flash_metal.ops.attention_kvcache_with_lse
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        op(q, cache, cache, lengths, table, cu_seqlens_q=torch.tensor([0, 4, 10]), max_seqlen_q=6)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] must equal"):
        op(q, cache, cache, lengths, table, cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32), max_seqlen_q=6)
    with pytest.raises(ValueError, match="max_seqlen_q is 5"):
        op(q, cache, cache, lengths, table, cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32), max_seqlen_q=5)
    with pytest.raises(ValueError, match="does not take packed queries"):
        flash_metal.explain(q, cache, cache, False, None, "decode", cu_seqlens_q=torch.tensor([0, 4, 10],
                            dtype=torch.int32), max_seqlen_q=6, block_table=table, cache_seqlens=lengths)
