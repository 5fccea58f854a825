"""The registry of attention implementations the benchmarks compare.

Each entry is an Impl: a name (the table column and plot legend), the devices
it runs on, the presets it joins, and `build(q, k, v, causal)`, which does any
set-up outside the timed region (repeating K/V heads for a baseline without
GQA, building a mask) and returns the zero-argument call that is timed.

Adding a kernel: append one Impl to IMPLS (see benchmarks/README.md). Every
benchmark checks it against the float64 oracle before timing it.
"""
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from .harness import load_flash_metal

Call = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Impl:
    name: str
    devices: Tuple[str, ...]
    build: Callable[..., Call]  # build(q, k, v, causal) -> timed call
    presets: Tuple[str, ...] = ("post", "llm")
    description: str = ""
    # Optional: why this impl cannot run a problem (None: it can).
    unsupported: Optional[Callable[..., Optional[str]]] = None
    # Optional: turns the call's result into a torch tensor for the oracle
    # check (outside the timed region); for libraries with their own arrays.
    to_torch: Optional[Callable[[object], torch.Tensor]] = None

    def runs_on(self, device: str) -> bool:
        return device in self.devices


# ---------------------------------------------------------------- helpers

def _expand_kv(q, k, v):
    """K/V with as many heads as q (GQA -> MHA), for baselines without GQA."""
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def _bottom_right_mask(n_q, n_k, device):
    """True where attention is allowed: key j <= query i + (n_k - n_q)."""
    i = torch.arange(n_q, device=device).unsqueeze(1)
    j = torch.arange(n_k, device=device).unsqueeze(0)
    return j <= i + (n_k - n_q)


# ---------------------------------------------------------------- explicit

def _build_explicit(q, k, v, causal):
    # The post's standard attention, batched: S = Q K^T / sqrt(d), mask,
    # softmax, @ V. S and P are N x N per head. The mask is built inside the
    # call, as the post's code does.
    k, v = _expand_kv(q, k, v)
    scale = q.shape[-1] ** -0.5
    n_q, n_k = q.shape[-2], k.shape[-2]

    def call():
        S = (q @ k.transpose(-2, -1)) * scale
        if causal:
            S = S.masked_fill(~_bottom_right_mask(n_q, n_k, q.device), float("-inf"))
        return torch.softmax(S, dim=-1) @ v

    return call


# ---------------------------------------------------------------- SDPA

def _sdpa_has_gqa() -> bool:
    # SDPA is a builtin without an introspectable signature: try a tiny call.
    try:
        x, kv = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)
        F.scaled_dot_product_attention(x, kv, kv, enable_gqa=True)
        return True
    except TypeError:
        return False


_SDPA_HAS_GQA = _sdpa_has_gqa()


def _build_sdpa(q, k, v, causal):
    kwargs = {}
    if q.shape[1] != k.shape[1]:
        if _SDPA_HAS_GQA:
            kwargs["enable_gqa"] = True
        else:
            k, v = _expand_kv(q, k, v)  # outside the timed call
    n_q, n_k = q.shape[-2], k.shape[-2]
    if causal and n_q != n_k:
        # SDPA's is_causal aligns top-left; ours (and FlashAttention-2's) is
        # bottom-right. Pass the equivalent boolean mask instead.
        kwargs["attn_mask"] = _bottom_right_mask(n_q, n_k, q.device)
    else:
        kwargs["is_causal"] = causal
    return lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)


# ---------------------------------------------------------------- flash_metal

def _flash(impl: str):
    def build(q, k, v, causal):
        fm = load_flash_metal()
        return lambda: fm.attention(q, k, v, causal=causal, impl=impl)

    return build


def _decode_only(q, k, v, causal):
    n_q = q.shape[-2]
    return None if n_q <= 8 else f"a decode kernel: Nq <= 8 query rows only (this problem has {n_q})"


# ---------------------------------------------------------------- MLX

def _mlx():
    try:
        import mlx.core as mx  # optional: pip install mlx (macOS on Apple silicon)
    except ImportError:
        return None
    return mx


def _mlx_unsupported(q, k, v, causal):
    return None if _mlx() is not None else "mlx is not installed (pip install mlx)"


def _to_mlx(t):
    """The same values as an MLX array, in the same dtype (via float32 on the CPU: numpy has no bfloat16)."""
    mx = _mlx()
    dtype = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}[t.dtype]
    return mx.array(t.detach().float().cpu().numpy()).astype(dtype)


def _build_mlx(q, k, v, causal):
    # MLX's own fused attention (mlx.core.fast.scaled_dot_product_attention,
    # its steel and vector kernels) on the same data, GQA native. Its
    # "causal" mask is bottom-right aligned, as ours. mx.eval makes each call
    # finish before it returns: MLX runs on its own Metal queue, which
    # torch.mps.synchronize does not wait for.
    mx = _mlx()
    mq, mk, mv = (_to_mlx(t) for t in (q, k, v))
    mx.eval(mq, mk, mv)
    scale = q.shape[-1] ** -0.5
    mask = "causal" if causal else None

    def call():
        out = mx.fast.scaled_dot_product_attention(mq, mk, mv, scale=scale, mask=mask)
        mx.eval(out)
        return out

    return call


def _mlx_to_torch(out):
    import numpy as np  # present wherever mlx is: mlx depends on it

    return torch.from_numpy(np.array(out.astype(_mlx().float32)))


IMPLS = [
    Impl("explicit", ("cpu", "mps"), _build_explicit, presets=("post",),
         description="the post's PyTorch attention: S = QK^T/sqrt(d), mask, softmax, @V"),
    Impl("sdpa", ("cpu", "mps"), _build_sdpa,
         description="torch.nn.functional.scaled_dot_product_attention"),
    Impl("metal_untiled", ("mps",), _flash("untiled"),
         description="the post's untiled Metal kernel (one query per thread)"),
    Impl("metal_tiled", ("mps",), _flash("tiled"),
         description="the post's tiled Metal kernel (16-key K/V tiles in threadgroup memory)"),
    Impl("metal_prefill", ("mps",), _flash("prefill"),
         description="flash_metal's FlashAttention-2 kernel on simdgroup matrices (impl='prefill')"),
    Impl("metal_decode", ("mps",), _flash("decode"), presets=("llm",), unsupported=_decode_only,
         description="flash_metal's one-pass decode kernel, Nq <= 8 (impl='decode')"),
    Impl("metal_decode_split", ("mps",), _flash("decode_split"), presets=("llm",), unsupported=_decode_only,
         description="flash_metal's split-KV decode, partials then a merge pass (impl='decode_split')"),
    Impl("mlx", ("mps",), _build_mlx, unsupported=_mlx_unsupported, to_torch=_mlx_to_torch,
         description="MLX's mlx.core.fast.scaled_dot_product_attention on the same data (when mlx is installed)"),
    Impl("flash_metal", ("cpu", "mps"), _flash("auto"),
         description="flash_metal.attention(impl='auto'): the CPU flash kernel on CPU tensors, "
                     "the routed Metal kernel on MPS"),
]

BASELINE = "sdpa"  # speedups are measured against this row


def for_preset(preset: str, names: str = ""):
    """The impls of a preset, optionally only those named in a comma-separated list."""
    wanted = set(names.split(",")) if names else None
    return [i for i in IMPLS if preset in i.presets and (wanted is None or i.name in wanted)]


def by_name(name: str) -> Impl:
    for i in IMPLS:
        if i.name == name:
            return i
    raise KeyError(f"no implementation named {name!r}; known: {[i.name for i in IMPLS]}")
