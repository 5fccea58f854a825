"""Building every Metal pipeline at once (issue 18, item 12), through the executed MPS host.

metal_build_all_pipelines (what the macOS CI and the self-check run) builds the
pipeline of every (kernel, function constants) pair with dispatch_apply on a
global concurrent queue; library.mm's cache releases its lock while Metal
compiles. Here the fakes run dispatch_apply on real threads and make every
build take a while, so builds that the host lets overlap do overlap, and a
race in the cache is a real race:

- on a cold cache (a fresh process each), the concurrent build equals the
  sequential one (one worker thread), builds each pipeline once and caches it
  once, and more than one build runs at a time;
- a kernel the compiler rejects: one error counting and naming every failed
  pipeline, no exception escapes a dispatch_apply block, the process carries
  on, and a retry builds only the failed ones;
- threads racing for one uncached pipeline all get the same one, several
  built it, and exactly one is kept (the others released).

Each check is proven by a planted bug (tests/mps_exec/plants.py): builds
serialized by a lock, and the throwing get_pipeline inside the block, by
default; with FLASH_METAL_MPS_EXEC_ALL_PLANTS=1 also the old sequential loop,
an error that stops at the first failure, and a racing build never released.
"""
import json
import os
import subprocess
import sys

import pytest

import mps_exec
from mps_exec import checks
from mps_exec.plants import SCENARIO, noticed, run_plants, run_scenarios


from mps_exec.fixtures import built, emu, host  # noqa: F401  (pytest fixtures, by name)


@pytest.fixture(scope="session")
def cold_builds(built, emu, tmp_path_factory):  # emu: its disk cache is warm before the processes start
    specs = {
        "concurrent": {"check": "builds_pipelines_concurrently", "args": {"threads": 4}},
        "sequential": {"check": "builds_pipelines_concurrently", "args": {"threads": 1}},
        "failures": {"check": "pipeline_failures_reported"},
        # Below the decode kernels' declared 256 threads, above every other kernel's N (128 at most).
        "below_n": {"check": "pipelines_below_their_declared_n_fail", "args": {"limit": 128}},
    }
    return run_scenarios({n: {"lib": built, **s} for n, s in specs.items()},
                         lambda name: tmp_path_factory.mktemp(f"pipelines_{name}"))


def _value(result):
    assert result["stage"] is None, result["error"]
    assert result["errors"] == [], result["errors"]
    return result["value"]


def test_all_pipelines_build_concurrently(cold_builds):
    concurrent = _value(cold_builds["concurrent"])
    assert concurrent["most_concurrent"] > 1 and len(concurrent["built"]) > 100
    # The registry's packed GQA prefills (fc_pack_gqa, constant 13) are built like any other pair.
    pairs = [entry.rsplit("/", 1) for entry in concurrent["built"]]
    assert any(n.startswith("flash_attention_prefill_") and "mpp" not in n and bits[13:14] == "1" for n, bits in pairs)


def test_concurrent_build_equals_the_sequential_one(cold_builds):
    concurrent, sequential = _value(cold_builds["concurrent"]), _value(cold_builds["sequential"])
    assert sequential["most_concurrent"] == 1  # the fake really ran it on one thread
    assert concurrent["built"] == sequential["built"]  # same pipelines, in the planner's order
    for r in (concurrent, sequential):  # each process its own package directory, both the metallib
        assert r["origin"].startswith("the precompiled ") and r["origin"].endswith(mps_exec.METALLIB_NAME), r


def test_failed_pipelines_are_all_named_in_one_error(cold_builds):
    failed = _value(cold_builds["failures"])
    kernels = {entry.rsplit("/", 1)[0] for entry in failed["reported"]}
    assert len(kernels) == 2 and len(failed["reported"]) >= 2  # every pair of both kernels, not the first only
    assert failed["message"].startswith("flash_metal.metal_build_all_pipelines: ")


def test_a_pipeline_below_the_declared_n_fails(cold_builds, emu):
    # The planner may launch a kernel with up to its declared N threads, so a pipeline admitting fewer
    # fails the build check, named with N: at a limit of 128, exactly the kernels declaring N = 256
    # fail, all of them: the one-pass and split decode kernels, and (issue 19) the prefill and both
    # backward kernels. (all_metal_launches plans each kernel at its largest threadgroup; the check
    # compares with N too, so it holds if that ever changes.)
    failed = _value(cold_builds["below_n"])
    decode = {k for k in emu.source_kernel_names()
              if k.startswith(("flash_decode_", "flash_decode_split_", "flash_attention_prefill_",
                               "flash_backward_")) and not k.startswith("flash_decode_merge_")}
    assert all(emu.max_threads(k) == 256 for k in decode)
    assert set(failed["named"]) == decode, sorted(set(failed["named"]) ^ decode)
    assert "fewer than the 256 the planner may launch it with" in failed["message"]


def test_racing_threads_share_one_pipeline(host, emu):
    checks.racing_builds_share_one_pipeline(host, emu)


# --- planted bugs --------------------------------------------------------------------------------

ALL = os.environ.get("FLASH_METAL_MPS_EXEC_ALL_PLANTS") == "1"
SUITE_PLANTS = ["builds_serialized", "throwing_call_in_block"]
EXTRA_PLANTS = ["pipelines_in_a_loop", "first_failure_only", "racing_build_not_released"]


@pytest.fixture(scope="session")
def plant_results(built, emu, tmp_path_factory):
    names = SUITE_PLANTS + (EXTRA_PLANTS if ALL else [])
    return run_plants(names, {}, lambda name: tmp_path_factory.mktemp(f"plant_{name}"))


@pytest.mark.parametrize("name", SUITE_PLANTS + EXTRA_PLANTS)
def test_planted_pipeline_bug_is_caught(plant_results, name):
    if name not in plant_results:
        pytest.skip("one .mm compile per plant: FLASH_METAL_MPS_EXEC_ALL_PLANTS=1 runs it")
    r = plant_results[name]
    assert noticed(r), f"plant {name} went unnoticed: {r}"


def test_a_throwing_block_is_what_the_fake_reports(plant_results):
    # The throwing plant is caught for the right reason: the fake saw the
    # exception leave a dispatch_apply block (on macOS: the process dies).
    r = plant_results["throwing_call_in_block"]
    assert r["stage"] == "check" and "exception escaped a dispatch_apply block" in r["error"], r["error"]


def test_serialized_builds_are_caught_for_the_right_reason(plant_results):
    r = plant_results["builds_serialized"]
    assert r["stage"] == "check" and "built one at a time" in r["error"], r["error"]


# --- under ThreadSanitizer (opt-in: FLASH_METAL_MPS_EXEC_TSAN=1; a full instrumented build) -------

# The cache's insert without its lock: a real data race, but one that shows
# only sometimes as a wrong result; ThreadSanitizer reports it every time.
_UNLOCKED_INSERT = ("    std::lock_guard<std::mutex> lock(mutex());\n    auto [it, inserted] = pipelines().emplace(key, built);",
                    "    auto [it, inserted] = pipelines().emplace(key, built);")
_TSAN_CHECKS = {"concurrent": ("builds_pipelines_concurrently", {}), "failures": ("pipeline_failures_reported", {}),
                "race": ("racing_builds_share_one_pipeline", {"rounds": 10})}


def _tsan_reports(directory) -> list[str]:
    return sorted(str(p) for p in directory.glob("tsan.*"))


@pytest.mark.skipif(os.environ.get("FLASH_METAL_MPS_EXEC_TSAN") != "1",
                    reason="a ThreadSanitizer build of the whole host: FLASH_METAL_MPS_EXEC_TSAN=1 runs it")
def test_concurrent_builds_are_clean_under_thread_sanitizer(built, emu, tmp_path_factory):
    with open(os.path.join(mps_exec.ROOT, "csrc", "mps", "library.mm"), encoding="utf-8") as f:
        library = f.read()
    assert library.count(_UNLOCKED_INSERT[0]) == 1, "update _UNLOCKED_INSERT to library.mm's keep()"
    libs = {"clean": mps_exec.build(sanitize="thread"),
            "unlocked": mps_exec.build({"library.mm": library.replace(*_UNLOCKED_INSERT)}, sanitize="thread")}
    logs = {name: tmp_path_factory.mktemp(f"tsan_{name}") for name in libs}
    env = {name: {"LD_PRELOAD": mps_exec.tsan_runtime(),
                  # exitcode=0: a report is read from the log, not taken for a crash
                  "TSAN_OPTIONS": f"report_signal_unsafe=0 exitcode=0 log_path={logs[name] / 'tsan'}"}
           for name in libs}
    specs = {c: {"lib": libs["clean"], "check": check, "args": args} for c, (check, args) in _TSAN_CHECKS.items()}
    results = {"clean": run_scenarios(specs, lambda c: tmp_path_factory.mktemp(f"tsan_clean_{c}"), env["clean"])}
    # The planted race may corrupt the map badly enough to crash the process: run it without
    # run_scenarios' crash check; the report is what counts.
    spec = {"lib": libs["unlocked"], "dir": str(tmp_path_factory.mktemp("tsan_unlocked_pkg")),
            "check": "builds_pipelines_concurrently"}
    proc = subprocess.run([sys.executable, SCENARIO, json.dumps(spec)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", **env["unlocked"]})
    results["unlocked"] = proc.stdout[-2000:] + proc.stderr[-2000:]
    for check, r in results["clean"].items():
        assert r["stage"] is None and r["errors"] == [], (check, r["error"], r["errors"])
    assert _tsan_reports(logs["clean"]) == [], open(_tsan_reports(logs["clean"])[0]).read()[:4000]
    # Planted: the insert without the lock. ThreadSanitizer must see the race in keep().
    reports = _tsan_reports(logs["unlocked"])
    assert reports, f"no ThreadSanitizer report for the unlocked insert: {results['unlocked']}"
    text = "".join(open(p, encoding="utf-8").read() for p in reports)
    assert "WARNING: ThreadSanitizer: data race" in text and "keep(" in text, text[:4000]
