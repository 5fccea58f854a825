"""private_arrays(): private arrays a kernel keeps in memory after LLVM's optimizer.

A GPU can hold a thread's private array in registers only when every index
into it is a compile-time constant; Apple's compiler is LLVM-based, so
compiling the kernel as the fast build does (stopping at LLVM IR) and listing
the array allocas that survive is a faithful proxy. The proof kernels compute
the same sum with a runtime-indexed and a constant-indexed array; the shipped
attention kernels must keep no array in memory (their query row and
accumulator loop to the compile-time head-dim bucket, fully unrolled).
"""
import os
import struct

import numpy as np
import pytest
from conftest import TESTS, kernel_path, library

from metal_emulator import private_arrays
from shader_builds import DEFAULT_EXCLUDE

SHADER = os.path.join(os.path.dirname(TESTS), "shaders", "attention.metal")


def test_runtime_index_stays_in_memory_constant_index_does_not():
    arrays = private_arrays([kernel_path("registers.metal")])
    assert arrays == {"runtime_index": ["[16 x float]"], "constant_index": []}


@pytest.mark.parametrize("n", [1, 7, 16])
def test_both_proof_kernels_compute_the_same_sum(instrumented, n):
    lib = library("registers.metal", instrumented)
    x = np.random.default_rng(n).standard_normal(16).astype(np.float32)
    want = sum(float(2 * x[c]) * float(2 * x[n - 1 - c]) for c in range(n))
    for name in ("runtime_index", "constant_index"):
        out = np.full(1, np.nan, np.float32)
        lib.dispatch(name, buffers={0: x, 1: out}, bytes={2: struct.pack("<i", n)}, grid=(1,), threadgroup=(1,))
        assert abs(out[0] - want) <= 1e-5 * max(1.0, abs(want)), name


def test_shipped_attention_kernels_keep_no_array_in_memory():
    arrays = private_arrays([SHADER], exclude=DEFAULT_EXCLUDE)
    # The post's 2 kernels x 3 dtypes x 4 buckets, the prefill kernel and the
    # 3 decode kernels x 3 dtypes x 8 buckets (192 since issue 20 section 3),
    # the backward's 2 kernels x 3 dtypes x 8 buckets less float32 d72 (it
    # runs d80's: 8 resident SIMD-groups per core, choose_backward), and the
    # sinks' gradient (flash_sinks_grad, one), and the split-D forward at
    # (512, 512), (576, 512) and (256, 512) (three per dtype: Q, O and S
    # fragment arrays, indexed by constants only): 176. The default builds' set: the wide decode's 18 (decode buckets 512
    # and 576) are checked on their own, tests/metal/test_metal_decode_wide.py.
    assert len(arrays) == 2 * 3 * 4 + 4 * 3 * 8 + 2 * (3 * 8 - 1) + 1 + 3 * 3
    in_memory = {name: a for name, a in arrays.items() if a}
    assert not in_memory, f"private arrays left in per-thread memory: {in_memory}"
