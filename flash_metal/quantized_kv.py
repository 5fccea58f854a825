"""Quantized KV caches (issue 44): the formats, and quantize_kv / dequantize_kv.

A quantized cache is an ordinary tensor of codes plus scales, in flash-attn's
cache layout (B or num_blocks, seqlen or page_size, kv_heads, head_dim).
attention_kvcache and flash_attn_with_kvcache read it in place: the kernels
convert codes in registers and never write a dequantized copy.

Formats (K and V may use different ones):

* ``"int8"``: symmetric, one scale per (token, kv head). codes int8
  (..., Nk, Hkv, D), scale float32 (..., Nk, Hkv); value = code * scale, with
  scale = max |x| / 127 over the head's D elements.
* ``"q4"``: 4-bit group-wise affine in MLX's layout (``mx.quantize`` with
  bits=4): along D, groups of ``group_size`` (32, 64 or 128) elements, each
  with a scale and a bias; value = code * scale + bias, code in 0..15.
  Codes are packed lowest bits first: element d is the 4-bit field at bits
  4 * (d % 8) of little-endian uint32 word d // 8, i.e. codes uint32
  (..., D / 8); or, the same bytes, uint8 (..., D / 2) with element 2i in
  byte i's low nibble. scale and bias (..., Hkv, D / group_size) in
  float32, float16 or bfloat16 (MLX keeps them in the input's dtype; so does
  quantize_kv by default). The scale and bias follow MLX's rule: the group's
  larger-magnitude edge is represented exactly and a zero bias is used when
  the edge rounds to code 0.
* ``"fp8_e4m3"``: torch.float8_e4m3fn codes with a float32 descale per
  (batch, kv head) -- flash-attn 3's ``k_descale`` / ``v_descale``, shape
  (B, Hkv) -- or per tensor (one element); value = float(code) * descale,
  with descale = max |x| / 448.
"""
from typing import NamedTuple, Optional

import torch
from torch import Tensor

FORMATS = ("int8", "q4", "fp8_e4m3")
GROUP_SIZES = (32, 64, 128)
_FP8_MAX = 448.0


class QuantizedKV(NamedTuple):
    codes: Tensor
    scale: Tensor            # int8: per token; q4: per group; fp8: the descale
    bias: Optional[Tensor]   # q4 only
    format: str


def _err(msg: str) -> ValueError:
    return ValueError(f"flash_metal.quantize_kv: {msg}")


def format_of(codes: Tensor) -> str:
    """The format a cache's dtype holds: 'int8', 'q4', 'fp8_e4m3', or 'native' (a float cache)."""
    if codes.dtype == torch.int8:
        return "int8"
    if codes.dtype in (torch.uint32, torch.uint8):
        return "q4"
    if codes.dtype == torch.float8_e4m3fn:
        return "fp8_e4m3"
    return "native"


def _pack_q4(q: Tensor, packing: str) -> Tensor:
    """Codes 0..15 (..., D) packed lowest bits first: uint32 (..., D / 8) or uint8 (..., D / 2)."""
    pairs = q.reshape(*q.shape[:-1], q.shape[-1] // 2, 2).to(torch.int32)
    data = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)  # byte i: element 2i low, 2i + 1 high
    if packing == "uint8":
        return data.contiguous()
    return data.contiguous().view(torch.uint32)  # little-endian: byte 0 is the word's lowest bits


def _unpack_q4(codes: Tensor) -> Tensor:
    """uint32 or uint8 packed codes -> int codes (..., D)."""
    data = codes.contiguous().view(torch.uint8).to(torch.int32)
    return torch.stack((data & 15, data >> 4), dim=-1).flatten(-2)


def quantize_q4(x: Tensor, group_size: int):
    """MLX's affine rule per group: (codes 0..15 (..., D) int32, scale, bias (..., D / group_size) float32)."""
    xg = x.float().reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    w_min, w_max = xg.amin(-1), xg.amax(-1)
    low_edge = w_min.abs() > w_max.abs()
    scale = ((w_max - w_min) / 15).clamp_min(1e-7)
    scale = torch.where(low_edge, scale, -scale)
    edge = torch.where(low_edge, w_min, w_max)
    q0 = torch.round(edge / scale)
    nonzero = q0 != 0
    scale = torch.where(nonzero, edge / torch.where(nonzero, q0, torch.ones_like(q0)), scale)
    bias = torch.where(nonzero, edge, torch.zeros_like(edge))
    q = torch.round((xg - bias[..., None]) / scale[..., None]).clamp(0, 15)
    return q.flatten(-2).to(torch.int32), scale, bias


def quantize_kv(x: Tensor, format: str, *, group_size: int = 64, packing: str = "uint32",
                scale_dtype: Optional[torch.dtype] = None, per: str = "head",
                descale: Optional[Tensor] = None) -> QuantizedKV:
    """Quantize a float cache x (..., Nk, Hkv, D) into `format` (see the module doc).

    q4: group_size 32, 64 or 128 dividing D; packing "uint32" (MLX's) or
    "uint8"; scale_dtype of scale and bias (default: x's dtype). fp8_e4m3:
    per "head" (descale (B, Hkv) from a 4-D x) or "tensor" (one element), or
    a given descale (codes then saturate at +-448 * descale), as appends do.
    """
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dtype == torch.float8_e4m3fn:
        raise _err(f"x must be a float tensor (float32, float16 or bfloat16); got "
                   f"{x.dtype if isinstance(x, Tensor) else type(x).__name__}")
    if x.dim() < 2:
        raise _err(f"x must have at least 2 dims (..., kv_heads, head_dim); got shape {tuple(x.shape)}")
    D = x.shape[-1]
    if format == "int8":
        amax = x.float().abs().amax(-1)
        scale = amax / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(x.float() / safe[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantizedKV(codes, scale, None, format)
    if format == "q4":
        if group_size not in GROUP_SIZES:
            raise _err(f"group_size must be one of {GROUP_SIZES} (MLX's); got {group_size}")
        if D % group_size:
            raise _err(f"group_size {group_size} does not divide head_dim {D}")
        if packing not in ("uint32", "uint8"):
            raise _err(f"packing must be 'uint32' (MLX's) or 'uint8'; got {packing!r}")
        sd = scale_dtype or x.dtype
        if sd not in (torch.float32, torch.float16, torch.bfloat16):
            raise _err(f"scale_dtype must be float32, float16 or bfloat16; got {sd}")
        q, scale, bias = quantize_q4(x, group_size)
        return QuantizedKV(_pack_q4(q, packing), scale.to(sd), bias.to(sd), format)
    if format == "fp8_e4m3":
        xf = x.float()
        if descale is None:
            if per == "tensor":
                amax = xf.abs().amax().reshape(1)
            elif per == "head":
                if x.dim() != 4:
                    raise _err(f"per='head' needs x of shape (B, Nk, Hkv, D); got {tuple(x.shape)}")
                amax = xf.abs().amax(dim=(1, 3))
            else:
                raise _err(f"per must be 'head' or 'tensor'; got {per!r}")
            descale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
        descale = descale.float()
        d = descale.reshape(1) if descale.numel() == 1 else descale
        full = d if d.numel() == 1 else d[:, None, :, None]
        codes = (xf / full).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        return QuantizedKV(codes, descale, None, format)
    raise _err(f"format must be one of {FORMATS}; got {format!r}")


def dequantize_kv(codes: Tensor, scale: Optional[Tensor] = None, bias: Optional[Tensor] = None, *,
                  dtype: torch.dtype = torch.float32) -> Tensor:
    """The float cache a quantized one stands for (the reference the kernels are held to).

    The format comes from codes' dtype (int8, uint32 / uint8 4-bit, float8_e4m3fn).
    fp8_e4m3 with a (B, Hkv) descale needs codes of shape (B, Nk, Hkv, D).
    """
    fmt = format_of(codes)
    what = "flash_metal.dequantize_kv"
    if fmt == "native":
        raise ValueError(f"{what}: codes has dtype {codes.dtype}, which is no quantized format (int8, uint32 / "
                         f"uint8 4-bit, float8_e4m3fn)")
    if scale is None:
        raise ValueError(f"{what}: scale is missing (the {fmt} format needs it)")
    if fmt == "int8":
        if scale.shape != codes.shape[:-1]:
            raise ValueError(f"{what}: int8 scale must have shape {tuple(codes.shape[:-1])}; got "
                             f"{tuple(scale.shape)}")
        return (codes.float() * scale.float()[..., None]).to(dtype)
    if fmt == "fp8_e4m3":
        if scale.numel() == 1:
            return (codes.float() * scale.float().reshape(())).to(dtype)
        if codes.dim() != 4 or scale.shape != (codes.shape[0], codes.shape[2]):
            raise ValueError(f"{what}: the fp8 descale must have one element or shape (B, Hkv) = "
                             f"({codes.shape[0]}, {codes.shape[2] if codes.dim() > 2 else '?'}); got "
                             f"{tuple(scale.shape)}")
        return (codes.float() * scale.float()[:, None, :, None]).to(dtype)
    if bias is None or bias.shape != scale.shape:
        raise ValueError(f"{what}: 4-bit codes need bias of scale's shape {tuple(scale.shape)}; got "
                         f"{None if bias is None else tuple(bias.shape)}")
    q = _unpack_q4(codes).float()
    D, G = q.shape[-1], scale.shape[-1]
    if scale.shape[:-1] != codes.shape[:-1] or D % G:
        raise ValueError(f"{what}: scale must have shape (*codes.shape[:-1], head_dim / group_size) with "
                         f"head_dim {D}; got {tuple(scale.shape)}")
    qg = q.reshape(*q.shape[:-1], G, D // G)
    return (qg * scale.float()[..., None] + bias.float()[..., None]).flatten(-2).to(dtype)


# ---------------------------------------------------------------- flash_attn_with_kvcache on a quantized cache


def _side_params(side: str, cache: Tensor, scale, bias, descale, what: str):
    """(format, the op's scale, the op's bias) of one side, checking which names were given."""
    fmt = format_of(cache)
    if fmt == "fp8_e4m3":
        if scale is not None or bias is not None:
            raise ValueError(f"flash_metal.{what}: {side}_cache is float8_e4m3fn, whose scale is {side}_descale "
                             f"(flash-attn 3's name, (B, Hkv) or one element); {side}_scale / {side}_bias are for "
                             f"int8 and 4-bit caches")
        if descale is None:
            raise ValueError(f"flash_metal.{what}: {side}_cache is float8_e4m3fn but {side}_descale is missing")
        return fmt, descale, None
    if descale is not None:
        raise ValueError(f"flash_metal.{what}: {side}_descale was given but {side}_cache is {cache.dtype}; a "
                         f"descale goes with a float8_e4m3fn cache")
    return fmt, scale, bias


def _append(fmt, new, cache, scale, bias, table, page, at):
    """Quantize new rows (B, S_new, Hkv, D) into the cache's format and write codes and scales in place."""
    from . import _kvcache

    if fmt == "int8":
        r = quantize_kv(new, "int8")
        _kvcache.append(cache, r.codes, table, page, at)
        _kvcache.append(scale, r.scale, table, page, at)
    elif fmt == "q4":
        group = new.shape[-1] // scale.shape[-1]
        r = quantize_kv(new, "q4", group_size=group, packing="uint32" if cache.dtype == torch.uint32 else "uint8",
                        scale_dtype=scale.dtype)
        if cache.dtype == torch.uint32:  # index_put_ on the same bytes seen as int32
            _kvcache.append(cache.view(torch.int32), r.codes.view(torch.int32), table, page, at)
        else:
            _kvcache.append(cache, r.codes, table, page, at)
        _kvcache.append(scale, r.scale, table, page, at)
        _kvcache.append(bias, r.bias, table, page, at)
    else:  # fp8: the cache's descale stays; values past +-448 * descale saturate
        d = scale if scale.numel() == 1 else scale[: new.shape[0]]
        r = quantize_kv(new, "fp8_e4m3", descale=d)
        _kvcache.append(cache.view(torch.uint8), r.codes.view(torch.uint8), table, page, at)


def with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                 softmax_scale, causal, left, right, softcap, return_softmax_lse, sinks, k_scale, v_scale, k_bias,
                 v_bias, k_descale, v_descale):
    """flash_attn_with_kvcache's quantized path (flash_metal.flash_attn calls it; see its doc)."""
    from . import _kvcache, ops

    what = "flash_attn_with_kvcache"
    if cache_leftpad is not None:
        raise ValueError(f"flash_metal.{what}: cache_leftpad is not supported with a quantized cache")
    kf, ks, kb = _side_params("k", k_cache, k_scale, k_bias, k_descale, what)
    vf, vs, vb = _side_params("v", v_cache, v_scale, v_bias, v_descale, what)
    B = q.shape[0]
    device = k_cache.device
    table, page, capacity = _kvcache.table_of(k_cache, v_cache, B, block_table, cache_batch_idx, what)
    lengths = _kvcache.int_vector(cache_seqlens, "cache_seqlens", B, device, what, default=capacity)
    s_new = 0 if k is None else k.shape[1]
    if B and bool((lengths < 0).any() or (lengths + s_new > capacity).any()):
        raise ValueError(f"flash_metal.{what}: cache_seqlens (+ the {s_new} appended rows) must lie in [0, "
                         f"{capacity}]; got {lengths.tolist()}")
    if block_table is not None:
        _kvcache.check_entries(table, page, lengths + s_new, k_cache.shape[0], what)
    if k is not None:
        if cache_seqlens is None:
            raise ValueError(f"flash_metal.{what}: appending k and v needs cache_seqlens (where each batch's new "
                             "rows go)")
        with torch.no_grad():
            for fmt, new, cache, sc, bi, name in ((kf, k, k_cache, ks, kb, "k"), (vf, v, v_cache, vs, vb, "v")):
                if fmt == "native":
                    _kvcache.append(cache, new, table, page, lengths)
                elif sc is None or (fmt == "q4" and bi is None):
                    raise ValueError(f"flash_metal.{what}: {name}_cache is {fmt} but its scales are missing")
                else:
                    _append(fmt, new, cache, sc, bi, table, page, lengths)
        lengths = lengths + s_new
    bt = block_table if block_table is not None else (table.to(torch.int32) if cache_batch_idx is not None else None)
    with torch.no_grad():
        out, lse = ops.attention_kvcache_with_lse(q.transpose(1, 2), k_cache, v_cache, lengths.to(torch.int32), bt,
                                                  causal, softmax_scale, left, right, softcap, sinks, k_scale=ks,
                                                  k_bias=kb, v_scale=vs, v_bias=vb)
    out = out.transpose(1, 2).contiguous()
    return (out, lse) if return_softmax_lse else out
