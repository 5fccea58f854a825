"""The post's pure-PyTorch references agree with each other and with the float64 oracle."""
import math

import pytest
import torch

from flash_metal import reference as R

SHAPES = [(1, 1, 8), (16, 16, 32), (63, 65, 24), (100, 37, 64), (37, 100, 16)]


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("block", [1, 3, 16, 1000])
def test_onlinesoftmax_matches_softmax(block):
    x = rand(257, seed=block) * 5
    torch.testing.assert_close(R.onlinesoftmax(x, block), torch.softmax(x, dim=0), rtol=1e-12, atol=1e-14)


def test_stdattention_rows_sum_to_one_and_match_oracle():
    Q, K, V = rand(40, 16, seed=1), rand(50, 16, seed=2), rand(50, 16, seed=3)
    S, P, O = R.stdattention(Q, K, V)
    assert S.shape == (40, 50) and P.shape == (40, 50)
    torch.testing.assert_close(P.sum(dim=1), torch.ones(40, dtype=torch.float64))
    torch.testing.assert_close(S, Q @ K.T / math.sqrt(16))
    out, _ = R.attention_reference(Q[None, None], K[None, None], V[None, None])
    torch.testing.assert_close(O, out[0, 0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("block", [1, 7, 64])
def test_onequeryattention_matches_each_row(block):
    Q, K, V = rand(5, 32, seed=4), rand(90, 32, seed=5), rand(90, 32, seed=6)
    _, _, O = R.stdattention(Q, K, V)
    for i in range(Q.shape[0]):
        torch.testing.assert_close(R.onequeryattention(Q[i], K, V, block), O[i], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("nq,nk,d", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("qb,kb", [(1, 1), (16, 16), (7, 13), (64, 32)])
def test_blockwise_matches_std_and_oracle(nq, nk, d, causal, qb, kb):
    Q, K, V = rand(nq, d, seed=7), rand(nk, d, seed=8), rand(nk, d, seed=9)
    O = R.blockwiseattention(Q, K, V, qb, kb, causal=causal)
    ref, _ = R.attention_reference(Q[None, None], K[None, None], V[None, None], causal=causal)
    torch.testing.assert_close(O, ref[0, 0], rtol=1e-10, atol=1e-12)
    if nk >= nq or not causal:  # stdattention gives NaN rows when a row sees no key
        torch.testing.assert_close(R.stdattention(Q, K, V, causal=causal)[2], ref[0, 0], rtol=1e-10, atol=1e-12)


def test_blockwise_early_stop_skips_future_blocks():
    """Causal: key blocks entirely in the future of the query block are never touched."""
    n, block = 64, 16
    Q, K, V = rand(n, 8, seed=10), rand(n, 8, seed=11), rand(n, 8, seed=12)
    seen = []

    class RecordingK:
        """K stand-in that records which key blocks the loop slices out."""

        def __init__(self, t):
            self.t, self.shape, self.device = t, t.shape, t.device

        def __getitem__(self, sl):
            seen.append(sl.start)
            return self.t[sl]

    R.blockwiseattention(Q, RecordingK(K), V, block, block, causal=True)
    # Query block b (rows 16b..16b+15) needs key blocks 0..b: 1 + 2 + 3 + 4 = 10 reads, not 16.
    assert len(seen) == 10
    seen.clear()
    R.blockwiseattention(Q, RecordingK(K), V, block, block, causal=False)
    assert len(seen) == 16


def test_blockwise_rows_without_keys_are_zero():
    Q, K, V = rand(10, 8, seed=13), rand(4, 8, seed=14), rand(4, 8, seed=15)
    O = R.blockwiseattention(Q, K, V, 4, 2, causal=True)
    assert torch.equal(O[:6], torch.zeros(6, 8, dtype=torch.float64))  # rows 0..5 see keys j <= i - 6
    assert not torch.isnan(O).any()


def test_oracle_gqa_equals_repeated_heads():
    q, k, v = rand(2, 8, 9, 16, seed=16), rand(2, 2, 11, 16, seed=17), rand(2, 2, 11, 16, seed=18)
    out, lse = R.attention_reference(q, k, v, causal=True)
    out2, lse2 = R.attention_reference(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), causal=True)
    torch.testing.assert_close(out, out2)
    torch.testing.assert_close(lse, lse2)
    S = q @ k.repeat_interleave(4, 1).transpose(-1, -2) / 4.0
    S = S.masked_fill(R.causal_mask(9, 11), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(S, -1))


def _autograd_grads(Q, K, V, dO, causal):
    """(dQ, dK, dV) by autograd through plain float64 attention. Rows that see
    no key (Nk < Nq, causal) output zeros, so their gradients are zero; they
    are given dummy finite scores first, since softmax over a row of -inf
    would put NaN into the graph."""
    Q, K, V = (t.detach().clone().requires_grad_(True) for t in (Q, K, V))
    S = (Q @ K.T) * Q.shape[-1] ** -0.5
    has_key = torch.ones(Q.shape[0], 1, dtype=torch.bool)
    if causal:
        mask = R.causal_mask(Q.shape[0], K.shape[0])
        has_key = ~mask.all(dim=1, keepdim=True)
        S = torch.where(has_key, S.masked_fill(mask, float("-inf")), 0.0)
    out = (torch.softmax(S, dim=-1) @ V) * has_key
    out.backward(dO)
    return Q.grad, K.grad, V.grad


@pytest.mark.parametrize("nq,nk,d", [(37, 53, 16), (64, 64, 32), (50, 21, 8), (1, 40, 16)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("qb,kb", [(1, 1), (16, 16), (7, 13)])
def test_blockwise_backward_matches_autograd(nq, nk, d, causal, qb, kb):
    # FlashAttention-2's backward with recomputation (P from the forward's
    # lse, never stored) gives autograd's gradients, blocks of any size,
    # causal (bottom-right, including rows with no key) or not.
    Q, K, V, dO = rand(nq, d, seed=11), rand(nk, d, seed=12), rand(nk, d, seed=13), rand(nq, d, seed=14)
    O, lse = R.attention_reference(Q[None, None], K[None, None], V[None, None], causal=causal)
    grads = R.blockwiseattention_backward(Q, K, V, O[0, 0], lse[0, 0], dO, qb, kb, causal=causal)
    for got, want, name in zip(grads, _autograd_grads(Q, K, V, dO, causal), ("dQ", "dK", "dV")):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)


def test_blockwise_backward_rows_without_keys_contribute_nothing():
    # Nk < Nq, causal: the first Nq - Nk rows see no key; their dQ is zero,
    # and changing their dO changes no gradient.
    Q, K, V, dO = rand(20, 8, seed=21), rand(5, 8, seed=22), rand(5, 8, seed=23), rand(20, 8, seed=24)
    O, lse = R.attention_reference(Q[None, None], K[None, None], V[None, None], causal=True)
    dQ, dK, dV = R.blockwiseattention_backward(Q, K, V, O[0, 0], lse[0, 0], dO, 4, 4, causal=True)
    assert torch.equal(dQ[:15], torch.zeros_like(dQ[:15])) and dQ[15:].abs().sum() > 0
    dO2 = dO.clone()
    dO2[:15] = rand(15, 8, seed=25)
    dQ2, dK2, dV2 = R.blockwiseattention_backward(Q, K, V, O[0, 0], lse[0, 0], dO2, 4, 4, causal=True)
    assert torch.equal(dQ, dQ2) and torch.equal(dK, dK2) and torch.equal(dV, dV2)
