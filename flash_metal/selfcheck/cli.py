"""Check flash_metal on this machine and write a report to paste into an issue.

The command behind python -m flash_metal.selfcheck (the package's docstring
says what it checks and what its exit status means): it parses the arguments,
starts a backend (backends.py), runs the sections in order (the platform, the
lane-layout probe of lanes.py, the pipelines, the sweep of sweep.py, the
accelerator section of accel.py, the timing table), writes the report so far
after each (report.py), and returns the exit status.
"""
import argparse
import faulthandler
import sys
import time
import warnings

import torch

from . import accel, sweep
from . import backends as backends_mod
from . import report as report_mod


def _parser():
    ap = argparse.ArgumentParser(prog="python -m flash_metal.selfcheck", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["mps", "metal-emu"], default=None,
                    help="mps: this Mac's GPU (default where MPS is available); metal-emu: the project's Metal "
                         "emulator, in a source checkout")
    ap.add_argument("--out", default="selfcheck-report", metavar="DIR",
                    help="directory for selfcheck.md and selfcheck.json (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="every family, option and dtype once, on small shapes")
    ap.add_argument("--only", metavar="TEXT", help="run only the checks whose id contains TEXT (for debugging)")
    ap.add_argument("--no-timing", action="store_true", help="skip the timing table")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    ap.add_argument("--accelerator-only", action="store_true",
                    help="only the platform, the lane probe and the tensor-op section (impl='tensor_ops')")
    ap.add_argument("--no-accelerator", action="store_true", help="skip the tensor-op section")
    ap.add_argument("--source", metavar="DIR", help="the source checkout for --backend metal-emu (default: the "
                                                    "current directory, or the one holding the package)")
    return ap


def make_backend(name, source=None):
    if name == "metal-emu":
        return backends_mod.EmulatorBackend(source)
    return backends_mod.MpsBackend()


def _planner_limits(checks):
    """kernel name -> the planner's N (max_threads_per_threadgroup, when explain() reports it) and the
    largest threadgroup the sweep launched."""
    seen = {}
    for c in checks:
        for launch in c.get("launches", []):
            s = seen.setdefault(launch["kernel"], {"planner_max": None, "largest": 0})
            s["largest"] = max(s["largest"], launch["threads"])
            n = launch.get("max_threads_per_threadgroup")
            if n is not None:
                s["planner_max"] = max(s["planner_max"] or 0, int(n))
    return seen


def _summary(report):
    checks = report.get("checks", [])
    failures = [f"{c['id']}: {c['status']}: {c['message']}" for c in checks if c["status"] != "passed"]
    lp = report.get("lane_probe", {})
    if lp.get("status") in ("failed", "error"):
        failures.insert(0, f"lane-layout probe: {lp['status']}: {lp.get('detail')}")
    ba = report.get("build_all", {})
    if ba.get("status") == "failed":
        failures.append(f"building every planner pipeline failed: {ba.get('detail')}")
    bad_pipes = [p for p in report.get("pipelines", {}).get("rows", []) if p["status"] == "failed"]
    failures += [f"pipeline {p['name']}: {p['note']}" for p in bad_pipes]
    failures += accel.failures(report.get("accelerator"))
    return {"checks": len(checks), "passed": sum(c["status"] == "passed" for c in checks),
            "failed": sum(c["status"] == "failed" for c in checks),
            "errors": sum(c["status"] == "error" for c in checks), "pipelines_failed": len(bad_pipes),
            "failures": failures}


def run(backend, args) -> dict:
    """The whole selfcheck on `backend`; every warning raised on the way (a runtime-compile fallback, say)
    is kept in the report."""
    with warnings.catch_warnings(record=True) as caught:
        # What torch and flash_metal warn about (UserWarning, as TORCH_WARN raises); not Python's own
        # resource or deprecation chatter, nor the deterministic mode the sweep turns on to poison outputs.
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", UserWarning)
        warnings.filterwarnings("ignore", message=".*deterministic", category=UserWarning)
        report = _run(backend, args)
    seen = dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught)
    report["warnings"] = [w[:1000] for w in seen][:50]
    return report


def _checkpoint(report, args, running):
    """Writes the report so far, marked incomplete with what is running: if the process dies inside a
    kernel (a GPU fault, a hang killed by CI), the files say where."""
    if args.out:
        report_mod.write({**report, "status": "incomplete", "running": running, "passed": False,
                          "summary": _summary(report)}, args.out)


def _run(backend, args) -> dict:
    t0 = time.perf_counter()
    only_accel = args.accelerator_only
    cases = [] if only_accel else [c for c in sweep.cases(args.quick) if not args.only or args.only in c.id]
    timing = not args.no_timing and not args.only and not only_accel
    n_timing = len(sweep.timing_cases(backend.timing_device, args.quick)) if timing else 0
    accel_plan = accel.plan(backend, args)
    n_accel = len(accel_plan["cases"]) + len(accel_plan["timing"])
    progress = report_mod.Progress(3 + len(cases) + n_timing + n_accel, enabled=not args.no_progress)
    report = {"tool": "flash_metal.selfcheck", "schema": 1, "backend": backend.name, "quick": args.quick,
              "only": args.only, "platform": backend.platform()}
    progress.step("platform")
    _checkpoint(report, args, "the lane-layout probe")
    # The probe first: if the lane layout is not the one the kernels assume, every prefill and backward
    # result below is wrong, and this says why.
    if only_accel and not accel_plan["status"]["usable"]:
        report["lane_probe"] = {"status": "skipped", "runner": "",
                                "detail": "--accelerator-only, and the accelerator section does not run here"}
    else:
        report["lane_probe"] = backend.lane_probe()
    progress.step(f"lane-layout probe: {report['lane_probe']['status']}")
    _checkpoint(report, args, "building every pipeline the planner can name")
    report["build_all"] = ({"status": "skipped", "detail": "--accelerator-only"} if only_accel else
                           backend.build_all_pipelines())
    report["library"] = backend.library(report["build_all"])
    progress.step("pipelines")
    checks, failed = [], 0
    with sweep.poisoned_allocations() as poisoned:
        for case in cases:
            report["checks"] = checks
            _checkpoint(report, args, f"check {case.id}")
            record = sweep.run_case(backend, case)
            failed += record["status"] != "passed"
            checks.append(record)
            progress.step(case.id, failed)
    report["poisons_outputs"] = poisoned or backend.poisons_outputs
    report["checks"] = checks
    report["pipelines"] = backend.pipelines(_planner_limits(checks))
    _checkpoint(report, args, "the accelerator section")
    report["accelerator"] = accel.run_section(backend, args, accel_plan, progress)
    _checkpoint(report, args, "the timing table")
    if timing:
        where = ("this Mac's GPU (MPS)" if backend.timing_device == "mps" else
                 "this machine's CPU: the metal-emu backend's kernels are emulated, so this times flash_metal's "
                 "CPU kernel instead (no Metal timing)")
        report["timing"] = {"device": backend.timing_device,
                            "note": f"Measured on {where}: medians after a warm-up, one run of this command; "
                                    "speed > 1 means flash_metal is faster.",
                            "rows": sweep.run_timing(backend.timing_device, args.quick, progress)}
    else:
        report["timing"] = {"note": "not measured (--no-timing or --only)", "rows": []}
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    report["summary"] = _summary(report)
    report["passed"] = not report["summary"]["failures"] and report["lane_probe"]["status"] in ("passed", "skipped")
    report["status"] = "passed" if report["passed"] else "failed"
    return report


def _not_run(name, reason) -> dict:
    report = {"tool": "flash_metal.selfcheck", "schema": 1, "backend": name, "status": "not run", "passed": False,
              "reason": reason, "platform": {**backends_mod.base_platform(), "backend": name}, "lane_probe": {},
              "checks": [], "pipelines": {}, "timing": {}}
    report["summary"] = _summary(report)
    return report


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    faulthandler.enable()  # a crash inside a kernel call still prints where it happened
    if args.only and not any(args.only in c.id for c in sweep.cases(args.quick)) and not any(
            args.only in accel.case_id(c) for c in accel.cases(args.quick)):
        print(f"flash_metal.selfcheck: --only {args.only!r} matches no check", file=sys.stderr)
        return 2
    name = args.backend
    if name is None:
        name = "mps" if hasattr(torch.backends, "mps") and torch.backends.mps.is_available() else None
    if name is None:
        reason = (f"no MPS device here (torch.backends.mps.is_available() is False: {sys.platform}, torch "
                  f"{torch.__version__}), so there is no Metal GPU to check. On a Mac with Apple silicon, install an "
                  "MPS-enabled torch. In a source checkout on Linux, `python -m flash_metal.selfcheck --backend "
                  "metal-emu` runs the same checks through the project's Metal emulator.")
        print(f"flash_metal.selfcheck: cannot run: {reason}", file=sys.stderr)
        report_mod.write(_not_run("mps", reason), args.out)
        return 2
    try:
        backend = make_backend(name, args.source)
        if hasattr(backend, "prepare"):
            if not args.no_progress:
                print("flash_metal.selfcheck: building the emulator's library (cached after the first run)...",
                      file=sys.stderr)
            backend.prepare()
    except Exception as err:  # noqa: BLE001  (Unavailable, or the emulator's build failing: a message, no traceback)
        if not isinstance(err, backends_mod.Unavailable):
            err = f"the {name} backend failed to start: {type(err).__name__}: {str(err)[:3000]}"
        print(f"flash_metal.selfcheck: cannot run: {err}", file=sys.stderr)
        report_mod.write(_not_run(name, str(err)), args.out)
        return 2
    report = run(backend, args)
    md, js = report_mod.write(report, args.out)
    s = report["summary"]
    print(f"flash_metal selfcheck ({report['backend']}): {report['status'].upper()}: {s['passed']}/{s['checks']} "
          f"checks passed, lane probe {report['lane_probe']['status']}, {s['pipelines_failed']} pipeline(s) failed")
    for f in s["failures"][:20]:
        print(f"  FAILED {f}")
    print(f"report: {md} and {js} (please paste {md} into an issue)")
    return 0 if report["passed"] else 1
