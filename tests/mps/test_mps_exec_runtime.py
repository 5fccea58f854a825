"""The executed MPS host (tests/mps_exec) under run-time conditions a Mac can meet:

- PyTorch's MPS profiler on (issue 18, item 5): endProfileKernel synchronizes
  the stream, which ends its shared encoder; every plan with more than one
  dispatch must fetch the encoder again for each (the fakes end the encoder
  and report any call on an ended one);
- no MTLCreateSystemDefaultDevice() (issue 18, item 6): nil in a
  non-interactive process on Apple silicon; PyTorch's device, else
  MTLCopyAllDevices();
- the backward's tensors in the layouts autograd hands over (issue 23,
  item 3): grad_out, out, lse and grad_lse expanded (stride 0), as one value
  (the gradient of .sum()), transposed and offset;
- a build with Xcode 15's SDK (issue 18, item 3), which lacks the macOS 15 API;
- macOS itself (issue 18, item 10): this Linux stand-in skips there, CI or not.

Planted bugs for each live in tests/mps_exec/plants.py; the suite runs two
of them in tests/mps/test_mps_exec_library.py, FLASH_METAL_MPS_EXEC_ALL_PLANTS=1 the rest
here too.
"""
import os

import pytest
import torch

import mps_exec
import prereqs
from mps_exec import checks
from mps_exec.plants import noticed, run_plants, run_scenarios
from numerics import make_qkv


from mps_exec.fixtures import built, emu, host  # noqa: F401  (pytest fixtures, by name)


# --- profiling ends the shared encoder ------------------------------------------------------------


def test_multi_dispatch_plans_survive_the_profiler(host, emu):
    checks.profiled_multi_dispatch(host, emu)


def test_fake_profiler_ends_the_encoder_only_when_profiling(host):
    # The fake's model of PyTorch: endProfileKernel synchronizes the stream
    # (ending its encoder) only with profiling on; the next fetch opens a new one.
    q, k, v = make_qkv(1, 2, 1, 9, 13, 32, torch.float16, generator=torch.Generator().manual_seed(1))
    rec, _ = host.run(q, k, v, False, None, "untiled")
    assert "stream.endKernelCoalescing" not in [e["op"] for e in rec["events"]]
    with checks.profiling(host):
        first, _ = host.run(q, k, v, False, None, "untiled")
        second, _ = host.run(q, k, v, False, None, "untiled")
    for rec in (first, second):
        assert rec["errors"] == []
        assert [e["op"] for e in rec["events"]].count("stream.endKernelCoalescing") == 1
    encoder_of = lambda rec: {e["encoder"] for e in rec["events"] if e["op"] == "dispatchThreadgroups"}  # noqa: E731
    assert encoder_of(first) != encoder_of(second)  # the second call got a new encoder


# --- finding the device ---------------------------------------------------------------------------


def test_pipelines_build_without_the_system_default_device(host, emu):
    checks.builds_all_pipelines(host, emu)


def test_no_metal_device_is_a_clear_error(host):
    with checks.knobs(host, torch_mps_device=0, metal_devices=0):
        with pytest.raises(RuntimeError, match="this machine has no Metal device"):
            torch.ops.flash_metal.metal_build_all_pipelines()
    assert host.take_recording()["errors"] == []


# --- the backward's tensors in autograd's layouts -------------------------------------------------


@pytest.mark.parametrize("tensor,layout", [(t, lay) for t, lays in checks.BACKWARD_LAYOUTS.items() for lay in lays])
def test_backward_binds_each_tensor_with_its_own_strides(host, emu, tensor, layout):
    checks.backward_layout(host, emu, tensor, layout)


def test_backward_layouts_differ_from_the_packed_strides():
    # Each layout must give the tensor strides unlike a packed tensor's (and so
    # unlike the other tensors'), or binding it with another's strides could pass.
    q, k, v, packed = checks.backward_inputs()
    for tensor, layouts in checks.BACKWARD_LAYOUTS.items():
        for layout in layouts:
            view = checks.in_layout(packed[tensor], layout)
            assert view.stride() != packed[tensor].stride(), (tensor, layout)
            if layout != "sum":
                assert torch.equal(view.nan_to_num(), packed[tensor].nan_to_num()), (tensor, layout)


# --- Xcode 15's SDK -------------------------------------------------------------------------------

_CASE = {"B": 1, "Hq": 4, "Hkv": 2, "Nq": 40, "Nk": 33, "D": 24, "dtype": "float16", "layout": "offset_slice",
         "causal": True, "impl": "tiled"}
# MTLLanguageVersion3_1, MTLMathModeSafe, MTLMathFloatingPointFunctionsPrecise (Metal's enum values).
_METAL_3_1, _SAFE, _PRECISE = (3 << 16) + 1, 0, 1


@pytest.fixture(scope="session")
def sdk14_scenarios(built, emu, tmp_path_factory):
    lib = mps_exec.build(sdk=mps_exec.SDK_VIEWS["sdk14"])
    force = {"FLASH_METAL_RUNTIME_COMPILE": "1"}
    specs = {
        "macos15": {"lib": lib, "case": _CASE, "env": force},
        "macos14": {"lib": lib, "case": _CASE, "env": force, "knobs": {"macos_version": 1400}},
        "metallib": {"lib": lib, "check": "library_reported", "args": {"kind": "metallib"}},
    }
    return run_scenarios(specs, lambda name: tmp_path_factory.mktemp(f"sdk14_{name}"))


@pytest.mark.parametrize("macos,options", [
    ("macos15", {"languageVersion": _METAL_3_1, "mathMode": _SAFE, "mathFloatingPointFunctions": _PRECISE}),
    ("macos14", {"languageVersion": _METAL_3_1, "fastMathEnabled": 0}),
])
def test_sdk14_build_still_asks_for_safe_math(sdk14_scenarios, macos, options):
    # Built against the macOS 14 SDK view, library.mm's own declarations of
    # the macOS 15 API keep the same compile options as the newest SDK's build.
    r = sdk14_scenarios[macos]
    assert r["stage"] is None, r["error"]
    assert r["errors"] == []
    [compiled] = [e["options"] for e in r["events"] if e["op"] == "newLibraryWithSource"]
    assert compiled == options


def test_sdk14_build_runs_the_metallib_path(sdk14_scenarios):
    r = sdk14_scenarios["metallib"]
    assert r["stage"] is None, r["error"]


# --- The MSL 4 library (issue 21): loaded beside the metallib, tensor-op pipelines taken from it ---
_MPP_CASE = {"B": 1, "Hq": 4, "Hkv": 2, "Nq": 70, "Nk": 90, "D": 64, "dtype": "float16", "layout": "contiguous",
             "causal": True, "impl": "tensor_ops", "seed": 21}
_MACOS_26_2 = {"macos_version": 2602}


@pytest.fixture(scope="session")
def mpp_scenarios(built, emu, tmp_path_factory):
    specs = {
        "fresh": {"lib": built, "case": _MPP_CASE, "knobs": _MACOS_26_2, "mpp_metallib": "fresh"},
        "none": {"lib": built, "case": _MPP_CASE, "knobs": _MACOS_26_2},
        "stale": {"lib": built, "case": _MPP_CASE, "knobs": _MACOS_26_2, "mpp_metallib": "stale"},
        "macos26_1": {"lib": built, "case": _MPP_CASE, "knobs": {"macos_version": 2601}, "mpp_metallib": "fresh"},
        "backward": {"lib": built, "knobs": _MACOS_26_2, "mpp_metallib": "fresh", "check": "tensor_ops_backward"},
        # D = 256: the split-D kernel (attention_prefill_mpp_dsplit.h), replayed in its own partial build.
        "dsplit": {"lib": built, "case": {**_MPP_CASE, "Nq": 40, "Nk": 45, "D": 256, "dtype": "bfloat16"},
                   "knobs": _MACOS_26_2, "mpp_metallib": "fresh"},
        # Its 64-row variant (Q in registers, 256 threads), forced by the routing's switch.
        "dsplit64": {"lib": built, "case": {**_MPP_CASE, "Nq": 70, "Nk": 45, "D": 256}, "knobs": _MACOS_26_2,
                     "mpp_metallib": "fresh", "env": {"FLASH_METAL_TENSOR_OPS_DSPLIT_ROWS": "64"}},
    }
    # metal_device_info's "tensor_ops" against Auto's choice (checks.tensor_ops_reported), one process
    # per library state (library.mm loads the MSL 4 library once per process).
    for name, (state, expected) in _TENSOR_OPS_REPORTS.items():
        specs[name] = {"lib": built, "mpp_metallib": state, "check": "tensor_ops_reported",
                       "args": {"expected": expected}}
    return run_scenarios(specs, lambda name: tmp_path_factory.mktemp(f"mpp_{name}"))


_M5, _DISABLE = {"device_generation": 5}, {"FLASH_METAL_DISABLE_TENSOR_OPS": "1"}
_LIBRARY_STALE = "flash_metal_mpp.metallib: it was built from other shader sources"
_NO_LIBRARY = "no MSL 4 library (flash_metal_mpp.metallib) was installed"
_OLD_MACOS = "this Mac runs a macOS older than 26.2"
# Scenario -> (the MSL 4 library's state, [what metal_device_info must say under knobs and env]). The MPS
# host takes the GPU's family from its name once per process (attention_mps.mm, gpu_spec_of), so every entry
# of a scenario names the same device; the fake's own name (the base chip, M3: Apple 9) is
# test_device_info.py's case.
_TENSOR_OPS_REPORTS = {
    "report_fresh": ("fresh", [
        {"knobs": {**_MACOS_26_2, **_M5}, "usable": True, "forced_reason": None, "family": 10},
        {"knobs": {**_MACOS_26_2, **_M5}, "env": _DISABLE, "usable": False,
         "reason": "FLASH_METAL_DISABLE_TENSOR_OPS=1 turns them off", "forced_reason": None, "family": 10},
    ]),
    # The library's other states (none, and a macOS older than 26.2) give their sentences through the same
    # call (tensor_ops_library_problem): the forced-path scenarios above check those sentences, and the
    # session host's answer (macOS 15) test_tensor_ops_report_check_bites; one process each would cost CI time.
    "report_stale": ("stale", [{"knobs": {**_MACOS_26_2, **_M5}, "usable": False, "reason": _LIBRARY_STALE,
                                "forced_reason": _LIBRARY_STALE, "family": 10}]),
}


@pytest.mark.parametrize("name", list(_TENSOR_OPS_REPORTS))
def test_device_info_says_whether_tensor_ops_run(mpp_scenarios, name):
    # The device's family, the switch, the macOS and the MSL 4 library, each
    # reported as the reason, and Auto picking the tensor-op kernel exactly
    # when metal_device_info says usable (the same rule, tensor_ops_problem).
    r = mpp_scenarios[name]
    assert r["stage"] is None, r["error"]
    assert len(r["value"]) == len(_TENSOR_OPS_REPORTS[name][1])


def test_tensor_ops_report_check_bites(host):
    # The check is not vacuous: on the session host (the fake's own name, planned as an Apple 9 GPU; macOS
    # 15, no MSL 4 library) Auto does not run the tensor-op kernels and forcing them needs macOS 26.2, so
    # claiming otherwise fails, as does a wrong reason or family. (No device_generation knob here: the
    # host keeps the first name it sees for the whole process, which other tests share.)
    from mps_exec import checks

    right = {"usable": False, "reason": "an Apple 9 GPU", "forced_reason": _OLD_MACOS, "family": 9}
    [answer] = checks.tensor_ops_reported(host, None, [right])
    assert _OLD_MACOS in answer["forced_reason"]
    for wrong in ({"usable": True}, {"reason": _NO_LIBRARY}, {"family": 10}, {"forced_reason": None}):
        with pytest.raises(AssertionError):
            checks.tensor_ops_reported(host, None, [{**right, **wrong}])


def test_tensor_op_pipelines_come_from_the_msl4_library(mpp_scenarios):
    # macOS 26.2 and a fresh flash_metal_mpp.metallib: the forced tensor-op
    # kernel's pipeline is looked up there (the main library has no such
    # kernel), bound as planned, replayed in the emulator's MSL 4 build and
    # checked against float64.
    r = mpp_scenarios["fresh"]
    assert r["stage"] is None, r["error"]
    assert r["errors"] == []
    loaded = [os.path.basename(e["path"]) for e in r["events"] if e["op"] == "newLibraryWithURL"]
    assert "flash_metal_mpp.metallib" in loaded
    kernels = [e["kernel"] for e in r["events"] if e["op"] == "setComputePipelineState"]
    assert kernels == ["flash_attention_prefill_mpp_float16_d64_bq64_bk32"]


def test_split_d_tensor_op_pipeline_is_bound_as_planned(mpp_scenarios):
    # D = 256, forced: the .mm takes the split-D kernel from the MSL 4 library, sets the threadgroup memory the
    # plan sized (csrc/metal/plan_detail.h, tensor_ops_dsplit_threadgroup_bytes) and dispatches 4 SIMD-groups
    # per 32 query rows; replayed in the emulator and checked against float64.
    r = mpp_scenarios["dsplit"]
    assert r["stage"] is None, r["error"]
    assert r["errors"] == []
    kernels = [e["kernel"] for e in r["events"] if e["op"] == "setComputePipelineState"]
    assert kernels == ["flash_attention_prefill_mpp_dsplit_bfloat16_d256_bq32_bk32_wn2"]
    assert [e["length"] for e in r["events"] if e["op"] == "setThreadgroupMemoryLength"] == [28928]
    [dispatch] = [e for e in r["events"] if e["op"] == "dispatchThreadgroups"]
    assert list(dispatch["grid"]) == [2, 4, 1] and list(dispatch["threadgroup"]) == [128, 1, 1]


def test_split_d_64_row_pipeline_is_bound_as_planned(mpp_scenarios):
    # The 64-row split-D kernel through the executed host: from the MSL 4 library, its 20,992 bytes of
    # threadgroup memory (tensor_ops_dsplit_wide_threadgroup_bytes), 8 SIMD-groups per 64 query rows (Nq = 70:
    # two threadgroups, the second ragged); replayed in the emulator and checked against float64.
    r = mpp_scenarios["dsplit64"]
    assert r["stage"] is None, r["error"]
    assert r["errors"] == []
    kernels = [e["kernel"] for e in r["events"] if e["op"] == "setComputePipelineState"]
    assert kernels == ["flash_attention_prefill_mpp_dsplit_float16_d256_bq64_bk16_wn2"]
    assert [e["length"] for e in r["events"] if e["op"] == "setThreadgroupMemoryLength"] == [20992]
    [dispatch] = [e for e in r["events"] if e["op"] == "dispatchThreadgroups"]
    assert list(dispatch["grid"]) == [2, 4, 1] and list(dispatch["threadgroup"]) == [256, 1, 1]


def test_tensor_op_backward_pipelines_come_from_the_msl4_library(mpp_scenarios):
    # The forced tensor-op backward through the executed host: the dQ kernel, then the dK/dV kernel, both
    # from the MSL 4 library, replayed and checked against float64 (checks.tensor_ops_backward); then with a
    # window, softcap and sinks: the same two, then flash_sinks_grad from the MSL 3.1 library; then at D = 256
    # the split-D pair (attention_backward_mpp_dsplit.h), its threadgroup memory as planned; then the MLA
    # pair's forward and backward.
    r = mpp_scenarios["backward"]
    assert r["stage"] is None, r["error"]
    # Then the MLA pair (q/k 192, v 128): its forward, dQ and dK/dV kernels from the MSL 4 library.
    pair = ["flash_backward_mpp_dq_float16_d64_bq64_bk32", "flash_backward_mpp_dkdv_float16_d64_bk64_bq32"]
    dsplit = ["flash_backward_mpp_dsplit_dq_bfloat16_d256_bq16_bk32_wn2",
              "flash_backward_mpp_dsplit_dkdv_bfloat16_d256_bk32_bq16_wn2"]
    mla = ["flash_attention_prefill_mpp_float16_dqk192_dv128_bq64_bk32",
           "flash_backward_mpp_dq_float16_dqk192_dv128_bq32_bk32",
           "flash_backward_mpp_dkdv_float16_dqk192_dv128_bk64_bq32"]
    assert r["value"] == pair + pair + ["flash_sinks_grad"] + dsplit + mla


@pytest.mark.parametrize("name,words", [
    ("none", "no MSL 4 library (flash_metal_mpp.metallib) was installed"),
    ("stale", "flash_metal_mpp.metallib: it was built from other shader sources"),
    ("macos26_1", "this Mac runs a macOS older than 26.2"),
])
def test_without_a_usable_msl4_library_tensor_ops_say_why(mpp_scenarios, name, words):
    r = mpp_scenarios[name]
    assert r["stage"] == "op" and "impl='tensor_ops' cannot run in this process" in r["error"], r["error"]
    assert words in r["error"]
    assert not [e for e in r["events"] if e["op"] == "setComputePipelineState"]


# --- macOS: the Linux stand-in skips, CI or not ---------------------------------------------------


def test_harness_skips_on_macos_even_in_ci(monkeypatch):
    monkeypatch.setattr(prereqs, "IN_CI", True)
    monkeypatch.setattr("sys.platform", "darwin")
    with pytest.raises(pytest.skip.Exception, match="macOS: tests/mps_exec is a Linux stand-in"):
        mps_exec.require_toolchain()


def test_without_the_macos_check_ci_would_fail_on_a_mac(monkeypatch):
    # Planted: the platform check removed. On a Mac the toolchain lookup then
    # finds no GCC libobjc, and CI=true turns that into a failure before any
    # Metal test runs: the bug issue 18 (item 10) describes.
    monkeypatch.setattr(prereqs, "IN_CI", True)
    monkeypatch.setattr("sys.platform", "darwin")
    monkeypatch.setattr(mps_exec._build, "check_platform", lambda platform=None: None)

    def no_gcc_objc():
        raise mps_exec.ToolchainMissing("missing libobjc-12-dev (GCC's libobjc.so)")

    monkeypatch.setattr(mps_exec._build, "_toolchain", no_gcc_objc)
    with pytest.raises(pytest.fail.Exception, match="missing libobjc"):
        mps_exec.require_toolchain()


def test_syntax_check_skips_on_macos_even_in_ci(monkeypatch):
    from test_mps_host import skip_on_macos

    monkeypatch.setattr(prereqs, "IN_CI", True)
    with pytest.raises(pytest.skip.Exception, match="macOS: tests/mps_syntax's stubs"):
        skip_on_macos("darwin")
    skip_on_macos("linux")  # no skip on Linux


# --- planted bugs (all: FLASH_METAL_MPS_EXEC_ALL_PLANTS=1) ----------------------------------------

EXTRA_PLANTS = ["system_default_device", "grad_out_with_out_strides", "out_with_grad_out_strides"]


@pytest.mark.skipif(os.environ.get("FLASH_METAL_MPS_EXEC_ALL_PLANTS") != "1",
                    reason="one .mm compile per plant: FLASH_METAL_MPS_EXEC_ALL_PLANTS=1 runs them")
@pytest.mark.parametrize("name", EXTRA_PLANTS)
def test_extra_planted_bug_is_caught(built, emu, tmp_path_factory, name):
    r = run_plants([name], {}, lambda n: tmp_path_factory.mktemp(f"plant_{n}"))[name]
    assert noticed(r), f"plant {name} went unnoticed: {r}"


def test_replay_refuses_an_ended_encoder():
    # The replay's own rule, on a hand-made recording: a call on an ended encoder
    # is what Metal would abort on, so it never runs.
    rec = {"events": [{"op": "setComputePipelineState", "encoder": 1, "ended": True, "kernel": "k", "constants": {}}]}
    with pytest.raises(mps_exec.ReplayError, match="after it ended"):
        mps_exec.replay(rec, None)
