"""Thin Python layer over torch.ops.flash_metal: wrappers and fake kernels.

Everything that decides anything (validation, kernel choice, launch shapes)
lives in C++ (csrc/); this file only adapts shapes, registers the fake
(meta) implementations that torch.compile traces through, and registers the
autograd formula (the forward saves q, k, v, out and lse; the backward op
recomputes the probabilities).
"""
from typing import Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import _mpp_bookkeeping

_IMPLS = ("auto", "untiled", "tiled", "prefill", "decode", "decode_split", "tensor_ops", "composite")


def _as_4d(x: Tensor) -> Tensor:
    # The post's single-head form: (N, D) -> (1, 1, N, D). A view, no copy.
    if isinstance(x, Tensor) and x.dim() == 2:
        return x.unsqueeze(0).unsqueeze(0)
    return x


def attention_with_lse(
    q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: Optional[float] = None, impl: str = "auto",
    attn_mask: Optional[Tensor] = None, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Exact scaled-dot-product attention and its row log-sum-exp.

    q: (B, Hq, Nq, D) or (Nq, D); k, v: (B, Hkv, Nk, D) or (Nk, D), with Hq a
    multiple of Hkv (grouped-query and multi-query attention). v may have a
    head dim of its own, D_v (MLA: DeepSeek's 192/128, absorbed 576/512; as
    torch's SDPA allows): out then has D_v. D up to 576 and D_v up to 512 on
    CPU; on Metal the fused kernels take both up to 256, forward and
    backward, D_v != D included, and wider ones run the composite path
    (chunked matrix products; explain() says which). Any strides
    (e.g. ``x.transpose(1, 2)`` of a (B, N, H, D) tensor, or a slice of a KV
    cache) are read in place. float32, float16 or bfloat16; float32
    accumulation. B, Nq or Nk may be 0 (as in SDPA: Nk = 0 gives zeros).

    causal: query i attends to keys j <= i + (Nk - Nq), i.e. the last query is
    aligned with the last key (the KV-cache convention of FlashAttention-2 and
    MLX). A query row that sees no key (possible when Nk < Nq) yields zeros
    and lse = -inf.
    scale: softmax scale, default 1/sqrt(D).
    impl: which kernel runs: "auto" (the routing heuristic decides; see
    explain()), or on Metal one of the post's kernels, "untiled" (one query
    per thread) or "tiled" (K/V tiles in threadgroup memory). CPU tensors
    always run the CPU flash kernel and accept only "auto".
    attn_mask: bool (True = attend) or additive (q's dtype or float32),
    broadcastable to (B, Hq, Nq, Nk); read through its strides, never
    expanded. A key is masked by False, or by an additive value low enough
    that its score reaches -2^100 (-inf, or float32's finfo.min); a row with
    every key masked gives zeros and lse = -inf.
    window_left, window_right: a sliding window as in flash-attn, bottom-right
    aligned: query i sees keys i + Nk - Nq - window_left <= j <= i + Nk - Nq +
    window_right; -1 is unbounded (causal sets window_right to 0). Key blocks
    outside the window are skipped, so the cost grows with N * window.
    softcap: scores s become softcap * tanh(s / softcap) before the mask and
    the softmax (Gemma 2); 0 is off.
    sinks: attention sinks (gpt-oss), (Hq,) float32 or q's dtype: one logit
    per query head for a virtual key whose value is zero. Each row's softmax
    runs over [scores, sinks[h]] and the sink's probability is dropped; lse
    includes it; the sink is neither softcapped nor masked, so a row with
    every key masked gives zeros and lse = sinks[h]. Differentiable (grad
    flows to sinks). CPU and Metal (the Metal kernels: emulated; not yet
    verified on Apple hardware).

    Returns (out, lse): out like q with v's head dim (packed, q's dtype; 2-D if q was 2-D) and
    lse (B, Hq, Nq) float32 (or (Nq,) for 2-D q).
    """
    single_head = isinstance(q, Tensor) and q.dim() == 2
    out, lse = torch.ops.flash_metal.attention_forward(
        _as_4d(q), _as_4d(k), _as_4d(v), causal, scale, impl, attn_mask, window_left, window_right, softcap, sinks
    )
    if single_head:
        return out[0, 0], lse[0, 0]
    return out, lse


def attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: Optional[float] = None, impl: str = "auto",
    attn_mask: Optional[Tensor] = None, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Exact attention, softmax(q kᵀ · scale) v, in O(N) memory. See attention_with_lse."""
    return attention_with_lse(q, k, v, causal, scale, impl, attn_mask, window_left, window_right, softcap, sinks)[0]


def attention_varlen_with_lse(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool = False, scale: Optional[float] = None, window_left: int = -1,
    window_right: int = -1, softcap: float = 0.0, impl: str = "auto", sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Attention over packed variable-length sequences (flash-attn's flash_attn_varlen_func).

    q: (total_q, Hq, D); k (total_k, Hkv, D), v (total_k, Hkv, D_v). Sequence b is q rows
    cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 against k/v rows
    cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1 (int32, (B + 1,)); max_seqlen_q
    and max_seqlen_k bound the lengths (host ints, so no device sync). causal,
    the window and softcap apply within each sequence, bottom-right aligned.
    Nothing is padded or copied. sinks and D_v as in attention_with_lse. Returns out
    (total_q, Hq, D_v) and lse (Hq, total_q) float32.
    """
    return torch.ops.flash_metal.attention_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left, window_right,
        softcap, impl, sinks,
    )


def attention_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool = False, scale: Optional[float] = None, window_left: int = -1,
    window_right: int = -1, softcap: float = 0.0, impl: str = "auto", sinks: Optional[Tensor] = None,
) -> Tensor:
    """Attention over packed variable-length sequences; see attention_varlen_with_lse."""
    return attention_varlen_with_lse(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left, window_right,
        softcap, impl, sinks,
    )[0]


def attention_kvcache_with_lse(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, block_table: Optional[Tensor] = None,
    causal: bool = False, scale: Optional[float] = None, window_left: int = -1, window_right: int = -1,
    softcap: float = 0.0, sinks: Optional[Tensor] = None, impl: str = "auto",
    cu_seqlens_q: Optional[Tensor] = None, max_seqlen_q: int = 0, k_scale: Optional[Tensor] = None,
    k_bias: Optional[Tensor] = None, v_scale: Optional[Tensor] = None, v_bias: Optional[Tensor] = None,
    k_format: str = "auto", v_format: str = "auto",
) -> Tuple[Tensor, Tensor]:
    """Attention of q against a (paged) KV cache: the attention of flash-attn's flash_attn_with_kvcache.

    q: (B, Hq, Nq, D). k_cache (num_blocks, page_size, Hkv, D) and v_cache
    (..., D_v), flash-attn's layout, any page size from 1; block_table int32
    (B, max_blocks): key j of sequence b is row j % page_size of block
    block_table[b, j // page_size], pages in any order; None: a plain cache
    (B_cache >= B, seqlen, Hkv, D), row b for sequence b. cache_seqlens int32
    (B,): sequence b's keys are 0 .. cache_seqlens[b] - 1; nothing past them
    is read (cache rows and table entries may hold anything). causal and the
    window are bottom-right aligned to each sequence's length; softcap,
    sinks and scale as in attention_with_lse. On Metal the decode kernels
    read K/V through the table for Nq <= 8 (see explain(..., cache_seqlens=));
    otherwise, and on CPU, the rows in use are gathered for the varlen
    kernels. impl (Metal): "auto", "decode", "decode_split" or "prefill"
    (the gather path). Returns out (B, Hq, Nq, D_v) and lse (B, Hq, Nq)
    float32. Differentiable: when a gradient is wanted (grad mode on and q,
    a cache or sinks requiring it) the rows in use are gathered (a
    differentiable copy) for attention_varlen, whose backward reaches q, the
    caches and sinks; impl must then be "auto". (The op itself,
    torch.ops.flash_metal.attention_kvcache, has no backward and says so.)

    Packed queries (flash_attn_varlen_func's paged prefill): with
    cu_seqlens_q int32 (B + 1,), q is (total_q, Hq, D) and sequence b's
    queries are its rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 (at most
    max_seqlen_q); its keys as above. On Metal the prefill kernel reads the
    table for them too (fc_varlen with fc_paged; CPU gathers). Returns out
    (total_q, Hq, D_v) and lse (Hq, total_q), as attention_varlen_with_lse.

    Quantized caches (flash_metal.quantized_kv): k_cache / v_cache int8
    with k_scale / v_scale (per token), 4-bit (uint32 / uint8, MLX's packing)
    with k_scale, k_bias / v_scale, v_bias (per group), or float8_e4m3fn with
    the descale in k_scale / v_scale ((B, Hkv) or one element); K and V may
    differ. Read in place on CPU (impl 'auto'; 'direct' reads a native cache
    the same way); forward only.
    """
    quantized = any(t is not None for t in (k_scale, k_bias, v_scale, v_bias)) or \
        k_format != "auto" or v_format != "auto"
    if quantized:
        if _wants_grad(q, sinks):
            raise ValueError("flash_metal.attention_kvcache: a quantized cache has no backward (its codes are "
                             "not differentiable); call under torch.no_grad() or detach q and sinks")
        return torch.ops.flash_metal.attention_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal,
                                                       scale, window_left, window_right, softcap, sinks, impl,
                                                       cu_seqlens_q, int(max_seqlen_q), k_scale, k_bias, v_scale,
                                                       v_bias, k_format, v_format)
    if _wants_grad(q, k_cache, v_cache, sinks):
        return _kvcache_by_gather(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, window_left,
                                  window_right, softcap, sinks, impl, cu_seqlens_q, int(max_seqlen_q))
    return torch.ops.flash_metal.attention_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale,
                                                   window_left, window_right, softcap, sinks, impl, cu_seqlens_q,
                                                   int(max_seqlen_q))


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


def _kvcache_by_gather(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, window_left, window_right,
                       softcap, sinks, impl, cu_seqlens_q, max_seqlen_q):
    """attention_kvcache_with_lse when a gradient is wanted: the rows in use gathered, then attention_varlen."""
    from . import _kvcache

    what = "attention_kvcache"
    if impl != "auto":
        raise ValueError(f"flash_metal.{what}: impl={impl!r} picks a forward-only kernel; with a gradient wanted "
                         "(grad mode on and q, a cache or sinks requiring grad) the rows in use are gathered for "
                         "attention_varlen, so impl must be 'auto'")
    packed = cu_seqlens_q is not None
    if not packed and (not isinstance(q, Tensor) or q.dim() != 4):
        raise ValueError(f"flash_metal.{what}: q must be 4-D (batch, heads, seq_len, head_dim); got "
                         f"{getattr(q, 'shape', q)}")
    batch = cu_seqlens_q.numel() - 1 if packed else q.shape[0]
    table, page, capacity = _kvcache.table_of(k_cache, v_cache, batch, block_table, None, what)
    lengths = _kvcache.int_vector(cache_seqlens, "cache_seqlens", batch, k_cache.device, what)
    if batch and bool(((lengths < 0) | (lengths > capacity)).any()):
        raise ValueError(f"flash_metal.{what}: cache_seqlens must lie in [0, {capacity}] (the table's capacity in "
                         f"keys); got {lengths.tolist()}")
    _kvcache.check_entries(table, page, lengths, k_cache.shape[0], what)
    rows = _kvcache.rows_in_use(table, page, torch.zeros_like(lengths), lengths)
    k, v = _kvcache.gather(k_cache, rows), _kvcache.gather(v_cache, rows)
    cu_k, max_k = _kvcache.cumulative(lengths), int(lengths.max()) if batch else 0
    options = (causal, scale, window_left, window_right, softcap)
    if packed:
        return attention_varlen_with_lse(q, k, v, cu_seqlens_q, cu_k, max_seqlen_q, max_k, *options, sinks=sinks)
    B, H, N = q.shape[:3]
    cu_q = (torch.arange(B + 1, device=q.device, dtype=torch.int32) * N)
    out, lse = attention_varlen_with_lse(q.transpose(1, 2).reshape(B * N, H, q.shape[3]), k, v, cu_q, cu_k, N, max_k,
                                         *options, sinks=sinks)
    return out.view(B, N, H, out.shape[-1]).transpose(1, 2), lse.view(H, B, N).permute(1, 0, 2)


# The tensors of a launch, in the order of the plan's binding table
# (LaunchTensor in csrc/metal/plan.h). partial_out and partial_stats are the
# split-KV decode's float32 scratch; grad_* are the backward's, and delta its
# float32 scratch (grad_lse is bound to lse when there is none; never read then);
# attn_mask, cu_seqlens_q, cu_seqlens_k and sinks (float32) are the options' inputs
# (q is bound in their slots when absent; never read then); grad_sinks is the
# float32 output of the backward's flash_sinks_grad (with sinks only);
# block_table and cache_seqlens the decode and prefill kernels' paged cache (q when not paged).
_LAUNCH_TENSORS = ("q", "k", "v", "out", "lse", "partial_out", "partial_stats", "grad_out", "grad_q", "grad_k",
                   "grad_v", "grad_lse", "delta", "attn_mask", "cu_seqlens_q", "cu_seqlens_k", "sinks", "grad_sinks",
                   "block_table", "cache_seqlens", "k_scale", "k_bias", "v_scale", "v_bias")
# The scratch tensors of each pass's plans, by name.
_SCRATCH = {False: ("partial_out", "partial_stats"), True: ("delta",)}


class MetalDispatch(NamedTuple):
    """One Metal dispatch of a plan (MetalLaunch in csrc/metal/plan.h)."""

    kernel_name: str
    grid: Tuple[int, int, int]
    threadgroup: Tuple[int, int, int]
    threadgroup_memory: int  # bytes of dynamic threadgroup memory (0: none)
    threadgroup_memory_index: int  # its [[threadgroup(i)]]
    function_constants: Tuple[bool, ...]
    buffers: Dict[str, int]  # the binding table: tensor name (see _LAUNCH_TENSORS) -> [[buffer(n)]]
    params_index: int  # [[buffer(n)]] of the AttentionParams bytes
    params: Tensor
    # The kernel's [[max_total_threads_per_threadgroup(N)]] (shaders/common/params.h): the
    # most threads the planner ever launches it with; threadgroup's product <= N.
    max_threads_per_threadgroup: int
    # The planner's estimates on the plan's GPU (LaunchEstimate, csrc/metal/plan.h):
    # a model, not a measurement. 32-bit values per lane the kernel keeps live,
    # threadgroups and SIMD-groups resident per core, and what bounds them
    # ("registers" or "threadgroup memory").
    live_registers: int
    threadgroups_per_core: int
    simdgroups_per_core: int
    occupancy_limit: str
    # Tensor-op kernels (issue 40): their per-block bookkeeping as the Metal emulator counts it
    # (flash_metal/_mpp_bookkeeping.py: coordinate queries per lane, barriers, matmul2d runs and the
    # edge-checked ones, and the coordinate queries before issue 40). Emulator counts, not measured on Apple
    # hardware; None for every other kernel.
    mpp_bookkeeping: Optional[Dict[str, float]] = None
    # The quantized-cache decode's KvQuantParams (shaders/common/params.h), bound with setBytes at
    # quant_params_index (0 and an empty tensor for every other kernel).
    quant_params_index: int = 0
    quant_params: Optional[Tensor] = None


class MetalPlan(NamedTuple):
    """What attention_forward encodes on Metal for these inputs, and why (see csrc/metal/plan.h).

    dispatches run in order on one encoder; scratch gives the float32
    elements of the pass's scratch tensors (0 when unused): the forward's
    partial_out and partial_stats (the split-KV decode's), the backward's delta.
    The single-dispatch fields (kernel_name, grid, ...) read dispatches[0]
    and are only defined for one-dispatch plans.
    """

    dispatches: Tuple[MetalDispatch, ...]
    scratch: Dict[str, int]
    reason: str
    gpu: str  # the chip the plan is sized and estimated for
    # The routing table (csrc/metal/families/table.cpp), one line per kernel
    # family in priority order, then the composite path's: "<family>: took the
    # call", "<family>: no: <why>", or "<family>: would take it too; <first>
    # comes first".
    families: Tuple[str, ...] = ()

    def _only(self) -> MetalDispatch:
        if len(self.dispatches) != 1:
            names = ", ".join(d.kernel_name for d in self.dispatches)
            raise ValueError(f"this plan has {len(self.dispatches)} dispatches ({names}); read plan.dispatches")
        return self.dispatches[0]

    kernel_name = property(lambda self: self._only().kernel_name)
    grid = property(lambda self: self._only().grid)
    threadgroup = property(lambda self: self._only().threadgroup)
    threadgroup_memory = property(lambda self: self._only().threadgroup_memory)
    threadgroup_memory_index = property(lambda self: self._only().threadgroup_memory_index)
    function_constants = property(lambda self: self._only().function_constants)
    buffers = property(lambda self: self._only().buffers)
    params_index = property(lambda self: self._only().params_index)
    params = property(lambda self: self._only().params)
    max_threads_per_threadgroup = property(lambda self: self._only().max_threads_per_threadgroup)
    live_registers = property(lambda self: self._only().live_registers)
    simdgroups_per_core = property(lambda self: self._only().simdgroups_per_core)


def explain(
    q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: Optional[float] = None, impl: str = "auto",
    gpu: str = "base", backward: bool = False, grad_out: Optional[Tensor] = None, out: Optional[Tensor] = None,
    lse: Optional[Tensor] = None, grad_lse: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0, cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
    sinks: Optional[Tensor] = None, block_table: Optional[Tensor] = None, cache_seqlens: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None, k_bias: Optional[Tensor] = None, v_scale: Optional[Tensor] = None,
    v_bias: Optional[Tensor] = None, k_format: str = "auto", v_format: str = "auto",
) -> MetalPlan:
    """Which Metal kernels attention() would launch for these inputs, and why.

    Runs only the host's planning code (no kernel), so it works on any
    device. gpu: the GPU to plan for, a class ("base", "max", "ultra") or a
    chip ("m1", "m2-pro", "m3-max", "m4-pro", "m5", ...; on a Mac the op uses
    the GPU's own): the split-KV decode sizes its blocks by its cores, and
    each dispatch's estimates (live_registers, simdgroups_per_core) are for it.
    backward=True: the plan of attention_backward instead (two dispatches);
    grad_out, out, lse and grad_lse, when given, supply their strides (packed
    otherwise) and grad_lse's presence. attn_mask, the window and softcap as
    in attention(); with cu_seqlens_q and cu_seqlens_k, the plan of
    attention_varlen (q, k, v packed (total, H, D)). sinks: the forward
    kernels' fc_has_sinks, and the backward's third dispatch, flash_sinks_grad.
    With cache_seqlens (and block_table): attention_kvcache_with_lse's plan,
    k and v being the caches: the decode or prefill kernel reading the table,
    or the gather path's varlen plan (the reason says which); with
    cu_seqlens_q too (no cu_seqlens_k), its packed queries' plan; with a
    quantized cache (k_scale, ..., as attention_kvcache takes them) the
    quantized decode kernels (issue 44). families:
    the routing table's verdicts, one line per kernel family (took the call,
    or why not), then the composite path's.
    """
    varlen = cu_seqlens_q is not None
    args = ((q, k, v) if varlen else (_as_4d(q), _as_4d(k), _as_4d(v))) + (causal, scale, impl, gpu)
    extra = (backward, grad_out, out, lse, grad_lse, attn_mask, window_left, window_right, softcap, cu_seqlens_q,
             cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, block_table, cache_seqlens, k_scale, k_bias, v_scale,
             v_bias, k_format, v_format)
    dispatches, count, i = [], 1, 0
    while i < count:
        (name, grid, tg, mem, mem_index, consts, indices, params_index, params, reason, count, scratch, max_threads,
         estimate, limit, gpu_name, families, qp_index, qp) = torch.ops.flash_metal.metal_plan(*args, i, *extra)
        if count == 0:  # the composite path (csrc/composite.h): no kernel of ours, only the reason
            break
        buffers = {t: n for t, n in zip(_LAUNCH_TENSORS, indices) if n >= 0}
        dispatches.append(
            MetalDispatch(name, tuple(grid), tuple(tg), mem, mem_index, tuple(consts), buffers, params_index, params,
                          max_threads, *estimate, limit, _mpp_bookkeeping.counts(name), qp_index,
                          qp if qp_index else None)
        )
        i += 1
    sizes = dict(zip(("partial_out", "partial_stats", "delta"), scratch))
    return MetalPlan(tuple(dispatches), {name: sizes[name] for name in _SCRATCH[backward]}, reason, gpu_name,
                     tuple(families))


@torch.library.register_fake("flash_metal::attention_forward")
def _attention_forward_fake(q, k, v, causal=False, scale=None, impl="auto", attn_mask=None, window_left=-1,
                            window_right=-1, softcap=0.0, sinks=None):
    # Shapes only; the C++ checks run on real tensors. These few guard the
    # symbolic shapes the outputs are built from.
    torch._check(q.dim() == 4, lambda: f"q must be 4-D (batch, heads, seq_len, head_dim); got {q.dim()}-D")
    torch._check(k.dim() == 4 and v.dim() == 4, lambda: "k and v must be 4-D (batch, heads, seq_len, head_dim)")
    torch._check(k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0,
                 lambda: "the number of query heads must be a multiple of the number of key/value heads")
    torch._check(impl in _IMPLS, lambda: f"impl must be one of {_IMPLS}; got {impl!r}")
    B, H, N, _ = q.shape
    out = q.new_empty((B, H, N, v.shape[3]))  # v's head dim (D_v), which may differ from q's and k's
    lse = q.new_empty((B, H, N), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("flash_metal::attention_backward")
def _attention_backward_fake(grad_out, q, k, v, out, lse, causal=False, scale=None, grad_lse=None, impl="auto",
                             attn_mask=None, window_left=-1, window_right=-1, softcap=0.0, sinks=None):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: "q, k and v must be 4-D (batch, heads, seq_len, head_dim)")
    torch._check(impl in ("auto", "tensor_ops", "prefill"),
                 lambda: f"attention_backward accepts only impl='auto', 'tensor_ops' or (D = 512) 'prefill'; "
                         f"got {impl!r}")
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), _grad_sinks_like(q, sinks)


def _grad_sinks_like(q, sinks):
    # The backward's grad_sinks: sinks' shape and dtype, or an empty float32
    # (0,) tensor without sinks (the schema's output is not optional).
    if sinks is None:
        return q.new_empty((0,), dtype=torch.float32)
    return sinks.new_empty(sinks.shape)


@torch.library.register_fake("flash_metal::attention_varlen_forward")
def _attention_varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                                   scale=None, window_left=-1, window_right=-1, softcap=0.0, impl="auto", sinks=None):
    torch._check(q.dim() == 3, lambda: f"q must be 3-D (total_tokens, heads, head_dim); got {q.dim()}-D")
    torch._check(k.dim() == 3 and v.dim() == 3, lambda: "k and v must be 3-D (total_tokens, heads, head_dim)")
    T, H, _ = q.shape
    return q.new_empty((T, H, v.shape[2])), q.new_empty((H, T), dtype=torch.float32)


@torch.library.register_fake("flash_metal::attention_kvcache")
def _attention_kvcache_fake(q, k_cache, v_cache, cache_seqlens, block_table=None, causal=False, scale=None,
                            window_left=-1, window_right=-1, softcap=0.0, sinks=None, impl="auto",
                            cu_seqlens_q=None, max_seqlen_q=0, k_scale=None, k_bias=None, v_scale=None,
                            v_bias=None, k_format="auto", v_format="auto"):
    # A 4-bit v_cache packs its head dim (8 codes per uint32, 2 per uint8); its scale has one entry per group.
    v_dim = v_cache.shape[3] * {torch.uint32: 8, torch.uint8: 2}.get(v_cache.dtype, 1) if v_cache.dim() == 4 else 0
    torch._check(k_cache.dim() == 4 and v_cache.dim() == 4,
                 lambda: "k_cache and v_cache must be 4-D (num_blocks, page_size, kv_heads, head_dim)")
    if cu_seqlens_q is not None:  # packed queries: attention_varlen's layouts
        torch._check(q.dim() == 3, lambda: f"q must be 3-D (total_q, heads, head_dim) with cu_seqlens_q; got "
                                           f"{q.dim()}-D")
        T, H, _ = q.shape
        return q.new_empty((T, H, v_dim)), q.new_empty((H, T), dtype=torch.float32)
    torch._check(q.dim() == 4, lambda: f"q must be 4-D (batch, heads, seq_len, head_dim); got {q.dim()}-D")
    B, H, N, _ = q.shape
    return q.new_empty((B, H, N, v_dim)), q.new_empty((B, H, N), dtype=torch.float32)


def _varlen_grads_like(t):
    # The kernels' gradients are (1, H, total, D) packed buffers returned as
    # (total, H, D) views; the fake has the same strides.
    T, H, D = t.shape
    return t.new_empty((1, H, T, D)).transpose(1, 2).squeeze(0)


@torch.library.register_fake("flash_metal::attention_varlen_backward")
def _attention_varlen_backward_fake(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal=False, scale=None, grad_lse=None, window_left=-1,
                                    window_right=-1, softcap=0.0, impl="auto", sinks=None):
    torch._check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3,
                 lambda: "q, k and v must be 3-D (total_tokens, heads, head_dim)")
    return _varlen_grads_like(q), _varlen_grads_like(k), _varlen_grads_like(v), _grad_sinks_like(q, sinks)


# Autograd. The forward saves q, k, v, out and lse (O(N) extra: one float per
# query row beyond out), never the N x N probabilities; the backward
# recomputes them (FlashAttention-2).
def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, impl, attn_mask, window_left, window_right, softcap, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, sinks)
    ctx.options = (causal, scale)
    ctx.features = (window_left, window_right, softcap)
    ctx.mask_needs_grad = attn_mask is not None and attn_mask.requires_grad
    # impl='prefill' at D_qk = D_v = 512 on Metal also forces the backward's fused split-D pair
    # (impl='auto' runs the composite backward there: csrc/metal/families/prefill_splitd.cpp says why).
    ctx.backward_impl = ("prefill" if impl == "prefill" and q.device.type == "mps"
                         and q.shape[-1] == v.shape[-1] == 512 else "auto")


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, attn_mask, sinks = ctx.saved_tensors
    if ctx.mask_needs_grad:
        raise NotImplementedError(
            "flash_metal.attention: no gradient flows into attn_mask (an additive mask that requires grad, such as "
            "a learned bias); detach it, or use torch.nn.functional.scaled_dot_product_attention"
        )
    # A gradient flowing into lse is supported: d lse_i / d s_ij = P_ij, so
    # it enters the backward as D_i - grad_lse_i (see attention_backward).
    # grad_out is never None, even when only lse was used: torch.library's
    # autograd materializes an unused output's gradient as zeros on every
    # supported torch (tests/api/test_backward.py::test_autograd_lse_only_and_both).
    # The forward's impl names a forward kernel; the backward's family is
    # chosen by "auto", but for impl='prefill' at D = 512 on Metal (the split-D pair).
    grad_q, grad_k, grad_v, grad_sinks = torch.ops.flash_metal.attention_backward(
        grad_out, q, k, v, out, lse, *ctx.options, grad_lse, ctx.backward_impl, attn_mask,
        *ctx.features, sinks,
    )
    return grad_q, grad_k, grad_v, None, None, None, None, None, None, None, (grad_sinks if sinks is not None else None)


torch.library.register_autograd("flash_metal::attention_forward", _backward, setup_context=_setup_context)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window_left, window_right, softcap, impl, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sinks)
    ctx.lengths = (max_q, max_k, causal, scale)
    ctx.features = (window_left, window_right, softcap)


def _varlen_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k, sinks = ctx.saved_tensors
    grad_q, grad_k, grad_v, grad_sinks = torch.ops.flash_metal.attention_varlen_backward(
        grad_out, q, k, v, out, lse, cu_q, cu_k, *ctx.lengths, grad_lse, *ctx.features,
        "auto", sinks,
    )
    return (grad_q, grad_k, grad_v) + (None,) * 10 + ((grad_sinks if sinks is not None else None),)


torch.library.register_autograd(
    "flash_metal::attention_varlen_forward", _varlen_backward, setup_context=_varlen_setup_context
)


def _no_double_backward(ctx, *grads):
    # The backward kernels are not themselves differentiable. Without this,
    # PyTorch would differentiate attention_backward as a constant and return
    # wrong second derivatives with only a warning.
    raise NotImplementedError(
        "flash_metal.attention_backward is not differentiable (no double backward): second derivatives of "
        "flash_metal.attention are not supported; use torch.nn.functional.scaled_dot_product_attention's math "
        "path for gradgradcheck-style higher-order gradients"
    )


def _backward_setup_context(ctx, inputs, output):
    pass


torch.library.register_autograd(
    "flash_metal::attention_backward", _no_double_backward, setup_context=_backward_setup_context
)
torch.library.register_autograd(
    "flash_metal::attention_varlen_backward", _no_double_backward, setup_context=_backward_setup_context
)


def _kvcache_no_backward(ctx, *grads):
    # Without this, autograd would pass the op by with a deprecation warning and
    # leave q's and the sinks' gradients None: a gradient silently dropped.
    raise NotImplementedError(
        "torch.ops.flash_metal.attention_kvcache has no backward: call flash_metal.attention_kvcache_with_lse (or "
        "flash_attn_varlen_func / flash_attn_with_kvcache), which gather the rows in use for attention_varlen when "
        "a gradient is wanted"
    )


torch.library.register_autograd("flash_metal::attention_kvcache", _kvcache_no_backward,
                                setup_context=_backward_setup_context)
