"""Linux checks of the MPS host code in csrc/mps/ (no Mac, no Metal needed).

- The .mm files parse against the real PyTorch MPS headers of the macOS
  wheels of the oldest supported torch (2.4.0, C++17) and a recent one
  (2.14.1, C++20), plus the Apple API declarations in tests/mps_syntax/stubs/,
  in two SDK views: the newest SDK and the macOS 14 SDK of Xcode 15, which
  lacks the macOS 15 API; the check provably bites (a misspelled method
  fails it, and so does macOS 15 API named without a compile-time guard in
  the SDK-14 view), and correct calls of real Metal API the .mm does not use
  yet pass it.
- The encoding rules in the header of csrc/mps/attention_mps.mm hold, textually.
- The runtime-compile fallback's include inliner (csrc/mps/shader_source.h)
  produces one complete source that the Metal emulator compiles into the same
  kernels as the shader files themselves.

Run: pytest tests/mps/test_mps_host.py. The first run downloads the two macOS
torch wheels (~60 and ~130 MB) into ~/.cache/flash_metal/; with CI=true a
failed download fails the tests instead of skipping them.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

from mps_syntax import syntax_check
from prereqs import unavailable

ROOT = syntax_check.ROOT
MPS_DIR = os.path.join(ROOT, "csrc", "mps")
SHADER = os.path.join(ROOT, "shaders", "attention.metal")



def skip_on_macos(platform=None):
    """The stubs stand in for Apple's SDK on Linux; a Mac has the real one (and builds the .mm against it):
    skipped there even with CI=true, where a missing prerequisite would fail."""
    if (platform or sys.platform) == "darwin":
        pytest.skip(syntax_check.MACOS_REASON)


@pytest.fixture(scope="session")
def clang():
    from metal_emulator import BuildError, find_clang

    skip_on_macos()
    try:
        return find_clang()
    except BuildError as err:
        unavailable(str(err))


def _headers(version):
    skip_on_macos()
    try:
        return syntax_check.macos_torch_include(version), syntax_check.MACOS_TORCH_VERSIONS[version]
    except syntax_check.HeadersUnavailable as err:
        unavailable(f"macOS torch {version} headers unavailable: {err}")


@pytest.fixture(scope="session", params=sorted(syntax_check.MACOS_TORCH_VERSIONS))
def macos_torch(request):
    """(torch/include, C++ standard) of each checked macOS torch version."""
    return _headers(request.param)


@pytest.fixture(scope="session")
def macos_torch_include():
    """torch/include of the newest checked macOS torch (for the checks that need one version)."""
    return _headers(syntax_check.MACOS_TORCH_VERSION)[0]


def _syntax_check(clang, source, include, *extra, std="c++20", sdk=None, pch=None):
    cmd = syntax_check.syntax_check_command(clang, source, include, extra, std=std, sdk=sdk, pch=pch)
    return subprocess.run(cmd, capture_output=True, text=True), cmd


@pytest.fixture(scope="session")
def precompiled(clang, tmp_path_factory):
    """(torch include, std, sdk) -> a precompiled header of the torch headers, built on first use."""
    made = {}

    def get(include, std, sdk=None):
        key = (include, std, sdk)
        if key not in made:
            cmd, pch = syntax_check.precompiled_header_command(clang, include, str(tmp_path_factory.mktemp("pch")),
                                                               std=std, sdk=sdk)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            assert proc.returncode == 0, f"$ {' '.join(cmd)}\n{proc.stderr}"
            made[key] = pch
        return made[key]

    return get


# --- the syntax check ---------------------------------------------------------------------


def test_there_are_mm_sources():
    names = {os.path.basename(p) for p in syntax_check.mm_sources()}
    assert {"attention_mps.mm", "library.mm"} <= names


def test_checked_versions_include_the_minimum_torch():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        minimum = re.search(r'"torch>=([\d.]+)"', f.read()).group(1)
    assert syntax_check.MINIMUM_TORCH_VERSION in syntax_check.MACOS_TORCH_VERSIONS
    assert syntax_check.MINIMUM_TORCH_VERSION.startswith(minimum + "."), (minimum, syntax_check.MINIMUM_TORCH_VERSION)


@pytest.mark.parametrize("source", syntax_check.mm_sources(), ids=os.path.basename)
def test_mm_parses_against_macos_torch_headers(clang, macos_torch, source, precompiled):
    # The newest torch parses each file as it stands (its own includes, no
    # precompiled header to supply one it forgot); older ones through a
    # precompiled header of the torch headers (the same declarations, parsed once).
    include, std = macos_torch
    newest = include == syntax_check.macos_torch_include(syntax_check.MACOS_TORCH_VERSION)
    proc, cmd = _syntax_check(clang, source, include, std=std, pch=None if newest else precompiled(include, std))
    assert proc.returncode == 0, f"$ {' '.join(cmd)}\n{proc.stderr}"


@pytest.mark.parametrize("source", syntax_check.mm_sources(), ids=os.path.basename)
def test_mm_parses_with_the_macos14_sdk(clang, source, precompiled):
    # Xcode 15 / Command Line Tools 15: the SDK view without the macOS 15 API,
    # with the oldest supported torch (the Apple stubs are what differ; one
    # torch version is enough to see them), through a precompiled header
    # made in that view.
    include, std = _headers(syntax_check.MINIMUM_TORCH_VERSION)
    sdk = syntax_check.SDK_VIEWS["sdk14"]
    proc, cmd = _syntax_check(clang, source, include, std=std, sdk=sdk, pch=precompiled(include, std, sdk))
    assert proc.returncode == 0, f"$ {' '.join(cmd)}\n{proc.stderr}"


def test_sdk14_view_lacks_the_macos15_api(clang, macos_torch_include, tmp_path):
    # The SDK-14 view is what makes the class visible: there, the API does not
    # exist; in the newest view it does.
    sample = tmp_path / "macos15_api.mm"
    sample.write_text("#include <Metal/Metal.h>\n"
                      "void f(MTLCompileOptions* o) {\n"
                      "  if (@available(macOS 15.0, *)) {\n"
                      "    [o setMathMode:MTLMathModeSafe];\n"
                      "    [o setMathFloatingPointFunctions:MTLMathFloatingPointFunctionsPrecise];\n"
                      "    [o setLanguageVersion:MTLLanguageVersion3_2];\n"
                      "  }\n}\n", encoding="utf-8")
    new, _ = _syntax_check(clang, str(sample), macos_torch_include, sdk=syntax_check.SDK_VIEWS["sdk26"])
    assert new.returncode == 0, new.stderr
    old, _ = _syntax_check(clang, str(sample), macos_torch_include, sdk=syntax_check.SDK_VIEWS["sdk14"])
    for name in ("MTLMathModeSafe", "MTLMathFloatingPointFunctionsPrecise", "MTLLanguageVersion3_2"):
        assert f"'{name}'" in old.stderr, old.stderr
    assert "setMathMode:" in old.stderr, old.stderr


@pytest.mark.parametrize("plant", ["declarations_dropped", "newer_language_version"])
def test_sdk14_check_catches_unguarded_macos15_api(clang, macos_torch_include, tmp_path, plant, precompiled):
    # library.mm declares the macOS 15 API itself when the SDK lacks it. Planted:
    # without that block, or naming a macOS 15 constant it does not declare
    # (MTLLanguageVersion3_2), library.mm still parses in the newest view but
    # fails in the SDK-14 view, as it would with Xcode 15.
    path = os.path.join(MPS_DIR, "library.mm")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if plant == "declarations_dropped":
        broken, n = re.subn(r"#if !defined\(__MAC_15_0\)\n.*?\n#endif\n", "", text, flags=re.S)
    else:
        broken, n = re.subn(r"(setMathFloatingPointFunctions:MTLMathFloatingPointFunctionsPrecise\];\s*"
                            r"\[options setLanguageVersion:)MTLLanguageVersion3_1", r"\1MTLLanguageVersion3_2", text)
    assert n == 1, f"plant {plant} no longer applies to library.mm: update it"
    copy = tmp_path / "library.mm"
    copy.write_text(broken, encoding="utf-8")
    # The oldest torch, through the precompiled headers the parse tests made
    # for both views (the plants are in library.mm's SDK guards, which any torch shows).
    include, std = _headers(syntax_check.MINIMUM_TORCH_VERSION)
    views = {v: (syntax_check.SDK_VIEWS[v], precompiled(include, std, syntax_check.SDK_VIEWS[v]))
             for v in ("sdk26", "sdk14")}
    new, cmd = _syntax_check(clang, str(copy), include, f"-I{MPS_DIR}", std=std, sdk=views["sdk26"][0],
                             pch=views["sdk26"][1])
    assert new.returncode == 0, f"$ {' '.join(cmd)}\n{new.stderr}"
    old, _ = _syntax_check(clang, str(copy), include, f"-I{MPS_DIR}", std=std, sdk=views["sdk14"][0],
                           pch=views["sdk14"][1])
    assert old.returncode != 0
    missing = ("MTLMathModeSafe",) if plant == "declarations_dropped" else ("MTLLanguageVersion3_2",)
    for name in missing:
        assert f"use of undeclared identifier '{name}'" in old.stderr, old.stderr


def test_library_mm_declares_the_macos15_api_only_for_older_sdks():
    # The compile-time guard: the block is skipped when the SDK has the API
    # (declaring it twice would clash), and it covers every name used.
    code = open(os.path.join(MPS_DIR, "library.mm"), encoding="utf-8").read()
    block = re.search(r"#if !defined\(__MAC_15_0\)\n(.*?)\n#endif\n", code, flags=re.S)
    assert block, "library.mm no longer declares the macOS 15 API for older SDKs"
    for name in ("MTLMathModeSafe", "MTLMathFloatingPointFunctionsPrecise", "mathMode", "mathFloatingPointFunctions"):
        assert name in block.group(1), name


def _newest(precompiled):
    """(torch include, std, pch) of the newest checked torch: the checks below
    parse small plants, so through a precompiled header of its headers."""
    include = syntax_check.macos_torch_include(syntax_check.MACOS_TORCH_VERSION)
    std = syntax_check.MACOS_TORCH_VERSIONS[syntax_check.MACOS_TORCH_VERSION]
    return include, std, precompiled(include, std)


def test_correct_calls_of_real_api_pass_the_check(clang, macos_torch_include, precompiled):
    # Real Metal selectors and PyTorch profiler calls the .mm does not (all)
    # make today, used correctly: a correct change must never fail the check.
    sample = os.path.join(syntax_check.HERE, "real_api_sample.mm")
    include, std, pch = _newest(precompiled)
    proc, cmd = _syntax_check(clang, sample, include, std=std, pch=pch)
    assert proc.returncode == 0, f"$ {' '.join(cmd)}\n{proc.stderr}"


def test_stubs_reject_wrong_use_of_real_api(clang, macos_torch_include, tmp_path, precompiled):
    # The same sample with a wrong argument type and a misspelled selector:
    # the stubs must carry real signatures, not accept anything.
    with open(os.path.join(syntax_check.HERE, "real_api_sample.mm"), encoding="utf-8") as f:
        text = f.read()
    assert "dispatchThreads:threads threadsPerThreadgroup:group" in text and "setBufferOffset:" in text
    text = text.replace("dispatchThreads:threads threadsPerThreadgroup:group",
                        "dispatchThreads:threads threadsPerThreadGroup:group")
    text = text.replace("setBufferOffset:16", "setBufferOffset:buffer")
    broken = tmp_path / "real_api_sample.mm"
    broken.write_text(text, encoding="utf-8")
    include, std, pch = _newest(precompiled)
    proc, _ = _syntax_check(clang, str(broken), include, std=std, pch=pch)
    assert "'-dispatchThreads:threadsPerThreadGroup:' not found" in proc.stderr, proc.stderr
    assert "error: cannot initialize a parameter of type 'NSUInteger'" in proc.stderr, proc.stderr
    assert "setBufferOffset:buffer" in proc.stderr, proc.stderr  # clang quotes the offending line


def test_syntax_check_catches_typos(clang, macos_torch_include, tmp_path, precompiled):
    # One copy, two misspellings: an MPSStream method (checked against the real
    # PyTorch header) and a Metal selector (checked against our stubs).
    with open(os.path.join(MPS_DIR, "attention_mps.mm"), encoding="utf-8") as f:
        text = f.read()
    assert "stream->commandEncoder()" in text and "threadsPerThreadgroup:r.group" in text
    text = text.replace("stream->commandEncoder()", "stream->commandEncoderr()")
    text = text.replace("threadsPerThreadgroup:r.group", "threadsPerThreadGroup:r.group")
    broken = tmp_path / "attention_mps.mm"
    broken.write_text(text, encoding="utf-8")
    include, std, pch = _newest(precompiled)
    proc, _ = _syntax_check(clang, str(broken), include, f"-I{MPS_DIR}", std=std, pch=pch)
    assert proc.returncode != 0
    assert "no member named 'commandEncoderr'" in proc.stderr, proc.stderr
    assert "'-dispatchThreadgroups:threadsPerThreadGroup:' not found" in proc.stderr, proc.stderr


# --- encoding rules, textually ---------------------------------------------------------------


def _code(path):
    """The file without comments and string literals (so prose cannot trip the rules)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"//[^\n]*|/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)


def _dispatch_blocks(code):
    """(start, end, text) of every `dispatch_sync(stream->queue(), ^{ ... })` block body."""
    blocks = []
    for m in re.finditer(r"dispatch_sync\s*\(\s*stream->queue\(\)\s*,\s*\^\s*\{", code):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            i += 1
        blocks.append((m.end(), i, code[m.end():i]))
    return blocks


@pytest.mark.parametrize("source", syntax_check.mm_sources(), ids=os.path.basename)
def test_mm_follows_encoding_rules(source):
    code = _code(source)
    for banned in ("computeCommandEncoder", "endEncoding", "commit", "commandBuffer", "-fobjc-arc",
                   "__bridge", "OperationUtils.h", "MetalShaderLibrary", "torch::mps::"):
        assert not re.search(r"(?<![\w-])" + re.escape(banned) + r"(?![\w-])", code), (
            f"{os.path.basename(source)} uses {banned}: see the rules at the top of csrc/mps/attention_mps.mm")
    blocks = _dispatch_blocks(code)
    for m in re.finditer(r"commandEncoder\s*\(", code):
        assert any(start <= m.start() < end for start, end, _ in blocks), (
            f"{os.path.basename(source)}: stream->commandEncoder() outside dispatch_sync(stream->queue(), ...)")
    for _, _, body in blocks:
        # Nothing that can throw, and no PyTorch call, inside the block.
        for banned in ("TORCH_CHECK", "throw", "at::", "torch::", "c10::", ".item", "get_pipeline"):
            assert banned not in body, f"{os.path.basename(source)}: `{banned}` inside the dispatch_sync block"


def _statements_outside_guard(code, api, version):
    """Uses of `api` not inside the then-branch of `if (@available(macOS <version>, *))`."""
    guards = []
    for m in re.finditer(r"if\s*\(\s*@available\s*\(\s*macOS\s+([\d.]+)\s*,\s*\*\s*\)\s*\)\s*\{", code):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            i += 1
        if float(m.group(1)) >= version:
            guards.append((m.end(), i))
    return [m.start() for m in re.finditer(re.escape(api), code)
            if not any(a <= m.start() < b for a, b in guards)]


@pytest.mark.parametrize("source", syntax_check.mm_sources(), ids=os.path.basename)
def test_new_metal_api_is_guarded_by_available(source):
    # clang ignores macOS availability on Linux, so check the guards here:
    # macOS 15 API only under @available(macOS 15.0, *), Metal 3.1 under 14.
    code = _code(source)
    for api, version in (("setMathMode", 15.0), ("setMathFloatingPointFunctions", 15.0),
                         ("MTLLanguageVersion3_1", 14.0), ("MTLLanguageVersion3_2", 15.0)):
        assert not _statements_outside_guard(code, api, version), (
            f"{os.path.basename(source)}: {api} outside `if (@available(macOS {version}, *))`")


def test_runtime_compile_turns_fast_math_off():
    code = _code(os.path.join(MPS_DIR, "library.mm"))
    assert "setMathMode:MTLMathModeSafe" in code
    assert "setFastMathEnabled:NO" in code
    assert "setMathFloatingPointFunctions:MTLMathFloatingPointFunctionsPrecise" in code


def test_availability_guard_rule_bites():
    code = "void f(O* o) { if (@available(macOS 14.0, *)) { [o setMathMode:MTLMathModeSafe]; } }"
    assert _statements_outside_guard(code, "setMathMode", 15.0)
    code = "void f(O* o) { if (@available(macOS 15.0, *)) { [o setMathMode:MTLMathModeSafe]; } }"
    assert not _statements_outside_guard(code, "setMathMode", 15.0)


def test_attention_mps_encodes_on_the_current_stream():
    code = _code(os.path.join(MPS_DIR, "attention_mps.mm"))
    assert "at::mps::getCurrentMPSStream()" in code
    assert len(_dispatch_blocks(code)) == 1
    body = _dispatch_blocks(code)[0][2]
    # The encoder is fetched inside the loop over the launches, once per
    # dispatch (the profiler may end it between two; tests/mps/test_mps_exec_runtime.py
    # executes that).
    loop = re.search(r"for \(const ResolvedLaunch& r : launches\) \{(.*)", body, flags=re.S)
    assert loop and "stream->commandEncoder()" in loop.group(1)
    assert body.count("stream->commandEncoder()") == 1


def test_dispatch_is_bracketed_by_the_mps_profiler():
    # As PyTorch's own Metal kernels do: begin after taking the encoder, end
    # after the dispatch, inside the block, through wrappers that cannot throw.
    code = _code(os.path.join(MPS_DIR, "attention_mps.mm"))
    body = _dispatch_blocks(code)[0][2]
    order = [body.find(s) for s in ("stream->commandEncoder()", "profile_begin(r.state", "setComputePipelineState:",
                                     "dispatchThreadgroups:", "profile_end(r.state)")]
    assert -1 not in order and order == sorted(order), order
    for wrapper, call in (("profile_begin", "getMPSProfiler().beginProfileKernel("),
                          ("profile_end", "getMPSProfiler().endProfileKernel(")):
        m = re.search(wrapper + r"\([^)]*\)\s*noexcept\s*\{\s*try\s*\{([^}]*)\}\s*catch\s*\(\.\.\.\)", code)
        assert m and call in m.group(1), f"{wrapper} must call {call} inside try/catch(...), noexcept"


def test_setup_never_enables_arc():
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        setup = f.read()
    assert "-fno-objc-arc" in setup
    assert not re.search(r"(?<![\w-])-fobjc-arc", setup)


# --- the runtime-compile fallback's include inliner ----------------------------------------


@pytest.fixture(scope="session")
def inliner(clang, tmp_path_factory):
    """tests/mps_syntax/inline_shaders.cpp built against csrc/mps/shader_source.h."""
    exe = str(tmp_path_factory.mktemp("inliner") / "inline_shaders")
    cmd = [clang, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{os.path.join(ROOT, 'csrc')}",
           os.path.join(syntax_check.HERE, "inline_shaders.cpp"), "-o", exe]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"$ {' '.join(cmd)}\n{proc.stderr}"
    return exe


def _inline(inliner, path):
    return subprocess.run([inliner, str(path)], capture_output=True, text=True)


def test_inlined_shaders_are_one_complete_source(inliner):
    proc = _inline(inliner, SHADER)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert not re.search(r'^\s*#\s*include\s*"', text, flags=re.M), "a local include was left in"
    assert not re.search(r"^\s*#\s*pragma\s+once", text, flags=re.M)
    # The MSL 4 headers belong to attention_mpp.metal's library alone (tensor
    # ops): never part of the MSL 3.1 source. They are the ones it includes.
    mpp_source = open(os.path.join(os.path.dirname(SHADER), "attention_mpp.metal"), encoding="utf-8").read()
    msl4 = {os.path.basename(p) for p in re.findall(r'^\s*#\s*include\s*"([^"]+)"', mpp_source, flags=re.M)}
    assert {"attention_prefill_mpp.h", "attention_backward_mpp.h"} <= msl4, msl4
    # Every header, in every family folder of shaders/ (the #line markers name files by basename).
    headers = sorted(f for _, _, files in os.walk(os.path.dirname(SHADER)) for f in files if f.endswith(".h"))
    assert len(headers) == len(set(headers)), "two shader headers share a name"
    for h in headers:  # every other shader header reachable from attention.metal, each inlined exactly once
        assert text.count(f'#line 1 "{h}"\n') == (0 if h in msl4 else 1), h


def test_inlined_shaders_compile_in_the_emulator(inliner, tmp_path):
    # The installed copy is what library.mm reads (next to the _C extension).
    import flash_metal
    from metal_emulator import preprocessed
    from shader_builds import shipped_library

    installed = os.path.join(os.path.dirname(os.path.abspath(flash_metal.__file__)), "shaders", "attention.metal")
    assert os.path.exists(installed), "pip install . did not ship shaders/attention.metal"
    proc = _inline(inliner, installed)
    assert proc.returncode == 0, proc.stderr
    # Alone in an empty directory: nothing can be resolved from next to it.
    single = tmp_path / "attention.metal"
    single.write_text(proc.stdout, encoding="utf-8")
    # The same tokens as the shipped shaders after preprocessing: the same
    # program, so the emulator's build of the shipped shaders stands for it
    # (a second full build of the inlined file cost minutes of CI).
    assert preprocessed(str(single)) == preprocessed(SHADER)
    assert shipped_library().kernel_names()


def test_inliner_includes_each_file_once_and_keeps_line_numbers(inliner, clang, tmp_path):
    # A diamond: main includes b and c, both include d (which has #pragma once).
    (tmp_path / "d.h").write_text("#pragma once\nint d_value = 4;\n")
    (tmp_path / "b.h").write_text('#pragma once\n#include "d.h"\nint b_value = d_value;\n')
    (tmp_path / "c.h").write_text('#pragma once\n#include "d.h"\n\n#include <cstddef>\nstatic_assert(false, "c.h line 5");\n')
    (tmp_path / "main.cpp").write_text('#include "b.h"\n#include "c.h"\nint main() { return b_value; }\n')
    proc = _inline(inliner, tmp_path / "main.cpp")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("int d_value") == 1
    assert "#include <cstddef>" in proc.stdout  # system includes stay for the compiler
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "main.cpp").write_text(proc.stdout)
    diag = subprocess.run([clang, "-std=c++17", "-fsyntax-only", str(alone / "main.cpp")],
                          capture_output=True, text=True)
    # The one error is reported at c.h:5, as if the headers had been included.
    assert diag.returncode != 0 and "c.h:5:" in diag.stderr, diag.stderr


def test_inliner_resolves_parent_folders_and_includes_each_file_once(inliner, clang, tmp_path):
    # shaders/'s layout: a main file at the root includes family headers ("prefill/a.h"), which include
    # shared ones by a relative path ("../common/d.h"). Two spellings of one file are one file.
    for sub in ("prefill", "decode", "common"):
        (tmp_path / sub).mkdir()
    (tmp_path / "common" / "d.h").write_text("#pragma once\nint d_value = 4;\n")
    (tmp_path / "prefill" / "a.h").write_text('#pragma once\n#include "../common/d.h"\nint a_value = d_value;\n')
    (tmp_path / "decode" / "b.h").write_text('#pragma once\n#include "../prefill/a.h"\n#include "../common/./d.h"\n'
                                             'int b_value = a_value;\n')
    (tmp_path / "main.cpp").write_text('#include "prefill/a.h"\n#include "decode/b.h"\n#include "common/d.h"\n'
                                       'int main() { return b_value; }\n')
    proc = _inline(inliner, tmp_path / "main.cpp")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("int d_value") == 1 and proc.stdout.count("int a_value") == 1
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "main.cpp").write_text(proc.stdout)
    diag = subprocess.run([clang, "-std=c++17", "-fsyntax-only", str(alone / "main.cpp")], capture_output=True, text=True)
    assert diag.returncode == 0, diag.stderr


def test_inliner_names_a_missing_header(inliner, tmp_path):
    (tmp_path / "main.metal").write_text('#include "absent.h"\n')
    proc = _inline(inliner, tmp_path / "main.metal")
    assert proc.returncode == 1
    assert "absent.h" in proc.stderr and "included from" in proc.stderr and "main.metal" in proc.stderr


def test_shader_sources_dir_layout_matches_library_mm():
    # library.mm looks for these files next to the _C extension; setup.py
    # must install them there (flash_metal/flash_metal.metallib, its
    # fingerprint file, flash_metal/shaders/).
    code = open(os.path.join(MPS_DIR, "library.mm"), encoding="utf-8").read()
    assert '"flash_metal.metallib"' in code and '"shaders/attention.metal"' in code
    assert '"flash_metal.metallib.fnv1a64"' in code and '"shaders"' in code
    setup = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    assert '"flash_metal.metallib"' in setup and '"shaders"' in setup
    assert '"flash_metal.metallib.fnv1a64"' in setup


def test_source_fingerprint_matches_setup_py(inliner, tmp_path):
    # library.mm's fingerprint of the installed shaders (shader_source.h) must
    # equal the one setup.py writes beside the metallib, or every Mac would
    # warn and recompile; and it must change when any shader byte does.
    from test_build import load_setup

    setup = load_setup()
    shaders = os.path.join(ROOT, "shaders")
    proc = subprocess.run([inliner, "--hash", shaders], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == setup.shader_sources_hash(shaders)
    copy = tmp_path / "shaders"
    shutil.copytree(shaders, copy)  # the family subfolders too
    common = copy / "common" / "attention_common.h"
    common.write_bytes(common.read_bytes() + b" ")
    edited = subprocess.run([inliner, "--hash", str(copy)], capture_output=True, text=True).stdout.strip()
    assert edited == setup.shader_sources_hash(str(copy)) != proc.stdout.strip()
    # A file moved to another folder, its bytes unchanged, changes it too: the hash is over paths.
    os.rename(copy / "post" / "attention_tiled.h", copy / "prefill" / "attention_tiled.h")
    moved = subprocess.run([inliner, "--hash", str(copy)], capture_output=True, text=True).stdout.strip()
    assert moved == setup.shader_sources_hash(str(copy)) not in (edited, proc.stdout.strip())
    # Hidden folders and files and non-shader files (shaders/README.md) never count.
    (copy / ".cache").mkdir()
    (copy / ".cache" / "stale.h").write_text("// an editor's leftovers\n")
    (copy / "prefill" / "._attention_tiled.h").write_text("AppleDouble")
    (copy / "NOTES.md").write_text("notes\n")
    again = subprocess.run([inliner, "--hash", str(copy)], capture_output=True, text=True).stdout.strip()
    assert again == setup.shader_sources_hash(str(copy)) == moved
