"""A pytest plugin that makes this machine look like one without clang 19 (tests/project/test_prereqs.py)."""
import metal_emulator._build as _build


def _no_clang():
    raise _build.ClangMissing("clang 19 not found (simulated by tests/noclang_plugin.py)")


def pytest_configure(config):
    _build.find_clang = _no_clang
