"""Quantized KV caches for the tests (issue 44): random caches in each format, paged and poisoned.

A case starts from a plain quantized cache (B, capacity, Hkv, ...) -- codes
and their scales -- and, paged, scatters every row in use into shuffled
blocks of `page` rows through a table whose entries past each sequence's
pages are out of range. Rows not in use are poison: NaN scales and biases,
float8 codes 0x7F (e4m3fn's NaN), NaN float caches; a kernel that reads one
produces NaN. The reference is attention over the dequantized cache
(flash_metal.dequantize_kv) in float64.

exact=True (16-bit q): codes and scales are drawn so that every dequantized
value is exact in bfloat16 and float16 (power-of-two scales; few code bits),
so the oracle sees in q's dtype the very values the kernel computes with.
"""
import math

import torch

import flash_metal
from flash_metal import dequantize_kv, quantize_kv

POISON = 1 << 20


def _pow2_up(x):
    return torch.exp2(torch.ceil(torch.log2(x.clamp_min(1e-30))))


def make_side(fmt, x, g, exact, group_size=64, packing="uint32", scale_dtype=torch.float32):
    """(codes, scale, bias) of x (B, S, Hkv, D) float32 in fmt ('native-<dtype>' keeps x in that dtype)."""
    if fmt.startswith("native"):
        return x.to(getattr(torch, fmt.split("-")[1])), None, None
    if fmt == "int8":
        if not exact:
            r = quantize_kv(x, "int8")
            return r.codes, r.scale, None
        scale = _pow2_up(x.abs().amax(-1) / 127)
        return torch.round(x / scale[..., None]).clamp(-127, 127).to(torch.int8), scale, None
    if fmt == "q4":
        if not exact:
            r = quantize_kv(x, "q4", group_size=group_size, packing=packing, scale_dtype=scale_dtype)
            return r.codes, r.scale, r.bias
        shape = (*x.shape[:-1], x.shape[-1] // group_size)
        codes = torch.randint(0, 16, x.shape, generator=g, dtype=torch.int32)
        scale = torch.exp2(torch.randint(-5, -2, shape, generator=g).float())
        bias = torch.randint(-48, 1, shape, generator=g).float() * 2.0 ** -6
        from flash_metal.quantized_kv import _pack_q4
        return _pack_q4(codes, packing), scale.to(scale_dtype), bias.to(scale_dtype)
    if fmt == "fp8_e4m3":
        per = "head"
        descale = None
        if exact:
            descale = _pow2_up(x.abs().amax(dim=(1, 3)) / 448)
        r = quantize_kv(x, "fp8_e4m3", per=per, descale=descale)
        return r.codes, r.scale, None
    raise ValueError(fmt)


def poison_rows(codes, scale, bias, fmt, keep):
    """Rows where keep (B, S) is False poisoned in place (see the module doc)."""
    drop = ~keep
    if fmt.startswith("native"):
        codes[drop] = float("nan")
    if fmt == "fp8_e4m3":
        codes.view(torch.uint8)[drop] = 0x7F
    if fmt in ("int8", "q4"):
        scale[drop] = float("nan")
    if bias is not None:
        bias[drop] = float("nan")


def page_rows(t, table, page, num_blocks, seqlens, fill):
    """t (B, S, ...) scattered into (num_blocks, page, ...) through table; other rows = fill."""
    out = torch.empty((num_blocks, page, *t.shape[2:]), dtype=t.dtype)
    if out.dtype == torch.float8_e4m3fn:
        out.view(torch.uint8).fill_(0x7F)
    elif out.dtype == torch.uint32:
        out.view(torch.int32).fill_(-1)
    elif not out.is_floating_point():
        out.fill_(-77 if out.dtype == torch.int8 else 0xAB)  # codes cannot be NaN: their scales are
    else:
        out.fill_(fill)
    for b, n in enumerate(seqlens):
        for r in range(n):
            blk = int(table[b, r // page])
            if out.dtype == torch.uint32:
                out.view(torch.int32)[blk, r % page] = t.view(torch.int32)[b, r]
            else:
                out[blk, r % page] = t[b, r]
    return out


def make_table(B, page, seqlens, g, spare_entries=2, spare_blocks=3):
    pages_of = [math.ceil(n / page) for n in seqlens]
    max_blocks = max(pages_of) + spare_entries
    num_blocks = sum(pages_of) + spare_blocks
    order = torch.randperm(num_blocks, generator=g)
    table = torch.empty((B, max_blocks), dtype=torch.int32)
    used = 0
    for b in range(B):
        for e in range(max_blocks):
            table[b, e] = int(order[used + e]) if e < pages_of[b] else (POISON if e % 2 else -POISON)
        used += pages_of[b]
    return table, num_blocks


class Case:
    """A quantized-cache call: q, caches (paged or plain), table, lengths, scales, and the dequantized reference."""

    def __init__(self, B, Hq, Hkv, Nq, D, kfmt, vfmt, seqlens, page=None, dtype=torch.float32, exact=False,
                 seed=0, group_size=64, packing="uint32", scale_dtype=torch.float32, outliers=False):
        g = torch.Generator().manual_seed(seed)
        cap = max(max(seqlens), 1) if page is None else None
        if page is not None:
            cap = (max(math.ceil(n / page) for n in seqlens) + 2) * page
        xk = torch.randn(B, cap, Hkv, D, generator=g)
        xv = torch.randn(B, cap, Hkv, D, generator=g)
        if outliers:  # a few channels of large, stable magnitude, as real keys have
            ch = torch.randperm(D, generator=g)[:max(1, D // 32)]
            xk[..., ch] = xk[..., ch] * 8 + 12
        keep = torch.arange(cap)[None, :] < torch.tensor(seqlens)[:, None]
        self.sides = {}
        for name, fmt, x in (("k", kfmt, xk), ("v", vfmt, xv)):
            codes, scale, bias = make_side(fmt, x, g, exact, group_size, packing, scale_dtype)
            ref = (codes.float() if fmt.startswith("native") else dequantize_kv(codes, scale, bias))
            poison_rows(codes, scale, bias, fmt, keep)
            self.sides[name] = (fmt, codes, scale, bias, ref, x)
        self.q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype)
        self.seqlens = list(seqlens)
        self.lens = torch.tensor(seqlens, dtype=torch.int32)
        self.table = None
        self.page = page
        if page is not None:
            self.table, nb = make_table(B, page, seqlens, g)
            for name, (fmt, codes, scale, bias, ref, x) in list(self.sides.items()):
                paged_codes = page_rows(codes, self.table, page, nb, seqlens, float("nan"))
                paged_scale = scale if (scale is None or fmt == "fp8_e4m3") else \
                    page_rows(scale, self.table, page, nb, seqlens, float("nan"))
                paged_bias = None if bias is None else page_rows(bias, self.table, page, nb, seqlens, float("nan"))
                self.sides[name] = (fmt, paged_codes, paged_scale, paged_bias, ref, x)

    def kwargs(self):
        k, v = self.sides["k"], self.sides["v"]
        return dict(k_scale=k[2], k_bias=k[3], v_scale=v[2], v_bias=v[3])

    def run(self, causal=False, impl="auto", **options):
        k, v = self.sides["k"], self.sides["v"]
        return flash_metal.attention_kvcache_with_lse(self.q, k[1], v[1], self.lens, self.table, causal, impl=impl,
                                                      **options, **self.kwargs())

    def reference_kv(self, b, dtype=None):
        """Sequence b's dequantized keys and values as (1, Hkv, n, D) in dtype (default q's)."""
        n = self.seqlens[b]
        dtype = dtype or self.q.dtype
        return tuple(self.sides[s][4][b:b + 1, :n].transpose(1, 2).to(dtype) for s in ("k", "v"))
