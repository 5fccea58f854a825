"""SIMD-group collectives against a Python model of 32-lane SIMD-groups."""

import numpy as np
import pytest
from conftest import library

W = 32  # lanes per SIMD-group


def model(x: np.ndarray, src: np.ndarray) -> list[np.ndarray]:
    n = len(x)
    outs = [np.zeros(n, np.float32) for _ in range(14)]
    for base in range(0, n, W):
        g = x[base : base + W]
        for lane in range(W):
            t = base + lane
            k = 0

            def put(v):
                nonlocal k
                outs[k][t] = v
                k += 1

            acc = np.float32(0)
            for v in g:  # lane-order fold, one float rounding per add
                acc = np.float32(acc + v)
            put(acc)
            put(g.max())
            put(g.min())
            put(np.float32(sum(np.float64(v) for v in g[: lane + 1])))
            put(np.float32(sum(np.float64(v) for v in g[:lane])))
            put(g[src[t]])
            put(g[lane ^ 5])
            put(g[lane + 3] if lane + 3 < W else g[lane])
            put(g[lane - 2] if lane >= 2 else g[lane])
            put(g[7])
            put(g[0])
            put(g[(lane + 4) % W])
            put(np.float32(sum(int(v) for v in g)))
            put(-g[lane ^ 16])
    return outs


@pytest.mark.parametrize("seed", [0, 1])
def test_collectives_match_model(instrumented, seed):
    lib = library("collectives.metal", instrumented)
    rng = np.random.default_rng(seed)
    n = 96  # three SIMD-groups
    # small integers: every order of summation gives the same float result
    x = rng.integers(-20, 20, n).astype(np.float32)
    src = rng.integers(0, W, n).astype(np.uint32)
    out = np.zeros(14 * n, np.float32)
    ballots = np.zeros(3 * n, np.uint32)
    lib.dispatch("collectives", buffers={0: x, 1: src, 2: out, 3: ballots}, grid=(1,), threadgroup=(n,),
                 seed=seed)
    for k, expect in enumerate(model(x, src)):
        np.testing.assert_array_equal(out[k * n : (k + 1) * n], expect, err_msg=f"collective #{k}")
    for base in range(0, n, W):
        g = x[base : base + W]
        ballot = sum(1 << l for l in range(W) if g[l] > 0)
        for lane in range(W):
            t = base + lane
            assert ballots[3 * t] == ballot
            assert ballots[3 * t + 1] == 1
            assert ballots[3 * t + 2] == int((g > 2.5).any())


def test_simd_sum_of_floats_folds_in_lane_order():
    lib = library("collectives.metal", False)
    rng = np.random.default_rng(7)
    x = rng.standard_normal(32).astype(np.float32) * np.float32(1e3)
    out = np.zeros(14 * 32, np.float32)
    lib.dispatch("collectives", buffers={0: x, 1: np.zeros(32, np.uint32), 2: out, 3: np.zeros(96, np.uint32)},
                 grid=(1,), threadgroup=(32,))
    acc = np.float32(0)
    for v in x:
        acc = np.float32(acc + v)
    assert (out[:32] == acc).all()
