"""python -m flash_metal.selfcheck: the command a first Mac user (or the macOS CI) runs.

On Linux it runs with --backend metal-emu: the same lane probe, sweep and
report, through the Metal emulator. These tests run it as a user would (a
subprocess from the repository root), read both reports, and plant failures
(a wrong output from one kernel, a lane layout that is not the assumed one,
a pipeline below the planner's N) to show each one turns the exit status
nonzero and is named in the report. The MPS backend's calls into the ops are
exercised on CPU tensors (its device copies replaced by identity), and its
refusal on a machine without MPS is checked to be a message, not a traceback.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import flash_metal
from flash_metal import testing
from flash_metal.selfcheck import backends as sb
from flash_metal.selfcheck import cli
from flash_metal.selfcheck import lanes
from flash_metal.selfcheck import report as report_mod
from flash_metal.selfcheck import sweep
from prereqs import unavailable
from repo_paths import ROOT_DIR as ROOT

FAMILIES = {"prefill", "decode", "decode_split", "untiled", "tiled", "varlen", "backward", "varlen_backward"}
# The kernels each family must have launched, in order (host-name prefixes; csrc/metal/launch.cpp).
KERNELS = {"prefill": ["flash_attention_prefill_"], "varlen": ["flash_attention_prefill_"],
           "decode": ["flash_decode_"], "decode_split": ["flash_decode_split_", "flash_decode_merge_"],
           "untiled": ["flash_attention_untiled_"], "tiled": ["flash_attention_tiled_"],
           "backward": ["flash_backward_dq_", "flash_backward_dkdv_"],
           "varlen_backward": ["flash_backward_dq_", "flash_backward_dkdv_"]}
MPS_AVAILABLE = hasattr(torch.backends, "mps") and torch.backends.mps.is_available()


def _need_emulator():
    from metal_emulator import BuildError, find_clang

    try:
        find_clang()
    except BuildError as err:
        unavailable(str(err))


def _selfcheck(*args, cwd=ROOT, timeout=1500):
    return subprocess.run([sys.executable, "-m", "flash_metal.selfcheck", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def emu_run(tmp_path_factory):
    """The quick sweep through the emulator, run as a user runs it: (process, report JSON, report Markdown)."""
    _need_emulator()
    out = tmp_path_factory.mktemp("selfcheck")
    proc = _selfcheck("--backend", "metal-emu", "--quick", "--out", str(out))
    md, js = out / "selfcheck.md", out / "selfcheck.json"
    data = json.loads(js.read_text()) if js.exists() else None
    return proc, data, md.read_text() if md.exists() else None


def test_metal_emu_quick_passes_and_writes_both_reports(emu_run):
    proc, data, md = emu_run
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert data is not None and md is not None
    assert "Traceback" not in proc.stderr
    assert "PASSED" in proc.stdout and "selfcheck.md" in proc.stdout
    # The progress bar: lines on stderr (not a terminal here), ending at total/total.
    bars = [ln for ln in proc.stderr.splitlines() if ln.startswith("selfcheck [")]
    assert len(bars) >= 3
    done, total = bars[-1].split("]")[1].split()[0].split("/")
    assert done == total and int(total) == 3 + data["summary"]["checks"] + len(data["timing"]["rows"]) + len(
        data["accelerator"]["checks"])


def test_metal_emu_report_every_check_passed_on_every_family(emu_run):
    _, data, _ = emu_run
    assert data["status"] == "passed" and data["passed"] is True and data["backend"] == "metal-emu"
    s = data["summary"]
    assert s["failures"] == [] and s["failed"] == s["errors"] == s["pipelines_failed"] == 0
    checks = data["checks"]
    assert s["checks"] == s["passed"] == len(checks) > 0
    assert data["lane_probe"]["status"] == "passed" and "emulator" in data["lane_probe"]["runner"].lower()
    assert data["poisons_outputs"] is True
    # Coverage: every family in every dtype, a zero-padded head dim, every option.
    assert {c["family"] for c in checks} == FAMILIES
    for fam in FAMILIES:
        assert {c["dtype"] for c in checks if c["family"] == fam} == {"float32", "float16", "bfloat16"}, fam
    assert {c["family"] for c in checks if c["head_dim"] == sweep.PADDED_D} >= {"prefill", "decode", "tiled",
                                                                                "backward"}
    options = " ".join(c["options"] for c in checks)
    for opt in ("causal", "GQA", "MQA", "bool mask", "additive mask", "window", "softcap", "varlen", "grad_lse"):
        assert opt in options, opt
    launched = set()
    for c in checks:
        assert c["status"] == "passed", c
        measured = [x for x in c["comparisons"] if x["error"] is not None]
        assert measured and all(x["ok"] and x["error"] <= x["tolerance"] for x in measured), c["id"]
        assert 0 <= c["worst_ratio"] <= 1
        # The kernels that ran are the family's, in its dtype, in the bucket holding D (48 runs in 64).
        prefixes = KERNELS[c["family"]]
        assert len(c["kernels"]) == len(prefixes), c
        bucket = 64 if c["head_dim"] == sweep.PADDED_D else c["head_dim"]
        for name, prefix in zip(c["kernels"], prefixes):
            assert name.startswith(prefix + c["dtype"] + f"_d{bucket}"), (c["id"], name)
        launched.update(c["kernels"])
    # Every launched kernel appears in the pipelines table, with the threadgroup the sweep launched.
    rows = {r["name"]: r for r in data["pipelines"]["rows"]}
    assert data["pipelines"]["available"] and set(rows) == launched
    assert all(r["largest_launched"] >= 32 and r["status"] != "failed" for r in rows.values())
    # Timing: measured, labelled as this machine's CPU (no Metal timing on the emulator).
    assert data["timing"]["device"] == "cpu" and "CPU" in data["timing"]["note"]
    assert data["timing"]["rows"] and all(r["flash_metal_ms"] > 0 and r["sdpa_ms"] > 0 for r in data["timing"]["rows"])
    assert data["platform"]["torch"] == torch.__version__ and data["platform"]["flash_metal"] == flash_metal.__version__


def test_metal_emu_markdown_has_every_section(emu_run):
    _, data, md = emu_run
    assert md.startswith("# flash_metal selfcheck: PASSED")
    for heading in ("## Platform", "## Where the kernels came from", "## Lane-layout probe (run first)",
                    "## Pipelines: thread limits against the planner's N", "## Correctness", "## Timing"):
        assert heading in md, heading
    # The probe's section comes before any result it vouches for.
    assert md.index("## Lane-layout probe") < md.index("## Correctness")
    for fam in FAMILIES:
        assert f"| {fam} | " in md, fam
    assert all(c["id"] in md for c in data["checks"])  # the per-check list fits here
    assert len(md) < report_mod.MAX_MARKDOWN + 5000


def test_metal_emu_accelerator_section_runs_in_emulation(emu_run):
    # The tensor-op section (issue 21) runs in the emulator: impl='tensor_ops' and the simdgroup prefill on the
    # same inputs, each by the 2x rule; every dtype, head dim and causal value once; no timing. The backward
    # cases: impl='tensor_ops' and the simdgroup backward (auto with the switch on), both kernels each.
    _, data, md = emu_run
    a = data["accelerator"]
    assert a["status"] == "passed" and a["usable"] is True and a["emulated"] is True
    backward = [c for c in a["checks"] if c["id"].startswith("tensor_ops_backward-")]
    checks = [c for c in a["checks"] if c not in backward]
    assert {c["dtype"] for c in checks} == {"float16", "bfloat16"} and {c["head_dim"] for c in checks} == {64, 96, 128,
                                                                                                        256}
    assert {c["causal"] for c in checks} == {True, False}
    assert {c["dtype"] for c in backward} == {"float16", "bfloat16"} and {c["causal"] for c in backward} == {True, False}
    assert any("-bool-mask-window40-softcap4-" in c["id"] for c in backward)  # the options case, forced too
    for c in backward:
        assert c["status"] == "passed", c
        tops, simd = c["tensor_ops"], c["simdgroup"]
        assert [k.rsplit("_d", 1)[0] for k in tops["kernels"]] == [
            f"flash_backward_mpp_dq_{c['dtype']}", f"flash_backward_mpp_dkdv_{c['dtype']}"], c
        assert [k.split("_")[2] for k in simd["kernels"]] == ["dq", "dkdv"], c  # flash_backward_dq_..., not _mpp_
        assert 0 <= tops["worst_ratio"] <= 1 and 0 <= simd["worst_ratio"] <= 1 and 0 < c["max_difference"] < 0.1
    for c in checks:
        assert c["status"] == "passed", c
        tops, simd = c["tensor_ops"], c["simdgroup"]
        want = (f"flash_attention_prefill_mpp_dsplit_{c['dtype']}_d256_bq32_bk32_wn2" if c["head_dim"] == 256
                else f"flash_attention_prefill_mpp_{c['dtype']}_d{c['head_dim']}_bq64_bk32")  # 256: split along D
        assert tops["kernels"] == [want], c
        assert len(simd["kernels"]) == 1 and simd["kernels"][0].startswith(
            f"flash_attention_prefill_{c['dtype']}_d{c['head_dim']}_"), c
        assert 0 <= tops["worst_ratio"] <= 1 and 0 <= simd["worst_ratio"] <= 1
        assert 0 < c["max_difference"] < 0.1  # two different kernels, both close to float64
    assert a["timing"]["rows"] == [] and "emulator" in a["timing"]["note"]
    assert "## Accelerator: Metal 4 tensor ops" in md and all(c["id"] in md for c in a["checks"])
    section = md.split("## Accelerator")[1].split("\n\n")
    table = next(part for part in section if part.startswith("| check")).splitlines()
    assert len(table) == 2 + len(a["checks"]) and len({ln.count("|") for ln in table}) == 1  # a well-formed table


# ---- planted failures -----------------------------------------------------------------------


def _run_in_process(tmp_path, *args):
    rc = cli.main(["--backend", "metal-emu", "--quick", "--source", ROOT, "--out", str(tmp_path), "--no-progress",
                         *args])
    data = json.loads((tmp_path / "selfcheck.json").read_text())
    return rc, data, (tmp_path / "selfcheck.md").read_text()


def test_planted_wrong_output_fails_and_is_named(tmp_path, monkeypatch):
    _need_emulator()
    import backends

    # Without the plant, these checks pass (so the failure below is the plant's).
    rc, data, _ = _run_in_process(tmp_path / "clean", "--only", "prefill-float16")
    assert rc == 0 and len(data["checks"]) == 6

    # The plant: the float16 prefill kernel gets one element wrong, by 0.05.
    original = backends._run_plan

    def planted(plan, tensors, *a, **kw):
        original(plan, tensors, *a, **kw)
        if plan.dispatches[0].kernel_name.startswith("flash_attention_prefill_float16"):
            tensors["out"].view(-1)[-1] += 0.05  # the last element (out is packed: 4-D, or varlen 3-D)

    monkeypatch.setattr(backends, "_run_plan", planted)
    rc, data, md = _run_in_process(tmp_path / "planted", "--only", "float16")
    assert rc == 1 and data["status"] == "failed" and data["passed"] is False
    failed = {c["id"] for c in data["checks"] if c["status"] != "passed"}
    expected = {c["id"] for c in data["checks"] if c["kernels"] and c["kernels"][0].startswith(
        "flash_attention_prefill_float16")}
    assert failed == expected and {c.split("-")[0] for c in failed} == {"prefill", "varlen"}
    for c in data["checks"]:
        if c["id"] in failed:
            assert "out: max error" in c["message"], c
    assert md.startswith("# flash_metal selfcheck: FAILED")
    assert all(cid in md.split("## Platform")[0] for cid in failed)  # named in the summary at the top
    assert "**FAIL**" in md


def test_planted_wrong_tensor_op_output_fails_the_accelerator_section(tmp_path, monkeypatch):
    _need_emulator()
    import backends

    only = ("--accelerator-only", "--only", "tensor_ops-float16-d64")
    rc, data, _ = _run_in_process(tmp_path / "clean", *only)
    assert rc == 0 and data["checks"] == [] and [c["status"] for c in data["accelerator"]["checks"]] == ["passed"]
    assert data["build_all"]["status"] == "skipped"
    original = backends._run_plan

    def planted(plan, tensors, *a, **kw):  # the MPP kernel gets one element wrong, by 0.05
        original(plan, tensors, *a, **kw)
        if plan.dispatches[0].kernel_name.startswith("flash_attention_prefill_mpp_"):
            tensors["out"].view(-1)[-1] += 0.05

    monkeypatch.setattr(backends, "_run_plan", planted)
    rc, data, md = _run_in_process(tmp_path / "planted", *only)
    [c] = data["accelerator"]["checks"]
    assert rc == 1 and data["accelerator"]["status"] == "failed" and c["status"] == "failed"
    assert c["tensor_ops"]["status"] == "failed" and c["simdgroup"]["status"] == "passed"
    assert "out: max error" in c["tensor_ops"]["message"]
    assert any(f.startswith(f"accelerator {c['id']}") for f in data["summary"]["failures"])
    assert md.startswith("# flash_metal selfcheck: FAILED")


def test_planted_wrong_tensor_op_gradient_fails_the_accelerator_section(tmp_path, monkeypatch):
    # The backward cases bite too: the tensor-op dQ kernel's last grad_q element off by 0.05 fails the
    # tensor_ops side of the case (the simdgroup backward's side still passes).
    _need_emulator()
    import backends

    only = ("--accelerator-only", "--only", "tensor_ops_backward-float16-d64")
    original = backends._run_plan

    def planted(plan, tensors, *a, **kw):
        original(plan, tensors, *a, **kw)
        if plan.dispatches[0].kernel_name.startswith("flash_backward_mpp_dq_"):
            tensors["grad_q"].view(-1)[-1] += 0.05

    monkeypatch.setattr(backends, "_run_plan", planted)
    rc, data, md = _run_in_process(tmp_path / "planted", *only)
    [c] = data["accelerator"]["checks"]
    assert rc == 1 and data["accelerator"]["status"] == "failed" and c["status"] == "failed"
    assert c["tensor_ops"]["status"] == "failed" and c["simdgroup"]["status"] == "passed"
    assert "max error" in c["tensor_ops"]["message"]


class _NoAccelerator:
    """An MPS backend stand-in whose device reports the tensor-op kernels unusable (metal_device_info's answer)."""

    name = "mps"

    def __init__(self, reason, forced_reason):
        self.info = sb.parse_device_info(_schema1(tensor_ops={"usable": False, "reason": reason,
                                                              "forced_reason": forced_reason, "gpu_family": 10}))

    def device_info(self):
        return self.info


def test_accelerator_section_skips_with_the_devices_reason(monkeypatch):
    from flash_metal.selfcheck import accel

    args = cli._parser().parse_args(["--quick"])
    backend = _NoAccelerator("FLASH_METAL_DISABLE_TENSOR_OPS=1 turns them off", None)
    planned = accel.plan(backend, args)
    assert planned["cases"] == [] and planned["timing"] == []
    section = accel.run_section(backend, args, planned)
    assert section["status"] == "skipped" and "FLASH_METAL_DISABLE_TENSOR_OPS=1" in section["reason"]
    assert accel.failures(section) == []
    assert "**skipped**: FLASH_METAL_DISABLE_TENSOR_OPS=1" in "\n".join(accel.to_markdown(section))
    # A build that must have the MSL 4 library (the macOS 26 CI leg): a missing one fails the section.
    missing = "no MSL 4 library (flash_metal_mpp.metallib) was installed"
    backend = _NoAccelerator(missing, missing)
    monkeypatch.delenv(accel.REQUIRE_ENV, raising=False)
    assert accel.run_section(backend, args, accel.plan(backend, args))["status"] == "skipped"
    monkeypatch.setenv(accel.REQUIRE_ENV, "1")
    section = accel.run_section(backend, args, accel.plan(backend, args))
    assert section["status"] == "failed" and accel.failures(section) == [f"accelerator: {section['message']}"]
    # Skipped for another reason (no accelerator on this GPU) is not a failure, even then.
    backend = _NoAccelerator("an Apple 9 GPU (Auto runs the tensor-op kernels from Apple 10, M5, on)", None)
    assert accel.run_section(backend, args, accel.plan(backend, args))["status"] == "skipped"


def test_planted_lane_layout_fails_the_probe(tmp_path, monkeypatch):
    _need_emulator()
    # The kernels' layout stays MLX's; the plant changes what the probe expects, which is what a GPU whose
    # layout differs from the assumed one looks like to it.
    original = lanes.mlx_coord
    monkeypatch.setattr(lanes, "mlx_coord", lambda lane: original(lane ^ 2))
    rc, data, md = _run_in_process(tmp_path, "--only", "untiled-float32")
    assert data["checks"] and all(c["status"] == "passed" for c in data["checks"])
    assert rc == 1 and data["lane_probe"]["status"] == "failed" and data["lane_probe"]["problems"]
    assert "lane 0" in data["lane_probe"]["problems"][0]
    assert data["summary"]["failures"][0].startswith("lane-layout probe: failed")
    assert "every prefill and backward result is suspect" in md


def test_warnings_raised_while_checking_are_reported(tmp_path, monkeypatch):
    # A runtime-compile fallback warns (TORCH_WARN -> UserWarning); the report must carry what the Mac said.
    _need_emulator()
    original = sweep.run_case

    def warning_run_case(backend, case):
        import warnings
        warnings.warn("flash_metal: planted warning from the library")
        return original(backend, case)

    monkeypatch.setattr(sweep, "run_case", warning_run_case)
    rc, data, md = _run_in_process(tmp_path, "--only", "untiled-float32")
    assert rc == 0 and data["warnings"] == ["UserWarning: flash_metal: planted warning from the library"]
    assert "- UserWarning: flash_metal: planted warning from the library" in md


def test_a_run_that_dies_leaves_a_report_naming_where(tmp_path, monkeypatch):
    # A GPU fault kills the process inside a kernel call; the report on disk must say which check it was.
    _need_emulator()
    original = sweep.run_case

    def dying_run_case(backend, case):
        if case.id.startswith("tiled-float32"):
            raise KeyboardInterrupt  # stands in for the process dying: nothing after this line runs
        return original(backend, case)

    monkeypatch.setattr(sweep, "run_case", dying_run_case)
    with pytest.raises(KeyboardInterrupt):
        _run_in_process(tmp_path, "--only", "float32-d48")
    data = json.loads((tmp_path / "selfcheck.json").read_text())
    assert data["status"] == "incomplete" and data["passed"] is False
    assert data["running"].startswith("check tiled-float32-d48")
    assert [c["status"] for c in data["checks"]] == ["passed", "passed"]  # prefill and decode at D = 48 ran
    md = (tmp_path / "selfcheck.md").read_text()
    assert md.startswith("# flash_metal selfcheck: INCOMPLETE") and "during check tiled-float32-d48" in md


def test_only_matching_nothing_is_an_error(tmp_path):
    assert cli.main(["--backend", "metal-emu", "--only", "no-such-check", "--out", str(tmp_path)]) == 2


def test_pipeline_below_the_planners_n_fails():
    pipes = [{"name": "k1", "max_threads": 512, "thread_execution_width": 32},
             {"name": "k2", "max_threads": 1024, "thread_execution_width": 32},
             {"name": "k3", "max_threads": 256, "thread_execution_width": 32},
             {"name": "k4", "max_threads": 1024, "thread_execution_width": 32},
             {"name": "k5", "max_threads": None, "thread_execution_width": None}]
    planner = {"k1": {"planner_max": 1024, "largest": 256}, "k2": {"planner_max": 1024, "largest": 1024},
               "k3": {"planner_max": None, "largest": 512}, "k5": {"planner_max": 64, "largest": 64}}
    rows = {r["name"]: r for r in sb.pipeline_rows(pipes, planner)}
    assert rows["k1"]["status"] == "failed" and "planner may launch 1024" in rows["k1"]["note"]
    assert rows["k2"]["status"] == "ok"
    assert rows["k3"]["status"] == "failed" and "sweep launched 512" in rows["k3"]["note"]
    assert rows["k4"]["status"] == rows["k5"]["status"] == "unchecked"
    report = {"checks": [], "lane_probe": {"status": "passed"}, "pipelines": {"rows": list(rows.values())}}
    s = cli._summary(report)
    assert s["pipelines_failed"] == 2 and any("pipeline k1" in f for f in s["failures"])


def _schema1(**over):
    info = {"schema": 1, "available": True, "reason": None, "mps_backend": True,
            "macos": {"version": "15.1.0", "major": 15, "minor": 1, "patch": 0},
            "device": {"name": "Apple M2 Pro", "registry_id": 7, "source": "torch", "has_unified_memory": True,
                       "max_threadgroup_memory_length": 32768, "max_threads_per_threadgroup": [1024, 1024, 1024],
                       "families": {"Apple7": True, "Apple8": True, "Apple9": False, "Mac2": True, "Metal3": True,
                                    "Metal4": None, "Apple10": None}},
            "library": {"kind": "runtime_compile", "path": "/site/flash_metal/shaders/attention.metal",
                        "reason": "no metallib was installed", "origin": "compiled at run time", "error": None},
            "pipelines": [{"kernel": "flash_decode_float16_d128", "function_constants": "1000000000",
                           "max_total_threads_per_threadgroup": 768, "thread_execution_width": 32,
                           "static_threadgroup_memory_length": 0}],
            "pipeline_errors": [{"kernel": "k", "function_constants": "0", "error": "compiler error"}],
            "tensor_ops": {"usable": False, "reason": "an Apple 8 GPU (Auto runs the tensor-op kernels from Apple 10, "
                                                      "M5, on)", "forced_reason": "this Mac runs a macOS older than 26.2, "
                                                      "which Metal 4 tensor ops need", "gpu_family": 8}}
    info.update(over)
    return info


def test_device_info_schema_1_is_read():
    from test_device_info import KEYS  # the op's keys, as the executed host's answer is checked

    raw = _schema1()
    assert set(raw) == KEYS
    info = sb.parse_device_info(json.dumps(raw))
    assert info["available"] is True and info["name"] == "Apple M2 Pro" and info["macos"] == "15.1.0"
    assert info["families"] == ["Apple7", "Apple8", "Mac2", "Metal3"]  # true only; null = not asked
    assert info["library"] == {"origin": "compiled at run time", "runtime_compile": True,
                               "reason": "no metallib was installed", "error": None}
    assert info["pipelines"] == [{"name": "flash_decode_float16_d128", "function_constants": "1000000000",
                                  "max_threads": 768, "thread_execution_width": 32}]
    assert info["pipeline_errors"] == raw["pipeline_errors"]
    assert info["tensor_ops"] == raw["tensor_ops"]  # whether the accelerator section runs, and why not
    older = sb.parse_device_info(json.dumps({k: v for k, v in raw.items() if k != "tensor_ops"}))
    assert older["tensor_ops"]["usable"] is False and "does not report it" in older["tensor_ops"]["reason"]
    off = sb.parse_device_info(_schema1(available=False, reason="no Metal device", device=None, library=None,
                                        pipelines=[], pipeline_errors=[]))
    assert off["available"] is False and off["reason"] == "no Metal device" and off["name"] is None
    with pytest.raises(ValueError, match="schema 2"):
        sb.parse_device_info(_schema1(schema=2))


# ---- the MPS backend, as far as Linux can take it --------------------------------------------


@pytest.mark.skipif(MPS_AVAILABLE, reason="this machine has MPS: the refusal cannot be shown")
@pytest.mark.parametrize("args", [["--backend", "mps"], []], ids=["explicit", "default"])
def test_mps_backend_without_mps_says_why(tmp_path, args):
    proc = _selfcheck(*args, "--out", str(tmp_path), timeout=300)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "cannot run" in proc.stderr and "is_available() is False" in proc.stderr
    assert "--backend metal-emu" in proc.stderr  # what to do instead
    data = json.loads((tmp_path / "selfcheck.json").read_text())
    assert data["status"] == "not run" and data["passed"] is False and "MPS" in data["reason"]
    assert (tmp_path / "selfcheck.md").read_text().startswith("# flash_metal selfcheck: NOT RUN")


def test_metal_emu_outside_a_source_checkout_says_so(tmp_path):
    from metal_emulator import _build

    _build.find_clang()  # without clang 19 selfcheck names that first (a missing prerequisite; tests/conftest.py)
    env = None
    pkg = os.path.dirname(os.path.abspath(flash_metal.__file__))
    if os.path.exists(os.path.join(os.path.dirname(pkg), "tests", "metal_emulator")):
        # flash_metal is an in-place build inside the checkout, which selfcheck would find beside the
        # package: run a copy of the package from a folder with no checkout around it, as installed.
        site = tmp_path / "site"
        shutil.copytree(pkg, site / "flash_metal", ignore=shutil.ignore_patterns("__pycache__"))
        env = dict(os.environ, PYTHONPATH=str(site))
    proc = subprocess.run([sys.executable, "-m", "flash_metal.selfcheck", "--backend", "metal-emu", "--out",
                           str(tmp_path / "r")], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "needs a source checkout" in proc.stderr


def test_mps_backend_calls_the_ops_correctly(monkeypatch):
    # The MPS backend's calls (argument order, keyword names) run against the real op schemas on CPU
    # tensors: its device copies become identity and the forced impl becomes "auto" (CPU accepts only
    # that); the results must pass the 2x rule, so a misplaced argument fails here.
    impls = []
    original = flash_metal.attention_with_lse

    def cpu_forward(q, k, v, causal, scale, impl, **options):
        impls.append(impl)
        return original(q, k, v, causal, scale, "auto", **options)

    monkeypatch.setattr(sb.MpsBackend, "_dev", staticmethod(lambda t: t))
    monkeypatch.setattr(sb.flash_metal, "attention_with_lse", cpu_forward)
    monkeypatch.setattr(torch.mps, "synchronize", lambda: None)
    backend = object.__new__(sb.MpsBackend)
    cases = [c for c in sweep.cases(quick=True) if c.dtype == torch.float32]
    assert {c.family for c in cases} == FAMILIES
    for case in cases:
        record = sweep.run_case(backend, case)
        assert record["status"] == "passed", record
        prefixes = KERNELS[case.family]
        assert [k[: len(p)] for k, p in zip(record["kernels"], prefixes)] == prefixes  # the planner's launches
    assert impls == [c.impl for c in cases if c.family not in ("varlen", "varlen_backward") and not c.backward]


def test_mps_pipelines_from_device_info_or_from_what_was_built(monkeypatch):
    backend = object.__new__(sb.MpsBackend)
    planner = {"flash_decode_float16_d128": {"planner_max": 512, "largest": 256}}
    info = sb.parse_device_info(_schema1(pipelines=[
        {"kernel": "flash_decode_float16_d128", "function_constants": "0", "max_total_threads_per_threadgroup": 384,
         "thread_execution_width": 32, "static_threadgroup_memory_length": 0}]))
    monkeypatch.setattr(sb.MpsBackend, "device_info", lambda self: info)
    (row,) = backend.pipelines(planner)["rows"]
    assert row["status"] == "failed" and row["planner_max_threads"] == 512 and row["max_threads"] == 384
    # A build without metal_device_info: the list metal_build_all_pipelines returned, limits unknown.
    monkeypatch.setattr(sb.MpsBackend, "device_info", lambda self: {"available": False, "reason": sb.NOT_AVAILABLE})
    assert backend.pipelines(planner)["available"] is False
    backend._built = ["flash_decode_float16_d128/1000000000", "flash_decode_merge_float16_d128/"]
    p = backend.pipelines(planner)
    assert p["available"] and sb.NOT_AVAILABLE in p["source"]
    assert [(r["name"], r["function_constants"], r["status"]) for r in p["rows"]] == [
        ("flash_decode_float16_d128", "1000000000", "unchecked"), ("flash_decode_merge_float16_d128", "", "unchecked")]


def test_mps_lane_probe_without_compile_shader_is_skipped(monkeypatch):
    monkeypatch.delattr(torch.mps, "compile_shader", raising=False)
    result = lanes.run_on_mps()
    assert result["status"] == "skipped" and "too old" in result["detail"]


def test_mps_lane_probe_through_a_compile_shader_of_the_emulator(monkeypatch, tmp_path):
    # torch.mps.compile_shader's contract as the probe uses it (argument i bound at [[buffer(i)]], kernels
    # as attributes, threads/group_size), played by the emulator: the probe passes, and a layout that
    # differs from the assumed one fails.
    _need_emulator()
    from metal_emulator import compile_library

    class Lib:
        def __init__(self, source):
            path = str(tmp_path / "probe.metal")
            with open(path, "w") as f:
                f.write(source)
            self.lib = compile_library([path], instrumented=True)

        def __getattr__(self, name):
            def call(*tensors, threads, group_size):
                self.lib.dispatch(name, buffers=dict(enumerate(tensors)), grid=(threads // group_size,),
                                  threadgroup=(group_size,))
            return call

    monkeypatch.setattr(torch.mps, "compile_shader", Lib, raising=False)
    monkeypatch.setattr(torch.mps, "synchronize", lambda: None)
    real_buffers = lanes._buffers
    monkeypatch.setattr(lanes, "_buffers", lambda device: real_buffers("cpu"))
    assert lanes.run_on_mps()["status"] == "passed"
    original = lanes.mlx_coord
    monkeypatch.setattr(lanes, "mlx_coord", lambda lane: original(lane ^ 1))
    assert lanes.run_on_mps()["status"] == "failed"


# ---- flash_metal.testing, the rule the package now carries -------------------------------------


def test_testing_names_the_failing_quantity_and_survives_python_O():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g) for _ in range(3))
    out, lse = flash_metal.attention_with_lse(q, k, v, True)
    comps = testing.attention_errors(out, lse, q, k, v, True)
    assert [c.name for c in comps if c.error is not None] == ["out", "lse"] and all(c.ok for c in comps)
    bad = out.clone()
    bad[0, 1, 3, 5] += 0.01
    failed = [c for c in testing.attention_errors(bad, lse, q, k, v, True) if not c.ok]
    assert [c.name for c in failed] == ["out"] and "max error 0.01" in failed[0].message
    with pytest.raises(testing.NotClose, match="out: max error"):
        testing.assert_attention_close(bad, lse, q, k, v, True)
    # The checks are raises, not asserts: python -O keeps them.
    code = ("import torch, flash_metal.testing as t; q = torch.randn(1, 1, 5, 8); "
            "o, l = torch.zeros(1, 1, 5, 8), torch.zeros(1, 1, 5)\n"
            "try:\n    t.assert_attention_close(o, l, q, q, q)\nexcept AssertionError as e:\n    print('raised', e)")
    proc = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, cwd=str(ROOT + "/tests"))
    assert proc.stdout.startswith("raised out: max error"), proc.stdout + proc.stderr


def test_markdown_stays_pasteable_with_many_checks():
    check = {"id": "prefill-float16-d128-" + "x" * 60, "family": "prefill", "dtype": "float16", "head_dim": 128,
             "options": "causal, GQA", "kernels": ["flash_attention_prefill_float16_d128_bq32_bk16_wm4"],
             "worst_ratio": 0.2, "status": "passed", "message": "", "seconds": 0.1}
    report = {"status": "passed", "backend": "mps", "summary": {"checks": 2000, "passed": 2000, "failed": 0,
                                                               "errors": 0, "pipelines_failed": 0, "failures": []},
              "platform": {}, "lane_probe": {"status": "passed"}, "checks": [check] * 2000, "timing": {}}
    md = report_mod.to_markdown(report)
    assert len(md) < report_mod.MAX_MARKDOWN and "selfcheck.json" in md


def test_accelerator_section_checks_the_mla_pair_both_passes():
    # The full grid (the macOS 26 CI leg runs it) has the MLA pair (q/k 192, v 128) forward and backward, with
    # v, out and grad_out 128 wide; one case runs through the emulated backend and passes both sides, the
    # tensor-op side on the pair's own kernels.
    _need_emulator()
    from flash_metal.selfcheck import accel

    mla = [c for c in accel.cases(quick=False) if c.dv]
    assert {(c.family, c.d, c.dv) for c in mla} == {("prefill", 192, 128), ("backward", 192, 128)} and len(mla) == 8
    assert not [c for c in accel.cases(quick=True) if c.dv]
    case = next(c for c in mla if c.backward and c.dtype == torch.bfloat16 and c.causal)
    inputs = sweep.make_inputs(case)
    assert inputs["v"].shape[-1] == inputs["out"].shape[-1] == inputs["grad_out"].shape[-1] == 128
    assert inputs["q"].shape[-1] == inputs["k"].shape[-1] == 192
    rec = accel.run_case(cli.make_backend("metal-emu", ROOT), case)
    assert rec["status"] == "passed", rec["message"]
    assert rec["id"].startswith("tensor_ops_backward-bfloat16-d192-dv128-") and rec["head_dim_v"] == 128
    assert rec["tensor_ops"]["kernels"][:2] == ["flash_backward_mpp_dq_bfloat16_dqk192_dv128_bq32_bk32",
                                                "flash_backward_mpp_dkdv_bfloat16_dqk192_dv128_bk64_bq32"]
