"""Where the model's counts come from: the Metal emulator and its launchers,
which live in tests/ (never shipped). Importing this module puts tests/ on
sys.path once, so that every part of the model reaches them the same way
(`backends`, `shader_builds`, `metal_emulator`, and the test helpers the
paged families launch through).
"""
import importlib
import os
import sys

# benchmarks/model/core/emulator.py -> the repository root
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TESTS = os.path.join(ROOT, "tests")
SHADERS = os.path.join(ROOT, "shaders")
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)  # the emulator and its launcher live in tests/ (not shipped)

import backends  # noqa: E402  (needs tests/ on sys.path)


def tests_module(name):
    """A module of tests/ (the emulator's launchers and helpers), by name."""
    return importlib.import_module(name)
