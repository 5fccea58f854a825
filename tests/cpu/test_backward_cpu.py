"""The CPU backward kernel's own branches (csrc/cpu/attention_backward_cpu.cpp).

tests/api/test_backward.py runs the cross-backend grid; this file covers what only
the CPU kernel has: its work decomposition (one item per (batch, kv head), or
query chunks with partial dK/dV summed in order when B * Hkv would leave
threads idle), its 96 x 96 blocks and 16-float column padding, strided
operands and grad_lse read in place, and bitwise determinism in both
decompositions. Gradients are checked against the float64 oracle by the 2x
rule (numerics.assert_gradients_close); outputs are freshly allocated and
NaN-poisoned by conftest.py, so an element never written fails.
"""

import pytest
import torch

from numerics import threads, DTYPES, assert_gradients_close, dtype_id, lay_out, make_qkv, make_tensor

FWD = torch.ops.flash_metal.attention_forward
BWD = torch.ops.flash_metal.attention_backward
# The kernel's query and key block (FLASH_METAL_CPU_BWD_BLOCK_Q/K).
BLOCK = 96


def forward_backward(q, k, v, causal, scale=None, grad_lse=None, grad_out=None, out_layout=None, seed=7):
    out, lse = FWD(q, k, v, causal, scale)
    if grad_out is None:
        grad_out = make_tensor(q.shape, "contiguous", q.dtype, torch.Generator().manual_seed(seed))
    if out_layout is not None:
        out = lay_out(out, out_layout)
    return grad_out, BWD(grad_out, q, k, v, out, lse, causal, scale, grad_lse)[:3]


# (B, Hq, Hkv, Nq, Nk, D): block edges (one block, one key past a block, not
# multiples of the blocks, Nq != Nk both ways), D off the vector widths
# (1, 33, 80) and the largest (256), GQA and MQA.
SHAPES = [
    (1, 2, 2, 96, 96, 64),
    (2, 3, 3, 97, 193, 33),
    (1, 4, 2, 200, 130, 80),
    (1, 4, 1, 130, 200, 1),
    (2, 6, 2, 45, 290, 256),
    (1, 1, 1, 1, 1, 16),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gradients(dtype, shape, causal):
    B, Hq, Hkv, Nq, Nk, D = shape
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, generator=torch.Generator().manual_seed(1))
    grad_out, grads = forward_backward(q, k, v, causal)
    assert_gradients_close(grads, q, k, v, grad_out, causal)


@pytest.mark.parametrize("nthreads", [1, 2, 3])
@pytest.mark.parametrize("kv_heads", [1, 2, 3], ids=["bh1", "bh2", "bh3"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_decompositions(nthreads, kv_heads, causal):
    # B * Hkv below, equal to and above the thread count, not a multiple of
    # it (query chunks of equal work, causal-aware), and Nk < Nq causal so
    # that the first chunk's rows see no key at all.
    q, k, v = make_qkv(1, 2 * kv_heads, kv_heads, 5 * BLOCK + 7, 3 * BLOCK + 5, 40, torch.float32,
                       generator=torch.Generator().manual_seed(2))
    with threads(nthreads):
        grad_out, grads = forward_backward(q, k, v, causal)
    assert_gradients_close(grads, q, k, v, grad_out, causal)
    if causal:  # rows before the first visible key: zero gradient, exactly
        assert (grads[0][:, :, : q.shape[2] - k.shape[2]] == 0).all()


def test_chunked_path_differs_from_whole_heads():
    # One kv head: one thread runs it whole, two threads split its query rows
    # into two chunks whose partial dK/dV are summed afterwards. Both must be
    # right; their float32 sums differ in order, so the bits differ: this is
    # how we know the chunked branch ran.
    q, k, v = make_qkv(1, 2, 1, 4 * BLOCK, 4 * BLOCK, 64, torch.float32, generator=torch.Generator().manual_seed(3))
    results = {}
    for n in (1, 2):
        with threads(n):
            grad_out, results[n] = forward_backward(q, k, v, False)
        assert_gradients_close(results[n], q, k, v, grad_out, False)
    assert torch.equal(results[1][0], results[2][0])  # dQ: each row summed by one item either way
    assert not torch.equal(results[1][1], results[2][1])


@pytest.mark.parametrize("layout", ["transposed", "offset_slice", "every_other", "d_outer", "storage_end_bnhd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_strided_operands(dtype, layout):
    # q, k, v, grad_out and out all strided; gradients come back packed.
    g = torch.Generator().manual_seed(4)
    q, k, v = make_qkv(2, 4, 2, 70, 101, 24, dtype, layout=layout, generator=g)
    grad_out = make_tensor(q.shape, layout, dtype, g)
    _, grads = forward_backward(q, k, v, True, grad_out=grad_out, out_layout=layout)
    for grad, like in zip(grads, (q, k, v)):
        assert grad.is_contiguous() and grad.shape == like.shape
    assert_gradients_close(grads, q, k, v, grad_out, True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_grad_lse(dtype, causal):
    g = torch.Generator().manual_seed(5)
    q, k, v = make_qkv(1, 4, 2, 150, 110, 48, dtype, generator=g)
    # A strided grad_lse: every other element of a wider buffer.
    grad_lse = torch.randn(1, 4, 300, generator=g)[..., ::2]
    grad_out, grads = forward_backward(q, k, v, causal, scale=0.3, grad_lse=grad_lse)
    assert_gradients_close(grads, q, k, v, grad_out, causal, 0.3, grad_lse)


@pytest.mark.parametrize("kv_heads,nthreads", [(1, 2), (4, 2), (3, 1)], ids=["chunked", "whole", "one-thread"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_deterministic(dtype, kv_heads, nthreads):
    q, k, v = make_qkv(1, 2 * kv_heads, kv_heads, 3 * BLOCK + 11, 3 * BLOCK + 11, 64, dtype,
                       generator=torch.Generator().manual_seed(6))
    with threads(nthreads):
        _, first = forward_backward(q, k, v, True)
        for _ in range(2):
            _, again = forward_backward(q, k, v, True)
            for a, b in zip(first, again):
                assert torch.equal(a, b)
    for grad in first:
        assert torch.isfinite(grad).all()


def test_impl_must_be_auto():
    q, k, v = make_qkv(1, 1, 1, 8, 8, 16, torch.float32)
    out, lse = FWD(q, k, v)
    with pytest.raises(ValueError, match=r"attention_backward: impl='tiled'.*impl must be 'auto'"):
        BWD(out, q, k, v, out, lse, False, None, None, "tiled")


@pytest.mark.parametrize("logit_scale, first_pass", [(1.0, False), (8.0, True)], ids=["small-lse", "large-lse"])
def test_float32_first_pass_gated_by_lse(logit_scale, first_pass):
    """float32's first pass (renormalized rows, backward_precise.h) runs only for query blocks whose
    |lse| passes kRenormLse = 12, or with a softcap or sinks: randn scores over 256 keys give
    |lse| ~ 6 and skip it; q scaled by 8 gives |lse| ~ 20 and takes it. Both meet the 2x rule,
    and the counter shows which way each block went (every block alike here)."""
    from flash_metal.cpu_paths import cpu_path_counts
    q, k, v = make_qkv(1, 2, 2, 200, 256, 64, torch.float32, generator=torch.Generator().manual_seed(5))
    q = q * logit_scale
    lse = FWD(q, k, v, False, None)[1]
    assert (lse.abs().max().item() > 12.0) == first_pass and (lse.abs().min().item() > 12.0) == first_pass
    before = cpu_path_counts()["backward_float32_first_pass_blocks"]
    grad_out, grads = forward_backward(q, k, v, False)
    taken = cpu_path_counts()["backward_float32_first_pass_blocks"] - before
    assert taken == (2 * 3 if first_pass else 0), taken  # 2 heads x 3 query blocks of <= 96 rows
    assert_gradients_close(grads, q, k, v, grad_out, False)
