"""attention_kvcache: attention against a paged KV cache (issue 20, section 4).

The op on CPU (the rows in use gathered for the varlen kernel) and through
the Metal emulator as the MPS host runs it (the decode kernels reading the
block table, fc_paged, for Nq <= 8; the prefill kernel reading it, also
fc_paged, otherwise). Caches are scattered and shuffled, unused table entries
poisoned with out-of-range page ids and unused rows NaN
(test_metal_decode_paged.make_paged_cache), outputs poisoned with NaN; each
sequence is compared with the float64 oracle (2x rule). The emulator runs
the sanitizing build, so a read through a poisoned entry is a bounds error.
"""
import pytest
import torch

import flash_metal
from backends import LAST_DISPATCHES, emulated_metal_kvcache
from numerics import assert_attention_close
from test_metal_decode_paged import POISON, make_paged_cache

PAGED, TABLE, SEQLENS = 12, 19, 20  # fc_paged; [[buffer(n)]] of block_table and cache_seqlens
PAGE_FIELDS = 312  # byte offset of (page_size, table_stride) in AttentionParams (shaders/common/params.h)


def make_case(B, Hq, Hkv, Nq, D, dtype, page, seqlens, seed, wide=0):
    """q (B, Hq, Nq, D), caches, table, contiguous copies; wide > 0: the table is a column
    slice of a wider one (row stride max_blocks + wide, the extra columns poisoned)."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table, k_contig, v_contig = make_paged_cache(B, Hkv, D, dtype, page, seqlens, g)
    if wide:
        big = torch.full((B, table.shape[1] + wide), POISON, dtype=torch.int32)
        big[:, :table.shape[1]] = table
        table = big[:, :table.shape[1]]
    q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype)
    return q, k_cache, v_cache, table, k_contig, v_contig


def check_oracle(out, lse, q, k_contig, v_contig, seqlens, causal, **options):
    """Each sequence against the float64 oracle on its own keys; an empty one: zeros and -inf (or the sink)."""
    sinks = options.get("sinks")
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    for b, n in enumerate(seqlens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])), b
            want = torch.full_like(lse[b], float("-inf")) if sinks is None else sinks[:, None].expand_as(lse[b])
            assert torch.allclose(lse[b], want, rtol=1e-6, atol=1e-6), b
            continue
        assert_attention_close(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_contig[b:b + 1, :, :n],
                               v_contig[b:b + 1, :, :n], causal, **options)


# (B, Hq, Hkv, Nq, D, dtype, page, seqlens, causal, window_left, softcap, sinks, impl, wide):
# ragged lengths with an empty sequence, pages 16, 5, 1 and 7, GQA and MQA, one pass and split,
# the window, softcap, sinks, a table that is a slice of a wider one, Nq 12 (the paged prefill).
CASES = [
    (3, 4, 2, 1, 64, torch.float16, 16, [37, 0, 64], False, -1, 0.0, False, "auto", 3),
    (2, 6, 2, 3, 40, torch.bfloat16, 5, [37, 13], True, 9, 0.0, True, "decode_split", 0),
    (2, 2, 1, 2, 32, torch.float32, 1, [9, 40], True, -1, 5.0, False, "auto", 2),
    (2, 4, 2, 12, 32, torch.float16, 7, [30, 12], True, -1, 0.0, False, "auto", 1),
]
IDS = ["p16-onepass", "p5-split-window-sinks", "p1-mqa-softcap", "p7-nq12-prefill"]


def _run(case, backend):
    B, Hq, Hkv, Nq, D, dtype, page, seqlens, causal, wl, softcap, sinks, impl, wide = case
    q, k_cache, v_cache, table, k_contig, v_contig = make_case(B, Hq, Hkv, Nq, D, dtype, page, seqlens,
                                                               sum(seqlens) + page, wide)
    options = dict(window_left=wl, softcap=softcap,
                   sinks=torch.randn(Hq, generator=torch.Generator().manual_seed(page)) if sinks else None)
    lengths = torch.tensor(seqlens, dtype=torch.int32)
    if backend == "cpu":
        out, lse = flash_metal.attention_kvcache_with_lse(q, k_cache, v_cache, lengths, table, causal, **options)
    else:
        out, lse = emulated_metal_kvcache(q, k_cache, v_cache, lengths, table, causal, impl=impl, instrumented=True,
                                          **options)
    return out, lse, (q, k_cache, v_cache, table, lengths, k_contig, v_contig, options)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_kvcache_op_cpu(case):
    # CPU: the oracle, and bit for bit the gather path flash_attn_with_kvcache
    # ran before this op (flash_metal._kvcache's gather + the varlen op).
    out, lse, (q, k_cache, v_cache, table, lengths, k_contig, v_contig, options) = _run(case, "cpu")
    check_oracle(out, lse, q, k_contig, v_contig, case[7], case[8], **options)
    from flash_metal import _kvcache

    B, Hq, Nq = q.shape[:3]
    n = lengths.to(torch.int64)
    rows = _kvcache.rows_in_use(table.to(torch.int64), k_cache.shape[1], torch.zeros_like(n), n)
    go, gl = flash_metal.attention_varlen_with_lse(
        q.transpose(1, 2).reshape(B * Nq, Hq, -1), _kvcache.gather(k_cache, rows), _kvcache.gather(v_cache, rows),
        (torch.arange(B + 1) * Nq).to(torch.int32), _kvcache.cumulative(n), Nq, int(n.max()), case[8], **options)
    assert torch.equal(out, go.view(B, Nq, Hq, -1).transpose(1, 2))
    assert torch.equal(lse, gl.view(Hq, B, Nq).permute(1, 0, 2))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_kvcache_op_emulated(case):
    # Metal (emulated, sanitized): the oracle, and the kernels that ran are the
    # route's: the paged decode (fc_paged on, the table and lengths read) or,
    # for Nq > 8, the paged prefill (fc_paged on too; tests/metal/test_metal_prefill_paged.py).
    out, lse, (q, k_cache, v_cache, table, lengths, k_contig, v_contig, options) = _run(case, "metal-emu")
    check_oracle(out, lse, q, k_contig, v_contig, case[7], case[8], **options)
    first, counts = LAST_DISPATCHES[0]
    if case[3] <= 8:
        assert first.kernel_name.startswith("flash_decode_split_" if case[12] == "decode_split" else "flash_decode_")
        assert first.function_constants[PAGED] and first.buffers["block_table"] == TABLE
        assert counts.device_unique_bytes_read_by_index.get(TABLE, 0) > 0
        assert counts.device_unique_bytes_read_by_index.get(SEQLENS, 0) > 0
        page, stride = (int(x) for x in first.params[PAGE_FIELDS:PAGE_FIELDS + 8].view(torch.int32))
        assert (page, stride) == (k_cache.shape[1], table.stride(0))
    else:
        assert first.kernel_name.startswith("flash_attention_prefill_") and first.function_constants[PAGED]
        assert counts.device_unique_bytes_read_by_index.get(TABLE, 0) > 0


def test_kvcache_op_plain_cache_cpu_and_emulated():
    # block_table None: a plain (B_cache, S, Hkv, D) cache, row b for batch b
    # (one page of S keys); rows past each length NaN, never read.
    g = torch.Generator().manual_seed(11)
    B, Hq, Hkv, S, D = 2, 4, 2, 40, 64
    k_cache = torch.randn(B + 1, S, Hkv, D, generator=g).half()
    v_cache = torch.randn(B + 1, S, Hkv, D, generator=g).half()
    seqlens = [23, 40]
    for b, n in enumerate(seqlens):
        k_cache[b, n:] = float("nan")
        v_cache[b, n:] = float("nan")
    q = torch.randn(B, Hq, 1, D, generator=g).half()
    lengths = torch.tensor(seqlens, dtype=torch.int32)
    kc, vc = k_cache[:B].transpose(1, 2), v_cache[:B].transpose(1, 2)
    for out, lse in (flash_metal.attention_kvcache_with_lse(q, k_cache, v_cache, lengths),
                     emulated_metal_kvcache(q, k_cache, v_cache, lengths, instrumented=True)):
        check_oracle(out, lse, q, kc, vc, seqlens, False)
    assert LAST_DISPATCHES[0][0].function_constants[PAGED]


def test_kvcache_explain_routes_and_registers():
    q, k_cache, v_cache, table, _, _ = make_case(2, 8, 2, 1, 128, torch.float16, 16, [40, 70], 3)
    lengths = torch.tensor([40, 70], dtype=torch.int32)
    plan = flash_metal.explain(q, k_cache, v_cache, True, block_table=table, cache_seqlens=lengths)
    d = plan.dispatches[0]
    assert "decode kernels read K/V through the block table" in plan.reason
    assert d.kernel_name.startswith("flash_decode_") and d.function_constants[PAGED]
    assert d.buffers["block_table"] == TABLE and d.buffers["cache_seqlens"] == SEQLENS
    # The page walk's live values (kPagedLiveValues): 8 over the same decode on a contiguous cache.
    contiguous = torch.empty(2, 2, table.shape[1] * 16, 128, dtype=torch.float16)
    plain = flash_metal.explain(q, contiguous, contiguous, True).dispatches[0]
    # The page walk's 8 values on top (kPagedLiveValues); at D 128 with 4 keys in flight (issue 43) 74, over
    # the 72-value budget: it runs at the residency explain() reports (threadgroups_per_core).
    assert not plain.function_constants[PAGED] and d.live_registers == plain.live_registers + 8
    assert d.threadgroups_per_core == max(1, 208 * 1024 // (d.live_registers * 4 * 32 * 8))
    for nq, impl in ((9, "auto"), (1, "prefill")):
        qq = torch.randn(2, 8, nq, 128).half()
        p = flash_metal.explain(qq, k_cache, v_cache, True, impl=impl, block_table=table, cache_seqlens=lengths)
        assert "the prefill kernel reads K/V through the block table" in p.reason, p.reason
        assert p.dispatches[0].kernel_name.startswith("flash_attention_prefill_")
        assert p.dispatches[0].function_constants[PAGED] and p.dispatches[0].buffers["block_table"] == TABLE
    with pytest.raises(ValueError, match="impl must be 'auto', 'decode', 'decode_split'"):
        flash_metal.explain(q, k_cache, v_cache, impl="tiled", block_table=table, cache_seqlens=lengths)
    with pytest.raises(ValueError, match="serves at most 8 query rows"):
        flash_metal.explain(torch.randn(2, 8, 9, 128).half(), k_cache, v_cache, impl="decode", block_table=table,
                            cache_seqlens=lengths)


# The paged decode's live values per lane over the 72-value budget with 4 keys in flight (issue 43,
# csrc/metal/plan_detail.h: D 64 76, 128 74, 256 85); every other bucket within it, all within the 128
# registers a thread addresses.
PAGED_OVER_BUDGET = {64: 76, 128: 74, 256: 85}


def test_kvcache_paged_plans_fit_the_register_budget():
    # Every head-dim bucket, one pass and split: the paged decode within the budget, but where listed.
    for d in (32, 64, 72, 80, 96, 128, 256):
        q = torch.randn(1, 4, 2, d).half()
        cache = torch.empty(64, 16, 2, d, dtype=torch.float16)
        table = torch.zeros(1, 64, dtype=torch.int32)
        for impl in ("decode", "decode_split"):
            plan = flash_metal.explain(q, cache, cache, impl=impl, block_table=table,
                                       cache_seqlens=torch.tensor([5], dtype=torch.int32))
            live = plan.dispatches[0].live_registers
            assert live == PAGED_OVER_BUDGET[d] if d in PAGED_OVER_BUDGET else live <= 72, (d, impl, live)
            assert live <= 128


def test_opcheck_attention_kvcache():
    q, k_cache, v_cache, table, _, _ = make_case(2, 4, 2, 3, 32, torch.float32, 5, [12, 7], 4, wide=1)
    lengths = torch.tensor([12, 7], dtype=torch.int32)
    torch.library.opcheck(
        torch.ops.flash_metal.attention_kvcache.default,
        (q, k_cache, v_cache, lengths, table, True, None, -1, -1, 0.0, None, "auto"),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic"),
    )


def test_kvcache_bad_input_names_the_argument():
    q, k_cache, v_cache, table, _, _ = make_case(2, 4, 2, 1, 32, torch.float32, 4, [6, 3], 5)
    lengths = torch.tensor([6, 3], dtype=torch.int32)
    op = flash_metal.attention_kvcache_with_lse
    with pytest.raises(TypeError, match="block_table must be int32"):
        op(q, k_cache, v_cache, lengths, table.long())
    with pytest.raises(ValueError, match=r"block_table must have shape \(batch, max_blocks_per_seq\)"):
        op(q, k_cache, v_cache, lengths, table[:1])
    with pytest.raises(TypeError, match="cache_seqlens must be int32"):
        op(q, k_cache, v_cache, lengths.long(), table)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 99 is outside \[0, "):
        op(q, k_cache, v_cache, torch.tensor([6, 99], dtype=torch.int32), table)
    bad = table.clone()
    bad[0, 1] = k_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = .* is out of range"):
        op(q, k_cache, v_cache, lengths, bad)
    with pytest.raises(ValueError, match="page_size .* must be at least 1"):
        op(q, k_cache[:, :0], v_cache[:, :0], torch.zeros(2, dtype=torch.int32), table)
    with pytest.raises(ValueError, match="v_cache must have k_cache's"):
        op(q, k_cache, v_cache[:, :2], lengths, table)
    with pytest.raises(ValueError, match="impl must be 'auto'"):
        op(q, k_cache, v_cache, lengths, table, impl="decode")


def test_flash_attn_with_kvcache_calls_the_op(monkeypatch):
    # Paged, appending across a page boundary: flash_attn_with_kvcache runs
    # attention_kvcache (a spy counts it) and matches the oracle on the
    # cache's contents after the append.
    from flash_metal import ops

    calls = []
    real = ops.attention_kvcache_with_lse
    monkeypatch.setattr(ops, "attention_kvcache_with_lse", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    g = torch.Generator().manual_seed(8)
    B, Hq, Hkv, D, page = 2, 4, 2, 32, 4
    k_cache = torch.randn(6, page, Hkv, D, generator=g)
    v_cache = torch.randn(6, page, Hkv, D, generator=g)
    table = torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32)
    lengths = torch.tensor([3, 7], dtype=torch.int32)
    q = torch.randn(B, 2, Hq, D, generator=g)
    k_new, v_new = torch.randn(B, 2, Hkv, D, generator=g), torch.randn(B, 2, Hkv, D, generator=g)
    out, lse = flash_metal.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths,
                                                   block_table=table, causal=True, return_softmax_lse=True)
    assert len(calls) == 1 and calls[0] is table
    for b in range(B):
        n = int(lengths[b]) + 2
        rows = [(int(table[b, j // page]), j % page) for j in range(n)]
        k = torch.stack([k_cache[r] for r in rows], 1)[None]  # (1, Hkv, n, D)
        v = torch.stack([v_cache[r] for r in rows], 1)[None]
        assert torch.equal(k[0, :, -2:], k_new[b].transpose(0, 1))
        assert_attention_close(out[b:b + 1].transpose(1, 2), lse[b:b + 1], q[b:b + 1].transpose(1, 2), k, v, True)
    # cache_batch_idx: a table of one page per sequence (the cache row); cache_leftpad keeps the gather.
    plain_k, plain_v = torch.randn(3, 10, Hkv, D, generator=g), torch.randn(3, 10, Hkv, D, generator=g)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    out, lse = flash_metal.flash_attn_with_kvcache(q, plain_k, plain_v, cache_seqlens=lengths, cache_batch_idx=idx,
                                                   return_softmax_lse=True)
    assert len(calls) == 2 and calls[1].tolist() == [[2], [0]]
    for b in range(B):
        n = int(lengths[b])
        k, v = plain_k[idx[b], :n].transpose(0, 1)[None], plain_v[idx[b], :n].transpose(0, 1)[None]
        assert_attention_close(out[b:b + 1].transpose(1, 2), lse[b:b + 1], q[b:b + 1].transpose(1, 2), k, v, False)
    flash_metal.flash_attn_with_kvcache(q, plain_k, plain_v, cache_seqlens=lengths,
                                        cache_leftpad=torch.tensor([1, 0], dtype=torch.int32))
    assert len(calls) == 2


def test_kvcache_empty_problems():
    # No sequence, no query row, or a table of no entries (capacity 0): the
    # op answers on the host as attention_forward does (zeros, lse -inf, or
    # the sink), on CPU and in explain() (which plans no kernel for them).
    q = torch.randn(2, 4, 1, 32)
    cache = torch.randn(3, 4, 2, 32)
    none = torch.zeros(2, dtype=torch.int32)
    out, lse = flash_metal.attention_kvcache_with_lse(q[:0], cache, cache, none[:0], torch.zeros(0, 2).int())
    assert out.shape == (0, 4, 1, 32) and lse.shape == (0, 4, 1)
    out, lse = flash_metal.attention_kvcache_with_lse(q[:, :, :0], cache, cache, none, torch.zeros(2, 2).int())
    assert out.shape == (2, 4, 0, 32) and lse.shape == (2, 4, 0)
    sinks = torch.randn(4)
    for s in (None, sinks):
        out, lse = flash_metal.attention_kvcache_with_lse(q, cache, cache, none, torch.zeros(2, 0).int(), sinks=s)
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.equal(lse, torch.full_like(lse, float("-inf")) if s is None else s[None, :, None].expand_as(lse))
    with pytest.raises(ValueError, match="empty problem"):
        flash_metal.explain(q, cache, cache, block_table=torch.zeros(2, 0).int(), cache_seqlens=none)
