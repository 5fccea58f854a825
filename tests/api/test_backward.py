"""attention_backward and the autograd formula, on every backend.

Gradients are checked against the float64 oracle (numerics.reference_gradients,
itself checked against autograd here) by FlashAttention's 2x rule. Each
backend runs the same grid: "cpu" (the C++ kernel), "metal-emu" (the Metal
backward kernels through the emulator, with the host's own plan) and "mps"
(a Mac; skipped elsewhere). The forward's out and lse come from the same
backend, so every case is forward + backward end to end. Gradients are
freshly allocated (NaN-poisoned by conftest.py on the C++ path, by
backends.py on the emulator), so an element never written fails.
"""
import pytest
import torch

import flash_metal
from backends import backend_param, run_attention, run_backward
from flash_metal.reference import attention_reference
from numerics import DTYPES, assert_gradients_close, dtype_id, lay_out, make_qkv, make_tensor, reference_gradients

BACKENDS = [backend_param(b) for b in ("cpu", "metal-emu", "mps")]
HEAD_DIMS = [1, 64, 80, 128, 256]
# (Nq, Nk) pairs straddling block edges, both ways round: one row, one key,
# lengths just off a multiple of 8/16/32/64, and Nq > Nk (with causal, the
# first Nq - Nk rows see no key and must get zero gradient).
_PAIRS = [(1, 1), (1, 100), (63, 65), (130, 77)]
SEQ_PAIRS = sorted(set(_PAIRS + [(b, a) for a, b in _PAIRS]))


def _forward_backward(backend, q, k, v, causal, scale=None, grad_lse=None, generator=None):
    out, lse = run_attention(backend, q, k, v, causal, scale)
    g = generator if generator is not None else torch.Generator().manual_seed(7)
    grad_out = make_tensor(q.shape, "contiguous", q.dtype, g)
    grads = run_backward(backend, grad_out, q, k, v, out, lse, causal, scale, grad_lse)
    return grad_out, grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk", SEQ_PAIRS, ids=[f"{a}x{b}" for a, b in SEQ_PAIRS])
@pytest.mark.parametrize("d", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gradient_shapes(backend, dtype, d, nq, nk, causal):
    g = torch.Generator().manual_seed(1000 * d + 7 * nq + nk + causal)
    q, k, v = make_qkv(1, 1, 1, nq, nk, d, dtype, generator=g)
    grad_out, grads = _forward_backward(backend, q, k, v, causal, generator=g)
    assert_gradients_close(grads, q, k, v, grad_out, causal)


HEADS = {"mha": (4, 4), "gqa4": (8, 2), "mqa": (4, 1)}
# (heads, layout) pairs as in test_attention.py: every layout meets some head
# configuration (every_other and d_outer have a feature stride other than 1).
HEAD_LAYOUTS = [("mha", "contiguous"), ("gqa4", "transposed"), ("mqa", "offset_slice"),
                ("gqa4", "every_other"), ("mqa", "d_outer"), ("mha", "storage_end_bnhd")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads,layout", HEAD_LAYOUTS, ids=[f"{h}-{lay}" for h, lay in HEAD_LAYOUTS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_heads_and_layouts(backend, dtype, causal, heads, layout):
    hq, hkv = HEADS[heads]
    g = torch.Generator().manual_seed(HEAD_LAYOUTS.index((heads, layout)) + 10 * causal)
    q, k, v = make_qkv(2, hq, hkv, 37, 45, 64, dtype, layout=layout, generator=g)
    out, lse = run_attention(backend, q, k, v, causal)
    # grad_out and out in layouts of their own too: the backward reads both through their strides.
    grad_out = make_tensor(q.shape, "every_other" if layout != "every_other" else "transposed", dtype, g)
    out = lay_out(out, layout)
    grads = run_backward(backend, grad_out, q, k, v, out, lse, causal)
    assert_gradients_close(grads, q, k, v, grad_out, causal)
    for grad, like in zip(grads, (q, k, v)):
        assert grad.is_contiguous() and grad.shape == like.shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_grad_lse(backend, dtype, causal):
    # A loss that uses lse too (e.g. a z-loss, or merging attention over
    # several key sets): its gradient enters as Delta - grad_lse.
    g = torch.Generator().manual_seed(31 + causal)
    q, k, v = make_qkv(1, 4, 2, 50, 40, 32, dtype, generator=g)
    grad_lse = torch.randn(1, 4, 50, generator=g)
    grad_out, grads = _forward_backward(backend, q, k, v, causal, grad_lse=grad_lse, generator=g)
    assert_gradients_close(grads, q, k, v, grad_out, causal, grad_lse=grad_lse)
    # It matters: without it the gradients differ.
    refs = reference_gradients(q, k, v, grad_out, causal)
    assert (grads[0].double() - refs[0]).abs().max() > 10 * (grads[0].double() - reference_gradients(
        q, k, v, grad_out, causal, grad_lse=grad_lse)[0]).abs().max()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_deterministic(backend, dtype):
    # Bitwise-equal gradients run after run: no atomics, no order that
    # depends on scheduling. GQA, so grad_k/grad_v reduce over query heads.
    g = torch.Generator().manual_seed(5)
    q, k, v = make_qkv(2, 8, 2, 100, 130, 64, dtype, generator=g)
    out, lse = run_attention(backend, q, k, v, True)
    grad_out = torch.randn(q.shape, generator=g).to(dtype)
    first = run_backward(backend, grad_out, q, k, v, out, lse, True)
    for _ in range(2):
        again = run_backward(backend, grad_out, q, k, v, out, lse, True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("scale", [None, 0.05, 1.7])
def test_scale(scale):
    g = torch.Generator().manual_seed(3)
    q, k, v = make_qkv(1, 2, 2, 40, 33, 48, torch.float32, generator=g)
    grad_out, grads = _forward_backward("cpu", q, k, v, True, scale, generator=g)
    assert_gradients_close(grads, q, k, v, grad_out, True, scale)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("with_lse", [False, True], ids=["out", "out+lse"])
def test_oracle_matches_autograd(causal, with_lse):
    # The oracle is written from the formulas; float64 autograd through the
    # forward oracle must agree with it (rows with no visible key excluded
    # from autograd's view: their lse is -inf and autograd's gradient there
    # is NaN, the oracle's is zero by contract).
    g = torch.Generator().manual_seed(11)
    q, k, v = (t.double().requires_grad_(True) for t in make_qkv(2, 4, 2, 23, 31, 16, torch.float32, generator=g))
    out, lse = attention_reference(q, k, v, causal)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grad_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64) if with_lse else None
    loss = (out * grad_out).sum() + ((lse * grad_lse).sum() if with_lse else 0.0)
    auto = torch.autograd.grad(loss, (q, k, v))
    ours = reference_gradients(q.detach(), k.detach(), v.detach(), grad_out, causal, None, grad_lse)
    for a, b in zip(auto, ours):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------ autograd


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_autograd_through_attention(dtype, causal):
    # flash_metal.attention with requires_grad inputs in a (B, N, H, D)
    # layout: gradients arrive in each input's own shape.
    g = torch.Generator().manual_seed(17)
    B, N, M, Hq, Hkv, D = 2, 33, 47, 6, 2, 40
    qb = torch.randn(B, N, Hq, D, generator=g).to(dtype).requires_grad_(True)
    kb = torch.randn(B, M, Hkv, D, generator=g).to(dtype).requires_grad_(True)
    vb = torch.randn(B, M, Hkv, D, generator=g).to(dtype).requires_grad_(True)
    q, k, v = (t.transpose(1, 2) for t in (qb, kb, vb))
    out = flash_metal.attention(q, k, v, causal=causal)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(grad_out)
    assert qb.grad.shape == qb.shape and kb.grad.shape == kb.shape and vb.grad.shape == vb.shape
    grads = tuple(t.grad.transpose(1, 2) for t in (qb, kb, vb))
    assert_gradients_close(grads, q.detach(), k.detach(), v.detach(), grad_out, causal)


def test_autograd_lse_only_and_both():
    # A loss on lse alone (torch hands the formula zeros for grad_out) and on both outputs.
    g = torch.Generator().manual_seed(19)
    q, k, v = (t.requires_grad_(True) for t in make_qkv(1, 2, 1, 20, 25, 32, torch.float32, generator=g))
    out, lse = flash_metal.attention_with_lse(q, k, v, causal=True)
    w = torch.randn(lse.shape, generator=g)
    grads = torch.autograd.grad((lse * w).sum(), (q, k, v))
    zero = torch.zeros_like(q)
    assert_gradients_close(grads, q.detach(), k.detach(), v.detach(), zero, True, grad_lse=w)

    out, lse = flash_metal.attention_with_lse(q, k, v)
    wo = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * wo).sum() + (lse * w).sum(), (q, k, v))
    assert_gradients_close(grads, q.detach(), k.detach(), v.detach(), wo, False, grad_lse=w)


def test_single_head_2d_inputs():
    g = torch.Generator().manual_seed(23)
    q, k, v = (torch.randn(n, 16, generator=g).requires_grad_(True) for n in (12, 9, 9))
    flash_metal.attention(q, k, v, causal=True).square().sum().backward()
    ref = [t.detach().clone().double().requires_grad_(True) for t in (q, k, v)]
    o, _ = attention_reference(*(t[None, None] for t in ref), causal=True)
    o[0, 0].square().sum().backward()
    for t, r in zip((q, k, v), ref):
        assert t.grad.shape == t.shape
        torch.testing.assert_close(t.grad.double(), r.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:Input #.* is not a double precision:UserWarning")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (3, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("nq,nk", [(5, 5), (4, 7), (7, 4)], ids=["5x5", "4x7", "7x4"])
def test_gradcheck(nq, nk, heads, causal):
    # The kernels compute in float32 by design (no float64 kernel exists), so
    # gradcheck runs in float32: central differences with eps = 1e-2 on
    # inputs of size ~1 are accurate to ~eps^2 in truncation and ~1e-7/eps in
    # rounding, both well inside atol = rtol = 2e-3; a wrong term (a missing
    # Delta, a transposed dS, a GQA head summed twice) is off by O(1).
    g = torch.Generator().manual_seed(nq * 10 + nk)
    q, k, v = (t.requires_grad_(True) for t in make_qkv(1, heads[0], heads[1], nq, nk, 8, torch.float32, generator=g))
    def fn(q, k, v):
        out, lse = flash_metal.attention_with_lse(q, k, v, causal=causal)
        # Rows with no visible key (causal, Nk < Nq) have lse = -inf, whose
        # finite differences are NaN; they are checked through out (zero).
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-2, atol=2e-3, rtol=2e-3, nondet_tol=0.0)


def test_double_backward_is_refused():
    q = torch.randn(1, 1, 6, 8, requires_grad=True)
    out = flash_metal.attention(q, q, q)
    (gq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="no double backward"):
        gq.sum().backward()


def test_no_grad_needed_saves_nothing():
    q = torch.randn(1, 2, 5, 8)
    assert not flash_metal.attention(q, q, q).requires_grad


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_opcheck_with_autograd(dtype):
    g = torch.Generator().manual_seed(29)
    q, k, v = (t.requires_grad_(True) for t in make_qkv(1, 4, 2, 13, 21, 32, dtype, generator=g))
    torch.library.opcheck(torch.ops.flash_metal.attention_forward.default, (q, k, v, True, None, "auto"))
    out, lse = torch.ops.flash_metal.attention_forward(q.detach(), k.detach(), v.detach(), True)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    torch.library.opcheck(
        torch.ops.flash_metal.attention_backward.default,
        (grad_out, q.detach(), k.detach(), v.detach(), out, lse, True, None, torch.randn(lse.shape, generator=g),
         "auto"),
    )
