"""flash_attn_with_kvcache on quantized caches (issue 44): flash-attn's (B, Nk, Hkv, D) layout,
flash-attn 3's k_descale / v_descale for fp8, and appends quantized on the way in.

A decode step appends new k / v into a quantized cache (plain or paged) and
attends; the appended rows must read back as quantize_kv would have written
them, the rows before them untouched, and the output must meet the 2x rule
against float64 attention over the dequantized cache after the append.
"""
import pytest
import torch

import flash_metal
from flash_metal import dequantize_kv, quantize_kv
from numerics import assert_attention_close


def _quant(x, fmt):
    r = quantize_kv(x, fmt, per="head") if fmt == "fp8_e4m3" else quantize_kv(x, fmt, scale_dtype=torch.float32) \
        if fmt == "q4" else quantize_kv(x, fmt)
    return r


def _kwargs(side, r):
    if r.format == "fp8_e4m3":
        return {f"{side}_descale": r.scale}
    out = {f"{side}_scale": r.scale}
    if r.bias is not None:
        out[f"{side}_bias"] = r.bias
    return out


def _deq(r):
    return dequantize_kv(r.codes, r.scale, r.bias)


@pytest.mark.parametrize("kf, vf, paged", [("int8", "q4", False), ("q4", "fp8_e4m3", True),
                                           ("fp8_e4m3", "int8", True)])
def test_append_then_decode(kf, vf, paged):
    g = torch.Generator().manual_seed(len(kf) * 7 + paged)
    B, S, Hkv, Hq, D, s_new = 2, 96, 2, 4, 64, 2
    lens = torch.tensor([40, 71], dtype=torch.int32)
    kr, vr = _quant(torch.randn(B, S, Hkv, D, generator=g), kf), _quant(torch.randn(B, S, Hkv, D, generator=g), vf)
    k_new, v_new = torch.randn(B, s_new, Hkv, D, generator=g), torch.randn(B, s_new, Hkv, D, generator=g)
    q = torch.randn(B, 1, Hq, D, generator=g)
    before_k, before_v = _deq(kr).clone(), _deq(vr).clone()
    kw = {**_kwargs("k", kr), **_kwargs("v", vr)}
    if paged:  # pages of 16 rows, batch b's pages in reverse order at the back of the pool
        page = 16
        nblk = S // page
        perm = [b * nblk + (nblk - 1 - e) for b in range(B) for e in range(nblk)]
        table = torch.tensor(perm, dtype=torch.int32).view(B, nblk)

        def to_pages(t):
            out = torch.empty((B * nblk, page, *t.shape[2:]), dtype=t.dtype)
            src = t.reshape(B * nblk, page, *t.shape[2:])
            view = (lambda x: x.view(torch.int32)) if t.dtype == torch.uint32 else \
                (lambda x: x.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn else (lambda x: x)
            view(out)[table.flatten().long()] = view(src)
            return out

        k_cache, v_cache = to_pages(kr.codes), to_pages(vr.codes)
        kw = {n: (to_pages(t) if t.dim() >= 3 else t) for n, t in kw.items()}
        out = flash_metal.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                                  block_table=table, causal=True, return_softmax_lse=True, **kw)
        out, lse = out

        def back(t):  # the pages in sequence order again
            view = (lambda x: x.view(torch.int32)) if t.dtype == torch.uint32 else \
                (lambda x: x.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn else (lambda x: x)
            got = view(t)[table.flatten().long()]
            if t.dtype in (torch.uint32, torch.float8_e4m3fn):
                got = got.view(t.dtype)
            return got.reshape(B, S, *t.shape[2:])

        kr = kr._replace(codes=back(k_cache), scale=back(kw["k_scale"]) if "k_scale" in kw else kr.scale,
                         bias=back(kw["k_bias"]) if "k_bias" in kw else None)
        vr = vr._replace(codes=back(v_cache), scale=back(kw["v_scale"]) if "v_scale" in kw else vr.scale,
                         bias=back(kw["v_bias"]) if "v_bias" in kw else None)
    else:
        out = flash_metal.flash_attn_with_kvcache(q, kr.codes, vr.codes, k_new, v_new, cache_seqlens=lens,
                                                  causal=True, return_softmax_lse=True, **kw)
        out, lse = out
    kd, vd = _deq(kr), _deq(vr)
    for b in range(B):
        n = int(lens[b])
        # Rows before the append untouched; the appended rows are the new k / v quantized.
        assert torch.equal(kd[b, :n], before_k[b, :n]) and torch.equal(vd[b, :n], before_v[b, :n])
        for fmt, d, new, r in ((kf, kd, k_new, kr), (vf, vd, v_new, vr)):
            if fmt == "fp8_e4m3":
                want = dequantize_kv(quantize_kv(new[b:b + 1], fmt, descale=r.scale[b:b + 1]).codes,
                                     r.scale[b:b + 1])[0]
            else:
                w = quantize_kv(new[b:b + 1], fmt, scale_dtype=torch.float32) if fmt == "q4" else \
                    quantize_kv(new[b:b + 1], fmt)
                want = dequantize_kv(w.codes, w.scale, w.bias)[0]
            assert torch.equal(d[b, n:n + s_new], want)
        m = n + s_new
        assert_attention_close(out[b:b + 1].transpose(1, 2), lse[b:b + 1], q[b:b + 1].transpose(1, 2),
                               kd[b:b + 1, :m].transpose(1, 2), vd[b:b + 1, :m].transpose(1, 2), True)


def test_lse_and_spy():
    """return_softmax_lse, and the quantized kernel's counter moves (int8 K, int8 V)."""
    g = torch.Generator().manual_seed(3)
    kr, vr = quantize_kv(torch.randn(1, 50, 2, 64, generator=g), "int8"), \
        quantize_kv(torch.randn(1, 50, 2, 64, generator=g), "int8")
    q = torch.randn(1, 1, 4, 64, generator=g)
    before = torch.ops.flash_metal.kvcache_quant_counts()
    out, lse = flash_metal.flash_attn_with_kvcache(q, kr.codes, vr.codes, cache_seqlens=50, k_scale=kr.scale,
                                                   v_scale=vr.scale, return_softmax_lse=True)
    after = torch.ops.flash_metal.kvcache_quant_counts()
    assert after[3] == before[3] + 1 and after[9] == before[9] + 1
    assert_attention_close(out.transpose(1, 2), lse, q.transpose(1, 2), _deq(kr).transpose(1, 2),
                           _deq(vr).transpose(1, 2))


def test_names_checked():
    x = torch.randn(1, 8, 2, 64)
    f, i8 = quantize_kv(x, "fp8_e4m3"), quantize_kv(x, "int8")
    q = torch.randn(1, 1, 2, 64)
    with pytest.raises(ValueError, match="k_cache is float8_e4m3fn, whose scale is k_descale"):
        flash_metal.flash_attn_with_kvcache(q, f.codes, i8.codes, k_scale=f.scale, v_scale=i8.scale)
    with pytest.raises(ValueError, match="v_descale was given but v_cache is torch.int8"):
        flash_metal.flash_attn_with_kvcache(q, f.codes, i8.codes, k_descale=f.scale, v_descale=f.scale)
    with pytest.raises(ValueError, match="cache_leftpad is not supported with a quantized cache"):
        flash_metal.flash_attn_with_kvcache(q, f.codes, i8.codes, k_descale=f.scale, v_scale=i8.scale,
                                            cache_leftpad=torch.zeros(1, dtype=torch.int32))
