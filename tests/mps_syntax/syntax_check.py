"""Syntax-only compile of csrc/mps/*.mm on Linux, against the real PyTorch MPS headers.

The headers come from the macOS arm64 torch wheel (downloaded once and cached;
only torch/include is unpacked). Apple's frameworks are replaced by the
declarations in stubs/, transcribed from Apple's documentation. clang then
proves that the .mm agrees with PyTorch's MPS API and with those
declarations: an unknown ATen member, a wrong type or a misspelled selector
fails. It proves nothing about run-time behaviour.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
STUB_DIR = os.path.join(HERE, "stubs")
# The macOS torch versions whose headers the .mm must agree with, each with
# the C++ standard it needs. Why these: 2.4.0 is the minimum torch flash_metal
# supports (pyproject.toml; torch.library.register_fake and opcheck appear in
# 2.4), and its headers still parse as C++17; 2.14.1 is the newest torch the
# environment allows (/etc/xdg/pip caps it), the one with the MPS stream pool,
# and its OperationUtils-era headers need C++20 (std::type_identity).
MACOS_TORCH_VERSIONS = {"2.4.0": "c++17", "2.14.1": "c++20"}
MINIMUM_TORCH_VERSION = "2.4.0"
MACOS_TORCH_VERSION = "2.14.1"  # the default for callers that check one version
# Why macosx_14_0_arm64: the tag PyTorch publishes its Apple-silicon wheels
# under (pip also accepts the older macosx_11_0_arm64 tag of 2.4.0 for it).
MACOS_PLATFORM = "macosx_14_0_arm64"
# The Apple SDKs the .mm must compile with, as views of stubs/ (see
# stubs/Availability.h): the newest (Xcode 26; the stubs' default) and the
# macOS 14 SDK of Xcode 15 / Command Line Tools 15, the oldest toolchain that
# builds Metal 3.1, which lacks the macOS 15 API (MTLMathMode and friends).
# `@available` guards only the run time, so only a build against the older
# view catches a use of newer API that compiles with the newer one.
SDK_VIEWS = {"sdk26": None, "sdk14": 140000}
# Why the check is skipped on macOS: stubs/ stands in for Apple's SDK, which a
# Mac has for real, and `pip install .` compiles csrc/mps/*.mm against it.
MACOS_REASON = ("macOS: tests/mps_syntax's stubs stand in for Apple's SDK on Linux; on a Mac `pip install .` "
                "compiles csrc/mps/*.mm against the real SDK and torch")
CACHE_ROOT = os.environ.get(
    "FLASH_METAL_MACOS_TORCH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "flash_metal"))
# A file whose presence means the cache holds a complete unpack.
_SENTINEL = os.path.join("torch", "include", "ATen", "mps", "MPSStream.h")


def cache_dir_for(version: str) -> str:
    return os.path.join(CACHE_ROOT, f"macos-torch-{version}")


class HeadersUnavailable(Exception):
    """The macOS torch headers could not be downloaded or unpacked."""


def macos_torch_include(version: str = MACOS_TORCH_VERSION) -> str:
    """torch/include of the macOS wheel of torch `version`, downloaded and unpacked on first use."""
    cache_dir = cache_dir_for(version)
    include = os.path.join(cache_dir, "torch", "include")
    if os.path.exists(os.path.join(cache_dir, _SENTINEL)):
        return include
    wheel_dir = os.path.join(cache_dir, "wheel")
    wheels = glob.glob(os.path.join(wheel_dir, f"torch-{version}-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", f"torch=={version}", "--no-deps",
               "--only-binary=:all:", "--platform", MACOS_PLATFORM, "-d", wheel_dir]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = glob.glob(os.path.join(wheel_dir, f"torch-{version}-*.whl"))
        if proc.returncode or not wheels:
            raise HeadersUnavailable(f"`{' '.join(cmd)}` failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    # Unpack into a temporary sibling, then rename: safe if two test runs race.
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="unpack.", dir=cache_dir)
    try:
        with zipfile.ZipFile(wheels[0]) as whl:
            whl.extractall(tmp, members=[n for n in whl.namelist() if n.startswith("torch/include/")])
        if not os.path.exists(os.path.join(tmp, _SENTINEL)):
            raise HeadersUnavailable(f"{wheels[0]} has no {_SENTINEL}")
        os.makedirs(os.path.join(cache_dir, "torch"), exist_ok=True)
        try:
            os.rename(os.path.join(tmp, "torch", "include"), include)
        except OSError:
            if not os.path.exists(os.path.join(cache_dir, _SENTINEL)):
                raise
    except (OSError, zipfile.BadZipFile) as err:
        raise HeadersUnavailable(f"cannot unpack {wheels[0]}: {err}") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return include


# The headers a precompiled header holds (precompiled_header_command): the
# torch headers the .mm files include, the bulk of every parse (measured on
# this 2-core machine under load: attention_mps.mm 51 s alone, 7 s with them
# precompiled in 55 s once).
PCH_INCLUDES = ("ATen/ATen.h", "ATen/mps/MPSDevice.h", "ATen/mps/MPSProfiler.h", "ATen/mps/MPSStream.h",
                "torch/library.h")


def precompiled_header_command(clang: str, torch_include: str, out_dir: str, std: str = "c++20",
                               sdk: int | None = None) -> tuple[list[str], str]:
    """(clang command, .pch path): darwin_libc.h and PCH_INCLUDES precompiled with exactly the flags
    syntax_check_command(..., pch=path) parses with. A .pch also supplies the headers a .mm forgot to
    include, so each .mm keeps one check without it (test_mps_host.py: the newest torch's)."""
    header = os.path.join(out_dir, "flash_metal_mm_pch.h")
    with open(header, "w", encoding="utf-8") as f:
        f.write(f'#include "{os.path.join(STUB_DIR, "darwin_libc.h")}"\n')
        f.writelines(f"#include <{h}>\n" for h in PCH_INCLUDES)
    pch = header + ".pch"
    cmd = syntax_check_command(clang, header, torch_include, std=std, sdk=sdk)
    cmd.remove("-fsyntax-only")
    at = cmd.index("-include")
    del cmd[at:at + 2]
    cmd[cmd.index("objective-c++")] = "objective-c++-header"
    return cmd + ["-o", pch], pch


def syntax_check_command(clang: str, source: str, torch_include: str, extra: tuple[str, ...] = (),
                         std: str = "c++20", sdk: int | None = None, pch: str | None = None) -> list[str]:
    """The clang command line that syntax-checks one .mm file (std: the C++ standard of that torch; sdk: the
    SDK view of stubs/, a value of SDK_VIEWS; pch: a precompiled header made for the same three by
    precompiled_header_command, in place of the forced darwin_libc.h)."""
    return [
        clang, "-fsyntax-only", "-x", "objective-c++", f"-std={std}",
        "-fblocks",                        # dispatch_sync takes a block
        "-fobjc-runtime=gnustep-2.0",      # any modern runtime parses; Apple's is not available on Linux
        "-fno-objc-arc",                   # as setup.py builds it: manual retain/release
        "-Werror=objc-method-access",      # a selector missing from stubs/ is an error, not a warning
        "-DFLASH_METAL_WITH_MPS=1",
        *([] if sdk is None else [f"-DFM_STUB_MACOS_SDK={int(sdk)}"]),
        *(["-include", os.path.join(STUB_DIR, "darwin_libc.h")] if pch is None else ["-include-pch", pch]),
        f"-I{STUB_DIR}", f"-I{torch_include}", f"-I{os.path.join(torch_include, 'torch', 'csrc', 'api', 'include')}",
        f"-I{os.path.join(ROOT, 'csrc')}", f"-I{os.path.join(ROOT, 'shaders')}",
        *extra, source,
    ]


def mm_sources() -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, "csrc", "mps", "*.mm")))
