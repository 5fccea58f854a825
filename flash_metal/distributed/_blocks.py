"""The local blocks of a ring step: the op's forward and backward on slices, and the lse merge.

``KERNELS`` is what every local block calls. It is the op
(torch.ops.flash_metal); tests swap in the Metal emulator's launches of the
same plans (tests/distributed_tasks.py), which is also how they plant bugs.

The merge is the one identity all ring attentions rest on (ring-flash-attention,
PyTorch's context_parallel): attention over two disjoint key sets with
results (o1, lse1) and (o2, lse2) is o = o1 e^(lse1 - lse) + o2 e^(lse2 - lse),
lse = log(e^lse1 + e^lse2). A row that sees no key (lse = -inf) contributes
nothing, and a row that sees none at all stays zero.
"""
import collections
from typing import Optional, Tuple

import torch
from torch import Tensor

# What the distributed attention did, for tests (proof that a path ran) and
# benchmarks: ring steps, local op calls (dense and varlen), steps with no
# block, bytes sent, tensors staged through the CPU, and seconds spent
# computing blocks and waiting for transfers ("wait_s": the transfer time
# not hidden behind compute).
stats = collections.Counter()


class _OpKernels:
    """The local blocks on flash_metal's op: (B, H, N, D) dense, (T, H, D) packed varlen."""

    @staticmethod
    def forward(q, k, v, scale, window_left, window_right, softcap) -> Tuple[Tensor, Tensor]:
        return torch.ops.flash_metal.attention_forward(q, k, v, False, scale, "auto", None, window_left,
                                                       window_right, softcap, None)

    @staticmethod
    def backward(grad_out, q, k, v, out, lse, scale, grad_lse, window_left, window_right, softcap):
        dq, dk, dv, _ = torch.ops.flash_metal.attention_backward(grad_out, q, k, v, out, lse, False, scale, grad_lse,
                                                                 "auto", None, window_left, window_right, softcap,
                                                                 None)
        return dq, dk, dv

    @staticmethod
    def varlen_forward(q, k, v, cu, max_len, causal, scale, window_left, window_right, softcap):
        return torch.ops.flash_metal.attention_varlen_forward(q, k, v, cu, cu, max_len, max_len, causal, scale,
                                                              window_left, window_right, softcap, "auto", None)

    @staticmethod
    def varlen_backward(grad_out, q, k, v, out, lse, cu, max_len, causal, scale, grad_lse, window_left, window_right,
                        softcap):
        dq, dk, dv, _ = torch.ops.flash_metal.attention_varlen_backward(
            grad_out, q, k, v, out, lse, cu, cu, max_len, max_len, causal, scale, grad_lse, window_left,
            window_right, softcap, "auto", None)
        return dq, dk, dv


KERNELS = _OpKernels()


def merge(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """Merges a block's (out, lse) into the float32 accumulators in place (rows of the same shape); no
    temporary the size of out (the rescale and the add are in place)."""
    new = torch.logaddexp(acc_lse, lse)
    seen = torch.isfinite(new)
    safe = torch.where(seen, new, 0.0)
    w_acc = torch.where(seen, torch.exp(acc_lse - safe), 0.0).unsqueeze(-1)
    w_new = torch.where(seen, torch.exp(lse - safe), 0.0).unsqueeze(-1)
    acc_out.mul_(w_acc).addcmul_(out, w_new)
    acc_lse.copy_(torch.where(seen, new, float("-inf")))


def add_sinks(acc_out: Tensor, acc_lse: Tensor, sinks: Optional[Tensor]) -> None:
    """Merges the sinks once, after every block: a virtual key per head with logit sinks[h] and value zero
    (merge with a zero block: only the accumulator's rescale is left)."""
    if sinks is None:
        return
    sink = sinks.detach().float().view(1, -1, 1).expand_as(acc_lse)
    new = torch.logaddexp(acc_lse, sink)
    w = torch.where(torch.isfinite(new), torch.exp(acc_lse - new), 0.0)  # no key (acc_lse -inf): 0; acc_out is 0
    acc_out.mul_(w.unsqueeze(-1))
    acc_lse.copy_(new)


def sinks_grad(sinks: Tensor, out: Tensor, grad_out: Tensor, lse: Tensor, grad_lse: Optional[Tensor]) -> Tensor:
    """d loss / d sinks[h] over this rank's rows: -sum_i p_sink,i (rowsum(dO_i O_i) - grad_lse_i).

    The sink's probability is p = exp(sinks[h] - lse_i) (lse with the sink);
    out_i = sum_j p_ij v_j depends on it only through lse, which gives
    d out_i / d sink = -p out_i, and d lse_i / d sink = p.
    """
    B, H = lse.shape[:2]
    p = torch.exp(sinks.detach().float().view(1, H, 1) - lse)  # rows with lse = sink: p = 1
    delta = (grad_out.float() * out.float()).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.float()
    return (-(p * delta)).sum(dim=(0, 2)).to(sinks.dtype)
