"""The test harness's own logic, on any OS: the mps smoke/full selection
(tests/backends.py), what a device's GPU family rules out, and prereqs'
linux_only (Linux stand-ins skip on macOS even in CI, other prerequisites
still fail there).

mps itself is absent on Linux, so the selection is checked on the real
collected grids (their mps cases are collected, then skipped here) and on
made-up items.
"""
import os
import re
import subprocess
import sys
import types

import pytest

import backends
import prereqs
from repo_paths import ROOT_DIR as ROOT


class FakeItem:
    """The parts of a pytest item the selection reads."""

    def __init__(self, nodeid, params=None, mps=True):
        self.nodeid = nodeid
        self._mps = mps
        if params is not None:
            self.callspec = types.SimpleNamespace(params=params)

    def get_closest_marker(self, name):
        return object() if name == "mps_backend" and self._mps else None


def _grid(test, **axes):
    """The cross product of `axes` as FakeItems of one test function, in pytest's order."""
    items = [{}]
    for name, values in axes.items():
        items = [dict(p, **{name: v}) for p in items for v in values]
    return [FakeItem(f"tests/test_x.py::{test}[{'-'.join(map(str, p.values()))}]", p) for p in items]


def test_the_smoke_set_covers_every_value_in_far_fewer_cases():
    grid = _grid("test_a", backend=["mps"], dtype=["float32", "float16", "bfloat16"], d=[32, 64, 128, 256],
                 causal=[False, True], layout=["contiguous", "transposed", "offset_slice"])
    kept = backends.mps_smoke_selection(grid)
    assert len(kept) <= 5 < len(grid)  # at most the largest axis + 1, against 72
    for axis in ("dtype", "d", "causal", "layout"):
        assert {i.callspec.params[axis] for i in kept} == {i.callspec.params[axis] for i in grid}, axis
    assert kept == [i for i in grid if i in kept]  # collection order kept
    assert backends.mps_smoke_selection(grid) == kept  # deterministic


def test_each_test_function_keeps_its_own_cover():
    a = _grid("test_a", backend=["mps"], dtype=["float32", "float16"])
    b = _grid("test_b", backend=["mps"], dtype=["float32", "float16"])
    plain = [FakeItem("tests/test_x.py::test_c", None)]  # not parametrized
    kept = backends.mps_smoke_selection(a + b + plain)
    assert {i.nodeid.split("[")[0] for i in kept} == {"tests/test_x.py::test_a", "tests/test_x.py::test_b",
                                                       "tests/test_x.py::test_c"}
    assert len(kept) == 5


def test_only_mps_cases_are_deselected_and_full_keeps_all(monkeypatch):
    mps = _grid("test_a", backend=["mps"], dtype=["float32", "float16", "bfloat16"], d=[32, 64, 128])
    cpu = [FakeItem(i.nodeid.replace("mps", "cpu"), dict(i.callspec.params, backend="cpu"), mps=False) for i in mps]
    items = cpu + mps
    monkeypatch.delenv(backends.MPS_FULL_ENV, raising=False)
    kept, dropped = backends.select_mps_cases(items)
    assert all(i in kept for i in cpu)
    assert dropped and all(i in mps for i in dropped)
    assert len(kept) + len(dropped) == len(items)
    monkeypatch.setenv(backends.MPS_FULL_ENV, "1")
    assert backends.select_mps_cases(items) == (items, [])


def _collected_mps_cases(env_full):
    env = dict(os.environ)
    env.pop(backends.MPS_FULL_ENV, None)
    if env_full:
        env[backends.MPS_FULL_ENV] = "1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", "mps_backend", "tests/api/test_attention.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_the_real_grids_mps_cases_are_selected_by_the_env_var():
    # The conftest hook on a real test module: every mps case carries the mark,
    # the default keeps a cover of each test function, FLASH_METAL_MPS_FULL=1 all.
    full = _collected_mps_cases(True)
    smoke = _collected_mps_cases(False)
    assert full and all("mps" in line for line in full)
    assert set(smoke) < set(full) and len(smoke) * 4 < len(full)
    functions = {line.split("[")[0] for line in full}
    assert {line.split("[")[0] for line in smoke} == functions


# --- what the device family rules out (metal_device_info's JSON, helper-built samples) ---

def _info(**families):
    return {"schema": 1, "available": True, "device": {"name": "Apple Paravirtual device", "families": families}}


@pytest.mark.parametrize("families, ruled_out", [
    (dict(Apple7=True, Apple8=True, Apple9=True, Apple10=None, Mac2=True), False),  # an M3
    (dict(Apple7=False, Apple8=False, Apple9=False, Apple10=None, Mac2=True), False),  # Mac2 only
    (dict(Apple7=False, Apple8=False, Apple9=False, Apple10=None, Mac2=False), True),  # neither
    (dict(Apple7=None, Apple8=None, Apple9=None, Apple10=None, Mac2=None), False),  # nothing known
], ids=["m3", "mac2-only", "neither", "unknown"])
def test_device_family_gaps(families, ruled_out):
    gaps = backends.device_family_gaps(_info(**families))
    assert bool(gaps) == ruled_out
    if ruled_out:
        assert "simdgroup matrices" in gaps[0]


def test_no_device_rules_nothing_out():
    assert backends.device_family_gaps({"available": False, "device": None}) == []
    assert backends.device_family_gaps(None) == []


# --- prereqs ---

def test_linux_only_skips_on_macos_even_in_ci(monkeypatch):
    monkeypatch.setattr(prereqs, "IN_CI", True)
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(pytest.skip.Exception, match="Linux-only stand-in, skipped on macOS.*the emulator"):
        prereqs.linux_only("the emulator")
    # A missing prerequisite is still a failure in CI, on macOS too.
    with pytest.raises(pytest.fail.Exception, match="no clang"):
        prereqs.unavailable("no clang")


def test_linux_only_does_nothing_on_linux(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    assert prereqs.linux_only("the emulator") is None


def test_linux_only_mark_matches_the_platform():
    (mark,) = prereqs.LINUX_ONLY.mark.args
    assert mark is (sys.platform == "darwin")
    assert re.search("Linux-only", prereqs.LINUX_ONLY.mark.kwargs["reason"])


# --- tests/device_report.py (the macOS CI's device step) ---

def test_device_report_names_the_device_and_what_its_family_rules_out():
    import device_report

    info = _info(Apple7=False, Apple8=False, Apple9=False, Apple10=None, Mac2=False)
    info.update(macos={"version": "15.6.1"}, library={"origin": "the precompiled /x/flash_metal.metallib"})
    info["device"].update(source="MTLCopyAllDevices", max_threads_per_threadgroup=[1024, 1024, 1024])
    text = device_report.report(info, mps_reason="the MPS device cannot run these kernels", torch_version="2.4.0")
    assert "Apple Paravirtual device (found via MTLCopyAllDevices)" in text
    assert "| Apple7 | no |" in text and "| Apple10 | not asked (older macOS) |" in text
    assert "rules out:** no simdgroup matrices" in text
    assert "| mps tests | skipped: the MPS device cannot run these kernels |" in text
    assert "the precompiled /x/flash_metal.metallib" in text and "| macOS | 15.6.1 |" in text
    ok = _info(Apple7=True, Mac2=True)
    assert "rules out:** nothing we know of" in device_report.report(ok)


def test_device_report_without_a_device_or_without_the_op():
    import device_report

    none = {"schema": 1, "available": False, "reason": "no Metal device: MTLCopyAllDevices() lists none",
            "device": None, "library": None, "macos": None}
    assert "| device | none: no Metal device: MTLCopyAllDevices() lists none |" in device_report.report(none)
    assert "Could not ask the device:** boom" in device_report.report(None, error="boom")


def test_device_report_runs_here_and_reports_instead_of_crashing():
    import torch

    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "device_report.py")],
                          capture_output=True, text=True)
    assert proc.stdout.startswith("### Metal device"), proc.stdout + proc.stderr
    has_op = hasattr(torch.ops.flash_metal, "metal_device_info")
    # With the op (every build has it): no device on Linux, exit 0; an older build: the error, exit 1.
    assert proc.returncode == (0 if has_op else 1), proc.stdout + proc.stderr
    assert ("| device | none:" in proc.stdout) if has_op else ("Could not ask the device" in proc.stdout)
