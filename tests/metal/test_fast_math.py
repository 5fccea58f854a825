"""The attention kernels compiled with fast math, against the float64 oracle.

Apple's compiler defaults to fast math, where infinities and NaNs are
undefined behaviour; the MPS host asks for safe math, but a kernel must not
depend on it. The Metal emulator's fast-math flavour (clang -ffast-math,
tests/metal_emulator/README.md) makes the same no-infinities assumption, so
a kernel that seeds its running max with -INFINITY or tests `x == -INFINITY`
can be folded into a wrong answer here. The metal-emu backend runs exactly as
in the other op tests (the host's plan, its binding table), only with the
fast-math library: every kernel and dtype on ragged shapes, causal rows with
no key among them, and the -inf / overflow / huge-key cases of
test_nonfinite.py.
"""
import pytest
import torch

from backends import metal_library, run_attention
from numerics import DTYPES, assert_attention_close, dtype_id, make_qkv
from test_metal_kernels import BUCKET_DIMS, IMPLS
from test_nonfinite import CASES, POSITIONS, SHAPES, check_case, make_case

BACKEND = "metal-emu-fast-math"
# Ragged (Nq, Nk): not multiples of the 32-row groups or 16-key tiles; Nk < Nq
# leaves causal rows with no key at all.
RAGGED = [(33, 17), (45, 70)]


@pytest.fixture
def fast_math_library():
    """The library the metal-emu-fast-math backend dispatches to."""
    lib = metal_library(False, True)
    assert lib.fast_math
    return lib


def _ran_on(lib, q, k, v, causal, impl):
    import flash_metal

    return flash_metal.explain(q, k, v, causal, impl=impl).kernel_name in lib.dispatched_names()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("bucket", list(BUCKET_DIMS), ids=[f"d{b}" for b in BUCKET_DIMS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("impl", IMPLS)
def test_every_kernel_under_fast_math(fast_math_library, impl, dtype, bucket, causal):
    d = BUCKET_DIMS[bucket]
    for i, (nq, nk) in enumerate(RAGGED):
        g = torch.Generator().manual_seed(2000 + i)
        q, k, v = make_qkv(1, 2, 1, nq, nk, d, dtype, layout="offset_slice", generator=g)
        out, lse = run_attention(BACKEND, q, k, v, causal, None, impl)
        assert_attention_close(out, lse, q, k, v, causal)
        if causal and nk < nq:
            assert torch.isinf(lse[:, :, : nq - nk]).all() and (lse[:, :, : nq - nk] < 0).all()
            assert torch.equal(out[:, :, : nq - nk], torch.zeros_like(out[:, :, : nq - nk]))
    assert _ran_on(fast_math_library, q, k, v, causal, impl)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("dtype,kind", CASES, ids=[f"{dtype_id(d)}-{k}" for d, k in CASES])
@pytest.mark.parametrize("impl", IMPLS)
def test_nonfinite_scores_under_fast_math(fast_math_library, impl, dtype, kind, position, causal):
    for i, (nq, nk) in enumerate(SHAPES):
        masked = POSITIONS[position](nk)
        q, k, v = make_case(nq, nk, dtype, kind, masked, seed=300 + i)
        out, lse = run_attention(BACKEND, q, k, v, causal, None, impl)
        check_case(out, lse, q, k, v, causal, kind, masked)
    assert _ran_on(fast_math_library, q, k, v, causal, impl)
