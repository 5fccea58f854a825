"""Different head dims for q/k (D_qk) and v (D_v) on the CPU kernels (issue 20, section 2).

MLA-style attention (DeepSeek-V2/V3, Kimi): q and k have D_qk, v has D_v,
out and grad_v have D_v, grad_q and grad_k D_qk; the default scale is
1/sqrt(D_qk) (as in torch's SDPA). Checked against the float64 oracle by the
2x rule, forward and backward, on the pairs real models use ((192, 128)
prefill and training, (576, 512) absorbed-MLA decode) and on small ones
either way round ((64, 32), (32, 64)), with causal, the window, softcap,
masks, GQA, varlen and sinks (a few combinations, not a full product); a
gradcheck; opcheck; the bad-input errors; the Metal planner's refusal; the
SDPA drop-in and the flash-attn API; the Metal forward and backward through
the emulator. Small ragged shapes: a few seconds.
"""
import re
import zlib

import pytest
import torch
import torch.nn.functional as F

import flash_metal
from flash_metal import reference as R
from numerics import (assert_attention_close, assert_gradients_close, assert_varlen_close,
                      assert_varlen_gradients_close, dtype_id, lay_out, make_tensor)


def _gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _qkv(B, hq, hkv, nq, nk, dqk, dv, dtype, g, layout="contiguous"):
    # Fresh random values (never zeros); `layout` applies to v (its strides
    # are the ones a D_v kernel could confuse with k's).
    return (make_tensor((B, hq, nq, dqk), "contiguous", dtype, g),
            make_tensor((B, hkv, nk, dqk), "contiguous", dtype, g),
            make_tensor((B, hkv, nk, dv), layout, dtype, g))


def _bool_mask(B, nq, nk, g):
    m = torch.rand(B, 1, nq, nk, generator=g) > 0.3
    m[0, 0, 2] = False  # a fully masked row: zeros, lse = -inf
    return m


# (name, (D_qk, D_v), dtype, B, Hq, Hkv, Nq, Nk, causal, options builder, v layout)
# Ragged lengths; GQA 4:2 throughout. "decode" rows (Nq = 1, float32, a GQA
# group of <= 16 columns) take the forward's in-place path, which reads K rows
# D_qk wide and V rows D_v wide through their own strides.
CASES = [
    ("mla192_plain", (192, 128), torch.float32, 2, 4, 2, 13, 21, False, lambda g: {}, "contiguous"),
    ("mla192_causal_long", (192, 128), torch.float32, 1, 4, 2, 200, 230, True, lambda g: {}, "contiguous"),
    ("mla192_bf16_window", (192, 128), torch.bfloat16, 2, 4, 2, 13, 21, True, lambda g: dict(window_left=5),
     "contiguous"),
    ("mla192_softcap_mask", (192, 128), torch.float16, 1, 4, 2, 13, 21, False,
     lambda g: dict(softcap=3.0, attn_mask=_bool_mask(1, 13, 21, g)), "every_other"),
    ("mla192_sinks", (192, 128), torch.float32, 2, 4, 2, 13, 21, True,
     lambda g: dict(sinks=torch.randn(4, generator=g) + 0.5), "transposed"),
    ("mla576_decode", (576, 512), torch.float32, 2, 4, 2, 1, 37, False, lambda g: {}, "contiguous"),
    ("mla576_prefill", (576, 512), torch.float32, 1, 4, 2, 9, 23, True, lambda g: {}, "contiguous"),
    ("mla576_bf16_decode", (576, 512), torch.bfloat16, 1, 4, 2, 2, 29, True, lambda g: {}, "contiguous"),
    ("wide_qk", (64, 32), torch.float32, 2, 4, 2, 13, 21, False, lambda g: dict(softcap=2.0), "offset_slice"),
    ("wide_v", (32, 64), torch.float32, 2, 4, 2, 13, 21, True, lambda g: {}, "contiguous"),
    ("wide_v_decode", (32, 64), torch.float32, 1, 4, 2, 1, 50, False, lambda g: {}, "contiguous"),
    ("ragged_dims", (40, 24), torch.bfloat16, 1, 4, 1, 11, 19, False,
     lambda g: dict(attn_mask=torch.randn(1, 4, 11, 19, generator=g).bfloat16()), "d_outer"),
]
IDS = [c[0] for c in CASES]


def _case(name):
    _, (dqk, dv), dtype, B, hq, hkv, nq, nk, causal, build, layout = next(c for c in CASES if c[0] == name)
    g = _gen(name)
    q, k, v = _qkv(B, hq, hkv, nq, nk, dqk, dv, dtype, g, layout)
    return g, q, k, v, causal, build(g)


@pytest.mark.parametrize("name", IDS)
def test_forward_matches_oracle(name):
    g, q, k, v, causal, options = _case(name)
    out, lse = flash_metal.attention_with_lse(q, k, v, causal, **options)
    assert out.shape == q.shape[:-1] + v.shape[-1:] and out.dtype == q.dtype
    assert_attention_close(out, lse, q, k, v, causal, None, **options)


@pytest.mark.parametrize("name", IDS)
def test_backward_matches_oracle(name):
    g, q, k, v, causal, options = _case(name)
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    given = dict(options)
    if "sinks" in given:  # grad_sinks too: its rowsum(dO * O) runs over D_v
        given["sinks"] = given["sinks"].clone().requires_grad_(True)
    out, lse = flash_metal.attention_with_lse(qq, kk, vv, causal, **given)
    grad_out = torch.randn(out.shape, generator=g).to(q.dtype)
    grad_lse = torch.randn(lse.shape, generator=g)
    ((out.float() * grad_out.float()).sum() + (lse * grad_lse).sum()).backward()
    assert qq.grad.shape == q.shape and kk.grad.shape == k.shape and vv.grad.shape == v.shape
    assert_gradients_close((qq.grad, kk.grad, vv.grad), q, k, v, grad_out, causal, None, grad_lse, **options)
    if "sinks" in given:
        s64 = options["sinks"].double().requires_grad_(True)
        ro, rl = R.attention_reference(q, k, v, causal, None, **dict(options, sinks=s64))
        (ref,) = torch.autograd.grad((ro * grad_out.double()).sum() + (rl * grad_lse.double()).sum(), s64)
        torch.testing.assert_close(given["sinks"].grad.double(), ref, rtol=1e-4, atol=1e-4)


def test_empty_problems_have_the_value_dim():
    # Nk = 0 (zeros, lse = -inf) and Nq = 0: outputs and gradients in their own head dims.
    q, k, v = torch.randn(2, 4, 3, 24), torch.randn(2, 2, 0, 24), torch.randn(2, 2, 0, 8)
    out, lse = torch.ops.flash_metal.attention_forward(q, k, v)
    assert out.shape == (2, 4, 3, 8) and (out == 0).all() and torch.isneginf(lse).all()
    grads = torch.ops.flash_metal.attention_backward(torch.randn(2, 4, 3, 8), q, k, v, out, lse)[:3]
    assert [tuple(t.shape) for t in grads] == [(2, 4, 3, 24), (2, 2, 0, 24), (2, 2, 0, 8)] and (grads[0] == 0).all()
    out, _ = torch.ops.flash_metal.attention_forward(q[:, :, :0], torch.randn(2, 2, 5, 24), torch.randn(2, 2, 5, 8))
    assert out.shape == (2, 4, 0, 8)


def test_backward_chunked_mqa():
    # B * Hkv = 1 kv head on a 2-thread pool: the backward cuts the query rows
    # into chunks whose partial dK (D_qk wide) and dV (D_v wide) are summed
    # afterwards, each with its own width.
    from numerics import threads

    g = _gen("chunked")
    q, k, v = _qkv(1, 3, 1, 200, 210, 72, 40, torch.float32, g)
    grad_out = torch.randn(1, 3, 200, 40, generator=g)
    with threads(2):
        out, lse = torch.ops.flash_metal.attention_forward(q, k, v, True)
        grads = torch.ops.flash_metal.attention_backward(grad_out, q, k, v, out, lse, True)[:3]
    assert_gradients_close(grads, q, k, v, grad_out, True)


def test_varlen():
    g = _gen("varlen")
    lq, lk = [5, 1, 0, 7, 3], [9, 1, 4, 6, 0]  # one-token, no-query and no-key sequences
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lq), 4, 48, generator=g)
    k = torch.randn(sum(lk), 2, 48, generator=g)
    v = torch.randn(sum(lk), 2, 24, generator=g)
    options = dict(window_left=3, softcap=3.0)
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = flash_metal.attention_varlen_with_lse(qq, kk, vv, cu_q, cu_k, max(lq), max(lk), True, **options)
    assert out.shape == (sum(lq), 4, 24)
    assert_varlen_close(out.detach(), lse.detach(), q, k, v, cu_q, cu_k, True, None, **options)
    grad_out = torch.randn(out.shape, generator=g)
    grad_lse = torch.randn(lse.shape, generator=g)
    ((out * grad_out).sum() + (lse * grad_lse).sum()).backward()
    assert_varlen_gradients_close((qq.grad, kk.grad, vv.grad), q, k, v, grad_out, cu_q, cu_k, True, None, grad_lse,
                                  **options)


@pytest.mark.filterwarnings("ignore:Input #.* is not a double precision:UserWarning")
def test_gradcheck():
    # float32 central differences (no float64 kernel), as tests/api/test_backward.py's.
    g = _gen("gradcheck")
    q, k, v = (t.requires_grad_(True) for t in _qkv(1, 4, 2, 5, 7, 12, 8, torch.float32, g))

    def fn(q, k, v):
        return flash_metal.attention_with_lse(q, k, v, causal=True, window_left=3)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-2, atol=2e-3, rtol=2e-3, nondet_tol=0.0)


def test_reference_matches_sdpa_with_its_own_value_dim():
    # The oracle with D_v != D_qk is torch's math SDPA (which allows it) in float64.
    g = _gen("oracle")
    q, k, v = _qkv(2, 4, 4, 6, 9, 20, 12, torch.float64, g)
    out, _ = R.attention_reference(q, k, v, True, None)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=R.visible_keys(6, 9, causal=True))
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_opcheck():
    g = _gen("opcheck")
    q, k, v = _qkv(1, 4, 2, 6, 9, 24, 16, torch.float32, g)
    torch.library.opcheck(torch.ops.flash_metal.attention_forward.default, (q, k, v, True, None, "auto"))
    out, lse = torch.ops.flash_metal.attention_forward(q, k, v, True)
    grad_out = torch.randn(out.shape, generator=g)
    torch.library.opcheck(torch.ops.flash_metal.attention_backward.default,
                          (grad_out, q, k, v, out, lse, True, None, torch.randn(lse.shape, generator=g), "auto"))
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    qv, kv, vv = q[0].transpose(0, 1), k[0, :, :6].transpose(0, 1), v[0, :, :6].transpose(0, 1)
    torch.library.opcheck(torch.ops.flash_metal.attention_varlen_forward.default, (qv, kv, vv, cu, cu, 4, 4, True))


def test_compile_traces_the_value_dim():
    # The fake kernels give out D_v: tracing the product with a (D_v, 3)
    # matrix fails if the fake's out has q's head dim.
    g = _gen("compile")
    q, k, v = _qkv(1, 2, 2, 5, 7, 16, 8, torch.float32, g)
    w = torch.randn(8, 3, generator=g)
    fn = torch.compile(lambda q, k, v: flash_metal.attention(q, k, v, causal=True) @ w, backend="eager",
                       fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), flash_metal.attention(q, k, v, causal=True) @ w)


BAD = [
    # (what, q, k, v shapes, exception, message pattern)
    ("k's head dim", (1, 4, 8, 192), (1, 2, 9, 128), (1, 2, 9, 128), ValueError,
     r"k has head_dim 128 but q has head_dim 192; k must have q's head dim \(D_qk = 192\)"),
    ("v's length", (1, 4, 8, 192), (1, 2, 9, 192), (1, 2, 10, 128), ValueError,
     r"v must have k's batch, heads and seq_len \[1, 2, 9\] \(its head_dim D_v may differ"),
    ("v's heads", (1, 4, 8, 192), (1, 2, 9, 192), (1, 1, 9, 128), ValueError, r"v must have k's batch, heads"),
    ("D_qk too big", (1, 4, 8, 577), (1, 2, 9, 577), (1, 2, 9, 512), ValueError,
     r"head_dim \(last dimension of q\) must be between 1 and 576; got 577"),
    ("D_v too big", (1, 4, 8, 576), (1, 2, 9, 576), (1, 2, 9, 513), ValueError,
     r"v's head_dim \(D_v, last dimension of v\) must be between 1 and 512; got 513"),
    ("D_v zero", (1, 4, 8, 64), (1, 2, 9, 64), (1, 2, 9, 0), ValueError, r"v must have at least one head and head_dim"),
]


@pytest.mark.parametrize("what,qs,ks,vs,exc,pattern", BAD, ids=[b[0] for b in BAD])
def test_bad_shapes_are_named(what, qs, ks, vs, exc, pattern):
    q, k, v = torch.randn(qs), torch.randn(ks), torch.randn(vs)
    with pytest.raises(exc, match=pattern):
        flash_metal.attention(q, k, v)
    with pytest.raises(exc, match=pattern):
        flash_metal.explain(q, k, v)


def test_bad_backward_shapes_are_named():
    g = _gen("bad-backward")
    q, k, v = _qkv(1, 4, 2, 8, 9, 32, 16, torch.float32, g)
    out, lse = torch.ops.flash_metal.attention_forward(q, k, v)
    bwd = torch.ops.flash_metal.attention_backward
    with pytest.raises(ValueError, match=r"grad_out must have shape \[1, 4, 8, 16\] \(q's, with v's head_dim D_v = 16\)"
                                         r"; got \[1, 4, 8, 32\]"):
        bwd(torch.randn(1, 4, 8, 32), q, k, v, out, lse)
    with pytest.raises(ValueError, match=r"out must have shape \[1, 4, 8, 16\]"):
        bwd(torch.randn_like(out), q, k, v, torch.randn(1, 4, 8, 32), lse)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_metal_plan_refuses_different_dims(backward):
    # The Metal forward and backward take D_v != D_qk on their fast families
    # (tests below), never planned with one head dim; the post's kernels
    # refuse it. Any D above 256 runs the composite path instead
    # (csrc/composite.h, tests/cpu/test_composite.py): an empty plan whose reason
    # says why.
    q = torch.randn(1, 4, 16, 192, dtype=torch.float16)
    k = torch.randn(1, 2, 16, 192, dtype=torch.float16)
    v = torch.randn(1, 2, 16, 128, dtype=torch.float16)
    if backward:
        plan = flash_metal.explain(q, k, v, backward=True)
        assert [d.kernel_name.split("_float16")[0] for d in plan.dispatches] == ["flash_backward_dq",
                                                                                "flash_backward_dkdv"]
        assert "D_qk = 192" in plan.reason and "D_v = 128" in plan.reason, plan.reason
    else:
        assert "D_v = 128" in flash_metal.explain(q, k, v).reason  # planned
        for impl in ("untiled", "tiled"):
            with pytest.raises(NotImplementedError, match=r"D_qk = 192 different from v's D_v = 128 on Metal "
                                                          r"kernels: not yet with impl='" + impl + "'"):
                flash_metal.explain(q, k, v, impl=impl)
    assert flash_metal.explain(q, k, torch.randn(1, 2, 16, 192, dtype=torch.float16), backward=backward).dispatches
    wide = torch.randn(1, 2, 16, 320, dtype=torch.float16)
    plan = flash_metal.explain(torch.randn(1, 4, 16, 320, dtype=torch.float16), wide, wide, backward=backward)
    assert plan.dispatches == () and "head dims 320 / 320 exceed the widest fused bucket (256)" in plan.reason
    with pytest.raises(NotImplementedError, match=r"head_dim 320 on Metal kernels: not yet \(at most 256"):
        flash_metal.explain(torch.randn(1, 4, 16, 320, dtype=torch.float16), wide, wide, impl="prefill",
                            backward=backward)
    if not backward:  # a fused request past 256 in either dim names the dim
        with pytest.raises(NotImplementedError, match=r"head_dim 320 on Metal kernels: not yet \(at most 256"):
            flash_metal.explain(torch.randn(1, 4, 16, 320, dtype=torch.float16), wide, k[..., :64], impl="prefill")
        with pytest.raises(NotImplementedError, match=r"v's head dim D_v = 320 on Metal kernels: not yet \(at most "
                                                      r"256"):
            flash_metal.explain(q[..., :64], k[..., :64], wide, impl="prefill")


def test_sdpa_drop_in_takes_its_own_value_dim():
    g = _gen("sdpa")
    q, k, v = _qkv(2, 4, 2, 7, 11, 48, 32, torch.float32, g)
    route = flash_metal.sdpa_route(q, k, v, is_causal=True, enable_gqa=True)
    assert route.flash_metal, route
    out = flash_metal.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    assert out.shape == (2, 4, 7, 32)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_flash_attn_api_takes_its_own_value_dim():
    g = _gen("flash-attn")
    q = torch.randn(2, 7, 4, 48, generator=g)
    k = torch.randn(2, 11, 2, 48, generator=g)
    v = torch.randn(2, 11, 2, 32, generator=g)
    out, lse, _ = flash_metal.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == (2, 7, 4, 32)
    ref, ref_lse = R.attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True)
    torch.testing.assert_close(out.double(), ref.transpose(1, 2), rtol=1e-5, atol=1e-5)
    # A KV cache whose v has its own head dim (absorbed MLA keeps a D_v latent): append, then attend.
    k_cache, v_cache = torch.randn(2, 16, 2, 48, generator=g), torch.randn(2, 16, 2, 32, generator=g)
    k_cache[:, :11], v_cache[:, :11] = k, v
    knew, vnew = torch.randn(2, 1, 2, 48, generator=g), torch.randn(2, 1, 2, 32, generator=g)
    dec = flash_metal.flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, knew, vnew,
                                              cache_seqlens=torch.tensor([11, 11], dtype=torch.int32), causal=True)
    kf, vf = torch.cat([k, knew], 1), torch.cat([v, vnew], 1)
    ref, _ = R.attention_reference(q[:, :1].transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2), True)
    assert dec.shape == (2, 1, 4, 32)
    torch.testing.assert_close(dec.double(), ref.transpose(1, 2), rtol=1e-5, atol=1e-5)
    # New rows with another head dim than their cache's: named, before anything is written.
    before = v_cache.clone()
    with pytest.raises(ValueError, match=r"flash_attn_with_kvcache: v has head dim 48 but v_cache has 32"):
        flash_metal.flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, knew, knew, cache_seqlens=3)
    assert torch.equal(v_cache, before)


# --- The Metal forward with D_v != D_qk, through the emulator -------------------------------
#
# The kernels run in the wider dim's bucket (no instantiation of their own):
# head_dim for the scores, head_dim_v (AttentionParams) for v, P.V, out and
# the split partials. Every family: prefill (and varlen), decode one pass,
# split decode (its partials and merge), and the paged decode (fc_paged),
# f32/f16/bf16, through the fast build on ragged GQA shapes, with the
# options rotating over the cases; the sanitizing build on a few small ones.
# Outputs poisoned with NaN (backends.py), the 2x rule against float64, and
# the dispatched kernels checked to be the planned family's.
from backends import LAST_DISPATCHES, emulated_metal_attention, emulated_metal_kvcache, emulated_metal_varlen  # noqa: E402

METAL_PAIRS = [(192, 128), (64, 32), (32, 64), (96, 64), (40, 72)]  # (D_qk, D_v); the last two: D_v > D_qk
METAL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DENSE = 10  # fc_dense's function-constant index (csrc/metal/plan.h, kDenseFunctionConstant)
# (family, impl, Nq, Nk): ragged lengths; decode_split forced so it splits at a short Nk.
FAMILIES = {"prefill": ("prefill", 37, 45), "decode": ("decode", 3, 70), "split": ("decode_split", 2, 300)}
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _bucket(d):
    # The bucket an equal-dims problem of head dim d runs in (the planner's list, whichever it is).
    x = torch.randn(1, 1, 1, d)
    return int(re.search(r"_d(\d+)", flash_metal.explain(x, x, x, impl="decode").kernel_name).group(1))


def _metal_options(i, B, hq, nq, nk, g):
    # One option set per case, rotating: none, causal, left window, softcap + bool mask, sinks + causal.
    kind = i % 5
    if kind == 1:
        return True, {}
    if kind == 2:
        return True, dict(window_left=7)
    if kind == 3:
        mask = torch.rand(B, 1, nq, nk, generator=g) > 0.3
        mask[0, 0, nq - 1] = False  # a fully masked row: zeros, lse = -inf
        return False, dict(softcap=4.0, attn_mask=mask)
    if kind == 4:
        return True, dict(sinks=torch.randn(hq, generator=g) + 0.5)
    return False, {}


def _assert_ran(prefix, plan):
    names = [d.kernel_name for d, _ in LAST_DISPATCHES]
    assert names == [d.kernel_name for d in plan.dispatches] and names[0].startswith(prefix), names


METAL_CASES = [(fam, pair, dtype) for fam in FAMILIES for pair in METAL_PAIRS for dtype in METAL_DTYPES]


@pytest.mark.parametrize("family,pair,dtype", METAL_CASES,
                         ids=[f"{f}-{a}x{b}-{dtype_id(t)}" for f, (a, b), t in METAL_CASES])
def test_metal_forward_own_value_dim(family, pair, dtype):
    dqk, dv = pair
    impl, nq, nk = FAMILIES[family]
    i = METAL_CASES.index((family, pair, dtype))
    g = _gen("metal", family, pair, dtype_id(dtype))
    B, hq, hkv = 2, 4, 2
    layout = ["contiguous", "transposed", "offset_slice"][i % 3]  # v's strides vary
    q, k, v = _qkv(B, hq, hkv, nq, nk, dqk, dv, dtype, g, layout)
    causal, options = _metal_options(i, B, hq, nq, nk, g)
    plan = flash_metal.explain(q, k, v, causal, None, impl, **options)
    assert f"D_qk = {dqk}" in plan.reason and f"D_v = {dv}" in plan.reason, plan.reason
    assert not plan.dispatches[0].function_constants[DENSE]  # one fc_dense for all tensors: off (csrc/metal/launch.cpp)
    out, lse = emulated_metal_attention(q, k, v, causal, None, impl, **options)
    prefix = {"prefill": "flash_attention_prefill_", "decode": "flash_decode_", "split": "flash_decode_split_"}[family]
    _assert_ran(prefix + f"{DTYPE_NAMES[dtype]}_d{_bucket(max(dqk, dv))}", plan)
    if family == "split":
        assert len(plan.dispatches) == 2 and plan.dispatches[1].kernel_name.startswith("flash_decode_merge_")
        assert plan.scratch["partial_out"] == B * hq * nq * plan.dispatches[0].grid[2] * dv  # D_v wide partials
    assert out.shape == (B, hq, nq, dv) and not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_attention_close(out, lse, q, k, v, causal, None, **options)



@pytest.mark.parametrize("pair", METAL_PAIRS, ids=[f"{a}x{b}" for a, b in METAL_PAIRS])
def test_metal_varlen_own_value_dim(pair):
    dqk, dv = pair
    dtype = METAL_DTYPES[METAL_PAIRS.index(pair) % 3]
    g = _gen("metal-varlen", pair)
    lq, lk = [5, 1, 0, 37, 3], [9, 1, 4, 40, 0]  # one-token, no-query and no-key sequences
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lq), 4, dqk, generator=g).to(dtype)
    k = torch.randn(sum(lk), 2, dqk, generator=g).to(dtype)
    v = torch.randn(sum(lk), 2, dv, generator=g).to(dtype)
    options = dict(window_left=6, softcap=3.0)
    out, lse = emulated_metal_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), True, **options)
    plan = flash_metal.explain(q, k, v, True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq),
                               max_seqlen_k=max(lk), **options)
    _assert_ran("flash_attention_prefill_", plan)
    assert out.shape == (sum(lq), 4, dv) and not torch.isnan(out).any()
    assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, True, None, **options)


def _paged(B, hkv, dqk, dv, dtype, page, seqlens, seed):
    # k and v caches of their own widths on one table: make_paged_cache's page
    # order is its generator's first draw, so equal seeds give equal tables.
    from test_metal_decode_paged import make_paged_cache

    kc, _, table, kcont, _ = make_paged_cache(B, hkv, dqk, dtype, page, seqlens, torch.Generator().manual_seed(seed))
    _, vc, table_v, _, vcont = make_paged_cache(B, hkv, dv, dtype, page, seqlens, torch.Generator().manual_seed(seed))
    assert torch.equal(table, table_v)
    return kc, vc, table, kcont, vcont


@pytest.mark.parametrize("pair", METAL_PAIRS, ids=[f"{a}x{b}" for a, b in METAL_PAIRS])
@pytest.mark.parametrize("impl", ["decode", "decode_split"])
def test_metal_paged_own_value_dim(pair, impl):
    # attention_kvcache's decode route (fc_paged): k_cache D_qk wide, v_cache
    # D_v wide, scattered pages, unused rows and table entries poisoned.
    from test_kvcache_op import check_oracle

    dqk, dv = pair
    dtype = METAL_DTYPES[(METAL_PAIRS.index(pair) + (impl == "decode_split")) % 3]
    seqlens = [37, 0, 70]
    kc, vc, table, kcont, vcont = _paged(3, 2, dqk, dv, dtype, 16, seqlens, zlib.crc32(repr((pair, impl)).encode()))
    g = _gen("metal-paged", pair, impl)
    q = torch.randn(3, 4, 2, dqk, generator=g).to(dtype)
    lengths = torch.tensor(seqlens, dtype=torch.int32)
    plan = flash_metal.explain(q, kc, vc, True, None, impl, block_table=table, cache_seqlens=lengths)
    assert plan.dispatches[0].function_constants[12]  # fc_paged (kPagedFunctionConstant)
    out, lse = emulated_metal_kvcache(q, kc, vc, lengths, table, True, None, impl)
    _assert_ran("flash_decode_" + ("split_" if impl == "decode_split" else ""), plan)
    assert out.shape == (3, 4, 2, dv)
    check_oracle(out, lse, q, kcont, vcont, seqlens, True)


# Small ragged shapes through the sanitizing build (bounds, races): each family once, D_v both sides of D_qk.
SANITIZED = [("prefill", (64, 32), torch.float16), ("decode", (32, 64), torch.bfloat16),
             ("split", (96, 64), torch.float32), ("prefill", (40, 72), torch.float32)]


@pytest.mark.parametrize("family,pair,dtype", SANITIZED,
                         ids=[f"{f}-{a}x{b}-{dtype_id(t)}" for f, (a, b), t in SANITIZED])
def test_metal_own_value_dim_sanitized(family, pair, dtype):
    dqk, dv = pair
    impl, nq, nk = FAMILIES[family]
    nq, nk = min(nq, 11), min(nk, 75)
    g = _gen("metal-sanitized", family, pair)
    q, k, v = _qkv(1, 4, 2, nq, nk, dqk, dv, dtype, g, "storage_end")  # v ends where its storage ends
    out, lse = emulated_metal_attention(q, k, v, True, None, impl, instrumented=True)
    assert not torch.isnan(out).any()
    assert_attention_close(out, lse, q, k, v, True)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_metal_own_value_dim_is_the_padded_problem_bit_for_bit(family):
    # Each output column of P.V depends on its own column of v only, so out
    # with D_v = 32 must be, bit for bit, the first 32 columns of the
    # equal-dims run (D = 64) on v zero-padded to 64: same scores, same
    # softmax, same products. The padded run's v is strided ("every_other"),
    # so its fc_dense is off too and both read the same lanes' features.
    dqk, dv = 64, 32
    impl, nq, nk = FAMILIES[family]
    g = _gen("metal-padded", family)
    q, k, v = _qkv(2, 4, 2, nq, nk, dqk, dv, torch.float16, g)
    padded = lay_out(torch.cat([v, torch.zeros(2, 2, nk, dqk - dv, dtype=v.dtype)], -1), "every_other")
    assert not flash_metal.explain(q, k, padded, True, None, impl).dispatches[0].function_constants[DENSE]
    out, lse = emulated_metal_attention(q, k, v, True, None, impl)
    ref_out, ref_lse = emulated_metal_attention(q, k, padded, True, None, impl)
    assert torch.equal(out, ref_out[..., :dv]) and torch.equal(lse, ref_lse)


def test_sdpa_drop_in_runs_its_own_value_dim_on_the_metal_kernels(monkeypatch):
    # The drop-in's op call sent to the emulated Metal backend (as
    # tests/api/test_sdpa.py does): 5-D inputs, GQA, top-left causal with L < S
    # (keys cropped), E_v != E; against PyTorch's SDPA by the 2x rule.
    from backends import run_attention
    from flash_metal import sdpa as sdpa_module
    from test_sdpa import assert_like_sdpa

    def emulated(q, k, v, causal=False, scale=None, impl="auto", **options):
        return run_attention("metal-emu", q, k, v, causal, scale, impl, **options)[0]

    monkeypatch.setattr(sdpa_module.ops, "attention", emulated)
    g = _gen("sdpa-metal")
    q = torch.randn(2, 1, 4, 21, 96, generator=g).half()
    k = torch.randn(2, 1, 2, 30, 96, generator=g).half()
    v = torch.randn(2, 1, 2, 30, 64, generator=g).half()
    assert flash_metal.sdpa_route(q, k, v, is_causal=True, enable_gqa=True).flash_metal
    LAST_DISPATCHES.clear()
    out = flash_metal.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert [d.kernel_name for d, _ in LAST_DISPATCHES][0].startswith("flash_attention_prefill_float16_")
    assert_like_sdpa(out, q, k, v, is_causal=True, enable_gqa=True)


# --- The Metal backward with D_v != D_qk, through the emulator -----------------------------
#
# flash_backward_dq and flash_backward_dkdv take head_dim_v (issue 20 section
# 2): Delta, dP = dO.V^T and dV over D_v, S, dQ and dK over D_qk, in the wider
# dim's bucket (with its feature parts: at 192/128 a part of the 192 bucket
# holds features past D_v). Against the float64 oracle by the 2x rule, grads
# poisoned with NaN (backends.py), and the fused kernels proved to have run
# (not the composite path).
BWD_PAIRS = [(192, 128), (64, 32), (32, 64), (96, 64)]
BWD_CASES = [(pair, dtype) for pair in BWD_PAIRS for dtype in METAL_DTYPES]


def _assert_fused_backward(plan, dqk, dv, dtype, sinks=False):
    # The plan is the fused pair (no composite reason), both dims named, fc_dense off;
    # the emulator ran exactly its dispatches.
    bucket = _bucket(max(dqk, dv))
    names = [d.kernel_name for d in plan.dispatches]
    want = ["flash_backward_dq_", "flash_backward_dkdv_"] + (["flash_sinks_grad"] if sinks else [])
    assert len(names) == len(want) and all(n.startswith(w) for n, w in zip(names, want)), names
    assert all(f"{DTYPE_NAMES[dtype]}_d{bucket}_" in n for n in names[:2]), names
    assert not plan.reason.startswith("composite") and f"D_qk = {dqk}" in plan.reason, plan.reason
    assert f"D_v = {dv}" in plan.reason, plan.reason
    assert not any(d.function_constants[DENSE] for d in plan.dispatches[:2])
    assert [d.kernel_name for d, _ in LAST_DISPATCHES] == names


@pytest.mark.parametrize("pair,dtype", BWD_CASES, ids=[f"{a}x{b}-{dtype_id(t)}" for (a, b), t in BWD_CASES])
def test_metal_backward_own_value_dim(pair, dtype):
    from backends import emulated_metal_attention_backward

    dqk, dv = pair
    i = BWD_CASES.index((pair, dtype))
    g = _gen("metal-backward", pair, dtype_id(dtype))
    nq, nk = (19, 23) if i % 2 else (23, 17)  # ragged both ways
    causal = i % 2 == 0
    options = dict(softcap=4.0) if i % 4 == 1 else dict(window_left=6) if i % 4 == 2 else {}
    q, k, v = _qkv(1, 4, 2, nq, nk, dqk, dv, dtype, g, ["contiguous", "transposed", "offset_slice"][i % 3])
    out, lse = flash_metal.attention_with_lse(q, k, v, causal, **options)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    grad_lse = torch.randn(lse.shape, generator=g) if i % 3 == 0 else None
    grads = emulated_metal_attention_backward(grad_out, q, k, v, out, lse, causal, None, grad_lse, **options)
    plan = flash_metal.explain(q, k, v, causal, backward=True, grad_out=grad_out, out=out, lse=lse,
                               grad_lse=grad_lse, **options)
    _assert_fused_backward(plan, dqk, dv, dtype)
    assert [t.shape for t in grads] == [q.shape, k.shape, v.shape]
    assert not any(torch.isnan(t).any() for t in grads)  # every element written (poisoned with NaN)
    assert_gradients_close(grads, q, k, v, grad_out, causal, None, grad_lse, **options)


def test_metal_backward_own_value_dim_varlen_and_sinks():
    # One varlen call (no-query and no-key sequences, a window) and one with
    # sinks (grad_sinks from Delta, whose rowsum(dO * O) runs over D_v).
    from backends import emulated_metal_attention_backward
    from test_sinks import assert_sinks_grad_close

    g = _gen("metal-backward-varlen")
    lq, lk = [5, 0, 19, 3], [9, 4, 22, 0]
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lq), 4, 192, generator=g).half()
    k = torch.randn(sum(lk), 2, 192, generator=g).half()
    v = torch.randn(sum(lk), 2, 128, generator=g).half()
    lens = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    out, lse = flash_metal.attention_varlen_with_lse(q, k, v, cu_q, cu_k, max(lq), max(lk), True, window_left=7)
    grad_out = torch.randn(out.shape, generator=g).half()
    grads = emulated_metal_attention_backward(grad_out, q, k, v, out, lse, True, None, None, window_left=7, **lens)
    plan = flash_metal.explain(q, k, v, True, backward=True, grad_out=grad_out, out=out, lse=lse, window_left=7,
                               **lens)
    _assert_fused_backward(plan, 192, 128, torch.float16)
    assert plan.dispatches[0].function_constants[9]  # fc_varlen
    assert [t.shape for t in grads] == [q.shape, k.shape, v.shape] and not any(t.isnan().any() for t in grads)
    assert_varlen_gradients_close(grads, q, k, v, grad_out, cu_q, cu_k, True, None, None, window_left=7)

    q, k, v = _qkv(2, 4, 2, 13, 21, 64, 32, torch.float32, g)
    sinks = torch.randn(4, generator=g) * 1.5 + 0.5
    out, lse = flash_metal.attention_with_lse(q, k, v, True, sinks=sinks)
    grad_out, grad_lse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    grads = emulated_metal_attention_backward(grad_out, q, k, v, out, lse, True, None, grad_lse, sinks=sinks)
    plan = flash_metal.explain(q, k, v, True, backward=True, grad_out=grad_out, out=out, lse=lse, grad_lse=grad_lse,
                               sinks=sinks)
    _assert_fused_backward(plan, 64, 32, torch.float32, sinks=True)
    assert not any(t.isnan().any() for t in grads)
    assert_gradients_close(grads[:3], q, k, v, grad_out, True, None, grad_lse, sinks=sinks)
    assert_sinks_grad_close(grads[3], q, k, v, sinks, grad_out, grad_lse, True, {})


# Small ragged shapes through the sanitizing build (bounds, races, barriers in
# the parts past a dim): D_v below and above D_qk, the 192 bucket's parts.
BWD_SANITIZED = [((64, 32), torch.float16), ((32, 64), torch.float32), ((192, 128), torch.bfloat16)]


@pytest.mark.parametrize("pair,dtype", BWD_SANITIZED, ids=[f"{a}x{b}-{dtype_id(t)}" for (a, b), t in BWD_SANITIZED])
def test_metal_backward_own_value_dim_sanitized(pair, dtype):
    from backends import emulated_metal_attention_backward

    dqk, dv = pair
    g = _gen("metal-backward-sanitized", pair)
    q, k, v = _qkv(1, 2, 1, 11, 13, dqk, dv, dtype, g, "storage_end")  # v ends where its storage ends
    out, lse = flash_metal.attention_with_lse(q, k, v, True)
    grad_out = lay_out(torch.randn(out.shape, generator=g).to(dtype), "storage_end")
    grads = emulated_metal_attention_backward(grad_out, q, k, v, out, lse, True, instrumented=True)
    assert [d.kernel_name for d, _ in LAST_DISPATCHES][0].startswith("flash_backward_dq_")
    assert not any(t.isnan().any() for t in grads)
    assert_gradients_close(grads, q, k, v, grad_out, True)


def test_metal_backward_own_value_dim_is_the_padded_problem_bit_for_bit():
    # grad_q and grad_k depend on v and dO only through dP = dO.V^T, which
    # zero columns leave unchanged; grad_v's first D_v columns are P^T.dO's.
    # So D_v = 32 must give, bit for bit, the equal-dims run (D = 64) on v,
    # out and grad_out zero-padded to 64 (strided, so its fc_dense is off too):
    # the same products in the same order, the padding's skipped.
    from backends import emulated_metal_attention_backward

    g = _gen("metal-backward-padded")
    dqk, dv = 64, 32
    q, k, v = _qkv(1, 4, 2, 21, 19, dqk, dv, torch.float16, g)
    out, lse = flash_metal.attention_with_lse(q, k, v, True)
    grad_out = torch.randn(out.shape, generator=g).half()
    pad = lambda t: lay_out(torch.cat([t, torch.zeros(t.shape[:-1] + (dqk - dv,), dtype=t.dtype)], -1),  # noqa: E731
                            "every_other")
    got = emulated_metal_attention_backward(grad_out, q, k, v, out, lse, True)
    ref = emulated_metal_attention_backward(pad(grad_out), q, k, pad(v), pad(out), lse, True)
    assert LAST_DISPATCHES[0][0].kernel_name.startswith("flash_backward_dq_float16_d64")
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2][..., :dv])
    assert torch.equal(ref[2][..., dv:], torch.zeros_like(ref[2][..., dv:]))
