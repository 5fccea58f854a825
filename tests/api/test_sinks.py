"""Attention sinks (issue 20, section 1): gpt-oss's per-head sink logit on the CPU and Metal kernels.

The sink is a virtual key per query head with logit sinks[h] and value zero:
the softmax runs over [scores, sink] and the sink's probability is dropped;
lse includes it. Checked against the float64 oracle (flash_metal.reference's
attention_reference with sinks, which concatenates the sink logit as gpt-oss's
eager code does) by the 2x rule, forward and backward, with every option;
grad_sinks against autograd through that oracle; a gradcheck; rows with every
key masked; the empty problem; validation. Then the Metal kernels through the
emulator (tests/backends.py's metal-emu backend): every forward family the
routing picks (prefill, one-pass decode, split decode) with each option, varlen,
and the backward's flash_sinks_grad, each with a check that the kernel ran
with fc_has_sinks.

Issue 41: each kernel's test stands on its own (the backward's out and lse
come from the float64 oracle, never from another kernel under test) and
reaches past 32 query rows per head: the prefill 37 rows, the backward 2 x 37
= 74 rows per head (so flash_sinks_grad's lanes each sum rows i, i + 32,
i + 64, and rows 16-31 sit in the upper half of the SIMD-group), varlen a
37-row sequence among one-token, no-query and no-key ones (the decode
kernels serve at most 8 query rows by design: kMaxDecodeRows). The
backward reads out and grad_out strided, each in a layout of its own (out a
slice of a larger buffer, grad_out transposed), and the autograd test takes
grad_out through a transposed view, as a model's loss does; the backward
tests run on the cpu and metal-emu backends alike (tests/backends.py).
Planted, each run against this file and reverted: flash_sinks_grad without
its `simd_shuffle_xor(sum, 16)` (the lane sums of rows 16-31 dropped) fails
test_backward_kernels_match_oracle[metal-emu-*] (all four),
test_varlen_forward_and_backward[metal-emu] and
test_metal_sinks_sanitized[prefill]; the CPU's head_sum reading out with
grad_out's row stride (csrc/cpu/sinks_cpu.cpp) fails
test_backward_kernels_match_oracle[cpu-*], test_backward_matches_oracle (all
18), test_autograd_with_strided_grad_out and
test_varlen_forward_and_backward[cpu]. (The audit found both escaping this
file's earlier tests: 13 rows at most, out and grad_out packed alike.)
Small ragged shapes: the whole file takes ~20 s (plus the emulator's
library builds when no earlier test made them).
"""
import zlib

import pytest
import torch

import flash_metal
from flash_metal import reference as R
from flash_metal import testing as T
import backends
from backends import LAST_DISPATCHES, emulated_metal_attention, emulated_metal_attention_backward
from numerics import (DTYPES, assert_attention_close, assert_gradients_close, assert_varlen_close,
                      assert_varlen_gradients_close, dtype_id, lay_out, make_qkv)


def _gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _sinks(h, dtype, g):
    # Logits around the scores' size (|s| ~ 1-3 at scale 1/sqrt(D)), so the
    # sink takes a real share of each row: a sink ignored, or counted twice,
    # moves out and lse far beyond the tolerance.
    return (torch.randn(h, generator=g) * 1.5 + 0.5).to(dtype)


def _bool_mask(B, nq, nk, g):
    # Random key padding with rows 0 and 3 of batch 0 fully masked (they
    # attend to the sink only).
    m = torch.rand(B, 1, nq, nk, generator=g) > 0.3
    m[0, 0, 0] = False
    m[0, 0, min(3, nq - 1)] = False
    return m


# (name, causal, options builder): each option the ops take, with sinks.
CONFIGS = {
    "plain": (False, lambda B, nq, nk, g, dt: {}),
    "causal": (True, lambda B, nq, nk, g, dt: {}),
    "window": (True, lambda B, nq, nk, g, dt: dict(window_left=4)),
    "softcap": (False, lambda B, nq, nk, g, dt: dict(softcap=2.0)),
    "bool_mask": (False, lambda B, nq, nk, g, dt: dict(attn_mask=_bool_mask(B, nq, nk, g))),
    "additive_mask": (True, lambda B, nq, nk, g, dt: dict(attn_mask=torch.randn(1, 4, nq, nk, generator=g).to(dt))),
}


def _case(dtype, config, nq=37, nk=45):
    g = _gen(str(dtype), config, nq, nk)
    q, k, v = make_qkv(2, 4, 2, nq, nk, 32, dtype, generator=g)  # GQA 4:2, ragged lengths
    causal, build = CONFIGS[config]
    return g, q, k, v, causal, build(2, nq, nk, g, dtype)


@pytest.mark.parametrize("sinks_dtype", ["float32", "input"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_forward_matches_oracle(dtype, config, sinks_dtype):
    g, q, k, v, causal, options = _case(dtype, config)
    sinks = _sinks(4, torch.float32 if sinks_dtype == "float32" else dtype, g)
    out, lse = flash_metal.attention_with_lse(q, k, v, causal, sinks=sinks, **options)
    assert_attention_close(out, lse, q, k, v, causal, None, sinks=sinks, **options)
    # The sink really entered: without it, lse is lower by log1p(exp(sink - lse_nosink)) > 0 on every row.
    _, lse0 = flash_metal.attention_with_lse(q, k, v, causal, **options)
    fin = torch.isfinite(lse0)
    assert (lse[fin] > lse0[fin]).all()
    if config == "bool_mask":  # fully masked rows: zeros, lse = the sink, no NaN
        assert (out[0, :, [0, 3]] == 0).all()
        torch.testing.assert_close(lse[0, :, [0, 3]], sinks.float()[:, None].expand(4, 2), rtol=1e-6, atol=1e-6)


def _backward_inputs(q, k, v, sinks, causal, options, g):
    """out (q's dtype) and lse (float32) from the float64 oracle, as a forward kernel stores them but from no
    kernel under test; grad_out and grad_lse random. out and grad_out come back strided, each in its own
    layout: out a slice of a larger NaN-filled buffer, grad_out transposed (issue 41: a kernel that reads one
    with the other's strides, or assumes packed rows, fails)."""
    o, l_ = R.attention_reference(q, k, v, causal, None, sinks=sinks, **options)
    out, lse = o.to(q.dtype), l_.float()
    grad_out = torch.randn(out.shape, generator=g).to(q.dtype)
    grad_lse = torch.randn(lse.shape, generator=g)
    return lay_out(out, "offset_slice"), lse, lay_out(grad_out, "transposed"), grad_lse


def _sinks_grad_reference(q, k, v, sinks, grad_out, grad_lse, causal, options):
    """grad_sinks by autograd through the float64 oracle (the sink concatenated as a logit), and the
    same sum over absolute values (what its float32 rounding scales with)."""
    s64 = sinks.detach().double().requires_grad_(True)
    out, lse = R.attention_reference(q, k, v, causal, None, sinks=s64, **options)
    loss = (out * grad_out.double()).sum() + (lse * grad_lse.double()).sum()
    (ref,) = torch.autograd.grad(loss, s64)
    p_sink = torch.exp(s64.detach().view(1, -1, 1) - lse.detach())
    bound = (p_sink * (grad_lse.double().abs() + (grad_out.double() * out.detach()).abs().sum(-1))).sum((0, 2))
    return ref, bound


def _sinks_grad_yardstick(q, k, v, sinks, grad_out, grad_lse, causal, options):
    # gpt-oss's eager attention in the inputs' dtype (softmax in float32),
    # differentiated: the 2x rule's yardstick for grad_sinks.
    s = sinks.detach().to(q.dtype).requires_grad_(True)
    ke, ve = T._expand_kv(q, k, v)
    S = R.apply_options((q * T._scale(q, None)) @ ke.transpose(-1, -2), causal, **options)
    Sx = torch.cat([S, s.view(1, -1, 1, 1).expand(*S.shape[:-1], 1)], dim=-1)
    P = torch.softmax(Sx.float(), dim=-1)[..., :-1].to(q.dtype)
    loss = ((P @ ve).float() * grad_out.float()).sum() + (torch.logsumexp(Sx.float(), -1) * grad_lse).sum()
    (pt,) = torch.autograd.grad(loss, s)
    return pt


def assert_sinks_grad_close(grad_sinks, q, k, v, sinks, grad_out, grad_lse, causal, options):
    assert grad_sinks.shape == sinks.shape and grad_sinks.dtype == sinks.dtype
    assert torch.isfinite(grad_sinks).all()
    ref, bound = _sinks_grad_reference(q, k, v, sinks, grad_out, grad_lse, causal, options)
    pt = _sinks_grad_yardstick(q, k, v, sinks, grad_out, grad_lse, causal, options)
    rows = q.shape[0] * q.shape[2]
    tol = (2 * (pt.double() - ref).abs().max().item() + T.rounding_floor(ref, sinks.dtype)
           + T.fp32_floor(bound, rows))
    err = (grad_sinks.double() - ref).abs().max().item()
    assert err <= tol, f"grad_sinks: error {err:.3g} > tolerance {tol:.3g} (max|ref| {ref.abs().max().item():.3g})"
    assert tol < ref.abs().max().item(), "the tolerance would pass an all-zero grad_sinks"


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_backward_matches_oracle(dtype, config):
    # The CPU backward, every dtype and option: 2 x 37 rows per head, strided out and grad_out.
    g, q, k, v, causal, options = _case(dtype, config)
    sinks = _sinks(4, torch.float32, g)
    out, lse, grad_out, grad_lse = _backward_inputs(q, k, v, sinks, causal, options, g)
    assert out.stride() != grad_out.stride() and not out.is_contiguous()
    grads = torch.ops.flash_metal.attention_backward(grad_out, q, k, v, out, lse, causal, None, grad_lse, "auto",
                                                     sinks=sinks, **options)
    assert_gradients_close(grads[:3], q, k, v, grad_out, causal, None, grad_lse, sinks=sinks, **options)
    assert_sinks_grad_close(grads[3], q, k, v, sinks, grad_out, grad_lse, causal, options)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_autograd_with_strided_grad_out(dtype):
    # The user's path: flash_metal.attention's autograd, the loss taken through a transposed view of out, as a
    # model's (B, N, H, D) reshape does, so the backward gets grad_out in other strides than out.
    g, q, k, v, causal, options = _case(dtype, "causal")
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, _sinks(4, torch.float32, g))]
    out, lse = flash_metal.attention_with_lse(*leaves[:3], causal, sinks=leaves[3], **options)
    weight = torch.randn(out.transpose(1, 2).shape, generator=g).to(dtype)  # (B, N, H, D), contiguous
    grad_lse = torch.randn(lse.shape, generator=g)
    ((out.transpose(1, 2).float() * weight.float()).sum() + (lse * grad_lse).sum()).backward()
    grad_out = weight.transpose(1, 2)
    assert_gradients_close([t.grad for t in leaves[:3]], q, k, v, grad_out, causal, None, grad_lse,
                           sinks=leaves[3].detach(), **options)
    assert_sinks_grad_close(leaves[3].grad, q, k, v, leaves[3].detach(), grad_out, grad_lse, causal, options)


def test_backward_is_deterministic_and_uses_grad_lse():
    g, q, k, v, causal, options = _case(torch.float32, "causal", nq=200, nk=230)
    sinks = _sinks(4, torch.float32, g)
    out, lse = flash_metal.attention_with_lse(q, k, v, causal, sinks=sinks)
    grad_out = torch.randn(out.shape, generator=g)
    grad_lse = torch.randn(lse.shape, generator=g)
    bwd = torch.ops.flash_metal.attention_backward
    args = (grad_out, q, k, v, out, lse, causal, None, grad_lse, "auto")
    first, again = bwd(*args, sinks=sinks), bwd(*args, sinks=sinks)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    # grad_lse enters grad_sinks as + sum P_sink * grad_lse: without it the result differs by exactly that.
    no_glse = bwd(grad_out, q, k, v, out, lse, causal, None, None, "auto", sinks=sinks)[3]
    p_sink = torch.exp(sinks.double().view(1, -1, 1) - lse.double())
    torch.testing.assert_close((first[3] - no_glse).double(), (p_sink * grad_lse.double()).sum((0, 2)),
                               rtol=1e-4, atol=1e-4)
    # Without sinks the fourth output is an empty float32 tensor.
    assert bwd(*args)[3].shape == (0,)


@pytest.mark.filterwarnings("ignore:Input #.* is not a double precision:UserWarning")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradcheck(causal):
    # float32, as tests/api/test_backward.py's gradcheck (no float64 kernel):
    # eps = 1e-2 central differences; a missing or doubled sink term is off by O(1).
    g = _gen("gradcheck", causal)
    q, k, v = (t.requires_grad_(True) for t in make_qkv(1, 4, 2, 5, 7, 8, torch.float32, generator=g))
    sinks = _sinks(4, torch.float32, g).requires_grad_(True)

    def fn(q, k, v, s):
        return flash_metal.attention_with_lse(q, k, v, causal=causal, window_left=3, sinks=s)

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks), eps=1e-2, atol=2e-3, rtol=2e-3, nondet_tol=0.0)


def test_reference_sinks_gradient_in_float64():
    # The oracle's own sinks gradient (autograd through the concatenated
    # logit) against central differences, in float64.
    g = _gen("ref-gradcheck")
    q, k, v = make_qkv(1, 2, 1, 3, 4, 4, torch.float64, generator=g)
    sinks = torch.randn(2, generator=g, dtype=torch.float64).requires_grad_(True)
    mask = torch.tensor([[True, True, False, True], [False] * 4, [True] * 4]).view(1, 1, 3, 4)
    assert torch.autograd.gradcheck(lambda s: R.attention_reference(q, k, v, False, None, attn_mask=mask, sinks=s),
                                    (sinks,))


@pytest.mark.parametrize("backend", [backends.backend_param("cpu"), backends.backend_param("metal-emu")])
def test_varlen_forward_and_backward(backend):
    # Packed sequences: one-token, no-query and no-key sequences (a no-key sequence's rows: out 0, lse = the
    # sink) and one of 37 rows (past a SIMD-group's 32), a window and softcap; forward and backward (grad_sinks
    # included) against the float64 oracle, the backward's out and lse the oracle's, out and grad_out strided.
    g = _gen("varlen", backend)
    lq, lk = [5, 1, 0, 37, 3], [9, 1, 4, 40, 0]
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lq), 4, 16, generator=g)
    k = torch.randn(sum(lk), 2, 16, generator=g)
    v = torch.randn(sum(lk), 2, 16, generator=g)
    sinks = _sinks(4, torch.float32, g)
    options = dict(window_left=3, softcap=3.0)
    args = (cu_q, cu_k, max(lq), max(lk), True, None)
    out, lse = backends.run_varlen(backend, q, k, v, *args, sinks=sinks, **options)
    if backend == "metal-emu":
        (d,) = _ran_with_sinks(("flash_attention_prefill_",))
        assert d.function_constants[9]  # fc_varlen
    assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, True, None, sinks=sinks, **options)
    # The no-key sequence: lse is the sink (Metal: exactly; the CPU forms ln 2 * (sink * log2 e), within an ulp).
    ulp = 0.0 if backend == "metal-emu" else 2 ** -23
    torch.testing.assert_close(lse[:, -3:], sinks.view(4, 1).expand(4, 3), rtol=ulp, atol=0)
    ref_out, ref_lse = R.attention_varlen_reference(q, k, v, cu_q, cu_k, True, None, sinks=sinks, **options)
    T_, H = q.shape[:2]
    out_s = torch.full((T_, H + 1, 19), float("nan"))[:, 1:, 2:18]  # a slice of a larger buffer
    out_s.copy_(ref_out.float())
    weight = torch.randn(H, T_, 16, generator=g)
    grad_out = weight.transpose(0, 1)  # (total, H, D) viewed from an (H, total, D) buffer
    grad_lse = torch.randn(H, T_, generator=g)
    grads = backends.run_varlen_backward(backend, grad_out, q, k, v, out_s, ref_lse.float(), *args, grad_lse,
                                         sinks=sinks, **options)
    if backend == "metal-emu":
        assert LAST_DISPATCHES[-1][0].kernel_name == "flash_sinks_grad" and LAST_DISPATCHES[-1][0].function_constants[9]
    assert_varlen_gradients_close(grads[:3], q, k, v, grad_out, cu_q, cu_k, True, None, grad_lse, sinks=sinks,
                                  **options)
    s64 = sinks.double().requires_grad_(True)
    ro, rl = R.attention_varlen_reference(q, k, v, cu_q, cu_k, True, None, sinks=s64, **options)
    (ref,) = torch.autograd.grad((ro * grad_out.double()).sum() + (rl * grad_lse.double()).sum(), s64)
    assert grads[3].shape == (4,) and ref.abs().max() > 0.05
    torch.testing.assert_close(grads[3].double(), ref, rtol=1e-4, atol=1e-4)


def test_empty_problem():
    # Nk = 0: every row attends to its sink alone (out 0, lse = sink); grad_sinks = sum of grad_lse.
    q = torch.randn(2, 4, 3, 8)
    k = v = torch.randn(2, 2, 0, 8)
    sinks = torch.randn(4).requires_grad_(True)
    out, lse = flash_metal.attention_with_lse(q, k, v, sinks=sinks)
    assert (out == 0).all()
    torch.testing.assert_close(lse, sinks.detach().view(1, 4, 1).expand(2, 4, 3))
    grad_lse = torch.randn(lse.shape)
    (lse * grad_lse).sum().backward()
    torch.testing.assert_close(sinks.grad, grad_lse.sum((0, 2)))


def test_opcheck():
    g = _gen("opcheck")
    q, k, v = make_qkv(1, 4, 2, 6, 9, 16, torch.float32, generator=g)
    sinks = _sinks(4, torch.float32, g)
    fwd = torch.ops.flash_metal.attention_forward.default
    torch.library.opcheck(fwd, (q, k, v, True, None, "auto"), {"sinks": sinks})
    out, lse = torch.ops.flash_metal.attention_forward(q, k, v, True, sinks=sinks)
    grad_out = torch.randn(out.shape, generator=g)
    torch.library.opcheck(torch.ops.flash_metal.attention_backward.default,
                          (grad_out, q, k, v, out, lse, True, None, torch.randn(lse.shape, generator=g), "auto"),
                          {"sinks": sinks})


@pytest.mark.parametrize("bad,exc,pattern", [
    (torch.zeros(3), ValueError, r"sinks must be 1-D of shape \(q_heads,\) = \(4,\)"),
    (torch.zeros(1, 4), ValueError, r"sinks must be 1-D"),
    (torch.zeros(4, dtype=torch.float64), TypeError, r"sinks must be float32 or q's dtype"),
    (torch.zeros(4, device="meta"), ValueError, r"sinks is on device meta"),
], ids=["shape", "rank", "dtype", "device"])
def test_bad_sinks_are_named(bad, exc, pattern):
    q = torch.randn(1, 4, 3, 8, dtype=torch.float16)
    k = v = torch.randn(1, 2, 5, 8, dtype=torch.float16)
    # A meta-device sinks would send the op to its fake (meta) kernel; the
    # planner (CompositeExplicitAutograd) runs the same C++ checks on it.
    call = flash_metal.explain if bad.device.type == "meta" else flash_metal.attention
    with pytest.raises(exc, match=pattern):
        call(q, k, v, sinks=bad)


def test_post_kernels_refuse_sinks():
    # The seed post's two kernels serve plain or causal attention only: sinks
    # are refused with the allowed impls named, never dropped.
    q = torch.randn(1, 4, 16, 64, dtype=torch.float16)
    k = v = torch.randn(1, 2, 16, 64, dtype=torch.float16)
    for impl in ("untiled", "tiled"):
        with pytest.raises(ValueError, match=r"impl='%s'.*sinks need impl='auto', 'prefill'" % impl):
            flash_metal.explain(q, k, v, impl=impl, sinks=torch.zeros(4))
    with pytest.raises(ValueError, match=r"sinks must be 1-D"):  # validated as the ops do
        flash_metal.explain(q, k, v, sinks=torch.zeros(3))


# ---- the Metal kernels, through the emulator ---------------------------------------------

SINKS = 11  # fc_has_sinks (kSinksFunctionConstant in csrc/metal/plan.h)

# Each forward family the routing picks: (impl, Nq, Nk, the kernels that must run with fc_has_sinks).
# decode: Nq = 1 with GQA 2 is one row group, so 8 key groups whose states the
# kernel merges (only key group 0 may carry the sink); split: Nk = 70 cut into
# 2 key blocks, both with keys (only split 0 may carry it).
FAMILIES = {
    "prefill": ("auto", 37, 45, ("flash_attention_prefill_",)),  # 37 rows: two query blocks, the second ragged
    "decode": ("auto", 1, 21, ("flash_decode_",)),
    "split": ("decode_split", 4, 70, ("flash_decode_split_",)),
}


def _ran_with_sinks(prefixes):
    ran = [d for d, _ in LAST_DISPATCHES]
    assert [d.kernel_name for d in ran][:len(prefixes)] and all(
        d.kernel_name.startswith(p) for d, p in zip(ran, prefixes)), [d.kernel_name for d in ran]
    assert all(d.function_constants[SINKS] for d in ran[:len(prefixes)])
    return ran


def _fully_masked_rows(options, q):
    mask = options.get("attn_mask")
    if mask is None or mask.dtype != torch.bool:
        return None
    return ~mask.expand(q.shape[0], q.shape[1], q.shape[2], mask.shape[-1]).any(-1)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_metal_forward_matches_oracle(family, config):
    impl, nq, nk, kernels = FAMILIES[family]
    n = list(FAMILIES).index(family) + list(CONFIGS).index(config)
    dtype = DTYPES[n % len(DTYPES)]  # each dtype on every family, without the full cross product
    g, q, k, v, causal, options = _case(dtype, config, nq, nk)
    sinks = _sinks(4, torch.float32 if n % 2 else dtype, g)
    if config == "plain":
        sinks[1] = float("-inf")  # a sink of -inf is no sink (the state stays "no key yet")
    out, lse = emulated_metal_attention(q, k, v, causal, None, impl, sinks=sinks, **options)
    ran = _ran_with_sinks(kernels)
    if family == "split":
        assert len(ran) == 2 and ran[0].grid[2] == 2  # two key blocks, then the merge
    assert_attention_close(out, lse, q, k, v, causal, None, sinks=sinks, **options)
    rows = _fully_masked_rows(options, q)
    if rows is not None:  # every key masked: zeros and lse = the sink, no NaN
        assert rows.any()
        assert (out[rows] == 0).all()
        want = sinks.float().view(1, -1, 1).expand_as(lse)[rows]
        torch.testing.assert_close(lse[rows], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("config", ["plain", "bool_mask", "softcap", "window"])
@pytest.mark.parametrize("backend", [backends.backend_param("cpu"), backends.backend_param("metal-emu")])
def test_backward_kernels_match_oracle(backend, config):
    # Each backend's backward kernels with sinks: on Metal the dQ and dK/dV kernels (lse holds the sink) and
    # flash_sinks_grad (-sum exp(sink - lse) * Delta per head). GQA, 2 x 37 rows per head, ragged keys, fully
    # masked rows (bool_mask), out and grad_out strided, out and lse the oracle's. On Metal a shuffled thread
    # schedule gives the same bits (fixed-order sums, no atomics).
    dtype = DTYPES[list(CONFIGS).index(config) % len(DTYPES)]
    g, q, k, v, causal, options = _case(dtype, config)
    sinks = _sinks(4, torch.float32, g)
    out, lse, grad_out, grad_lse = _backward_inputs(q, k, v, sinks, causal, options, g)
    args = (grad_out, q, k, v, out, lse, causal, None, grad_lse)
    grads = backends.run_backward(backend, *args, sinks=sinks, **options)
    if backend == "metal-emu":
        assert [d.kernel_name.split("_")[1] for d, _ in LAST_DISPATCHES] == ["backward", "backward", "sinks"]
    assert_gradients_close(grads[:3], q, k, v, grad_out, causal, None, grad_lse, sinks=sinks, **options)
    assert_sinks_grad_close(grads[3], q, k, v, sinks, grad_out, grad_lse, causal, options)
    if config == "plain" and backend == "metal-emu":
        again = emulated_metal_attention_backward(*args, sinks=sinks, seed=7, **options)
        assert all(torch.equal(a, b) for a, b in zip(grads, again))


@pytest.mark.parametrize("family", ["prefill", "split"])
def test_metal_sinks_sanitized(family):
    # fc_has_sinks under the emulator's sanitizers (races, barriers, exact
    # bounds: the sinks buffer is Hq floats), with fully masked rows; the
    # prefill case also runs the backward, flash_sinks_grad included.
    impl, nq, nk, kernels = FAMILIES[family]
    if family == "prefill":  # sanitized runs are slow: past 32 rows (33), few keys
        nq, nk = 33, 21
    g, q, k, v, causal, options = _case(torch.float16, "bool_mask", nq, nk)
    sinks = _sinks(4, torch.float32, g)
    out, lse = emulated_metal_attention(q, k, v, causal, None, impl, instrumented=True, sinks=sinks, **options)
    _ran_with_sinks(kernels)
    assert LAST_DISPATCHES[0][1].device_bytes_read_by_index[17] > 0  # the kernel read the sinks
    assert_attention_close(out, lse, q, k, v, causal, None, sinks=sinks, **options)
    # Without sinks the same pipeline family never touches buffer 17 (q is bound there, unread).
    emulated_metal_attention(q, k, v, causal, None, impl, instrumented=True, **options)
    assert not LAST_DISPATCHES[0][0].function_constants[SINKS]
    assert LAST_DISPATCHES[0][1].device_bytes_read_by_index[17] == 0
    if family == "prefill":
        grad_out = torch.randn(out.shape, generator=g).half()
        grad_lse = torch.randn(lse.shape, generator=g)
        grads = emulated_metal_attention_backward(grad_out, q, k, v, out, lse, causal, None, grad_lse,
                                                  instrumented=True, sinks=sinks, **options)
        assert LAST_DISPATCHES[-1][0].kernel_name == "flash_sinks_grad"
        assert_sinks_grad_close(grads[3], q, k, v, sinks, grad_out, grad_lse, causal, options)


@pytest.mark.parametrize("family", ["prefill", "decode"])
def test_metal_sinks_fast_math(family):
    # The shaders built with -ffast-math (tests/metal/test_fast_math.py: the
    # compiler may assume no infinity): rows with every key masked still give
    # zeros and lse = the sink, and a -inf sink still means "no sink"
    # (seed_sink compares with the finite kMaskedScore; with causal rows
    # that all see keys, as a row with neither keys nor sink has no reference).
    impl, nq, nk, kernels = FAMILIES[family]
    for config in ("bool_mask", "causal"):
        g, q, k, v, causal, options = _case(torch.float32, config, nq, nk)
        sinks = _sinks(4, torch.float32, g)
        if config == "causal":
            sinks[2] = float("-inf")
        out, lse = emulated_metal_attention(q, k, v, causal, None, impl, fast_math=True, sinks=sinks, **options)
        _ran_with_sinks(kernels)
        assert_attention_close(out, lse, q, k, v, causal, None, sinks=sinks, **options)
        rows = _fully_masked_rows(options, q)
        if rows is not None:
            assert rows.any() and (out[rows] == 0).all()
            torch.testing.assert_close(lse[rows], sinks.view(1, -1, 1).expand_as(lse)[rows], rtol=1e-6, atol=1e-6)
