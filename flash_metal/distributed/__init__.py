"""Context-parallel attention: one sequence split across the ranks of a torch.distributed group.

    import torch.distributed as dist
    import flash_metal.distributed as fmd

    dist.init_process_group("gloo")                       # torchrun sets rank, world size, address
    q, k, v = (fmd.shard(t, 2, "zigzag") for t in (q_full, k_full, v_full))
    out = fmd.attention(q, k, v, variant="zigzag", causal=True)   # this rank's shard of the output
    full = fmd.unshard(out, 2, "zigzag")                  # (for checking; no gradient)

Variants (see docs/usage.md, "Context parallelism", for what each costs):
- "ring": contiguous shards; K/V shards travel around the ring with
  batch_isend_irecv while the local blocks compute; partial results merge
  through their lse (ring-flash-attention's ring).
- "zigzag": the ring on shards of chunks r and 2P-1-r (ring-flash-attention's
  zigzag), which balances a causal mask's work across ranks.
- "ulysses": all-to-all from sequence shards to head shards, the op over the
  whole sequence for Hq/P heads, all-to-all back (DeepSpeed-Ulysses). Needs
  Hq divisible by P (kv heads are repeated when P does not divide them).
The hybrid of the two (USP, feifeibear/long-context-attention) is not built.

Every variant is exact (the same attention as the single-process op, to
rounding), differentiable (autograd; the ring's backward passes dK/dV
around with K/V and uses the merged lse), and takes the op's options:
causal, GQA, scale, softcap, a sliding window (ring: steps whose keys no
rank can see are not run at all, neither compute nor transfer), sinks
(merged once), D_v != D_qk, and varlen (packed documents with global
cu_seqlens, sharded by token; a rank may hold none). It is self-attention:
q, k and v shards cover the same positions. Not supported: attn_mask,
dropout, the hybrid, a KV cache.

torch.compile: each call is one graph break (the collectives run eagerly,
torch.compiler.disable); the model code around it compiles.
"""
import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _blocks, _comm, _layout, _ring, _ulysses
from ._blocks import stats
from ._layout import VARIANTS

__all__ = ["attention", "attention_with_lse", "shard", "unshard", "stats", "VARIANTS"]


def _fail(message: str):
    raise ValueError(f"flash_metal.distributed.attention: {message}")


def _check_local(q, k, v, variant, g, window_left, window_right, softcap, sinks, cu_seqlens, varlen):
    """The checks each rank makes on its own inputs (before any collective)."""
    if variant not in VARIANTS:
        _fail(f"variant must be one of {VARIANTS}; got {variant!r}")
    want = 3 if varlen else 4
    layout = "(total_tokens, heads, head_dim) with cu_seqlens" if varlen else "(batch, heads, seq_len, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != want:
            _fail(f"{name} must be a {want}-D tensor {layout}; got {getattr(t, 'shape', type(t).__name__)}")
    if not (q.dtype == k.dtype == v.dtype):
        _fail(f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    seq, heads = (0, 1) if varlen else (2, 1)
    if not (q.shape[seq] == k.shape[seq] == v.shape[seq]):
        _fail(f"q, k and v must hold the same positions (self-attention over one sharded sequence); got local "
              f"lengths {q.shape[seq]}, {k.shape[seq]}, {v.shape[seq]}")
    if not varlen and not (q.shape[0] == k.shape[0] == v.shape[0]):
        _fail(f"q, k and v must share the batch size; got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[heads] != v.shape[heads] or k.shape[heads] == 0 or q.shape[heads] % k.shape[heads]:
        _fail(f"the query heads ({q.shape[heads]}) must be a multiple of the kv heads (k {k.shape[heads]}, "
              f"v {v.shape[heads]})")
    if q.shape[-1] != k.shape[-1]:
        _fail(f"q and k must share their head dim; got {q.shape[-1]} and {k.shape[-1]}")
    for name, w in (("window_left", window_left), ("window_right", window_right)):
        if not isinstance(w, int) or w < -1:
            _fail(f"{name} must be -1 (unbounded) or a number of keys >= 0; got {w!r}")
    if not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap >= 0):
        _fail(f"softcap must be 0 (off) or a finite positive number; got {softcap!r}")
    if sinks is not None and (not isinstance(sinks, Tensor) or tuple(sinks.shape) != (q.shape[heads],)):
        _fail(f"sinks must be a ({q.shape[heads]},) tensor, one logit per query head; got "
              f"{getattr(sinks, 'shape', sinks)}")
    if variant == "ulysses" and q.shape[heads] % g.size:
        _fail(f"variant 'ulysses' needs the query heads ({q.shape[heads]}) divisible by the group's size "
              f"({g.size}); use 'ring' or 'zigzag'")
    if cu_seqlens is not None and (not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or
                                   cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64)):
        _fail(f"cu_seqlens must be a 1-D int32 tensor (documents + 1,), the same on every rank; got "
              f"{getattr(cu_seqlens, 'shape', cu_seqlens)}")


def _check_global(variant, lengths, cu_seqlens):
    """The checks on every rank's lengths (the same answer on every rank)."""
    if variant == "zigzag":
        why = _layout.check_zigzag_lengths(lengths)
        if why:
            _fail(why)
    if cu_seqlens is not None:
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != sum(lengths) or any(b < a for a, b in zip(cu, cu[1:])):
            _fail(f"cu_seqlens must rise from 0 to the global token count {sum(lengths)} (the sum of every rank's "
                  f"shard); got {cu if len(cu) <= 12 else cu[:6] + ['...'] + cu[-3:]}")


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cfg):
        out, lse = _ring.ring_forward(cfg, q, k, v, sinks)
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        grad_out = grad_out.to(out.dtype)
        dq, dk, dv = _ring.ring_backward(ctx.cfg, (grad_out, q, out, lse, grad_lse), k, v, sinks is None)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            dsinks = _blocks.sinks_grad(sinks, out, grad_out, lse, grad_lse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None


@torch.compiler.disable
def attention_with_lse(
    q: Tensor, k: Tensor, v: Tensor, group: Optional["dist.ProcessGroup"] = None, variant: str = "ring",
    causal: bool = False, scale: Optional[float] = None, window_left: int = -1, window_right: int = -1,
    softcap: float = 0.0, sinks: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Exact attention over a sequence sharded across `group` (default: the world). Returns (out, lse) shards.

    q (B, Hq, n, D), k (B, Hkv, n, D), v (B, Hkv, n, D_v): this rank's shard
    of the sequence, laid out as shard(x, 2, variant) lays it out (ring and
    ulysses: any contiguous split in rank order, uneven allowed; zigzag:
    chunks r and 2P-1-r of tensor_split(x, 2P)). Positions are global: causal
    and the window (flash-attn's convention, as in flash_metal.attention) apply
    to positions in the whole sequence.

    Varlen: with cu_seqlens (the global document boundaries, the same on
    every rank), q is (t, Hq, D) and k, v (t, Hkv, D): this rank's shard of
    the packed tokens (shard(x, 0, variant)); documents may straddle ranks
    and a rank may hold no token. Returns out (t, Hq, D_v), lse (Hq, t).

    sinks (Hq,): the attention sinks, merged once per row. Its gradient, like
    any weight's under context parallelism, is this rank's share (sum it
    across ranks, as DDP does). lse (float32) includes the sinks.
    Every rank must pass the same options.
    """
    varlen = cu_seqlens is not None
    g = _comm.Group(group, q.device if isinstance(q, Tensor) else torch.device("cpu"))
    try:
        _check_local(q, k, v, variant, g, window_left, window_right, softcap, sinks, cu_seqlens, varlen)
    except ValueError:
        g.all_lengths(0, ok=False)  # so that the other ranks raise too, instead of waiting
        raise
    lengths = g.all_lengths(int(q.shape[0 if varlen else 2]))
    _check_global(variant, lengths, cu_seqlens)
    if varlen:
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H, t, D) views
    else:
        q4, k4, v4 = q, k, v
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if variant == "ulysses":
        out, lse = _ulysses.ulysses_attention(g, lengths, q4, k4, v4, causal, scale, window_left, window_right,
                                              softcap, sinks, cu_seqlens)
    else:
        band = _layout.Band.of(causal, window_left, window_right)
        cfg = _ring.RingConfig(g, variant, tuple(lengths), band, bool(causal), window_left, window_right, scale,
                               float(softcap), None if cu_seqlens is None else tuple(cu_seqlens.tolist()),
                               _layout.ring_steps(variant, lengths, band))
        stats["skipped_steps"] += g.size - cfg.steps
        out, lse = _RingAttention.apply(q4, k4, v4, sinks, cfg)
    if varlen:
        return out[0].transpose(0, 1), lse[0]
    return out, lse


def attention(q: Tensor, k: Tensor, v: Tensor, group=None, variant: str = "ring", causal: bool = False,
              scale: Optional[float] = None, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
              sinks: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """This rank's shard of the attention output; see attention_with_lse."""
    return attention_with_lse(q, k, v, group, variant, causal, scale, window_left, window_right, softcap, sinks,
                              cu_seqlens)[0]


def _group_size_rank(group) -> Tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flash_metal.distributed: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group('gloo') first")
    return dist.get_world_size(group), dist.get_rank(group)


def shard(x: Tensor, dim: int, variant: str = "ring", group=None) -> Tensor:
    """This rank's shard of x (the whole sequence, the same on every rank) along dim: a view for ring and ulysses
    (torch.tensor_split's r-th part), chunks r and 2P-1-r of tensor_split(x, 2P) joined for zigzag.
    Works the same for position_ids and labels."""
    if variant not in VARIANTS:
        raise ValueError(f"flash_metal.distributed.shard: variant must be one of {VARIANTS}; got {variant!r}")
    size, rank = _group_size_rank(group)
    if variant == "zigzag":
        parts = x.tensor_split(2 * size, dim)
        a, b = _layout.zigzag_chunks(rank, size)
        return torch.cat([parts[a], parts[b]], dim)
    return x.tensor_split(size, dim)[rank]


@torch.no_grad()
def unshard(x: Tensor, dim: int, variant: str = "ring", group=None) -> Tensor:
    """The whole sequence from every rank's shard (an all_gather; every rank gets it). No gradient flows back."""
    if variant not in VARIANTS:
        raise ValueError(f"flash_metal.distributed.unshard: variant must be one of {VARIANTS}; got {variant!r}")
    g = _comm.Group(group, x.device)
    dim = dim % x.dim()
    lengths = g.all_lengths(x.shape[dim])
    longest = max(lengths)
    pad = list(x.shape)
    pad[dim] = longest - x.shape[dim]
    mine = g.wire(torch.cat([x, x.new_zeros(pad)], dim))
    every = [torch.empty_like(mine) for _ in range(g.size)]
    if g.size > 1:
        dist.all_gather(every, mine, group=g.group)
    else:
        every = [mine]
    pieces = [g.arrived(t).narrow(dim, 0, n) for t, n in zip(every, lengths)]
    if variant != "zigzag":
        return torch.cat(pieces, dim)
    chunks = [None] * (2 * g.size)
    for r, piece in enumerate(pieces):
        for seg, c in zip(_layout.segments("zigzag", lengths, r), _layout.zigzag_chunks(r, g.size)):
            chunks[c] = piece.narrow(dim, seg.offset, seg.length)
    return torch.cat(chunks, dim)
