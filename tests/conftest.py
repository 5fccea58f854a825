"""Shared pytest set-up: NaN-poisoned allocations and the installed package.

The suite tests the *installed* flash_metal (pip install .). tests/ is put on
sys.path by pytest (this conftest has no package above it), so helpers such
as `numerics`, `backends` and the `metal_emulator` package import directly.

The test files sit in one folder per thing tested (repo_paths.GROUPS; docs/testing.md
has the map). A test file may import a helper from another test file by its
basename (`from test_sinks import assert_sinks_grad_close`), so every group
folder goes on sys.path here, before collection; tests/project/test_layout.py
keeps the basenames unique and every test file inside a group.
"""
import os

# Before torch loads its OpenMP runtime (which reads this once): threads that
# wait for work sleep instead of spinning. The README's test command runs one
# pytest-xdist worker per core, each with torch's intra-op threads; spinning
# waiters then burn the cores the other worker needs (measured here: 3x the
# CPU time on the CPU-kernel test files). A user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

import flash_metal
from repo_paths import put_groups_on_path

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
put_groups_on_path()


def pytest_configure(config):
    pkg_dir = os.path.dirname(os.path.abspath(flash_metal.__file__))
    if os.path.dirname(pkg_dir) == _REPO and not any(f.startswith("_C") for f in os.listdir(pkg_dir)):
        raise pytest.UsageError(
            "tests imported flash_metal from the source tree, which has no compiled _C. "
            "Run `pytest` (not `python -m pytest`, which puts the checkout first on sys.path) after "
            "`pip install .`, or use an editable install."
        )


def pytest_collection_modifyitems(config, items):
    """The mps cases: a smoke set unless FLASH_METAL_MPS_FULL=1 (tests/backends.py, select_mps_cases)."""
    import backends

    kept, deselected = backends.select_mps_cases(items)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
    config._flash_metal_mps = (sum(1 for i in kept if i.get_closest_marker("mps_backend")), len(deselected))


def pytest_report_collectionfinish(config, start_path, items):
    ran, skipped = getattr(config, "_flash_metal_mps", (0, 0))
    if skipped:
        return [f"flash_metal: mps smoke set: {ran} mps cases kept, {skipped} deselected "
                f"(FLASH_METAL_MPS_FULL=1 runs the full grid)"]
    return []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that needs the Metal emulator on a machine without clang 19 (e.g. a CPU-only box such as
    the AMX Xeon of issue 39, docs/testing.md) is a missing prerequisite: skipped locally, failed in CI
    (tests/prereqs.py's rule, applied where the emulator raises ClangMissing)."""
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is None or report.outcome != "failed":
        return
    from metal_emulator._build import ClangMissing
    import prereqs

    if isinstance(call.excinfo.value, ClangMissing) and not prereqs.IN_CI:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0,
                           f"Skipped: the Metal emulator needs clang 19 ({call.excinfo.value})")


@pytest.fixture(autouse=True)
def poison_uninitialized_memory():
    """Every at::empty inside the ops comes back NaN-filled while a test runs.

    With deterministic algorithms on, PyTorch fills uninitialized float memory
    with NaN (torch.utils.deterministic.fill_uninitialized_memory), including
    the outputs our C++ ops allocate. An element a kernel forgets to write then
    stays NaN and the tolerance check fails on it.
    """
    old = torch.are_deterministic_algorithms_enabled()
    old_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(old)
    torch.utils.deterministic.fill_uninitialized_memory = old_fill
