"""simdgroup_matrix: products and the MLX lane layout of thread_elements()."""

import numpy as np
import pytest
from conftest import library


def mlx_coord(lane: int) -> tuple[int, int]:
    # MLX steel/attn/mma.h BaseMMAFrag::get_coord
    qid = lane // 4
    row = (qid & 4) + (lane // 2) % 4
    col = (qid & 2) * 2 + (lane % 2) * 2
    return row, col


def run(dtype_name, np_dtype, instrumented, seed):
    lib = library("matrix.metal", instrumented)
    rng = np.random.default_rng(seed)
    a = rng.integers(-4, 5, (8, 8)).astype(np_dtype)
    b = rng.integers(-4, 5, (8, 8)).astype(np_dtype)
    c = rng.standard_normal((8, 8)).astype(np.float32)
    d = np.zeros((8, 8), np.float32)
    layout = np.zeros(64, np.float32)
    index = np.arange(128, dtype=np.float32).reshape(8, 16)  # element (r, c) = 16 r + c
    transposed = np.zeros((8, 8), np.float32)
    lib.dispatch(f"mma_{dtype_name}", buffers={0: a, 1: b, 2: c, 3: d, 4: layout, 5: index, 6: transposed},
                 grid=(1,), threadgroup=(32,))
    return a, b, c, d, layout, index, transposed


@pytest.mark.parametrize("dtype_name,np_dtype", [("float", np.float32), ("half", np.float16)])
def test_multiply_accumulate(instrumented, dtype_name, np_dtype):
    a, b, c, d, *_ = run(dtype_name, np_dtype, instrumented, 3)
    expect = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(d, expect, rtol=1e-6, atol=1e-5)


def test_thread_elements_follow_mlx_layout():
    *_, layout, index, transposed = run("float", np.float32, False, 0)
    for lane in range(32):
        r, c = mlx_coord(lane)
        # loaded from origin (x=8, y=0) of a 16-wide matrix: element = 16 r + 8 + c
        assert layout[2 * lane] == 16 * r + 8 + c, lane
        assert layout[2 * lane + 1] == 16 * r + 8 + c + 1, lane
    # the 64 (row, col) pairs cover the matrix exactly once
    cells = {(mlx_coord(l)[0], mlx_coord(l)[1] + j) for l in range(32) for j in range(2)}
    assert len(cells) == 64


def test_transposed_load():
    *_, index, transposed = run("float", np.float32, False, 0)
    np.testing.assert_array_equal(transposed, index[:, :8].T)
