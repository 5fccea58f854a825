"""The CPU backward's compensated sums across thread chunks (csrc/cpu/attention_backward_cpu.cpp, issue 41).

Where B * Hkv items would leave threads idle (here one kv head, B = 1), the
CPU backward cuts the query rows into one chunk per thread (chunk_bounds:
96-row blocks of about equal work, so 300 rows at 2 threads are 192 + 108,
at 3 threads 96 + 96 + 108, at 4 threads 96 + 96 + 96 + 12). Each chunk
folds the query heads of the GQA group into its partial dK/dV by TwoSum and
keeps the rounding errors in its own compensation array; write_sum adds the
chunks' partials in order and then every chunk's compensation.

The inputs make every compensation term decisive. Three query heads share
the kv head: heads 0 and 2 have the same q (so the same P, out and lse) and
grad_out negated, so their dK and dV contributions are exact negatives of
each other (IEEE rounding is symmetric), while head 1's grad_out is 2^24
times smaller. The exact group sum is therefore head 1's contribution
alone; folding head 1 into head 0's sum loses most of it (it is about one
float32 ulp of head 0's), and what is lost lives only in the chunk's
compensation. A sum compensated per chunk recovers head 1's gradient to
float32 precision (here: bit for bit what head 1 alone gives); one that adds
any chunk's compensation in place of another's (or none) is off by about
head 1's own size. The yardstick:
the same backward run on head 1 alone (its own float32 error against the
float64 oracle), doubled, plus the dtype's rounding floor.

Planted (csrc/cpu/attention_backward_cpu.cpp, write_sum; rebuilt, run, reverted):
`e += comp[x]` in place of `e += comp[c * stride + x]` (chunk 0's compensation
added for every chunk) fails test_compensation_of_each_chunk_is_added in all
four cases, at 2, 3 and 4 threads alike: dK and dV off by 0.24-3.9 against
tolerances of 8e-7-2e-6 in float32 (3e5-2e6 x) and 0.007-0.03 in bfloat16
(30-140 x); at 1 thread (one chunk) it passes, as it must.

Cost: ~2 s on 2 cores (300 x 300, D = 40, 3 query heads, 4 thread counts).
"""
import pytest
import torch

import flash_metal.testing as testing
from numerics import dtype_id, threads

FWD = torch.ops.flash_metal.attention_forward
BWD = torch.ops.flash_metal.attention_backward

N, D = 300, 40  # 300 rows: 96-row blocks 96, 96, 96, 12, so the chunks are unequal at 2, 3 and 4 threads
BIG = 2.0 ** 24  # heads 0 and 2's grad_out relative to head 1's: head 1 is below half an ulp of their sums


def _inputs(dtype, seed):
    """q, k, v, grad_out: (1, 3, N, D) queries whose heads 0 and 2 cancel exactly, (1, 1, N, D) keys and values."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    # Rows of very different size in different chunks, so each chunk's compensation differs.
    rows = torch.linspace(0.5, 3.0, N).view(1, 1, N, 1).to(dtype)
    q0, q1 = rnd(1, 1, N, D), rnd(1, 1, N, D)
    go0, go1 = rnd(1, 1, N, D, scale=BIG) * rows, rnd(1, 1, N, D)
    q = torch.cat([q0, q1, q0], dim=1)
    grad_out = torch.cat([go0, go1, -go0], dim=1)
    k, v = rnd(1, 1, N, D), rnd(1, 1, N, D)
    return q, k, v, grad_out, (q1, go1)


def _errors(grads, ref):
    return [(g.double() - r).abs().max().item() for g, r in zip(grads, ref)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_compensation_of_each_chunk_is_added(dtype, causal):
    q, k, v, go, (q1, go1) = _inputs(dtype, seed=41 + causal)
    out, lse = FWD(q, k, v, causal, None)
    # Heads 0 and 2 are the same attention: their out and lse agree bit for bit (the premise of the cancellation).
    assert torch.equal(out[:, 0], out[:, 2]) and torch.equal(lse[:, 0], lse[:, 2])
    # The exact group sum of dK and dV is head 1's alone: the float64 oracle of that head.
    _, ref_k, ref_v = testing.reference_gradients(q1, k, v, go1, causal)
    floors = [testing.rounding_floor(r, dtype) for r in (ref_k, ref_v)]
    for n in (1, 2, 3, 4):
        with threads(n):
            assert torch.get_num_threads() == n
            _, gk, gv = BWD(go, q, k, v, out, lse, causal, None, None)[:3]
            out1, lse1 = FWD(q1, k, v, causal, None)
            _, k1, v1 = BWD(go1, q1, k, v, out1, lse1, causal, None, None)[:3]
        errs, alone = _errors((gk, gv), (ref_k, ref_v)), _errors((k1, v1), (ref_k, ref_v))
        for name, err, own, floor, ref in zip(("grad_k", "grad_v"), errs, alone, floors, (ref_k, ref_v)):
            tol = 2 * own + floor
            assert err <= tol, (f"{n} threads: {name} of the cancelling group is off by {err:.3g}, head 1 alone by "
                                f"{own:.3g} (tolerance {tol:.3g}): a chunk's compensation was lost or misplaced")
            # The tolerance is far below what a lost compensation costs (about head 1's own size).
            assert tol < ref.abs().max().item() / 20
