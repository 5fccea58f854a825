"""python -m flash_metal.selfcheck's accelerator section (issue 21): the Metal 4 tensor-op prefill and backward.

Where metal_device_info says Auto runs the tensor-op kernels (its "tensor_ops"
answer: an Apple 10 GPU, macOS 26.2, the MSL 4 library, the
FLASH_METAL_DISABLE_TENSOR_OPS switch not set; the routing's own rule), every
case runs impl="tensor_ops" and the simdgroup prefill (impl="prefill") on the
same inputs, each against the float64 oracle by FlashAttention's 2x rule, and
checks that the launched kernels are the ones asked for; then both are timed
on the same inputs, in the same run, as a ratio. The backward cases run
impl="tensor_ops" on attention_backward and the simdgroup backward (impl="auto"
with FLASH_METAL_DISABLE_TENSOR_OPS=1 for that call, which keeps Auto off the
tensor-op kernels), both against float64; then both backwards are timed the
same way (a row per shape: tensor-op ms, simdgroup ms, their ratio, measured
on this Mac's GPU in this run). Elsewhere the section says
"skipped" and why. --backend metal-emu runs the cases in the Metal emulator
(cooperative tensors in its scrambled lane layout): correctness only, never a
timing.
"""
import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import List, Optional

import torch

from . import sweep

DTYPES = (torch.float16, torch.bfloat16)
# The head dims the tensor-op kernels are instantiated for (csrc/metal/families/tensor_ops.cpp), and 256
# split along D (attention_prefill_mpp_dsplit.h forward, attention_backward_mpp_dsplit.h backward).
HEAD_DIMS = (64, 96, 128)
FORWARD_HEAD_DIMS = HEAD_DIMS + (256,)
# The MLA pair both passes serve (q/k 192, v 128: DeepSeek-V2/V3 prefill and training).
MLA_DIMS = (192, 128)
# Why this shape: GQA (4 query heads on 2 KV heads); 70 query rows, one full
# 64-row block and a ragged one; 90 keys, two full 32-key blocks and a ragged
# one; more keys than queries, so causal masking (bottom-right) cuts mid-block.
SHAPE = (1, 4, 2, 70, 90)
MPP_PREFIX = "flash_attention_prefill_mpp_"
SIMDGROUP_PREFIX = "flash_attention_prefill_"
MPP_BACKWARD_PREFIX = "flash_backward_mpp_"
SIMDGROUP_BACKWARD_PREFIX = "flash_backward_"
# The switch the simdgroup backward's run sets (csrc/metal/plan.h, kDisableTensorOpsEnv).
DISABLE_ENV = "FLASH_METAL_DISABLE_TENSOR_OPS"
# setup.py's switch that makes a missing MSL 4 library an install error (the macOS 26 CI leg).
REQUIRE_ENV = "FLASH_METAL_REQUIRE_MPP_METALLIB"


@dataclass(frozen=True)
class ForcedCase(sweep.Case):
    """A prefill case run with a forced impl; its inputs (seeded by id) are the prefill case's, whatever the impl."""

    forced: str = "tensor_ops"

    @property
    def impl(self) -> str:
        return self.forced


def cases(quick: bool) -> List[sweep.Case]:
    """Full: every dtype x head dim x causal. Quick: each dtype, head dim and causal value at least once."""
    grid = [(dt, d, causal) for dt in DTYPES for d in FORWARD_HEAD_DIMS for causal in (True, False)]
    if quick:
        grid = [(torch.float16, 64, True), (torch.bfloat16, 96, False), (torch.float16, 128, False),
                (torch.bfloat16, 128, True), (torch.float16, 256, True)]
    forward = [sweep.Case("prefill", dt, d, SHAPE, causal=causal) for dt, d, causal in grid]
    # The backward (attention_backward_mpp.h; D = 256 split along D, attention_backward_mpp_dsplit.h, in the
    # full grid): with a gradient into lse; quick: two cases. Both: one with the options (a bool key-padding
    # mask, a left window, softcap) on top.
    bgrid = [(torch.float16, 64, True), (torch.bfloat16, 128, False)] if quick else grid
    backward = [sweep.Case("backward", dt, d, SHAPE, causal=causal, grad_lse=True) for dt, d, causal in bgrid]
    options = sweep.Case("backward", torch.float16, 96, SHAPE, causal=True, mask="bool", window_left=40, softcap=4.0,
                         grad_lse=True)
    # The MLA pair, forward and backward, in the full grid (the macOS 26 CI leg's): both dtypes, causal and not.
    mgrid = [] if quick else [(dt, causal) for dt in DTYPES for causal in (True, False)]
    dqk, dv = MLA_DIMS
    mla = [sweep.Case(family, dt, dqk, SHAPE, causal=causal, grad_lse=family == "backward", dv=dv)
           for family in ("prefill", "backward") for dt, causal in mgrid]
    return forward + backward + [options] + mla


def case_id(case: sweep.Case) -> str:
    if case.backward:
        return "tensor_ops_backward" + case.id[len("backward"):]
    return "tensor_ops" + case.id[len("prefill"):]


def timing_shapes(quick: bool) -> List[tuple]:
    """(B, Hq, Hkv, N, D, causal, dtype) on a Mac: LLM prefills, and MLX's measured M5 Max point
    (f16, 1x32(8)x4096x96: 4.13 ms for its accelerator kernel, MLX PR #3943) for comparison."""
    if quick:
        return [(1, 16, 4, 1024, 128, True, torch.float16)]
    out = [(1, 16, 4, 2048, d, True, dt) for dt in DTYPES for d in FORWARD_HEAD_DIMS]
    return out + [(1, 32, 8, 4096, 96, False, torch.float16)]


def backward_timing_shapes(quick: bool) -> List[tuple]:
    """(B, Hq, Hkv, N, D, causal, dtype) for the backward rows: LLM shapes, and the model's point (f16,
    1x32x4096x96 MHA: python -m benchmarks.model accel predicts it for the M5 family, a
    prediction this row can check)."""
    if quick:
        return [(1, 16, 4, 1024, 128, True, torch.float16)]
    out = [(1, 16, 4, 2048, d, True, dt) for dt in DTYPES for d in FORWARD_HEAD_DIMS]
    return out + [(1, 32, 32, 4096, 96, False, torch.float16)]


def status(backend) -> dict:
    """Whether the section runs here, and if not why (metal_device_info's "tensor_ops" on a Mac)."""
    if backend.name == "metal-emu":
        return {"usable": True, "emulated": True, "reason": None,
                "note": "metal-emu: the MSL 4 kernels run in the Metal emulator (scrambled cooperative-tensor "
                        "layout); correctness only, no timing"}
    info = backend.device_info()
    if not info.get("available"):
        return {"usable": False, "emulated": False, "reason": f"no Metal device: {info.get('reason')}"}
    t = info.get("tensor_ops") or {}
    out = {"usable": bool(t.get("usable")), "emulated": False, "reason": t.get("reason"),
           "forced_reason": t.get("forced_reason"), "gpu_family": t.get("gpu_family")}
    if not out["usable"] and not out["reason"]:
        out["reason"] = "metal_device_info does not report tensor_ops (an older build?)"
    return out


# What says that the MSL 4 library itself is missing, stale, unloadable or unfindable, in metal_device_info's
# tensor_ops reasons (csrc/mps/library.mm, load_mpp_library and tensor_ops_library_problem; package_directory's
# refusal when the extension cannot find its own directory). tests/api/test_selfcheck_verdicts.py reads every problem
# string library.mm can return and checks each one's verdict here.
LIBRARY_MARKERS = ("MSL 4 library", "flash_metal_mpp.metallib", "cannot locate the _C extension")


def _library_missing(st: dict) -> Optional[str]:
    """With FLASH_METAL_REQUIRE_MPP_METALLIB=1 (a build that must have the MSL 4 library), a report that the
    library is missing or stale is a failure, not a skip. Both reasons count: on a GPU that Auto leaves to the
    simdgroup kernels (the CI's runners) the library's problem is only in forced_reason."""
    if os.environ.get(REQUIRE_ENV) != "1":
        return None
    for why in (st.get("reason"), st.get("forced_reason")):
        if why and any(marker in why for marker in LIBRARY_MARKERS):
            return f"{REQUIRE_ENV}=1, but the MSL 4 library is not usable: {why}"
    return None


def _run_forced(backend, case, impl, inputs, prefix, not_prefix=None) -> dict:
    run = ForcedCase(**{f.name: getattr(case, f.name) for f in dataclasses.fields(sweep.Case)}, forced=impl)
    rec = {"impl": impl, "kernels": [], "status": "error", "message": "", "worst_ratio": None}
    try:
        result, launches = backend.run(run, inputs)
        rec["kernels"] = [launch["kernel"] for launch in launches]
        comps = sweep.compare(case, inputs, result)
    except Exception as err:  # noqa: BLE001  (reported; the section goes on)
        rec["message"] = f"{type(err).__name__}: {str(err).strip()[:1500]}"
        return rec
    failed = [c.message for c in comps if not c.ok]
    problem = _kernel_problem(impl, rec["kernels"], prefix, not_prefix)
    if problem:
        failed.insert(0, problem)
    measured = [c for c in comps if c.error is not None and c.tolerance]
    worst = max(measured, key=lambda c: c.error / c.tolerance, default=None)
    rec["worst_ratio"] = None if worst is None else worst.error / worst.tolerance
    rec["status"] = "failed" if failed else "passed"
    rec["message"] = "; ".join(failed[:4]) if failed else (f"worst: {worst.message}" if worst else "")
    rec["result"] = result[0]
    return rec


def _kernel_problem(impl, kernels, prefix, not_prefix=None) -> Optional[str]:
    """Why the launched kernels are not the side's (None when they are): a tensor-op side that fell back to the
    simdgroup kernels, or a simdgroup side that ran the tensor ops (which would compare them with themselves)."""
    if not kernels:
        return f"impl='{impl}' launched nothing, not a {prefix}* kernel"
    strays = [k for k in kernels if not_prefix and k.startswith(not_prefix)]
    if strays:
        return (f"impl='{impl}' launched {strays}, tensor-op kernels ({not_prefix}*), where the simdgroup kernels were "
                "asked for: the comparison would set the tensor ops against themselves")
    wrong = [k for k in kernels if not k.startswith(prefix)]
    if wrong:
        return f"impl='{impl}' launched {wrong}, not {prefix}* kernels"
    return None


@contextlib.contextmanager
def _simdgroup_only():
    """FLASH_METAL_DISABLE_TENSOR_OPS=1 for the calls inside: Auto stays off the tensor-op kernels."""
    before = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(DISABLE_ENV, None)
        else:
            os.environ[DISABLE_ENV] = before


def _simdgroup_backward(backend, case, inputs) -> dict:
    """The simdgroup backward on the same inputs: impl='auto' with the switch on for this call."""
    with _simdgroup_only():
        return _run_forced(backend, case, "auto", inputs, SIMDGROUP_BACKWARD_PREFIX, not_prefix=MPP_BACKWARD_PREFIX)


def run_case(backend, case) -> dict:
    """One case: impl='tensor_ops' and the simdgroup kernels (impl='prefill'; for the backward impl='auto' with
    the switch on) on the same inputs, each by the 2x rule."""
    inputs = sweep.make_inputs(case)
    if case.backward:
        tops = _run_forced(backend, case, "tensor_ops", inputs, MPP_BACKWARD_PREFIX)
        simd = _simdgroup_backward(backend, case, inputs)
    else:
        tops = _run_forced(backend, case, "tensor_ops", inputs, MPP_PREFIX)
        simd = _run_forced(backend, case, "prefill", inputs, SIMDGROUP_PREFIX, not_prefix=MPP_PREFIX)
    record = {"id": case_id(case), "dtype": sweep.dtype_name(case.dtype), "head_dim": case.d,
              "head_dim_v": case.dv or case.d, "causal": case.causal, "shape": list(case.shape),
              "options": case.options_text()}
    diff = None
    if "result" in tops and "result" in simd:
        diff = (tops["result"].double() - simd["result"].double()).abs().max().item()
    for rec in (tops, simd):
        rec.pop("result", None)
    record.update(tensor_ops=tops, simdgroup=simd, max_difference=diff)
    bad = [f"{r['impl']}: {r['message']}" for r in (tops, simd) if r["status"] != "passed"]
    record["status"] = "passed" if not bad else ("error" if "error" in (tops["status"], simd["status"]) else "failed")
    record["message"] = "; ".join(bad)
    return record


def run_timing(quick: bool, progress=None) -> List[dict]:
    """Median times of impl='tensor_ops' and impl='prefill' on this Mac's GPU, same inputs, one run."""
    import flash_metal

    rows = []
    for B, Hq, Hkv, n, d, causal, dt in timing_shapes(quick):
        g = torch.Generator().manual_seed(21)
        q, k, v = (torch.randn(B, h, n, d, generator=g).to(dt).to("mps") for h in (Hq, Hkv, Hkv))
        row = {"dtype": sweep.dtype_name(dt), "shape": f"{B}x{Hq}:{Hkv}x{n}x{n}x{d}", "causal": causal}
        try:
            with torch.no_grad():
                for impl in ("tensor_ops", "prefill"):
                    row[f"{impl}_ms"] = sweep._median_ms(
                        lambda impl=impl: flash_metal.attention(q, k, v, causal=causal, impl=impl),
                        torch.mps.synchronize, 5 if quick else 10)
            row["speedup"] = row["prefill_ms"] / row["tensor_ops_ms"]
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        rows.append(row)
        if progress:
            progress.step(f"accelerator timing {row['shape']}")
    return rows


def time_backward(shape, device="mps", sync=None, repeats=10, ops=None) -> dict:
    """One backward row: median ms of attention_backward with impl='tensor_ops' and of the simdgroup backward
    (impl='auto', the switch on for those calls) on the same inputs, in one run, and their ratio
    (speedup = simdgroup ms / tensor_ops ms). out and lse come from one forward (impl='auto'). `device`,
    `sync` and `ops` (torch.ops.flash_metal) are parameters so Linux tests can run the row on fakes; only
    device 'mps' is a Mac figure, and run_timing is only called where it is."""
    ops = ops or torch.ops.flash_metal
    sync = sync or torch.mps.synchronize
    B, Hq, Hkv, n, d, causal, dt = shape
    g = torch.Generator().manual_seed(21)
    q, k, v, grad_out = (torch.randn(B, h, n, d, generator=g).to(dt).to(device) for h in (Hq, Hkv, Hkv, Hq))
    row = {"dtype": sweep.dtype_name(dt), "shape": f"{B}x{Hq}:{Hkv}x{n}x{n}x{d}", "causal": causal}
    try:
        with torch.no_grad():
            out, lse = ops.attention_forward(q, k, v, causal, None, "auto")

            def backward(impl):
                return lambda: ops.attention_backward(grad_out, q, k, v, out, lse, causal, None, None, impl)

            row["tensor_ops_ms"] = sweep._median_ms(backward("tensor_ops"), sync, repeats)
            with _simdgroup_only():
                row["simdgroup_ms"] = sweep._median_ms(backward("auto"), sync, repeats)
        row["speedup"] = row["simdgroup_ms"] / row["tensor_ops_ms"]
    except Exception as err:  # noqa: BLE001  (reported in the row; the section goes on)
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    return row


def run_backward_timing(quick: bool, progress=None, **kw) -> List[dict]:
    rows = []
    for shape in backward_timing_shapes(quick):
        rows.append(time_backward(shape, repeats=5 if quick else 10, **kw))
        if progress:
            progress.step(f"accelerator backward timing {rows[-1]['shape']}")
    return rows


def plan(backend, args) -> dict:
    """What the section will run (for the progress bar's total): the status, the cases, the timing shapes."""
    st = status(backend)
    chosen = [c for c in cases(args.quick) if not args.only or args.only in case_id(c)]
    if not st["usable"] or getattr(args, "no_accelerator", False):
        chosen = []
    timed = st["usable"] and not st["emulated"] and not args.no_timing and not args.only
    shapes = timing_shapes(args.quick) + backward_timing_shapes(args.quick)
    return {"status": st, "cases": chosen, "timing": shapes if timed else []}


def run_section(backend, args, planned: dict, progress=None) -> dict:
    st = planned["status"]
    section = {**st, "checks": [], "timing": {"rows": []}}
    if getattr(args, "no_accelerator", False):
        return {**section, "status": "skipped", "reason": "--no-accelerator"}
    if not st["usable"]:
        missing = _library_missing(st)
        return {**section, "status": "failed" if missing else "skipped", "message": missing}
    for case in planned["cases"]:
        section["checks"].append(run_case(backend, case))
        if progress:
            progress.step(section["checks"][-1]["id"])
    if planned["timing"]:
        section["timing"] = {"note": "Measured on this Mac's GPU: medians after a warm-up, one run of this command, "
                                     "same inputs; speedup = prefill ms / tensor_ops ms.",
                             "rows": run_timing(args.quick, progress),
                             "backward_note": "Measured on this Mac's GPU, as above: attention_backward with "
                                              "impl='tensor_ops' and the simdgroup backward (impl='auto' with "
                                              f"{DISABLE_ENV}=1); speedup = simdgroup ms / tensor_ops ms.",
                             "backward_rows": run_backward_timing(args.quick, progress)}
    else:
        section["timing"]["note"] = ("not measured: " + ("the emulator times nothing" if st["emulated"] else
                                                         "--no-timing or --only"))
    section["status"] = "failed" if any(c["status"] != "passed" for c in section["checks"]) else "passed"
    return section


def failures(section: Optional[dict]) -> List[str]:
    if not section:
        return []
    out = [f"accelerator {c['id']}: {c['status']}: {c['message']}" for c in section.get("checks", [])
           if c["status"] != "passed"]
    if section.get("status") == "failed" and section.get("message"):
        out.append(f"accelerator: {section['message']}")
    t = section.get("timing", {})
    out += [f"accelerator timing {r['shape']}: {r['error']}" for r in t.get("rows", []) if "error" in r]
    out += [f"accelerator backward timing {r['shape']}: {r['error']}" for r in t.get("backward_rows", [])
            if "error" in r]
    return out


def _timing_line(r: dict, baseline: str) -> str:
    """A timing row: tensor_ops ms, the baseline's ms (prefill_ms or simdgroup_ms), speedup; or its error."""
    cells = ([f"{r['tensor_ops_ms']:.3f}", f"{r[baseline]:.3f}", f"{r['speedup']:.2f}x"]
             if "speedup" in r else [r.get("error", ""), "", ""])
    return "| " + " | ".join([r["dtype"], r["shape"], str(r["causal"]), *cells]) + " |"


def to_markdown(section: Optional[dict]) -> List[str]:
    out = ["## Accelerator: Metal 4 tensor ops (impl='tensor_ops')", ""]
    if not section:
        return out + ["Not run.", ""]
    if section.get("status") == "skipped":
        return out + [f"**skipped**: {section.get('reason')}", ""]
    where = section.get("note") or f"Apple {section.get('gpu_family')} GPU"
    out += [f"**{section['status']}** ({where}). Each case: impl='tensor_ops' and the simdgroup prefill (backward "
            "cases: the simdgroup backward) on the same inputs, each against float64 by the 2x rule (error / "
            "tolerance <= 1).", ""]
    if section.get("message"):
        out += [section["message"], ""]
    rows = [(c["id"], c["options"], ", ".join(c["tensor_ops"]["kernels"]),
             "" if c["tensor_ops"]["worst_ratio"] is None else f"{c['tensor_ops']['worst_ratio']:.2f}",
             "" if c["simdgroup"]["worst_ratio"] is None else f"{c['simdgroup']['worst_ratio']:.2f}",
             "" if c["max_difference"] is None else f"{c['max_difference']:.3g}",
             ("**FAIL** " if c["status"] != "passed" else "ok ") + c["message"][:300])
            for c in section.get("checks", [])]
    if rows:
        header = ["check", "options", "tensor-op kernel", "tensor_ops err/tol", "simdgroup err/tol",
                  "max abs(tensor_ops - simdgroup)", "status"]
        out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(str(x).replace("|", "\\|") for x in r) + " |" for r in rows] + [""]
    t = section.get("timing", {})
    if t.get("rows"):
        out += [t["note"], "", "| dtype | B x Hq:Hkv x Nq x Nk x D | causal | tensor_ops ms | prefill ms | speedup |",
                "|---|---|---|---|---|---|"]
        out += [_timing_line(r, "prefill_ms") for r in t["rows"]] + [""]
    if t.get("backward_rows"):
        out += [t["backward_note"], "", "| dtype | B x Hq:Hkv x Nq x Nk x D | causal | tensor_ops backward ms "
                "| simdgroup backward ms | speedup |", "|---|---|---|---|---|---|"]
        out += [_timing_line(r, "simdgroup_ms") for r in t["backward_rows"]] + [""]
    if not t.get("rows") and not t.get("backward_rows"):
        out += [f"Timing {t.get('note', 'not measured')}.", ""]
    return out
