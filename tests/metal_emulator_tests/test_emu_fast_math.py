"""The fast-math flavour: compile_library(..., fast_math=True).

Apple's Metal compiler defaults to fast math, which assumes no value is ever
infinite or NaN. The emulator's third build flavour compiles kernels with
clang's -ffast-math, which makes the same assumption, so code that relies on
infinities misbehaves here as it may on a Mac. These tests pin that the
assumption really is in force (an infinity test is folded away), that a bit
pattern survives it, that each flavour has its own cache entry, and that the
host process keeps IEEE arithmetic.
"""
import numpy as np
import pytest
from conftest import kernel_path

from metal_emulator import compile_library

X = np.array([-np.inf, 1.0, -3.0e38, 0.0], np.float32)


def _probe(instrumented, fast_math):
    lib = compile_library([kernel_path("fast_math.metal")], instrumented=instrumented, fast_math=fast_math)
    out = np.full(3 * len(X), np.nan, np.float32)
    lib.dispatch("inf_probe", buffers={0: X, 1: out}, grid=(1,), threadgroup=(len(X),))
    return lib, out.reshape(len(X), 3)


@pytest.mark.parametrize("instrumented", [False, True], ids=["fast", "instrumented"])
def test_ieee_build_honours_infinities(instrumented):
    lib, out = _probe(instrumented, fast_math=False)
    assert not lib.fast_math
    assert out[:, 0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert out[:, 1].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert np.all(np.isneginf(out[:, 2]))


@pytest.mark.parametrize("instrumented", [False, True], ids=["fast", "instrumented"])
def test_fast_math_build_assumes_no_infinities(instrumented):
    lib, out = _probe(instrumented, fast_math=True)
    assert lib.fast_math
    # The -inf input is still -inf in memory, but both tests were folded to
    # "not infinite": what Metal's fast-math contract allows its compiler to do.
    assert out[:, 0].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert out[:, 1].tolist() == [0.0, 0.0, 0.0, 0.0]
    # A value made from bits and only stored is out of the optimizer's reach.
    assert np.all(np.isneginf(out[:, 2]))


def test_each_flavour_is_its_own_library():
    paths = {compile_library([kernel_path("fast_math.metal")], instrumented=i, fast_math=f).path
             for i in (False, True) for f in (False, True)}
    assert len(paths) == 4


def test_host_process_keeps_ieee_arithmetic():
    # The fast-math objects are linked without crtfastmath.o, so loading them
    # never switches the process to flush-to-zero: a float32 subnormal survives.
    _probe(False, fast_math=True)
    tiny = np.float32(1e-40)
    assert tiny * np.float32(1.0) == tiny and tiny > 0
