"""The composite path (csrc/composite.h): chunked ATen matmuls and softmax, what
the MPS op runs where no fused Metal kernel serves (head dims above 256, the
model's verdict in benchmarks/model/families/d512.py; D_qk != D_v within 256
runs fused, forward and backward). The same C++ runs here on CPU tensors (impl='composite'),
forward and backward, against the float64 oracle by the 2x rule; explain()
routes to it and says why; the emulated Metal backend runs it (counted)."""
import zlib

import pytest
import torch

import backends
import flash_metal
from flash_metal import reference as R
from numerics import (assert_attention_close, assert_gradients_close, assert_varlen_close,
                      assert_varlen_gradients_close, make_tensor)


def _gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _qkv(B, hq, hkv, nq, nk, dqk, dv, dtype, g):
    return (make_tensor((B, hq, nq, dqk), "contiguous", dtype, g), make_tensor((B, hkv, nk, dqk), "contiguous", dtype, g),
            make_tensor((B, hkv, nk, dv), "transposed" if dv % 2 == 0 else "contiguous", dtype, g))


# (name, B, Hq, Hkv, Nq, Nk, D_qk, D_v, dtype, causal, options)
CASES = [
    ("d512_f32", 1, 2, 2, 19, 33, 512, 512, torch.float32, False, {}),
    ("d512_f16_causal_gqa", 2, 4, 2, 17, 40, 512, 512, torch.float16, True, {}),
    ("d512_bf16_window_softcap", 1, 2, 1, 24, 24, 512, 512, torch.bfloat16, False,
     dict(window_left=5, window_right=3, softcap=20.0)),
    ("mla_576_512_decode", 2, 8, 1, 1, 70, 576, 512, torch.float16, True, {}),
    ("mla_192_128_sinks", 1, 4, 2, 21, 21, 192, 128, torch.float32, True, dict(sinks=True)),
    ("d320_bool_mask", 2, 2, 2, 9, 13, 320, 320, torch.float32, False, dict(mask="bool")),
    ("d264_additive_mask", 1, 2, 2, 12, 7, 264, 264, torch.float16, False, dict(mask="float")),
]
IDS = [c[0] for c in CASES]


def _case(name):
    _, B, hq, hkv, nq, nk, dqk, dv, dtype, causal, opts = CASES[IDS.index(name)]
    g = _gen(name)
    q, k, v = _qkv(B, hq, hkv, nq, nk, dqk, dv, dtype, g)
    options = {key: val for key, val in opts.items() if key not in ("mask", "sinks")}
    if opts.get("sinks"):
        options["sinks"] = torch.randn(hq, generator=g)
    if opts.get("mask") == "bool":
        m = torch.rand(B, 1, nq, nk, generator=g) > 0.3
        m[0, 0, 2] = False  # a fully masked row: zeros, lse = -inf
        options["attn_mask"] = m
    elif opts.get("mask") == "float":
        options["attn_mask"] = torch.randn(1, hq, nq, nk, generator=g).to(dtype)
    return g, q, k, v, causal, options


@pytest.mark.parametrize("name", IDS)
def test_forward_matches_oracle(name):
    g, q, k, v, causal, options = _case(name)
    out, lse = flash_metal.attention_with_lse(q, k, v, causal, None, "composite", **options)
    assert out.shape == q.shape[:-1] + v.shape[-1:] and out.dtype == q.dtype
    assert_attention_close(out, lse, q, k, v, causal, None, **options)
    if "attn_mask" in options and options["attn_mask"].dtype == torch.bool:
        assert torch.all(out[0, :, 2] == 0) and torch.all(lse[0, :, 2] == float("-inf"))


@pytest.mark.parametrize("name", IDS)
def test_backward_matches_oracle(name):
    g, q, k, v, causal, options = _case(name)
    out, lse = flash_metal.attention_with_lse(q, k, v, causal, None, "composite", **options)
    grad_out = torch.randn(out.shape, generator=g).to(q.dtype)
    grad_lse = torch.randn(lse.shape, generator=g)
    gq, gk, gv, gs = torch.ops.flash_metal.attention_backward(
        grad_out, q, k, v, out, lse, causal, None, grad_lse, "composite", options.get("attn_mask"),
        options.get("window_left", -1), options.get("window_right", -1), options.get("softcap", 0.0),
        options.get("sinks"))
    assert gq.shape == q.shape and gk.shape == k.shape and gv.shape == v.shape
    assert_gradients_close((gq, gk, gv), q, k, v, grad_out, causal, None, grad_lse, **options)
    if "sinks" in options:
        s64 = options["sinks"].double().requires_grad_(True)
        ro, rl = R.attention_reference(q, k, v, causal, None, **dict(options, sinks=s64))
        (ref,) = torch.autograd.grad((ro * grad_out.double()).sum() + (rl * grad_lse.double()).sum(), s64)
        torch.testing.assert_close(gs.double(), ref, rtol=1e-4, atol=1e-4)


def test_varlen_forward_and_backward():
    g = _gen("varlen")
    cu_q = torch.tensor([0, 5, 5, 17, 18], dtype=torch.int32)  # an empty sequence, and one of a single row
    cu_k = torch.tensor([0, 9, 12, 12, 30], dtype=torch.int32)  # and one with no key
    hq, hkv, dqk, dv = 4, 2, 512, 384
    q = torch.randn(18, hq, dqk, generator=g)
    k = torch.randn(30, hkv, dqk, generator=g)
    v = torch.randn(30, hkv, dv, generator=g)[:, :, :]
    sinks = torch.randn(hq, generator=g)
    out, lse = flash_metal.attention_varlen_with_lse(q, k, v, cu_q, cu_k, 12, 18, True, None, impl="composite",
                                                     sinks=sinks)
    assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, True, None, sinks=sinks)
    grad_out = torch.randn(out.shape, generator=g)
    grads = torch.ops.flash_metal.attention_varlen_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, 12, 18, True,
                                                            None, None, -1, -1, 0.0, "composite", sinks)
    assert_varlen_gradients_close(grads[:3], q, k, v, grad_out, cu_q, cu_k, True, None, sinks=sinks)
    assert not any(t.isnan().any() for t in grads)


def test_chunks_cover_every_row():
    # More rows than one chunk holds (kCompositeChunkBytes = 64 MiB of float32
    # scores: 64 rows at Hq = 32, Nk = 8192): every chunk's rows are written.
    g = _gen("chunks")
    q = make_tensor((1, 32, 130, 8), "contiguous", torch.float32, g)
    k = make_tensor((1, 32, 8192, 8), "contiguous", torch.float32, g)
    v = make_tensor((1, 32, 8192, 8), "contiguous", torch.float32, g)
    out, lse = flash_metal.attention_with_lse(q, k, v, True, None, "composite")
    assert_attention_close(out, lse, q, k, v, True, None)


def _views(dqk, dv, nq=64, nk=64):
    one = lambda d, n: torch.empty(1, 1, 1, d).expand(1, 8, n, d)  # noqa: E731
    return one(dqk, nq), one(dqk, nk), one(dv, nk)


@pytest.mark.parametrize("dqk, dv, backward, composite", [
    (512, 512, False, True), (576, 512, False, True), (320, 128, True, True), (128, 128, False, False),
    (256, 256, True, False),
])
def test_explain_routes_to_the_composite_path_and_says_why(dqk, dv, backward, composite):
    plan = flash_metal.explain(*_views(dqk, dv), backward=backward)
    assert (plan.dispatches == ()) == composite, plan.reason
    if composite:
        assert plan.reason.startswith("composite (" + ("backward" if backward else "forward") + ")")
        assert "exceed the widest fused bucket (256)" in plan.reason and "model/families/d512.py" in plan.reason


def test_explain_plans_the_mla_backward_on_the_fused_kernels():
    # D_qk != D_v within 256: the fused backward (issue 20 section 2), not the composite path.
    plan = flash_metal.explain(*_views(64, 32), backward=True)
    assert [d.kernel_name.split("_")[2] for d in plan.dispatches] == ["dq", "dkdv"], plan.reason
    assert not plan.reason.startswith("composite") and "D_v = 32" in plan.reason


def test_explicit_request_and_fused_requests_past_256():
    plan = flash_metal.explain(*_views(64, 64), impl="composite")
    assert plan.dispatches == () and "requested by the caller" in plan.reason
    with pytest.raises(NotImplementedError, match="head_dim 576"):
        flash_metal.explain(*_views(576, 256), impl="prefill")
    # At (512, 512), (576, 512) and (256, 512) impl='prefill' names the split-D forward
    # (tests/metal/test_metal_prefill_splitd.py, tests/metal/test_metal_prefill_splitd_mla.py).
    for dqk in (512, 576, 256):
        assert flash_metal.explain(*_views(dqk, 512), impl="prefill").dispatches[0].kernel_name.startswith(
            "flash_attention_prefill_splitd_")


@pytest.mark.parametrize("backward", [False, True])
def test_the_emulated_metal_backend_runs_the_composite_path(backward):
    g = _gen("emu", backward)
    q, k, v = _qkv(1, 4, 2, 9, 21, 512, 512, torch.float16, g)
    before = len(backends.COMPOSITE_RUNS)
    # Not causal: causal D = 512 forwards run the split-D kernel (tests/metal/test_metal_prefill_splitd.py).
    out, lse = backends.run_attention("metal-emu", q, k, v, False)
    assert len(backends.COMPOSITE_RUNS) == before + 1
    assert_attention_close(out, lse, q, k, v, False, None)
    if backward:
        grad_out = torch.randn(out.shape, generator=g).to(q.dtype)
        grads = backends.emulated_metal_attention_backward(grad_out, q, k, v, out, lse, False)
        assert len(backends.COMPOSITE_RUNS) == before + 2
        assert_gradients_close(grads, q, k, v, grad_out, False, None)
