"""python -m flash_metal.selfcheck's verdicts, tested like a product (issue 41).

Every way a part of the selfcheck can end, driven through the real code
that decides and reports it (cli.main: the sweep's run_case and
compare, the accelerator section, _summary, the Markdown and JSON writers,
the exit status): a correctness check that passed, failed or errored; the
lane probe passed, failed, errored or skipped with its reason; the
accelerator section passed, failed, errored, skipped with the device's
reason, skipped by --no-accelerator, or failed because a build that must have
the MSL 4 library lacks it; the whole run not run, or stopped mid-way (the
checks after it not run). Then each check's own
guard gets a planted fault that the report must name: the kernels a sweep
check launched, the kernels each side of an accelerator case launched, the
library the device reports, the lane layout.

The backend is a stand-in (FakeBackend) with the real backends' interface:
results from flash_metal's CPU ops, launches from the planner
(flash_metal.explain, planned for an M5 with tensor ops, so both sides of
an accelerator case have their real kernel names), and a fault hook. So the
whole file needs no emulator: ~5 s on 2 cores. The emulator-backed runs of
the same report code are tests/api/test_selfcheck.py's.

Planted in flash_metal/selfcheck/, each run against this file and reverted:
  * cli._summary counting only status "failed" as a failure (the
    escaped bug: an errored check left out, the report said PASSED): fails
    test_a_check_ends_in_the_report[error] (exit 0, "PASSED"); the same in
    selfcheck/accel.py's failures fails test_accelerator_outcome_in_the_report[error].
  * The simdgroup side no longer checked for tensor-op kernels (the escaped
    bug): not_prefix dropped from the forward's or the backward's
    _run_forced call, or from its _kernel_problem call, fails
    test_simdgroup_side_running_tensor_ops_is_named (that case, or both).
  * _library_missing weakened (the escaped bug): reading reason only, not
    forced_reason, fails test_required_library_problems_fail_the_section[forced_reason];
    one marker only ("MSL 4 library", or "flash_metal_mpp.metallib"), or no
    check at all, fails both of its cases.
  * selfcheck/sweep.py's run_case without its kernel_problem guard fails all four
    test_sweep_check_that_ran_another_kernel_is_named cases.
  * check_lanes without its two simdgroup_load comparisons fails
    test_lane_probe_fault_is_named (the probe passes a foreign layout).
"""
import dataclasses
import json
import os
import re

import pytest
import torch

import flash_metal
from flash_metal.selfcheck import accel
from flash_metal.selfcheck import backends as sb
from flash_metal.selfcheck import cli
from flash_metal.selfcheck import lanes
from flash_metal.selfcheck import sweep
from repo_paths import ROOT_DIR as ROOT

LIBRARY_MM = os.path.join(ROOT, "csrc", "mps", "library.mm")
# The checks the sweep tests run: prefill, decode, tiled and backward at the zero-padded head dim (--quick).
SWEEP_ONLY = "float32-d48"
SWEEP_IDS = [c.id for c in sweep.cases(True) if SWEEP_ONLY in c.id]
# The accelerator cases: one forward and one backward of --quick.
ACCEL_FORWARD, ACCEL_BACKWARD = "tensor_ops-float16-d64", "tensor_ops_backward-float16-d64"
PASSING_PROBE = {"status": "passed", "runner": "stand-in", "problems": [],
                 "detail": "the simdgroup_matrix lane layout is MLX's, as the prefill and backward kernels assume"}


def _cpu_result(case, inputs):
    """The case's result from flash_metal's CPU ops (impl='auto': the CPU takes no other)."""
    q, k, v, opts = inputs["q"], inputs["k"], inputs["v"], inputs["options"]
    if case.family == "varlen":
        return flash_metal.attention_varlen_with_lse(q, k, v, *inputs["varlen"], case.causal, None, **opts)
    if case.family == "varlen_backward":
        return torch.ops.flash_metal.attention_varlen_backward(
            inputs["grad_out"], q, k, v, inputs["out"], inputs["lse"], *inputs["varlen"], case.causal, None,
            inputs["grad_lse"], **opts)[:3]
    if case.backward:
        return torch.ops.flash_metal.attention_backward(inputs["grad_out"], q, k, v, inputs["out"], inputs["lse"],
                                                        case.causal, None, inputs["grad_lse"], "auto", **opts)[:3]
    return flash_metal.attention_with_lse(q, k, v, case.causal, None, "auto", **opts)


def _planned(case, inputs):
    """The planner's launches for the case on an M5 with tensor ops (FLASH_METAL_DISABLE_TENSOR_OPS honoured)."""
    q, k, v, opts = inputs["q"], inputs["k"], inputs["v"], dict(inputs["options"])
    if "varlen" in inputs:
        cq, ck, mq, mk = inputs["varlen"]
        opts.update(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk)
    if case.backward:
        opts.update(backward=True, grad_out=inputs["grad_out"], out=inputs["out"], lse=inputs["lse"],
                    grad_lse=inputs["grad_lse"])
    plan = flash_metal.explain(q, k, v, case.causal, None, case.impl, "m5+tensor_ops", **opts)
    return [sb._launch(d) for d in plan.dispatches]


class FakeBackend:
    """The selfcheck backends' interface on the CPU: real results and real plans, and `fault(case, result,
    launches)` (optional) to change what a case returns or to raise."""

    timing_device = "cpu"
    poisons_outputs = True

    def __init__(self, name="metal-emu", probe=None, fault=None, device_info=None):
        self.name, self.probe, self.fault, self.info = name, probe or dict(PASSING_PROBE), fault, device_info

    def prepare(self):
        return None

    def run(self, case, inputs):
        result, launches = tuple(_cpu_result(case, inputs)), _planned(case, inputs)
        if self.fault is not None:
            result, launches = self.fault(case, result, launches)
        return result, launches

    def device_info(self):
        return self.info

    def platform(self):
        return {**sb.base_platform(), "backend": self.name, "gpu": "a stand-in", "gpu_families": "n/a"}

    def library(self, built_all):
        return {"origin": "a stand-in library", "runtime_compile": None, "reason": "tests"}

    def build_all_pipelines(self):
        return {"status": "passed", "count": 0, "detail": "nothing to build (a stand-in)"}

    def pipelines(self, planner):
        rows = [{"name": n, "max_threads": 1024, "thread_execution_width": 32} for n in sorted(planner)]
        return {"available": True, "source": "a stand-in", "rows": sb.pipeline_rows(rows, planner)}

    def lane_probe(self):
        return dict(self.probe)


def _device(usable, reason=None, forced_reason=None, family=10):
    """metal_device_info's answer (schema 1) as parse_device_info reads it, with the given tensor_ops verdict."""
    from test_selfcheck import _schema1

    return sb.parse_device_info(_schema1(tensor_ops={"usable": usable, "reason": reason,
                                                     "forced_reason": forced_reason, "gpu_family": family}))


def _run(tmp_path, monkeypatch, capfd, backend, *args):
    """cli.main on `backend`: (exit status, JSON report, Markdown report, stdout)."""
    monkeypatch.setattr(cli, "make_backend", lambda name, source=None: backend)
    rc = cli.main(["--backend", "metal-emu", "--quick", "--out", str(tmp_path), "--no-progress", "--no-timing",
                         *args])
    data = json.loads((tmp_path / "selfcheck.json").read_text())
    return rc, data, (tmp_path / "selfcheck.md").read_text(), capfd.readouterr().out


def _head(md):
    """The Markdown before its first section: the verdict, the summary line and the failures."""
    return md.split("## Platform")[0]


def _only(check_id, change):
    """A fault that applies `change(result, launches)` to one check (by its id prefix) and leaves the rest."""
    def fault(case, result, launches):
        cid = accel.case_id(case) if isinstance(case, accel.ForcedCase) else case.id
        return change(result, launches) if cid.startswith(check_id) else (result, launches)
    return fault


def _off_by(result, launches):  # the first output's last element off by 0.05
    first = result[0].clone()
    first.view(-1)[-1] += 0.05
    return (first,) + tuple(result[1:]), launches


def _raises(result, launches):
    raise RuntimeError("planted: the kernel could not run")


# ---- a correctness check: passed, failed, errored ---------------------------------------------

OUTCOMES = {"passed": None, "failed": _off_by, "error": _raises}


@pytest.mark.parametrize("outcome", list(OUTCOMES))
def test_a_check_ends_in_the_report(tmp_path, monkeypatch, capfd, outcome):
    target = next(i for i in SWEEP_IDS if i.startswith("tiled-"))
    change = OUTCOMES[outcome]
    backend = FakeBackend(fault=_only(target, change) if change else None)
    rc, data, md, out = _run(tmp_path, monkeypatch, capfd, backend, "--only", SWEEP_ONLY)
    s, n = data["summary"], len(SWEEP_IDS)
    assert [c["id"] for c in data["checks"]] == SWEEP_IDS and n == 4
    rec = next(c for c in data["checks"] if c["id"] == target)
    assert rec["status"] == outcome
    if outcome == "passed":
        assert rc == 0 and data["status"] == "passed" and data["passed"] is True
        assert (s["checks"], s["passed"], s["failed"], s["errors"], s["failures"]) == (n, n, 0, 0, [])
        assert md.startswith("# flash_metal selfcheck: PASSED")
        assert f"{n} of {n} correctness checks passed, 0 failed;" in md
        assert "**Failures:**" not in md and "Failed checks:" not in md
        assert f"PASSED: {n}/{n} checks passed" in out and "FAILED" not in out
        return
    why = "out: max error" if outcome == "failed" else "RuntimeError: planted: the kernel could not run"
    assert why in rec["message"]
    assert rc == 1 and data["status"] == "failed" and data["passed"] is False
    assert (s["checks"], s["passed"], s["failed"], s["errors"]) == (n, n - 1, outcome == "failed", outcome == "error")
    assert len(s["failures"]) == 1 and s["failures"][0].startswith(f"{target}: {outcome}: ") and why in s["failures"][0]
    head = _head(md)
    assert head.startswith("# flash_metal selfcheck: FAILED")
    summary = f"{n - 1} of {n} correctness checks passed, {int(outcome == 'failed')} failed"
    assert summary + (", 1 could not run;" if outcome == "error" else ";") in head
    assert f"- {target}: {outcome}: " in head and why in head  # named at the top, with the reason
    assert re.search(rf"\| {re.escape(target)} \|.*\| {outcome}: ", md)  # and in the failed-checks table
    assert f"FAILED: {n - 1}/{n} checks passed" in out and f"FAILED {target}: {outcome}" in out


# ---- the lane probe: passed, failed, errored, skipped -----------------------------------------

PROBES = {
    "passed": (PASSING_PROBE, 0),
    "failed": ({"status": "failed", "runner": "stand-in", "problems": ["lane 3: planted"],
                "detail": "1 mismatch(es): every prefill and backward result is suspect"}, 1),
    "error": ({"status": "error", "runner": "stand-in", "problems": [],
               "detail": "the probe could not run: RuntimeError: planted"}, 1),
    "skipped": ({"status": "skipped", "runner": "torch.mps.compile_shader", "problems": [],
                 "detail": "skipped: torch 2.4 is too old (torch.mps.compile_shader arrived in 2.6)"}, 0),
}


@pytest.mark.parametrize("outcome", list(PROBES))
def test_lane_probe_outcome_in_the_report(tmp_path, monkeypatch, capfd, outcome):
    probe, want_rc = PROBES[outcome]
    rc, data, md, out = _run(tmp_path, monkeypatch, capfd, FakeBackend(probe=probe), "--only", "untiled-float32")
    assert rc == want_rc and data["lane_probe"]["status"] == outcome
    assert data["checks"] and all(c["status"] == "passed" for c in data["checks"])
    assert f"**{outcome}** ({probe['runner']}): {probe['detail']}" in md
    assert f"lane probe: {outcome};" in _head(md) and f"lane probe {outcome}" in out
    bad = outcome in ("failed", "error")
    assert data["passed"] is not bad and data["status"] == ("failed" if bad else "passed")
    assert md.startswith("# flash_metal selfcheck: " + ("FAILED" if bad else "PASSED"))
    if bad:
        assert data["summary"]["failures"] == [f"lane-layout probe: {outcome}: {probe['detail']}"]
        assert f"- lane-layout probe: {outcome}: {probe['detail']}" in _head(md)
        assert f"FAILED lane-layout probe: {outcome}" in out
    else:
        assert data["summary"]["failures"] == []


def _simulated_probe(hardware):
    """The probe's buffers on a GPU whose simdgroup_load puts at lane l the fragment elements at hardware(l),
    while the kernels' helpers (prefill_frag_row/col, prefill_read_frag) keep MLX's layout; checked by the real
    check_lanes/_result."""
    bufs, index = lanes._buffers("cpu"), lanes.index_matrix()
    for lane in range(lanes.SIMD_WIDTH):
        (r, c), (hr, hc) = lanes.mlx_coord(lane), hardware(lane)
        bufs["coords"][2 * lane:2 * lane + 2] = torch.tensor([r, c], dtype=torch.int32)
        for j in range(2):
            bufs["read"][2 * lane + j] = index[r, 8 + c + j]
            bufs["read_t"][2 * lane + j] = index[c + j, 8 + r]
            bufs["loaded"][2 * lane + j] = index[hr, 8 + hc + j]
            bufs["loaded_t"][2 * lane + j] = index[hc + j, 8 + hr]
    return lanes._result(bufs, "simulated GPU")


def test_lane_probe_fault_is_named(tmp_path, monkeypatch, capfd):
    # The probe's own guard: the hardware's layout differs from the one the kernels assume (lanes l and l ^ 8
    # swapped). Without the fault the same simulation passes.
    assert _simulated_probe(lanes.mlx_coord)["status"] == "passed"
    probe = _simulated_probe(lambda lane: lanes.mlx_coord(lane ^ 8))
    rc, data, md, out = _run(tmp_path, monkeypatch, capfd, FakeBackend(probe=probe), "--only", "untiled-float32")
    assert rc == 1 and data["lane_probe"]["status"] == "failed"
    first = data["lane_probe"]["problems"][0]
    assert first.startswith("lane 0[0]: prefill_read_frag gave 8.0, simdgroup_load gave ")
    assert f"- {first}" in md and "every prefill and backward result is suspect" in _head(md)
    assert "FAILED lane-layout probe: failed" in out


# ---- the accelerator section: every ending ------------------------------------------------------

def _tensor_ops_side(change):
    """A fault on the tensor-op side of every accelerator case (the kernels the impl='tensor_ops' run launched)."""
    def fault(case, result, launches):
        ran_tensor_ops = any("_mpp_" in launch["kernel"] for launch in launches)
        return change(result, launches) if ran_tensor_ops else (result, launches)
    return fault


ACCEL = {
    "passed": (dict(), 0, "passed"),
    "failed": (dict(fault=_tensor_ops_side(_off_by)), 1, "failed"),
    "error": (dict(fault=_tensor_ops_side(_raises)), 1, "error"),
}


@pytest.mark.parametrize("outcome", list(ACCEL))
def test_accelerator_outcome_in_the_report(tmp_path, monkeypatch, capfd, outcome):
    kw, want_rc, status = ACCEL[outcome]
    rc, data, md, out = _run(tmp_path, monkeypatch, capfd, FakeBackend(**kw), "--accelerator-only", "--only",
                             ACCEL_FORWARD)
    a = data["accelerator"]
    [c] = a["checks"]
    assert rc == want_rc and data["checks"] == [] and c["status"] == status
    assert c["tensor_ops"]["kernels"] == ["flash_attention_prefill_mpp_float16_d64_bq64_bk32"] or outcome == "error"
    assert c["simdgroup"]["status"] == "passed" and c["simdgroup"]["kernels"][0].startswith(
        "flash_attention_prefill_float16_d64_")
    section = md.split("## Accelerator")[1]
    if outcome == "passed":
        assert a["status"] == "passed" and data["passed"] is True and data["summary"]["failures"] == []
        assert md.startswith("# flash_metal selfcheck: PASSED") and "**passed**" in section
        assert f"| {c['id']} |" in section and "| ok " in section
        return
    why = "out: max error" if outcome == "failed" else "RuntimeError: planted"
    assert a["status"] == "failed" and data["passed"] is False and data["status"] == "failed"
    assert c["tensor_ops"]["status"] == status and why in c["tensor_ops"]["message"]
    [failure] = data["summary"]["failures"]
    assert failure.startswith(f"accelerator {c['id']}: {status}: tensor_ops: ") and why in failure
    assert md.startswith("# flash_metal selfcheck: FAILED") and f"- {failure[:80]}" in _head(md)
    assert "**failed**" in section and f"| {c['id']} |" in section and "**FAIL** tensor_ops: " in section
    assert f"FAILED accelerator {c['id']}: {status}" in out


@pytest.mark.parametrize("outcome", ["device", "flag"])
def test_accelerator_skipped_with_its_reason(tmp_path, monkeypatch, capfd, outcome):
    monkeypatch.delenv(accel.REQUIRE_ENV, raising=False)
    why = "an Apple 9 GPU (Auto runs the tensor-op kernels from Apple 10, M5, on)"
    if outcome == "device":  # a Mac whose device rules the section out; the sweep still runs
        backend = FakeBackend(name="mps", device_info=_device(False, why, "no MSL 4 library (flash_metal_mpp."
                                                                        "metallib) was installed", 9))
        rc, data, md, out = _run(tmp_path, monkeypatch, capfd, backend, "--only", "untiled-float32")
    else:
        why = "--no-accelerator"
        rc, data, md, out = _run(tmp_path, monkeypatch, capfd, FakeBackend(), "--only", "untiled-float32",
                                 "--no-accelerator")
    a = data["accelerator"]
    assert rc == 0 and a["status"] == "skipped" and a["reason"] == why and a["checks"] == []
    assert data["passed"] is True and data["summary"]["failures"] == [] and data["checks"]
    assert f"**skipped**: {why}" in md.split("## Accelerator")[1]
    assert md.startswith("# flash_metal selfcheck: PASSED")


def test_not_run_says_why(tmp_path, monkeypatch, capfd):
    def unavailable(name, source=None):
        raise sb.Unavailable("planted: no Metal here, and here is what to do instead")

    monkeypatch.setattr(cli, "make_backend", unavailable)
    rc = cli.main(["--backend", "metal-emu", "--out", str(tmp_path), "--no-progress"])
    data = json.loads((tmp_path / "selfcheck.json").read_text())
    md = (tmp_path / "selfcheck.md").read_text()
    assert rc == 2 and data["status"] == "not run" and data["passed"] is False
    assert data["reason"] == "planted: no Metal here, and here is what to do instead"
    assert md.startswith("# flash_metal selfcheck: NOT RUN") and "**Could not run:** planted: no Metal here" in md
    assert "cannot run: planted" in capfd.readouterr().err


def test_a_run_that_stops_leaves_an_incomplete_report(tmp_path, monkeypatch, capfd):
    # The checks after the one during which the process dies are not run: the report on disk says which was
    # running, and that the run is not a pass.
    target = next(i for i in SWEEP_IDS if i.startswith("tiled-"))

    def dies(result, launches):
        raise KeyboardInterrupt  # stands in for a GPU fault killing the process: nothing after it runs

    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, monkeypatch, capfd, FakeBackend(fault=_only(target, dies)), "--only", SWEEP_ONLY)
    data = json.loads((tmp_path / "selfcheck.json").read_text())
    md = (tmp_path / "selfcheck.md").read_text()
    done = SWEEP_IDS[:SWEEP_IDS.index(target)]
    assert data["status"] == "incomplete" and data["passed"] is False and data["running"] == f"check {target}"
    assert [c["id"] for c in data["checks"]] == done and all(c["status"] == "passed" for c in data["checks"])
    assert md.startswith("# flash_metal selfcheck: INCOMPLETE") and f"during check {target}" in _head(md)


# ---- each guard, with a planted fault the report must name ------------------------------------

def _launching(kernels):
    return lambda result, launches: (result, [{**launches[0], "kernel": k} for k in kernels])


@pytest.mark.parametrize("family,kernels", [
    ("decode-", ["flash_attention_prefill_float32_d64_bq32_bk32_wm4"]),  # a decode check that ran the prefill
    ("prefill-", ["flash_attention_prefill_mpp_float32_d64_bq64_bk32"]),  # a forced prefill on the tensor ops
    ("backward-", []),  # nothing launched: the composite path, no Metal kernel at all
    ("tiled-", ["flash_attention_tiled_float16_d64"]),  # another dtype's kernel
], ids=["decode-ran-prefill", "prefill-ran-tensor-ops", "backward-ran-nothing", "tiled-wrong-dtype"])
def test_sweep_check_that_ran_another_kernel_is_named(tmp_path, monkeypatch, capfd, family, kernels):
    target = next(i for i in SWEEP_IDS if i.startswith(family))
    backend = FakeBackend(fault=_only(target, _launching(kernels)))
    rc, data, md, out = _run(tmp_path, monkeypatch, capfd, backend, "--only", SWEEP_ONLY)
    rec = next(c for c in data["checks"] if c["id"] == target)
    assert rc == 1 and rec["status"] == "failed" and rec["kernels"] == kernels
    assert rec["message"].startswith(f"launched {kernels or 'no kernel'}, not ")
    assert [c["id"] for c in data["checks"] if c["status"] != "passed"] == [target]  # the results were right
    assert any(f.startswith(f"{target}: failed: launched") for f in data["summary"]["failures"])
    assert f"- {target}: failed: launched" in _head(md)


@pytest.mark.parametrize("only", [ACCEL_FORWARD, ACCEL_BACKWARD])
def test_simdgroup_side_running_tensor_ops_is_named(tmp_path, monkeypatch, capfd, only):
    # The escaped bug's guard: the baseline side (impl='prefill'; for the backward impl='auto' with
    # FLASH_METAL_DISABLE_TENSOR_OPS=1) runs the tensor-op kernels, so the case would compare them with
    # themselves. The plant: the switch ignored (the backward) or impl='prefill' routed to them (the forward).
    def baseline_on_tensor_ops(case, result, launches):
        if isinstance(case, accel.ForcedCase) and case.forced in ("prefill", "auto"):
            launches = _planned(dataclasses.replace(case, forced="tensor_ops"), sweep.make_inputs(case))
        return result, launches

    rc, data, md, out = _run(tmp_path, monkeypatch, capfd, FakeBackend(fault=baseline_on_tensor_ops),
                             "--accelerator-only", "--only", only)
    [c] = data["accelerator"]["checks"]
    assert rc == 1 and c["status"] == "failed" and c["tensor_ops"]["status"] == "passed"
    simd = c["simdgroup"]
    assert simd["status"] == "failed" and all("_mpp_" in k for k in simd["kernels"])
    assert "tensor-op kernels" in simd["message"] and "against themselves" in simd["message"]
    [failure] = data["summary"]["failures"]
    assert failure.startswith(f"accelerator {c['id']}: failed: {simd['impl']}: impl='{simd['impl']}' launched ")
    assert "against themselves" in _head(md) and f"FAILED accelerator {c['id']}" in out


def test_tensor_op_side_that_fell_back_is_named(tmp_path, monkeypatch, capfd):
    # The other side's guard: impl='tensor_ops' that ran the simdgroup kernel (a routing fallback) is no
    # tensor-op check, whatever its numbers.
    def fell_back(case, result, launches):
        if isinstance(case, accel.ForcedCase) and case.forced == "tensor_ops":
            launches = [{**launches[0], "kernel": "flash_attention_prefill_float16_d64_bq32_bk32_wm4"}]
        return result, launches

    rc, data, md, _ = _run(tmp_path, monkeypatch, capfd, FakeBackend(fault=fell_back), "--accelerator-only",
                           "--only", ACCEL_FORWARD)
    [c] = data["accelerator"]["checks"]
    assert rc == 1 and c["tensor_ops"]["status"] == "failed" and c["simdgroup"]["status"] == "passed"
    assert c["tensor_ops"]["message"].startswith("impl='tensor_ops' launched ['flash_attention_prefill_float16_d64_")
    assert "not flash_attention_prefill_mpp_* kernels" in _head(md)


# ---- the MSL 4 library under FLASH_METAL_REQUIRE_MPP_METALLIB=1 -------------------------------

# Stand-ins for the values library.mm splices into its problem strings.
SPLICED = {"kMppMetallibName": "flash_metal_mpp.metallib",
           "path": "/site-packages/flash_metal/flash_metal_mpp.metallib",
           "stale": "it was built from other shader sources (fingerprint 1a, installed sources 2b): a stale build",
           "kReinstallHint": "reinstall flash_metal (pip install --no-build-isolation .)",
           "error": "Error Domain=MTLLibraryErrorDomain Code=1"}
# Each problem library.mm can report for the MSL 4 library (by its first words), and whether it says the library
# itself is missing or broken: under FLASH_METAL_REQUIRE_MPP_METALLIB=1 those fail the section; the others are
# no library's fault (the section is skipped and says why).
LIBRARY_VERDICTS = {"this Mac runs a macOS older than 26.2": False, "no Metal device": False,
                    "flash_metal: cannot locate the _C extension": True, "no MSL 4 library (": True,
                    "not using ": True, "cannot load ": True, "the MSL 4 library could not be looked up": True}


def _render(expr, what):
    """A C++ string expression of library.mm ("a" + name + "b" ...) with each name replaced by its stand-in."""
    expr = re.sub(r'std::string\(("(?:[^"\\]|\\.)*")\)', r"\1", expr)  # std::string("a") is "a"
    text = []
    for part in re.findall(r'"(?:[^"\\]|\\.)*"|[^+"\s][^+"]*', expr):
        part = part.strip()
        if part.startswith('"'):
            text.append(part[1:-1])
        elif part == "e.what()":
            text.append(what)
        else:
            assert part in SPLICED, f"library.mm splices {part!r} into a problem: give it a stand-in in SPLICED"
            text.append(SPLICED[part])
    return "".join(text)


def library_problems():
    """Every problem string csrc/mps/library.mm can report for the MSL 4 library, rendered."""
    with open(LIBRARY_MM, encoding="utf-8") as f:
        src = f.read()
    load = src[src.index("LoadedMpp load_mpp_library("):]
    load = load[:load.index("\n}\n")]
    lookup = src[src.index("std::string tensor_ops_library_problem("):]
    lookup = lookup[:lookup.index("\n}\n")]
    # package_directory's refusal reaches load_mpp_library as e.what().
    locate = re.search(r'std::string package_directory\(\).*?TORCH_CHECK\(.*?,\s*("(?:[^"\\]|\\.)*")\);', src, re.S)
    expr = r'((?:"(?:[^"\\]|\\.)*"|[^;"])*);'  # up to the statement's end (a ';' outside a literal)
    exprs = [(e, _render(locate.group(1), "")) for e in re.findall(r"out\.problem\s*=\s*" + expr, load)]
    exprs += [(e, "std::bad_alloc") for e in re.findall(r"return\s+(?=std::string\()" + expr, lookup)]
    return [_render(e, what) for e, what in exprs]


def test_library_problems_are_all_classified():
    # The rule is read from library.mm: a new or reworded problem string fails here until it is classified.
    problems = library_problems()
    assert len(problems) == len(LIBRARY_VERDICTS) >= 6
    assert sorted(next(k for k in LIBRARY_VERDICTS if p.startswith(k)) for p in problems) == sorted(LIBRARY_VERDICTS)


@pytest.mark.parametrize("where", ["forced_reason", "both"])
def test_required_library_problems_fail_the_section(tmp_path, monkeypatch, capfd, where):
    # Under FLASH_METAL_REQUIRE_MPP_METALLIB=1 (the macOS 26 CI leg) each library problem fails the run and is
    # named; the device's other reasons skip. "forced_reason": a GPU that Auto leaves to the simdgroup kernels
    # (the CI's runners), whose reason names the family and whose forced_reason holds the library's problem;
    # "both": an M5, whose two reasons are the library's.
    monkeypatch.setenv(accel.REQUIRE_ENV, "1")
    family = "an Apple 7 GPU (Auto runs the tensor-op kernels from Apple 10, M5, on)"
    for problem in library_problems():
        missing = LIBRARY_VERDICTS[next(k for k in LIBRARY_VERDICTS if problem.startswith(k))]
        info = _device(False, family if where == "forced_reason" else problem, problem, 7 if where != "both" else 10)
        rc, data, md, out = _run(tmp_path, monkeypatch, capfd, FakeBackend(name="mps", device_info=info),
                                 "--accelerator-only")
        a = data["accelerator"]
        if not missing:
            assert rc == 0 and a["status"] == "skipped", problem
            continue
        assert rc == 1 and a["status"] == "failed" and data["passed"] is False, problem
        [failure] = data["summary"]["failures"]
        assert failure == f"accelerator: {accel.REQUIRE_ENV}=1, but the MSL 4 library is not usable: {problem}"
        assert f"- {failure}" in _head(md) and md.startswith("# flash_metal selfcheck: FAILED")
        assert f"FAILED {failure[:60]}" in out
    # Without the requirement the same answers skip.
    monkeypatch.delenv(accel.REQUIRE_ENV)
    rc, data, _, _ = _run(tmp_path, monkeypatch, capfd, FakeBackend(name="mps", device_info=info),
                          "--accelerator-only")
    assert rc == 0 and data["accelerator"]["status"] == "skipped"
