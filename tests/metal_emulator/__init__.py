"""A Metal emulator for tests: runs the project's .metal kernels on the CPU.

Usage (see README.md)::

    from tests.metal_emulator import compile_library, EmulatorError
    lib = compile_library(["shaders/attention.metal"], instrumented=True)
    lib.dispatch("kernel_host_name", buffers={0: q, ...}, bytes={5: params},
                 grid=(gx, gy, gz), threadgroup=(tx, ty, tz), threadgroup_memory={0: n})

Importable as ``tests.metal_emulator`` or, with tests/ on sys.path, as ``metal_emulator``.
"""

from ._build import BuildError, find_clang
from ._check import MslRuleError, check_msl_rules, check_shader_tree, uncovered_shader_files
from ._ir import mma_call_sites, private_arrays, slow_integer_math
from ._library import DISPATCHED, DispatchCounts, EmulatorError, Library, compile_library, preprocessed

__all__ = [
    "BuildError",
    "DISPATCHED",
    "DispatchCounts",
    "EmulatorError",
    "Library",
    "MslRuleError",
    "check_msl_rules",
    "check_shader_tree",
    "compile_library",
    "find_clang",
    "preprocessed",
    "mma_call_sites",
    "private_arrays",
    "slow_integer_math",
    "uncovered_shader_files",
]
