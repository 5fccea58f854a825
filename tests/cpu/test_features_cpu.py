"""The CPU kernels' own checks of issue 11's options (csrc/cpu/).

tests/api/test_features.py runs the option grid on every backend; this file
checks what is particular to the CPU kernels: key blocks outside a window are
really skipped (keys no query may see are NaN-poisoned, so touching one makes
a NaN), forward and backward, in the per-(batch, kv head) backward and in its
chunked fallback (threads > B * Hkv); per-sequence offsets of varlen across
several query blocks; masks read through arbitrary strides (stride 0,
sliced, transposed) and across key blocks; GQA heads packed side by side
with a per-head mask; fully masked rows; softcap with large logits. Every
result is checked against the float64 oracle (tests/numerics.py).
"""
import zlib

import pytest
import torch

import flash_metal
from numerics import (
    DTYPES,
    assert_attention_close,
    assert_gradients_close,
    assert_varlen_close,
    assert_varlen_gradients_close,
    dtype_id,
    make_qkv,
)


def _gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _forward(q, k, v, causal, options):
    return flash_metal.attention_with_lse(q, k, v, causal, None, "auto", **options)


def _backward(grad_out, q, k, v, out, lse, causal, grad_lse, options):
    return torch.ops.flash_metal.attention_backward(grad_out, q, k, v, out, lse, causal, None, grad_lse, "auto",
                                                    **options)[:3]


def _grad_inputs(out, lse, dtype, g):
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    grad_lse = torch.where(torch.isfinite(lse), torch.randn(lse.shape, generator=g), 0.0)
    return grad_out, grad_lse


@pytest.fixture
def two_threads():
    """The kernels at 2 threads (the decomposition these tests aim at), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


# --- window block skipping ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("nq,left,right", [(150, 70, 0), (1, 100, -1), (5, 20, 3), (230, 0, 0)])
def test_keys_left_of_every_window_are_never_read(dtype, nq, left, right, two_threads):
    # Bottom-right alignment with Nk >> Nq: query i sees keys from
    # i + Nk - Nq - left, so every key before Nk - Nq - left is outside all
    # windows. They are NaN in k and v: a kernel that multiplies even one of
    # them (a P of 0 times a NaN V is NaN) fails, forward or backward.
    # (1, 100): the in-place decode path; (5, 20, 3): a right window too;
    # (150, ...), (230, ...): several query blocks, sub-blocks and chunks.
    nk = 700
    g = _gen("poison", nq, left, right, str(dtype))
    q, k, v = make_qkv(1, 4, 2, nq, nk, 64, dtype, generator=g)
    first = nk - nq - left
    kp, vp = k.clone(), v.clone()
    kp[:, :, :first] = float("nan")
    vp[:, :, :first] = float("nan")
    options = dict(window_left=left, window_right=right)
    causal = right == 0
    out, lse = _forward(q, kp, vp, causal, options)
    assert_attention_close(out, lse, q, k, v, causal, None, **options)
    grad_out, grad_lse = _grad_inputs(out, lse, dtype, g)
    grads = _backward(grad_out, q, kp, vp, out, lse, causal, grad_lse, options)
    assert (grads[1][:, :, :first] == 0).all() and (grads[2][:, :, :first] == 0).all()
    assert_gradients_close(grads, q, k, v, grad_out, causal, None, grad_lse, **options)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("path", ["auto", "emulated-brgemm"])
def test_varlen_windows_skip_each_sequences_own_prefix(dtype, two_threads, path, monkeypatch):
    # "emulated-brgemm": the VNNI-packed path on any CPU (its column form's odd blocks must not
    # multiply the next sequence's poisoned V^T column by P's zero pad row: 0 * NaN is NaN).
    if path == "emulated-brgemm":
        if dtype == torch.float32:
            pytest.skip("the brgemm path is for 16-bit dtypes; float32 runs the vector path under auto already")
        monkeypatch.setenv("FLASH_METAL_CPU_PATH", "brgemm")
        monkeypatch.setenv("FLASH_METAL_CPU_VNNI", "emulate")
    # Per sequence, keys before Nk_b - Nq_b - left are poisoned: the skip uses
    # each sequence's own offsets and lengths (several query blocks in the
    # second sequence, Nq_b > Nk_b in the third, a length-1 query in the last).
    g = _gen("varlen-poison", str(dtype))
    lq, lk, left = [40, 210, 30, 1], [300, 400, 12, 90], 25
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lq), 4, 64, generator=g).to(dtype)
    k = torch.randn(sum(lk), 2, 64, generator=g).to(dtype)
    v = torch.randn(sum(lk), 2, 64, generator=g).to(dtype)
    kp, vp = k.clone(), v.clone()
    poisoned = torch.zeros(sum(lk), dtype=torch.bool)
    for b in range(4):
        first = lk[b] - lq[b] - left
        if first > 0:
            poisoned[cu_k[b]:cu_k[b] + first] = True
    kp[poisoned] = float("nan")
    vp[poisoned] = float("nan")
    options = dict(window_left=left, softcap=20.0)
    out, lse = flash_metal.attention_varlen_with_lse(q, kp, vp, cu_q, cu_k, max(lq), max(lk), True, **options)
    assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, True, None, **options)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    grads = torch.ops.flash_metal.attention_varlen_backward(grad_out, q, kp, vp, out, lse, cu_q, cu_k, max(lq),
                                                            max(lk), True, None, None, **options)
    assert (grads[1][poisoned] == 0).all() and (grads[2][poisoned] == 0).all()
    assert_varlen_gradients_close(grads, q, k, v, grad_out, cu_q, cu_k, True, None, None, **options)


# --- the chunked backward ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_chunked_backward_with_every_option_is_correct_and_deterministic(dtype, two_threads):
    # B * Hkv = 1 on 2 threads: the backward cuts the kv head's query rows
    # into chunks that write partial dK/dV, summed in order afterwards.
    g = _gen("chunked", str(dtype))
    q, k, v = make_qkv(1, 3, 1, 300, 340, 64, dtype, generator=g)
    mask = torch.randn(1, 3, 300, 340, generator=g).to(dtype)
    mask[torch.rand(mask.shape, generator=g) > 0.8] = float("-inf")
    options = dict(attn_mask=mask, window_left=120, window_right=30, softcap=8.0)
    out, lse = _forward(q, k, v, False, options)
    assert_attention_close(out, lse, q, k, v, False, None, **options)
    grad_out, grad_lse = _grad_inputs(out, lse, dtype, g)
    grads = _backward(grad_out, q, k, v, out, lse, False, grad_lse, options)
    assert_gradients_close(grads, q, k, v, grad_out, False, None, grad_lse, **options)
    again = _backward(grad_out, q, k, v, out, lse, False, grad_lse, options)
    for a, b in zip(grads, again):
        assert torch.equal(a, b), "the chunked backward is not deterministic"


# --- masks through their strides ---------------------------------------------------------------


def _masks(kind, dtype, b, hq, nq, nk, g):
    """Masks of one kind with unusual strides, each broadcastable to (b, hq, nq, nk)."""
    def values(shape):
        keep = torch.rand(shape, generator=g) > 0.3
        if kind == "bool":
            return keep
        bias = torch.randn(shape, generator=g)
        return torch.where(keep, bias, float("-inf")).to(torch.float32 if kind == "float32" else dtype)

    return {
        # stride 0 on batch and heads, made by expand()
        "expanded": values((1, 1, nq, nk)).expand(b, hq, nq, nk),
        # every other key of a wider mask: key stride 2
        "key_stride_2": values((b, hq, nq, 2 * nk))[..., ::2],
        # (b, hq, nk, nq) transposed: key stride > query stride
        "transposed": values((b, hq, nk, nq)).transpose(-1, -2),
        # one row per head, stride 0 over queries
        "per_head_rows": values((1, hq, 1, nk)),
    }


# (dtype, mask kind): an additive float32 mask with float32 inputs is the "input" kind.
MASK_CASES = [(d, kind) for d in DTYPES for kind in ("bool", "input", "float32")
              if not (kind == "float32" and d == torch.float32)]


@pytest.mark.parametrize("dtype,kind", MASK_CASES, ids=[f"{dtype_id(d)}-{kind}" for d, kind in MASK_CASES])
@pytest.mark.parametrize("nq,nk", [(100, 200), (5, 150)])
def test_masks_read_through_their_strides(dtype, kind, nq, nk, two_threads):
    # (100, 200): two query blocks, three key blocks; (5, 150): short queries, so
    # the kernel packs the 4 query heads of a kv head side by side and each
    # column must read its own head's mask row. Causal on every other mask.
    g = _gen("strided-mask", kind, str(dtype), nq, nk)
    q, k, v = make_qkv(2, 4, 1, nq, nk, 64, dtype, generator=g)
    for x, mask in enumerate(_masks(kind, dtype, 2, 4, nq, nk, g).values()):
        causal = x % 2 == 1
        options = dict(attn_mask=mask)
        out, lse = _forward(q, k, v, causal, options)
        assert_attention_close(out, lse, q, k, v, causal, None, **options)
        grad_out, grad_lse = _grad_inputs(out, lse, dtype, g)
        grads = _backward(grad_out, q, k, v, out, lse, causal, grad_lse, options)
        assert_gradients_close(grads, q, k, v, grad_out, causal, None, grad_lse, **options)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", ["bool", "finfo_min"])
def test_fully_masked_rows_across_key_blocks(dtype, kind, two_threads):
    # Rows whose every key (over 3 key blocks) is masked give out 0, lse
    # -inf and zero gradients; rows masked only within some blocks are
    # unaffected. finfo.min of the mask's dtype counts as masked (float16's
    # -65504 does not: its mask uses -inf).
    g = _gen("masked-rows", kind, str(dtype))
    q, k, v = make_qkv(1, 2, 1, 200, 250, 64, dtype, generator=g)
    keep = torch.rand(1, 2, 200, 250, generator=g) > 0.3
    rows = [0, 95, 96, 199]
    keep[:, :, rows] = False
    keep[:, :, 50, :240] = False  # only the last block's keys
    if kind == "bool":
        mask = keep
    else:
        mdtype = torch.float32 if dtype == torch.float16 else dtype
        mask = torch.where(keep, 0.5, torch.finfo(mdtype).min).to(mdtype)
    options = dict(attn_mask=mask, softcap=30.0)
    out, lse = _forward(q, k, v, False, options)
    assert (out[:, :, rows] == 0).all() and torch.isneginf(lse[:, :, rows]).all()
    assert_attention_close(out, lse, q, k, v, False, None, **options)
    grad_out, grad_lse = _grad_inputs(out, lse, dtype, g)
    grads = _backward(grad_out, q, k, v, out, lse, False, grad_lse, options)
    assert (grads[0][:, :, rows] == 0).all()
    assert_gradients_close(grads, q, k, v, grad_out, False, None, grad_lse, **options)


# --- softcap and varlen ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_with_large_logits(dtype, causal, two_threads):
    # Inputs scaled so that raw scores reach the hundreds: uncapped they
    # would be near one-hot; capped at 5 they are not. The backward's
    # 1 - tanh^2 factor is tiny for saturated scores and must be exact.
    g = _gen("softcap", str(dtype), causal)
    q, k, v = make_qkv(2, 4, 2, 150, 190, 64, dtype, generator=g, scale_inputs=4.0)
    options = dict(softcap=5.0)
    out, lse = _forward(q, k, v, causal, options)
    assert_attention_close(out, lse, q, k, v, causal, None, **options)
    grad_out, grad_lse = _grad_inputs(out, lse, dtype, g)
    grads = _backward(grad_out, q, k, v, out, lse, causal, grad_lse, options)
    assert_gradients_close(grads, q, k, v, grad_out, causal, None, grad_lse, **options)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_varlen_ragged_across_blocks_and_threads(dtype, two_threads):
    # Empty sequences on either side, length 1, Nq_b > Nk_b and Nq_b < Nk_b,
    # one sequence longer than two query blocks, GQA 4:2, causal; a strided
    # (non-contiguous) packed q.
    g = _gen("varlen", str(dtype))
    lq, lk = [0, 1, 220, 7, 30, 0, 3], [5, 1, 180, 0, 64, 0, 40]
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(4, sum(lq), 64, generator=g).to(dtype).transpose(0, 1)
    k = torch.randn(sum(lk), 2, 64, generator=g).to(dtype)
    v = torch.randn(sum(lk), 2, 64, generator=g).to(dtype)
    for causal in (False, True):
        out, lse = flash_metal.attention_varlen_with_lse(q, k, v, cu_q, cu_k, max(lq), max(lk), causal)
        assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, causal)
        grad_out = torch.randn(out.shape, generator=g).to(dtype)
        grad_lse = torch.where(torch.isfinite(lse), torch.randn(lse.shape, generator=g), 0.0)
        grads = torch.ops.flash_metal.attention_varlen_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max(lq),
                                                                max(lk), causal, None, grad_lse)
        assert_varlen_gradients_close(grads, q, k, v, grad_out, cu_q, cu_k, causal, None, grad_lse)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_varlen_chunked_backward_cuts_each_sequence(dtype, two_threads):
    # 3 sequences x 1 kv head on 2 threads: the chunked backward, with
    # chunk bounds from each sequence's own length (an empty one included)
    # and window; run twice, bitwise the same.
    g = _gen("varlen-chunked", str(dtype))
    lq, lk = [250, 0, 120], [200, 30, 260]
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lq), 2, 64, generator=g).to(dtype)
    k = torch.randn(sum(lk), 1, 64, generator=g).to(dtype)
    v = torch.randn(sum(lk), 1, 64, generator=g).to(dtype)
    options = dict(window_left=70, window_right=10, softcap=15.0)
    out, lse = flash_metal.attention_varlen_with_lse(q, k, v, cu_q, cu_k, max(lq), max(lk), False, **options)
    assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, False, None, **options)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    args = (grad_out, q, k, v, out, lse, cu_q, cu_k, max(lq), max(lk), False, None, None)
    grads = torch.ops.flash_metal.attention_varlen_backward(*args, **options)
    assert_varlen_gradients_close(grads, q, k, v, grad_out, cu_q, cu_k, False, None, None, **options)
    again = torch.ops.flash_metal.attention_varlen_backward(*args, **options)
    for a, b in zip(grads, again):
        assert torch.equal(a, b), "the chunked varlen backward is not deterministic"
