"""The C++ sources compile against the oldest supported torch (pyproject.toml).

Every csrc/**/*.cpp (the op layer, csrc/cpu/, csrc/metal/) is syntax-checked (templates instantiated,
op registrations type-checked) against the headers of the torch 2.4.0 macOS
wheel, with C++17, the standard that torch builds extensions with. The headers
are the ones tests/mps/test_mps_host.py downloads; their C++ API is the same on
every platform. This is the Linux half of "torch >= 2.4 works"; the macOS CI
builds and tests against 2.4.0 itself. (On this x86-64 machine the CPU
kernel's AVX2 branch is the one parsed; its NEON branch is parsed on macOS.)
"""
import glob
import os
import subprocess
import sys
import sysconfig

import pytest

from mps_syntax import syntax_check
from prereqs import unavailable

ROOT = syntax_check.ROOT
SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.cpp"), recursive=True))
VERSION = syntax_check.MINIMUM_TORCH_VERSION
STD = f"-std={syntax_check.MACOS_TORCH_VERSIONS[VERSION]}"



@pytest.fixture(scope="module")
def flags():
    if sys.platform == "darwin":
        # macOS CI builds against torch 2.4.0 itself, with Apple's SDK.
        pytest.skip("macOS: the macOS CI builds the extension against torch 2.4.0 itself")
    try:
        include = syntax_check.macos_torch_include(VERSION)
    except syntax_check.HeadersUnavailable as err:
        unavailable(f"torch {VERSION} headers unavailable: {err}")
    return [f"-I{include}", f"-I{os.path.join(include, 'torch', 'csrc', 'api', 'include')}",
            f"-I{sysconfig.get_paths()['include']}", f"-I{os.path.join(ROOT, 'csrc')}",
            f"-I{os.path.join(ROOT, 'shaders')}"]


@pytest.fixture(scope="module")
def pch(flags, tmp_path_factory):
    """torch's big headers parsed once (a precompiled header), so each source parses in seconds."""
    from metal_emulator import BuildError, find_clang

    try:
        clang = find_clang()
    except BuildError as err:
        unavailable(str(err))
    d = tmp_path_factory.mktemp("pch")
    header = d / "torch_headers.h"
    header.write_text("#include <Python.h>\n#include <ATen/ATen.h>\n#include <torch/library.h>\n")
    out = str(header) + ".pch"
    proc = subprocess.run([clang, "-x", "c++-header", STD, *flags, str(header), "-o", out],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return clang, out


def test_minimum_torch_is_what_pyproject_says():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        assert f'"torch>={VERSION.rsplit(".", 1)[0]}"' in f.read()


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: os.path.relpath(p, ROOT))
def test_source_compiles_against_the_minimum_torch(pch, flags, source):
    clang, header = pch
    cmd = [clang, "-fsyntax-only", STD, "-include-pch", header, *flags, source]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"$ {' '.join(cmd)}\n{proc.stderr[-4000:]}"


def test_the_check_bites(pch, flags, tmp_path):
    # An API torch 2.4 does not have must fail (here a made-up Tensor method).
    bad = tmp_path / "uses_missing_api.cpp"
    bad.write_text("#include <ATen/ATen.h>\nint64_t f(const at::Tensor& t) { return t.flash_metal_absent(); }\n")
    clang, header = pch
    proc = subprocess.run([clang, "-fsyntax-only", STD, "-include-pch", header, *flags, str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "flash_metal_absent" in proc.stderr, proc.stderr
