"""flash_metal.quantize_kv / dequantize_kv: the three formats' layouts (issue 44).

MLX's 4-bit packing is checked against words written out by hand (element
d at bits 4 * (d % 8) of uint32 word d // 8, lowest first; uint8: element 2i
in byte i's low nibble), MLX's affine rule by its defining property (the
group's larger-magnitude edge is exact) and by the round-trip bound, int8
and fp8 by theirs; each bad argument by its error.
"""
import pytest
import torch

from flash_metal import dequantize_kv, quantize_kv
from flash_metal.quantized_kv import _pack_q4, _unpack_q4, quantize_q4


def test_q4_packing_by_hand():
    codes = torch.arange(16, dtype=torch.int32).view(1, 16)
    words = _pack_q4(codes, "uint32")
    assert words.dtype == torch.uint32 and words.shape == (1, 2)
    assert words.view(torch.int32).tolist() == [[0x76543210, int.from_bytes(bytes.fromhex("98badcfe"), "little",
                                                                          signed=True)]]
    assert _pack_q4(codes, "uint8").tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]
    assert torch.equal(_unpack_q4(words), codes) and torch.equal(_unpack_q4(_pack_q4(codes, "uint8")), codes)


def test_q4_dequantize_by_hand():
    # One group of 32: code d % 16, scale 0.5, bias -3: value = (d % 16) * 0.5 - 3.
    codes = (torch.arange(32, dtype=torch.int32) % 16).view(1, 1, 32)
    words = _pack_q4(codes, "uint32")
    scale, bias = torch.tensor([[[0.5]]]), torch.tensor([[[-3.0]]])
    want = (torch.arange(32) % 16).float() * 0.5 - 3
    assert torch.equal(dequantize_kv(words, scale, bias)[0, 0], want)
    # Planted: a reader with the nibbles swapped, or without the bias, reads something else.
    swapped = torch.stack((codes[..., 1::2], codes[..., 0::2]), -1).flatten(-2).float() * 0.5 - 3
    assert not torch.equal(swapped[0, 0], want)
    assert not torch.equal(codes.float()[0, 0] * 0.5, want)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("packing", ["uint32", "uint8"])
def test_q4_round_trip(group_size, packing):
    g = torch.Generator().manual_seed(group_size)
    x = torch.randn(2, 5, 3, 128, generator=g) * 3
    r = quantize_kv(x, "q4", group_size=group_size, packing=packing, scale_dtype=torch.float32)
    assert r.codes.shape == (2, 5, 3, 128 // (8 if packing == "uint32" else 2))
    assert r.scale.shape == r.bias.shape == (2, 5, 3, 128 // group_size)
    y = dequantize_kv(r.codes, r.scale, r.bias)
    # Within the group's representable range [bias, bias + 15 scale] (either order: MLX's scale may be
    # negative) a value is off by at most half a step; past it, by its distance to the range's end.
    ends = torch.stack((r.bias, r.bias + 15 * r.scale), -1)
    lo, hi = ends.amin(-1)[..., None], ends.amax(-1)[..., None]
    xg, yg = x.reshape(2, 5, 3, -1, group_size), y.reshape(2, 5, 3, -1, group_size)
    outside = (lo - xg).clamp_min(0) + (xg - hi).clamp_min(0)
    assert ((yg - xg).abs() <= r.scale.abs()[..., None] * 0.5 + outside + 1e-5).all()
    # MLX's rule: the edge of larger magnitude is represented exactly (it sets the scale).
    xg = x.reshape(2, 5, 3, -1, group_size)
    edge = torch.where(xg.amin(-1).abs() > xg.amax(-1).abs(), xg.amin(-1), xg.amax(-1))
    yg = y.reshape(2, 5, 3, -1, group_size)
    assert ((yg - edge[..., None]).abs().amin(-1) <= 1e-5 * edge.abs()).all()
    q, _, _ = quantize_q4(x, group_size)
    assert q.min() >= 0 and q.max() <= 15


def test_int8_and_fp8_round_trip():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 3, 64, generator=g, dtype=torch.float32) * 5
    r = quantize_kv(x, "int8")
    assert r.codes.dtype == torch.int8 and r.scale.shape == (2, 7, 3) and r.bias is None
    assert torch.allclose(r.scale, x.abs().amax(-1) / 127)
    assert ((dequantize_kv(r.codes, r.scale) - x).abs() <= r.scale[..., None] * 0.5 + 1e-6).all()
    for per, shape in (("head", (2, 3)), ("tensor", (1,))):
        f = quantize_kv(x, "fp8_e4m3", per=per)
        assert f.codes.dtype == torch.float8_e4m3fn and f.scale.shape == shape
        y = dequantize_kv(f.codes, f.scale)
        # e4m3: 3 mantissa bits, relative half-ulp 2^-4, and subnormals below 2^-6 (times the descale).
        assert ((y - x).abs() <= x.abs() * 2.0 ** -4 + 2.0 ** -10 * f.scale.max()).all()
    # A given descale saturates at +-448 * descale (an append into an existing cache).
    sat = quantize_kv(x * 100, "fp8_e4m3", descale=torch.full((2, 3), 0.01))
    assert dequantize_kv(sat.codes, sat.scale).abs().max() <= 448 * 0.01 + 1e-6


def test_bf16_input_keeps_scale_dtype():
    x = torch.randn(1, 4, 2, 64, dtype=torch.bfloat16)
    r = quantize_kv(x, "q4")
    assert r.scale.dtype == torch.bfloat16 and r.bias.dtype == torch.bfloat16


@pytest.mark.parametrize("call, match", [
    (lambda x: quantize_kv(x, "int4"), "format must be one of"),
    (lambda x: quantize_kv(x, "q4", group_size=48), "group_size must be one of"),
    (lambda x: quantize_kv(x[..., :96], "q4", group_size=64), "does not divide head_dim 96"),
    (lambda x: quantize_kv(x, "q4", packing="int32"), "packing must be"),
    (lambda x: quantize_kv(x.to(torch.int8), "int8"), "x must be a float tensor"),
    (lambda x: quantize_kv(x[0], "fp8_e4m3", per="head"), "per='head' needs x of shape"),
    (lambda x: dequantize_kv(x), "no quantized format"),
    (lambda x: dequantize_kv(x.to(torch.int8)), "scale is missing"),
    (lambda x: dequantize_kv(x.to(torch.int8), torch.ones(3)), "int8 scale must have shape"),
    (lambda x: dequantize_kv(quantize_kv(x, "q4").codes, quantize_kv(x, "q4").scale), "need bias"),
])
def test_bad_arguments(call, match):
    x = torch.randn(2, 3, 2, 128)
    with pytest.raises(ValueError, match=match):
        call(x)
