"""Shared helpers for the emulator's own tests.

tests/ is on sys.path (as tests/conftest.py arranges for the whole suite), so
the emulator imports as `metal_emulator`. The insert below only matters when
this directory runs on its own with --confcutdir.
"""

import os
import sys

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from metal_emulator import compile_library  # noqa: E402

KERNELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")


def kernel_path(name: str) -> str:
    return os.path.join(KERNELS, name)


def library(name: str, instrumented: bool):
    """Compiled once per process (and cached on disk across runs)."""
    return compile_library([kernel_path(name)], instrumented=instrumented)


@pytest.fixture(params=[False, True], ids=["fast", "instrumented"])
def instrumented(request):
    return request.param
