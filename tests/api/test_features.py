"""Masks, sliding windows, softcapping, packed variable-length batches and empty inputs (issue 11).

Every option, forward and backward, on every backend (cpu, the Metal
emulator running the shipped shaders through the op's own plan, and mps on
a Mac), against the float64 oracle by FlashAttention's 2x rule
(tests/numerics.py). Outputs are NaN-poisoned on the emulator, so a row a
kernel skips by mistake fails. The per-kernel sanitizer sweeps live in
test_metal_features.py and test_metal_backward_features.py; the CPU's
block-skipping and threading checks in test_features_cpu.py.
"""
import zlib

import pytest
import torch

import flash_metal
from backends import backend_param, run_attention, run_backward, run_varlen, run_varlen_backward
from numerics import (
    DTYPES,
    assert_attention_close,
    assert_gradients_close,
    assert_varlen_close,
    assert_varlen_gradients_close,
    dtype_id,
    make_qkv,
)

BACKENDS = [backend_param(b) for b in ("cpu", "metal-emu", "mps")]


def _gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _grads_of(backend, q, k, v, causal, options, g):
    """The forward then the backward on `backend`, for a fresh random grad_out and grad_lse."""
    out, lse = run_attention(backend, q, k, v, causal, None, **options)
    grad_out = torch.randn(out.shape, generator=g).to(q.dtype)
    grad_lse = torch.where(torch.isfinite(lse), torch.randn(lse.shape, generator=g), 0.0)
    grads = run_backward(backend, grad_out, q, k, v, out, lse, causal, None, grad_lse, **options)
    return out, lse, grad_out, grad_lse, grads


def _check_both(backend, q, k, v, causal, options, key):
    g = _gen(*key)
    out, lse, grad_out, grad_lse, grads = _grads_of(backend, q, k, v, causal, options, g)
    assert_attention_close(out, lse, q, k, v, causal, None, **options)
    assert_gradients_close(grads, q, k, v, grad_out, causal, None, grad_lse, **options)


# --- attn_mask ---------------------------------------------------------------------------------

B, HQ, HKV, NQ, NK, D = 2, 4, 2, 37, 45, 64
# Every broadcast a mask may take over (B, Hq, Nq, Nk): missing leading
# dimensions, size-1 dimensions, and a full mask read through a transposed view.
MASK_SHAPES = {
    "keys": (NK,),
    "rows_keys": (NQ, NK),
    "batch_1_rows_keys": (B, 1, NQ, NK),
    "heads_1_keys": (1, HQ, 1, NK),
    "full_transposed": (B, HQ, NK, NQ),  # transposed to (B, HQ, NQ, NK): non-contiguous
}
MASK_KINDS = ("bool", "additive", "additive_float32")


def make_mask(kind, shape, dtype, g):
    """A random mask of `kind` (about a third of the keys masked), shape `shape`."""
    keep = torch.rand(shape, generator=g) > 0.35
    if kind == "bool":
        m = keep
    else:
        bias = torch.randn(shape, generator=g)  # a real additive bias, not only 0 / -inf
        m = torch.where(keep, bias, float("-inf")).to(torch.float32 if kind == "additive_float32" else dtype)
    return m.transpose(-1, -2) if shape == MASK_SHAPES["full_transposed"] else m


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_mask_every_broadcast_shape(backend, dtype, kind):
    for name, shape in MASK_SHAPES.items():
        g = _gen("mask", kind, name, str(dtype))
        q, k, v = make_qkv(B, HQ, HKV, NQ, NK, D, dtype, generator=g)
        mask = make_mask(kind, shape, dtype, g)
        _check_both(backend, q, k, v, False, dict(attn_mask=mask), ("mask", backend, kind, name, str(dtype)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("nq,nk", [(37, 45), (45, 37), (1, 50), (6, 40)])
def test_mask_with_causal_and_decode_rows(backend, dtype, nq, nk):
    # Nq <= 8 runs the decode kernels on Metal (every row of a GQA group in one
    # threadgroup: each row must read its own head's mask).
    g = _gen("mask-causal", nq, nk, str(dtype))
    q, k, v = make_qkv(1, 4, 2, nq, nk, 64, dtype, generator=g)
    mask = make_mask("bool", (1, 4, nq, nk), dtype, g)
    _check_both(backend, q, k, v, True, dict(attn_mask=mask), ("mask-causal", backend, nq, nk, str(dtype)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", ["bool", "finfo_min"])
def test_fully_masked_rows_give_zeros(backend, dtype, kind):
    # Rows whose every key is masked: zeros and lse = -inf, never NaN, and
    # zero gradients; the other rows are unaffected. finfo(float32).min is
    # what transformers puts in an additive mask.
    g = _gen("masked-rows", kind, str(dtype))
    q, k, v = make_qkv(1, 2, 2, 20, 33, 64, dtype, generator=g)
    keep = torch.rand(1, 1, 20, 33, generator=g) > 0.3
    keep[..., [0, 7, 19], :] = False
    if kind == "bool":
        mask = keep
    else:
        mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    options = dict(attn_mask=mask)
    out, lse, grad_out, grad_lse, grads = _grads_of(backend, q, k, v, False, options, g)
    assert (out[:, :, [0, 7, 19]] == 0).all() and torch.isneginf(lse[:, :, [0, 7, 19]]).all()
    assert (grads[0][:, :, [0, 7, 19]] == 0).all()
    assert_attention_close(out, lse, q, k, v, False, None, **options)
    assert_gradients_close(grads, q, k, v, grad_out, False, None, grad_lse, **options)


# --- sliding windows ---------------------------------------------------------------------------

WINDOWS = {
    "smaller_than_a_block": (3, 0),
    "left_only": (40, -1),
    "right_only": (-1, 5),
    "straddling": (17, 9),
    "diagonal": (0, 0),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("window", WINDOWS, ids=list(WINDOWS))
@pytest.mark.parametrize("nq,nk", [(70, 70), (33, 97), (97, 33), (3, 80)])
def test_sliding_window(backend, dtype, window, nq, nk):
    left, right = WINDOWS[window]
    g = _gen("window", window, nq, nk, str(dtype))
    q, k, v = make_qkv(1, 4, 1, nq, nk, 64, dtype, generator=g)
    options = dict(window_left=left, window_right=right)
    _check_both(backend, q, k, v, False, options, ("window", backend, window, nq, nk, str(dtype)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_window_with_causal_mask_and_softcap_together(backend, dtype):
    g = _gen("all", str(dtype))
    q, k, v = make_qkv(2, 4, 2, 50, 61, 80, dtype, generator=g, scale_inputs=3.0)
    mask = make_mask("additive", (2, 1, 50, 61), dtype, g)
    options = dict(attn_mask=mask, window_left=20, softcap=15.0)
    _check_both(backend, q, k, v, True, options, ("all", backend, str(dtype)))


# --- softcap -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("softcap,inputs", [(50.0, 1.0), (20.0, 8.0), (2.0, 8.0)])
@pytest.mark.parametrize("nq,nk", [(45, 60), (2, 70)])
def test_softcap_with_large_logits(backend, dtype, softcap, inputs, nq, nk):
    # inputs scales q and k: logits up to ~inputs^2 * sqrt(D), far past the
    # cap, where tanh saturates and its derivative 1 - tanh^2 vanishes.
    g = _gen("softcap", softcap, inputs, nq, nk, str(dtype))
    q, k, v = make_qkv(1, 2, 2, nq, nk, 64, dtype, generator=g, scale_inputs=inputs)
    _check_both(backend, q, k, v, nq > nk // 2, dict(softcap=softcap), ("softcap", backend, softcap, str(dtype)))


# --- variable length ---------------------------------------------------------------------------

SEQUENCES = {
    # (query lengths, key lengths) per sequence: length 1, empty sequences on
    # either side, Nq != Nk, one longer than a block.
    "ragged": ([1, 17, 40, 5], [1, 30, 33, 5]),
    "empty_sequences": ([0, 9, 3, 0], [4, 0, 12, 0]),
    "decode_like": ([1, 1, 1], [20, 7, 50]),
}


def _varlen_inputs(lengths_q, lengths_k, hq, hkv, d, dtype, g):
    cu_q = torch.tensor([0] + list(torch.tensor(lengths_q).cumsum(0).tolist()), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lengths_k).cumsum(0).tolist()), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d, generator=g).to(dtype)
    k = torch.randn(int(cu_k[-1]), hkv, d, generator=g).to(dtype)
    v = torch.randn(int(cu_k[-1]), hkv, d, generator=g).to(dtype)
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k)


VARLEN_OPTIONS = {
    "plain": (False, {}),
    "causal": (True, {}),
    "window_softcap": (True, dict(window_left=6, softcap=10.0)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("sequences", SEQUENCES, ids=list(SEQUENCES))
@pytest.mark.parametrize("opts", VARLEN_OPTIONS, ids=list(VARLEN_OPTIONS))
def test_varlen(backend, dtype, sequences, opts):
    causal, options = VARLEN_OPTIONS[opts]
    g = _gen("varlen", sequences, opts, str(dtype))
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs(*SEQUENCES[sequences], 4, 2, 64, dtype, g)
    out, lse = run_varlen(backend, q, k, v, cu_q, cu_k, max_q, max_k, causal, None, **options)
    assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, causal, None, **options)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    grads = run_varlen_backward(backend, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, None, None,
                                **options)
    assert_varlen_gradients_close(grads, q, k, v, grad_out, cu_q, cu_k, causal, None, None, **options)


def test_varlen_equals_the_padded_batch_per_sequence():
    # The packed call is the dense op on each sequence's slice: same numbers
    # (bitwise on CPU, where both run the same kernel code per row block).
    g = _gen("varlen-dense")
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs([5, 12, 1], [9, 12, 3], 4, 2, 32, torch.float32, g)
    out, lse = flash_metal.attention_varlen_with_lse(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l = flash_metal.attention_with_lse(*(t[s].transpose(0, 1).unsqueeze(0) for t, s in
                                                ((q, qs), (k, ks), (v, ks))), causal=True)
        torch.testing.assert_close(out[qs], o[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse[:, qs], l[0], rtol=1e-6, atol=1e-6)


# --- empty inputs ------------------------------------------------------------------------------

EMPTY = {"no_batch": (0, 5, 7), "no_query": (2, 0, 7), "no_key": (2, 5, 0)}


# cpu and mps only: an empty problem never reaches a kernel. The ops' common
# flow (csrc/attention_ops.h, shared by both backends) answers it on the host,
# and the Metal planner refuses it (test_empty_problem_has_no_metal_plan).
@pytest.mark.parametrize("backend", [backend_param("cpu"), backend_param("mps")])
@pytest.mark.parametrize("shape", EMPTY, ids=list(EMPTY))
def test_empty_inputs_as_sdpa(backend, shape):
    b, nq, nk = EMPTY[shape]
    g = _gen("empty", shape)
    q, k, v = make_qkv(b, 4, 2, nq, nk, 32, torch.float32, generator=g)
    out, lse = run_attention(backend, q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    assert out.shape == ref.shape == (b, 4, nq, 32) and lse.shape == (b, 4, nq)
    # SDPA gives zeros for Nk = 0 (its math path gives NaN; its fused paths zeros); lse = -inf.
    assert (out == 0).all() and torch.isneginf(lse).all()
    grad_out = torch.randn(out.shape, generator=g)
    grads = run_backward(backend, grad_out, q, k, v, out, lse)
    for grad, like in zip(grads, (q, k, v)):
        assert grad.shape == like.shape and (grad == 0).all()


def test_empty_problem_has_no_metal_plan():
    q, k, v = make_qkv(1, 2, 2, 3, 0, 16, torch.float32)
    with pytest.raises(ValueError, match=r"an empty problem \(B, Nq or Nk is 0\) launches no kernel"):
        flash_metal.explain(q, k, v)


def test_empty_inputs_through_autograd_and_compile():
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 3, 0, 16, torch.float32))
    out = torch.compile(flash_metal.attention, fullgraph=True)(q, k, v)
    out.sum().backward()
    assert out.shape == (1, 2, 3, 16) and (out == 0).all() and (q.grad == 0).all()


# --- the ops' plumbing -------------------------------------------------------------------------


def test_opcheck_with_every_option():
    g = _gen("opcheck")
    q, k, v = make_qkv(1, 4, 2, 9, 13, 16, torch.float32, generator=g)
    mask = make_mask("additive", (9, 13), torch.float32, g)
    args = (q, k, v, True, None, "auto", mask, 4, -1, 5.0)
    torch.library.opcheck(torch.ops.flash_metal.attention_forward.default, args)
    qv, kv, vv, cu_q, cu_k, max_q, max_k = _varlen_inputs([3, 0, 6], [4, 2, 7], 4, 2, 16, torch.float32, g)
    vargs = (qv.requires_grad_(), kv.requires_grad_(), vv.requires_grad_(), cu_q, cu_k, max_q, max_k, True, None,
             3, -1, 5.0, "auto")
    torch.library.opcheck(torch.ops.flash_metal.attention_varlen_forward.default, vargs)


def test_autograd_through_every_option_matches_the_oracle():
    # flash_metal.attention with all options under autograd: the registered
    # backward gives the float64 oracle's gradients (double checks the
    # wiring of mask, window and softcap through setup_context).
    g = _gen("autograd")
    q, k, v = make_qkv(2, 4, 2, 21, 30, 32, torch.float32, generator=g)
    mask = make_mask("bool", (2, 1, 21, 30), torch.float32, g)
    options = dict(attn_mask=mask, window_left=7, window_right=2, softcap=6.0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_metal.attention(*leaves, **options)
    grad_out = torch.randn(out.shape, generator=g)
    out.backward(grad_out)
    assert_gradients_close(tuple(t.grad for t in leaves), q, k, v, grad_out, False, None, None, **options)


def test_a_mask_that_requires_grad_is_refused_in_backward():
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 4, 5, 16, torch.float32))
    bias = torch.zeros(4, 5, requires_grad=True)
    out = flash_metal.attention(q, k, v, attn_mask=bias)
    with pytest.raises(NotImplementedError, match=r"no gradient flows into attn_mask"):
        out.sum().backward()


def test_compiled_model_with_mask_window_and_softcap_has_no_graph_break():
    g = _gen("compile")
    q, k, v = make_qkv(2, 4, 2, 16, 16, 32, torch.float32, generator=g)
    mask = torch.rand(2, 1, 16, 16, generator=g) > 0.2

    def f(q, k, v, mask):
        return flash_metal.attention(q, k, v, attn_mask=mask, window_left=5, softcap=10.0).sum()

    eager = f(q, k, v, mask)
    compiled = torch.compile(f, fullgraph=True)(q, k, v, mask)
    torch.testing.assert_close(compiled, eager)
