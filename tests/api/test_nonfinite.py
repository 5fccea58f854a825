"""Keys whose scores are -inf, overflow, or are hugely negative, on every backend.

A key whose score is -inf (a -inf in k) or overflows float32 to -inf (a key
of -3e38 against a positive query) must get weight exactly 0, wherever it
sits: the first key a row sees, the middle, the last, a whole first tile, or
every key. A row whose every visible score is -inf sees no key: zeros and
lse = -inf, the contract of README and of the CPU kernel. Keys of -1e4 give
finite scores of about -5e4: their weight underflows to 0 beside ordinary
keys, and a row that sees only them gets a uniform average, not zeros (a
running max seeded too high, or a sentinel that swallows finite scores,
fails there).

Masked keys carry loud values (about 1e3) in v, so any weight leaking onto
them is far outside tolerance. Queries are positive so that q . k is -inf,
not NaN, for a -inf in k (as in the float64 oracle too).

Yardstick: FlashAttention's rule (tests/numerics.py), with PyTorch's
same-dtype attention scoring in float32 from the dtype's inputs. A float16
q @ k.T of these keys would overflow on its own, which would make the
tolerance meaningless.
"""
import math

import pytest
import torch

from backends import backend_param, run_attention
from flash_metal.reference import attention_reference, causal_mask
from numerics import DTYPES, dtype_id, fp32_floor, rounding_floor

# (backend, impl): the CPU kernel, and every Metal kernel emulated and on a Mac.
BACKEND_IMPLS = [
    pytest.param(b, impl, id=f"{b}-{impl}", marks=backend_param(b).marks)
    for b, impl in [("cpu", "auto")] + [(b, i) for b in ("metal-emu", "mps") for i in ("untiled", "tiled", "prefill")]
]
# Which keys are masked, as a function of Nk. "first_tile" covers more than one
# 16-key tile of the tiled kernel, so rows cross a tile boundary having seen
# nothing but masked keys.
POSITIONS = {
    "first": lambda nk: [0],
    "middle": lambda nk: [nk // 2],
    "last": lambda nk: [nk - 1],
    "first_tile": lambda nk: list(range(min(nk, 20))),
    "all": lambda nk: list(range(nk)),
}
# "overflow" needs a key value whose products overflow float32: -3e38 exists
# in float32 and bfloat16 but not in float16 (it would round to -inf there,
# the "-inf" case again).
KINDS = {torch.float32: ["-inf", "overflow", "huge"], torch.bfloat16: ["-inf", "overflow", "huge"],
         torch.float16: ["-inf", "huge"]}
# Two shapes: Nq < Nk, and Nq > Nk so that causal masking also leaves rows
# with no visible key at all (rows 0..28 of the second).
SHAPES = [(37, 45), (50, 21)]
D = 40  # ragged inside the 64 bucket



def make_case(nq, nk, dtype, kind, masked, seed):
    """q, k, v (B=1, Hq=2, Hkv=1) with the keys in `masked` made non-finite or huge."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, 2, nq, D, generator=g).abs() + 0.05).to(dtype)
    k = torch.randn(1, 1, nk, D, generator=g)
    v = torch.randn(1, 1, nk, D, generator=g)
    for j in masked:
        if kind == "-inf":
            k[:, :, j, j % D] = float("-inf")  # one feature: q . k = -inf since q > 0
        elif kind == "overflow":
            k[:, :, j, :] = -3e38  # every product about -5e37: the float32 sum overflows
        else:
            k[:, :, j, :] = -1e4  # score about -5e4: finite, weight exp(-5e4) = 0
        v[:, :, j, :] = 1e3 + torch.randn(D, generator=g)
    return q, k.to(dtype), v.to(dtype)


def _visible(nq, nk, causal):
    return ~causal_mask(nq, nk) if causal else torch.ones(nq, nk, dtype=torch.bool)


def expected(q, k, v, causal, kind, masked):
    """The float64 oracle, adjusted where float32 cannot follow it.

    An "overflow" score is finite in float64 but -inf in float32, so a row
    whose every visible key overflows sees no key in any float32 kernel:
    zeros and lse = -inf (what the CPU kernel gives, and README promises for
    rows with nothing to attend to).
    """
    ref_out, ref_lse = attention_reference(q, k, v, causal)
    if kind == "overflow":
        nq, nk = q.shape[2], k.shape[2]
        is_masked = torch.zeros(nk, dtype=torch.bool)
        is_masked[masked] = True
        vis = _visible(nq, nk, causal)
        empty = (vis & ~is_masked).sum(dim=1) == 0
        ref_out[:, :, empty] = 0.0
        ref_lse[:, :, empty] = float("-inf")
    return ref_out, ref_lse


def yardstick(q, k, v, causal):
    """PyTorch's attention in q's dtype, scores in float32 from the dtype's inputs."""
    k, v = k.expand(-1, q.shape[1], -1, -1), v.expand(-1, q.shape[1], -1, -1)
    S = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        S = S.masked_fill(causal_mask(q.shape[2], k.shape[2]), float("-inf"))
    # Rows with no visible key are zeroed before the product, never after:
    # a CPU GEMM may spread a NaN row into its neighbours (tests/numerics.py).
    seen = torch.isfinite(S).any(dim=-1, keepdim=True)
    P = torch.where(seen, torch.softmax(S, dim=-1), 0.0).to(q.dtype)
    return P @ v, torch.logsumexp(S, dim=-1)


def check_case(out, lse, q, k, v, causal, kind, masked):
    assert not torch.isnan(out).any(), "output has NaN"
    assert not torch.isnan(lse).any(), "lse has NaN"
    ref_out, ref_lse = expected(q, k, v, causal, kind, masked)
    pt_out, pt_lse = yardstick(q, k, v, causal)
    nk = k.shape[2]

    # Rows with no key to attend to: exactly zero, lse exactly -inf.
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), "lse is -inf on the wrong rows"
    assert (lse[empty] < 0).all()
    assert torch.equal(out[empty], torch.zeros_like(out[empty])), "a row with no key is not all zeros"

    err = (out.double() - ref_out).abs().max().item()
    pt_err = (pt_out.double() - ref_out).abs().max().item()
    tol = 2 * pt_err + rounding_floor(ref_out, q.dtype) + fp32_floor(ref_out, nk)
    assert err <= tol, f"out: max error {err:.3g} > tolerance {tol:.3g} (PyTorch same-dtype error {pt_err:.3g})"
    fin = ~empty
    if fin.any():
        lerr = (lse.double()[fin] - ref_lse[fin]).abs().max().item()
        pt_lerr = (pt_lse.double()[fin] - ref_lse[fin]).abs().max().item()
        ltol = 2 * pt_lerr + rounding_floor(ref_lse[fin], torch.float32) + fp32_floor(ref_lse[fin], nk)
        assert lerr <= ltol, f"lse: max error {lerr:.3g} > tolerance {ltol:.3g} (PyTorch error {pt_lerr:.3g})"


CASES = [(dtype, kind) for dtype in DTYPES for kind in KINDS[dtype]]


@pytest.mark.parametrize("backend,impl", BACKEND_IMPLS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("dtype,kind", CASES, ids=[f"{dtype_id(d)}-{k}" for d, k in CASES])
def test_nonfinite_scores(backend, impl, dtype, kind, position, causal):
    for i, (nq, nk) in enumerate(SHAPES):
        masked = POSITIONS[position](nk)
        q, k, v = make_case(nq, nk, dtype, kind, masked, seed=100 + i)
        out, lse = run_attention(backend, q, k, v, causal, None, impl)
        check_case(out, lse, q, k, v, causal, kind, masked)


@pytest.mark.parametrize("backend,impl", BACKEND_IMPLS)
def test_rows_whose_every_score_overflows_see_no_key(backend, impl):
    # Every key overflows: the float64 oracle still has a finite answer, but in
    # float32 every score is -inf, so each row has nothing to attend to.
    q, k, v = make_case(5, 30, torch.float32, "overflow", list(range(30)), seed=7)
    out, lse = run_attention(backend, q, k, v, False, None, impl)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isinf(lse).all() and (lse < 0).all()
