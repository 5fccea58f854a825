"""flash_metal.scaled_dot_product_attention against PyTorch's own, behaviour by behaviour.

The reference is PyTorch's scaled_dot_product_attention itself, run in
float64 on the CPU (an independent statement of SDPA's semantics: top-left
is_causal, broadcasting, bool and additive masks, GQA); the tolerance is
FlashAttention's 2x rule against PyTorch's same-dtype result. Backends: cpu,
mps on a Mac, and the Metal emulator (forward only: the drop-in's op calls
are sent to the emulated backend).
"""
import re

import pytest
import torch
import torch.nn.functional as F

import flash_metal
from backends import backend_param, run_attention
from flash_metal import sdpa as sdpa_module
from numerics import DTYPES, dtype_id, rounding_floor

TORCH_SDPA = sdpa_module._TORCH_SDPA
BACKENDS = [backend_param(b) for b in ("cpu", "metal-emu", "mps")]


@pytest.fixture
def on_backend(backend, monkeypatch):
    """Runs the drop-in on `backend`; returns a function calling it with CPU tensors."""
    if backend == "metal-emu":
        def emulated(q, k, v, causal=False, scale=None, impl="auto", **options):
            return run_attention("metal-emu", q, k, v, causal, scale, impl, **options)[0]

        monkeypatch.setattr(sdpa_module.ops, "attention", emulated)

    def call(*args, **kwargs):
        if backend == "mps":
            args = [a.to("mps") if isinstance(a, torch.Tensor) else a for a in args]
            kwargs = {k: v.to("mps") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            return flash_metal.scaled_dot_product_attention(*args, **kwargs).cpu()
        return flash_metal.scaled_dot_product_attention(*args, **kwargs)

    return call


def _double(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def assert_like_sdpa(out, q, k, v, **kwargs):
    """out vs PyTorch's SDPA in float64, within 2x the error of PyTorch's SDPA in q's dtype."""
    ref = TORCH_SDPA(_double(q), _double(k), _double(v), **{n: _double(x) for n, x in kwargs.items()})
    same = TORCH_SDPA(q, k, v, **kwargs)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any()
    ref = torch.nan_to_num(ref, nan=0.0)  # PyTorch's math path: NaN on fully masked rows; its fused paths 0
    pt_err = (torch.nan_to_num(same.double(), nan=0.0) - ref).abs().max().item() if ref.numel() else 0.0
    floor = rounding_floor(ref, q.dtype) + 64 * torch.finfo(torch.float32).eps * max(1.0, ref.abs().max().item())
    err = (out.double() - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= 2 * pt_err + floor, f"max error {err:.3g} > 2 x {pt_err:.3g} + {floor:.3g}"


def _qkv(shape_q, shape_kv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape_q, generator=g).to(dtype)
    k = torch.randn(shape_kv, generator=g).to(dtype)
    v = torch.randn(shape_kv, generator=g).to(dtype)
    return q, k, v, g


MASKS = {"rows_keys": (37, 45), "batch_heads_1": (2, 1, 37, 45), "keys_only": (1, 4, 1, 45)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_every_mask_kind_and_broadcast(on_backend, dtype, mask_kind):
    q, k, v, g = _qkv((2, 4, 37, 64), (2, 4, 45, 64), dtype, 1)
    for shape in MASKS.values():
        keep = torch.rand(shape, generator=g) > 0.3
        mask = keep if mask_kind == "bool" else torch.where(keep, torch.randn(shape, generator=g), -1e4).to(dtype)
        assert flash_metal.sdpa_route(q, k, v, mask).flash_metal
        assert_like_sdpa(on_backend(q, k, v, attn_mask=mask), q, k, v, attn_mask=mask)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("L,S", [(37, 37), (20, 45), (45, 20), (1, 30)])
def test_is_causal_is_top_left(on_backend, dtype, L, S):
    q, k, v, _ = _qkv((1, 4, L, 32), (1, 4, S, 32), dtype, L * 100 + S)
    assert_like_sdpa(on_backend(q, k, v, is_causal=True), q, k, v, is_causal=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gqa_scale_and_ranks(on_backend, dtype):
    q, k, v, _ = _qkv((2, 8, 30, 64), (2, 2, 41, 64), dtype, 2)
    assert_like_sdpa(on_backend(q, k, v, enable_gqa=True, scale=0.3), q, k, v, enable_gqa=True, scale=0.3)
    q3, k3, v3, _ = _qkv((4, 17, 32), (4, 19, 32), dtype, 3)  # (N, L, E): 3-D
    assert_like_sdpa(on_backend(q3, k3, v3, is_causal=True), q3, k3, v3, is_causal=True)
    q5, k5, v5, g = _qkv((2, 3, 2, 9, 16), (2, 3, 2, 11, 16), dtype, 4)  # two batch dimensions
    mask5 = torch.rand(3, 1, 9, 11, generator=g) > 0.2
    assert_like_sdpa(on_backend(q5, k5, v5, attn_mask=mask5), q5, k5, v5, attn_mask=mask5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_fully_masked_rows_give_zeros_like_sdpa(on_backend, dtype):
    q, k, v, g = _qkv((1, 2, 12, 32), (1, 2, 16, 32), dtype, 5)
    keep = torch.rand(1, 1, 12, 16, generator=g) > 0.4
    keep[..., 3, :] = False
    out = on_backend(q, k, v, attn_mask=keep)
    assert (out[:, :, 3] == 0).all()
    assert_like_sdpa(out, q, k, v, attn_mask=keep)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gradients_like_sdpa(dtype):
    q, k, v, g = _qkv((2, 4, 21, 32), (2, 2, 30, 32), dtype, 6)
    mask = torch.rand(2, 1, 21, 30, generator=g) > 0.3
    grad = torch.randn(2, 4, 21, 32, generator=g).to(dtype)
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    flash_metal.scaled_dot_product_attention(*ours, attn_mask=mask, enable_gqa=True).backward(grad)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    TORCH_SDPA(*ref, attn_mask=mask, enable_gqa=True).backward(grad.double())
    same = [t.clone().requires_grad_() for t in (q, k, v)]
    TORCH_SDPA(*same, attn_mask=mask, enable_gqa=True).backward(grad)
    for a, r, s in zip(ours, ref, same):
        pt = (s.grad.double() - r.grad).abs().max().item()
        floor = rounding_floor(r.grad, dtype) + 256 * torch.finfo(torch.float32).eps * r.grad.abs().max().item()
        assert (a.grad.double() - r.grad).abs().max().item() <= 2 * pt + floor


def test_what_goes_to_pytorch_and_why():
    q, k, v, _ = _qkv((1, 2, 8, 16), (1, 2, 8, 16), torch.float32, 7)
    mask = torch.ones(8, 8, dtype=torch.bool)
    cases = {
        "dropout_p": (dict(dropout_p=0.1), "no dropout"),
        "mask and causal": (dict(attn_mask=mask, is_causal=True), "attn_mask together with is_causal"),
        "float64": (None, "dtypes"),
        "gqa without enable_gqa": (None, "without enable_gqa"),
        "mask needs grad": (dict(attn_mask=torch.zeros(8, 8, requires_grad=True)), "requires grad"),
    }
    for name, (kwargs, why) in cases.items():
        args = (q, k, v)
        if name == "float64":
            args, kwargs = (q.double(), k.double(), v.double()), {}
        if name == "gqa without enable_gqa":
            args, kwargs = (torch.randn(1, 4, 8, 16), k, v), {}
        route = flash_metal.explain_sdpa(*args, **kwargs)
        assert not route.flash_metal and why in route.reason, (name, route)
        # The fallback is PyTorch's function, so the result is PyTorch's (errors included).
        torch.manual_seed(0)
        try:
            want = TORCH_SDPA(*args, **kwargs)
        except RuntimeError as e:
            with pytest.raises(RuntimeError, match=re.escape(str(e)[:40])):
                flash_metal.scaled_dot_product_attention(*args, **kwargs)
            continue
        torch.manual_seed(0)
        torch.testing.assert_close(flash_metal.scaled_dot_product_attention(*args, **kwargs), want)
    assert flash_metal.sdpa_route(q, k, v, is_causal=True).reason == "flash_metal.attention_forward"


def test_patch_swaps_and_restores_torch_function():
    q, k, v, _ = _qkv((1, 2, 8, 16), (1, 2, 8, 16), torch.float32, 8)
    original = F.scaled_dot_product_attention
    calls = []
    real_route = sdpa_module.sdpa_route

    def counting_route(*args, **kwargs):
        calls.append(1)
        return real_route(*args, **kwargs)

    sdpa_module.sdpa_route = counting_route
    try:
        with flash_metal.patch():
            assert torch.nn.functional.scaled_dot_product_attention is flash_metal.scaled_dot_product_attention
            F.scaled_dot_product_attention(q, k, v)  # a caller that looks the function up at call time
        assert F.scaled_dot_product_attention is original and calls == [1]
        flash_metal.patch()
        assert flash_metal.sdpa.is_patched()
        flash_metal.unpatch()
        assert F.scaled_dot_product_attention is original
    finally:
        sdpa_module.sdpa_route = real_route
        flash_metal.unpatch()


def test_patched_model_compiles_without_graph_break():
    q, k, v, g = _qkv((2, 4, 16, 32), (2, 4, 16, 32), torch.float32, 9)
    mask = torch.rand(2, 1, 16, 16, generator=g) > 0.2

    def f(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()

    want = f(q, k, v, mask)
    with flash_metal.patch():
        got = torch.compile(f, fullgraph=True)(q, k, v, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
