"""Build flash_metal.

Everywhere: the C++ extension flash_metal._C (op schemas, CPU kernel, Metal
planning) and the shader sources shipped as package data.
On macOS with an MPS-enabled torch, also: the Objective-C++ MPS backend, and
the shaders compiled into flash_metal/flash_metal.metallib, if a probe shows
that Apple's `metal` compiles Metal 3.1 (Xcode 15 or newer, with its Metal
toolchain). Otherwise the install still succeeds: setup.py warns, and the MPS
backend compiles the shipped sources at first use with Metal's runtime
compiler. Shader warnings are errors only with FLASH_METAL_SHADER_WERROR=1
(our CI), and a missing metallib only with FLASH_METAL_REQUIRE_METALLIB=1.
The Metal 4 tensor-op kernels (shaders/*_mpp.metal, issue 21) go into a second
library, flash_metal/flash_metal_mpp.metallib, built only where a second probe
shows that `metal` compiles MSL 4 tensor ops for macOS 26.2 (Xcode 26 with the
macOS 26.2 SDK or newer). Where it cannot, setup.py says so and builds
everything else: an older Xcode never breaks `pip install .`
(FLASH_METAL_REQUIRE_MPP_METALLIB=1 makes it an error, for a macOS 26 CI leg).

`pip install .` builds against the torch already installed in the target
environment and never pulls a second one (see _use_installed_torch below).
"""
import concurrent.futures
import glob
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings


def _use_installed_torch():
    """Make the target environment's torch importable inside pip's isolated build.

    pip builds in an isolated environment that hides the site-packages it is
    installing into. Listing torch in [build-system] requires would make pip
    download a second, possibly multi-GB, torch and build against it. Instead,
    ask a clean interpreter (same executable, without pip's PYTHONPATH
    overlay) where the installed torch lives and append that directory to
    sys.path, after the build environment's own packages.
    """
    try:
        import torch  # noqa: F401  (already visible: --no-build-isolation, or a plain venv)
        return
    except ImportError:
        pass
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    probe = subprocess.run(
        [sys.executable, "-c", "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))"],
        env=env, capture_output=True, text=True,
    )
    if probe.returncode != 0:
        sys.exit(
            "flash_metal builds against an installed PyTorch, and none was found for "
            f"{sys.executable}.\nInstall torch first (on Linux here: pip install torch==2.13.0), then "
            "pip install . again."
        )
    sys.path.append(probe.stdout.strip())


_use_installed_torch()

import torch  # noqa: E402
from setuptools import find_packages, setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
SHADER_DIR = os.path.join(ROOT, "shaders")
IS_MACOS = sys.platform == "darwin"
BUILD_MPS = IS_MACOS and torch.backends.mps.is_built()
# Command that installs the Metal compiler where Xcode 26 lacks it.
METAL_TOOLCHAIN_HINT = (
    "install Xcode, then run `xcodebuild -downloadComponent MetalToolchain` "
    "(Command Line Tools alone do not ship the `metal` compiler)"
)


def _cxx_flags():
    flags = ["-O3", "-fvisibility=hidden"]
    # A from-source build targets the machine it is built on, as a compiler
    # would by default for local code; FLASH_METAL_PORTABLE=1 keeps the
    # baseline ISA for binaries meant to be copied elsewhere.
    if platform.machine() in ("x86_64", "AMD64") and os.environ.get("FLASH_METAL_PORTABLE") != "1":
        flags.append("-march=native")
    flags += _openmp_flags()
    return flags


def _openmp_flags():
    """-fopenmp where torch itself runs on OpenMP (Linux builds).

    at::parallel_for's OpenMP backend is an inline `#pragma omp parallel` in
    ATen's headers: without -fopenmp it compiles to a serial loop, and the CPU
    kernel would run on one thread. The extension then needs libgomp.so.1,
    which the loader resolves to the copy torch has already loaded (same
    soname), so there is one OpenMP runtime in the process. Apple clang has
    no -fopenmp; there the kernel spreads its work over ATen's inter-op pool.
    """
    if sys.platform.startswith("linux") and torch.backends.openmp.is_available():
        return ["-fopenmp"]
    return []


def _cxx_compiler():
    """The C++ compiler distutils will run: $CXX, else Python's configured CXX, else c++."""
    import shlex
    import sysconfig
    return shlex.split(os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++")[0]


def _shared_libstdcxx_args(cxx=None, maps="/proc/self/maps"):
    """Link the process's libstdc++.so.6 explicitly where the compiler would link libstdc++.a (issue 39).

    A relocated GCC without libstdc++.so (seen on an AMX Xeon: /opt/gcc/bin/g++,
    Ubuntu's gcc 13.3 copied without its shared runtime) links libstdc++.a into
    the extension silently. The process then holds two C++ runtimes: torch's
    libstdc++.so.6 and the extension's private copy, whose locale and iostream
    state were never set up. The first `ostream << long` in the extension (any
    error message with a number in it, e.g. "q must be 4-D; got a 3-D tensor")
    crashed with SIGSEGV instead of raising ValueError. Naming the already
    loaded libstdc++.so.6 on the link line (before g++'s implicit -lstdc++)
    resolves every C++ runtime symbol from it, so nothing of libstdc++.a is
    pulled in. Returns [] where the compiler has its shared libstdc++ (the
    usual case) and off Linux.
    """
    if not sys.platform.startswith("linux"):
        return []
    try:
        found = subprocess.run([cxx or _cxx_compiler(), "-print-file-name=libstdc++.so"], capture_output=True,
                               text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return []
    if os.path.isabs(found) and os.path.exists(found):
        return []  # the compiler links its shared libstdc++: nothing to do
    try:
        with open(maps) as f:
            loaded = sorted({line.split()[-1] for line in f if "/libstdc++.so" in line})
    except OSError:
        loaded = []
    if not loaded:
        sys.exit(f"flash_metal: the C++ compiler {cxx or _cxx_compiler()} has no shared libstdc++ (it would link "
                 "libstdc++.a into the extension, which crashes on the first error message) and this process "
                 "has no libstdc++.so.6 loaded to link instead; set CXX to a compiler with its shared runtime "
                 "(e.g. CXX=/usr/bin/g++)")
    print(f"flash_metal: {cxx or _cxx_compiler()} has no shared libstdc++ (-print-file-name gave {found!r}); "
          f"linking {loaded[0]} explicitly so that no static copy of the C++ runtime enters the extension",
          file=sys.stderr)
    return [loaded[0]]


def _extension():
    # Every C++ source under csrc/: the op layer (csrc/), the CPU kernels
    # (csrc/cpu/) and the portable Metal planner (csrc/metal/ and its subfolders).
    # (The root's first, as before the subfolders: the order files link in.)
    sources = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/*/**/*.cpp", recursive=True))
    extra_compile_args = {"cxx": _cxx_flags()}
    extra_link_args = list(_openmp_flags()) + _shared_libstdcxx_args()
    if BUILD_MPS:
        sources += sorted(glob.glob("csrc/mps/*.mm"))
        # PyTorch's MPS headers assume manual retain/release: never ARC.
        extra_compile_args["cxx"] += ["-fno-objc-arc"]
        extra_link_args += ["-framework", "Metal", "-framework", "Foundation"]
    return CppExtension(
        "flash_metal._C",
        sources,
        include_dirs=[os.path.join(ROOT, "csrc"), SHADER_DIR],
        extra_compile_args=extra_compile_args,
        extra_link_args=extra_link_args,
        define_macros=[("FLASH_METAL_WITH_MPS", "1")] if BUILD_MPS else [],
        py_limited_api=False,
    )


def _shader_files(shader_dir=SHADER_DIR):
    """The shader sources the package ships (and library.mm fingerprints): every *.metal and *.h
    under shader_dir, its family subfolders (common/, prefill/, ...; shaders/README.md) included.

    Dot-files and dot-folders never count: macOS writes AppleDouble companions
    (`._attention.metal`) beside files copied to non-Apple file systems or unpacked
    from some archives, and they would change the fingerprint and ship as "shaders".
    The same rule as shader_source::is_shader_file and list_shader_files.
    """
    found = []
    for root, dirs, files in os.walk(shader_dir):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.join(root, f) for f in files if not f.startswith(".") and f.endswith((".metal", ".h"))]
    return sorted(found)


def _shader_relpath(path, shader_dir=SHADER_DIR):
    """A shader file's path relative to shader_dir, '/'-separated ("common/params.h"): its name in the
    fingerprint and its place in the installed flash_metal/shaders/."""
    return os.path.relpath(path, shader_dir).replace(os.sep, "/")


# --- The metallib ----------------------------------------------------------------------------
# Names inside the package directory; csrc/mps/library.mm looks for the same.
METALLIB_NAME = "flash_metal.metallib"
METALLIB_HASH_NAME = "flash_metal.metallib.fnv1a64"
# Why 14.0: Metal 3.1, the first language version with bfloat, starts at
# macOS 14, and library.mm refuses older macOS. Without -mmacosx-version-min,
# `metal` targets the SDK's own macOS, and the metallib of a newer Xcode then
# fails to load on an older macOS (MLX passes its deployment target too).
METAL_MACOS_MIN = "14.0"
METAL_STD = "metal3.1"
# -fno-fast-math: fast math is `metal`'s default, and its contract (no
# infinities, no NaNs) is not what the tests check; the kernels are written to
# survive it (a finite running-max sentinel; lse = -inf for a row without keys
# is made from bits), but IEEE arithmetic is what the emulator verifies.
# PyTorch and MLX build their shaders with -fno-fast-math too.
# -Wall -Wextra: shader warnings are shown; they fail the build only with
# SHADER_WERROR_ENV (our CI), since the next Xcode's new warning must not
# break every user's install (PyTorch's Metal.cmake adds -Werror only under
# its WERROR option for the same reason).
METAL_FLAGS = [f"-std={METAL_STD}", f"-mmacosx-version-min={METAL_MACOS_MIN}", "-fno-fast-math",
               "-Wall", "-Wextra", "-O2"]
# Set to 1 (the macOS CI does) to make a missing or too old Metal toolchain
# fail the build instead of warning: there, a metallib is part of what is tested.
REQUIRE_METALLIB_ENV = "FLASH_METAL_REQUIRE_METALLIB"
# Set to 1 (the macOS CI does) to compile the shaders with -Werror.
SHADER_WERROR_ENV = "FLASH_METAL_SHADER_WERROR"
# The toolchain probe, after PyTorch's CAN_COMPILE_METAL check (cmake/Metal.cmake):
# a kernel on `bfloat` under -std=metal3.1, the two things an older `metal`
# (Xcode < 15) rejects, compiled and linked into a metallib. Only a compiler
# that builds this is trusted with the real shaders.
METAL_PROBE_SOURCE = """#include <metal_stdlib>
using namespace metal;
[[kernel]] void flash_metal_probe(device bfloat* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  x[i] = bfloat(float(x[i]) + 1.0f);
}
"""
# --- The MSL 4 library (the Metal 4 tensor-op kernels, issue 21) ---------------------------
METALLIB_MPP_NAME = "flash_metal_mpp.metallib"
METALLIB_MPP_HASH_NAME = "flash_metal_mpp.metallib.fnv1a64"
# Sources whose kernels use Metal 4 tensor ops (<metal_tensor>, MPP matmul2d):
# compiled only into the MSL 4 library, never with -std=metal3.1.
MPP_SOURCE_SUFFIX = "_mpp.metal"
METAL4_STD = "metal4.0"
# Why 26.2, not the SDK's default: below a 26.2 deployment target Apple's
# compiler lowers cooperative tensors through MPP's legacy ABI, whose lane
# layout differs; PyTorch shipped scrambled P.V from exactly that (PyTorch
# #191794) and MLX saw Xcode 26.5 miscompile its accelerator GEMM without it
# (MLX #3586, PR #3622). Both now pass 26.2. It is also the first macOS on
# which matmul2d reaches M5's neural accelerators (MLX is_nax_available).
METAL4_MACOS_MIN = "26.2"
METAL4_FLAGS = [f"-std={METAL4_STD}", f"-mmacosx-version-min={METAL4_MACOS_MIN}", "-fno-fast-math",
                "-Wall", "-Wextra", "-O2"]
# Set to 1 (a macOS 26 CI leg) to make a toolchain that cannot build the MSL 4
# library fail the build instead of warning.
REQUIRE_MPP_METALLIB_ENV = "FLASH_METAL_REQUIRE_MPP_METALLIB"
# The MSL 4 probe: the API surface our tensor-op kernels use, on bfloat
# operands (the macOS 26.0 SDK's MPP headers have half x half only): an
# input cooperative tensor (the later SDKs' get_left_input_cooperative_tensor,
# as the 64-row D = 256 forward keeps Q), a transposed-right matmul2d on one
# SIMD-group into a float destination cooperative tensor, a named slice as
# run()'s operand (Apple declares run(thread L &, thread R &, thread D &)
# only), tensors over device memory whose const the kernel casts away
# (Apple's __run has no branch for a const element type), a row reduction
# with a float identity, a threadgroup tensor with a row stride, and a
# multiply_accumulate op with a dynamic K over operand views clamped to a
# ragged block (the kernels' O += P.V and dQ += dS.K); since issue 40 also a
# static slice as an operand (the kernels' full key blocks), relaxed_precision
# set (their 16-bit products) and a row value broadcast by map_iterator behind
# is_iterator_compatible (their rescale). A toolchain that
# compiles and links this has what attention_mpp.metal needs, as far as the
# probe can tell; tests/project/test_build.py checks that it uses every MPP construct
# the kernels use, and compiles and runs it in the project's Metal emulator.
METAL4_PROBE_SOURCE = """#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;
constant float kProbeFloor = -1.0e30f;
// c (16 x 16) = (Q K^T - rowmax) over its first 20 columns, rounded to bfloat, times V's first 20 rows.
[[kernel]] void flash_metal_mpp_probe(device const bfloat* q [[buffer(0)]], device const bfloat* k [[buffer(1)]],
                                      device const bfloat* v [[buffer(2)]], device float* c [[buffer(3)]]) {
  threadgroup bfloat p[16 * 32];
  using DevT = tensor<device bfloat, dextents<int, 2>, tensor_inline>;
  using TgT = tensor<threadgroup bfloat, dextents<int, 2>, tensor_inline>;
  constexpr auto sd = matmul2d_descriptor(16, 32, 32, false, true, true, matmul2d_descriptor::mode::multiply);
  matmul2d<sd, execution_simdgroup> qk;
  auto qin = qk.get_left_input_cooperative_tensor<bfloat, bfloat, float>();
  for (int i = 0; i < qin.get_capacity(); ++i) {
    if (!qin.is_valid_element(i)) continue;
    auto at = qin.get_multidimensional_index(i);
    qin[i] = q[at[1] * 32 + at[0]];
  }
  DevT tk(const_cast<device bfloat*>(k), dextents<int, 2>(32, 32), array<int, 2>{1, 32});
  auto k_blk = tk.slice(0, 0);
  auto k_full = tk.static_slice<32, 32>(0, 0);
  auto s = qk.get_destination_cooperative_tensor<decltype(qin), decltype(k_blk), float>();
  qk.run(qin, k_full, s);
  auto m = qk.get_row_reduction_destination_cooperative_tensor<decltype(qin), decltype(k_blk), float>();
  reduce_rows(s, m, reduction_operation::max, float(kProbeFloor));
  const bool mapped = is_iterator_compatible(s, m);
  if (mapped) {
    for (auto it = s.begin(); it != s.end(); it++) *it -= *m.map_iterator(it);
  }
  for (int i = 0; i < s.get_capacity(); ++i) {
    if (!s.is_valid_element(i)) continue;
    auto at = s.get_multidimensional_index(i);
    float mx = 0.0f;
    for (int j = 0; j < m.get_capacity(); ++j)
      if (!mapped && m.is_valid_element(j) && m.get_multidimensional_index(j)[0] == at[1]) mx = m[j];
    p[at[1] * 32 + at[0]] = bfloat(s[i] - mx);
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  const int keys = 20;
  TgT p_blk(p, dextents<int, 2>(keys, 16), array<int, 2>{1, 32});
  DevT v_blk(const_cast<device bfloat*>(v), dextents<int, 2>(16, keys), array<int, 2>{1, 16});
  constexpr auto od = matmul2d_descriptor(16, 16, static_cast<int>(dynamic_extent), false, false, true,
                                          matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<od, execution_simdgroup> pv;
  auto o = pv.get_destination_cooperative_tensor<decltype(p_blk), decltype(v_blk), float>();
  for (int i = 0; i < o.get_capacity(); ++i) o[i] = 0.0f;
  pv.run(p_blk, v_blk, o);
  for (int i = 0; i < o.get_capacity(); ++i) {
    if (o.is_valid_element(i)) {
      auto at = o.get_multidimensional_index(i);
      c[at[1] * 16 + at[0]] = o[i];
    }
  }
}
"""
# FNV-1a 64-bit offset basis and prime (FNV's published constants), as in
# csrc/mps/shader_source.h's source_tree_hash, which this mirrors.
_FNV_OFFSET_BASIS = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


class ShaderBuildError(RuntimeError):
    """Apple's Metal compiler rejected the shaders (an error or, with -Werror, a warning)."""


def _env_flag(name):
    return os.environ.get(name) == "1"


def shader_sources_hash(shader_dir=SHADER_DIR):
    """The fingerprint library.mm recomputes from the installed shaders (16 hex digits).

    FNV-1a-64 over, per shader file in byte order of its path relative to shader_dir
    ('/'-separated: "common/params.h"), "<path>\\n<size>\\n<contents>"; see
    shader_source::source_tree_hash.
    """
    h = _FNV_OFFSET_BASIS

    def feed(data, h):
        for byte in data:
            h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
        return h

    names = sorted(_shader_relpath(p, shader_dir).encode() for p in _shader_files(shader_dir))
    for name in names:
        with open(os.path.join(shader_dir, name.decode()), "rb") as f:
            data = f.read()
        h = feed(name + b"\n" + str(len(data)).encode() + b"\n", h)
        h = feed(data, h)
    return f"{h:016x}"


def metal_compile_command(src, air, shader_dir=SHADER_DIR, werror=False, base_flags=None):
    flags = list(METAL_FLAGS if base_flags is None else base_flags) + (["-Werror"] if werror else [])
    return ["xcrun", "-sdk", "macosx", "metal", *flags, "-I", shader_dir, "-c", src, "-o", air]


def _metal_toolchain_problem(work_dir, source=METAL_PROBE_SOURCE, flags=None, std=METAL_STD,
                            name="flash_metal_probe"):
    """None if Apple's Metal toolchain can build our shaders' language; else why not.

    Compiles METAL_PROBE_SOURCE with the real flags (less -Wall/-Werror) and
    links it with `metallib`, in work_dir. This catches every way a Mac can
    lack the toolchain: no xcrun, Command Line Tools without `metal`, Xcode 26
    without its Metal Toolchain component (`xcrun --find metal` succeeds but
    running it fails), and an Xcode older than 15 whose `metal` does not know
    -std=metal3.1 or `bfloat`. With the MSL 4 arguments (_metal4_toolchain_problem)
    the same for the tensor-op library.
    """
    src = os.path.join(work_dir, name + ".metal")
    air = os.path.join(work_dir, name + ".air")
    with open(src, "w", encoding="ascii") as f:
        f.write(source)
    probe_flags = [f for f in (METAL_FLAGS if flags is None else flags) if not f.startswith("-W")]
    for cmd in (["xcrun", "-sdk", "macosx", "metal", *probe_flags, "-c", src, "-o", air],
                ["xcrun", "-sdk", "macosx", "metallib", air, "-o", os.path.join(work_dir, name + ".metallib")]):
        try:
            probe = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as err:
            return f"cannot run xcrun: {err}"
        if probe.returncode != 0:
            output = (probe.stderr or probe.stdout).strip()
            return f"`xcrun {cmd[3]}` failed on a {std} probe kernel" + (f": {output}" if output else "")
    return None


def _metal4_toolchain_problem(work_dir):
    """None if `metal` builds MSL 4 tensor ops on bfloat for macOS 26.2 (METAL4_PROBE_SOURCE); else why not."""
    return _metal_toolchain_problem(work_dir, METAL4_PROBE_SOURCE, METAL4_FLAGS, METAL4_STD, "flash_metal_mpp_probe")


def _run_shader_tool(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        werror = f" (with -Werror from {SHADER_WERROR_ENV}=1, warnings are errors)" if "-Werror" in cmd else ""
        raise ShaderBuildError(
            f"flash_metal: Apple's Metal compiler rejected the shaders{werror}:\n"
            f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    if proc.stderr.strip():  # warnings: shown, as a compiler would, without failing
        sys.stderr.write(proc.stderr)


def remove_metallib(out_dir, names=(METALLIB_NAME, METALLIB_HASH_NAME)):
    """Delete the metallib and its fingerprint from out_dir, so that no stale copy survives a build."""
    for name in names:
        path = os.path.join(out_dir, name)
        if os.path.lexists(path):
            os.remove(path)


def build_metallib(out_dir, shader_dir=SHADER_DIR):
    """Compile shader_dir/*.metal (all but the MSL 4 *_mpp.metal) into out_dir/flash_metal.metallib, with
    its fingerprint beside it.

    Stale outputs are deleted first. Returns the paths written, or [] after a
    warning when Apple's Metal toolchain is missing or too old to compile
    Metal 3.1 (the MPS backend then compiles the shipped sources at first
    use); with FLASH_METAL_REQUIRE_METALLIB=1 that raises instead. A shader
    that does not compile raises ShaderBuildError: the build fails. Warnings
    fail it only with FLASH_METAL_SHADER_WERROR=1.
    """
    remove_metallib(out_dir)
    with tempfile.TemporaryDirectory(prefix="flash_metal_air.") as air_dir:
        problem = _metal_toolchain_problem(air_dir)
        if problem is not None:
            message = (f"flash_metal: Apple's Metal compiler cannot build Metal 3.1 here ({problem}), so no "
                       "metallib was built. The install continues: the MPS backend will compile the shipped "
                       f"shader sources at first use (slower first call). To precompile, {METAL_TOOLCHAIN_HINT}.")
            if _env_flag(REQUIRE_METALLIB_ENV):
                raise ShaderBuildError(message + f" ({REQUIRE_METALLIB_ENV}=1 makes this an error.)")
            warnings.warn(message)
            return []
        os.makedirs(out_dir, exist_ok=True)
        lib = os.path.join(out_dir, METALLIB_NAME)
        werror = _env_flag(SHADER_WERROR_ENV)
        _compile_and_link(metal_sources(shader_dir), air_dir, lib, shader_dir, werror, METAL_FLAGS)
    return [lib, _write_fingerprint(out_dir, METALLIB_HASH_NAME, shader_dir)]


def metal_sources(shader_dir=SHADER_DIR, mpp=False):
    """The .metal files of one library: the MSL 3.1 one (mpp=False) or the MSL 4 tensor-op one.

    Only shader_dir's root holds translation units; the subfolders hold the headers they include
    (shaders/README.md)."""
    sources = sorted(glob.glob(os.path.join(shader_dir, "[!.]*.metal")))
    return [s for s in sources if s.endswith(MPP_SOURCE_SUFFIX) == mpp]


def _compile_and_link(sources, air_dir, lib, shader_dir, werror, flags):
    airs = [os.path.join(air_dir, os.path.basename(src)[: -len(".metal")] + ".air") for src in sources]
    # Each .metal is its own `metal` process, so several run at once;
    # map() re-raises the first failure in source order.
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
        list(pool.map(_run_shader_tool,
                      [metal_compile_command(src, air, shader_dir, werror, flags) for src, air in zip(sources, airs)]))
    _run_shader_tool(["xcrun", "-sdk", "macosx", "metallib", *airs, "-o", lib])
    if not os.path.isfile(lib):
        raise ShaderBuildError(f"flash_metal: `xcrun metallib` reported success but wrote no {lib}")


def _write_fingerprint(out_dir, name, shader_dir):
    hash_path = os.path.join(out_dir, name)
    with open(hash_path, "w", encoding="ascii") as f:
        f.write(shader_sources_hash(shader_dir) + "\n")
    return hash_path


MPP_NAMES = (METALLIB_MPP_NAME, METALLIB_MPP_HASH_NAME)


def build_mpp_metallib(out_dir, shader_dir=SHADER_DIR):
    """Compile shader_dir/*_mpp.metal (MSL 4) into out_dir/flash_metal_mpp.metallib, with its fingerprint.

    Optional by design: where the toolchain cannot build MSL 4 tensor ops for
    macOS 26.2 (the probe fails), or where it passes the probe but rejects our
    kernels (an Xcode 26 whose MPP headers lack something they use), it warns,
    leaves no MSL 4 library, and returns []; the rest of the build goes on and
    the tensor-op kernels are simply unavailable (explain() says so on a Mac).
    FLASH_METAL_REQUIRE_MPP_METALLIB=1 turns both into errors, and
    FLASH_METAL_SHADER_WERROR=1 a compile error too (our CI wants to see it).
    """
    remove_metallib(out_dir, MPP_NAMES)
    sources = metal_sources(shader_dir, mpp=True)
    if not sources:
        return []
    required = _env_flag(REQUIRE_MPP_METALLIB_ENV)
    werror = _env_flag(SHADER_WERROR_ENV)
    skipped = ("so the Metal 4 tensor-op kernels (impl='tensor_ops', M5's neural accelerators) are not built; "
               "everything else is. To build them, use Xcode 26 with the macOS 26.2 SDK or newer; if its `metal` "
               f"is missing, {METAL_TOOLCHAIN_HINT}.")
    with tempfile.TemporaryDirectory(prefix="flash_metal_air4.") as air_dir:
        problem = _metal4_toolchain_problem(air_dir)
        if problem is not None:
            message = f"flash_metal: Apple's Metal compiler cannot build MSL 4 tensor ops here ({problem}), " + skipped
            if required:
                raise ShaderBuildError(message + f" ({REQUIRE_MPP_METALLIB_ENV}=1 makes this an error.)")
            warnings.warn(message)
            return []
        os.makedirs(out_dir, exist_ok=True)
        lib = os.path.join(out_dir, METALLIB_MPP_NAME)
        try:
            _compile_and_link(sources, air_dir, lib, shader_dir, werror, METAL4_FLAGS)
        except ShaderBuildError as err:
            remove_metallib(out_dir, MPP_NAMES)
            if required or werror:
                raise
            warnings.warn(f"flash_metal: Apple's Metal compiler rejected the MSL 4 kernels ({err}), " + skipped)
            return []
    return [lib, _write_fingerprint(out_dir, METALLIB_MPP_HASH_NAME, shader_dir)]


def install_shader_sources(out_dir, shader_dir=SHADER_DIR):
    """Replace out_dir/shaders/ with exactly this checkout's shader sources (no leftovers), in the
    same subfolders (their #include paths are relative)."""
    dest = os.path.join(out_dir, "shaders")
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    for path in _shader_files(shader_dir):
        target = os.path.join(dest, *_shader_relpath(path, shader_dir).split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(path, target)
    return dest


def build_package_data(package_dir, build_mps, shader_dir=SHADER_DIR):
    """What the build adds to the package beside _C: the shader sources, and with
    build_mps the metallib (a warning and none if the toolchain cannot build it) and the MSL 4 one (the
    same, when the toolchain cannot build tensor ops).
    Returns the installed shader directory."""
    shader_out = install_shader_sources(package_dir, shader_dir)
    if build_mps:
        # A toolchain that cannot build Metal 3.1 (one warning already said
        # so) cannot build MSL 4 either: the MSL 4 library is then not tried.
        if build_metallib(package_dir, shader_dir):
            build_mpp_metallib(package_dir, shader_dir)
        else:
            remove_metallib(package_dir, MPP_NAMES)
    else:
        remove_metallib(package_dir)
        remove_metallib(package_dir, MPP_NAMES)
    return shader_out


class BuildWithShaders(BuildExtension):
    """Builds the extension, ships the shader sources, and on macOS the metallib.

    Only what this build produced is installed: pyproject.toml lists no
    shader or metallib package data (which would copy whatever an earlier
    build left in the checkout), stale outputs are deleted before building,
    and a shader compile error fails the build.
    """

    def run(self):
        super().run()
        package_dir = os.path.join(self.build_lib, "flash_metal")
        shader_out = build_package_data(package_dir, BUILD_MPS)
        self._mirror_into_checkout(package_dir, shader_out)

    def _mirror_into_checkout(self, package_dir, shader_out):
        """Leave the built artifacts in the checkout's flash_metal/ as well (git-ignored).

        Commands run from the checkout root (`python -m benchmarks.post_figure`,
        `python -m flash_metal.demo`) put the source tree first on sys.path, so
        they import flash_metal from the checkout; with the compiled _C, the
        shader sources and the metallib mirrored there, that copy is complete
        and identical to the installed one (an old metallib there is deleted
        when this build made none).
        """
        dest = os.path.join(ROOT, "flash_metal")
        if os.path.abspath(package_dir) == os.path.abspath(dest):
            return
        for ext in self.extensions:
            built = self.get_ext_fullpath(ext.name)
            if os.path.exists(built):
                self.copy_file(built, os.path.join(dest, os.path.basename(built)))
        shutil.rmtree(os.path.join(dest, "shaders"), ignore_errors=True)
        self.copy_tree(shader_out, os.path.join(dest, "shaders"))
        remove_metallib(dest)
        remove_metallib(dest, MPP_NAMES)
        for name in (METALLIB_NAME, METALLIB_HASH_NAME) + MPP_NAMES:
            if os.path.exists(os.path.join(package_dir, name)):
                self.copy_file(os.path.join(package_dir, name), os.path.join(dest, name))


# setuptools runs this file as __main__; tests/project/test_build.py imports it to
# test the metallib logic above without building anything.
if __name__ == "__main__":
    setup(
        packages=find_packages(include=["flash_metal", "flash_metal.*"]),
        ext_modules=[_extension()],
        cmdclass={"build_ext": BuildWithShaders.with_options(use_ninja=True)},
    )
