"""attention_forward against the float64 oracle, on every backend.

Backends: "cpu" (the C++ flash kernel), "metal-emu" (the real shaders, run
through the Metal emulator with the host's own launch plan), and "mps" (a
Mac with a usable GPU; skipped elsewhere). Outputs are NaN-poisoned before
each call (conftest.py for the C++ ops, backends.py for the emulator), so an
element a kernel never writes fails the check. Tests that take a
(backend, impl) pair run every Metal kernel, not just the one "auto" picks.
"""
import pytest
import torch

from backends import backend_param, run_attention
from numerics import DTYPES, assert_attention_close, attention_tolerances, dtype_id, make_qkv

BACKENDS = [backend_param(b) for b in ("cpu", "metal-emu", "mps")]
# (backend, impl): the CPU kernel (which accepts only "auto"), and on the
# emulator and a Mac every Metal impl, "auto" included.
_PAIRS_BI = [("cpu", "auto")] + [(b, i) for b in ("metal-emu", "mps") for i in ("auto", "untiled", "tiled")]
BACKEND_IMPLS = [pytest.param(b, i, id=f"{b}-{i}", marks=backend_param(b).marks) for b, i in _PAIRS_BI]
HEAD_DIMS = [1, 32, 63, 64, 80, 128, 256]
# (Nq, Nk) pairs straddling block edges, and their swaps.
_PAIRS = [(1, 1), (1, 239), (63, 65), (127, 512), (1000, 1000), (2048, 1)]
SEQ_PAIRS = sorted(set(_PAIRS + [(b, a) for a, b in _PAIRS]))
HEADS = {"mha": (4, 4), "gqa4": (8, 2), "mqa": (4, 1)}
# (heads, layout) pairs: one layout for all of q, k, v; every layout meets
# some head configuration and every configuration two layouts (the full
# product would run 15 cases per shape and kernel for little more coverage).
# every_other and d_outer have a feature stride other than 1.
HEAD_LAYOUTS = [("mha", "contiguous"), ("gqa4", "transposed"), ("mqa", "offset_slice"),
                ("gqa4", "every_other"), ("mqa", "d_outer"), ("mha", "every_other")]



@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk", SEQ_PAIRS, ids=[f"{a}x{b}" for a, b in SEQ_PAIRS])
@pytest.mark.parametrize("d", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_shapes(backend, dtype, d, nq, nk, causal):
    g = torch.Generator().manual_seed(hash((d, nq, nk, causal)) % 2**31)
    q, k, v = make_qkv(1, 1, 1, nq, nk, d, dtype, generator=g)
    out, lse = run_attention(backend, q, k, v, causal)
    assert_attention_close(out, lse, q, k, v, causal)


@pytest.mark.parametrize("backend,impl", BACKEND_IMPLS)
@pytest.mark.parametrize("heads,layout", HEAD_LAYOUTS, ids=[f"{h}-{lay}" for h, lay in HEAD_LAYOUTS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("nq,nk,d", [(63, 65, 80), (130, 77, 64)], ids=["63x65d80", "130x77d64"])
def test_heads_and_layouts(backend, impl, dtype, nq, nk, d, causal, heads, layout):
    hq, hkv = HEADS[heads]
    # A stable seed per case (hash() of a str changes from run to run).
    g = torch.Generator().manual_seed(1000 * nq + HEAD_LAYOUTS.index((heads, layout)))
    q, k, v = make_qkv(2, hq, hkv, nq, nk, d, dtype, layout=layout, generator=g)
    out, lse = run_attention(backend, q, k, v, causal, None, impl)
    assert_attention_close(out, lse, q, k, v, causal)
    assert out.is_contiguous()


# (q, k, v) layouts, each tensor its own: k and v always differ, and each of
# q, k and v in turn has a feature stride other than 1 while the others do
# not (the first two rows: only v's, only k's).
MIXED_LAYOUTS = [
    ("contiguous", "contiguous", "every_other"),
    ("contiguous", "every_other", "contiguous"),
    ("every_other", "transposed", "offset_slice"),
    ("transposed", "d_outer", "storage_end"),
    ("offset_slice", "storage_end_bnhd", "d_outer"),
    ("d_outer", "offset_slice", "transposed"),
]
# Decode-like (B, Hq, Hkv, Nq, Nk, D): few query rows against a long cache.
# The CPU kernel packs the heads of a GQA group into one item of
# group * Nq query columns; with <= 16 columns, float32 and D a multiple of
# the vector width (8 on AVX2, 4 on NEON) it reads K and V in place (its
# decode path). Columns here: 4, 8, 4, 16 (the limit), 9, and 32 (packed
# again); D = 40 is a multiple of 8 but not 16, D = 36 not of 8 (packed on
# AVX2, in place with NEON's 4-wide vectors).
DECODE_SHAPES = [
    (1, 8, 2, 1, 300, 64),
    (2, 4, 1, 2, 517, 128),
    (1, 4, 4, 4, 1000, 64),
    (1, 4, 2, 8, 333, 128),
    (1, 6, 2, 3, 97, 40),
    (1, 8, 2, 8, 130, 36),
]


@pytest.mark.parametrize("backend,impl", BACKEND_IMPLS)
@pytest.mark.parametrize("layouts", MIXED_LAYOUTS, ids=["-".join(m) for m in MIXED_LAYOUTS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_mixed_layouts_decode(backend, impl, dtype, layouts):
    for i, (b, hq, hkv, nq, nk, d) in enumerate(DECODE_SHAPES):
        g = torch.Generator().manual_seed(100 + i)
        q, k, v = make_qkv(b, hq, hkv, nq, nk, d, dtype, layout=layouts, generator=g)
        assert [t.stride(3) != 1 for t in (q, k, v)] == [x in ("every_other", "d_outer") for x in layouts]
        for causal in (False, True):
            out, lse = run_attention(backend, q, k, v, causal, None, impl)
            assert_attention_close(out, lse, q, k, v, causal)


def _shifted_scores_inputs(b, hq, hkv, nq, nk, d, dtype, shifts, sign, g):
    """q, k, v whose scaled scores are sign * (x_i . y_j + shifts[i % len]), all exact.

    x and y have entries in {-1, 0, 1} on their first 31 features (|x . y| <= 31);
    the last feature holds the row's shift in q and 1 in k, so with scale
    sign * 1 every score of row i moves by the same constant. Integers up to
    256 are exact in bfloat16, float16 and float32, and so is every partial
    sum here: each dtype's inputs, PyTorch's same-dtype scores and the
    oracle's all agree exactly, and only the softmax itself rounds. k's other
    features are random; q is 0 there, so they do not change the scores.
    """
    active = min(d - 1, 31)
    x = torch.randint(-1, 2, (b, hq, nq, active), generator=g).float()
    y = torch.randint(-1, 2, (b, hkv, nk, active), generator=g).float()
    q = torch.zeros(b, hq, nq, d)
    q[..., :active] = x
    q[..., -1] = torch.tensor([float(shifts[i % len(shifts)]) for i in range(nq)])
    k = torch.randn(b, hkv, nk, d, generator=g)
    k[..., :active] = y
    k[..., -1] = 1.0
    v = torch.randn(b, hkv, nk, d, generator=g)
    assert (q.abs().sum(-1) <= 256).all()
    return q.to(dtype), k.to(dtype), v.to(dtype), float(sign)


# Shapes for the score-shift tests (B, Hq, Hkv, Nq, Nk, D): several key tiles
# and CPU key blocks, GQA, and a decode-like one.
SHIFT_SHAPES = [(1, 2, 1, 40, 100, 32), (2, 4, 2, 3, 130, 64), (1, 2, 2, 70, 45, 40)]


@pytest.mark.parametrize("backend,impl", BACKEND_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("sign", [1, -1], ids=["scale+1", "scale-1"])
def test_all_negative_logits(backend, impl, dtype, sign):
    # Every score of every row lies in [-256, -119]: below -104 (-150 in base
    # 2), where float32's exp underflows to 0. A running max seeded with 0
    # instead of -inf measures every key against 0, loses them all, and
    # returns zeros with lse = -inf. With scale -1 the raw products are large
    # and positive and the negative scale makes them negative.
    shifts = [-150, -225, -181, -199, -163]
    for i, (b, hq, hkv, nq, nk, d) in enumerate(SHIFT_SHAPES):
        g = torch.Generator().manual_seed(200 + i)
        q, k, v, scale = _shifted_scores_inputs(b, hq, hkv, nq, nk, d, dtype, [sign * c for c in shifts], sign, g)
        for causal in (False, True):
            out, lse = run_attention(backend, q, k, v, causal, scale, impl)
            assert_attention_close(out, lse, q, k, v, causal, scale)
            fin = torch.isfinite(lse)
            assert fin.any() and (lse[fin] < -100).all()


@pytest.mark.parametrize("backend,impl", BACKEND_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_row_shift_invariance(backend, impl, dtype):
    # softmax(s + c) = softmax(s): shifting every score of a row by the same
    # constant leaves its output unchanged and moves its lse by c. Shifts up
    # to +225 (exp overflows float32 beyond 88) and down to -225 (every
    # weight underflows), on the same x, y and v as unshifted rows.
    shifts = [0, 225, -225, 75, -150, 150, -75]
    for i, (b, hq, hkv, nq, nk, d) in enumerate(SHIFT_SHAPES):
        g = torch.Generator().manual_seed(300 + i)
        q, k, v, scale = _shifted_scores_inputs(b, hq, hkv, nq, nk, d, dtype, shifts, 1, g)
        q0 = q.clone()
        q0[..., -1] = 0
        for causal in (False, True):
            out, lse = run_attention(backend, q, k, v, causal, scale, impl)
            out0, lse0 = run_attention(backend, q0, k, v, causal, scale, impl)
            assert_attention_close(out, lse, q, k, v, causal, scale)
            _, _, tol0, ltol0 = attention_tolerances(q0, k, v, causal, scale)
            assert (out.double() - out0.double()).abs().max().item() <= tol0
            fin = torch.isfinite(lse0)
            assert torch.equal(fin, torch.isfinite(lse))
            # lse moves by the shift, within lse0's tolerance plus a few float32
            # ulps of the shift (the shifted scores are that much larger).
            shift = q[..., -1].float()
            slack = ltol0 + 8 * torch.finfo(torch.float32).eps * shift[fin].abs()
            assert ((lse - lse0 - shift)[fin].abs() <= slack).all()


@pytest.mark.parametrize("backend,impl", BACKEND_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_custom_scale_and_batch(backend, impl, dtype):
    q, k, v = make_qkv(3, 2, 2, 37, 45, 48, dtype)
    for scale in (0.0, 0.05, -0.3, 2.0):
        out, lse = run_attention(backend, q, k, v, False, scale, impl)
        assert_attention_close(out, lse, q, k, v, False, scale)


@pytest.mark.parametrize("backend,impl", BACKEND_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_fully_masked_rows_are_zero(backend, impl, dtype):
    # Causal with Nk < Nq: rows 0 .. Nq-Nk-1 see no key at all.
    q, k, v = make_qkv(1, 2, 1, 50, 20, 32, dtype)
    out, lse = run_attention(backend, q, k, v, True, None, impl)
    assert torch.equal(out[:, :, :30], torch.zeros_like(out[:, :, :30]))
    assert torch.isinf(lse[:, :, :30]).all() and (lse[:, :, :30] < 0).all()
    assert_attention_close(out, lse, q, k, v, True)


@pytest.mark.parametrize("backend,impl", BACKEND_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_extreme_logits(backend, impl, dtype, causal):
    # Scale 1e3 and inputs up to 1e4: logits near 1e11. A kernel that
    # exponentiates without subtracting the running max overflows to inf/NaN.
    # PyTorch's float16 attention overflows here and bfloat16's loses the
    # scores to rounding; the tolerance must still mean something
    # (numerics.yardstick_errors), so an all-zero output has to fail.
    g = torch.Generator().manual_seed(5)
    q, k, v = make_qkv(1, 2, 2, 70, 90, 16, dtype, generator=g)
    q = (q.float() * 2500).clamp(-1e4, 1e4).to(dtype)
    k = (k.float() * 2500).clamp(-1e4, 1e4).to(dtype)
    out, lse = run_attention(backend, q, k, v, causal, 1e3, impl)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_attention_close(out, lse, q, k, v, causal, 1e3)
    with pytest.raises(AssertionError, match="out: max error"):
        assert_attention_close(torch.zeros_like(out), lse, q, k, v, causal, 1e3)


@pytest.mark.parametrize("backend,impl", BACKEND_IMPLS)
def test_stale_cache_values_never_leak(backend, impl):
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
        out, lse = run_attention(backend, q, k, v, causal, None, impl)
        assert out.abs().max() < 10
        assert_attention_close(out, lse, q, k, v, causal)


@pytest.mark.parametrize("backend,impl", BACKEND_IMPLS)
def test_zero_stride_broadcast_kv(backend, impl):
    # An expanded (stride-0) kv head dimension is a legal view: read in place.
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 33, 32, generator=g)
    k = torch.randn(1, 1, 40, 32, generator=g).expand(1, 4, 40, 32)
    v = torch.randn(1, 1, 40, 32, generator=g).expand(1, 4, 40, 32)
    out, lse = run_attention(backend, q, k, v, True, None, impl)
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
