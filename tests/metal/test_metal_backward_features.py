"""The Metal backward's options (issue 11) on Linux, through the emulator.

shaders/backward/attention_backward.h serves attn_mask (bool, additive in q's dtype,
additive float32; any broadcast shape), sliding windows, softcap and packed
variable-length sequences, each behind its function constant (4-9). Here
every option, and their combinations, runs on both kernels in the
SANITIZING emulator build (races, barrier divergence, out-of-bounds) on
small ragged shapes for every dtype and three head-dim buckets (D = 256:
the dK/dV feature split), and on the fast build over wider cases; every
result is compared with the float64 oracle under the 2x rule
(tests/numerics.py). Block skipping is proven two ways: rows that no
window reaches are poisoned with NaN (a skipped block is never read), and
the exact device reads of the instrumented build equal the reads of the
(query block, key block) pairs holding a visible pair, no more.

out and lse come from the float64 oracle (flash_metal/reference.py), rounded
to the inputs' dtype and float32: the backward only needs them to be the
attention of q, k, v.
"""
import itertools
import math

import pytest
import torch

import backends
import flash_metal
from flash_metal.reference import attention_reference, attention_varlen_reference, visible_keys
from numerics import DTYPES, assert_gradients_close, assert_varlen_gradients_close, dtype_id, make_qkv, make_tensor

# Function-constant indices (csrc/metal/plan.h, shaders/common/attention_features.h).
CAUSAL, ALIGN_Q, ALIGN_K, GRAD_LSE, HAS_MASK, MASK_BOOL, MASK_F32, WINDOW_LEFT, SOFTCAP, VARLEN = range(10)
MASK_KINDS = ("bool", "input", "float32")
# Share of mask elements that drop their key: enough that some rows lose
# most keys, few enough that most rows keep some.
DROP = 0.3


def _blocks(dispatch):
    """(bq, bk, dsplit) parsed from a backward kernel name (dsplit 1 for the dQ kernel)."""
    fields = {p[:2]: int(p[2:]) for p in dispatch.kernel_name.split("_")[-4:] if p[:2] in ("bq", "bk", "ds")}
    return fields["bq"], fields["bk"], fields.get("ds", 1)


def _mask(kind, shape, dtype, g):
    """A fresh mask of `kind`: bool (True = attend), or additive (random values, -inf where dropped)."""
    drop = torch.rand(shape, generator=g) < DROP
    if kind == "bool":
        return ~drop
    values = torch.randn(shape, generator=g).masked_fill(drop, float("-inf"))
    return values.to(torch.float32 if kind == "float32" else dtype)


def _case(B, Hq, Hkv, Nq, Nk, D, dtype, causal, seed, grad_lse=False, scale_inputs=1.0, **options):
    """Fresh q, k, v, the oracle's out (in dtype) and lse (float32), grad_out and grad_lse."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, generator=g, scale_inputs=scale_inputs)
    out, lse = attention_reference(q, k, v, causal, None, **options)
    grad_out = make_tensor((B, Hq, Nq, D), "contiguous", dtype, g)
    gl = torch.randn(B, Hq, Nq, generator=g) if grad_lse else None
    return q, k, v, out.to(dtype), lse.float(), grad_out, gl


def _check(backend, case, causal, seed=0, **options):
    """The backward of `case` on `backend` against the oracle; returns the gradients."""
    q, k, v, out, lse, grad_out, gl = case
    if backend == "metal-emu" and seed:
        grads = backends.emulated_metal_attention_backward(grad_out, q, k, v, out, lse, causal, None, gl, seed=seed,
                                                           **options)
    else:
        grads = backends.run_backward(backend, grad_out, q, k, v, out, lse, causal, None, gl, **options)
    assert_gradients_close(grads, q, k, v, grad_out, causal, None, gl, **options)
    return grads


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _varlen_case(lq, lk, Hq, Hkv, D, dtype, causal, seed, grad_lse=False, **options):
    """Packed (total, H, D) inputs for sequences of lq query / lk key rows, the oracle's out and lse."""
    g = torch.Generator().manual_seed(seed)
    cq, ck = _cu(lq), _cu(lk)
    q = torch.randn(int(cq[-1]), Hq, D, generator=g).to(dtype)
    k = torch.randn(int(ck[-1]), Hkv, D, generator=g).to(dtype)
    v = torch.randn(int(ck[-1]), Hkv, D, generator=g).to(dtype)
    out, lse = attention_varlen_reference(q, k, v, cq, ck, causal, None, **options)
    grad_out = torch.randn(q.shape, generator=g).to(dtype)
    gl = torch.randn(Hq, q.shape[0], generator=g) if grad_lse else None
    return q, k, v, out.to(dtype), lse.float(), grad_out, gl, cq, ck, max(lq), max(lk)


def _check_varlen(backend, case, causal, seed=0, **options):
    q, k, v, out, lse, grad_out, gl, cq, ck, mq, mk = case
    if seed:
        grads = backends.emulated_metal_attention_backward(grad_out, q, k, v, out, lse, causal, None, gl, seed=seed,
                                                           cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq,
                                                           max_seqlen_k=mk, **options)
    else:
        grads = backends.run_varlen_backward(backend, grad_out, q, k, v, out, lse, cq, ck, mq, mk, causal, None, gl,
                                             **options)
    assert_varlen_gradients_close(grads, q, k, v, grad_out, cq, ck, causal, None, gl, **options)
    return grads


def _option_constants(causal, options, dtype, varlen=False):
    """Function constants 0 and 4-9 the plan must set for these options (a
    float32 mask with float32 inputs is the input-dtype kind)."""
    mask = options.get("attn_mask")
    kind = None if mask is None else ("bool" if mask.dtype == torch.bool else
                                      "input" if mask.dtype == dtype else "float32")
    return (causal or options.get("window_right", -1) >= 0, mask is not None, kind == "bool", kind == "float32",
            options.get("window_left", -1) >= 0, options.get("softcap", 0.0) > 0, varlen)


def _seen_constants():
    """(constants 0 and 4-9) of both dispatches of the last emulated call."""
    got = [tuple(d.function_constants[i] for i in (CAUSAL, *range(HAS_MASK, VARLEN + 1)))
           for d, _ in backends.LAST_DISPATCHES]
    assert len(got) == 2
    return got


# ------------------------------------------------------------- sanitized


# A head_dim per bucket, ragged inside it (zero padding), 256 exactly (the
# dK/dV kernel's feature split).
SANITIZED_DIMS = (17, 90, 256)


@pytest.mark.parametrize("D", SANITIZED_DIMS, ids=[f"d{d}" for d in SANITIZED_DIMS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_every_option_combination_sanitized(dtype, D):
    # Both kernels, every option alone and together, with and without the
    # upper bound, on lengths ragged for every block (2A + 5 and 2A + 3, A the
    # largest block: several blocks, so windows skip some) and once aligned;
    # GQA (2 query heads per kv head), batch 2 (per-batch mask slices).
    # The plan's constants are checked per case, so each combination really
    # ran; any sanitizer finding raises.
    probe = flash_metal.explain(torch.empty(1, 1, 8, D, dtype=dtype), torch.empty(1, 1, 8, D, dtype=dtype),
                                         torch.empty(1, 1, 8, D, dtype=dtype), backward=True)
    A = max(max(_blocks(d)[:2]) for d in probe.dispatches)
    Nq, Nk = 2 * A + 5, 2 * A + 3
    g = torch.Generator().manual_seed(D)
    cases = [
        # (causal, grad_lse, aligned, options)
        (False, False, False, dict(attn_mask=_mask("bool", (2, 1, Nq, Nk), dtype, g))),
        (True, False, False, dict(attn_mask=_mask("input", (Nq, Nk), dtype, g))),
        (False, True, False, dict(attn_mask=_mask("float32", (1, 2, 1, Nk), dtype, g))),
        (True, False, False, dict(window_left=3)),
        (False, True, False, dict(window_left=A + 2)),
        (False, False, False, dict(window_left=2, window_right=5)),
        (False, False, False, dict(softcap=2.0)),
        (True, True, False, dict(softcap=1.5, window_left=A)),
        (True, True, False, dict(attn_mask=_mask("bool", (2, 2, Nq, Nk), dtype, g), window_left=A - 1, softcap=3.0)),
        (False, False, True, dict(attn_mask=_mask("float32", (2, 2, 2 * A, 2 * A), dtype, g), window_left=5,
                                  window_right=9, softcap=4.0)),
    ]
    for n, (causal, grad_lse, aligned, options) in enumerate(cases):
        nq, nk = (2 * A, 2 * A) if aligned else (Nq, Nk)
        case = _case(2, 2, 1, nq, nk, D, dtype, causal, seed=n, grad_lse=grad_lse, **options)
        _check("metal-emu-sanitized", case, causal, **options)
        want = _option_constants(causal, options, dtype)
        assert _seen_constants() == [want, want], (n, options)
    # Varlen: a long sequence, an empty one, one of length 1, Nq != Nk per
    # sequence, a sequence with queries but no key.
    lq, lk = [A + 3, 0, 1, 2 * A + 1, 4], [A + 7, 3, 1, A + 2, 0]
    for n, (causal, options) in enumerate([(False, {}), (True, dict(window_left=4, softcap=2.5)),
                                          (False, dict(window_left=A, window_right=2))]):
        case = _varlen_case(lq, lk, 2, 1, D, dtype, causal, seed=50 + n, grad_lse=n == 1, **options)
        _check_varlen("metal-emu-sanitized", case, causal, **options)
        want = _option_constants(causal, options, dtype, varlen=True)
        assert _seen_constants() == [want, want], (n, options)


# ------------------------------------------------------------- masks

# Mask shapes against (B, Hq, Nq, Nk) = (2, 4, 37, 45): every broadcast
# pattern the op accepts, including a per-row (…, Nq, 1) mask (whole rows
# dropped: fully masked rows) and a per-key padding mask (B, 1, 1, Nk).
MASK_SHAPES = [(45,), (37, 45), (2, 1, 1, 45), (1, 4, 37, 1), (4, 1, 45), (2, 4, 37, 45)]


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=["x".join(map(str, s)) for s in MASK_SHAPES])
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_mask_broadcast_shapes_and_kinds(dtype, kind, shape):
    # A mask alone or a mask plus causal, alternating so each kind and each
    # dtype meets both.
    causal = (MASK_SHAPES.index(shape) + MASK_KINDS.index(kind)) % 2 == 1
    g = torch.Generator().manual_seed(len(shape) * 11 + shape[-1])
    mask = _mask(kind, shape, dtype, g)
    case = _case(2, 4, 2, 37, 45, 64, dtype, causal, seed=len(shape) + causal, grad_lse=causal, attn_mask=mask)
    _check("metal-emu", case, causal, attn_mask=mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_mask_strided_view(dtype):
    # A mask that is itself a non-contiguous view (transposed storage, every
    # other key): read through its strides, never copied.
    g = torch.Generator().manual_seed(7)
    base = _mask("input", (2, 90, 29), dtype, g)  # (B, Nk * 2, Nq)
    mask = base.transpose(1, 2)[:, :, ::2].unsqueeze(1)  # (2, 1, 29, 45)
    assert not mask.is_contiguous()
    case = _case(2, 2, 1, 29, 45, 40, dtype, True, seed=3, attn_mask=mask)
    _check("metal-emu-sanitized", case, True, attn_mask=mask)


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_fully_masked_rows_give_zero_and_add_nothing(kind):
    # Rows whose every key is masked (bool False, additive -inf, or an
    # additive float32 finfo.min, which the masked-key rule counts as masked)
    # have lse = -inf: grad_q exactly 0 and, whatever their grad_out, no
    # effect on grad_k / grad_v. Never NaN.
    dtype, Nq, Nk = torch.float16, 40, 33
    g = torch.Generator().manual_seed(5)
    mask = _mask(kind, (1, 1, Nq, Nk), dtype, g)
    dead = [0, 9, 10, 39]
    fill = {"bool": False, "input": float("-inf"), "float32": torch.finfo(torch.float32).min}[kind]
    mask[..., dead, :] = fill
    for causal in (False, True):
        case = _case(1, 2, 1, Nq, Nk, 64, dtype, causal, seed=1, grad_lse=True, attn_mask=mask)
        assert torch.isneginf(case[4][..., dead]).all()
        dq, dk, dv = _check("metal-emu-sanitized", case, causal, attn_mask=mask)
        assert (dq[..., dead, :] == 0).all() and (dq != 0).any()
        q, k, v, out, lse, grad_out, gl = case
        loud, loud_gl = grad_out.clone(), gl.clone()
        loud[..., dead, :] = 1e4
        loud_gl[..., dead] = 1e4
        again = backends.run_backward("metal-emu", loud, q, k, v, out, lse, causal, None, loud_gl, attn_mask=mask)
        assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), again))


# ------------------------------------------------------------- windows

# (Nq, Nk, window_left, window_right, causal): windows smaller than a block,
# straddling block edges (33, 40 against blocks of 8..32), left-only,
# right-only, both without causal, the diagonal alone (0, causal), Nq != Nk
# both ways (rows with no key: Nq > Nk with a tight right bound).
WINDOWS = [
    (100, 100, 3, -1, True),
    (100, 100, 33, -1, True),
    (70, 130, 40, -1, True),
    (130, 70, 20, 2, False),
    (100, 90, 17, -1, False),
    (90, 100, -1, 7, False),
    (77, 77, 9, 9, False),
    (64, 64, 0, -1, True),
]


@pytest.mark.parametrize("window", WINDOWS, ids=[f"{w[0]}x{w[1]}_l{w[2]}_r{w[3]}{'_c' if w[4] else ''}" for w in WINDOWS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_windows(dtype, window):
    Nq, Nk, left, right, causal = window
    options = dict(window_left=left, window_right=right)
    for D, grad_lse in ((64, False), (96, True)):
        case = _case(1, 2, 1, Nq, Nk, D, dtype, causal, seed=Nq + left + D, grad_lse=grad_lse, **options)
        _check("metal-emu", case, causal, **options)


@pytest.mark.parametrize("softcap", [5.0, 30.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_softcap_with_large_logits(dtype, softcap):
    # Inputs scaled so the raw logits reach several times the cap (tanh
    # saturates: its derivative 1 - t^2 is far from 1 and must be applied).
    for causal, grad_lse, D in ((False, False, 64), (True, True, 256)):
        case = _case(1, 2, 2, 45, 52, D, dtype, causal, seed=int(softcap) + D, grad_lse=grad_lse,
                     scale_inputs=3.0 * math.sqrt(softcap), softcap=softcap)
        raw = (case[0].double() @ case[1].double().transpose(-1, -2)).abs().max().item() / math.sqrt(D)
        assert raw > 3 * softcap
        _check("metal-emu", case, causal, softcap=softcap)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_every_option_with_grad_lse_gqa_and_batches(dtype):
    g = torch.Generator().manual_seed(2)
    mask = _mask("bool", (3, 1, 50, 61), dtype, g)
    options = dict(attn_mask=mask, window_left=12, window_right=4, softcap=6.0)
    case = _case(3, 6, 2, 50, 61, 80, dtype, False, seed=2, grad_lse=True, **options)
    _check("metal-emu", case, False, **options)


# ------------------------------------------------------------- varlen

# (query lengths, key lengths): length-1 sequences, empty ones (no query,
# no key, both), Nq_b != Nk_b both ways, several blocks long.
VARLEN_LENGTHS = [
    ([1, 40, 0, 7, 33], [1, 25, 5, 7, 70]),
    ([65, 3, 9, 0], [0, 3, 30, 0]),
    ([100, 1], [37, 96]),
]


@pytest.mark.parametrize("lengths", VARLEN_LENGTHS, ids=["mixed", "empty_sides", "long"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_varlen(dtype, lengths):
    lq, lk = lengths
    for n, (causal, options) in enumerate([(False, {}), (True, {}), (True, dict(window_left=6)),
                                          (False, dict(window_left=10, window_right=3, softcap=3.0))]):
        case = _varlen_case(lq, lk, 4, 2, 64 if n % 2 else 40, dtype, causal, seed=n + len(lq), grad_lse=n >= 2,
                            **options)
        _check_varlen("metal-emu", case, causal, **options)


# ------------------------------------------------------------- determinism


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_deterministic_with_options_across_thread_schedules(dtype):
    # No atomics with the options either: bitwise-equal gradients whatever
    # order the emulator runs the threads in (seed 0 fixed, others shuffled).
    g = torch.Generator().manual_seed(4)
    mask = _mask("input", (2, 1, 57, 70), dtype, g)
    options = dict(attn_mask=mask, window_left=20, softcap=4.0)
    case = _case(2, 4, 2, 57, 70, 64, dtype, True, seed=4, grad_lse=True, **options)
    first = _check("metal-emu", case, True, **options)
    vcase = _varlen_case([30, 1, 44], [52, 9, 0], 4, 2, 64, dtype, True, seed=6, window_left=8, softcap=2.0)
    vfirst = _check_varlen("metal-emu", vcase, True, window_left=8, softcap=2.0)
    for seed in (3, 11):
        again = _check("metal-emu", case, True, seed=seed, **options)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
        again = _check_varlen("metal-emu", vcase, True, seed=seed, window_left=8, softcap=2.0)
        assert all(torch.equal(a, b) for a, b in zip(vfirst, again))


# ------------------------------------------------------------- block skipping


def test_window_skips_unseen_key_blocks_nan_poisoned():
    # Causal + left window with Nk > Nq: query 0 sees keys from
    # Nk - Nq - left on, so no query sees the keys before: whole key blocks
    # of them are poisoned with NaN in k and v. The dQ kernel must not load
    # them (it would compute NaN), the dK/dV kernel must give them exactly 0
    # (they see no query block) and every other gradient is bitwise the
    # clean run's.
    Nq, Nk, left, dtype = 40, 150, 30, torch.float32
    options = dict(window_left=left)
    case = _case(1, 2, 1, Nq, Nk, 64, dtype, True, seed=9, **options)
    first_key = Nk - Nq - left
    assert not visible_keys(Nq, Nk, True, left)[:, :first_key].any()
    cut = first_key // 32 * 32  # whole blocks of every size the plan uses (8..32)
    assert cut >= 64
    clean = _check("metal-emu", case, True, **options)
    q, k, v, out, lse, grad_out, _ = case
    kp, vp = k.clone(), v.clone()
    kp[..., :cut, :] = float("nan")
    vp[..., :cut, :] = float("nan")
    dq, dk, dv = backends.run_backward("metal-emu-sanitized", grad_out, q, kp, vp, out, lse, True, None, None, **options)
    assert torch.equal(dq, clean[0])
    assert (dk[..., :cut, :] == 0).all() and (dv[..., :cut, :] == 0).all()
    assert torch.equal(dk[..., cut:, :], clean[1][..., cut:, :]) and torch.equal(dv[..., cut:, :], clean[2][..., cut:, :])


def test_window_skips_query_blocks_that_see_no_key_nan_poisoned():
    # A right window with Nq > Nk: query i sees keys up to i + Nk - Nq + right,
    # so the first Nq - Nk - right rows see none (lse = -inf). Whole query
    # blocks of them are poisoned with NaN in q and grad_out: the dK/dV
    # kernel must not load them, their grad_q is exactly 0, and every other
    # gradient is bitwise the clean run's.
    Nq, Nk, right, dtype = 150, 40, 5, torch.float16
    options = dict(window_left=12, window_right=right)
    case = _case(1, 2, 1, Nq, Nk, 64, dtype, False, seed=10, **options)
    dead = Nq - Nk - right
    assert not visible_keys(Nq, Nk, False, 12, right)[:dead].any()
    cut = dead // 32 * 32
    assert cut >= 64
    clean = _check("metal-emu", case, False, **options)
    q, k, v, out, lse, grad_out, _ = case
    qp, gp = q.clone(), grad_out.clone()
    qp[..., :cut, :] = float("nan")
    gp[..., :cut, :] = float("nan")
    dq, dk, dv = backends.run_backward("metal-emu-sanitized", gp, qp, k, v, out, lse, False, None, None, **options)
    assert (dq[..., :cut, :] == 0).all() and torch.equal(dq[..., cut:, :], clean[0][..., cut:, :])
    assert torch.equal(dk, clean[1]) and torch.equal(dv, clean[2])


def _ideal_rows(vis, own, streamed, own_is_query):
    """Streamed rows a kernel must load: over its own blocks, every streamed
    block holding some visible (query, key) pair with the own block."""
    Nq, Nk = vis.shape
    n_own, n_str = (Nq, Nk) if own_is_query else (Nk, Nq)
    rows = 0
    for o0 in range(0, n_own, own):
        for s0 in range(0, n_str, streamed):
            qs, ks = (slice(o0, o0 + own), slice(s0, s0 + streamed)) if own_is_query else \
                     (slice(s0, s0 + streamed), slice(o0, o0 + own))
            if vis[qs, ks].any():
                rows += min(streamed, n_str - s0)
    return rows


@pytest.mark.parametrize("window", [(16, -1, True), (24, 8, False)], ids=["causal_l16", "l24_r8"])
def test_window_reads_only_blocks_with_visible_pairs(window):
    # The instrumented build's exact device reads: the dQ kernel reads K and
    # V only for key blocks holding a visible pair with its query block, the
    # dK/dV kernel Q and grad_out only for query blocks holding one with its
    # key block (both window bounds), so reads grow with N * window: doubling
    # N doubles them (within a block's rounding), where without a window
    # they quadruple.
    left, right, causal = window
    options = dict(window_left=left, window_right=right)
    Hq, Hkv, D, dtype, e = 2, 1, 64, torch.float16, 2
    reads = {}
    for N in (192, 384):
        case = _case(1, Hq, Hkv, N, N, D, dtype, causal, seed=N, **options)
        _check("metal-emu-sanitized", case, causal, **options)
        (dq, dq_counts), (dkdv, dkdv_counts) = backends.LAST_DISPATCHES
        (bq, bk, _), (kbq, kbk, split) = _blocks(dq), _blocks(dkdv)
        vis = visible_keys(N, N, causal, left, right)
        key_rows = _ideal_rows(vis, bq, bk, own_is_query=True)
        query_rows = _ideal_rows(vis, kbk, kbq, own_is_query=False)
        r1, r2 = dq_counts.device_bytes_read_by_index, dkdv_counts.device_bytes_read_by_index
        for name in ("k", "v"):
            assert r1[dq.buffers[name]] == Hq * key_rows * D * e, name
        for name in ("q", "grad_out"):
            assert r2[dkdv.buffers[name]] == Hq * query_rows * D * e, name  # once per threadgroup: parts share tiles
        reads[N] = (r1[dq.buffers["k"]], r2[dkdv.buffers["q"]], math.ceil(N / bq) * N * Hq * D * e)
    (k_small, q_small, _), (k_large, q_large, k_full) = reads[192], reads[384]
    assert 1.9 * k_small <= k_large <= 2.2 * k_small and 1.9 * q_small <= q_large <= 2.2 * q_small
    assert k_large < k_full / 3  # against every key block for every query block


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_fast_math_build_with_options(dtype):
    # Apple's compiler defaults to fast math (no infinities): an additive -inf
    # mask, fully masked rows (lse = -inf) and softcap's tanh must still give
    # the oracle's gradients when clang may assume every value finite.
    g = torch.Generator().manual_seed(12)
    mask = _mask("input", (1, 1, 37, 41), dtype, g)
    mask[..., [3, 30], :] = float("-inf")
    options = dict(attn_mask=mask, window_left=9, softcap=3.0)
    case = _case(1, 2, 1, 37, 41, 64, dtype, True, seed=12, grad_lse=True, **options)
    assert torch.isneginf(case[4]).any()
    q, k, v, out, lse, grad_out, gl = case
    grads = backends.run_backward("metal-emu-fast-math", grad_out, q, k, v, out, lse, True, None, gl, **options)
    assert_gradients_close(grads, q, k, v, grad_out, True, None, gl, **options)
    assert backends.metal_library(False, True).fast_math
