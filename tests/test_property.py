"""Property-based sweep: random shapes, strides and GQA ratios vs the float64 oracle."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends import run_attention
from numerics import DTYPES, assert_attention_close


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
        layouts=draw(st.lists(st.sampled_from(["packed", "bnhd", "slice", "dim_stride"]), min_size=3, max_size=3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _make(shape, layout, dtype, g):
    B, H, N, D = shape
    if layout == "packed":
        return torch.randn(B, H, N, D, generator=g).to(dtype)
    if layout == "bnhd":
        return torch.randn(B, N, H, D, generator=g).to(dtype).transpose(1, 2)
    if layout == "slice":
        big = torch.full((B + 1, H + 1, N + 3, D + 2), float("nan"), dtype=dtype)
        view = big[1:, 1:, 2 : N + 2, 1 : D + 1]
        view.copy_(torch.randn(B, H, N, D, generator=g))
        return view
    if layout == "dim_stride":  # features not adjacent in memory
        return torch.randn(B, H, D, N, generator=g).to(dtype).transpose(2, 3)
    raise ValueError(layout)


@pytest.mark.parametrize("backend", ["cpu", "metal-emu"])
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(p=problems())
def test_random_problems(backend, p):
    g = torch.Generator().manual_seed(p["seed"])
    q = _make((p["batch"], p["q_heads"], p["nq"], p["d"]), p["layouts"][0], p["dtype"], g)
    k = _make((p["batch"], p["kv_heads"], p["nk"], p["d"]), p["layouts"][1], p["dtype"], g)
    v = _make((p["batch"], p["kv_heads"], p["nk"], p["d"]), p["layouts"][2], p["dtype"], g)
    out, lse = run_attention(backend, q, k, v, p["causal"], p["scale"])
    assert_attention_close(out, lse, q, k, v, p["causal"], p["scale"])
