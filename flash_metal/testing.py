"""FlashAttention's 2x rule: is an attention result (or its gradient) as accurate as it should be?

Useful to anyone writing or checking an attention kernel, and what
flash_metal's own tests and ``python -m flash_metal.selfcheck`` use::

    from flash_metal.testing import assert_attention_close, assert_gradients_close
    out, lse = my_attention(q, k, v, causal=True)          # any device; compared on the CPU
    assert_attention_close(out.cpu(), lse.cpu(), q, k, v, causal=True)

The rule (FlashAttention's test suite): the error against a float64 oracle
(`flash_metal.reference.attention_reference`) may be at most twice the error
of PyTorch's own attention computed in the same dtype (the yardstick), plus a
rounding floor, 2 * max|ref + 0.3 - 0.3 - ref| in that dtype (the error of
merely storing the reference in it), plus a float32 accumulation floor
(`fp32_floor`; ``strict=True`` drops it). Where PyTorch's same-dtype
attention breaks down (scores beyond the dtype's range or resolution), a
yardstick that cannot overflow takes its place (see `yardstick_errors`).
A tolerance as large as the output itself would accept an all-zero result;
then the yardstick, not the kernel, is broken, and `YardstickError` says so.

Two forms of each check: ``assert_*`` raises `NotClose` (an AssertionError)
with the numbers; ``*_errors`` returns one `Comparison` per quantity (out,
lse, each gradient, and the structural checks: shape, dtype, NaN), for
reports. Inputs and results are CPU tensors.
"""
import math
from typing import List, NamedTuple, Optional, Sequence

import torch

from .reference import apply_options, attention_reference

__all__ = [
    "Comparison", "NotClose", "YardstickError", "FP32_ULPS", "SCORE_BREAKDOWN", "attention_errors",
    "attention_tolerances", "assert_attention_close", "assert_gradients_close", "assert_varlen_close",
    "assert_varlen_gradients_close", "as_batch", "fp32_floor", "gradient_errors", "gradient_tolerances",
    "pytorch_attention_same_dtype", "reference_gradients", "rounding_floor", "varlen_errors",
    "varlen_gradient_errors", "varlen_sequences", "yardstick_errors",
]

# float32 accumulation rounds too: a few ulps of float32 at the result's
# magnitude, times log2 of the reduction length, is the least any float32
# kernel can promise. This keeps float32 comparisons from hinging on luck.
FP32_ULPS = 8
# A yardstick whose scores are off by a whole unit (natural log) or more has
# reweighted the keys by a factor e or more: it is no longer a rounded
# version of attention, and its error says nothing about what a correct
# kernel can achieve (see yardstick_errors).
SCORE_BREAKDOWN = 1.0


class NotClose(AssertionError):
    """A result failed the 2x rule (or is malformed: wrong shape or dtype, NaN, -inf on the wrong rows)."""


class YardstickError(AssertionError):
    """The tolerance itself is meaningless (as large as the result): a broken yardstick, not a kernel error."""


class Comparison(NamedTuple):
    """One quantity checked: its max error and tolerance (None for structural checks), and the verdict."""

    name: str  # "out", "lse", "grad_q", ..., or a structural check ("out shape", "out NaN", ...)
    error: Optional[float]
    tolerance: Optional[float]
    ok: bool
    message: str  # what was found, with the numbers


def _measured(name: str, err: float, tol: float) -> Comparison:
    ok = err <= tol  # False for a NaN error
    return Comparison(name, err, tol, ok, f"{name}: max error {err:.3g} {'<=' if ok else '>'} tolerance {tol:.3g}")


def _structural(name: str, ok: bool, message: str) -> Comparison:
    return Comparison(name, None, None, bool(ok), message)


def _raise_first(comparisons: Sequence[Comparison]) -> None:
    for c in comparisons:
        if not c.ok:
            raise NotClose(c.message)


def _expand_kv(q, k, v):
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def _scale(q, scale):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def pytorch_attention_same_dtype(q, k, v, causal, scale, return_scores=False, **options):
    """PyTorch's attention computed in the inputs' dtype: the yardstick.

    As in FlashAttention's own reference (attention_ref in its tests) and
    PyTorch's math SDPA, q is scaled before the product: a kernel that folds
    the scale into q (all of ours do) rounds the same way.
    """
    sinks = options.pop("sinks", None)
    k, v = _expand_kv(q, k, v)
    S = (q * _scale(q, scale)) @ k.transpose(-1, -2)
    S = apply_options(S, causal, **options)
    if sinks is not None:  # gpt-oss's eager form: the sink as one more column, dropped after the softmax
        Sx = torch.cat([S, sinks.to(S.dtype).view(1, -1, 1, 1).expand(*S.shape[:-1], 1)], dim=-1)
        P = torch.softmax(Sx.float(), dim=-1)[..., :-1].to(q.dtype)
        lse = torch.logsumexp(Sx.float(), dim=-1)
        out = P @ v
        return (out, lse, S) if return_scores else (out, lse)
    # A row with no visible key is softmax over all -inf: NaN. It is zeroed
    # before the product, never after: how a CPU's GEMM kernel treats a NaN
    # row differs (torch's bfloat16 matmul on AVX-512 BF16 / AMX Xeons
    # spreads it into the neighbouring row), and a yardstick must not
    # depend on that.
    seen = torch.isfinite(S).any(dim=-1, keepdim=True)
    P = torch.where(seen, torch.softmax(S.float(), dim=-1), 0.0).to(q.dtype)
    lse = torch.logsumexp(S.float(), dim=-1)
    out = P @ v
    return (out, lse, S) if return_scores else (out, lse)


def _float32_scores(q, k, causal, scale, **options):
    options.pop("sinks", None)  # scores only: the sink is not a score
    k = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    S = (q.float() * _scale(q, scale)) @ k.transpose(-1, -2)
    return apply_options(S, causal, **options)


def _scores_broke(S, q, k, causal, scale, **options):
    """True when the same-dtype scores S overflowed or drifted SCORE_BREAKDOWN from float32's.

    float32 is the reference here (cheaper than float64, and its own error
    reaches 1 only for scores beyond 1e7, where a 16-bit dtype is off by far
    more): if the two disagree that much, the same-dtype result is not a
    rounded version of attention.
    """
    if q.dtype == torch.float32:
        return False  # the fallback would be this very computation
    S32 = _float32_scores(q, k, causal, scale, **options)
    fin = torch.isfinite(S32)
    if not torch.equal(torch.isfinite(S), fin):
        return True
    drift = torch.where(fin, S.float() - S32, 0.0).abs().max().item()
    return drift >= SCORE_BREAKDOWN


def yardstick_errors(q, k, v, causal, scale, ref_out, ref_lse, **options):
    """(out error, lse error) of the yardstick against the float64 oracle.

    The yardstick is PyTorch's same-dtype attention (FlashAttention's rule),
    unless its scores broke down: non-finite where float32's are finite
    (float16 overflows past 65504), or off by SCORE_BREAKDOWN or more (logits
    of 1e11 in bfloat16 are 4e8 apart). Then it returns infinities, or an
    effectively random row, and twice its error (as large as the output
    itself) would excuse any result, even all zeros. In that case the
    yardstick is the same computation in float32, which cannot overflow on
    these inputs, with its error scaled by eps(dtype) / eps(float32): what
    same-dtype arithmetic would cost if it had float32's range. The output's
    own rounding to the dtype is added, since the float32 result skips it.
    """
    pt_out, pt_lse, S = pytorch_attention_same_dtype(q, k, v, causal, scale, return_scores=True, **options)
    lfin = torch.isfinite(ref_lse)
    if not _scores_broke(S, q, k, causal, scale, **options):
        err = (pt_out.double() - ref_out).abs().max().item()
        lerr = (pt_lse.double()[lfin] - ref_lse[lfin]).abs().max().item() if lfin.any() else 0.0
        return err, lerr
    f_out, f_lse = pytorch_attention_same_dtype(q.float(), k.float(), v.float(), causal, scale, **_float_mask(options))
    ratio = torch.finfo(q.dtype).eps / torch.finfo(torch.float32).eps
    err = ratio * (f_out.double() - ref_out).abs().max().item() + (ref_out.to(q.dtype).double() - ref_out).abs().max().item()
    lerr = ratio * (f_lse.double()[lfin] - ref_lse[lfin]).abs().max().item() if lfin.any() else 0.0
    return err, lerr


def _float_mask(options):
    # The float32 fallback yardstick takes an additive mask in float32 too.
    m = options.get("attn_mask")
    if m is not None and m.dtype != torch.bool:
        options = dict(options, attn_mask=m.float())
    return options


def rounding_floor(ref, dtype):
    """2 * max|r + 0.3 - 0.3 - r| for ref rounded to dtype: the error of merely storing ref in dtype."""
    r = ref.to(dtype)
    return 2 * ((r + 0.3 - 0.3) - r).abs().max().item()


def fp32_floor(ref, length):
    """FP32_ULPS float32 ulps at ref's magnitude (at least 1), times log2 of the reduction length."""
    finite = ref[torch.isfinite(ref)]
    mag = finite.abs().max().item() if finite.numel() else 0.0
    return FP32_ULPS * torch.finfo(torch.float32).eps * max(mag, 1.0) * max(1.0, math.log2(max(length, 1)))


def attention_tolerances(q, k, v, causal=False, scale=None, strict=False, **options):
    """(ref_out, ref_lse, out tolerance, lse tolerance) by the 2x rule.

    strict: FlashAttention's rule alone, 2x PyTorch's error plus the rounding
    floor of the output dtype, without the float32 accumulation floor
    (fp32_floor), which for float32 inputs can exceed PyTorch's own error.
    Raises YardstickError if the tolerance would accept an all-zero output.
    """
    ref_out, ref_lse = attention_reference(q, k, v, causal, scale, **options)
    pt_err, pt_lerr = yardstick_errors(q, k, v, causal, scale, ref_out, ref_lse, **options)
    nk = k.shape[2]
    slack = (lambda ref: 0.0) if strict else (lambda ref: fp32_floor(ref, nk))
    tol = 2 * pt_err + rounding_floor(ref_out, q.dtype) + slack(ref_out)
    fin = torch.isfinite(ref_lse)
    ltol = 0.0
    if fin.any():
        ltol = 2 * pt_lerr + rounding_floor(ref_lse[fin], torch.float32) + slack(ref_lse[fin])
    # A tolerance as large as the output itself would pass an all-zero
    # result: then the yardstick, not the kernel, is broken.
    mag = ref_out.abs().max().item()
    if not (mag == 0.0 or tol < mag):
        raise YardstickError(f"tolerance {tol:.3g} >= max|reference| {mag:.3g}: the yardstick is meaningless")
    return ref_out, ref_lse, tol, ltol


def attention_errors(out, lse, q, k, v, causal=False, scale=None, strict=False, **options) -> List[Comparison]:
    """out/lse from a kernel vs the float64 oracle, by the 2x rule: one Comparison per check, in order.

    options: attn_mask, window_left, window_right, softcap, as the op takes them.
    """
    want = q.shape[:-1] + v.shape[-1:]  # q's shape with v's head dim (D_v)
    checks = [
        _structural("out shape", out.shape == want and out.dtype == q.dtype,
                    f"out is {tuple(out.shape)} {out.dtype}; expected {tuple(want)} {q.dtype}"),
        _structural("lse shape", lse.shape == q.shape[:3] and lse.dtype == torch.float32,
                    f"lse is {tuple(lse.shape)} {lse.dtype}; expected {tuple(q.shape[:3])} torch.float32"),
    ]
    if not all(c.ok for c in checks):
        return checks
    checks.append(_structural("out NaN", not torch.isnan(out).any(),
                              "output has NaN: an element was never written, or the math broke"))
    checks.append(_structural("lse NaN", not torch.isnan(lse).any(),
                              "lse has NaN: an element was never written, or the math broke"))
    ref_out, ref_lse, tol, ltol = attention_tolerances(q, k, v, causal, scale, strict, **options)
    checks.append(_measured("out", (out.double() - ref_out).abs().max().item(), tol))
    # lse: -inf exactly where the oracle has -inf (rows with no visible key).
    checks.append(_structural("lse -inf rows", torch.equal(torch.isinf(lse), torch.isinf(ref_lse)),
                              "lse is -inf on the wrong rows"))
    fin = torch.isfinite(ref_lse)
    if fin.any():
        checks.append(_measured("lse", (lse.double()[fin] - ref_lse[fin]).abs().max().item(), ltol))
    return checks


def assert_attention_close(out, lse, q, k, v, causal=False, scale=None, strict=False, **options):
    """out/lse from a kernel vs the float64 oracle, by the 2x rule (strict: no fp32_floor).

    options: attn_mask, window_left, window_right, softcap, as the op takes them.
    Raises NotClose naming the first failing check, with the numbers.
    """
    _raise_first(attention_errors(out, lse, q, k, v, causal, scale, strict, **options))


# ---------------------------------------------------------------- gradients


def reference_gradients(q, k, v, grad_out, causal=False, scale=None, grad_lse=None, bounds=False, **options):
    """The float64 oracle of attention_backward: (grad_q, grad_k, grad_v).

    Written from the definition, through the full N x N matrices: with
    P = softmax(S) (zero on masked keys and on rows that see no key),
    dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O) + grad_lse), dQ = dS K · scale,
    dK = dSᵀ Q · scale, summed over each kv head's query group. With
    softcap, dS is multiplied by the cap's derivative 1 - tanh²(S / softcap).
    tests/api/test_backward.py checks it against autograd through
    attention_reference.
    """
    sinks = options.pop("sinks", None)
    s = _scale(q, scale)
    q64, k64, v64, do64 = q.double(), k.double(), v.double(), grad_out.double()
    group = q.shape[1] // k.shape[1]
    ke, ve = k64.repeat_interleave(group, dim=1), v64.repeat_interleave(group, dim=1)
    S_raw = (q64 @ ke.transpose(-1, -2)) * s
    S = apply_options(S_raw, causal, **options)
    vis = torch.isfinite(S)
    if sinks is not None:  # lse over [scores, sink]; the sink's value is zero, so nothing else changes
        sink = sinks.double().view(1, -1, 1, 1).expand(*S.shape[:-1], 1)
        lse = torch.logsumexp(torch.cat([S, sink], dim=-1), dim=-1, keepdim=True)
    else:
        lse = torch.logsumexp(S, dim=-1, keepdim=True)
    seen = torch.isfinite(lse)
    P = torch.where(seen & vis, torch.exp(S - torch.where(seen, lse, 0.0)), 0.0)
    O = P @ ve
    Di = (do64 * O).sum(-1, keepdim=True)
    if grad_lse is not None:
        Di = Di - torch.where(seen, grad_lse.double().unsqueeze(-1), 0.0)
    dP = do64 @ ve.transpose(-1, -2)
    dS = P * (dP - Di)
    softcap = options.get("softcap", 0.0)
    if softcap > 0:
        dS = dS * (1 - torch.tanh(S_raw / softcap) ** 2)
    dq = (dS @ ke) * s
    dk = (dS.transpose(-1, -2) @ q64) * s
    dv = P.transpose(-1, -2) @ do64
    B, Hkv, Nk, D = k.shape
    Dv = v.shape[-1]  # v's head dim (D_v; D unless MLA-style)
    dk = dk.view(B, Hkv, group, Nk, D).sum(2)
    dv = dv.view(B, Hkv, group, Nk, Dv).sum(2)
    if not bounds:
        return dq, dk, dv
    # The same sums taken over absolute values: what float32 rounding error
    # scales with. dS = P (dP - D) cancels (exactly, for a row with one
    # key), so the gradients can be far smaller than the terms their
    # rounding comes from; see gradient_tolerances.
    A = P * (do64.abs() @ ve.abs().transpose(-1, -2) + (do64 * O).abs().sum(-1, keepdim=True))
    bq = (A @ ke.abs()) * abs(s)
    bk = ((A.transpose(-1, -2) @ q64.abs()) * abs(s)).view(B, Hkv, group, Nk, D).sum(2)
    bv = (P.transpose(-1, -2) @ do64.abs()).view(B, Hkv, group, Nk, Dv).sum(2)
    return (dq, dk, dv), (bq, bk, bv)


def _same_dtype_gradients(q, k, v, grad_out, causal, scale, grad_lse, **options):
    """PyTorch's attention in the inputs' dtype, differentiated by autograd: the yardstick."""
    sinks = options.pop("sinks", None)
    qd, kd, vd = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ke, ve = _expand_kv(qd, kd, vd)
    S = apply_options((qd * _scale(q, scale)) @ ke.transpose(-1, -2), causal, **options)
    if sinks is not None:  # gpt-oss's eager form, differentiated
        Sx = torch.cat([S, sinks.to(S.dtype).view(1, -1, 1, 1).expand(*S.shape[:-1], 1)], dim=-1)
        P = torch.softmax(Sx.float(), dim=-1)[..., :-1].to(q.dtype)
        loss = ((P @ ve).float() * grad_out.float()).sum()
        if grad_lse is not None:
            loss = loss + (torch.logsumexp(Sx.float(), dim=-1) * grad_lse).sum()
        return torch.autograd.grad(loss, (qd, kd, vd))
    vis = torch.isfinite(S.detach())
    seen = vis.any(-1, keepdim=True)
    # Rows that see no key: scores 0 and P zeroed, so no NaN enters autograd.
    S = torch.where(seen, S, torch.zeros((), dtype=S.dtype))
    P = (torch.softmax(S.float(), dim=-1) * seen).to(q.dtype)
    loss = ((P @ ve).float() * grad_out.float()).sum()
    if grad_lse is not None:
        lse = torch.logsumexp(S.float(), dim=-1)
        loss = loss + torch.where(seen.squeeze(-1), lse * grad_lse, 0.0).sum()
    return torch.autograd.grad(loss, (qd, kd, vd))


def gradient_tolerances(q, k, v, grad_out, causal=False, scale=None, grad_lse=None, **options):
    """(reference gradients, tolerances) by FlashAttention's 2x rule, one per gradient.

    Each tolerance is twice the error of PyTorch's same-dtype attention
    backward against the float64 oracle, plus the rounding floor of the
    gradient's dtype and the float32 accumulation floor. That floor is taken
    from the magnitude of the terms summed (the same sums over absolute
    values), not of the gradient: dS = P (dP - D) subtracts two float32 dot
    products of size |dO| |V| that cancel exactly when a row sees one key,
    where PyTorch's softmax backward happens to be exact (P = 1) and a
    kernel that sums dP and D in different orders is not.
    Raises YardstickError if a tolerance would accept an all-zero gradient.
    """
    refs, bounds = reference_gradients(q, k, v, grad_out, causal, scale, grad_lse, bounds=True, **options)
    pts = _same_dtype_gradients(q, k, v, grad_out, causal, scale, grad_lse, **options)
    length = max(q.shape[2], k.shape[2], q.shape[3], v.shape[3])
    tols = []
    for ref, pt, bound in zip(refs, pts, bounds):
        err = (pt.double() - ref).abs().max().item() if ref.numel() else 0.0
        floor = rounding_floor(ref, q.dtype) + fp32_floor(bound, length)
        # A yardstick error as large as the gradient itself would pass an
        # all-zero result; unless the gradient is itself zero up to rounding
        # (grad_q with a single key: P = 1 whatever q is).
        mag = ref.abs().max().item() if ref.numel() else 0.0
        if not (mag <= floor or 2 * err < mag):
            raise YardstickError(f"yardstick error {err:.3g} vs max|gradient| {mag:.3g}: meaningless")
        tols.append(2 * err + floor)
    return refs, tols


_GRAD_NAMES = ("grad_q", "grad_k", "grad_v")


def gradient_errors(grads, q, k, v, grad_out, causal=False, scale=None, grad_lse=None, **options) -> List[Comparison]:
    """(grad_q, grad_k, grad_v) from a kernel vs the float64 oracle, by the 2x rule: one Comparison per check."""
    checks = []
    for name, g, like in zip(_GRAD_NAMES, grads, (q, k, v)):
        checks.append(_structural(f"{name} shape", g.shape == like.shape and g.dtype == like.dtype,
                                  f"{name}: {g.shape} {g.dtype}; expected {like.shape} {like.dtype}"))
    if not all(c.ok for c in checks):
        return checks
    for name, g in zip(_GRAD_NAMES, grads):
        checks.append(_structural(f"{name} finite", torch.isfinite(g).all(),
                                  f"{name} has NaN/inf: an element was never written, or the math broke"))
    refs, tols = gradient_tolerances(q, k, v, grad_out, causal, scale, grad_lse, **options)
    for name, g, ref, tol in zip(_GRAD_NAMES, grads, refs, tols):
        err = (g.double() - ref).abs().max().item() if ref.numel() else 0.0
        checks.append(_measured(name, err, tol))
    return checks


def assert_gradients_close(grads, q, k, v, grad_out, causal=False, scale=None, grad_lse=None, **options):
    """(grad_q, grad_k, grad_v) from a kernel vs the float64 oracle, by the 2x rule (raises NotClose)."""
    _raise_first(gradient_errors(grads, q, k, v, grad_out, causal, scale, grad_lse, **options))


# ---------------------------------------------------------------- varlen


def varlen_sequences(cu_seqlens_q, cu_seqlens_k):
    """[(q rows, k rows)] slices of each packed sequence."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(cq) - 1)]


def as_batch(t, rows):
    """Rows of a packed (total, H, D) tensor as a (1, H, n, D) view."""
    return t[rows].transpose(0, 1).unsqueeze(0)


def _prefixed(b, checks):
    return [c._replace(name=f"seq {b}: {c.name}") for c in checks]


def varlen_errors(out, lse, q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None,
                  **options) -> List[Comparison]:
    """attention_varlen's (out, lse) vs the float64 oracle, sequence by sequence, by the 2x rule.

    A sequence with no query rows has nothing to check; one with queries but
    no key must give zeros and lse = -inf. Names are prefixed "seq b: ".
    """
    want = q.shape[:-1] + v.shape[-1:]  # q's shape with v's head dim (D_v)
    checks = [
        _structural("out shape", out.shape == want and out.dtype == q.dtype,
                    f"out is {tuple(out.shape)} {out.dtype}; expected {tuple(want)} {q.dtype}"),
        _structural("lse shape", lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32,
                    f"lse is {tuple(lse.shape)} {lse.dtype}; expected {(q.shape[1], q.shape[0])} torch.float32"),
    ]
    if not all(c.ok for c in checks):
        return checks
    checks.append(_structural("NaN", not torch.isnan(out).any() and not torch.isnan(lse).any(),
                              "an element was never written"))
    for b, (qs, ks) in enumerate(varlen_sequences(cu_seqlens_q, cu_seqlens_k)):
        if qs.stop == qs.start:
            continue
        if ks.stop == ks.start:
            sinks = options.get("sinks")
            if sinks is None:
                ok = bool((out[qs] == 0).all() and torch.isneginf(lse[:, qs]).all())
            else:  # the rows attend to their head's sink alone
                want = sinks.float().view(-1, 1).expand(-1, qs.stop - qs.start)
                ok = bool((out[qs] == 0).all() and torch.allclose(lse[:, qs], want, rtol=1e-6, atol=1e-6))
            checks.append(_structural(f"seq {b}: no key", ok,
                                      f"seq {b} has no key: expected zeros and lse = -inf (with sinks: the sink)"))
            continue
        checks += _prefixed(b, attention_errors(as_batch(out, qs), lse[:, qs].unsqueeze(0), as_batch(q, qs),
                                                as_batch(k, ks), as_batch(v, ks), causal, scale, **options))
    return checks


def assert_varlen_close(out, lse, q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None, **options):
    """attention_varlen's (out, lse) vs the float64 oracle, sequence by sequence (raises NotClose)."""
    _raise_first(varlen_errors(out, lse, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, **options))


def varlen_gradient_errors(grads, q, k, v, grad_out, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None,
                           grad_lse=None, **options) -> List[Comparison]:
    """attention_varlen_backward's gradients vs the float64 oracle, sequence by sequence."""
    checks = []
    for name, g, like in zip(_GRAD_NAMES, grads, (q, k, v)):
        checks.append(_structural(f"{name} shape", g.shape == like.shape and g.dtype == like.dtype,
                                  f"{name}: {g.shape} {g.dtype}; expected {like.shape} {like.dtype}"))
        checks.append(_structural(f"{name} finite", g.shape == like.shape and torch.isfinite(g).all(),
                                  "a gradient has NaN/inf: an element was never written"))
    if not all(c.ok for c in checks):
        return checks
    for b, (qs, ks) in enumerate(varlen_sequences(cu_seqlens_q, cu_seqlens_k)):
        if qs.stop == qs.start or ks.stop == ks.start:
            # No query: k/v rows get zero gradient; no key: q rows do.
            ok = bool((grads[0][qs] == 0).all() and (grads[1][ks] == 0).all() and (grads[2][ks] == 0).all())
            checks.append(_structural(f"seq {b}: empty", ok, f"seq {b} is empty on one side: expected zero gradients"))
            continue
        glse = None if grad_lse is None else grad_lse[:, qs].unsqueeze(0)
        checks += _prefixed(b, gradient_errors(
            tuple(as_batch(g, r) for g, r in zip(grads, (qs, ks, ks))), as_batch(q, qs), as_batch(k, ks),
            as_batch(v, ks), as_batch(grad_out, qs), causal, scale, glse, **options,
        ))
    return checks


def assert_varlen_gradients_close(grads, q, k, v, grad_out, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None,
                                  grad_lse=None, **options):
    """attention_varlen_backward's gradients vs the float64 oracle, sequence by sequence (raises NotClose)."""
    _raise_first(varlen_gradient_errors(grads, q, k, v, grad_out, cu_seqlens_q, cu_seqlens_k, causal, scale,
                                        grad_lse, **options))
