"""Input generation for the op tests, and FlashAttention's tolerance rule (re-exported).

The rule itself lives in the package, flash_metal/testing.py (public, so the
installed package's selfcheck and users can apply it too): our error against
a float64 oracle may be at most twice the error of PyTorch's own attention
computed in the same dtype, plus a rounding floor. This file keeps what only
the tests need (dtypes, memory layouts, random inputs) and re-exports the
rule's names, so `from numerics import assert_attention_close` keeps working.
"""
import contextlib

import torch

from flash_metal.testing import (  # noqa: F401  (re-exported for the tests)
    FP32_ULPS,
    SCORE_BREAKDOWN,
    Comparison,
    NotClose,
    YardstickError,
    as_batch,
    assert_attention_close,
    assert_gradients_close,
    assert_varlen_close,
    assert_varlen_gradients_close,
    attention_errors,
    attention_tolerances,
    fp32_floor,
    gradient_errors,
    gradient_tolerances,
    pytorch_attention_same_dtype,
    reference_gradients,
    rounding_floor,
    varlen_errors,
    varlen_gradient_errors,
    varlen_sequences,
    yardstick_errors,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def dtype_id(d):
    """A dtype as a test id: "float16"."""
    return str(d).replace("torch.", "")


# Memory layouts make_tensor can produce, each a (B, H, N, D) view:
#   contiguous:     packed (B, H, N, D);
#   transposed:     a packed (B, N, H, D) buffer viewed as (B, H, N, D);
#   offset_slice:   a slice from the middle of a larger NaN-filled buffer
#                   (storage offset, larger row and head strides);
#   every_other:    x[..., 1::2] of a NaN-filled (B, H, N, 2D) buffer: feature
#                   stride 2, and a kernel that assumes stride 1 reads NaN;
#   d_outer:        the first N columns of a NaN-filled (B, H, D, N + 1) buffer,
#                   viewed as (B, H, N, D): the feature dimension is not
#                   innermost (feature stride N + 1, never 1, even for N = 1);
#   storage_end:    packed (B, H, N, D) at the very end of a storage that holds
#                   NaN before it, so one element past the view is past the
#                   storage (the emulator's sanitizer sees the over-read);
#   storage_end_bnhd: the same with a packed (B, N, H, D) buffer, so the row
#                   after any head's last row is past the storage.
LAYOUTS = ["contiguous", "transposed", "offset_slice", "every_other", "d_outer", "storage_end", "storage_end_bnhd"]
# NaN elements in front of a storage_end view. Why 37: not a multiple of any
# vector width or tile, so a read before the view is never accidentally
# aligned with it.
STORAGE_END_PAD = 37


def lay_out(values, layout):
    """A view holding `values` (B, H, N, D) in `layout` (see LAYOUTS); NaN in every gap."""
    B, H, N, D = values.shape
    nan = float("nan")
    if layout == "contiguous":
        return values.contiguous().clone()
    if layout == "transposed":
        return values.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "offset_slice":
        big = torch.full((B, H + 2, N + 5, D + 3), nan, dtype=values.dtype)
        view = big[:, 1 : H + 1, 3 : N + 3, 2 : D + 2]
    elif layout == "d_outer":
        view = torch.full((B, H, D, N + 1), nan, dtype=values.dtype)[..., :N].transpose(2, 3)
    elif layout == "every_other":
        view = torch.full((B, H, N, 2 * D), nan, dtype=values.dtype)[..., 1::2]
    elif layout in ("storage_end", "storage_end_bnhd"):
        store = torch.full((STORAGE_END_PAD + values.numel(),), nan, dtype=values.dtype)
        tail = store[STORAGE_END_PAD:]
        view = tail.view(B, H, N, D) if layout == "storage_end" else tail.view(B, N, H, D).transpose(1, 2)
        assert view.storage_offset() + view.numel() == store.numel()  # ends exactly at the storage's end
    else:
        raise ValueError(layout)
    view.copy_(values)
    return view


def make_tensor(shape, layout, dtype, generator, scale_inputs=1.0):
    """Fresh random (B, H, N, D) values (never zeros) in `layout` (see LAYOUTS)."""
    B, H, N, D = shape
    g = generator
    if layout == "contiguous":
        return (torch.randn(B, H, N, D, generator=g) * scale_inputs).to(dtype)
    if layout == "transposed":
        return (torch.randn(B, N, H, D, generator=g) * scale_inputs).to(dtype).transpose(1, 2)
    return lay_out((torch.randn(B, H, N, D, generator=g) * scale_inputs).to(dtype), layout)


def make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, layout="contiguous", generator=None, scale_inputs=1.0):
    """Fresh random q, k, v; `layout` is one of LAYOUTS for all three, or a (q, k, v) triple."""
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    lq, lk, lv = (layout,) * 3 if isinstance(layout, str) else layout
    return (make_tensor((B, Hq, Nq, D), lq, dtype, g, scale_inputs),
            make_tensor((B, Hkv, Nk, D), lk, dtype, g, scale_inputs),
            make_tensor((B, Hkv, Nk, D), lv, dtype, g, scale_inputs))


@contextlib.contextmanager
def threads(n):
    """Run the body with torch's intra-op pool at n threads, then restore it."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
