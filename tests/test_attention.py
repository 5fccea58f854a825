"""attention_forward against the float64 oracle, on every backend.

Backends: "cpu" (the C++ flash kernel), "metal-emu" (the real shaders, run
through the Metal emulator with the host's own launch plan), and "mps" (a
Mac with a usable GPU; skipped elsewhere). Outputs are NaN-poisoned before
each call (conftest.py for the C++ ops, backends.py for the emulator), so an
element a kernel never writes fails the check.
"""
import itertools

import pytest
import torch

from backends import backend_param, run_attention
from numerics import DTYPES, assert_attention_close, make_qkv

BACKENDS = [backend_param(b) for b in ("cpu", "metal-emu", "mps")]
HEAD_DIMS = [1, 32, 63, 64, 80, 128, 256]
# (Nq, Nk) pairs straddling block edges, and their swaps.
_PAIRS = [(1, 1), (1, 239), (63, 65), (127, 512), (1000, 1000), (2048, 1)]
SEQ_PAIRS = sorted(set(_PAIRS + [(b, a) for a, b in _PAIRS]))
HEADS = {"mha": (4, 4), "gqa4": (8, 2), "mqa": (4, 1)}
LAYOUTS = ["contiguous", "transposed", "offset_slice"]


def _dtype_id(d):
    return str(d).replace("torch.", "")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk", SEQ_PAIRS, ids=[f"{a}x{b}" for a, b in SEQ_PAIRS])
@pytest.mark.parametrize("d", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_shapes(backend, dtype, d, nq, nk, causal):
    g = torch.Generator().manual_seed(hash((d, nq, nk, causal)) % 2**31)
    q, k, v = make_qkv(1, 1, 1, nq, nk, d, dtype, generator=g)
    out, lse = run_attention(backend, q, k, v, causal)
    assert_attention_close(out, lse, q, k, v, causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("nq,nk,d", [(63, 65, 80), (130, 77, 64)], ids=["63x65d80", "130x77d64"])
def test_heads_and_layouts(backend, dtype, nq, nk, d, causal, heads, layout):
    hq, hkv = HEADS[heads]
    g = torch.Generator().manual_seed(hash((nq, hq, hkv, layout)) % 2**31)
    q, k, v = make_qkv(2, hq, hkv, nq, nk, d, dtype, layout=layout, generator=g)
    out, lse = run_attention(backend, q, k, v, causal)
    assert_attention_close(out, lse, q, k, v, causal)
    assert out.is_contiguous()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_custom_scale_and_batch(backend, dtype):
    q, k, v = make_qkv(3, 2, 2, 37, 45, 48, dtype)
    for scale in (0.0, 0.05, -0.3, 2.0):
        out, lse = run_attention(backend, q, k, v, False, scale)
        assert_attention_close(out, lse, q, k, v, False, scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_fully_masked_rows_are_zero(backend, dtype):
    # Causal with Nk < Nq: rows 0 .. Nq-Nk-1 see no key at all.
    q, k, v = make_qkv(1, 2, 1, 50, 20, 32, dtype)
    out, lse = run_attention(backend, q, k, v, causal=True)
    assert torch.equal(out[:, :, :30], torch.zeros_like(out[:, :, :30]))
    assert torch.isinf(lse[:, :, :30]).all() and (lse[:, :, :30] < 0).all()
    assert_attention_close(out, lse, q, k, v, True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_extreme_logits(backend, dtype, causal):
    # Scale 1e3 and inputs up to 1e4: logits near 1e11. A kernel that
    # exponentiates without subtracting the running max overflows to inf/NaN.
    g = torch.Generator().manual_seed(5)
    q, k, v = make_qkv(1, 2, 2, 70, 90, 16, dtype, generator=g)
    q = (q.float() * 2500).clamp(-1e4, 1e4).to(dtype)
    k = (k.float() * 2500).clamp(-1e4, 1e4).to(dtype)
    out, lse = run_attention(backend, q, k, v, causal, 1e3)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_attention_close(out, lse, q, k, v, causal, 1e3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stale_cache_values_never_leak(backend):
    # K/V sliced out of a cache whose unused tail holds huge values: a kernel
    # that reads one key too far produces garbage far outside tolerance.
    cache_k = torch.full((1, 2, 300, 64), 1e4)
    cache_v = torch.full((1, 2, 300, 64), 1e4)
    g = torch.Generator().manual_seed(6)
    n = 129
    cache_k[:, :, :n] = torch.randn(1, 2, n, 64, generator=g)
    cache_v[:, :, :n] = torch.randn(1, 2, n, 64, generator=g)
    q = torch.randn(1, 2, 17, 64, generator=g)
    k, v = cache_k[:, :, :n], cache_v[:, :, :n]
    for causal in (False, True):
        out, lse = run_attention(backend, q, k, v, causal)
        assert out.abs().max() < 10
        assert_attention_close(out, lse, q, k, v, causal)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_stride_broadcast_kv(backend):
    # An expanded (stride-0) kv head dimension is a legal view: read in place.
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 33, 32, generator=g)
    k = torch.randn(1, 1, 40, 32, generator=g).expand(1, 4, 40, 32)
    v = torch.randn(1, 1, 40, 32, generator=g).expand(1, 4, 40, 32)
    out, lse = run_attention(backend, q, k, v, True)
    assert_attention_close(out, lse, q, k, v, True)


def test_single_head_wrapper_form():
    import flash_metal

    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(n, 16, generator=g) for n in (10, 12, 12))
    out = flash_metal.attention(q, k, v, causal=True)
    assert out.shape == (10, 16)
    out4, lse4 = flash_metal.attention_with_lse(q[None, None], k[None, None], v[None, None], causal=True)
    assert torch.equal(out, out4[0, 0])
    assert_attention_close(out4, lse4, q[None, None], k[None, None], v[None, None], True)


@pytest.mark.skipif(not __import__("backends").mps_usable(), reason="no usable MPS device")
def test_mps_stream_ordering_with_other_ops():
    # Inputs produced by MPS ops just before the call, and the output consumed
    # by MPS ops right after: our dispatch must sit in order on PyTorch's stream.
    g = torch.Generator().manual_seed(9)
    base = [torch.randn(1, 2, 300, 64, generator=g) for _ in range(3)]
    q, k, v = ((t.to("mps") * 3.0 - 1.0) / 3.0 + 1.0 / 3.0 for t in base)
    out, lse = torch.ops.flash_metal.attention_forward(q, k, v, True)
    doubled = (out * 2.0).cpu() / 2.0
    assert_attention_close(doubled.contiguous(), lse.cpu(), *(t.cpu() for t in (q, k, v)), True)
