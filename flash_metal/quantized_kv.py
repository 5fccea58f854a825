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
