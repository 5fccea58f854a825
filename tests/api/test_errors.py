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
    ("v shape", dict(v=torch.randn(1, 2, 10, 16)), ValueError, r"v must have k's batch, heads and seq_len \[1, 2, 9\]"),
    # (v's own head dim, D_v != D_qk, is valid: tests/cpu/test_head_dims.py.)
    ("head_dim too big", dict(q=torch.randn(1, 4, 8, 577), k=torch.randn(1, 2, 9, 577), v=torch.randn(1, 2, 9, 64)),
     ValueError, r"head_dim \(last dimension of q\) must be between 1 and 576; got 577"),
    ("GQA ratio", dict(q=torch.randn(1, 3, 8, 16)), ValueError,
     r"number of query heads \(3\) must be a multiple of the number of key/value heads \(2\)"),
    # (Empty batch and sequence lengths are valid: tests/api/test_features.py::test_empty_inputs_as_sdpa.)
    ("zero head_dim", dict(q=torch.randn(1, 4, 8, 0), k=torch.randn(1, 2, 9, 0), v=torch.randn(1, 2, 9, 0)),
     ValueError, r"q must have at least one head and head_dim >= 1; got shape \[1, 4, 8, 0\]"),
    ("zero heads", dict(q=torch.randn(1, 0, 8, 16)), ValueError, r"q must have at least one head"),
    ("zero batch k", dict(k=torch.randn(0, 2, 9, 16), v=torch.randn(0, 2, 9, 16)), ValueError,
     r"k has batch size 0 but q has batch size 1"),
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
                                         r"'decode_split', 'tensor_ops', 'composite'; got 'fast'"):
        OP(a["q"], a["k"], a["v"], False, None, "fast")


@pytest.mark.parametrize("kernel", ["untiled", "tiled", "prefill", "decode", "decode_split", "tensor_ops"])
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
     r"grad_out must have shape \[1, 4, 8, 16\] \(q's, with v's head_dim D_v = 16\); got \[1, 4, 9, 16\]"),
    ("out shape", dict(out=torch.randn(1, 4, 8)), ValueError, r"out must have shape \[1, 4, 8, 16\]"),
    ("bfloat16 lse", dict(lse=torch.randn(1, 4, 8).bfloat16()), TypeError,
     r"lse must be float32 \(the forward returns lse in float32\); got BFloat16"),
    ("lse shape", dict(lse=torch.randn(1, 4, 9)), ValueError,
     r"lse must have shape \[1, 4, 8\] \(the forward's lse\); got \[1, 4, 9\]"),
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

# --- the options of issue 11 ------------------------------------------------------------------

OPTION_CASES = [
    # (what is wrong, keyword arguments, exception type, message pattern)
    ("int mask", dict(attn_mask=torch.ones(8, 9, dtype=torch.int32)), TypeError,
     r"attn_mask must be bool \(True = attend\) or an additive float mask in q's dtype \(Float\) or float32; got Int"),
    ("half mask for float32 q", dict(attn_mask=torch.zeros(8, 9).half()), TypeError, r"attn_mask must be bool"),
    ("mask wrong key count", dict(attn_mask=torch.ones(8, 10, dtype=torch.bool)), ValueError,
     r"attn_mask must broadcast to \(batch, q_heads, q_len, kv_len\) = \[1, 4, 8, 9\].*got shape \[8, 10\]"),
    ("mask wrong heads", dict(attn_mask=torch.ones(1, 2, 8, 9, dtype=torch.bool)), ValueError,
     r"attn_mask must broadcast to"),
    ("5-D mask", dict(attn_mask=torch.ones(1, 1, 4, 8, 9, dtype=torch.bool)), ValueError, r"1 to 4 dimensions"),
    ("window_left", dict(window_left=-2), ValueError, r"window_left must be -1 \(unbounded\) or a number of keys >= 0"),
    ("window_right", dict(window_right=-5), ValueError, r"window_right must be -1"),
    ("negative softcap", dict(softcap=-1.0), ValueError, r"softcap must be 0 \(off\) or a finite positive number"),
    ("nan softcap", dict(softcap=float("nan")), ValueError, r"softcap must be 0"),
]


@pytest.mark.parametrize("what,kw,exc,pattern", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_bad_option(what, kw, exc, pattern):
    a = good()
    with pytest.raises(exc, match=pattern):
        flash_metal.attention(a["q"], a["k"], a["v"], **kw)
    with pytest.raises(exc, match=pattern):
        flash_metal.explain(a["q"], a["k"], a["v"], **kw)
    b = good_backward()
    with pytest.raises(exc, match=pattern.replace("attention_forward", "attention_backward")):
        BACKWARD(b["grad_out"], b["q"], b["k"], b["v"], b["out"], b["lse"], False, None, None, "auto", **kw)


def test_post_kernels_refuse_options():
    a = good()
    for impl in ("untiled", "tiled"):
        with pytest.raises(ValueError, match=rf"impl='{impl}' \(the post's kernel\) serves plain or causal"):
            flash_metal.explain(a["q"], a["k"], a["v"], impl=impl, window_left=4)


def varlen_good(**over):
    g = torch.Generator().manual_seed(1)
    args = dict(q=torch.randn(7, 4, 16, generator=g), k=torch.randn(9, 2, 16, generator=g),
                v=torch.randn(9, 2, 16, generator=g), cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 5, 9], dtype=torch.int32), max_seqlen_q=4, max_seqlen_k=5)
    args.update(over)
    return args


VARLEN_CASES = [
    ("4-D q", dict(q=torch.randn(1, 7, 4, 16)), ValueError, r"q must be 3-D \(total_tokens, heads, head_dim\)"),
    ("int64 offsets", dict(cu_seqlens_q=torch.tensor([0, 3, 7])), TypeError,
     r"cu_seqlens_q must be int32 \(as in flash-attn\); got Long"),
    ("2-D offsets", dict(cu_seqlens_k=torch.tensor([[0, 5, 9]], dtype=torch.int32)), ValueError,
     r"cu_seqlens_k must be 1-D of shape \(batch \+ 1,\)"),
    ("offset counts differ", dict(cu_seqlens_k=torch.tensor([0, 9], dtype=torch.int32)), ValueError,
     r"cu_seqlens_q has 3 entries but cu_seqlens_k has 2"),
    ("decreasing", dict(cu_seqlens_q=torch.tensor([0, 3, 2], dtype=torch.int32)), ValueError,
     r"cu_seqlens_q must be non-decreasing"),
    ("wrong total", dict(cu_seqlens_k=torch.tensor([0, 5, 8], dtype=torch.int32)), ValueError,
     r"cu_seqlens_k\[-1\] must equal the number of packed rows \(9\); got 8"),
    ("max too small", dict(max_seqlen_q=3), ValueError,
     r"sequence 1 has length 4 \(from cu_seqlens_q\) but max_seqlen_q is 3"),
    ("first not zero", dict(cu_seqlens_q=torch.tensor([1, 3, 7], dtype=torch.int32)), ValueError,
     r"cu_seqlens_q\[0\] must be 0; got 1"),
]


@pytest.mark.parametrize("what,over,exc,pattern", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_bad_varlen_input(what, over, exc, pattern):
    a = varlen_good(**over)
    with pytest.raises(exc, match=r"attention_varlen_forward: " + pattern):
        flash_metal.attention_varlen(**a)


def test_varlen_refuses_a_mask_and_decode():
    a = varlen_good()
    with pytest.raises(ValueError, match=r"attn_mask is not supported with packed variable-length sequences"):
        flash_metal.explain(a["q"], a["k"], a["v"], attn_mask=torch.ones(4, 5, dtype=torch.bool),
                            cu_seqlens_q=a["cu_seqlens_q"], cu_seqlens_k=a["cu_seqlens_k"], max_seqlen_q=4,
                            max_seqlen_k=5)
    with pytest.raises(ValueError, match=r"impl='decode' does not take packed variable-length sequences"):
        flash_metal.explain(a["q"], a["k"], a["v"], impl="decode", cu_seqlens_q=a["cu_seqlens_q"],
                            cu_seqlens_k=a["cu_seqlens_k"], max_seqlen_q=4, max_seqlen_k=5)
