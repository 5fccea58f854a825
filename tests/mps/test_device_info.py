"""torch.ops.flash_metal.metal_device_info: what the Metal device, the OS and the
shader library report, as JSON (the contract is at the schema, in
csrc/flash_metal.cpp). python -m flash_metal.selfcheck and the macOS CI log it.

- The installed build on Linux (no MPS backend) answers available=false with
  a reason, in a fresh process (the executed host below would replace it).
- The MPS implementation (csrc/mps/device_info.mm) runs on Linux through the
  executed host (tests/mps_exec): the fake device's answers, the macOS
  version, the GPU families each asked only on a macOS that knows them, the
  device found without PyTorch, no device at all, the pipelines built and
  the ones that fail, and where the shader library came from and why, one
  fresh process per library path.
- On a Mac with an MPS build, the real device is described (and printed, for
  the CI log).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import mps_exec
from mps_exec import checks
from mps_exec.plants import run_scenarios

ON_MAC_WITH_MPS = sys.platform == "darwin" and torch.backends.mps.is_built()
# Every key of the answer, in every case (schema 1).
KEYS = {"schema", "available", "reason", "mps_backend", "macos", "device", "library", "pipelines", "pipeline_errors",
        "tensor_ops"}
TENSOR_OPS_KEYS = {"usable", "reason", "forced_reason", "gpu_family"}
FAMILIES = {"Apple7", "Apple8", "Apple9", "Apple10", "Mac2", "Metal3", "Metal4"}
# What the fake device (tests/mps_exec/fake_metal.mm) is: an Apple8 GPU.
FAKE_NAME, FAKE_REGISTRY_ID = "flash_metal mps_exec fake device", 0x100000ABC


def _answer_of_a_fresh_process(statement):
    """The JSON a new Python process prints after importing flash_metal (never this worker's: it may hold the
    executed MPS host, whose kernel answers for a fake device)."""
    code = "import json, torch, flash_metal; " + statement
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(ON_MAC_WITH_MPS, reason="a build with the MPS backend describes its device (tested below)")
def test_build_without_mps_answers_unavailable():
    info = _answer_of_a_fresh_process("print(torch.ops.flash_metal.metal_device_info())")
    assert set(info) == KEYS
    assert info["schema"] == 1 and info["available"] is False and info["mps_backend"] is False
    assert "no MPS backend" in info["reason"]
    assert info["device"] is None and info["library"] is None and info["macos"] is None
    assert info["pipelines"] == [] and info["pipeline_errors"] == []
    t = info["tensor_ops"]
    assert set(t) == TENSOR_OPS_KEYS and t["usable"] is False and t["gpu_family"] is None
    assert "no MPS backend" in t["reason"] and "no MPS backend" in t["forced_reason"]


@pytest.mark.skipif(ON_MAC_WITH_MPS, reason="a build with the MPS backend describes its device (tested below)")
def test_python_wrapper_parses_the_answer():
    # flash_metal.device_info(): the op's JSON as a dict; bad arguments named.
    import flash_metal

    info = _answer_of_a_fresh_process("print(json.dumps(flash_metal.device_info()))")
    assert set(info) == KEYS and info["available"] is False
    assert info["tensor_ops"]["usable"] is False and "no MPS backend" in info["tensor_ops"]["reason"]
    with pytest.raises(TypeError, match="build_pipelines must be a bool"):
        flash_metal.device_info("yes")


# --- the MPS implementation, executed on Linux -------------------------------------------------------


from mps_exec.fixtures import built, emu, host  # noqa: F401  (pytest fixtures, by name)


def test_device_info_describes_the_device(host):
    # The installed build registers its available=false answer too; the MPS
    # kernel (CompositeExplicitAutograd) must be the one that runs.
    info = checks.device_info(host)
    assert set(info) - {"_recording"} == KEYS
    assert info["available"] is True and info["reason"] is None and info["mps_backend"] is True
    assert info["macos"] == {"version": "15.0.0", "major": 15, "minor": 0, "patch": 0}
    d = info["device"]
    assert d["name"] == FAKE_NAME and d["registry_id"] == FAKE_REGISTRY_ID and d["source"] == "torch"
    assert d["has_unified_memory"] is True and d["max_threadgroup_memory_length"] == 32768
    assert d["max_threads_per_threadgroup"] == [1024, 1024, 1024]
    # macOS 15: the macOS 26 families are not asked (null), the others answered.
    assert d["families"] == {"Apple7": True, "Apple8": True, "Apple9": False, "Apple10": None, "Mac2": True,
                             "Metal3": True, "Metal4": None}
    assert info["library"] == {"kind": "metallib", "path": os.path.join(host.package, mps_exec.METALLIB_NAME),
                               "reason": "", "origin": "the precompiled " + os.path.join(
                                   host.package, mps_exec.METALLIB_NAME), "error": None}
    calls = {e["op"] for e in info["_recording"]["events"]}
    assert not calls & {"MTLCreateSystemDefaultDevice", "MTLCopyAllDevices"}  # PyTorch's device was used
    # The fake's name plans as the base chip (M3, Apple 9): no tensor ops for Auto; forcing them needs
    # macOS 26.2 (scenarios of each reason: test_mps_exec_runtime.py, test_device_info_says_whether_tensor_ops_run).
    t = info["tensor_ops"]
    assert t["usable"] is False and t["gpu_family"] == 9 and t["reason"].startswith("an Apple 9 GPU")
    assert "macOS older than 26.2" in t["forced_reason"]


def test_families_are_asked_on_the_macos_that_knows_them(host):
    with checks.knobs(host, macos_version=2600):
        info = checks.device_info(host)
    assert info["macos"]["major"] == 26
    assert set(info["device"]["families"]) == FAMILIES
    assert all(v is not None for v in info["device"]["families"].values())
    assert info["device"]["families"]["Apple10"] is False and info["device"]["families"]["Metal4"] is False
    with checks.knobs(host, macos_version=1306):  # macOS 13.6: Apple9 (macOS 14) is not asked
        info = checks.device_info(host)
    assert info["device"]["families"]["Apple9"] is None and info["device"]["families"]["Apple8"] is True


def test_device_found_without_pytorch(host):
    with checks.knobs(host, torch_mps_device=0):
        info = checks.device_info(host)
    assert info["available"] and info["device"]["source"] == "MTLCopyAllDevices"
    assert info["device"]["name"] == FAKE_NAME
    assert "MTLCreateSystemDefaultDevice" not in {e["op"] for e in info["_recording"]["events"]}


def test_the_selfcheck_reads_the_executed_hosts_answer(host):
    # python -m flash_metal.selfcheck parses this op's JSON (flash_metal/selfcheck/backends.py):
    # the fake device's real answer, not a hand-written one.
    from flash_metal.selfcheck.backends import parse_device_info

    raw = checks.device_info(host)
    raw.pop("_recording")
    info = parse_device_info(json.dumps(raw))
    assert info["available"] is True and info["name"] == FAKE_NAME and info["macos"] == "15.0.0"
    assert info["families"] and set(info["families"]) <= FAMILIES
    assert info["library"]["runtime_compile"] is False and info["library"]["origin"]
    assert [p["name"] for p in info["pipelines"]] == [p["kernel"] for p in raw["pipelines"]]


def test_no_device_answers_unavailable(host):
    with checks.knobs(host, torch_mps_device=0, metal_devices=0):
        info = checks.device_info(host)
    assert set(info) - {"_recording"} == KEYS
    assert info["available"] is False and info["mps_backend"] is True and "no Metal device" in info["reason"]
    assert info["macos"]["major"] == 15 and info["device"] is None and info["library"] is None
    assert info["tensor_ops"]["usable"] is False and "no Metal device" in info["tensor_ops"]["reason"]


def test_pipelines_built_so_far(host):
    q, k, v = mps_exec_inputs()
    host.run(q, k, v, True, None, "tiled")  # builds (at least) this pipeline
    listed = checks.device_info(host)["pipelines"]
    names = [(p["kernel"], p["function_constants"]) for p in listed]
    assert names == sorted(names) and len(set(names)) == len(names)
    tiled = [p for p in listed if p["kernel"].startswith("flash_attention_tiled_float32_d32")]
    assert tiled and all(p["function_constants"] in ("0", "1") for p in tiled)
    for p in listed:  # the fake pipeline's answers (knob defaults)
        assert (p["max_total_threads_per_threadgroup"], p["thread_execution_width"],
                p["static_threadgroup_memory_length"]) == (1024, 32, 0), p
    # Building every pipeline runs in a process of its own (the "build_all" scenario below): here it
    # would fill the session host's cache, which test_mps_exec's caching test needs empty.


def mps_exec_inputs():
    from numerics import make_qkv

    return make_qkv(1, 2, 2, 17, 23, 32, torch.float32, generator=torch.Generator().manual_seed(9))


# Where the library came from, one fresh process per path (library.mm loads it once per process).
_LIBRARY_SCENARIOS = {
    "forced": ({"env": {"FLASH_METAL_RUNTIME_COMPILE": "1"}},
               {"kind": "runtime_compile", "reason": "FLASH_METAL_RUNTIME_COMPILE=1"}),
    "no_metallib": ({"metallib": "none"}, {"kind": "runtime_compile", "reason": "no metallib was installed"}),
    "stale": ({"metallib": "stale"},
              {"kind": "runtime_compile", "reason": "the metallib was stale: it was built from other shader sources"}),
    "unloadable": ({"metallib": "unloadable"},
                   {"kind": "runtime_compile", "reason": "the metallib did not load: fake Metal:"}),
}


@pytest.fixture(scope="session")
def library_scenarios(built, emu, tmp_path_factory):
    specs = {name: {"lib": built, "check": "library_reported", "args": args, **spec}
             for name, (spec, args) in _LIBRARY_SCENARIOS.items()}
    specs["nothing_installed"] = {"lib": built, "metallib": "none", "shaders": False, "check": "library_error_reported",
                                  "args": {"error": "shaders/attention.metal are missing"}}
    dropped = sorted(emu.kernel_names())[0]
    specs["build_all"] = {"lib": built, "check": "every_pipeline_built"}
    specs["kernel_missing"] = {"lib": built, "drop_kernel": dropped, "check": "pipeline_errors_reported",
                               "args": {"missing": dropped}}
    return run_scenarios(specs, lambda name: tmp_path_factory.mktemp(f"device_info_{name}"))


@pytest.mark.parametrize("name", [*_LIBRARY_SCENARIOS, "nothing_installed", "build_all", "kernel_missing"])
def test_device_info_reports_the_library_path_taken(library_scenarios, name):
    r = library_scenarios[name]
    assert r["stage"] is None, r["error"]


def test_library_check_bites():
    # The check the scenarios run is not vacuous: a run that compiled at run
    # time fails it when the metallib is expected, and a wrong reason fails.
    compiled = {"available": True, "library": {"kind": "runtime_compile", "path": "/p/shaders/attention.metal",
                                               "reason": "no metallib was installed", "origin": "o", "error": None}}
    checks.assert_library(compiled, "runtime_compile", "no metallib")
    with pytest.raises(AssertionError):
        checks.assert_library(compiled, "metallib")
    with pytest.raises(AssertionError):
        checks.assert_library(compiled, "runtime_compile", "stale")


# --- a real Mac -------------------------------------------------------------------------------------


@pytest.mark.skipif(not ON_MAC_WITH_MPS, reason="describes a real Metal device: macOS with an MPS-enabled torch")
def test_device_info_on_this_mac():
    info = json.loads(torch.ops.flash_metal.metal_device_info(True))
    print(json.dumps(info, indent=1))  # for the CI log
    assert set(info) == KEYS and info["mps_backend"] is True and info["macos"]["major"] >= 14
    if not info["available"]:
        pytest.skip(f"no Metal device: {info['reason']}")
    assert info["device"]["name"] and set(info["device"]["families"]) == FAMILIES
    assert info["library"]["error"] is None, info["library"]
    assert info["pipeline_errors"] == [], info["pipeline_errors"]
    if os.environ.get("FLASH_METAL_REQUIRE_METALLIB") == "1":
        assert info["library"]["kind"] == "metallib", info["library"]
    assert set(info["tensor_ops"]) == TENSOR_OPS_KEYS
    if os.environ.get("FLASH_METAL_REQUIRE_MPP_METALLIB") == "1":  # the macos-26 leg: an MSL 4 library was built
        assert "flash_metal_mpp.metallib" not in (info["tensor_ops"]["forced_reason"] or ""), info["tensor_ops"]
