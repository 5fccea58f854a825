"""The emulator's builds of shaders/attention.metal that the suite shares.

Every test that builds the shipped shaders in the emulator goes through
shipped_library, so all of them share one build per flavour (the emulator
caches by source, flags and filters) and all of them leave out the same
kernels. No torch and no flash_metal here: the executed MPS host's processes
(tests/mps_exec), which load a host build of their own, import this too.
"""
import fnmatch
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHADER = os.path.join(ROOT, "shaders", "attention.metal")

# The wide decode (issue 20: the decode-only head-dim buckets 512 and 576, 3
# kernels x 3 dtypes x 2 buckets = 18). Why out of the default builds: they are
# the library's widest unrolled kernels (16 and 18 values per lane per slice),
# their compile put the CI run past its 30 minutes, and only
# tests/metal/test_metal_decode_wide.py and tests/model/test_metal_model_decode_wide.py run
# them, on partial libraries of their own (tests/backends.py
# wide_decode_library). The default builds still name them
# (Library.omitted_names), so the registry, the planner and the executed
# host's fake metallib are checked against every kernel of the source.
WIDE_DECODE_KERNELS = ("flash_decode*_d512", "flash_decode*_d576")
# The split-D backward at D = 512 (issue 20 section 3, shaders/backward/attention_backward_splitd.h:
# 2 kernels x 3 dtypes). Out of the default builds for the same reason (CI time): only
# tests/metal/test_metal_backward_splitd.py and benchmarks/model/families/splitd_backward.py run them,
# on a partial library of their own (tests/backends.py splitd_backward_library).
SPLITD_BACKWARD_KERNELS = ("flash_backward_splitd_*",)
# The quantized-cache decode (issue 44, shaders/decode/attention_decode_quant.h: 2 kernels x 3 dtypes x 8
# buckets). Out of the default builds for the same reason (CI time): tests/metal/test_metal_decode_quant.py
# builds the few it runs (tests/backends.py quant_decode_library).
QUANT_DECODE_KERNELS = ("flash_decode_quant_*",)
DEFAULT_EXCLUDE = WIDE_DECODE_KERNELS + SPLITD_BACKWARD_KERNELS + QUANT_DECODE_KERNELS


def is_wide_decode(kernel_name: str) -> bool:
    """Whether `kernel_name` is one of WIDE_DECODE_KERNELS (the default builds' left-out kernels)."""
    return any(fnmatch.fnmatchcase(kernel_name, p) for p in WIDE_DECODE_KERNELS)


def is_quant_decode(kernel_name: str) -> bool:
    """Whether `kernel_name` is one of QUANT_DECODE_KERNELS."""
    return any(fnmatch.fnmatchcase(kernel_name, p) for p in QUANT_DECODE_KERNELS)


def is_splitd_backward(kernel_name: str) -> bool:
    """Whether `kernel_name` is one of SPLITD_BACKWARD_KERNELS."""
    return any(fnmatch.fnmatchcase(kernel_name, p) for p in SPLITD_BACKWARD_KERNELS)


def shipped_library(instrumented: bool = False, fast_math: bool = False, only=None, path: str = SHADER):
    """The emulator's build of the shipped shaders (`path`: an identical copy, e.g. the installed one,
    shares the build), less DEFAULT_EXCLUDE; only: compile_library's, for a partial flavour."""
    from metal_emulator import compile_library

    return compile_library([path], instrumented=instrumented, fast_math=fast_math, only=only,
                           exclude=DEFAULT_EXCLUDE)
