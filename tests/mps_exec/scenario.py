"""One fresh process running the host once: `python scenario.py '<json>'`.

library.mm loads its shader library once per process, so each library path
(metallib, runtime compile, fallbacks, errors) and each planted-bug build
runs in its own process. The spec (JSON):
  lib            built library (mps_exec.build())
  dir            where to lay out the package look-alike
  metallib       "fresh" | "stale" | "unloadable" | "none"      (default "fresh")
  shaders        ship shaders/ next to the library               (default true)
  drop_kernel    a kernel name left out of the fake metallib     (default none)
  mpp_metallib   the same states for the MSL 4 library, of the tensor-op kernels   (default "none")
  env            environment variables set before the first call
  knobs          fake knobs (Host.configure)
  runtime_compile  "emulator": newLibraryWithSource: yields the kernels the
                 emulator finds in the recorded source | "fail:<message>"
  case           {B, Hq, Hkv, Nq, Nk, D, dtype, layout, causal, impl, seed}; layout
                 as numerics.make_qkv's, or "mixed" (q transposed, k offset slice, v packed)
  check          instead of a case: the name of a function in mps_exec/checks.py,
                 called as f(host, library, **args) (args: "args", default {});
                 the same assertions the suite makes in process; what it
                 returns (JSON) is the result's "value"
Prints one JSON object: stage ("op", "replay", "oracle", "check" or null when
all passed), error, warnings, errors (the fakes'), events (sources elided),
source_path (the recorded runtime-compile source, if any).
"""
import hashlib
import json
import os
import sys
import warnings

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)

import torch  # noqa: E402

from repo_paths import put_groups_on_path  # noqa: E402

put_groups_on_path()  # the checks import helpers from test files (test_sinks)

import mps_exec  # noqa: E402
from metal_emulator import preprocessed  # noqa: E402
from shader_builds import shipped_library  # noqa: E402
from numerics import assert_attention_close, make_qkv  # noqa: E402


def main(spec: dict) -> dict:
    shipped = shipped_library(path=mps_exec.SHADER)
    # The metallib's kernels: all of the source's, the ones the emulator's default build left out too.
    names = [n for n in shipped.source_kernel_names() if n != spec.get("drop_kernel")]
    mpp_state = spec.get("mpp_metallib", "none")
    mpp = mps_exec.mpp_library(spec.get("case", {}).get("D")) if mpp_state != "none" else None
    path = mps_exec.package_dir(spec["lib"], spec["dir"], spec.get("metallib", "fresh"), names,
                                spec.get("shaders", True), mpp_state, mpp.source_kernel_names() if mpp else None)
    os.environ.update(spec.get("env", {}))
    host = mps_exec.load(path)
    host.configure(**spec.get("knobs", {}))
    compile_mode = spec.get("runtime_compile", "emulator")
    if compile_mode == "emulator":
        # What the runtime compiler would find; checked below against the
        # emulator's compile of the source actually handed over.
        host.set_runtime_compile(shipped.source_kernel_names())
    else:
        host.set_runtime_compile((), compile_mode.split(":", 1)[1])
    if "check" in spec:
        return run_check(host, shipped, spec)

    c = spec["case"]
    g = torch.Generator().manual_seed(c.get("seed", 0))
    dims = (c["B"], c["Hq"], c["Hkv"], c["Nq"], c["Nk"], c["D"], getattr(torch, c["dtype"]))
    if c["layout"] == "mixed":  # q transposed, k an offset slice, v packed
        q = make_qkv(*dims, layout="transposed", generator=g)[0]
        k = make_qkv(*dims, layout="offset_slice", generator=g)[1]
        v = make_qkv(*dims, layout="contiguous", generator=g)[2]
    else:
        q, k, v = make_qkv(*dims, layout=c["layout"], generator=g)
    result = {"stage": None, "error": None, "warnings": [], "source_path": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            rec, tensors = host.run(q, k, v, c["causal"], None, c["impl"])
        except Exception as err:  # noqa: BLE001  (reported to the test)
            result.update(stage="op", error=str(err))
            rec = host.take_recording()
    result["warnings"] = [str(w.message) for w in caught]
    result["errors"] = rec.get("errors", [])
    library = shipped
    for e in rec.get("events", []):
        if e["op"] == "newLibraryWithSource":
            # A path named by the content: the emulator caches its builds by
            # path and content, so every scenario handing over the same
            # source shares one build.
            source = e.pop("source")
            digest = hashlib.sha256(source.encode()).hexdigest()[:20]
            result["source_path"] = os.path.join(mps_exec.CACHE_DIR, "recorded", digest, "attention.metal")
            if not os.path.exists(result["source_path"]):
                os.makedirs(os.path.dirname(result["source_path"]), exist_ok=True)
                tmp = f"{result['source_path']}.{os.getpid()}"
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(source)
                os.replace(tmp, result["source_path"])
            # The recorded source preprocesses to the shipped shaders' text
            # (tokens of the pre-passed sources, as the emulator's compiler
            # sees them), so it compiles to the shipped library: replayed
            # against that build, not a second full build of the same code.
            if preprocessed(result["source_path"]) != preprocessed(mps_exec.SHADER):
                result.update(stage="replay", error="the recorded source preprocesses to other code than the shipped shaders")
    result["events"] = rec.get("events", [])
    if result["stage"] is not None:
        return result
    try:
        mps_exec.replay(rec, library, mpp)
    except Exception as err:  # noqa: BLE001
        result.update(stage="replay", error=f"{type(err).__name__}: {err}")
        return result
    try:
        assert_attention_close(host.to_cpu(tensors[3]), host.to_cpu(tensors[4]), q, k, v, c["causal"])
    except AssertionError as err:
        result.update(stage="oracle", error=str(err))
    return result


def run_check(host, library, spec: dict) -> dict:
    """Runs mps_exec.checks.<spec["check"]> on the loaded host."""
    from mps_exec import checks

    result = {"stage": None, "error": None, "warnings": [], "source_path": None, "errors": [], "events": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result["value"] = getattr(checks, spec["check"])(host, library, **spec.get("args", {}))
        except Exception as err:  # noqa: BLE001  (AssertionError included: reported to the test)
            result.update(stage="check", error=f"{type(err).__name__}: {err}")
    result["warnings"] = [str(w.message) for w in caught]
    return result


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
