"""Threadgroup memory is shared by a group, private to it, and starts as NaN."""

import numpy as np
import pytest
from conftest import library


@pytest.mark.parametrize("tpg,grid", [(1024, (2, 1)), (96, (3, 2))])
def test_threadgroup_memory_is_shared(instrumented, tpg, grid):
    lib = library("threadgroup.metal", instrumented)
    groups = grid[0] * grid[1]
    out = np.zeros(groups * tpg, np.uint32)
    lib.dispatch("share", buffers={0: out}, grid=grid, threadgroup=(tpg,), threadgroup_memory={0: 4 * 1024})
    lid = np.arange(tpg)
    other = (lid + 517) % tpg
    for g in range(groups):
        expect = (other * 3 + g) + other * 65536
        np.testing.assert_array_equal(out[g * tpg : (g + 1) * tpg], expect.astype(np.uint32))


def test_unwritten_threadgroup_memory_reads_nan(instrumented):
    lib = library("threadgroup.metal", instrumented)
    f = np.zeros(64, np.float32)
    h = np.zeros(64, np.float16)
    lib.dispatch("unwritten", buffers={0: f, 1: h}, grid=(1,), threadgroup=(64,))
    assert np.isnan(f).all() and np.isnan(h).all()


def test_position_attributes():
    lib = library("threadgroup.metal", False)
    tg, grid = (4, 3, 2), (2, 3, 2)
    tpg = (tg[0] * grid[0], tg[1] * grid[1], tg[2] * grid[2])
    total = tpg[0] * tpg[1] * tpg[2]
    out = np.zeros(total * 20, np.uint32)
    lib.dispatch("positions", buffers={0: out}, grid=grid, threadgroup=tg)
    rows = out.reshape(total, 20)
    seen = set()
    for r in rows:
        gx, gy, gz = r[0:3]
        lx, ly, lz = r[3:6]
        bx, by, bz = r[6:9]
        assert (gx, gy, gz) == (bx * tg[0] + lx, by * tg[1] + ly, bz * tg[2] + lz)
        assert r[9] == tg[0] * 10000 + tg[1] * 100 + tg[2]
        assert r[10] == grid[0] * 10000 + grid[1] * 100 + grid[2]
        assert r[11] == tpg[0] * 10000 + tpg[1] * 100 + tpg[2]
        index = (lz * tg[1] + ly) * tg[0] + lx
        assert r[12] == index and r[13] == index % 32 and r[14] == index // 32
        assert r[15] == 1 and r[16] == 32
        seen.add((gx, gy, gz))
    assert len(seen) == total
