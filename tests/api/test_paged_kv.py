"""Paged KV caches, cache_batch_idx and cache_leftpad (flash-attn's conventions) on flash_attn_with_kvcache and
flash_attn_varlen_func.

A paged cache holds key j of batch b at row j % page of block block_table[b, j // page]. Each test scatters
the same sequences over shuffled pages, fills every page and row no sequence uses with NaN and every unused
table entry with an out-of-range block number, so a read of anything not in use shows up as NaN or an index
error; the result must equal the same call on a plain contiguous cache, and both the float64 oracle by the
2x rule. The gather's count of rows read proves the paged path ran and read only the rows in use.
"""
import pytest
import torch

import flash_metal
from flash_metal import _kvcache
from numerics import DTYPES, assert_attention_close, dtype_id

NAN = float("nan")


def _bhsd(t):
    return t.transpose(1, 2)


def _paginate(plain, lengths, page, g, spare=3, fill=NAN):
    """plain (B, S, H, D) -> (pages (num_blocks, page, H, D), block_table int32): each batch's first lengths[b]
    rows (rounded up to whole pages) copied into shuffled blocks among `spare` unused ones; the rest NaN."""
    B, S = plain.shape[:2]
    per = -(-S // page)
    need = [-(-int(n) // page) for n in lengths]
    num_blocks = sum(need) + spare
    order = torch.randperm(num_blocks, generator=g)
    pages = torch.full((num_blocks, page, *plain.shape[2:]), fill, dtype=plain.dtype)
    table = torch.full((B, per), num_blocks + 7, dtype=torch.int32)  # unused entries name no block
    used = 0
    for b in range(B):
        for e in range(need[b]):
            blk = int(order[used])
            used += 1
            table[b, e] = blk
            rows = plain[b, e * page:(e + 1) * page]
            pages[blk, :rows.shape[0]] = rows
    for b in range(B):  # rows past the length inside the last page are never read either
        n = int(lengths[b])
        if n % page:
            pages[int(table[b, n // page]), n % page:] = fill
    return pages, table


class _GatherSpy:
    """Counts the rows a paged call reads (the proof the paged path ran): the rows
    flash_metal._kvcache.gather copies, and the rows in use (2 * sum(cache_seqlens), k
    and v) of each attention_kvcache call, which reads those and no other
    (tests/api/test_kvcache_op.py: NaN rows and poisoned table entries, the sanitizer)."""

    def __init__(self, monkeypatch):
        from flash_metal import ops

        self.rows = 0
        real, real_op = _kvcache.gather, ops.attention_kvcache_with_lse

        def spy(cache, rows):
            self.rows += int(rows[0].numel())
            return real(cache, rows)

        def op_spy(q, k_cache, v_cache, cache_seqlens, *args, **kwargs):
            self.rows += 2 * int(cache_seqlens.sum())
            return real_op(q, k_cache, v_cache, cache_seqlens, *args, **kwargs)

        monkeypatch.setattr(_kvcache, "gather", spy)
        monkeypatch.setattr(ops, "attention_kvcache_with_lse", op_spy)


def _plain_cache(B, S, Hkv, D, Dv, lengths, dtype, g):
    k, v = torch.full((B, S, Hkv, D), NAN), torch.full((B, S, Hkv, Dv), NAN)
    for b, n in enumerate(lengths):
        k[b, :n], v[b, :n] = torch.randn(n, Hkv, D, generator=g), torch.randn(n, Hkv, Dv, generator=g)
    return k.to(dtype), v.to(dtype)


CASES = [  # (page, causal, window, softcap, sinks)
    (1, True, (-1, -1), 0.0, False),
    (3, False, (-1, -1), 0.0, True),
    (4, True, (5, 0), 0.0, False),    # the window's edge crosses page boundaries
    (16, True, (-1, -1), 9.0, True),
    (7, False, (6, 2), 0.0, False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("page,causal,window,softcap,with_sinks", CASES,
                         ids=[f"p{c[0]}-{'causal' if c[1] else 'full'}-w{c[2][0]}_{c[2][1]}-cap{c[3]:g}"
                              f"{'-sinks' if c[4] else ''}" for c in CASES])
def test_paged_cache_equals_the_plain_cache(monkeypatch, dtype, page, causal, window, softcap, with_sinks):
    g = torch.Generator().manual_seed(100 + page)
    B, S, H, Hkv, D, sq = 4, 37, 4, 2, 32, 3
    lengths = [9, 0, S, 16]  # an empty sequence, a full one, one ending on a page boundary (page 4, 16)
    k_plain, v_plain = _plain_cache(B, S, Hkv, D, D, lengths, dtype, g)
    k_pages, table = _paginate(k_plain, lengths, page, torch.Generator().manual_seed(1))
    v_pages, _ = _paginate(v_plain, lengths, page, torch.Generator().manual_seed(1))
    q = torch.randn(B, sq, H, D, generator=g).to(dtype)
    sinks = torch.randn(H, generator=g) if with_sinks else None
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    opts = dict(cache_seqlens=seqlens, causal=causal, window_size=window, softcap=softcap, sinks=sinks,
                return_softmax_lse=True)
    spy = _GatherSpy(monkeypatch)
    out, lse = flash_metal.flash_attn_with_kvcache(q, k_pages, v_pages, block_table=table, **opts)
    assert spy.rows == 2 * sum(lengths), "the paged call must gather exactly the rows in use, k and v"
    ref_out, ref_lse = flash_metal.flash_attn_with_kvcache(q, k_plain, v_plain, **opts)
    assert spy.rows == 2 * sum(lengths), "the plain call reads the cache in place"
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    for b, n in enumerate(lengths):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            continue
        assert_attention_close(_bhsd(out[b:b + 1]), lse[b:b + 1], _bhsd(q[b:b + 1]), _bhsd(k_plain[b:b + 1, :n]),
                               _bhsd(v_plain[b:b + 1, :n]), causal, None, window_left=window[0],
                               window_right=window[1], softcap=softcap, sinks=sinks)


@pytest.mark.parametrize("page", [1, 4, 5])
def test_paged_appends_cross_page_boundaries_in_place(page):
    # 6 new keys per batch, appended at lengths that put them across one or more page boundaries.
    g = torch.Generator().manual_seed(200 + page)
    B, S, H, Hkv, D, Dv, new = 3, 30, 4, 2, 16, 8, 6
    lengths = [3, 0, 22]
    k_plain, v_plain = _plain_cache(B, S, Hkv, D, Dv, lengths, torch.float32, g)
    ends = [n + new for n in lengths]
    k_pages, table = _paginate(k_plain, ends, page, torch.Generator().manual_seed(2))
    v_pages, _ = _paginate(v_plain, ends, page, torch.Generator().manual_seed(2))
    k_before, v_before = k_pages.clone(), v_pages.clone()
    q = torch.randn(B, new, H, D, generator=g)
    k_new, v_new = torch.randn(B, new, Hkv, D, generator=g), torch.randn(B, new, Hkv, Dv, generator=g)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    out, lse = flash_metal.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, cache_seqlens=seqlens,
                                                   block_table=table, causal=True, return_softmax_lse=True)
    written = torch.zeros(k_pages.shape[:2], dtype=torch.bool)
    for b in range(B):
        for i in range(new):
            j = lengths[b] + i
            blk, off = int(table[b, j // page]), j % page
            assert torch.equal(k_pages[blk, off], k_new[b, i]) and torch.equal(v_pages[blk, off], v_new[b, i])
            written[blk, off] = True
    # Nothing else changed (NaN where it was NaN).
    for pages, before in ((k_pages, k_before), (v_pages, v_before)):
        assert torch.equal(pages[~written].nan_to_num(7.0), before[~written].nan_to_num(7.0))
    for b in range(B):
        keys_k = torch.cat((k_plain[b, :lengths[b]], k_new[b]))[None]
        keys_v = torch.cat((v_plain[b, :lengths[b]], v_new[b]))[None]
        assert_attention_close(_bhsd(out[b:b + 1]), lse[b:b + 1], _bhsd(q[b:b + 1]), _bhsd(keys_k), _bhsd(keys_v),
                               True)


def test_cache_batch_idx_picks_rows_and_appends_there(monkeypatch):
    g = torch.Generator().manual_seed(300)
    B_cache, B, S, H, Hkv, D, new = 5, 3, 20, 4, 2, 16, 2
    lengths = [4, 11, 0, 7, 9]
    k_cache, v_cache = _plain_cache(B_cache, S, Hkv, D, D, lengths, torch.float32, g)
    idx = torch.tensor([3, 0, 4], dtype=torch.int32)
    seqlens = torch.tensor([lengths[i] for i in idx.tolist()], dtype=torch.int32)
    q = torch.randn(B, 1, H, D, generator=g)
    k_new, v_new = torch.randn(B, new, Hkv, D, generator=g), torch.randn(B, new, Hkv, D, generator=g)
    untouched = [1, 2]
    before = k_cache[untouched].clone()
    spy = _GatherSpy(monkeypatch)
    out, lse = flash_metal.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                                   cache_batch_idx=idx, return_softmax_lse=True)
    assert spy.rows == 2 * int((seqlens + new).sum())
    assert torch.equal(k_cache[untouched].nan_to_num(7.0), before.nan_to_num(7.0))
    for b, row in enumerate(idx.tolist()):
        n = int(seqlens[b])
        assert torch.equal(k_cache[row, n:n + new], k_new[b]) and torch.equal(v_cache[row, n:n + new], v_new[b])
        assert_attention_close(_bhsd(out[b:b + 1]), lse[b:b + 1], _bhsd(q[b:b + 1]), _bhsd(k_cache[row:row + 1, :n + new]),
                               _bhsd(v_cache[row:row + 1, :n + new]), False)


@pytest.mark.parametrize("paged", [False, True], ids=["plain", "paged"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (3, 0))])
def test_cache_leftpad_skips_the_rows_before_it(paged, causal, window):
    # Batch b's keys are rows leftpad[b] .. seqlens[b] - 1; the rows before hold NaN and are never read;
    # causal and the window are bottom-right aligned to that range.
    g = torch.Generator().manual_seed(400)
    B, S, H, Hkv, D, sq = 3, 24, 4, 2, 16, 2
    lengths, pads = [10, 24, 5], [4, 0, 5]
    k_cache, v_cache = _plain_cache(B, S, Hkv, D, D, lengths, torch.float32, g)
    for b, p in enumerate(pads):
        k_cache[b, :p], v_cache[b, :p] = NAN, NAN
    q = torch.randn(B, sq, H, D, generator=g)
    kwargs = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                  cache_leftpad=torch.tensor(pads, dtype=torch.int32), causal=causal, window_size=window,
                  return_softmax_lse=True)
    if paged:
        k_cache, table = _paginate(k_cache, lengths, 4, torch.Generator().manual_seed(3))
        v_cache, _ = _paginate(v_cache, lengths, 4, torch.Generator().manual_seed(3))
        kwargs["block_table"] = table
    out, lse = flash_metal.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
    k_ref, v_ref = _plain_cache(B, S, Hkv, D, D, lengths, torch.float32, torch.Generator().manual_seed(400))
    for b in range(B):
        keys = slice(pads[b], lengths[b])
        if lengths[b] == pads[b]:
            assert torch.equal(out[b], torch.zeros_like(out[b])) and bool((lse[b] == -float("inf")).all())
            continue
        assert_attention_close(_bhsd(out[b:b + 1]), lse[b:b + 1], _bhsd(q[b:b + 1]), _bhsd(k_ref[b:b + 1, keys]),
                               _bhsd(v_ref[b:b + 1, keys]), causal, None, window_left=window[0],
                               window_right=window[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_paged_varlen_prefill(monkeypatch, dtype):
    g = torch.Generator().manual_seed(500)
    lq, lk, page, H, Hkv, D = [3, 0, 17, 1], [5, 2, 17, 9], 4, 4, 2, 32
    cu_q = torch.tensor([0, 3, 3, 20, 21], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 24, 33], dtype=torch.int32)
    q = torch.randn(21, H, D, generator=g).to(dtype)
    k_plain, v_plain = _plain_cache(4, 17, Hkv, D, D, lk, dtype, g)
    k_pages, table = _paginate(k_plain, lk, page, torch.Generator().manual_seed(4))
    v_pages, _ = _paginate(v_plain, lk, page, torch.Generator().manual_seed(4))
    spy = _GatherSpy(monkeypatch)
    out, lse, _ = flash_metal.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lq), max(lk), causal=True,
                                                     window_size=(4, -1), return_attn_probs=True, block_table=table)
    assert spy.rows == 2 * sum(lk)
    packed_k = torch.cat([k_plain[b, :n] for b, n in enumerate(lk)])
    packed_v = torch.cat([v_plain[b, :n] for b, n in enumerate(lk)])
    ref_out, ref_lse, _ = flash_metal.flash_attn_varlen_func(q, packed_k, packed_v, cu_q, cu_k, max(lq), max(lk),
                                                             causal=True, window_size=(4, -1), return_attn_probs=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def _paged_inputs():
    g = torch.Generator().manual_seed(600)
    q = torch.randn(2, 1, 4, 16, generator=g)
    pages = torch.randn(6, 4, 2, 16, generator=g)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    return q, pages, table


BAD = [
    (dict(block_table=torch.tensor([[0, 9, 2], [3, 4, 5]], dtype=torch.int32), cache_seqlens=6),
     r"block_table\[0, 1\] = 9 is out of range: entries in use must name one of k_cache's 6 blocks"),
    (dict(block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int64)),
     r"block_table must be an int32 tensor of shape \(2, max_blocks_per_seq\); got torch.int64"),
    (dict(block_table=torch.tensor([[0, 1, 2]], dtype=torch.int32)),
     r"block_table must be an int32 tensor of shape \(2, max_blocks_per_seq\)"),
    (dict(cache_seqlens=13), r"cache_seqlens \(up to 13\) exceed the block table's capacity .* of 12 keys"),
    (dict(cache_seqlens=torch.tensor([3, 4], dtype=torch.int32), cache_batch_idx=torch.tensor([0, 1])),
     r"cache_batch_idx cannot be combined with block_table"),
    (dict(cache_seqlens=torch.tensor([3, 4], dtype=torch.int32), cache_leftpad=torch.tensor([4, 0])),
     r"cache_leftpad must lie in \[0, cache_seqlens\]"),
    (dict(cache_seqlens=torch.tensor([3, 4, 5], dtype=torch.int32)),
     r"cache_seqlens must be an int32 tensor of shape \(2,\)"),
]


@pytest.mark.parametrize("kwargs,pattern", BAD, ids=[p.split(" ")[0].strip("\\") for _, p in BAD])
def test_bad_paged_input_is_refused_naming_the_argument(kwargs, pattern):
    q, pages, table = _paged_inputs()
    kwargs = dict(kwargs)
    kwargs.setdefault("block_table", table)
    with pytest.raises(ValueError, match=r"flash_metal.flash_attn_with_kvcache: " + pattern):
        flash_metal.flash_attn_with_kvcache(q, pages, pages, **kwargs)


def test_bad_plain_cache_input_is_refused():
    q, pages, _ = _paged_inputs()
    cache = torch.randn(3, 10, 2, 16)
    with pytest.raises(ValueError, match=r"cache_batch_idx\[1\] = 3 is out of range for k_cache's 3 sequences"):
        flash_metal.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=2, cache_batch_idx=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"k_cache and v_cache must agree in \(num_blocks, page_size, heads\)"):
        flash_metal.flash_attn_with_kvcache(q, pages, pages[:, :2], block_table=_paged_inputs()[2])
    with pytest.raises(ValueError, match=r"cache_seqlens \+ the appended rows \(up to 11\) exceed the cache of 10 keys"):
        flash_metal.flash_attn_with_kvcache(q, cache[:2], cache[:2], q[:, :, :2], q[:, :, :2], cache_seqlens=10)
    with pytest.raises(ValueError, match=r"flash_attn_varlen_func: a sequence of 13 keys \(cu_seqlens_k\) exceeds"):
        flash_metal.flash_attn_varlen_func(q[:, 0], pages, pages, torch.tensor([0, 1, 2], dtype=torch.int32),
                                           torch.tensor([0, 13, 14], dtype=torch.int32), 1, 13,
                                           block_table=_paged_inputs()[2])
