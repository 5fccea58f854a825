"""Pure-PyTorch references: the post's four functions, and a float64 oracle.

The post ("Writing a FlashAttention kernel in Metal", shared/seed/) builds up
to FlashAttention's forward pass in four steps; each function below is one
step, generalized only as far as the tests need (an optional scale, and
causal masking with Nq != Nk). They run on single-head (N, D) tensors and are
meant to be read, not to be fast.

`attention_reference` is the float64 oracle every kernel is tested against.
"""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor


def _scale(d: int, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(d) if scale is None else scale


def causal_mask(n_q: int, n_k: int, device=None) -> Tensor:
    """True where query i may NOT attend key j: j > i + (n_k - n_q).

    Bottom-right alignment: the last query lines up with the last key (the
    KV-cache convention of FlashAttention-2 and MLX). With n_q == n_k this is
    the usual strictly-upper triangle.
    """
    i = torch.arange(n_q, device=device).unsqueeze(1)
    j = torch.arange(n_k, device=device).unsqueeze(0)
    return j > i + (n_k - n_q)


def stdattention(Q: Tensor, K: Tensor, V: Tensor, causal: bool = False, scale: Optional[float] = None):
    """Standard attention, step 1 of the post: materialize S and P (N x N).

    S = Q Kᵀ · scale, P = softmax(S) row by row, O = P V. Returns (S, P, O).
    Each row of P holds one query's weights over the keys and sums to 1.
    """
    S = (Q @ K.T) * _scale(Q.shape[-1], scale)
    if causal:
        S = S.masked_fill(causal_mask(Q.shape[0], K.shape[0], Q.device), float("-inf"))
    P = torch.softmax(S, dim=1)
    O = P @ V
    return S, P, O


def onlinesoftmax(x: Tensor, blockSize: int) -> Tensor:
    """Softmax of a 1-D tensor computed block by block (step 2).

    A running maximum m and normalization sum l are carried across blocks:
    when a block raises the maximum, the sum so far is rescaled by
    exp(m - m_new) so that every term is measured against the same maximum,
    then the block's own exp(x - m_new) terms are added. The final
    probabilities still revisit x, which is why attention needs step 3.
    """
    l = x.new_tensor(0.0)  # normalization sum
    m = x.new_tensor(float("-inf"))  # largest score so far
    for start in range(0, x.numel(), blockSize):
        block = x[start : start + blockSize]
        m_new = torch.maximum(m, block.max())
        l = torch.exp(m - m_new) * l + torch.exp(block - m_new).sum()
        m = m_new
    return torch.exp(x - m) / l


def onequeryattention(Q: Tensor, K: Tensor, V: Tensor, blockSize: int, scale: Optional[float] = None) -> Tensor:
    """Attention for one query vector Q (D,) over key/value blocks (step 3).

    Besides m and l, an unnormalized weighted sum of values u is carried and
    rescaled with the same factor alpha = exp(m - m_new), so each block of
    scores can be discarded after use; the answer is u / l.
    """
    s = _scale(Q.shape[-1], scale)
    m = Q.new_tensor(float("-inf"))
    l = Q.new_tensor(0.0)
    u = V.new_zeros(V.shape[-1])  # unnormalized weighted sum of values
    for start in range(0, K.shape[0], blockSize):
        KBlock = K[start : start + blockSize]
        VBlock = V[start : start + blockSize]
        scores = (Q @ KBlock.T) * s
        m_new = torch.maximum(m, scores.max())
        alpha = torch.exp(m - m_new)
        weights = torch.exp(scores - m_new)
        l = alpha * l + weights.sum()
        u = alpha * u + weights @ VBlock
        m = m_new
    return u / l


def blockwiseattention(
    Q: Tensor,
    K: Tensor,
    V: Tensor,
    QBlockSize: int,
    KBlockSize: int,
    causal: bool = False,
    scale: Optional[float] = None,
) -> Tensor:
    """FlashAttention's forward loop in PyTorch (step 4).

    For each block of query rows, m and l have shape (rows, 1) and u (rows, D):
    every query keeps its own running statistics. With causal masking, future
    keys are set to -inf inside a block, and the key loop stops early at the
    first block that lies entirely in the future of the whole query block.
    Rows that see no key at all (only possible when Nk < Nq) give zeros.
    """
    s = _scale(Q.shape[-1], scale)
    n_q, n_k = Q.shape[0], K.shape[0]
    offset = n_k - n_q  # query i sees keys j <= i + offset
    O = torch.zeros(n_q, V.shape[-1], dtype=V.dtype, device=V.device)
    for QStart in range(0, n_q, QBlockSize):
        QBlock = Q[QStart : QStart + QBlockSize]
        rows = QBlock.shape[0]
        m = Q.new_full((rows, 1), float("-inf"))
        l = Q.new_zeros((rows, 1))
        u = V.new_zeros((rows, V.shape[-1]))
        for KStart in range(0, n_k, KBlockSize):
            if causal and KStart > QStart + rows - 1 + offset:
                break  # this block and every later one are in the future of every row
            KBlock = K[KStart : KStart + KBlockSize]
            VBlock = V[KStart : KStart + KBlockSize]
            scores = (QBlock @ KBlock.T) * s
            if causal:
                queryPositions = torch.arange(QStart, QStart + rows, device=Q.device).unsqueeze(1)
                keyPositions = torch.arange(KStart, KStart + KBlock.shape[0], device=K.device).unsqueeze(0)
                scores = scores.masked_fill(keyPositions > queryPositions + offset, float("-inf"))
            blockMax = scores.max(dim=1, keepdim=True).values
            m_new = torch.maximum(m, blockMax)
            # A row with no visible key yet has m_new = -inf; measure against 0
            # instead so that exp() gives 0 rather than NaN.
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - safe)
            weights = torch.exp(scores - safe)
            l = alpha * l + weights.sum(dim=1, keepdim=True)
            u = alpha * u + weights @ VBlock
            m = m_new
        O[QStart : QStart + rows] = torch.where(l > 0, u / l.clamp_min(torch.finfo(l.dtype).tiny), 0.0)
    return O


# The kernels' masked-key rule: a key whose final score (after softcap and
# an additive mask) is at or below this counts as masked (weight 0), so a
# row whose every key is masked gives zeros and lse = -inf, never NaN. The
# kernels work in base 2 and test s * log2(e) <= -2^100; in natural-log
# units that is -2^100 * ln(2). Far below any real score; -inf and float32's
# finfo.min (transformers' additive padding value) are both below it.
MASKED_SCORE = -(2.0**100) * math.log(2.0)


def visible_keys(
    n_q: int, n_k: int, causal: bool = False, window_left: int = -1, window_right: int = -1, device=None
) -> Tensor:
    """(n_q, n_k) bool: True where query i may see key j by causality and the window.

    flash-attn's convention, bottom-right aligned:
    i + n_k - n_q - window_left <= j <= i + n_k - n_q + window_right, each
    bound absent when -1; causal sets window_right to 0.
    """
    i = torch.arange(n_q, device=device).unsqueeze(1)
    j = torch.arange(n_k, device=device).unsqueeze(0)
    vis = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    right = 0 if causal else window_right
    if right >= 0:
        vis &= j <= i + (n_k - n_q) + right
    if window_left >= 0:
        vis &= j >= i + (n_k - n_q) - window_left
    return vis


def apply_options(
    S: Tensor, causal: bool = False, attn_mask: Optional[Tensor] = None, window_left: int = -1,
    window_right: int = -1, softcap: float = 0.0,
) -> Tensor:
    """Scaled scores S (..., n_q, n_k) -> the scores the softmax sees, -inf where masked.

    The order every kernel follows (Gemma 2's): softcap, softcap * tanh(S /
    softcap); then the mask, + an additive mask or -inf where a bool mask is
    False; then the window and causality. A score at or below MASKED_SCORE
    becomes -inf (the kernels' masked-key rule). Computed in S's dtype.
    """
    if softcap > 0:
        S = softcap * torch.tanh(S / softcap)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            S = S.masked_fill(~attn_mask, float("-inf"))
        else:
            S = S + attn_mask.to(S.dtype)
        S = S.masked_fill(S <= MASKED_SCORE, float("-inf"))
    if causal or window_left >= 0 or window_right >= 0:
        vis = visible_keys(S.shape[-2], S.shape[-1], causal, window_left, window_right, S.device)
        S = S.masked_fill(~vis, float("-inf"))
    return S


def attention_reference(
    q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: Optional[float] = None,
    attn_mask: Optional[Tensor] = None, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """The float64 oracle: (out, lse) for (B, Hq, Nq, D) / (B, Hkv, Nk, D) inputs (v: D or its own D_v).

    Computed in float64 through the full score matrix (fine for a reference,
    never used on a flash path). Handles GQA by repeating kv heads,
    bottom-right causal alignment, the mask, window and softcap of
    apply_options, and rows with no visible key (out 0, lse -inf),
    matching attention_forward's contract.

    sinks (Hq,): gpt-oss's attention sinks, written as gpt-oss's eager code
    does: the sink logit is concatenated to each row's (softcapped, masked)
    scores as one more key whose value is zero, the softmax runs over the
    row, and the sink's column is dropped; lse includes it. A row with every
    key masked then gives out 0 and lse = its sink. Differentiable: autograd
    through this function gives the sinks' float64 gradient.
    """
    q64, k64, v64 = q.double(), k.double(), v.double()
    group = q.shape[1] // max(k.shape[1], 1)
    if group > 1:
        k64 = k64.repeat_interleave(group, dim=1)
        v64 = v64.repeat_interleave(group, dim=1)
    S = (q64 @ k64.transpose(-1, -2)) * _scale(q.shape[-1], scale)
    S = apply_options(S, causal, attn_mask, window_left, window_right, softcap)
    if sinks is not None:
        sink = sinks.double().view(1, -1, 1, 1).expand(*S.shape[:-1], 1)
        S = torch.cat([S, sink], dim=-1)
        v64 = torch.cat([v64, v64.new_zeros(*v64.shape[:-2], 1, v64.shape[-1])], dim=-2)
    lse = torch.logsumexp(S, dim=-1) if S.shape[-1] else S.new_full(S.shape[:-1], float("-inf"))
    finite = torch.isfinite(lse)
    P = torch.where(finite.unsqueeze(-1), torch.exp(S - torch.where(finite, lse, 0.0).unsqueeze(-1)), 0.0)
    return P @ v64, lse


def attention_varlen_reference(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, causal: bool = False,
    scale: Optional[float] = None, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """The float64 oracle of attention_varlen: out (total_q, Hq, D_v), lse (Hq, total_q).

    Each sequence b (q rows cu_seqlens_q[b]..[b+1], k/v rows likewise) is
    attention_reference on its own slices.
    """
    out = q.new_zeros(q.shape[:-1] + v.shape[-1:], dtype=torch.float64)  # v's head dim (D_v)
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if cq[b + 1] == cq[b]:
            continue
        o, l = attention_reference(
            q[qs].transpose(0, 1).unsqueeze(0), k[ks].transpose(0, 1).unsqueeze(0),
            v[ks].transpose(0, 1).unsqueeze(0), causal, scale, None, window_left, window_right, softcap, sinks,
        )
        out[qs] = o[0].transpose(0, 1)
        lse[:, qs] = l[0]
    return out, lse


def blockwiseattention_backward(
    Q: Tensor,
    K: Tensor,
    V: Tensor,
    O: Tensor,
    lse: Tensor,
    dO: Tensor,
    QBlockSize: int,
    KBlockSize: int,
    causal: bool = False,
    scale: Optional[float] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """FlashAttention-2's backward pass in PyTorch, with recomputation: (dQ, dK, dV).

    The post's next step, written as the kernels will run it (the
    atomics-free split of metal-flash-attention): nothing N x N is stored;
    each (query block, key block) tile recomputes its probabilities from the
    forward's lse, P = exp(S - lse).
      1. Di = rowsum(dO * O), one number per query row.
      2. Parallel over key blocks (one block's dK and dV stay local): for each
         query block that can see it, dV += P^T dO, dP = dO V^T,
         dS = P * (dP - Di), dK += dS^T Q * scale.
      3. Parallel over query blocks (its dQ stays local): for each key block
         it can see, dQ += dS K * scale, with dS recomputed the same way.
    With causal masking (bottom-right, as the forward), blocks entirely in
    the future are skipped on both sides. Rows that saw no key (lse = -inf)
    have P = 0 and contribute nothing.
    """
    s = _scale(Q.shape[-1], scale)
    n_q, n_k = Q.shape[0], K.shape[0]
    offset = n_k - n_q  # query i sees keys j <= i + offset
    Di = (dO * O).sum(dim=1, keepdim=True)
    finite_lse = torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(1)
    seen = torch.isfinite(lse).unsqueeze(1)

    def tile(QStart, KStart):
        """(P, dS) of one tile, or None when the whole tile lies in the future."""
        rows = min(QBlockSize, n_q - QStart)
        keys = min(KBlockSize, n_k - KStart)
        if causal and KStart > QStart + rows - 1 + offset:
            return None
        scores = (Q[QStart : QStart + rows] @ K[KStart : KStart + keys].T) * s
        P = torch.exp(scores - finite_lse[QStart : QStart + rows])
        visible = seen[QStart : QStart + rows].expand(rows, keys)
        if causal:
            queryPositions = torch.arange(QStart, QStart + rows, device=Q.device).unsqueeze(1)
            keyPositions = torch.arange(KStart, KStart + keys, device=K.device).unsqueeze(0)
            visible = visible & (keyPositions <= queryPositions + offset)
        P = torch.where(visible, P, 0.0)
        dP = dO[QStart : QStart + rows] @ V[KStart : KStart + keys].T
        dS = P * (dP - Di[QStart : QStart + rows])
        return P, dS

    dK, dV = torch.zeros_like(K), torch.zeros_like(V)
    for KStart in range(0, n_k, KBlockSize):
        for QStart in range(0, n_q, QBlockSize):
            t = tile(QStart, KStart)
            if t is None:
                continue
            P, dS = t
            dV[KStart : KStart + KBlockSize] += P.T @ dO[QStart : QStart + QBlockSize]
            dK[KStart : KStart + KBlockSize] += (dS.T @ Q[QStart : QStart + QBlockSize]) * s
    dQ = torch.zeros_like(Q)
    for QStart in range(0, n_q, QBlockSize):
        for KStart in range(0, n_k, KBlockSize):
            t = tile(QStart, KStart)
            if t is None:
                break  # every later key block is further in the future
            dQ[QStart : QStart + QBlockSize] += (t[1] @ K[KStart : KStart + KBlockSize]) * s
    return dQ, dK, dV
