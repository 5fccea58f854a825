"""setup.py's metallib step, tested on any OS with a fake `xcrun` on PATH.

The fake stands in for Apple's toolchain in each state a user's Mac can be
in: a working compiler, a shader that fails to compile, a shader warning
(an error with -Werror), Command Line Tools without `metal`, and no xcrun at
all. The checks: stale outputs are deleted before building, a compile error
or warning fails the build, a missing toolchain only warns (unless
FLASH_METAL_REQUIRE_METALLIB=1), the fingerprint written beside the metallib
is that of the sources, Apple's compiler gets the flags the kernels need,
and the package data never ships the checkout's old metallib.
"""
import functools
import importlib.util
import json
import os
import re
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The fake xcrun: logs its argv, then acts per FAKE_XCRUN_MODE.
FAKE_XCRUN = r'''#!{python}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_XCRUN_LOG"], "a") as log:
    log.write(json.dumps(args) + "\n")
mode = os.environ.get("FAKE_XCRUN_MODE", "ok")
assert args[:2] == ["-sdk", "macosx"], args
tool, rest = args[2], args[3:]
if tool == "--find" or "--version" in rest:
    if mode == "no-metal":
        sys.stderr.write('xcrun: error: unable to find utility "%s", not a developer tool or in PATH\n' % tool)
        sys.exit(72)
    print("/fake/usr/bin/" + rest[0] if tool == "--find" else "Apple metal version 32023.404 (fake)")
    sys.exit(0)
out = rest[rest.index("-o") + 1]
if tool == "metal":
    src = rest[rest.index("-c") + 1]
    if mode == "compile-error":
        sys.stderr.write(src + ":3:1: error: unknown type name 'flaot'\n")
        sys.exit(1)
    if mode == "warning":
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
'''


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


def _compile_calls(calls):
    return [c for c in calls if c[2] == "metal" and "--version" not in c]


def test_the_toolchain_probe_runs_the_compiler(setup_py, xcrun, monkeypatch):
    # Xcode 26 without its Metal Toolchain component: `--find metal` works,
    # running `metal` does not; so the probe must run it.
    monkeypatch.setenv("FAKE_XCRUN_MODE", "ok")
    assert setup_py._metal_toolchain_problem() is None
    assert ["-sdk", "macosx", "metal", "--version"] in xcrun()


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
    assert [os.path.basename(c[c.index("-c") + 1]) for c in compiles] == sorted(
        n for n in os.listdir(shaders) if n.endswith(".metal"))
    for flag in ("-std=metal3.1", "-mmacosx-version-min=14.0", "-fno-fast-math", "-Werror"):
        assert all(flag in c for c in compiles), (flag, compiles)
    assert not any("-ffast-math" in c for c in compiles)


@pytest.mark.parametrize("mode", ["compile-error", "warning"])
def test_a_shader_error_or_warning_fails_the_build(setup_py, shaders, xcrun, out_dir, monkeypatch, mode):
    monkeypatch.setenv("FAKE_XCRUN_MODE", mode)
    with pytest.raises(setup_py.ShaderBuildError, match="unknown type name|unused variable"):
        setup_py.build_metallib(str(out_dir), shaders)
    # Nothing stale is left for the install to pick up.
    assert not (out_dir / setup_py.METALLIB_NAME).exists()
    assert not (out_dir / setup_py.METALLIB_HASH_NAME).exists()


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


def test_required_metallib_makes_a_missing_toolchain_an_error(setup_py, shaders, xcrun, out_dir, monkeypatch):
    monkeypatch.setenv("FAKE_XCRUN_MODE", "no-metal")
    monkeypatch.setenv("FLASH_METAL_REQUIRE_METALLIB", "1")
    with pytest.raises(setup_py.ShaderBuildError, match="FLASH_METAL_REQUIRE_METALLIB=1"):
        setup_py.build_metallib(str(out_dir), shaders)


def test_fingerprint_follows_every_shader_byte(setup_py, shaders):
    before = setup_py.shader_sources_hash(shaders)
    with open(os.path.join(shaders, "params.h"), "ab") as f:
        f.write(b"\n")
    assert setup_py.shader_sources_hash(shaders) != before


def test_shader_install_leaves_no_leftovers(setup_py, shaders, tmp_path):
    pkg = tmp_path / "pkg2"
    (pkg / "shaders").mkdir(parents=True)
    (pkg / "shaders" / "removed_kernel.h").write_text("// from an older checkout\n")
    setup_py.install_shader_sources(str(pkg), shaders)
    assert sorted(os.listdir(pkg / "shaders")) == sorted(os.listdir(shaders))


def test_package_data_never_ships_a_metallib_or_shaders():
    # The build writes these itself; package data would copy whatever an
    # earlier build left in the checkout's flash_metal/ into the wheel.
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    assert "metallib" not in text and "shaders/" not in text
