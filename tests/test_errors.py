"""Every bad input gets a clear error naming the argument and what is allowed."""
import pytest
import torch

import flash_metal
from backends import mps_usable

OP = torch.ops.flash_metal.attention_forward


def good(**over):
    g = torch.Generator().manual_seed(0)
    args = dict(
        q=torch.randn(1, 4, 8, 16, generator=g),
        k=torch.randn(1, 2, 9, 16, generator=g),
        v=torch.randn(1, 2, 9, 16, generator=g),
    )
    args.update(over)
    return args


CASES = [
    # (what is wrong, replaced arguments, exception type, message pattern)
    ("int q", dict(q=torch.ones(1, 4, 8, 16, dtype=torch.int64)), TypeError,
     r"q must have dtype float32, float16 or bfloat16; got Long"),
    ("float64 k", dict(k=torch.randn(1, 2, 9, 16, dtype=torch.float64)), TypeError,
     r"k must have dtype float32, float16 or bfloat16; got Double"),
    ("mixed dtypes", dict(v=torch.randn(1, 2, 9, 16).half()), TypeError,
     r"v has dtype Half but q has dtype Float"),
    ("3-D q", dict(q=torch.randn(4, 8, 16)), ValueError, r"q must be 4-D \(batch, heads, seq_len, head_dim\); got a 3-D"),
    ("5-D k", dict(k=torch.randn(1, 1, 2, 9, 16)), ValueError, r"k must be 4-D"),
    ("batch mismatch", dict(k=torch.randn(2, 2, 9, 16), v=torch.randn(2, 2, 9, 16)), ValueError,
     r"k has batch size 2 but q has batch size 1"),
    ("head_dim mismatch", dict(k=torch.randn(1, 2, 9, 8), v=torch.randn(1, 2, 9, 8)), ValueError,
     r"k has head_dim 8 but q has head_dim 16"),
    ("v shape", dict(v=torch.randn(1, 2, 10, 16)), ValueError, r"v must have the same shape as k"),
    ("head_dim too big", dict(q=torch.randn(1, 4, 8, 257), k=torch.randn(1, 2, 9, 257), v=torch.randn(1, 2, 9, 257)),
     ValueError, r"head_dim \(last dimension of q\) must be between 1 and 256; got 257"),
    ("GQA ratio", dict(q=torch.randn(1, 3, 8, 16)), ValueError,
     r"number of query heads \(3\) must be a multiple of the number of key/value heads \(2\)"),
    ("empty q", dict(q=torch.randn(1, 4, 0, 16)), ValueError, r"q must be non-empty; got shape \[1, 4, 0, 16\]"),
    ("empty k", dict(k=torch.randn(1, 2, 0, 16), v=torch.randn(1, 2, 0, 16)), ValueError, r"k must be non-empty"),
    ("zero head_dim", dict(q=torch.randn(1, 4, 8, 0), k=torch.randn(1, 2, 9, 0), v=torch.randn(1, 2, 9, 0)),
     ValueError, r"q must be non-empty"),
    ("zero batch", dict(q=torch.randn(0, 4, 8, 16)), ValueError, r"q must be non-empty"),
]


@pytest.mark.parametrize("what,over,exc,pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_tensor(what, over, exc, pattern):
    a = good(**over)
    with pytest.raises(exc, match=pattern):
        OP(a["q"], a["k"], a["v"])
    # The Python wrapper and the planner report the same error.
    with pytest.raises(exc, match=pattern):
        flash_metal.attention(a["q"], a["k"], a["v"])
    with pytest.raises(exc, match=pattern):
        flash_metal.explain(a["q"], a["k"], a["v"])


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf")])
def test_bad_scale(scale):
    a = good()
    with pytest.raises(ValueError, match=r"scale must be a finite number or None"):
        OP(a["q"], a["k"], a["v"], False, scale)


def test_unknown_kernel_name():
    a = good()
    with pytest.raises(ValueError, match=r"impl must be one of 'auto', 'untiled', 'tiled', 'prefill', 'decode', "
                                         r"'decode_split'; got 'fast'"):
        OP(a["q"], a["k"], a["v"], False, None, "fast")


@pytest.mark.parametrize("kernel", ["untiled", "tiled", "prefill", "decode", "decode_split"])
def test_metal_kernel_on_cpu_tensors(kernel):
    a = good()
    with pytest.raises(ValueError, match=rf"impl=.{kernel}. selects a Metal kernel"):
        OP(a["q"], a["k"], a["v"], False, None, kernel)


@pytest.mark.skipif(not mps_usable(), reason="needs a usable MPS device to mix devices")
def test_mixed_devices():
    a = good()
    with pytest.raises(ValueError, match=r"k is on device cpu but q is on device mps"):
        OP(a["q"].to("mps"), a["k"], a["v"])


def test_non_contiguous_views_are_accepted_not_copied():
    # Views are read in place: a transposed q and a sliced k/v are valid input.
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 8, 4, 16, generator=g).transpose(1, 2)
    kv = torch.randn(1, 2, 20, 16, generator=g)
    out, lse = OP(q, kv[:, :, 3:12], kv[:, :, 3:12])
    assert out.shape == (1, 4, 8, 16) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_none_tensor(name):
    a = good(**{name: None})
    with pytest.raises(ValueError, match=rf"{name} is undefined \(None\)"):
        OP(a["q"], a["k"], a["v"])


BACKWARD = torch.ops.flash_metal.attention_backward


def good_backward(**over):
    a = good()
    out, lse = OP(a["q"], a["k"], a["v"])
    a.update(grad_out=torch.randn_like(out), out=out, lse=lse, grad_lse=None)
    a.update(over)
    return a


BACKWARD_CASES = [
    # (what is wrong, replaced arguments, exception type, message pattern)
    ("int grad_out", dict(grad_out=torch.ones(1, 4, 8, 16, dtype=torch.int64)), TypeError,
     r"attention_backward: grad_out has dtype Long but q has dtype Float"),
    ("half out", dict(out=torch.randn(1, 4, 8, 16).half()), TypeError, r"out has dtype Half but q has dtype Float"),
    ("grad_out shape", dict(grad_out=torch.randn(1, 4, 9, 16)), ValueError,
     r"grad_out must have q's shape \[1, 4, 8, 16\]; got \[1, 4, 9, 16\]"),
    ("out shape", dict(out=torch.randn(1, 4, 8)), ValueError, r"out must have q's shape"),
    ("bfloat16 lse", dict(lse=torch.randn(1, 4, 8).bfloat16()), TypeError,
     r"lse must be float32 \(attention_forward returns lse in float32\); got BFloat16"),
    ("lse shape", dict(lse=torch.randn(1, 4, 9)), ValueError,
     r"lse must have shape \(batch, q_heads, q_len\) = \[1, 4, 8\]; got \[1, 4, 9\]"),
    ("grad_lse shape", dict(grad_lse=torch.randn(4, 8)), ValueError, r"grad_lse must have shape"),
    ("float64 grad_lse", dict(grad_lse=torch.randn(1, 4, 8, dtype=torch.float64)), TypeError,
     r"grad_lse must be float32"),
    ("int q", dict(q=torch.ones(1, 4, 8, 16, dtype=torch.int64)), TypeError,
     r"attention_backward: q must have dtype float32, float16 or bfloat16; got Long"),
    ("GQA ratio", dict(k=torch.randn(1, 3, 9, 16), v=torch.randn(1, 3, 9, 16)), ValueError,
     r"number of query heads \(4\) must be a multiple of the number of key/value heads \(3\)"),
    ("head_dim", dict(k=torch.randn(1, 2, 9, 8), v=torch.randn(1, 2, 9, 8)), ValueError,
     r"k has head_dim 8 but q has head_dim 16"),
]


@pytest.mark.parametrize("what,over,exc,pattern", BACKWARD_CASES, ids=[c[0] for c in BACKWARD_CASES])
def test_bad_backward_input(what, over, exc, pattern):
    a = good_backward(**over)
    with pytest.raises(exc, match=pattern):
        BACKWARD(a["grad_out"], a["q"], a["k"], a["v"], a["out"], a["lse"], False, None, a["grad_lse"])


def test_backward_impl_must_be_auto_on_cpu():
    a = good_backward()
    with pytest.raises(ValueError, match=r"impl"):
        BACKWARD(a["grad_out"], a["q"], a["k"], a["v"], a["out"], a["lse"], False, None, None, "tiled")