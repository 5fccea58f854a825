"""A drop-in for torch.nn.functional.scaled_dot_product_attention.

    out = flash_metal.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0,
                                                   is_causal=False, scale=None, enable_gqa=False)
    with flash_metal.patch():        # or flash_metal.patch() ... flash_metal.unpatch()
        model(x)                     # every F.scaled_dot_product_attention call goes through here

Same signature and semantics as PyTorch's function: (..., H, L, E) inputs of
any rank >= 3, bool (True = attend) or additive masks broadcast as SDPA
broadcasts them, top-left ``is_causal`` when L != S, ``enable_gqa``,
keyword ``scale``. A call flash_metal can serve runs attention_forward (and
its backward under autograd); any other goes to PyTorch's own function,
unchanged. ``sdpa_route(...)`` (also ``flash_metal.explain_sdpa``) says which
path a call takes and why.
"""
import math
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import ops

# PyTorch's function, captured before any patch(): the fallback, and what
# unpatch() restores.
_TORCH_SDPA = torch.nn.functional.scaled_dot_product_attention
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Head dims flash_metal serves, per device: csrc/checks.h kMaxHeadDim (q/k)
# and kMaxHeadDimV (v) on CPU; the Metal kernels' largest bucket for either
# (wider ones would run flash_metal's composite path, not its kernels: PyTorch
# keeps them here). v's head dim may differ from q's on both, forward and
# backward (the Metal backward kernels take D_v of their own).
_MAX_HEAD_DIM = {"cpu": 576, "mps": 256}
_MAX_HEAD_DIM_V = {"cpu": 512, "mps": 256}


class SdpaRoute(NamedTuple):
    """Where a scaled_dot_product_attention call goes."""

    flash_metal: bool  # True: attention_forward runs it; False: PyTorch's function
    reason: str


def _broadcasts(mask: Tensor, shape: Tuple[int, ...]) -> bool:
    if mask.dim() > len(shape):
        return False
    return all(m in (1, n) for m, n in zip(mask.shape[::-1], shape[::-1]))


def sdpa_route(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False) -> SdpaRoute:
    """Which path scaled_dot_product_attention takes for these arguments, and why."""
    def torch_(why):
        return SdpaRoute(False, "PyTorch's scaled_dot_product_attention: " + why)

    tensors = (query, key, value)
    if not all(isinstance(t, Tensor) for t in tensors):
        return torch_("query, key and value must be tensors")
    if dropout_p > 0.0:
        return torch_(f"dropout_p = {dropout_p} (flash_metal has no dropout)")
    if query.device.type not in ("cpu", "mps") or any(t.device != query.device for t in tensors):
        return torch_(f"device {query.device} (flash_metal runs on cpu and mps)")
    if query.dtype not in _DTYPES or any(t.dtype != query.dtype for t in tensors):
        return torch_(f"dtypes {query.dtype}/{key.dtype}/{value.dtype} (flash_metal: one of float32, float16, "
                      "bfloat16 for all three)")
    if query.dim() < 3 or key.dim() != query.dim() or value.dim() != query.dim():
        return torch_(f"ranks {query.dim()}/{key.dim()}/{value.dim()} (flash_metal: equal ranks of at least 3)")
    E, L, S, Ev = query.shape[-1], query.shape[-2], key.shape[-2], value.shape[-1]
    if key.shape[-1] != E or value.shape[-2] != S:
        return torch_("key's feature size differs from query's, or value's length from key's (PyTorch raises)")
    dev = query.device.type
    if not 1 <= E <= _MAX_HEAD_DIM[dev]:
        return torch_(f"head dim {E} (flash_metal on {dev}: 1 to {_MAX_HEAD_DIM[dev]})")
    if not 1 <= Ev <= _MAX_HEAD_DIM_V[dev]:
        return torch_(f"value's head dim {Ev} (flash_metal on {dev}: 1 to {_MAX_HEAD_DIM_V[dev]})")
    if query.shape[:-3] != key.shape[:-3] or key.shape[:-2] != value.shape[:-2]:
        return torch_("batch dimensions that differ between query, key and value (broadcast batches)")
    hq, hkv = query.shape[-3], key.shape[-3]
    if hq != hkv and not (enable_gqa and hkv > 0 and hq % hkv == 0):
        return torch_(f"{hq} query heads and {hkv} key/value heads without enable_gqa (PyTorch decides)")
    if attn_mask is not None:
        if is_causal:
            return torch_("attn_mask together with is_causal (PyTorch's backends disagree on it; PyTorch decides)")
        if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
            return torch_(f"an attn_mask of dtype {attn_mask.dtype} with {query.dtype} inputs")
        if attn_mask.device != query.device:
            return torch_(f"attn_mask on {attn_mask.device}")
        if attn_mask.requires_grad and torch.is_grad_enabled():
            return torch_("an attn_mask that requires grad (flash_metal computes no mask gradient)")
        if attn_mask.dim() < 2 or not _broadcasts(attn_mask, tuple(query.shape[:-2]) + (L, S)):
            return torch_(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast (PyTorch raises)")
    if scale is not None and not math.isfinite(scale):
        return torch_(f"scale = {scale}")
    how = "attention_forward"
    if is_causal and L != S:
        how += (", top-left causal as SDPA's: keys cropped to the first L" if L < S
                else ", top-left causal as SDPA's: window_right = L - S")
    return SdpaRoute(True, "flash_metal." + how)


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> Tensor:
    """torch.nn.functional.scaled_dot_product_attention, run by flash_metal where it can be (see sdpa_route)."""
    route = sdpa_route(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if not route.flash_metal:
        return _TORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa)
    lead = query.shape[:-3]
    hq, L = query.shape[-3], query.shape[-2]
    Ev = value.shape[-1]  # out has value's head dim (D_v), as in SDPA
    hkv, S = key.shape[-3], key.shape[-2]
    # (..., H, L, E) -> (B, H, L, E): a view for 4-D inputs, a leading 1 for
    # 3-D ones, the batch dimensions flattened (reshape) beyond 4.
    def four_d(t):
        return t.reshape((-1,) + tuple(t.shape[-3:])) if t.dim() != 3 else t.unsqueeze(0)

    q, k, v = four_d(query), four_d(key), four_d(value)
    mask = attn_mask
    if mask is not None and query.dim() > 4 and mask.dim() > 3:
        # The batch dimensions of the mask flattened with the inputs'.
        mask = mask.expand(tuple(lead) + tuple(mask.shape[-3:])).reshape((-1,) + tuple(mask.shape[-3:]))
    causal, window_right = False, -1
    if is_causal:
        if L <= S:
            # Top-left: query i sees keys j <= i, so keys past L are never
            # seen; on the cropped (L, L) problem top-left and bottom-right agree.
            k, v = k[..., :L, :], v[..., :L, :]
            causal = True
        else:
            # j <= i is the bottom-right bound j <= i + (S - L) + (L - S).
            window_right = L - S
    out = ops.attention(q, k, v, causal=causal, scale=scale, attn_mask=mask, window_right=window_right)
    return out.reshape(tuple(lead) + (hq, L, Ev))


explain_sdpa = sdpa_route


class _Patch:
    """Returned by patch(): already active; as a context manager, undone on exit."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        unpatch()
        return False


def patch() -> _Patch:
    """Swap flash_metal's function in for torch.nn.functional.scaled_dot_product_attention.

    Affects every caller that looks the function up at call time (``F.scaled_dot_product_attention(...)``,
    as PyTorch's own modules and transformers' sdpa path do), not code that bound the function to a
    name of its own before patching. Use as ``with flash_metal.patch(): ...`` or call unpatch().
    """
    torch.nn.functional.scaled_dot_product_attention = scaled_dot_product_attention
    return _Patch()


def unpatch() -> None:
    """Restore PyTorch's own torch.nn.functional.scaled_dot_product_attention."""
    torch.nn.functional.scaled_dot_product_attention = _TORCH_SDPA


def is_patched() -> bool:
    return torch.nn.functional.scaled_dot_product_attention is scaled_dot_product_attention
