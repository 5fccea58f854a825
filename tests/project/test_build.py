"""setup.py's metallib step, tested on any OS with a fake `xcrun` on PATH; and the sdist.

The fake stands in for Apple's toolchain in each state a user's Mac can be
in: a working compiler, an Xcode 14 compiler without Metal 3.1, a shader that
fails to compile, a shader warning, Command Line Tools without `metal`, and no
xcrun at all. The checks: a probe compiles a Metal 3.1 kernel before the
shaders are built, and when it fails the install warns and goes on without a
metallib (unless FLASH_METAL_REQUIRE_METALLIB=1); stale outputs are deleted
before building; a compile error fails the build, a warning only with
FLASH_METAL_SHADER_WERROR=1; the fingerprint written beside the metallib is
that of the sources, and dot-files (AppleDouble `._x.metal`) count neither
there nor in the runtime's copy; Apple's compiler gets the flags the kernels
need; the package data never ships the checkout's old metallib.

The sdist: built from a clean copy of the sources, it holds every source and
no build output (always checked). That it installs into a fresh venv whose op
then passes the 2x rule on the CPU is a second full compile of the extension
(3 minutes on 2 cores, a tenth of the Linux CI's budget), so it runs where
FLASH_METAL_SDIST_INSTALL=1 is set: the macOS workflow sets it; locally,
`FLASH_METAL_SDIST_INSTALL=1 pytest -m sdist tests/project/test_build.py`.
"""
import functools
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest
from prereqs import unavailable
from repo_paths import ROOT_DIR as ROOT


# The fake xcrun: logs its argv, then acts per FAKE_XCRUN_MODE:
#   ok             a working Metal toolchain (Xcode 15 or newer);
#   old-metal      an Xcode 14 `metal`: -std=metal3.1 (and 4.0) are unknown values;
#   no-metal       Command Line Tools only, or Xcode 26 without its Metal
#                  Toolchain component: running `metal` fails;
#   compile-error  the probe compiles, our shaders do not;
#   warning        our shaders compile with a warning (an error under -Werror);
#   no-msl4        an Xcode 16 `metal`: knows -std=metal3.1, not metal4.0;
#   old-mpp        Xcode 26 with the macOS 26.0 SDK: MSL 4 compiles, but its MPP
#                  headers have no bfloat matmul2d (the MSL 4 probe fails);
#   mpp-error      the MSL 4 probe compiles, our tensor-op kernels do not.
FAKE_XCRUN = r"""#!{python}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_XCRUN_LOG"], "a") as log:
    log.write(json.dumps(args) + "\n")
mode = os.environ.get("FAKE_XCRUN_MODE", "ok")
assert args[:2] == ["-sdk", "macosx"], args
tool, rest = args[2], args[3:]
if mode == "no-metal" and tool == "metal":
    sys.stderr.write('xcrun: error: unable to find utility "metal", not a developer tool or in PATH\n')
    sys.exit(72)
out = rest[rest.index("-o") + 1]
if tool == "metal":
    src = rest[rest.index("-c") + 1]
    std = [a for a in rest if a.startswith("-std=")]
    newer = {"old-metal": ("-std=metal3.1", "-std=metal4.0"), "no-msl4": ("-std=metal4.0",)}.get(mode, ())
    if any(a in newer for a in std):
        sys.stderr.write("error: invalid value '%s' in '%s'\n" % (std[0][5:], std[0]))
        sys.exit(1)
    probe = os.path.basename(src) in ("flash_metal_probe.metal", "flash_metal_mpp_probe.metal")
    if mode == "old-mpp" and os.path.basename(src) == "flash_metal_mpp_probe.metal":
        sys.stderr.write(src + ":13:3: error: no matching matmul2d for operand types 'bfloat'\n")
        sys.exit(1)
    if mode == "mpp-error" and src.endswith("_mpp.metal"):
        sys.stderr.write(src + ":30:5: error: no member named 'reduce_rows'\n")
        sys.exit(1)
    if mode == "compile-error" and not probe:
        sys.stderr.write(src + ":3:1: error: unknown type name 'flaot'\n")
        sys.exit(1)
    if mode == "warning" and not probe:
        sys.stderr.write(src + ":7:9: warning: unused variable 'x' [-Wunused-variable]\n")
        if "-Werror" in rest:
            sys.exit(1)
    with open(src, "rb") as f, open(out, "wb") as o:
        o.write(b"AIR:" + f.read())
elif tool == "metallib":
    with open(out, "wb") as o:
        for air in rest[: rest.index("-o")]:
            with open(air, "rb") as f:
                o.write(f.read())
else:
    sys.exit("fake xcrun: unexpected tool " + tool)
"""

@functools.lru_cache(maxsize=None)
def load_setup():
    """setup.py as a module (its setup() call runs only as __main__)."""
    spec = importlib.util.spec_from_file_location("flash_metal_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def setup_py():
    return load_setup()


def _files(root):
    """Every file under root, at any depth, hidden ones included, as sorted '/'-separated relative paths."""
    return sorted(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
                  for d, _, names in os.walk(root) for f in names)


def _shader_sources(root):
    """The shader sources under root (its family subfolders too), as setup.py ships them: *.metal and *.h,
    never a dot-file; shaders/README.md is not one."""
    return [f for f in _files(root) if f.endswith((".metal", ".h")) and not os.path.basename(f).startswith(".")]


@pytest.fixture
def shaders(tmp_path):
    dest = tmp_path / "shaders"
    shutil.copytree(os.path.join(ROOT, "shaders"), dest)
    return str(dest)


@pytest.fixture
def xcrun(tmp_path, monkeypatch):
    """Installs the fake xcrun first on PATH; returns a function giving its logged calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "xcrun"
    script.write_text(FAKE_XCRUN.replace("{python}", sys.executable))
    script.chmod(0o755)
    log = tmp_path / "xcrun.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_XCRUN_LOG", str(log))
    monkeypatch.delenv("FLASH_METAL_REQUIRE_METALLIB", raising=False)

    def calls():
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return calls


@pytest.fixture
def out_dir(tmp_path, setup_py):
    """A package directory holding a stale metallib and fingerprint from an older build."""
    out = tmp_path / "pkg"
    out.mkdir()
    (out / setup_py.METALLIB_NAME).write_bytes(b"OLD METALLIB")
    (out / setup_py.METALLIB_HASH_NAME).write_text("0123456789abcdef\n")
    return out


def _compile_calls(calls, msl=None):
    """The `metal` compiles of our shaders (not the toolchain probes); msl 3 or 4: only that library's."""
    std = {None: None, 3: "-std=metal3.1", 4: "-std=metal4.0"}[msl]
    return [c for c in calls if c[2] == "metal" and not c[c.index("-c") + 1].endswith("_probe.metal")
            and (std is None or std in c)]


def _probe_calls(calls, name="flash_metal_probe.metal"):
    return [c for c in calls if c[2] == "metal" and c[c.index("-c") + 1].endswith(name)]


def test_the_toolchain_probe_compiles_metal_3_1(setup_py, xcrun, tmp_path, monkeypatch):
    # As PyTorch's CAN_COMPILE_METAL: a bfloat kernel under -std=metal3.1,
    # compiled and linked, so that an old `metal` is caught before our shaders.
    monkeypatch.setenv("FAKE_XCRUN_MODE", "ok")
    assert setup_py._metal_toolchain_problem(str(tmp_path)) is None
    (probe,) = _probe_calls(xcrun())
    assert "-std=metal3.1" in probe and "-mmacosx-version-min=14.0" in probe
    assert "bfloat" in (tmp_path / "flash_metal_probe.metal").read_text()
    assert any(c[2] == "metallib" for c in xcrun())


def test_builds_the_metallib_and_its_fingerprint(setup_py, shaders, xcrun, out_dir, monkeypatch):
    monkeypatch.setenv("FAKE_XCRUN_MODE", "ok")
    written = setup_py.build_metallib(str(out_dir), shaders)
    lib = out_dir / setup_py.METALLIB_NAME
    assert sorted(written) == sorted([str(lib), str(out_dir / setup_py.METALLIB_HASH_NAME)])
    assert lib.read_bytes().startswith(b"AIR:")  # this build's output, not the stale one
    fingerprint = (out_dir / setup_py.METALLIB_HASH_NAME).read_text()
    assert re.fullmatch(r"[0-9a-f]{16}\n", fingerprint)
    assert fingerprint.strip() == setup_py.shader_sources_hash(shaders)
    compiles = _compile_calls(xcrun())
    # Every .metal but the MSL 4 ones, which have a library of their own.
    assert sorted(os.path.basename(c[c.index("-c") + 1]) for c in compiles) == sorted(
        n for n in os.listdir(shaders) if n.endswith(".metal") and not n.endswith("_mpp.metal"))
    for flag in ("-std=metal3.1", "-mmacosx-version-min=14.0", "-fno-fast-math", "-Wall"):
        assert all(flag in c for c in compiles), (flag, compiles)
    assert not any("-ffast-math" in c for c in compiles)
    # A user's install never turns the next Xcode's new warning into a failure.
    assert not any("-Werror" in c for c in compiles)


def test_a_shader_warning_is_shown_but_fails_only_when_opted_in(setup_py, shaders, xcrun, out_dir, monkeypatch,
                                                                capfd):
    monkeypatch.setenv("FAKE_XCRUN_MODE", "warning")
    assert setup_py.build_metallib(str(out_dir), shaders)  # built, despite the warning
    assert "unused variable" in capfd.readouterr().err
    # Our CI opts in: then the warning fails the build, and nothing stale is left.
    monkeypatch.setenv("FLASH_METAL_SHADER_WERROR", "1")
    with pytest.raises(setup_py.ShaderBuildError, match="unused variable"):
        setup_py.build_metallib(str(out_dir), shaders)
    compiles = _compile_calls(xcrun())
    assert "-Werror" in compiles[-1] and "-Werror" not in compiles[0]
    assert not (out_dir / setup_py.METALLIB_NAME).exists()
    assert not (out_dir / setup_py.METALLIB_HASH_NAME).exists()


def test_a_shader_error_fails_the_build(setup_py, shaders, xcrun, out_dir, monkeypatch):
    monkeypatch.setenv("FAKE_XCRUN_MODE", "compile-error")
    with pytest.raises(setup_py.ShaderBuildError, match="unknown type name"):
        setup_py.build_metallib(str(out_dir), shaders)
    # Nothing stale is left for the install to pick up.
    assert not (out_dir / setup_py.METALLIB_NAME).exists()
    assert not (out_dir / setup_py.METALLIB_HASH_NAME).exists()


def test_an_old_compiler_falls_back_and_the_install_goes_on(setup_py, shaders, xcrun, out_dir, monkeypatch):
    # Xcode 14's `metal` knows no -std=metal3.1: the probe fails, so the build
    # warns, ships the sources for the runtime compile, and does not fail.
    monkeypatch.setenv("FAKE_XCRUN_MODE", "old-metal")
    with pytest.warns(UserWarning, match=r"metal3\.1.*The install continues.*downloadComponent MetalToolchain"):
        installed = setup_py.build_package_data(str(out_dir), True, shaders)
    assert _files(installed) == _shader_sources(shaders)
    assert not (out_dir / setup_py.METALLIB_NAME).exists()
    assert not (out_dir / setup_py.METALLIB_HASH_NAME).exists()
    assert _probe_calls(xcrun()) and not _compile_calls(xcrun())  # the shaders were never handed to it
    # Nor was MSL 4 tried: one warning, not two for one old toolchain.
    assert not _probe_calls(xcrun(), "flash_metal_mpp_probe.metal")


def test_a_missing_toolchain_warns_and_installs_no_metallib(setup_py, shaders, xcrun, out_dir, monkeypatch):
    monkeypatch.setenv("FAKE_XCRUN_MODE", "no-metal")
    with pytest.warns(UserWarning, match=r'unable to find utility "metal".*downloadComponent MetalToolchain'):
        assert setup_py.build_metallib(str(out_dir), shaders) == []
    assert not (out_dir / setup_py.METALLIB_NAME).exists()
    assert not (out_dir / setup_py.METALLIB_HASH_NAME).exists()
    assert not _compile_calls(xcrun())


def test_no_xcrun_at_all_warns(setup_py, shaders, out_dir, tmp_path, monkeypatch):
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("FLASH_METAL_REQUIRE_METALLIB", raising=False)
    with pytest.warns(UserWarning, match="cannot run xcrun"):
        assert setup_py.build_metallib(str(out_dir), shaders) == []
    assert not (out_dir / setup_py.METALLIB_NAME).exists()


@pytest.mark.parametrize("mode", ["old-metal", "no-metal"])
def test_required_metallib_makes_a_failed_probe_an_error(setup_py, shaders, xcrun, out_dir, monkeypatch, mode):
    monkeypatch.setenv("FAKE_XCRUN_MODE", mode)
    monkeypatch.setenv("FLASH_METAL_REQUIRE_METALLIB", "1")
    with pytest.raises(setup_py.ShaderBuildError, match="FLASH_METAL_REQUIRE_METALLIB=1"):
        setup_py.build_metallib(str(out_dir), shaders)


# --- The MSL 4 library (issue 21): built where the toolchain can, never breaking the install.

@pytest.fixture
def mpp_out(out_dir, setup_py):
    """out_dir holding a stale MSL 4 library too."""
    (out_dir / setup_py.METALLIB_MPP_NAME).write_bytes(b"OLD MPP METALLIB")
    (out_dir / setup_py.METALLIB_MPP_HASH_NAME).write_text("0123456789abcdef\n")
    return out_dir


def _has_mpp_library(setup_py, out):
    return (out / setup_py.METALLIB_MPP_NAME).exists() or (out / setup_py.METALLIB_MPP_HASH_NAME).exists()


def test_the_msl4_probe_asks_for_bfloat_tensor_ops_for_macos_26_2(setup_py, xcrun, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_XCRUN_MODE", "ok")
    assert setup_py._metal4_toolchain_problem(str(tmp_path)) is None
    (probe,) = _probe_calls(xcrun(), "flash_metal_mpp_probe.metal")
    assert "-std=metal4.0" in probe and "-mmacosx-version-min=26.2" in probe and "-fno-fast-math" in probe
    source = (tmp_path / "flash_metal_mpp_probe.metal").read_text()
    for needed in ("MetalPerformancePrimitives", "matmul2d", "bfloat", "get_multidimensional_index"):
        assert needed in source
    assert any(c[2] == "metallib" for c in xcrun())


def test_builds_both_libraries_each_from_its_own_sources(setup_py, shaders, xcrun, mpp_out, monkeypatch):
    monkeypatch.setenv("FAKE_XCRUN_MODE", "ok")
    setup_py.build_package_data(str(mpp_out), True, shaders)
    mpp_sources = sorted(n for n in os.listdir(shaders) if n.endswith("_mpp.metal"))
    assert mpp_sources, "no MSL 4 source to build"
    msl4 = _compile_calls(xcrun(), msl=4)
    assert sorted(os.path.basename(c[c.index("-c") + 1]) for c in msl4) == mpp_sources
    for flag in ("-mmacosx-version-min=26.2", "-fno-fast-math", "-Wall"):
        assert all(flag in c for c in msl4), (flag, msl4)
    assert not any(os.path.basename(c[c.index("-c") + 1]) in mpp_sources for c in _compile_calls(xcrun(), msl=3))
    lib = (mpp_out / setup_py.METALLIB_MPP_NAME).read_bytes()
    assert lib.startswith(b"AIR:") and b"flash_attention_prefill_mpp" in lib  # this build's, of the MPP kernels
    assert b"flash_attention_prefill_mpp" not in (mpp_out / setup_py.METALLIB_NAME).read_bytes()
    assert (mpp_out / setup_py.METALLIB_MPP_HASH_NAME).read_text().strip() == setup_py.shader_sources_hash(shaders)


@pytest.mark.parametrize("mode", ["no-msl4", "old-mpp", "mpp-error"])
def test_without_msl4_tensor_ops_the_rest_installs(setup_py, shaders, xcrun, mpp_out, monkeypatch, mode):
    # An Xcode 16 `metal`, the macOS 26.0 SDK's MPP headers, or a toolchain
    # that passes the probe but rejects our kernels: a warning that names what
    # is missing, the MSL 3.1 metallib as always, no (stale) MSL 4 library.
    monkeypatch.setenv("FAKE_XCRUN_MODE", mode)
    with pytest.warns(UserWarning, match=r"tensor-op kernels .* are not built; everything else is"):
        setup_py.build_package_data(str(mpp_out), True, shaders)
    assert (mpp_out / setup_py.METALLIB_NAME).read_bytes().startswith(b"AIR:")
    assert not _has_mpp_library(setup_py, mpp_out)
    assert bool(_compile_calls(xcrun(), msl=4)) == (mode == "mpp-error")


@pytest.mark.parametrize("mode,env", [("no-msl4", "FLASH_METAL_REQUIRE_MPP_METALLIB"),
                                      ("mpp-error", "FLASH_METAL_REQUIRE_MPP_METALLIB"),
                                      ("mpp-error", "FLASH_METAL_SHADER_WERROR")])
def test_a_macos_26_ci_leg_can_require_the_msl4_library(setup_py, shaders, xcrun, mpp_out, monkeypatch, mode, env):
    monkeypatch.setenv("FAKE_XCRUN_MODE", mode)
    monkeypatch.setenv(env, "1")
    with pytest.raises(setup_py.ShaderBuildError, match=r"reduce_rows|MPP_METALLIB=1"):
        setup_py.build_mpp_metallib(str(mpp_out), shaders)
    assert not _has_mpp_library(setup_py, mpp_out)


def test_without_mps_no_msl4_library_either(setup_py, shaders, xcrun, mpp_out):
    setup_py.build_package_data(str(mpp_out), False, shaders)
    assert not _has_mpp_library(setup_py, mpp_out) and xcrun() == []


def test_the_msl4_probe_computes_its_product_in_the_emulator(setup_py, tmp_path):
    # The probe is real MSL 4 as far as the emulator knows (whose MPP shim
    # refuses what Apple's headers refuse): it compiles (msl=4) and computes
    # its product under both cooperative-tensor lane layouts. A probe that no
    # compiler accepts would silently disable the MSL 4 library.
    import torch
    from metal_emulator import compile_library

    path = tmp_path / "mpp_probe.metal"
    path.write_text(setup_py.METAL4_PROBE_SOURCE)
    lib = compile_library([str(path)], msl=4)
    gen = torch.Generator().manual_seed(21)
    q, k = (torch.randn(s, generator=gen).to(torch.bfloat16) for s in ((16, 32), (32, 32)))
    v = torch.randn(32, 16, generator=gen).to(torch.bfloat16)
    s = q.double() @ k.double().T
    p = (s - s.max(1, keepdim=True).values).to(torch.bfloat16).double()[:, :20]  # the 20 keys of the ragged block
    want, bound = p @ v.double()[:20], p.abs() @ v.double()[:20].abs()
    for layout in ("m5", "scrambled"):
        c = torch.full((16, 16), float("nan"))
        lib.dispatch("flash_metal_mpp_probe", buffers={0: q, 1: k, 2: v, 3: c}, threadgroup=(32, 1, 1),
                     mpp_layout=layout)
        assert not c.isnan().any(), layout
        # P's bfloat rounding of a float32 S may fall on the other side of a tie: one bfloat ulp of P.
        assert ((c.double() - want).abs() <= 2.0**-8 * bound + 1e-6).all(), layout


# The MPP / Metal 4 tensor constructs of the tensor-op kernels, each as a pattern of its source text: a Mac
# whose toolchain cannot build one of them should fail the probe, not the library build after it.
MPP_CONSTRUCTS = {
    "a slice of a tensor (named, as run()'s operand)": r"\.slice\(",
    "a static slice": r"\bstatic_slice<|\.slice<",
    "an inline tensor over device memory": r"tensor<device ",
    "an inline tensor over threadgroup memory": r"tensor<threadgroup ",
    "a tensor with explicit strides": r"array<int, 2>\{",
    "a const pointer cast for a device operand": r"const_cast<device ",
    "a left-input cooperative tensor": r"get_left_input_cooperative_tensor",
    "a right-input cooperative tensor": r"get_right_input_cooperative_tensor",
    "a destination cooperative tensor": r"get_destination_cooperative_tensor",
    "a row reduction destination": r"get_row_reduction_destination_cooperative_tensor",
    "a column reduction destination": r"get_column_reduction_destination_cooperative_tensor",
    "reduce_rows": r"\breduce_rows\(",
    "reduce_columns": r"\breduce_columns\(",
    "a reduction with a float identity": r"reduce_rows\([^;]*\bfloat\(",
    "a dynamic K": r"static_cast<int>\((?:metal::)?dynamic_extent\)",
    "multiply_accumulate": r"mode::multiply_accumulate",
    "a multi-SIMD-group scope": r"execution_simdgroups<",
    "a cooperative load": r"\.load\(",
    "a cooperative store": r"\.store\(",
    "map_iterator": r"\bmap_iterator\b",
    "relaxed precision": r"relaxed_precision\s*=\s*true",
}
CORE_CONSTRUCTS = ("a slice of a tensor (named, as run()'s operand)", "a left-input cooperative tensor",
                   "a dynamic K", "a reduction with a float identity", "a const pointer cast for a device operand")


def _mpp_kernel_text():
    """Every source of the MSL 4 library (shaders/*_mpp.metal and the headers it includes, every file of
    shaders/tensor_ops/), found by walking the folder."""
    shader_dir = os.path.join(ROOT, "shaders")
    names = [n for n in _shader_sources(shader_dir) if n.endswith("_mpp.metal") or n.startswith("tensor_ops/")]
    assert any(n.startswith("tensor_ops/") for n in names), names
    assert any(n.endswith("_mpp.metal") for n in names), names
    text = ""
    for n in names:
        with open(os.path.join(shader_dir, n), encoding="utf-8") as f:
            text += f.read()
    return text


def probe_gaps(kernel_text, probe_text):
    """The constructs the kernels use and the probe does not."""
    return [name for name, pattern in MPP_CONSTRUCTS.items()
            if re.search(pattern, kernel_text) and not re.search(pattern, probe_text)]


def test_the_msl4_probe_uses_every_construct_the_kernels_use(setup_py):
    """So a Mac whose toolchain cannot build the kernels says so at install time (the probe fails: a warning,
    or an error under FLASH_METAL_REQUIRE_MPP_METALLIB=1) rather than after the probe passed. Planted: a
    construct the kernels gain (a multi-SIMD-group scope appended to their text) is reported missing from the
    probe."""
    kernels, probe = _mpp_kernel_text(), setup_py.METAL4_PROBE_SOURCE
    used = [name for name, pattern in MPP_CONSTRUCTS.items() if re.search(pattern, kernels)]
    assert set(CORE_CONSTRUCTS) <= set(used), used  # the patterns still find what the kernels spell
    assert probe_gaps(kernels, probe) == []
    assert "bfloat" in probe and "bfloat" in kernels
    assert probe_gaps(kernels + "  matmul2d<d, execution_simdgroups<4>> op;", probe) == ["a multi-SIMD-group scope"]


def test_without_mps_the_build_ships_sources_and_no_metallib(setup_py, shaders, xcrun, out_dir):
    installed = setup_py.build_package_data(str(out_dir), False, shaders)
    assert _files(installed) == _shader_sources(shaders)  # the family subfolders, and nothing else
    assert "common/params.h" in _files(installed) and "attention.metal" in _files(installed)
    assert not (out_dir / setup_py.METALLIB_NAME).exists()  # the stale one is gone
    assert xcrun() == []


def test_fingerprint_follows_every_shader_byte(setup_py, shaders):
    before = setup_py.shader_sources_hash(shaders)
    with open(os.path.join(shaders, "common", "params.h"), "ab") as f:
        f.write(b"\n")
    assert setup_py.shader_sources_hash(shaders) != before


# An AppleDouble file (what macOS writes as "._<name>" beside a file copied to a
# non-Apple file system or packed by some archivers): its magic number, 0x00051607.
APPLE_DOUBLE = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(16)


@pytest.fixture
def shaders_with_dot_files(shaders):
    for name in ("._attention.metal", os.path.join("common", "._params.h")):
        with open(os.path.join(shaders, name), "wb") as f:
            f.write(APPLE_DOUBLE)
    return shaders


def test_dot_files_are_not_shaders(setup_py, shaders_with_dot_files, xcrun, tmp_path, monkeypatch):
    clean = tmp_path / "clean"
    shutil.copytree(shaders_with_dot_files, clean, ignore=shutil.ignore_patterns(".*"))
    assert setup_py.shader_sources_hash(shaders_with_dot_files) == setup_py.shader_sources_hash(str(clean))
    installed = setup_py.install_shader_sources(str(tmp_path / "pkg"), shaders_with_dot_files)
    assert _files(installed) == _shader_sources(str(clean))
    monkeypatch.setenv("FAKE_XCRUN_MODE", "ok")
    setup_py.build_metallib(str(tmp_path / "pkg"), shaders_with_dot_files)
    assert not any("._" in c[c.index("-c") + 1] for c in _compile_calls(xcrun()))


def test_the_runtime_fingerprint_skips_dot_files_too(setup_py, shaders_with_dot_files, tmp_path):
    # library.mm recomputes the fingerprint at run time (csrc/mps/shader_source.h):
    # it must agree with setup.py's, or a stray ._x.metal beside the installed
    # shaders would make every first call recompile them.
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        unavailable("no C++ compiler to build the shader_source.h driver")
    exe = str(tmp_path / "inline_shaders")
    cmd = [cxx, "-std=c++17", "-O1", f"-I{os.path.join(ROOT, 'csrc')}",
           os.path.join(ROOT, "tests", "mps_syntax", "inline_shaders.cpp"), "-o", exe]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    runtime = subprocess.run([exe, "--hash", shaders_with_dot_files], capture_output=True, text=True, check=True)
    assert runtime.stdout.strip() == setup_py.shader_sources_hash(shaders_with_dot_files)


def test_shader_install_leaves_no_leftovers(setup_py, shaders, tmp_path):
    pkg = tmp_path / "pkg2"
    (pkg / "shaders").mkdir(parents=True)
    (pkg / "shaders" / "removed_kernel.h").write_text("// from an older checkout\n")
    (pkg / "shaders" / "prefill").mkdir()
    (pkg / "shaders" / "prefill" / "removed_kernel.h").write_text("// from an older checkout\n")
    (pkg / "shaders" / "removed_family").mkdir()
    (pkg / "shaders" / "removed_family" / "attention_removed.h").write_text("// from an older checkout\n")
    setup_py.install_shader_sources(str(pkg), shaders)
    assert _files(pkg / "shaders") == _shader_sources(shaders)


def test_package_data_never_ships_a_metallib_or_shaders():
    # The build writes these itself; package data would copy whatever an
    # earlier build left in the checkout's flash_metal/ into the wheel.
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    assert "metallib" not in text and "shaders/" not in text


# --- The sdist round trip -----------------------------------------------------------------------
# Run in the fresh venv: the op, forward and backward, on inputs the test made;
# saves what it got and where flash_metal was imported from.
SDIST_SMOKE = r"""
import os, sys, torch
import flash_metal
inputs = torch.load(sys.argv[1])
q, k, v, grad_out = (inputs[n] for n in ("q", "k", "v", "grad_out"))
out, lse = flash_metal.attention_with_lse(q, k, v, True)
grads = torch.ops.flash_metal.attention_backward(grad_out, q, k, v, out, lse, True)[:3]
pkg = os.path.dirname(flash_metal.__file__)
shaders = os.path.join(pkg, "shaders")
torch.save({"out": out, "lse": lse, "grads": grads, "package": pkg,
            "shaders": sorted(os.path.relpath(os.path.join(d, f), shaders).replace(os.sep, "/")
                              for d, _, names in os.walk(shaders) for f in names)}, sys.argv[2])
"""


def _site_dirs_of(*modules):
    """The directories the given installed modules were imported from (site-packages)."""
    dirs = []
    # Found on sys.path, neither imported nor passed through the import hooks:
    # setuptools' distutils hook would otherwise unload distutils when asked for pip.
    for name in modules:
        d = os.path.dirname(os.path.dirname(os.path.abspath(importlib.machinery.PathFinder.find_spec(name).origin)))
        if d not in dirs:
            dirs.append(d)
    return dirs


def _fresh_venv(tmp_path):
    """A new venv that sees this environment's torch, setuptools and pip but no flash_metal.

    Installing torch again would download gigabytes: instead the new
    site-packages gets a symlink to every entry of the current ones except
    flash_metal's (a .pth to them would also expose the installed flash_metal,
    which pip would then see and could uninstall).
    """
    venv = tmp_path / "venv"
    proc = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True)
    if proc.returncode != 0:
        unavailable(f"cannot create a venv: {proc.stderr.strip()}")
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    for d in _site_dirs_of("torch", "setuptools", "pip"):
        for entry in os.listdir(d):
            if "flash_metal" in entry.lower().replace("-", "_") or os.path.exists(os.path.join(site, entry)):
                continue
            os.symlink(os.path.join(d, entry), os.path.join(site, entry))
    return python


# Build outputs and macOS litter a checkout can hold, planted in the copy the
# sdist is built from: none may reach the sdist.
LEFTOVERS = ("flash_metal/_C.cpython-311-x86_64-linux-gnu.so", "flash_metal/flash_metal.metallib",
             "flash_metal/flash_metal.metallib.fnv1a64", "flash_metal/shaders/attention.metal",
             "flash_metal/shaders/prefill/attention_prefill.h", "shaders/._attention.metal",
             "shaders/common/._params.h", "csrc/._flash_metal.cpp")


def _source_files():
    """The checkout's source files (relative paths): git's tracked and new, unignored files, else a walk."""
    proc = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                          capture_output=True)
    if proc.returncode == 0 and proc.stdout:
        return [p for p in proc.stdout.decode().split("\0") if p and os.path.isfile(os.path.join(ROOT, p))]
    skip = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis", "wheels"}
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.endswith(".egg-info")]
        files += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in filenames]
    return files


def _clean_copy(dest):
    """The checkout's sources copied to dest, as a fresh clone has them, plus LEFTOVERS.

    Not the checkout itself: setuptools reuses an existing *.egg-info/SOURCES.txt
    as part of the manifest, so a checkout that was built before yields a
    complete sdist even without MANIFEST.in, and a fresh clone would not.
    """
    for rel in _source_files():
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), os.path.join(dest, rel))
    for rel in LEFTOVERS:
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        with open(os.path.join(dest, rel), "wb") as f:
            f.write(APPLE_DOUBLE if "/._" in rel else b"a build output\n")
    return dest


def _build_sdist(src, out_dir):
    """The sdist of the tree at src, through setuptools' PEP 517 backend (as `python -m build --sdist` would)."""
    proc = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                           "print(build_meta.build_sdist(sys.argv[1]))", str(out_dir)],
                          cwd=src, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return os.path.join(out_dir, proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    src = _clean_copy(str(tmp_path_factory.mktemp("checkout")))
    return _build_sdist(src, tmp_path_factory.mktemp("sdist"))


def test_the_sdist_holds_every_source_and_no_build_output(sdist):
    with tarfile.open(sdist) as tar:
        members = {m.split("/", 1)[1] for m in tar.getnames() if "/" in m}
    sources = [p for p in _source_files() if p.startswith(("csrc/", "shaders/"))]
    assert any(p.endswith(".mm") for p in sources) and any(p.endswith(".metal") for p in sources)
    missing = sorted(p for p in sources if p not in members)
    assert missing == [], f"the sdist lacks {missing}"
    for required in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in", "flash_metal/__init__.py"):
        assert required in members
    assert sorted(m for m in members if m in LEFTOVERS or m.endswith(".so") or "/._" in m) == []


SDIST_INSTALL = os.environ.get("FLASH_METAL_SDIST_INSTALL") == "1"


@pytest.mark.sdist
@pytest.mark.skipif(not SDIST_INSTALL, reason="a second full compile: FLASH_METAL_SDIST_INSTALL=1 runs it "
                    "(the macOS workflow does)")
def test_the_sdist_installs_into_a_fresh_venv_and_runs(sdist, tmp_path):
    # What a user of `pip install flash_metal-<v>.tar.gz` gets: a build from
    # the sdist alone (no checkout around it), then the op on the CPU.
    import torch

    from numerics import assert_attention_close, assert_gradients_close, make_qkv

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        unavailable("no C++ compiler (c++) to build the extension")
    python = _fresh_venv(tmp_path)
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--no-build-isolation",
                           "--no-cache-dir", sdist], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    q, k, v = make_qkv(1, 4, 2, 37, 45, 64, torch.float32)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    torch.save({"q": q, "k": k, "v": v, "grad_out": grad_out}, tmp_path / "inputs.pt")
    (tmp_path / "smoke.py").write_text(SDIST_SMOKE)
    run = subprocess.run([str(python), "smoke.py", "inputs.pt", "result.pt"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    result = torch.load(tmp_path / "result.pt")
    assert result["package"].startswith(str(tmp_path / "venv")), result["package"]  # not this env's copy
    assert result["shaders"] == _shader_sources(os.path.join(ROOT, "shaders"))
    assert_attention_close(result["out"], result["lse"], q, k, v, causal=True)
    assert_gradients_close(result["grads"], q, k, v, grad_out, causal=True)
