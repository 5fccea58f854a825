"""Toolchain discovery, compile flags, and the on-disk build cache."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

from . import _prepass

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM_DIR = os.path.join(HERE, "include")
RUNTIME_DIR = os.path.join(HERE, "runtime")
CACHE_DIR = os.environ.get("FLASH_METAL_EMULATOR_CACHE", os.path.join(HERE, ".build"))
# The Metal version the shaders see: MSL 3.1 (macOS 14), the oldest our
# host targets; shaders only test that it is defined.
METAL_VERSION = "310"
# MSL 4 (compile_library(msl=4)): tensor ops (<metal_tensor>, MPP) need it, and
# their class-type template arguments (matmul2d<descriptor, scope>) need C++20
# in clang (Apple compiles them with -std=metal4.0). The shipped shaders keep
# MSL 3.1 and C++17; the rules check keeps parsing them as C++14.
MSL_VERSIONS = {3: ("c++17", METAL_VERSION, []), 4: ("c++20", "400", ["-D__HAVE_TENSOR__=1"])}
RUNTIME_SOURCES = ("executor.cpp", "memory.cpp", "sanitizer.cpp", "softfloat.cpp")


class BuildError(Exception):
    """clang rejected a shader (message holds its diagnostics)."""


class ClangMissing(BuildError):
    """No clang 19 on this machine: a missing prerequisite (tests/prereqs.py), not a shader error."""


@functools.lru_cache(maxsize=None)
def find_clang() -> str:
    """clang++ from $FLASH_METAL_CLANG, clang++-19 / clang-19 on PATH, or /usr/lib/llvm-19/bin."""
    env = os.environ.get("FLASH_METAL_CLANG")
    candidates = [env] if env else []
    candidates += [shutil.which(n) for n in ("clang++-19", "clang-19")]
    candidates += ["/usr/lib/llvm-19/bin/clang++", "/usr/lib/llvm-19/bin/clang"]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise ClangMissing(
        "clang 19 not found: install it with `apt-get install -y clang-19 libclang-rt-19-dev` "
        "or point FLASH_METAL_CLANG at a clang++ binary"
    )


def _llvm_tool(name: str) -> str | None:
    """An LLVM tool beside the clang in use (Homebrew's llvm@19 is not on PATH), on PATH, or in /usr/lib/llvm-19."""
    try:
        beside = os.path.join(os.path.dirname(find_clang()), name)
    except BuildError:
        beside = None
    for p in (beside, shutil.which(name + "-19"), shutil.which(name), f"/usr/lib/llvm-19/bin/{name}"):
        if p and os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


@functools.lru_cache(maxsize=None)
def find_symbolizer() -> tuple[str, str] | None:
    """('llvm', path) or ('addr2line', path) for turning PCs into source lines."""
    p = _llvm_tool("llvm-symbolizer")
    if p:
        return ("llvm", p)
    p = shutil.which("addr2line")
    return ("addr2line", p) if p else None


DARWIN = platform.system() == "Darwin"


def link_flags() -> list[str]:
    """Flags of the shared-library link. ELF: -Bsymbolic binds the library's
    references to its own definitions, so two emulator libraries loaded in one
    process never use each other's runtime. Apple's linker has no such flag
    and needs none: a Mach-O dylib's two-level namespace binds them so already."""
    return [] if DARWIN else ["-Wl,-Bsymbolic"]


def debug_info_step(library: str) -> list[str] | None:
    """macOS keeps DWARF in the object files, which the build directory's rename
    moves away: dsymutil copies it into <library>.dSYM beside the library, where
    llvm-symbolizer finds it. None elsewhere (ELF libraries carry their own)."""
    if not DARWIN:
        return None
    tool = _llvm_tool("dsymutil") or shutil.which("dsymutil")
    return [tool, library] if tool else None


@functools.lru_cache(maxsize=None)
def clang_version() -> str:
    return subprocess.run([find_clang(), "--version"], capture_output=True, text=True, check=True).stdout


def _arch_flags() -> list[str]:
    if platform.machine() in ("x86_64", "AMD64"):
        # F16C converts half<->float in one instruction; without it every half
        # operation is a libgcc call (correct, several times slower).
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                if " f16c" in f.read():
                    return ["-mf16c"]
        except OSError:
            pass
    return []


def common_flags(msl: int = 3) -> list[str]:
    if msl not in MSL_VERSIONS:
        raise ValueError(f"msl must be one of {sorted(MSL_VERSIONS)} (3: MSL 3.1 as C++17, 4: MSL 4 as C++20), got {msl!r}")
    std, version, defines = MSL_VERSIONS[msl]
    return [
        f"-std={std}",
        "-x",
        "c++",
        "-isystem",
        SHIM_DIR,
        f"-D__METAL_VERSION__={version}",
        *defines,
        # per-operation rounding of half and bfloat, as the GPU does
        "-Xclang",
        "-ffloat16-excess-precision=none",
        "-Xclang",
        "-fbfloat16-excess-precision=none",
        # no silent a*b+c -> fma contraction: results must not depend on the host
        "-ffp-contract=off",
        "-fno-exceptions",
        "-fno-rtti",
        "-Wno-unknown-attributes",
        "-Wno-ignored-attributes",
    ] + _arch_flags()


# The fast-math flavour: Apple's compiler (`xcrun metal`, MTLCompileOptions)
# defaults to fast math, whose contract is that no value is ever NaN or
# infinite. -ffast-math makes clang assume the same (it implies
# -ffinite-math-only: -fno-honor-infinities and -fno-honor-nans), so a kernel
# that relies on infinities, e.g. a running max seeded with -INFINITY or an
# isinf() test, may be folded into something else here, as it may on a Mac.
# It also allows reassociation and reciprocals, so results differ from the
# strict build by rounding only. Kernel translation unit only: the runtime,
# which the shaders never see, keeps IEEE semantics, and -ffast-math is not
# passed to the link step, so crtfastmath.o never sets flush-to-zero in the
# host process. -fno-slp-vectorize: with reassociation allowed, LLVM's SLP
# vectorizer spends minutes on the fully unrolled fast kernels (the whole
# attention.metal took 476 s to build instead of 51 s); it only packs scalar
# operations into vectors, so it changes no fast-math folding the build
# exists to expose.
FAST_MATH_FLAGS = ["-ffast-math", "-fno-slp-vectorize"]


def kernel_flags(instrumented: bool, fast_math: bool = False, msl: int = 3) -> list[str]:
    # -disable-cgp skips LLVM's CodeGenPrepare, an optional pre-isel pass (-O0
    # never runs it) that rescans a whole function after every change: on the
    # fully unrolled kernels it took 29 % of the build (51 of 175 s for half
    # of attention.metal), and without it the libraries build in about two
    # thirds of the time. It never touches floating point: outputs were
    # bitwise identical across every kernel family and dtype, and kernels
    # ran at the same speed in the emulator.
    flags = common_flags(msl) + ["-fPIC", "-gline-tables-only", "-fno-omit-frame-pointer", "-mllvm", "-disable-cgp"]
    if instrumented:
        # every load and store calls back into runtime/sanitizer.cpp (trace-loads
        # and trace-stores emit nothing unless a coverage kind such as func is on)
        flags += ["-O1", "-fsanitize-coverage=func,trace-loads,trace-stores"]
    else:
        flags += ["-O2"]
    if fast_math:
        flags += FAST_MATH_FLAGS
    return flags


RUNTIME_FLAGS = ["-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-gline-tables-only", "-Wall"]
# FLASH_METAL_EMULATOR_UCONTEXT=1: switch fibers with ucontext even on x86-64
# Linux, as macOS does, so that path is tested here (tests/metal_emulator_tests/
# test_emu_platform.py).
if os.environ.get("FLASH_METAL_EMULATOR_UCONTEXT") == "1":
    RUNTIME_FLAGS = RUNTIME_FLAGS + ["-DFMEMU_FORCE_UCONTEXT"]
# Read by every runtime source (their cache key includes it).
RUNTIME_HEADERS = ("internal.h", "platform.h")


def _hash(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _shim_files() -> list[str]:
    out = []
    for root, _, files in os.walk(SHIM_DIR):
        out += [os.path.join(root, f) for f in files]
    return sorted(out)


def _run(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise BuildError(f"{what} failed:\n$ {' '.join(cmd)}\n{proc.stderr}")
    return proc


def _atomic_dir(final: str, build) -> str:
    """Build into a temporary sibling, then rename (safe with parallel test processes). Processes
    wanting the same output (pytest-xdist's workers) take turns on a lock file beside it (.<name>.lock),
    so the second waits for the first's build instead of repeating it on the same cores."""
    if os.path.isdir(final):
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    with _build_lock(os.path.join(os.path.dirname(final), "." + os.path.basename(final) + ".lock")):
        if os.path.isdir(final):
            return final
        tmp = tempfile.mkdtemp(prefix=os.path.basename(final) + ".tmp", dir=os.path.dirname(final))
        try:
            build(tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                if not os.path.isdir(final):
                    raise
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def _build_lock(path: str):
    """An exclusive advisory lock on `path` (POSIX flock; released when the process dies)."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def runtime_objects(pool: ThreadPoolExecutor) -> list[str]:
    srcs = [os.path.join(RUNTIME_DIR, s) for s in RUNTIME_SOURCES]
    headers = [os.path.join(RUNTIME_DIR, h) for h in RUNTIME_HEADERS]
    key = _hash(clang_version(), RUNTIME_FLAGS, *(_read(p) for p in srcs + headers),
                *(_read(p) for p in _shim_files()))
    final = os.path.join(CACHE_DIR, "runtime-" + key)

    def build(tmp):
        jobs = [
            pool.submit(_run, [find_clang(), *RUNTIME_FLAGS, "-c", s, "-o", os.path.join(tmp, os.path.basename(s) + ".o")],
                        f"compiling {os.path.basename(s)}")
            for s in srcs
        ]
        for j in jobs:
            j.result()

    _atomic_dir(final, build)
    return [os.path.join(final, os.path.basename(s) + ".o") for s in srcs]


def write_rewritten(paths: list[str], dest: str) -> dict[str, str]:
    """Pre-pass every reachable source into dest/<absolute path>; returns original -> copy."""
    sources = _prepass.collect_sources(paths)
    rewritten = _prepass.rewrite_sources(sources)
    mapping = {}
    for orig, text in rewritten.items():
        copy = os.path.join(dest, orig.lstrip(os.sep))
        os.makedirs(os.path.dirname(copy), exist_ok=True)
        with open(copy, "w", encoding="utf-8") as f:
            f.write(text)
        mapping[orig] = copy
    return mapping


def source_key(paths: list[str], *extra) -> str:
    # Keyed by file names and contents, not directories: an identical copy of
    # the shaders elsewhere (the installed package's, say) reuses the build.
    # A name is the path relative to the first .metal's folder (shaders/ has
    # family subfolders: "prefill/attention_prefill.h").
    sources = _prepass.collect_sources(paths)
    base = os.path.dirname(sources[0]) if sources else ""
    return _hash(
        clang_version(),
        _read(os.path.join(HERE, "_prepass.py")),
        *(os.path.relpath(p, base).replace(os.sep, "/").encode() + b"\0" + _read(p) for p in sources),
        *(_read(p) for p in _shim_files()),
        *extra,
    )
