"""Ulysses: all-to-all from sequence shards to head shards, the whole sequence on each rank's heads, and back.

DeepSpeed-Ulysses' scheme (Jacobs et al., 2023), written here for
torch.distributed's all_to_all_single: rank p receives query heads
[p Hq/P, (p + 1) Hq/P) of every rank's shard, so it holds the whole sequence
for Hq/P heads and runs the op once, with every option the op has (causal,
window, softcap, sinks of its heads, varlen over the global documents).
An all-to-all brings the output (and lse) back to sequence shards.

K/V heads: with Hkv divisible by P each rank takes Hkv/P of them. Otherwise
each kv head is repeated r = P / gcd(Hkv, P) times first (r divides the
query group, so every rank's query heads still map onto its own kv heads);
autograd sums the repeats' gradients.
"""
import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _comm
from ._blocks import stats


def kv_repeats(q_heads: int, kv_heads: int, world: int) -> int:
    """How many times each kv head is repeated so that P divides the kv heads (1: not repeated)."""
    return world // math.gcd(kv_heads, world)


def _seq_to_heads(g: _comm.Group, x: Tensor, lengths: List[int]) -> Tensor:
    """(B, H, n_r, D) sequence shard -> (B, H/P, N, D): every rank's rows of this rank's heads."""
    B, H, n, D = x.shape
    h = H // g.size
    return _comm.all_to_all(g, x, 1, [h] * g.size, 2, [(B, h, m, D) for m in lengths])


def _heads_to_seq(g: _comm.Group, y: Tensor, lengths: List[int]) -> Tensor:
    """(B, H/P, N, D) -> (B, H, n_r, D): the inverse of _seq_to_heads."""
    B, h, _, D = y.shape
    return _comm.all_to_all(g, y, 2, lengths, 1, [(B, h, lengths[g.rank], D)] * g.size)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, lengths):
        ctx.g, ctx.lengths = g, lengths
        return _seq_to_heads(g, x, lengths)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(ctx.g, grad.contiguous(), ctx.lengths), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, g, lengths):
        ctx.g, ctx.lengths = g, lengths
        return _heads_to_seq(g, y, lengths)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(ctx.g, grad.contiguous(), ctx.lengths), None, None


def ulysses_attention(g: _comm.Group, lengths: List[int], q: Tensor, k: Tensor, v: Tensor, causal: bool,
                      scale: Optional[float], window_left: int, window_right: int, softcap: float,
                      sinks: Optional[Tensor], cu_seqlens: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """q, k, v (B, H, n_r, D) sequence shards (varlen: B = 1, packed rows). Returns (out, lse) shards."""
    from .. import ops

    hq, hkv = q.shape[1], k.shape[1]
    reps = kv_repeats(hq, hkv, g.size)
    if reps > 1:
        stats["ulysses_kv_repeated"] += 1
        k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
    qh, kh, vh = (_SeqToHeads.apply(t, g, lengths) for t in (q, k, v))
    h = hq // g.size
    sinks_h = None if sinks is None else sinks[g.rank * h:(g.rank + 1) * h]
    stats["block_calls"] += 1
    if cu_seqlens is None:
        out, lse = ops.attention_with_lse(qh, kh, vh, causal, scale, window_left=window_left,
                                          window_right=window_right, softcap=softcap, sinks=sinks_h)
    else:
        stats["varlen_blocks"] += 1
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        out, lse = ops.attention_varlen_with_lse(qh[0].transpose(0, 1), kh[0].transpose(0, 1),
                                                 vh[0].transpose(0, 1), cu, cu, longest, longest, causal, scale,
                                                 window_left, window_right, softcap, sinks=sinks_h)
        out, lse = out.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0)
    out = _HeadsToSeq.apply(out.contiguous(), g, lengths)
    lse = _HeadsToSeq.apply(lse.unsqueeze(-1).contiguous(), g, lengths).squeeze(-1)
    return out, lse
