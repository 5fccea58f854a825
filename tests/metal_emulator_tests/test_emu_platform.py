"""The emulator's portable pieces: the ucontext fiber switch, and macOS build flags.

macOS (Apple silicon) runs the emulator's fibers on ucontext, not on the
hand-written x86-64 switch; FLASH_METAL_EMULATOR_UCONTEXT=1 builds that path
on Linux, and the emulator's own proof kernels (barriers, SIMD-group
collectives, races) run on it here. What only a Mac can show: that Apple's
headers, linker and dsymutil accept the build (the macOS CI runs the suite).
"""

import os
import shutil
import subprocess
import sys

from metal_emulator import _build

HERE = os.path.dirname(os.path.abspath(__file__))


def test_proof_kernels_run_on_the_ucontext_fiber_switch(tmp_path):
    _build.find_clang()  # no clang 19: a missing prerequisite (skipped locally, failed in CI; tests/conftest.py)
    env = {**os.environ, "FLASH_METAL_EMULATOR_UCONTEXT": "1", "FLASH_METAL_EMULATOR_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--confcutdir={HERE}",
         os.path.join(HERE, "test_emu_collectives.py"), os.path.join(HERE, "test_emu_detectors.py"),
         "-k", "not instrumented"],
        capture_output=True, text=True, env=env, cwd=os.path.dirname(os.path.dirname(HERE)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout
    # the libraries it built switch fibers with swapcontext, not the x86-64 assembly
    cache = tmp_path / "cache"  # library directories; not the runtime's objects, nor build locks (.x.lock files)
    libs = [cache / d / "lib.so" for d in os.listdir(cache) if (cache / d).is_dir() and not d.startswith("runtime-")]
    assert libs
    nm = shutil.which("nm") or shutil.which("llvm-nm-19") or shutil.which("llvm-nm")
    if nm:
        for lib in libs:
            symbols = subprocess.run([nm, str(lib)], capture_output=True, text=True).stdout
            assert "swapcontext" in symbols and "fm_ctx_switch" not in symbols, lib


def test_ucontext_flag_reaches_the_runtime_build(monkeypatch):
    code = ("import sys; sys.path.insert(0, %r); from metal_emulator import _build; "
            "print('-DFMEMU_FORCE_UCONTEXT' in _build.RUNTIME_FLAGS)") % os.path.dirname(HERE)
    for value, expect in (("1", "True"), ("0", "False")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "FLASH_METAL_EMULATOR_UCONTEXT": value}).stdout.strip()
        assert out == expect, (value, out)


def test_link_flags_per_platform(monkeypatch):
    # ELF: -Bsymbolic; Apple's ld rejects it (and a Mach-O dylib binds its own
    # symbols without it), and there dsymutil gathers the debug info.
    monkeypatch.setattr(_build, "DARWIN", False)
    assert _build.link_flags() == ["-Wl,-Bsymbolic"] and _build.debug_info_step("lib.so") is None
    monkeypatch.setattr(_build, "DARWIN", True)
    assert "-Wl,-Bsymbolic" not in _build.link_flags()
    step = _build.debug_info_step("lib.so")
    assert step is None or (os.path.basename(step[0]).startswith("dsymutil") and step[1] == "lib.so")


def test_runtime_sources_set_the_feature_macros_first():
    # macOS's <ucontext.h> needs _XOPEN_SOURCE before any system header.
    with open(os.path.join(_build.RUNTIME_DIR, "platform.h"), encoding="utf-8") as f:
        header = f.read()
    assert "#define _XOPEN_SOURCE" in header and "#define _DARWIN_C_SOURCE" in header
    for name in _build.RUNTIME_SOURCES:
        with open(os.path.join(_build.RUNTIME_DIR, name), encoding="utf-8") as f:
            lines = [ln for ln in f if ln.startswith("#include")]
        assert lines[0].startswith('#include "platform.h"'), name
