"""flash-attn 2.8's API (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache) on flash_metal.

flash-attn's semantics are the oracle's (flash_metal/reference.py: bottom-right
causal, window_size = (left, right) with -1 unbounded, softcap), so the
results are checked against the float64 oracle by the 2x rule, in
flash-attn's (B, S, H, D) layout.
"""
import pytest
import torch

import flash_metal
from numerics import DTYPES, assert_attention_close, assert_gradients_close, assert_varlen_close, dtype_id


def _bshd(b, s, h, d, dtype, g, scale=1.0):
    return (scale * torch.randn(b, s, h, d, generator=g)).to(dtype)


def _bhsd(t):
    return t.transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (True, (16, 0), 0.0), (False, (8, 3), 30.0)])
@pytest.mark.parametrize("sq,sk", [(33, 33), (20, 57), (50, 31)])
def test_flash_attn_func(dtype, causal, window, softcap, sq, sk):
    g = torch.Generator().manual_seed(sq * 1000 + sk)
    q, k, v = _bshd(2, sq, 8, 64, dtype, g), _bshd(2, sk, 2, 64, dtype, g), _bshd(2, sk, 2, 64, dtype, g)
    out, lse, probs = flash_metal.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                                  return_attn_probs=True)
    assert out.shape == q.shape and out.is_contiguous() and probs is None and lse.shape == (2, 8, sq)
    options = dict(window_left=window[0], window_right=window[1], softcap=softcap)
    assert_attention_close(_bhsd(out), lse, _bhsd(q), _bhsd(k), _bhsd(v), causal, None, **options)
    assert torch.equal(flash_metal.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap), out)


def test_flash_attn_func_gradients():
    g = torch.Generator().manual_seed(3)
    q, k, v = _bshd(2, 19, 4, 32, torch.float32, g), _bshd(2, 27, 2, 32, torch.float32, g), \
        _bshd(2, 27, 2, 32, torch.float32, g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_metal.flash_attn_func(*leaves, softmax_scale=0.2, causal=True, window_size=(5, 0))
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    grads = tuple(_bhsd(t.grad) for t in leaves)
    assert_gradients_close(grads, _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(grad), True, 0.2, None, window_left=5)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_flash_attn_varlen_func(dtype):
    g = torch.Generator().manual_seed(4)
    lq, lk = [3, 0, 17, 1], [5, 2, 17, 9]
    cu_q = torch.tensor([0, 3, 3, 20, 21], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 24, 33], dtype=torch.int32)
    q = torch.randn(21, 4, 64, generator=g).to(dtype)
    k, v = (torch.randn(33, 2, 64, generator=g).to(dtype) for _ in range(2))
    out, lse, _ = flash_metal.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True,
                                                     window_size=(4, -1), softcap=5.0, return_attn_probs=True)
    assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, True, None, window_left=4, softcap=5.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_with_kvcache_appends_and_attends(dtype, causal):
    # A KV cache of 40 rows; batch entries hold 7, 20 and 0 rows; 2 new tokens each.
    g = torch.Generator().manual_seed(5)
    B, S, H, Hkv, D, new = 3, 40, 4, 2, 64, 2
    k_cache, v_cache = _bshd(B, S, Hkv, D, dtype, g), _bshd(B, S, Hkv, D, dtype, g)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    seqlens = torch.tensor([7, 20, 0], dtype=torch.int32)
    q = _bshd(B, new, H, D, dtype, g)
    k_new, v_new = _bshd(B, new, Hkv, D, dtype, g), _bshd(B, new, Hkv, D, dtype, g)
    out, lse = flash_metal.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                                   causal=causal, return_softmax_lse=True)
    for b in range(B):
        n = int(seqlens[b])
        # The new rows were written in place after the existing ones; the rest is untouched.
        assert torch.equal(k_cache[b, n:n + new], k_new[b]) and torch.equal(v_cache[b, n:n + new], v_new[b])
        assert torch.equal(k_cache[b, :n], before_k[b, :n]) and torch.equal(k_cache[b, n + new:], before_k[b, n + new:])
        assert torch.equal(v_cache[b, n + new:], before_v[b, n + new:])
        keys = slice(0, n + new)
        assert_attention_close(_bhsd(out[b:b + 1]), lse[b:b + 1], _bhsd(q[b:b + 1]), _bhsd(k_cache[b:b + 1, keys]),
                               _bhsd(v_cache[b:b + 1, keys]), causal)


def test_kvcache_window_and_int_seqlens():
    g = torch.Generator().manual_seed(6)
    k_cache, v_cache = _bshd(2, 30, 2, 32, torch.float32, g), _bshd(2, 30, 2, 32, torch.float32, g)
    q = _bshd(2, 1, 4, 32, torch.float32, g)
    out, lse = flash_metal.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=25, window_size=(6, -1),
                                                   softcap=8.0, return_softmax_lse=True)
    assert_attention_close(_bhsd(out), lse, _bhsd(q), _bhsd(k_cache[:, :25]), _bhsd(v_cache[:, :25]), False, None,
                           window_left=6, softcap=8.0)



@pytest.mark.parametrize("fill", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 2))])
@pytest.mark.parametrize("new", [0, 3])
def test_kvcache_never_reads_rows_past_cache_seqlens(fill, causal, window, new):
    # flash-attn never reads a cache row at or past cache_seqlens[b] (after the
    # append): a cache from torch.empty may hold NaN or inf there. Masking
    # such rows is not enough (0 * NaN in P @ V), so every unused row holds
    # `fill` here, and out and lse must match the used rows alone.
    g = torch.Generator().manual_seed(7 + new)
    B, S, H, Hkv, D, Dv, sq = 4, 37, 6, 2, 32, 16, 3
    seqlens = torch.tensor([5, 0, S - new, 19], dtype=torch.int32)  # one empty, one full after the append
    k_cache, v_cache = torch.full((B, S, Hkv, D), fill), torch.full((B, S, Hkv, Dv), fill)
    for b, n in enumerate(seqlens.tolist()):
        k_cache[b, :n], v_cache[b, :n] = torch.randn(n, Hkv, D, generator=g), torch.randn(n, Hkv, Dv, generator=g)
    q = _bshd(B, sq, H, D, torch.float32, g)
    extra = dict(k=_bshd(B, new, Hkv, D, torch.float32, g), v=_bshd(B, new, Hkv, Dv, torch.float32, g)) if new else {}
    out, lse = flash_metal.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=causal,
                                                   window_size=window, return_softmax_lse=True, **extra)
    assert out.shape == (B, sq, H, Dv) and lse.shape == (B, H, sq)
    for b, n in enumerate((seqlens + new).tolist()):
        if n == 0:  # no key at all: zeros and lse = -inf, as for a fully masked row
            assert torch.equal(out[b], torch.zeros_like(out[b])) and bool((lse[b] == -float("inf")).all())
            continue
        assert bool(out[b].isfinite().all()), f"batch {b}: a row past cache_seqlens reached the output"
        if not causal and window == (-1, -1):
            assert bool(lse[b].isfinite().all())
        keys = slice(0, n)
        assert_attention_close(_bhsd(out[b:b + 1]), lse[b:b + 1], _bhsd(q[b:b + 1]), _bhsd(k_cache[b:b + 1, keys]),
                               _bhsd(v_cache[b:b + 1, keys]), causal, None, window_left=window[0],
                               window_right=window[1])



@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (4, 0))])
def test_kvcache_without_seqlens_attends_to_the_whole_cache(causal, window):
    g = torch.Generator().manual_seed(8)
    k_cache, v_cache = _bshd(2, 23, 2, 32, torch.float32, g), _bshd(2, 23, 2, 32, torch.float32, g)
    q = _bshd(2, 3, 4, 32, torch.float32, g)
    out, lse = flash_metal.flash_attn_with_kvcache(q, k_cache, v_cache, causal=causal, window_size=window,
                                                   softcap=6.0, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 4, 3)
    assert_attention_close(_bhsd(out), lse, _bhsd(q), _bhsd(k_cache), _bhsd(v_cache), causal, None,
                           window_left=window[0], window_right=window[1], softcap=6.0)


UNSUPPORTED = [
    ("flash_attn_func", dict(dropout_p=0.1), r"dropout_p must be 0.0 \(flash_metal has no dropout\)"),
    ("flash_attn_func", dict(alibi_slopes=torch.ones(4)), r"alibi_slopes is not supported by flash_metal"),
    ("flash_attn_with_kvcache", dict(rotary_cos=torch.ones(8, 4)), r"rotary_cos is not supported"),
    ("flash_attn_with_kvcache", dict(rotary_sin=torch.ones(8, 4)), r"rotary_sin is not supported"),
    ("flash_attn_func", dict(window_size=(1, 2, 3)), r"window_size must be \(left, right\)"),
]


@pytest.mark.parametrize("fn,kwargs,pattern", UNSUPPORTED, ids=[f"{f}-{list(k)[0]}" for f, k, _ in UNSUPPORTED])
def test_unsupported_arguments_raise_clearly(fn, kwargs, pattern):
    q = torch.randn(2, 5, 4, 16)
    k = torch.randn(2, 8, 2, 16)
    with pytest.raises(ValueError, match=rf"flash_metal.{fn}: " + pattern):
        getattr(flash_metal, fn)(q, k, k, **kwargs)
