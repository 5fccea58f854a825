"""Where the checkout and the test folder are, and the test groups, for code in any folder of tests/.

tests/conftest.py puts tests/ on sys.path, so a test file in tests/cpu/ (or any
other group) imports this as `repo_paths` and never counts its own depth.
"""
import os
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT_DIR = os.path.dirname(TESTS_DIR)

# The test groups, one folder per thing tested (docs/testing.md has the map): the CPU kernels, the Metal
# kernels through the emulator, the MPS host, the public APIs and drop-ins, the performance model, the
# project (build, packaging, CI, layout; pytest never collects a folder named build/, its norecursedirs,
# hence project/), and the emulator's own tests (metal_emulator_tests/, next to the emulator package).
GROUPS = ("cpu", "metal", "mps", "api", "model", "project", "metal_emulator_tests")


def put_groups_on_path():
    """Every group folder on sys.path: a test file imports a helper from another test file by basename
    (`from test_sinks import assert_sinks_grad_close`). tests/conftest.py calls this before collection;
    code run outside pytest (the executed MPS host's scenario processes) calls it too."""
    for group in GROUPS:
        path = os.path.join(TESTS_DIR, group)
        if path not in sys.path:
            sys.path.append(path)
