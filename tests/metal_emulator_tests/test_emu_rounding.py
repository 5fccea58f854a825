"""half and bfloat round after every operation, bit for bit like IEEE.

The reference computes each operation exactly in float64 (products and sums
of two half or bfloat values are exact there; quotients are rounded once to
53 bits, far below the final rounding) and rounds once to the target format.
"""

import math

import numpy as np
from conftest import library

N = 4096


def to_bfloat_bits(x: float) -> int:
    """float64 -> bfloat16 bits, round to nearest even (normal range)."""
    if x == 0:
        return 0x8000 if math.copysign(1, x) < 0 else 0
    m, e = math.frexp(x)  # x = m * 2**e, 0.5 <= |m| < 1
    q = round(m * 256)  # 8 significant bits; round() is ties-to-even
    y = math.ldexp(q / 256, e)
    return int(np.array(y, np.float32).view(np.uint32)) >> 16


def bfloat_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def operands(rng, n):
    mant = rng.uniform(1, 2, n) * rng.choice([-1, 1], n)
    return mant * np.exp2(rng.integers(-6, 7, n))


def test_half_per_operation_rounding(instrumented):
    lib = library("rounding.metal", instrumented)
    rng = np.random.default_rng(11)
    a, b, c = (operands(rng, N).astype(np.float16) for _ in range(3))
    x = rng.standard_normal(N).astype(np.float32) * 100
    out = np.zeros(6 * N, np.float16)
    lib.dispatch("arith_half", buffers={0: a, 1: b, 2: c, 3: x, 4: out}, grid=(N // 256,), threadgroup=(256,))
    A, B, C = (v.astype(np.float64) for v in (a, b, c))
    prod = (A * B).astype(np.float16)
    expect = [A + B, A - B, A * B, A / B, prod.astype(np.float64) + C, x.astype(np.float64)]
    for k, e in enumerate(expect):
        got = out[k * N : (k + 1) * N]
        np.testing.assert_array_equal(got.view(np.uint16), e.astype(np.float16).view(np.uint16), err_msg=f"op {k}")


def test_half_fused_expression_differs_from_single_rounding():
    # guards the -f*-excess-precision=none flags: a*b+c must round twice
    lib = library("rounding.metal", False)
    rng = np.random.default_rng(5)
    a, b, c = (operands(rng, N).astype(np.float16) for _ in range(3))
    out = np.zeros(6 * N, np.float16)
    lib.dispatch("arith_half", buffers={0: a, 1: b, 2: c, 3: np.zeros(N, np.float32), 4: out},
                 grid=(N // 256,), threadgroup=(256,))
    once = (a.astype(np.float64) * b + c).astype(np.float16)
    assert (out[4 * N : 5 * N] != once).sum() > N // 100


def test_bfloat_per_operation_rounding(instrumented):
    lib = library("rounding.metal", instrumented)
    rng = np.random.default_rng(12)
    bits = [np.array([to_bfloat_bits(v) for v in operands(rng, N)], np.uint16) for _ in range(3)]
    A, B, C = (bfloat_values(v) for v in bits)
    x = (rng.standard_normal(N) * 100).astype(np.float32)
    out = np.zeros(6 * N, np.uint16)
    lib.dispatch("arith_bfloat", buffers={0: bits[0], 1: bits[1], 2: bits[2], 3: x, 4: out},
                 grid=(N // 256,), threadgroup=(256,))
    prod = np.array([to_bfloat_bits(v) for v in A * B], np.uint16)
    expect = [A + B, A - B, A * B, A / B, bfloat_values(prod) + C, x.astype(np.float64)]
    for k, e in enumerate(expect):
        want = np.array([to_bfloat_bits(v) for v in e], np.uint16)
        np.testing.assert_array_equal(out[k * N : (k + 1) * N], want, err_msg=f"op {k}")
