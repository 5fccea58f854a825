"""Planted bugs in the MPS host, and the fresh processes that run them.

A plant is a realistic one-line bug applied by regex to a temporary copy of
one csrc/mps/*.mm file; the planted build runs in its own process
(scenario.py), either on a forward case or on a check of checks.py, and the
test asserts the run noticed: the replay failed, the oracle or the check
disagreed, or the fakes recorded an error. A pattern that no longer matches
fails the test: update it to the current code.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from ._build import ROOT, build

SCENARIO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scenario.py")


class Plant(NamedTuple):
    file: str                # in csrc/mps/
    pattern: str             # must match exactly once
    replacement: str
    spec: dict | None = None  # scenario spec (default: a forward case with q transposed, k and v offset slices)


# The first four are binding bugs the oracle comparison catches; the next three
# break the encoding rules, which the fakes catch; the rest are the bugs of
# issue 18 (items 5, 6) and issue 23 (item 3), each caught by its own check.
PLANTS = {
    "k_v_swapped": Plant(
        "attention_mps.mm", r"put\(LaunchTensor::K, c\.k\);\n  put\(LaunchTensor::V, c\.v\);\n  put\(LaunchTensor::Out, o\.out4\);",
        "put(LaunchTensor::K, c.v);\n  put(LaunchTensor::V, c.k);\n  put(LaunchTensor::Out, o.out4);"),
    "offset_in_elements": Plant("attention_mps.mm", r"t\.storage_offset\(\) \* t\.element_size\(\)", "t.storage_offset()"),
    "threadgroup_memory_index_1": Plant(
        "attention_mps.mm", r"setThreadgroupMemoryLength:r\.threadgroup_memory atIndex:[\w.]+\]",
        "setThreadgroupMemoryLength:r.threadgroup_memory atIndex:1]"),
    "out_strides_from_q": Plant("attention_mps.mm", r"strides4\(out4\)", "strides4(c.q)"),
    "encoder_taken_outside_dispatch_sync": Plant(
        "attention_mps.mm",
        r"dispatch_sync\(stream->queue\(\), \^\{\s*@autoreleasepool \{\s*for \(const ResolvedLaunch& r : launches\) \{"
        r"\s*id<MTLComputeCommandEncoder> encoder = stream->commandEncoder\(\);",
        "id<MTLComputeCommandEncoder> encoder = stream->commandEncoder();\n"
        "  dispatch_sync(stream->queue(), ^{\n    @autoreleasepool {\n      for (const ResolvedLaunch& r : launches) {"),
    "shared_encoder_ended": Plant(
        "attention_mps.mm", r"(\[encoder dispatchThreadgroups:r\.grid threadsPerThreadgroup:r\.group\];)",
        r"\1 [encoder endEncoding];"),
    "function_released_twice": Plant("library.mm", r"\[function release\];", "[function release]; [function release];"),
    # Issue 18, item 5: the encoder fetched once for the whole plan (the old code).
    "encoder_fetched_once": Plant(
        "attention_mps.mm",
        r"@autoreleasepool \{\s*for \(const ResolvedLaunch& r : launches\) \{\s*"
        r"id<MTLComputeCommandEncoder> encoder = stream->commandEncoder\(\);",
        "@autoreleasepool {\n      id<MTLComputeCommandEncoder> encoder = stream->commandEncoder();\n"
        "      for (const ResolvedLaunch& r : launches) {",
        {"check": "profiled_multi_dispatch"}),
    # Issue 18, item 6: the system default device (nil in a non-interactive process).
    "system_default_device": Plant(
        "pipelines.mm", r"id<MTLDevice> device = metal_device\(\);",
        "id<MTLDevice> device = MTLCreateSystemDefaultDevice();", {"check": "builds_all_pipelines"}),
    # Issue 23, item 3: gradients bound with another tensor's strides.
    "grad_lse_with_lse_strides": Plant(
        "attention_mps.mm", r"strides\.grad_lse = \{glse\.stride\(0\), glse\.stride\(1\), glse\.stride\(2\)\};",
        "strides.grad_lse = {t.lse3.stride(0), t.lse3.stride(1), t.lse3.stride(2)};", {"check": "backward_layouts"}),
    "grad_out_with_out_strides": Plant(
        "attention_mps.mm", r"strides\.grad_out = strides4\(t\.grad_out4\);", "strides.grad_out = strides4(t.out4);",
        {"check": "backward_layouts"}),
    "out_with_grad_out_strides": Plant(
        "attention_mps.mm", r"launch_strides\(c, t\.out4, t\.lse3\)", "launch_strides(c, t.grad_out4, t.lse3)",
        {"check": "backward_layouts"}),
    # Issue 18, item 12: building every pipeline at once.
    "builds_serialized": Plant(  # a lock held while building (what the cache did before)
        "library.mm", r"(\n    std::string error;\n    const Pipeline built = build_pipeline\()",
        r"\n    static std::mutex one_at_a_time;\n    std::lock_guard<std::mutex> hold(one_at_a_time);\1",
        {"check": "builds_pipelines_concurrently"}),
    "throwing_call_in_block": Plant(  # the throwing get_pipeline inside the dispatch_apply block
        "pipelines.mm", r"out\[i\] = try_get_pipeline\(device, in\[i\]\.kernel_name, in\[i\]\.constants\);",
        "out[i].pipeline = get_pipeline(device, in[i].kernel_name, in[i].constants);",
        {"check": "pipeline_failures_reported"}),
    "pipelines_in_a_loop": Plant(  # the loop of before: no dispatch_apply
        "pipelines.mm", r"dispatch_apply\(requests\.size\(\), dispatch_get_global_queue\(DISPATCH_QUEUE_PRIORITY_DEFAULT, 0\), "
        r"\^\(size_t i\) \{([\s\S]*?)\n  \}\);", r"for (size_t i = 0; i < requests.size(); ++i) {\1\n  }",
        {"check": "builds_pipelines_concurrently"}),
    "first_failure_only": Plant(  # stops at the first failing pipeline
        "pipelines.mm", r'failures \+= "\\n  " \+ entry \+ ": " \+ problem;',
        'TORCH_CHECK(false, "flash_metal: ", entry, ": ", problem);',
        {"check": "pipeline_failures_reported"}),
    "racing_build_not_released": Plant(  # the losing thread's pipeline leaks
        "library.mm", r"\n  \[built\.state release\];", "", {"check": "racing_builds_share_one_pipeline"}),
}


def planted(name: str) -> dict[str, str]:
    """{file: text} of the planted copy."""
    p = PLANTS[name]
    with open(os.path.join(ROOT, "csrc", "mps", p.file), encoding="utf-8") as f:
        text = f.read()
    out, n = re.subn(p.pattern, p.replacement, text)
    assert n == 1, f"plant {name}: /{p.pattern}/ matches {n} times in {p.file}; update mps_exec/plants.py"
    return {p.file: out}


def run_scenarios(specs: dict[str, dict], directory, env: dict | None = None) -> dict[str, dict]:
    """Runs scenario.py once per {name: spec}, two at a time (each a fresh process, with `env` added to its
    environment from the start), each in its own directory made by directory(name). Returns {name: result}
    (scenario.py's JSON, plus stderr)."""
    def one(item):
        name, spec = item
        spec = {"dir": str(directory(name)), **spec}
        proc = subprocess.run([sys.executable, SCENARIO, json.dumps(spec)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})
        assert proc.returncode == 0, f"scenario {name} crashed:\n{proc.stderr[-4000:]}"
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["stderr"] = proc.stderr
        return name, result

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(one, specs.items()))


def run_plants(names, default_spec: dict, directory) -> dict[str, dict]:
    """Builds each plant (one .mm compile each) and runs it in its own process."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        libs = dict(zip(names, pool.map(lambda n: build(planted(n)), names)))
    return run_scenarios({n: {**default_spec, **(PLANTS[n].spec or {}), "lib": libs[n]} for n in names}, directory)


def noticed(result: dict) -> bool:
    """The planted run failed somewhere it must: replay, oracle, a check, or a fake's error."""
    return result["stage"] in ("replay", "oracle", "check") or bool(result["errors"])
