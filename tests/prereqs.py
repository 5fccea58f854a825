"""Test prerequisites (clang, downloaded headers, Debian packages): skip locally, fail in CI.

A developer without clang 19 or a network still gets a green run of what
their machine can check; CI (CI=true), where the README's install command
has set everything up, treats a missing prerequisite as a broken set-up.

The Linux stand-ins for a Mac (the Metal emulator, the MPS host run against
recording fakes) are another matter: on macOS the real Metal compiler,
framework and GPU take their place, so there they skip even in CI
(`linux_only`), and the Mac job runs the real thing instead.
"""
import os
import sys

import pytest

IN_CI = os.environ.get("CI") == "true"


def on_macos() -> bool:
    """True on macOS (read at call time, so tests can pretend to be elsewhere)."""
    return sys.platform == "darwin"


def unavailable(reason: str):
    """Skip the calling test locally; fail it in CI."""
    if IN_CI:
        pytest.fail(reason)
    pytest.skip(reason)


def linux_only(reason: str):
    """Skip the calling test (or fixture) on macOS, also in CI; do nothing elsewhere.

    For the Linux stand-ins of what a Mac has for real. `reason` says what the
    test stands in for; the skip message names the platform, e.g.
    linux_only("the Metal emulator: clang runs the shaders as C++") gives
    "Linux-only stand-in, skipped on macOS (the real Metal path runs there):
    the Metal emulator: clang runs the shaders as C++".
    """
    if on_macos():
        pytest.skip(f"Linux-only stand-in, skipped on macOS (the real Metal path runs there): {reason}")


# The same as a mark, for a whole module (`pytestmark = LINUX_ONLY`) or one test.
LINUX_ONLY = pytest.mark.skipif(
    sys.platform == "darwin",
    reason="Linux-only stand-in, skipped on macOS (the real Metal path runs there)",
)
