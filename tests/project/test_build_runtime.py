"""The extension's C++ runtime (issue 39): one libstdc++ in the process, never a private static copy.

On an AMX Xeon (Ubuntu 24.04, torch 2.11) the build ran CXX=/opt/gcc/bin/g++, a
GCC copied without its shared libstdc++, which linked libstdc++.a into
flash_metal._C silently. Every error message with a number in it then crashed
the process (SIGSEGV in std::ostream << long) instead of raising ValueError.
setup.py now links the process's libstdc++.so.6 explicitly where the compiler
has no shared runtime (_shared_libstdcxx_args). These tests hold that fix:
- the built extension needs libstdc++.so.6 and defines no C++ runtime of its own
  (planted: `-static-libstdc++` in setup.py's flags makes both fail);
- the helper finds the shared runtime for a compiler that lacks one (a fake g++);
- the smallest reproducer, built with a static runtime, loses the number from its
  message (or crashes), and built with the helper's link line raises it intact.
"""
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import textwrap

import pytest
import torch
import torch.utils.cpp_extension

import flash_metal
from test_build import load_setup  # setup.py as a module
from repo_paths import ROOT_DIR as ROOT

LINUX = sys.platform.startswith("linux")
pytestmark = pytest.mark.skipif(not LINUX, reason="ELF shared objects and libstdc++: Linux only")


def elf_dynamic(path):
    """(DT_NEEDED names, defined dynamic symbol names) of an x86-64/aarch64 ELF64 shared object."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF" and data[4] == 2, f"{path} is not an ELF64 file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed, defined = [], set()
    for name, kind, _, _, off, size, link, _, _, entsize in sections:
        strtab = sections[link][4]

        def cstr(o):
            return data[strtab + o:data.index(b"\0", strtab + o)].decode()

        if kind == 6:  # SHT_DYNAMIC
            for i in range(size // 16):
                tag, val = struct.unpack_from("<qQ", data, off + 16 * i)
                if tag == 1:  # DT_NEEDED
                    needed.append(cstr(val))
        elif kind == 11:  # SHT_DYNSYM
            for i in range(1, size // entsize):
                st_name, _, _, st_shndx, _, _ = struct.unpack_from("<IBBHQQ", data, off + entsize * i)
                if st_shndx != 0:
                    defined.add(cstr(st_name))
    return needed, defined


# std::locale::classic() and the ios_base initializer: defined by a C++ runtime, never by an extension.
RUNTIME_SYMBOLS = ("_ZNSt6locale7classicEv", "_ZNSt8ios_base4InitC1Ev")


def test_extension_uses_the_shared_cxx_runtime():
    """flash_metal._C needs libstdc++.so.6 and defines none of its symbols (no static copy inside)."""
    needed, defined = elf_dynamic(flash_metal._C.__file__)
    assert "libstdc++.so.6" in needed, f"_C does not link libstdc++.so.6 (NEEDED: {needed}): a static C++ runtime"
    assert not defined.intersection(RUNTIME_SYMBOLS), "_C defines C++ runtime symbols: libstdc++.a was linked in"


def test_helper_links_the_loaded_runtime_for_a_compiler_without_one(tmp_path):
    """A compiler whose -print-file-name finds no libstdc++.so gets the process's libstdc++.so.6 named explicitly;
    a compiler that has its shared runtime gets nothing added."""
    setup = load_setup()
    fake = tmp_path / "g++"
    fake.write_text("#!/bin/sh\necho libstdc++.so\n")  # what GCC prints for a library it cannot find
    fake.chmod(0o755)
    args = setup._shared_libstdcxx_args(str(fake))
    assert len(args) == 1 and os.path.basename(args[0]).startswith("libstdc++.so") and os.path.exists(args[0])
    with open("/proc/self/maps") as f:
        assert args[0] in f.read(), "the helper must name the runtime this process has loaded"
    real = shutil.which("g++") or shutil.which("c++")
    if real is not None:
        assert setup._shared_libstdcxx_args(real) == []


def _build_probe(tmp_path, name, link_args):
    inc = sum((["-I", p] for p in torch.utils.cpp_extension.include_paths()), [])
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    cmd = ["g++", "-shared", "-fPIC", "-std=c++17", "-O1", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           f"-DPROBE_NS={name}", *inc, "-I", sysconfig.get_paths()["include"],
           os.path.join(ROOT, "tests", "cxx_runtime", "throw_op.cpp"), "-o", str(tmp_path / f"{name}.so"),
           f"-L{lib}", "-lc10", "-ltorch", "-ltorch_cpu", f"-Wl,-rpath,{lib}", *link_args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _call_probe(tmp_path, name):
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(tmp_path)!r})
        import torch, {name}
        try:
            torch.ops.{name}.throw_value(torch.zeros(2, 3))
        except ValueError as e:
            print(str(e).splitlines()[0])
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the reproducer")
def test_static_runtime_reproducer_and_its_fix(tmp_path):
    """The smallest reproducer (tests/cxx_runtime/throw_op.cpp): with a private static libstdc++ its ValueError
    loses the numbers (Debian 12) or the process crashes (the AMX Xeon); linked as setup.py now links a compiler
    without a shared runtime, it raises the whole message."""
    setup = load_setup()
    fake = tmp_path / "fake-g++"
    fake.write_text("#!/bin/sh\necho libstdc++.so\n")
    fake.chmod(0o755)
    fix = setup._shared_libstdcxx_args(str(fake))
    builds = {"fm_rt_static": _build_probe(tmp_path, "fm_rt_static", ["-static-libstdc++"]),
              "fm_rt_fixed": _build_probe(tmp_path, "fm_rt_fixed", ["-static-libstdc++", *fix])}
    for name, proc in builds.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"building {name} failed:\n{out[-2000:]}"
    want = "probe: x has 2 dimensions and 6 elements"
    fixed = _call_probe(tmp_path, "fm_rt_fixed")
    assert fixed.returncode == 0 and fixed.stdout.strip() == want, (fixed.returncode, fixed.stdout, fixed.stderr[-500:])
    needed, _ = elf_dynamic(str(tmp_path / "fm_rt_fixed.so"))
    assert "libstdc++.so.6" in needed
    broken = _call_probe(tmp_path, "fm_rt_static")
    assert broken.returncode != 0 or broken.stdout.strip() != want, "the static-runtime build should misbehave"
    needed, defined = elf_dynamic(str(tmp_path / "fm_rt_static.so"))
    assert "libstdc++.so.6" not in needed and defined.intersection(RUNTIME_SYMBOLS)
