"""Every entry point that takes sinks returns their gradient (issue 41).

flash_metal.attention and attention_varlen (the autograd formulas of
flash_metal/ops.py), flash_attn_func, flash_attn_varlen_func packed and
paged (block_table), attention_kvcache_with_lse with 4-D and packed queries,
and flash_attn_with_kvcache (paged, a plain cache with cache_seqlens, the
whole plain cache, cache_batch_idx, and an append), each in two ways: sinks
the only input that requires grad (the case that used to take a no-backward
path and drop the gradient silently), and q, the keys and sinks all
requiring it. One problem underlies them all: 2 sequences of 37 query rows
(74 rows per head: past 32, so a reduction over rows crosses SIMD-group
lanes and wraps around), 45 and 30 keys (the dense paths: 45 and 45), GQA
4:2, causal, sinks of real weight; out is reached through the layout each
entry point returns, so grad_out arrives strided (transposed or sliced).
Each gradient is compared with autograd through the float64 oracle
(flash_metal.reference.attention_varlen_reference); CPU float32, where the
kernels are checked against the oracle by the 2x rule elsewhere, here to
1e-4 relative (a dropped or misrouted gradient is off by O(1)). The Metal
kernels' own sinks gradients are tests/api/test_sinks.py's.

metal_attention (transformers) is tests/api/test_transformers_matrix.py's: every
route with sinks, backward included.

Planted (each run against this file and reverted):
  * attention_kvcache_with_lse deciding "gradient wanted" from q and the
    caches only, not sinks (the escaped bug, which flash_attn_varlen_func's
    paged branch had): fails the six paged/cache [*-sinks_only] cases,
    [varlen_paged-sinks_only] among them.
  * attention_kvcache_with_lse without its gather path (the op always): fails
    all twelve kvcache / paged / batch_idx / append cases (the op's backward
    now says it has none, where a None gradient used to pass with a warning).
  * flash_attn_with_kvcache back under torch.no_grad: fails all ten
    [with_kvcache_*] cases (no gradient).
  * _varlen_backward returning None for sinks: fails all 18 varlen-based cases.
Cost: ~2 s on 2 cores.
"""
import pytest
import torch

import flash_metal
from flash_metal import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from flash_metal.reference import attention_varlen_reference

B, HQ, HKV, D, NQ, PAGE = 2, 4, 2, 16, 37, 8


def _problem(dense, seed=0):
    """Packed q (B*NQ, HQ, D), k and v (sum of lengths, HKV, D), cu_seqlens, sinks, a grad weight."""
    g = torch.Generator().manual_seed(seed)
    lengths = [45, 45] if dense else [45, 30]
    cu_q = torch.tensor([0, NQ, 2 * NQ], dtype=torch.int32)
    cu_k = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    q = torch.randn(B * NQ, HQ, D, generator=g)
    k = torch.randn(sum(lengths), HKV, D, generator=g)
    v = torch.randn(sum(lengths), HKV, D, generator=g)
    sinks = torch.randn(HQ, generator=g) * 1.5 + 0.5  # each sink takes a real share of its rows
    weight = torch.randn(B * NQ, HQ, D, generator=g)
    return dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, lengths=lengths, sinks=sinks, weight=weight)


def _paged(p, g):
    """k and v of p in a paged cache (blocks in shuffled order, NaN in every row not in use) and its table."""
    blocks = [(n + PAGE - 1) // PAGE for n in p["lengths"]]
    order = torch.randperm(sum(blocks) + 3, generator=g)  # 3 spare blocks never used
    k_cache = torch.full((len(order), PAGE, HKV, D), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    table = torch.zeros(B, max(blocks), dtype=torch.int32)
    start, used = 0, 0
    for b, n in enumerate(p["lengths"]):
        for j in range(blocks[b]):
            blk = int(order[used])
            used += 1
            table[b, j] = blk
            rows = slice(start + j * PAGE, start + min(n, (j + 1) * PAGE))
            k_cache[blk, : rows.stop - rows.start] = p["k"][rows]
            v_cache[blk, : rows.stop - rows.start] = p["v"][rows]
        start += n
    return k_cache, v_cache, table


def _plain(p):
    """k and v of p in a plain (B, S, HKV, D) cache, NaN past each sequence's length."""
    s = max(p["lengths"])
    k_cache = torch.full((B, s, HKV, D), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    for b, (lo, hi) in enumerate(zip(p["cu_k"][:-1].tolist(), p["cu_k"][1:].tolist())):
        k_cache[b, : hi - lo], v_cache[b, : hi - lo] = p["k"][lo:hi], p["v"][lo:hi]
    return k_cache, v_cache


def _as4d(x):  # packed (B*NQ, H, D) -> (B, H, NQ, D), a view of a transposed copy
    return x.view(B, NQ, *x.shape[1:]).transpose(1, 2)


def _packed(out4):  # (B, H, NQ, D) -> packed (B*NQ, H, D): reached through a transpose, so grad_out is strided
    return out4.transpose(1, 2).reshape(B * NQ, *out4.shape[1:2], out4.shape[-1])


# Each path: (dense problem?, fn(p, q, k, v, sinks) -> packed out). q, k, v, sinks are the leaves (packed).
PATHS = {
    "attention": (True, lambda p, q, k, v, s: _packed(flash_metal.attention(
        _as4d(q), k.view(B, 45, HKV, D).transpose(1, 2), v.view(B, 45, HKV, D).transpose(1, 2), True, sinks=s))),
    "varlen": (False, lambda p, q, k, v, s: flash_metal.attention_varlen(
        q, k, v, p["cu_q"], p["cu_k"], NQ, 45, True, sinks=s)),
    "flash_attn_func": (True, lambda p, q, k, v, s: flash_attn_func(
        q.view(B, NQ, HQ, D), k.view(B, 45, HKV, D), v.view(B, 45, HKV, D), causal=True, sinks=s
    ).reshape(B * NQ, HQ, D)),
    "varlen_packed": (False, lambda p, q, k, v, s: flash_attn_varlen_func(
        q, k, v, p["cu_q"], p["cu_k"], NQ, 45, causal=True, sinks=s)),
    "varlen_paged": (False, lambda p, q, k, v, s: _paged_call(p, q, k, v, lambda kc, vc, t: flash_attn_varlen_func(
        q, kc, vc, p["cu_q"], p["cu_k"], NQ, 45, causal=True, block_table=t, sinks=s))),
    "kvcache_4d": (False, lambda p, q, k, v, s: _paged_call(p, q, k, v, lambda kc, vc, t: _packed(
        flash_metal.attention_kvcache_with_lse(_as4d(q), kc, vc, p["seqlens"], t, True, sinks=s)[0]))),
    "kvcache_packed": (False, lambda p, q, k, v, s: _paged_call(p, q, k, v, lambda kc, vc, t: (
        flash_metal.attention_kvcache_with_lse(q, kc, vc, p["seqlens"], t, True, sinks=s, cu_seqlens_q=p["cu_q"],
                                               max_seqlen_q=NQ)[0]))),
    "with_kvcache_paged": (False, lambda p, q, k, v, s: _paged_call(p, q, k, v, lambda kc, vc, t: (
        flash_attn_with_kvcache(q.view(B, NQ, HQ, D), kc, vc, cache_seqlens=p["seqlens"], block_table=t, causal=True,
                                sinks=s).reshape(B * NQ, HQ, D)))),
    "with_kvcache_plain": (False, lambda p, q, k, v, s: flash_attn_with_kvcache(
        q.view(B, NQ, HQ, D), *p["plain"](k, v), cache_seqlens=p["seqlens"], causal=True, sinks=s
    ).reshape(B * NQ, HQ, D)),
    "with_kvcache_whole": (True, lambda p, q, k, v, s: flash_attn_with_kvcache(
        q.view(B, NQ, HQ, D), k.view(B, 45, HKV, D), v.view(B, 45, HKV, D), causal=True, sinks=s
    ).reshape(B * NQ, HQ, D)),
    "with_kvcache_batch_idx": (False, lambda p, q, k, v, s: flash_attn_with_kvcache(
        q.view(B, NQ, HQ, D), *(c.flip(0) for c in p["plain"](k, v)), cache_seqlens=p["seqlens"],
        cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32), causal=True, sinks=s).reshape(B * NQ, HQ, D)),
    "with_kvcache_append": (False, lambda p, q, k, v, s: flash_attn_with_kvcache(
        q.view(B, NQ, HQ, D), *p["appended"](k, v), k=p["new_k"], v=p["new_v"], cache_seqlens=p["seqlens"] - 2,
        block_table=p["paged"](k, v)[2], causal=True, sinks=s).reshape(B * NQ, HQ, D)),
}


def _paged_call(p, q, k, v, call):
    return call(*p["paged"](k, v))


def _setup(name):
    dense, fn = PATHS[name]
    p = _problem(dense, seed=len(name))
    g = torch.Generator().manual_seed(1)
    pages = _paged(p, g)
    p["seqlens"] = torch.tensor(p["lengths"], dtype=torch.int32)

    def paged(k, v):
        # The leaves' rows written into the cache through the table (a differentiable scatter), NaN elsewhere.
        kc, vc, table = pages
        kc, vc = kc.clone(), vc.clone()
        rows = _rows(table, p["lengths"])
        kc[rows], vc[rows] = k, v
        return kc, vc, table

    def appended(k, v):  # the cache without each sequence's last 2 rows, which the call appends (p["new_k"])
        kc, vc, table = pages
        rows = _rows(table, p["lengths"])
        kc, vc = kc.clone(), vc.clone()
        kc[rows], vc[rows] = k.detach(), v.detach()
        last = torch.cat([torch.arange(hi - 2, hi) for hi in p["cu_k"][1:].tolist()])
        p["new_k"], p["new_v"] = k.detach()[last].view(B, 2, HKV, D), v.detach()[last].view(B, 2, HKV, D)
        blk, off = rows[0][last], rows[1][last]
        kc[blk, off], vc[blk, off] = float("nan"), float("nan")  # written by the append
        return kc, vc

    def plain(k, v):
        kc, vc = _plain(p)
        for b, (lo, hi) in enumerate(zip(p["cu_k"][:-1].tolist(), p["cu_k"][1:].tolist())):
            kc[b, : hi - lo], vc[b, : hi - lo] = k[lo:hi], v[lo:hi]
        return kc, vc

    p.update(paged=paged, appended=appended, plain=plain)
    return p, fn


def _rows(table, lengths):
    blk = torch.cat([table[b, torch.arange(n) // PAGE].long() for b, n in enumerate(lengths)])
    off = torch.cat([torch.arange(n) % PAGE for n in lengths])
    return blk, off


def _reference(p, which):
    leaves = {n: p[n].double().requires_grad_(n in which) for n in ("q", "k", "v", "sinks")}
    out, _ = attention_varlen_reference(leaves["q"], leaves["k"], leaves["v"], p["cu_q"], p["cu_k"], True, None,
                                        sinks=leaves["sinks"])
    (out * p["weight"].double()).sum().backward()
    return {n: t.grad for n, t in leaves.items() if n in which}


WHICH = {"sinks_only": ("sinks",), "all": ("q", "k", "v", "sinks")}


@pytest.mark.parametrize("which", list(WHICH))
@pytest.mark.parametrize("path", list(PATHS))
def test_sinks_gradient(path, which):
    p, fn = _setup(path)
    wanted = WHICH[which]
    if path == "with_kvcache_append":
        wanted = tuple(n for n in wanted if n not in ("k", "v"))  # appended rows get no gradient (documented)
    leaves = {n: p[n].clone().requires_grad_(n in wanted) for n in ("q", "k", "v", "sinks")}
    out = fn(p, leaves["q"], leaves["k"], leaves["v"], leaves["sinks"])
    assert out.requires_grad, "the output does not depend on any input that requires grad"
    (out * p["weight"]).sum().backward()
    ref = _reference(p, wanted)
    for n in wanted:
        got = leaves[n].grad
        assert got is not None, f"{path}: no gradient for {n}"
        assert torch.isfinite(got).all(), f"{path}: {n}'s gradient is not finite (a NaN row of the cache read?)"
        torch.testing.assert_close(got.double(), ref[n], rtol=1e-4, atol=1e-4, msg=f"{path}: grad of {n}")
    assert ref["sinks"].abs().max() > 0.02  # 200x the tolerance: a zero gradient cannot pass
    for n in set(("q", "k", "v")) - set(wanted):
        assert leaves[n].grad is None


def test_raw_kvcache_op_refuses_a_backward():
    # torch.ops.flash_metal.attention_kvcache itself has no backward: asked for one, it says so (autograd's
    # fallback would otherwise warn and leave the gradients None).
    p, _ = _setup("kvcache_4d")
    s = p["sinks"].clone().requires_grad_(True)
    kc, vc, table = p["paged"](p["k"], p["v"])
    out, _ = torch.ops.flash_metal.attention_kvcache(_as4d(p["q"]), kc, vc, p["seqlens"], table, True, sinks=s)
    with pytest.raises(NotImplementedError, match="attention_kvcache has no backward: call "
                                                  "flash_metal.attention_kvcache_with_lse"):
        out.sum().backward()
    with torch.no_grad():  # and without a gradient wanted the wrapper still runs the op (no gather)
        want = flash_metal.attention_kvcache_with_lse(_as4d(p["q"]), kc, vc, p["seqlens"], table, True, sinks=s)[0]
    torch.testing.assert_close(out.detach(), want)


def test_kvcache_gradient_path_refuses_a_forced_kernel():
    p, _ = _setup("kvcache_4d")
    kc, vc, table = p["paged"](p["k"], p["v"])
    s = p["sinks"].clone().requires_grad_(True)
    with pytest.raises(ValueError, match=r"impl='decode' picks a forward-only kernel; with a gradient wanted"):
        flash_metal.attention_kvcache_with_lse(_as4d(p["q"]), kc, vc, p["seqlens"], table, True, sinks=s,
                                               impl="decode")
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, 48\]"):
        flash_metal.attention_kvcache_with_lse(_as4d(p["q"]), kc, vc, torch.tensor([45, 99], dtype=torch.int32),
                                               table, True, sinks=s)
