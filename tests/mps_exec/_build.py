"""Builds the execution test's shared library: the real csrc/mps/*.mm, the
portable C++ they call, and the fakes, against a GNU Objective-C runtime.

Objects are cached in tests/mps_exec/.build/ by a hash of the source text,
flags, clang and torch, and checked against the digests of the repository
headers clang reported they include (-MD), so
a warm run only links, and a planted-bug copy of one .mm recompiles only it.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

# The SDK views the host is built against (the syntax check's; see there).
from mps_syntax.syntax_check import SDK_VIEWS  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
ROOT = os.path.dirname(TESTS)
CSRC = os.path.join(ROOT, "csrc")
STUB_DIR = os.path.join(TESTS, "mps_syntax", "stubs")
CACHE_DIR = os.environ.get("FLASH_METAL_MPS_EXEC_CACHE", os.path.join(HERE, ".build"))
# The portable C++ the host calls (compiled again here: setup.py builds the
# _C extension with hidden visibility, so it exports none of it).
# Paths relative to csrc/: the op layer's portable files, and the whole Metal
# planner (csrc/metal/ and its subfolders, by glob: a new file there is built too).
OP_LAYER_SOURCES = ("checks.cpp", "composite.cpp", "kvcache.cpp", "kvcache_quant.cpp")


def portable_sources() -> list[str]:
    planner = glob.glob(os.path.join(CSRC, "metal", "**", "*.cpp"), recursive=True)
    return list(OP_LAYER_SOURCES) + sorted(os.path.relpath(p, CSRC).replace(os.sep, "/") for p in planner)


FAKE_SOURCES = ("fake_foundation.mm", "fake_metal.mm", "fake_encoder.mm", "fake_mps.mm", "race_driver.mm", "personality.cpp")
# What apt must install for this build (Debian bookworm names).
APT_PACKAGES = "clang-19 libobjc-12-dev libblocksruntime-dev"
# Why the harness does not run on macOS: the real thing runs there.
MACOS_REASON = ("macOS: tests/mps_exec is a Linux stand-in for Apple's frameworks (GCC's libobjc, libBlocksRuntime, "
                "recording fakes); on a Mac the real Metal framework runs the host instead (tests/mps/test_mps_pipelines.py, "
                "tests/mps/test_device_info.py)")

# `@available(macOS 14.0, *)`: clang folds it to true off Apple platforms, so
# the build rewrites it into a call the harness can answer with any macOS
# version (fm_exec_macos_at_least, fake_mps.mm).
_AVAILABLE = re.compile(r"@available\s*\(\s*macOS\s+(\d+)(?:\.(\d+))?(?:\.\d+)?\s*,\s*\*\s*\)")


class ToolchainMissing(Exception):
    """clang 19, GCC's libobjc or libBlocksRuntime is not installed."""


class LinuxOnly(Exception):
    """This is macOS, where the harness's Linux stand-ins do not exist (and are not needed)."""


def check_platform(platform: str | None = None) -> None:
    """Raises LinuxOnly on macOS (the build looks for GCC's libobjc and the blocks runtime, which Apple's
    toolchain does not have; Apple's own runtime and frameworks run the host there for real)."""
    if (platform or sys.platform) == "darwin":
        raise LinuxOnly(MACOS_REASON)


class BuildFailed(Exception):
    """clang rejected a source, or the link failed (message holds the diagnostics)."""


def toolchain() -> dict:
    """clang, libobjc's and libBlocksRuntime's directories. Raises LinuxOnly on macOS, ToolchainMissing if a
    package is absent."""
    check_platform()
    return _toolchain()


@functools.lru_cache(maxsize=None)
def _toolchain() -> dict:
    from metal_emulator import BuildError, find_clang

    try:
        clang = find_clang()
    except BuildError as err:
        raise ToolchainMissing(f"{err}; the MPS execution test needs `apt-get install -y {APT_PACKAGES}`") from None
    objc = sorted(glob.glob("/usr/lib/gcc/*/*/libobjc.so"), key=lambda p: [int(x) for x in re.findall(r"/(\d+)/", p)])
    blocks = glob.glob("/usr/lib/*/libBlocksRuntime.so") + glob.glob("/usr/lib/libBlocksRuntime.so")
    missing = [name for name, found in (("libobjc-12-dev (GCC's libobjc.so)", objc),
                                        ("libblocksruntime-dev (libBlocksRuntime.so)", blocks)) if not found]
    if missing:
        raise ToolchainMissing(f"missing {', '.join(missing)}: `apt-get install -y {APT_PACKAGES}`")
    version = subprocess.run([clang, "--version"], capture_output=True, text=True, check=True).stdout
    return {"clang": clang, "objc_dir": os.path.dirname(objc[-1]), "blocks_dir": os.path.dirname(blocks[0]),
            "version": version}


@functools.lru_cache(maxsize=None)
def _torch_flags() -> tuple[list[str], list[str], str]:
    import torch
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    lib_dir = cpp_extension.library_paths()[0]
    links = [f"-L{lib_dir}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib_dir}"]
    return [abi, *includes], links, torch.__version__


def compile_flags() -> list[str]:
    torch_flags, _, _ = _torch_flags()
    return [
        # C++17: the oldest standard the supported torch headers (2.4) accept.
        "-std=c++17", "-fPIC", "-fvisibility=hidden", "-O1", "-g1",
        "-DFLASH_METAL_WITH_MPS=1",
        "-Wno-c++20-extensions",  # torch's own headers use C++20 bit-field initializers
        # Our minimal at::mps headers first, then Apple's API as transcribed.
        f"-I{os.path.join(HERE, 'include')}", f"-I{STUB_DIR}",
        f"-I{HERE}", *torch_flags, f"-I{CSRC}", f"-I{os.path.join(CSRC, 'mps')}", f"-I{os.path.join(ROOT, 'shaders')}",
    ]


OBJC_FLAGS = [
    "-x", "objective-c++",
    "-fobjc-runtime=gcc",              # GCC's libobjc: the GNU runtime Debian packages
    "-fblocks",                        # dispatch_sync takes a block (libBlocksRuntime)
    "-fno-objc-arc",                   # as setup.py: manual retain/release
    "-Werror=objc-method-access",      # a selector missing from the stubs is an error
    # A fake must implement every stub declaration of what it adopts.
    "-Werror=protocol", "-Werror=incomplete-implementation", "-Werror=objc-property-implementation",
]


_AVAILABLE_DECL = "extern \"C\" bool fm_exec_macos_at_least(int major, int minor);\n"


def rewrite_available(text: str) -> str:
    return _AVAILABLE.sub(lambda m: f"(::fm_exec_macos_at_least({m.group(1)}, {m.group(2) or 0}))", text)


def _digest(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return "missing"


def _local_deps_fresh(deps_file: str) -> bool:
    """True if every repository header the object was built from is unchanged."""
    try:
        with open(deps_file, encoding="utf-8") as f:
            deps = json.load(f)
    except (OSError, ValueError):
        return False
    return all(_digest(path) == digest for path, digest in deps.items())


def _write_local_deps(make_deps: str, deps_file: str) -> None:
    """Records the digests of the repository files clang's -MD output names
    (system and torch headers are covered by the toolchain and torch version;
    the source itself, a temporary copy, by the object's key)."""
    with open(make_deps, encoding="utf-8") as f:
        text = f.read().replace("\\\n", " ")
    paths = sorted({os.path.realpath(p) for p in text.split(":", 1)[1].split()
                    if os.path.realpath(p).startswith(ROOT + os.sep) and ".venv" not in p.split(os.sep)
                    and not os.path.realpath(p).startswith(os.path.realpath(CACHE_DIR) + os.sep)})
    tmp = f"{deps_file}.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({p: _digest(p) for p in paths}, f)
    os.replace(tmp, deps_file)


def host_sources() -> list[str]:
    return sorted(glob.glob(os.path.join(CSRC, "mps", "*.mm")))


def _sdk_flags(sdk: int | None) -> list[str]:
    return [] if sdk is None else [f"-DFM_STUB_MACOS_SDK={int(sdk)}"]


def _source_units(overrides: dict[str, str]) -> list[tuple[str, str, bool]]:
    """(name, text, is_objc) for every translation unit, .mm texts rewritten."""
    units = []
    for path in host_sources():
        name = os.path.basename(path)
        text = overrides.get(name)
        if text is None:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        # Line markers keep diagnostics pointing at the file on disk.
        units.append((name, _AVAILABLE_DECL + f'#line 1 "{path}"\n' + rewrite_available(text), True))
    for rel in portable_sources():
        # The unit's name is its path under csrc/ with "/" as "-" (metal-routing.cpp): a flat file name in
        # the cache, distinct across folders. Its includes are rooted at csrc/ (-I), as in setup.py's build.
        path = os.path.join(CSRC, rel)
        with open(path, encoding="utf-8") as f:
            units.append((rel.replace("/", "-"), f'#line 1 "{path}"\n' + f.read(), False))
    for name in FAKE_SOURCES:
        with open(os.path.join(HERE, name), encoding="utf-8") as f:
            units.append((name, f'#line 1 "{os.path.join(HERE, name)}"\n' + f.read(), name.endswith(".mm")))
    unknown = set(overrides) - {u[0] for u in units}
    if unknown:
        raise BuildFailed(f"overrides name no source of the build: {sorted(unknown)}")
    return units


def _atomic_write_from(tmp_path: str, final: str) -> None:
    os.replace(tmp_path, final)


# ThreadSanitizer (build(sanitize="thread")): every unit instrumented, the
# runtime linked as a shared library, to be preloaded into the process
# (tsan_runtime()), since Python itself is not instrumented.
_SANITIZE = {None: ([], []), "thread": (["-fsanitize=thread"], ["-fsanitize=thread", "-shared-libsan"])}


def tsan_runtime() -> str:
    """The ThreadSanitizer runtime to LD_PRELOAD into a process that loads a build(sanitize="thread")."""
    out = subprocess.run([toolchain()["clang"], "-print-file-name=libclang_rt.tsan-x86_64.so"], capture_output=True,
                         text=True, check=True).stdout.strip()
    if not os.path.isabs(out) or not os.path.exists(out):
        raise ToolchainMissing(f"clang has no ThreadSanitizer runtime ({out})")
    return out


# torch's headers, parsed once per (flags, clang, torch) into a precompiled
# header that every Objective-C++ unit including them loads: they are most of
# each such unit's compile (attention_mps.mm 20 s -> 6 s, fake_mps.mm 20 s
# -> 6 s on 2 cores; the header itself takes about 18 s, once per flag set).
# The units still include the headers themselves (the include guards make
# those no-ops), so what they compile is unchanged.
_PCH_TEXT = "#include <ATen/ATen.h>\n#include <torch/library.h>\n"
_USES_TORCH = re.compile(r"#include <(ATen|torch)/")


def _pch(flags: list[str], key_base: str) -> str:
    """The precompiled torch headers for Objective-C++ units compiled with `flags` (cached, built once)."""
    header_flags = ["objective-c++-header" if f == "objective-c++" else f for f in flags]
    key = hashlib.sha256((key_base + _PCH_TEXT + " ".join(header_flags)).encode()).hexdigest()[:20]
    out = os.path.join(CACHE_DIR, "pch", f"torch.{key}.pch")
    if os.path.exists(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    # The header stays beside its .pch: clang checks that the file the PCH
    # was made from still exists.
    header = out[:-4] + ".h"
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        staged = os.path.join(tmp, "torch.h")
        with open(staged, "w", encoding="utf-8") as f:
            f.write(_PCH_TEXT)
        _atomic_write_from(staged, header)
        built = os.path.join(tmp, "torch.pch")
        proc = subprocess.run([toolchain()["clang"], *header_flags, header, "-o", built], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise BuildFailed(f"precompiling torch's headers failed:\n{proc.stderr[-6000:]}")
        _atomic_write_from(built, out)
    return out


def _unit_flags(objc: bool, sdk: int | None, sanitize: str | None) -> list[str]:
    # The SDK view only matters to what sees Apple's API: the Objective-C++ units.
    return compile_flags() + _SANITIZE[sanitize][0] + (OBJC_FLAGS + _sdk_flags(sdk) if objc else ["-x", "c++"])


def _compile(unit: tuple[str, str, bool], key_base: str, sdk: int | None = None, sanitize: str | None = None,
             pch: str | None = None) -> str:
    name, text, objc = unit
    tc = toolchain()
    flags = _unit_flags(objc, sdk, sanitize)
    if pch and objc and _USES_TORCH.search(text):
        flags = flags + ["-include-pch", pch]
    key = hashlib.sha256((key_base + name + "\0" + text + "\0" + " ".join(flags)).encode()).hexdigest()[:20]
    obj = os.path.join(CACHE_DIR, "obj", f"{name}.{key}.o")
    deps_file = obj[:-2] + ".deps.json"
    if os.path.exists(obj) and _local_deps_fresh(deps_file):
        return obj
    os.makedirs(os.path.dirname(obj), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        src = os.path.join(tmp, name + (".mm" if objc and not name.endswith(".mm") else ""))
        with open(src, "w", encoding="utf-8") as f:
            f.write(text)
        out = os.path.join(tmp, "out.o")
        make_deps = os.path.join(tmp, "out.d")
        proc = subprocess.run([tc["clang"], *flags, "-MD", "-MF", make_deps, "-c", src, "-o", out],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildFailed(f"compiling {name} failed:\n{proc.stderr[-6000:]}")
        _atomic_write_from(out, obj)
        _write_local_deps(make_deps, deps_file)
    return obj


def build(overrides: dict[str, str] | None = None, sdk: int | None = None, sanitize: str | None = None) -> str:
    """Path of the built library (cached). overrides: {basename: text} replaces a source's text; sdk: the
    SDK view of the Apple stubs (SDK_VIEWS; None: the newest); sanitize: "thread" for ThreadSanitizer."""
    tc = toolchain()
    _, links, torch_version = _torch_flags()
    os.makedirs(CACHE_DIR, exist_ok=True)
    # One build at a time across processes (pytest-xdist's workers): each uses every core, and two
    # workers wanting the same host would compile the same objects twice.
    from metal_emulator._build import _build_lock

    with _build_lock(os.path.join(CACHE_DIR, "build.lock")):
        return _build_locked(tc, links, torch_version, overrides, sdk, sanitize)


def _build_locked(tc, links, torch_version, overrides, sdk, sanitize) -> str:
    key_base = hashlib.sha256((tc["version"] + torch_version).encode()).hexdigest()
    units = _source_units(overrides or {})
    with ThreadPoolExecutor(max_workers=max(1, min(len(units), os.cpu_count() or 1))) as pool:
        # The precompiled header first, the C++ units beside it, then the
        # Objective-C++ units (which wait for it).
        pch = pool.submit(_pch, _unit_flags(True, sdk, sanitize), key_base)
        jobs = {u[0]: pool.submit(lambda u=u: _compile(u, key_base, sdk, sanitize, pch.result() if u[2] else None))
                for u in sorted(units, key=lambda u: u[2])}
        objects = [jobs[u[0]].result() for u in units]
    link_flags = [*links, *_SANITIZE[sanitize][1], f"-L{tc['objc_dir']}", "-lobjc", f"-L{tc['blocks_dir']}", "-lBlocksRuntime",
                  "-Wl,-z,defs"]  # every symbol resolved now: a missing fake fails the build, not a test
    key = hashlib.sha256(("\0".join(objects) + " ".join(link_flags)).encode()).hexdigest()[:20]
    lib = os.path.join(CACHE_DIR, f"libmps_exec.{key}.so")
    if os.path.exists(lib):
        return lib
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        out = os.path.join(tmp, "lib.so")
        proc = subprocess.run([tc["clang"], "-shared", *objects, "-o", out, *link_flags], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise BuildFailed(f"linking the MPS execution library failed:\n{proc.stderr[-6000:]}")
        _atomic_write_from(out, lib)
    return lib


def copy_library(lib: str, dest_dir: str, name: str = "_C_exec.so") -> str:
    """A copy of `lib` in dest_dir: library.mm finds its shaders next to the loaded file."""
    os.makedirs(dest_dir, exist_ok=True)
    dest = os.path.join(dest_dir, name)
    shutil.copyfile(lib, dest)
    return dest
