"""[[max_total_threads_per_threadgroup(N)]]: read from the kernel, enforced at dispatch.

A Metal pipeline whose kernel declares N admits at most N threads per
threadgroup (maxTotalThreadsPerThreadgroup), so a dispatch with more fails
on a Mac; the emulator refuses it the same way, as a `limits` finding.
"""

import numpy as np
import pytest
from conftest import kernel_path, library

from metal_emulator import EmulatorError, compile_library
from metal_emulator._prepass import PrepassError


def test_declared_limits_are_read():
    lib = library("max_threads.metal", False)
    assert lib.max_threads("capped") == 64
    assert lib.max_threads("capped_float") == 96  # a program-scope constant, through a host-name instantiation
    assert lib.max_threads("uncapped") == 0  # none declared: Metal's own 1,024 applies


@pytest.mark.parametrize("name,limit", [("capped", 64), ("capped_float", 96)])
def test_launch_up_to_the_declared_limit_runs(instrumented, name, limit):
    lib = library("max_threads.metal", instrumented)
    out = np.zeros(limit, np.float32)
    lib.dispatch(name, buffers={0: out}, grid=(1,), threadgroup=(limit,))
    np.testing.assert_array_equal(out, np.arange(limit, dtype=np.float32))


@pytest.mark.parametrize("name,limit,tg", [("capped", 64, (65,)), ("capped", 64, (32, 3)),
                                           ("capped_float", 96, (128,)), ("capped_float", 96, (32, 2, 2))])
def test_launch_over_the_declared_limit_is_refused(instrumented, name, limit, tg):
    lib = library("max_threads.metal", instrumented)
    out = np.zeros(int(np.prod(tg)), np.float32)
    with pytest.raises(EmulatorError) as e:
        lib.dispatch(name, buffers={0: out}, grid=(1,), threadgroup=tg)
    assert "limits" in e.value.kinds
    assert f"max_total_threads_per_threadgroup({limit})" in str(e.value), str(e.value)
    assert not out.any()  # refused before any thread ran


def test_undeclared_kernel_takes_metal_limit():
    lib = library("max_threads.metal", False)
    out = np.zeros(1024, np.float32)
    lib.dispatch("uncapped", buffers={0: out}, grid=(1,), threadgroup=(1024,))
    assert out[1023] == 1023


def test_limit_that_depends_on_a_template_parameter_is_refused():
    # Dropping it silently would let an over-sized launch through.
    with pytest.raises(PrepassError, match="max_total_threads_per_threadgroup"):
        compile_library([kernel_path("max_threads_dependent.metal")])
