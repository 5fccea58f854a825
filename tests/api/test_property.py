"""Property-based sweep: random shapes, strides and GQA ratios vs the float64 oracle.

Runs the CPU kernel and every Metal kernel (emulated): "auto" and each
kernel by name, so a kernel that auto never picks still meets every layout.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends import run_attention
from numerics import DTYPES, LAYOUTS, assert_attention_close, make_tensor

# (backend, impl) pairs: the CPU kernel accepts only "auto".
BACKEND_IMPLS = [("cpu", "auto"), ("metal-emu", "auto"), ("metal-emu", "untiled"), ("metal-emu", "tiled")]


@st.composite
def problems(draw):
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    return dict(
        batch=draw(st.integers(1, 2)),
        kv_heads=kv_heads,
        q_heads=kv_heads * group,
        nq=draw(st.integers(1, 150)),
        nk=draw(st.integers(1, 150)),
        d=draw(st.integers(1, 256)),
        dtype=draw(st.sampled_from(DTYPES)),
        causal=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(-2.0, 2.0, allow_nan=False))),
        # Each tensor laid out in one of several ways, independently.
        layouts=draw(st.lists(st.sampled_from(LAYOUTS), min_size=3, max_size=3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@pytest.mark.parametrize("backend,impl", BACKEND_IMPLS, ids=[f"{b}-{i}" for b, i in BACKEND_IMPLS])
# 40 examples per kernel: 160 problems in all, a few seconds per kernel.
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(p=problems())
def test_random_problems(backend, impl, p):
    g = torch.Generator().manual_seed(p["seed"])
    B, Hq, Hkv, D = p["batch"], p["q_heads"], p["kv_heads"], p["d"]
    q = make_tensor((B, Hq, p["nq"], D), p["layouts"][0], p["dtype"], g)
    k = make_tensor((B, Hkv, p["nk"], D), p["layouts"][1], p["dtype"], g)
    v = make_tensor((B, Hkv, p["nk"], D), p["layouts"][2], p["dtype"], g)
    out, lse = run_attention(backend, q, k, v, p["causal"], p["scale"], impl)
    assert_attention_close(out, lse, q, k, v, p["causal"], p["scale"])


@st.composite
def option_problems(draw):
    """A problem of problems() plus issue 11's options: mask (kind and broadcast), window, softcap."""
    p = draw(problems())
    p["mask"] = draw(st.sampled_from([None, "bool", "additive", "additive_float32"]))
    # Which of (B, Hq, Nq, Nk) the mask spans (the rest broadcast), from the right.
    p["mask_dims"] = draw(st.lists(st.booleans(), min_size=4, max_size=4))
    p["window_left"] = draw(st.sampled_from([-1, -1, 0, 1, 7, 31, 64]))
    p["window_right"] = draw(st.sampled_from([-1, -1, 0, 3, 40]))
    p["softcap"] = draw(st.sampled_from([0.0, 0.0, 1.0, 30.0]))
    return p


def _random_mask(p, q, k, g):
    if p["mask"] is None:
        return None
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    shape = tuple(n if keep else 1 for n, keep in zip(full, p["mask_dims"]))
    keep = torch.rand(shape, generator=g) > 0.3
    if p["mask"] == "bool":
        return keep
    bias = torch.randn(shape, generator=g)
    return torch.where(keep, bias, float("-inf")).to(torch.float32 if p["mask"] == "additive_float32" else q.dtype)


@pytest.mark.parametrize("backend", ["cpu", "metal-emu"])
# 40 examples per backend, drawn from every option at once.
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(p=option_problems())
def test_random_problems_with_options(backend, p):
    g = torch.Generator().manual_seed(p["seed"])
    B, Hq, Hkv, D = p["batch"], p["q_heads"], p["kv_heads"], p["d"]
    q = make_tensor((B, Hq, p["nq"], D), p["layouts"][0], p["dtype"], g)
    k = make_tensor((B, Hkv, p["nk"], D), p["layouts"][1], p["dtype"], g)
    v = make_tensor((B, Hkv, p["nk"], D), p["layouts"][2], p["dtype"], g)
    options = dict(attn_mask=_random_mask(p, q, k, g), window_left=p["window_left"],
                   window_right=p["window_right"], softcap=p["softcap"])
    out, lse = run_attention(backend, q, k, v, p["causal"], p["scale"], "auto", **options)
    assert_attention_close(out, lse, q, k, v, p["causal"], p["scale"], **options)
