"""metal::, fast:: and precise:: math against numpy's float64, rounded once.

The emulator's model (include/fm/math.h): half arguments are widened to
float, the C library's float function runs, and the result is rounded once
to the argument type; fast:: and precise:: are the same functions. These
tests pin that model: comparisons, clamps and sqrt are exact, fma is within
one ulp (numpy's reference rounds a*b+a twice in float64 in rare cases), and
the transcendental functions within 2 ulps, glibc's documented bound for its
float functions. Apple documents wider bounds for fast:: (and some precise::)
functions, so shaders must not rely on accuracy beyond Apple's tables; the
emulator cannot reproduce Apple's exact errors.
"""
import numpy as np
import pytest
from conftest import library

N = 1024
# (name, float64 reference, allowed ulps), in the kernel's output order.
TRANSCENDENTAL_ULPS = 2
FUNCS = [
    ("exp", lambda a, b: np.exp(a), TRANSCENDENTAL_ULPS),
    ("exp2", lambda a, b: np.exp2(a), TRANSCENDENTAL_ULPS),
    ("log", lambda a, b: np.log(np.abs(a)), TRANSCENDENTAL_ULPS),
    ("log2", lambda a, b: np.log2(np.abs(a)), TRANSCENDENTAL_ULPS),
    ("sqrt", lambda a, b: np.sqrt(np.abs(a)), 0),
    ("rsqrt", lambda a, b: 1 / np.sqrt(np.abs(a)), TRANSCENDENTAL_ULPS),
    ("tanh", lambda a, b: np.tanh(a), TRANSCENDENTAL_ULPS),
    ("max", lambda a, b: np.maximum(a, b), 0),
    ("min", lambda a, b: np.minimum(a, b), 0),
    ("clamp", lambda a, b: np.clip(a, -1, 1), 0),
    ("fma", lambda a, b: a * b + a, 1),
    ("fast::exp", lambda a, b: np.exp(a), TRANSCENDENTAL_ULPS),
    ("fast::exp2", lambda a, b: np.exp2(a), TRANSCENDENTAL_ULPS),
    ("fast::log", lambda a, b: np.log(np.abs(a)), TRANSCENDENTAL_ULPS),
    ("precise::exp", lambda a, b: np.exp(a), TRANSCENDENTAL_ULPS),
    ("precise::log2", lambda a, b: np.log2(np.abs(a)), TRANSCENDENTAL_ULPS),
    ("precise::sqrt", lambda a, b: np.sqrt(np.abs(a)), 0),
]


def ulp_distance(got, want):
    g = got.view(np.int16 if got.dtype == np.float16 else np.int32).astype(np.int64)
    w = want.view(np.int16 if want.dtype == np.float16 else np.int32).astype(np.int64)
    return np.abs(g - w)


@pytest.mark.parametrize("name,np_dtype", [("math_float", np.float32), ("math_half", np.float16)])
def test_math_functions_round_once(instrumented, name, np_dtype):
    rng = np.random.default_rng(3)
    # Nonzero magnitudes within each type's comfortable range (no overflow in exp).
    x = (rng.uniform(0.05, 8.0, N) * rng.choice([-1, 1], N)).astype(np_dtype)
    y = (rng.standard_normal(N) * 4).astype(np_dtype)
    out = np.full(len(FUNCS) * N, np.nan, np_dtype)  # poisoned: an unwritten slot fails
    library("math.metal", instrumented).dispatch(name, buffers={0: x, 1: y, 2: out}, grid=(N // 128,),
                                                 threadgroup=(128,))
    a, b = x.astype(np.float64), y.astype(np.float64)
    for k, (fname, ref, allowed) in enumerate(FUNCS):
        got = out[k * N : (k + 1) * N]
        want = ref(a, b).astype(np_dtype)
        worst = int(ulp_distance(got, want).max())
        assert worst <= allowed, f"{fname} ({np_dtype.__name__}): {worst} ulps from float64 rounded once"
