"""Build flash_metal.

Everywhere: the C++ extension flash_metal._C (op schemas, CPU kernel, Metal
planning) and the shader sources shipped as package data.
On macOS with an MPS-enabled torch, also: the Objective-C++ MPS backend, and
the shaders compiled into flash_metal/flash_metal.metallib. Without Apple's
`metal` tool the install still succeeds: setup.py warns, and the MPS backend
compiles the shipped sources at first use with Metal's runtime compiler.

`pip install .` builds against the torch already installed in the target
environment and never pulls a second one (see _use_installed_torch below).
"""
import glob
import os
import platform
import shutil
import subprocess
import sys
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


def _extension():
    sources = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
    extra_compile_args = {"cxx": _cxx_flags()}
    extra_link_args = list(_openmp_flags())
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


def _shader_files():
    return sorted(glob.glob(os.path.join(SHADER_DIR, "*.metal")) + glob.glob(os.path.join(SHADER_DIR, "*.h")))


def _compile_metallib(out_path):
    """xcrun metal -> .air per file -> one .metallib. Returns False if `metal` is unavailable."""
    air_dir = os.path.join(os.path.dirname(out_path), "air")
    os.makedirs(air_dir, exist_ok=True)
    airs = []
    try:
        for src in sorted(glob.glob(os.path.join(SHADER_DIR, "*.metal"))):
            air = os.path.join(air_dir, os.path.basename(src)[: -len(".metal")] + ".air")
            # metal3.1 (macOS 14+) is the first standard with bfloat.
            subprocess.run(["xcrun", "-sdk", "macosx", "metal", "-std=metal3.1", "-O2", "-I", SHADER_DIR,
                            "-c", src, "-o", air], check=True, capture_output=True, text=True)
            airs.append(air)
        subprocess.run(["xcrun", "-sdk", "macosx", "metallib", *airs, "-o", out_path], check=True,
                       capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        warnings.warn(
            "flash_metal: could not compile the Metal shaders into a metallib "
            f"({detail.strip()}). The install continues: the MPS backend will compile the shipped "
            f"shader sources at first use (slower first call). To precompile, {METAL_TOOLCHAIN_HINT}."
        )
        return False
    finally:
        shutil.rmtree(air_dir, ignore_errors=True)
    return True


class BuildWithShaders(BuildExtension):
    """Builds the extension, ships the shader sources, and on macOS the metallib."""

    def run(self):
        super().run()
        package_dir = os.path.join(self.build_lib, "flash_metal")
        shader_out = os.path.join(package_dir, "shaders")
        os.makedirs(shader_out, exist_ok=True)
        for path in _shader_files():
            shutil.copy2(path, shader_out)
        if BUILD_MPS:
            _compile_metallib(os.path.join(package_dir, "flash_metal.metallib"))
        self._mirror_into_checkout(package_dir, shader_out)

    def _mirror_into_checkout(self, package_dir, shader_out):
        """Leave the built artifacts in the checkout's flash_metal/ as well (git-ignored).

        Commands run from the checkout root (`python -m benchmarks.post_figure`,
        `python -m flash_metal.demo`) put the source tree first on sys.path, so
        they import flash_metal from the checkout; with the compiled _C, the
        shader sources and the metallib mirrored there, that copy is complete
        and identical to the installed one.
        """
        dest = os.path.join(ROOT, "flash_metal")
        if os.path.abspath(package_dir) == os.path.abspath(dest):
            return
        for ext in self.extensions:
            built = self.get_ext_fullpath(ext.name)
            if os.path.exists(built):
                self.copy_file(built, os.path.join(dest, os.path.basename(built)))
        self.copy_tree(shader_out, os.path.join(dest, "shaders"))
        lib = os.path.join(package_dir, "flash_metal.metallib")
        if os.path.exists(lib):
            self.copy_file(lib, os.path.join(dest, "flash_metal.metallib"))


setup(
    packages=find_packages(include=["flash_metal", "flash_metal.*"]),
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildWithShaders.with_options(use_ninja=True)},
)
