"""Input generation and FlashAttention's tolerance rule, shared by the op tests.

The rule (FlashAttention's test suite): our error against a float64 oracle
may be at most twice the error of PyTorch's own attention computed in the
same dtype, plus a rounding floor, 2 * max|ref + 0.3 - 0.3 - ref| in that
dtype (the error of merely storing the reference in it).
"""
import math

import torch

from flash_metal.reference import attention_reference, causal_mask

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# float32 accumulation rounds too: a few ulps of float32 at the result's
# magnitude, times log2 of the reduction length, is the least any float32
# kernel can promise. This keeps float32 comparisons from hinging on luck.
FP32_ULPS = 8


def make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, layout="contiguous", generator=None, scale_inputs=1.0):
    """Fresh random q, k, v in the requested memory layout (values, never zeros).

    layout:
      "contiguous": packed (B, H, N, D);
      "transposed": a (B, N, H, D) buffer viewed as (B, H, N, D);
      "offset_slice": a slice from the middle of a larger buffer (offset,
        larger row and head strides), with NaN everywhere outside the slice
        so any read past it shows up in the result.
    """
    g = generator if generator is not None else torch.Generator().manual_seed(0)

    def one(H, N):
        if layout == "contiguous":
            return (torch.randn(B, H, N, D, generator=g) * scale_inputs).to(dtype)
        if layout == "transposed":
            return (torch.randn(B, N, H, D, generator=g) * scale_inputs).to(dtype).transpose(1, 2)
        if layout == "offset_slice":
            big = torch.full((B, H + 2, N + 5, D + 3), float("nan"), dtype=dtype)
            inner = (torch.randn(B, H, N, D, generator=g) * scale_inputs).to(dtype)
            view = big[:, 1 : H + 1, 3 : N + 3, 2 : D + 2]
            view.copy_(inner)
            return view
        raise ValueError(layout)

    return one(Hq, Nq), one(Hkv, Nk), one(Hkv, Nk)


def pytorch_attention_same_dtype(q, k, v, causal, scale):
    """PyTorch's attention computed in the inputs' dtype: the yardstick."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    S = (q @ k.transpose(-1, -2)) * scale
    if causal:
        S = S.masked_fill(causal_mask(q.shape[2], k.shape[2]), float("-inf"))
    P = torch.softmax(S.float(), dim=-1).to(q.dtype)
    lse = torch.logsumexp(S.float(), dim=-1)
    out = torch.nan_to_num(P @ v, nan=0.0)  # rows with no key: softmax of all -inf
    return out, lse


def rounding_floor(ref, dtype):
    r = ref.to(dtype)
    return 2 * ((r + 0.3 - 0.3) - r).abs().max().item()


def fp32_floor(ref, length):
    finite = ref[torch.isfinite(ref)]
    mag = finite.abs().max().item() if finite.numel() else 0.0
    return FP32_ULPS * torch.finfo(torch.float32).eps * max(mag, 1.0) * max(1.0, math.log2(max(length, 1)))


def assert_attention_close(out, lse, q, k, v, causal=False, scale=None):
    """out/lse from a kernel vs the float64 oracle, by the 2x rule."""
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert not torch.isnan(out).any(), "output has NaN: an element was never written, or the math broke"
    assert not torch.isnan(lse).any(), "lse has NaN: an element was never written, or the math broke"
    ref_out, ref_lse = attention_reference(q, k, v, causal, scale)
    pt_out, pt_lse = pytorch_attention_same_dtype(q, k, v, causal, scale)
    nk = k.shape[2]

    err = (out.double() - ref_out).abs().max().item()
    pt_err = (pt_out.double() - ref_out).abs().max().item()
    tol = 2 * pt_err + rounding_floor(ref_out, q.dtype) + fp32_floor(ref_out, nk)
    assert err <= tol, f"out: max error {err:.3g} > tolerance {tol:.3g} (PyTorch same-dtype error {pt_err:.3g})"

    # lse: -inf exactly where the oracle has -inf (rows with no visible key).
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "lse is -inf on the wrong rows"
    fin = torch.isfinite(ref_lse)
    if fin.any():
        lerr = (lse.double()[fin] - ref_lse[fin]).abs().max().item()
        pt_lerr = (pt_lse.double()[fin] - ref_lse[fin]).abs().max().item()
        ltol = 2 * pt_lerr + rounding_floor(ref_lse[fin], torch.float32) + fp32_floor(ref_lse[fin], nk)
        assert lerr <= ltol, f"lse: max error {lerr:.3g} > tolerance {ltol:.3g} (PyTorch error {pt_lerr:.3g})"
