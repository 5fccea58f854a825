"""The executed MPS host (tests/mps_exec) loading its shader library, one fresh process per path:
the shipped metallib, the run-time compile of the inlined sources (forced, on
macOS 14, with no metallib), stale, unloadable or missing libraries, a missing
kernel, a compiler that rejects the source, macOS 13 and a low thread limit;
then the planted host bugs (tests/mps_exec/plants.py), each in a process of
its own. Split from tests/mps/test_mps_exec.py, which runs the host in this process.

Needs what tests/mps/test_mps_exec.py needs (clang-19, libobjc-12-dev,
libblocksruntime-dev); skips locally without them, fails with CI=true.
"""
import os
import re
import subprocess

import pytest
import torch

import mps_exec
from mps_exec import checks
from numerics import make_qkv
from mps_exec.plants import PLANTS, noticed, planted, run_plants, run_scenarios

ROOT = mps_exec.ROOT

from mps_exec.fixtures import built, emu  # noqa: E402,F401  (pytest fixtures, by name)


def _run_scenarios(built, tmp_path_factory, specs):
    """Runs scenario.py once per spec, two at a time (each is a fresh process)."""
    specs = {name: {"lib": built, **spec} for name, spec in specs.items()}
    return run_scenarios(specs, lambda name: tmp_path_factory.mktemp(f"scenario_{name}"))


# A small problem that runs every path quickly: GQA, causal, an offset slice.
_CASE = {"B": 1, "Hq": 4, "Hkv": 2, "Nq": 40, "Nk": 33, "D": 24, "dtype": "float16", "layout": "offset_slice",
         "causal": True, "impl": "tiled"}


def _case_kernel():
    """The kernel the planner picks for _CASE (flash_metal.explain: the plan, no run)."""
    import flash_metal

    c = _CASE
    q, k, v = make_qkv(c["B"], c["Hq"], c["Hkv"], c["Nq"], c["Nk"], c["D"], getattr(torch, c["dtype"]))
    return flash_metal.explain(q, k, v, c["causal"], None, c["impl"]).kernel_name


SCENARIOS = {
    "metallib": {},
    "forced_runtime_compile": {"env": {"FLASH_METAL_RUNTIME_COMPILE": "1"}},
    "macos14_runtime_compile": {"env": {"FLASH_METAL_RUNTIME_COMPILE": "1"}, "knobs": {"macos_version": 1400}},
    "no_metallib": {"metallib": "none"},
    "stale_metallib": {"metallib": "stale"},
    "unloadable_metallib": {"metallib": "unloadable"},
    "kernel_missing": {"drop_kernel": "<the case's kernel>"},
    "nothing_installed": {"metallib": "none", "shaders": False},
    "compiler_rejects": {"metallib": "none", "runtime_compile": "fail:fake compiler: error: bad token"},
    "macos13": {"knobs": {"macos_version": 1306}},
    "thread_limit": {"knobs": {"max_threads_per_threadgroup": 16}},
}


@pytest.fixture(scope="session")
def scenarios(built, emu, tmp_path_factory):  # emu: its disk cache is warm before the processes start
    specs = {n: {"case": _CASE, **s} for n, s in SCENARIOS.items()}
    specs["kernel_missing"]["drop_kernel"] = _case_kernel()
    return _run_scenarios(built, tmp_path_factory, specs)


_ops = checks.recorded_ops


# --- the at::mps declarations cannot drift from PyTorch's ----------------------------------

@pytest.fixture(scope="session")
def clang():
    return mps_exec.require_toolchain()["clang"]


# --- loading the shader library: one fresh process per path ---------------------------------


def _assert_ran_and_matched(result):
    assert result["stage"] is None, result["error"]
    assert result["errors"] == []
    assert "dispatchThreadgroups" in _ops(result)


def test_metallib_path(scenarios):
    r = scenarios["metallib"]
    _assert_ran_and_matched(r)
    assert "newLibraryWithURL" in _ops(r) and "newLibraryWithSource" not in _ops(r)
    assert "Warning" not in r["stderr"]


def _compile_options(result):
    [options] = [e["options"] for e in result["events"] if e["op"] == "newLibraryWithSource"]
    return options


# MTLLanguageVersion3_1, MTLMathModeSafe, MTLMathFloatingPointFunctionsPrecise (Metal's enum values).
_METAL_3_1, _SAFE, _PRECISE = (3 << 16) + 1, 0, 1


def _inlined_shaders(clang, tmp_path):
    """What tests/mps_syntax/inline_shaders.cpp (shader_source.h's inliner) makes of the shaders."""
    exe = str(tmp_path / "inline_shaders")
    cmd = [clang, "-std=c++17", "-O1", f"-I{os.path.join(ROOT, 'csrc')}",
           os.path.join(ROOT, "tests", "mps_syntax", "inline_shaders.cpp"), "-o", exe]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([exe, mps_exec.SHADER], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_runtime_compile_path_hands_over_the_inlined_sources(scenarios, clang, tmp_path):
    r = scenarios["forced_runtime_compile"]
    _assert_ran_and_matched(r)  # the recorded source preprocessed to the shipped code, replayed against its build
    assert "newLibraryWithURL" not in _ops(r)
    with open(r["source_path"], encoding="utf-8") as f:
        source = f.read()
    assert source == _inlined_shaders(clang, tmp_path)
    assert _compile_options(r) == {"languageVersion": _METAL_3_1, "mathMode": _SAFE,
                                   "mathFloatingPointFunctions": _PRECISE}


def test_replay_reuses_the_shipped_build_only_for_the_same_code(clang, tmp_path):
    # scenario.py replays a recorded runtime-compile source against the
    # shipped library when both preprocess to the same text. The inlined
    # sources do; comments and blank lines do not matter; a changed token in
    # an inlined header (planted) does, and so does a dropped instantiation.
    from metal_emulator import preprocessed

    inlined = _inlined_shaders(clang, tmp_path)
    shipped = preprocessed(mps_exec.SHADER)

    def text_of(source, name):
        path = tmp_path / name / "attention.metal"
        path.parent.mkdir()
        path.write_text(source, encoding="utf-8")
        return preprocessed(str(path))

    assert text_of(inlined, "same") == shipped
    assert text_of("// a comment\n\n" + inlined.replace("\n", "\n\n", 3), "spaced") == shipped
    assert "constexpr int kDenseLoadBytes = 16;" in inlined
    assert text_of(inlined.replace("constexpr int kDenseLoadBytes = 16;", "constexpr int kDenseLoadBytes = 8;"),
                   "planted_token") != shipped
    assert "FM_DECODE_ALL_D(bfloat16, bfloat)\n" in inlined
    assert text_of(inlined.replace("FM_DECODE_ALL_D(bfloat16, bfloat)\n", "", 1), "planted_dropped") != shipped


def test_runtime_compile_on_macos14_disables_fast_math(scenarios):
    r = scenarios["macos14_runtime_compile"]
    _assert_ran_and_matched(r)
    assert _compile_options(r) == {"languageVersion": _METAL_3_1, "fastMathEnabled": 0}


def test_no_metallib_compiles_sources_quietly(scenarios):
    r = scenarios["no_metallib"]
    _assert_ran_and_matched(r)
    assert "newLibraryWithSource" in _ops(r) and "newLibraryWithURL" not in _ops(r)
    assert "Warning" not in r["stderr"]


@pytest.mark.parametrize("name,warning", [("stale_metallib", "stale"), ("unloadable_metallib", "cannot load")])
def test_bad_metallib_falls_back_with_a_warning(scenarios, name, warning):
    r = scenarios[name]
    _assert_ran_and_matched(r)
    assert "newLibraryWithSource" in _ops(r)
    assert "Warning: flash_metal: " in r["stderr"] and warning in r["stderr"]


@pytest.mark.parametrize("name,message", [
    ("kernel_missing", r"kernel 'flash_attention_tiled_\w+' is not in the precompiled .*flash_metal.metallib"),
    ("nothing_installed", r"shader sources .*shaders/attention.metal are missing"),
    ("compiler_rejects", r"Metal's runtime compiler rejected .*\n.*fake compiler: error: bad token"),
    ("macos13", r"need macOS 14"),
    ("thread_limit", r"needs 32 threads per threadgroup but its pipeline allows at most 16"),
])
def test_library_errors_are_clear(scenarios, name, message):
    r = scenarios[name]
    assert r["stage"] == "op" and re.search(message, r["error"]), r["error"]
    assert r["errors"] == [] and "dispatch_sync" not in _ops(r)


# --- planted bugs: the execution test must catch each -----------------------------------------

# The plants are in tests/mps_exec/plants.py. Each costs a compile; the suite
# runs these (all with FLASH_METAL_MPS_EXEC_ALL_PLANTS=1): two binding bugs, the
# stale encoder under profiling (issue 18, item 5) and grad_lse read with lse's
# strides (issue 23, item 3).
SUITE_PLANTS = list(PLANTS) if os.environ.get("FLASH_METAL_MPS_EXEC_ALL_PLANTS") == "1" else [
    "k_v_swapped", "offset_in_elements", "encoder_fetched_once", "grad_lse_with_lse_strides"]


@pytest.fixture(scope="session")
def plant_results(built, emu, tmp_path_factory):
    # Forward plants: transposed q (so q's strides differ from out's), offset-slice k and v.
    default = {"case": {**_CASE, "layout": "mixed"}}
    return run_plants(SUITE_PLANTS, default, lambda name: tmp_path_factory.mktemp(f"plant_{name}"))


@pytest.mark.parametrize("name", SUITE_PLANTS)
def test_planted_host_bug_is_caught(plant_results, name):
    r = plant_results[name]
    assert noticed(r), f"plant {name} went unnoticed: {r}"


def test_every_plant_still_applies():
    # A plant whose pattern no longer matches would test nothing: each must apply exactly once.
    for name in PLANTS:
        assert planted(name)