"""csrc/cpu/kv_dequant.h in each ISA the CPU kernel can be built for (issue 44).

This machine builds the extension for itself (-march=native: AVX-512 here),
so the AVX2 and scalar-fallback loads would otherwise never run in the
suite. tests/kv_dequant_check.cpp is compiled three times -- native, AVX2
(+FMA, F16C), and without AVX (the scalar fallback) -- and each build checks
every format's vector load against the scalar decode lane by lane, a 4-bit
byte by hand, and the shuffle-tree reduction's permutation. Its fp8 table
(every e4m3fn code, via the float16 bit trick) must equal torch's own
float8_e4m3fn conversion, NaN codes included.
"""
import os
import platform
import shutil
import subprocess

import pytest
import torch
import torch.utils.cpp_extension as cpp
from repo_paths import TESTS_DIR as HERE

FLAGS = {"native": ["-march=native"], "avx2": ["-mavx2", "-mfma", "-mf16c"], "scalar": ["-mno-avx"]}


@pytest.fixture(scope="module")
def compiler():
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    return cxx


@pytest.mark.parametrize("isa", list(FLAGS))
def test_loads_match_the_scalar_decode(compiler, isa, tmp_path):
    if isa != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the {isa} build is an x86-64 one; this is {platform.machine()} (native runs)")
    exe = tmp_path / "check"
    cmd = [compiler, "-std=c++17", "-O1", *FLAGS[isa], *("-I" + p for p in cpp.include_paths()),
           os.path.join(HERE, "kv_dequant_check.cpp"), "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    lines = run.stdout.split("\n")
    assert run.returncode == 0 and lines[256].startswith("ok"), run.stdout[-500:]
    width = int(lines[256].split("width=")[1])
    assert width == {"native": width, "avx2": 8, "scalar": 1}[isa]
    got = torch.tensor([float(x) for x in lines[:256]], dtype=torch.float64)
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(want).sum() == 2
    assert torch.equal(got[~torch.isnan(got)], want[~torch.isnan(want)])
