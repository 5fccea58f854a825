"""The CPU kernel's tile-product paths against SDPA, in one run (issue 22).

    python -m benchmarks.cpu_paths [--rounds 5] [--threads 2] [--shapes issue|small|llm|llm-quick]
                                   [--paths vector,brgemm] [--backward] [--dtypes ...]

For each (shape, dtype): torch's SDPA, flash_metal with FLASH_METAL_CPU_PATH=vector
and, for bfloat16/float16, with FLASH_METAL_CPU_PATH=brgemm (on a CPU without AMX
that is ATen's non-VNNI brgemm fallback: it measures the path's plumbing, not the
matrix units; --paths vector leaves it out). Calls are interleaved round by round
and the best of the rounds is kept, so machine load hits every column alike; the
ratios are SDPA time over ours (above 1: we are faster), with their geometric mean
per dtype. Every output is first checked against SDPA's (with --backward, the
three gradients too). The CPU model and its ISA flags are printed beside the
table: a figure holds only for that CPU class.

Shapes: "issue" is issue 22's table; "llm" the LLM preset's (benchmarks/llm.py
FULL, decode steps included for the forward, left out with --backward as in
benchmarks/training.py), each non-decode shape causal and not; "llm-quick" its
--quick shapes. --backward times forward + backward (torch.autograd.grad).

FLASH_METAL_CPU_VNNI=emulate (the scalar VNNI test seam, csrc/cpu/matrix_units.h)
is slow by design: if it is set, the brgemm columns are labelled "brgemm[VNNI
emulated]" and the table says its times are no performance figure.

--cpu-time: one thread, timed by the process's CPU time (time.process_time)
instead of the wall clock. On a machine other processes keep busy, waiting for
a core then costs nothing, so the ratios of two single-thread kernels stay
steady where wall-clock ratios swing by 20% (what it cannot remove: caches and
memory bandwidth shared with the other processes). Use smaller head counts
with it: per-head work is the same, and one thread is 2x slower.
"""
import argparse
import math
import os
import time

import torch
import torch.nn.functional as F

from . import harness as H
from .llm import FULL as LLM_FULL, QUICK as LLM_QUICK

# The shapes of issue 22's table (B, Hq, Hkv, Nq, Nk, D, causal), measured there on a Xeon with AMX.
ISSUE_SHAPES = [(1, 4, 4, 3072, 3072, 128, False), (4, 8, 8, 512, 512, 64, True), (1, 8, 8, 4096, 4096, 128, True),
                (1, 16, 16, 1024, 1024, 96, False), (2, 12, 12, 1536, 1536, 64, True)]
SMALL_SHAPES = [(1, 4, 4, 512, 512, 64, False), (1, 4, 4, 512, 512, 128, True)]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Largest max|ours - SDPA| / max|SDPA| accepted before timing: a wrong kernel is off by O(1).
CHECK = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def _preset(shapes, backward):
    out = []
    for s in shapes:
        if s.decode and backward:
            continue  # one query is not a training problem (benchmarks/training.py)
        for causal in ((False,) if s.decode else (False, True)):
            out.append((s.b, s.hq, s.hkv, s.n_q, s.n_k, s.d, causal))
    return out


def shapes_for(name, backward):
    return {"issue": ISSUE_SHAPES, "small": SMALL_SHAPES, "llm": _preset(LLM_FULL, backward),
            "llm-quick": _preset(LLM_QUICK, backward)}[name]


def _calls(fm, q, k, v, grad_out, causal, paths, backward):
    """name -> a call returning the output (forward) or the three gradients (backward)."""
    gqa = q.shape[1] != k.shape[1]

    def wrap(attend):
        if not backward:
            return attend
        return lambda: torch.autograd.grad(attend(), (q, k, v), grad_out)

    def flash(path):
        def attend():
            os.environ["FLASH_METAL_CPU_PATH"] = path
            return fm.attention(q, k, v, causal=causal)
        return attend

    calls = {"sdpa": wrap(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa))}
    for p in paths:
        if p == "brgemm" and q.dtype == torch.float32:
            continue  # the brgemm path is for 16-bit tiles; float32 forced to it runs vector
        calls[p] = wrap(flash(p))
    return calls


def _rel_err(got, ref):
    got = got if isinstance(got, tuple) else (got,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    return max(float((g.float() - r.float()).abs().max()) / max(float(r.float().abs().max()), 1e-30)
               for g, r in zip(got, ref))


def run(args):
    fm = H.load_flash_metal()
    from flash_metal.cpu_paths import cpu_label, cpu_path_counts

    H.set_threads(1 if args.cpu_time else args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    saved = os.environ.get("FLASH_METAL_CPU_PATH")
    paths = args.paths.split(",")
    slot = "backward" if args.backward else "forward"
    rows, ratios = [], {}
    try:
        for (B, Hq, Hkv, Nq, Nk, D, causal) in shapes_for(args.shapes, args.backward):
            if args.heads and Hq > args.heads:  # same per-head work, fewer heads (and batch 1)
                Hkv, Hq, B = max(1, Hkv * args.heads // Hq), args.heads, 1
            for dname in args.dtypes.split(","):
                dtype = DTYPES[dname]
                g = torch.Generator().manual_seed(Nq * D + Hq)
                q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype)
                k, v = (torch.randn(B, Hkv, Nk, D, generator=g).to(dtype) for _ in range(2))
                grad_out = torch.randn(B, Hq, Nq, D, generator=g).to(dtype)
                for t in (q, k, v):
                    t.requires_grad_(args.backward)
                calls = _calls(fm, q, k, v, grad_out, causal, paths, args.backward)
                ref = calls["sdpa"]()
                for name, fn in calls.items():
                    if name == "sdpa":
                        continue
                    before = cpu_path_counts()
                    err = _rel_err(fn(), ref)
                    assert err < CHECK[dtype], f"{name} differs from sdpa by {err:.3g} (relative)"
                    key = f"{slot}_{name}"  # the forced path ran
                    assert cpu_path_counts()[key] == before[key] + 1, f"{name}: the {name} path did not run"
                del ref
                best = {n: float("inf") for n in calls}
                for _ in range(args.rounds):
                    for name, fn in calls.items():
                        t = clock()
                        fn()
                        best[name] = min(best[name], clock() - t)
                flops = (3.5 if args.backward else 1.0) * H.attention_flops(B, Hq, Nq, Nk, D, causal)
                shape = f"{B}x{Hq}{'' if Hkv == Hq else f':{Hkv}'}x{Nq}{'' if Nk == Nq else f'/{Nk}'}x{D}"
                row = [shape, dname, "yes" if causal else "no", f"{best['sdpa'] * 1e3:.1f}"]
                for p in paths:
                    if p in best:
                        r = best["sdpa"] / best[p]
                        ratios.setdefault((p, dname), []).append(r)
                        row += [f"{best[p] * 1e3:.1f} ({flops / best[p] / 1e9:.0f} GF/s)", f"{r:.2f}x"]
                    else:
                        row += ["n/a", "n/a"]
                rows.append(row)
                print(" | ".join(row), flush=True)
    finally:
        if saved is None:
            os.environ.pop("FLASH_METAL_CPU_PATH", None)
        else:
            os.environ["FLASH_METAL_CPU_PATH"] = saved
    what = "Forward + backward" if args.backward else "Forward"
    what += ", one thread, process CPU time" if args.cpu_time else ", wall clock"
    print(f"\n{what}, best of {args.rounds} interleaved rounds, ms; ratio = SDPA time / ours. flash_metal "
          f"{fm.__version__}\nCPU: {cpu_label()}")
    header = ["shape", "dtype", "causal", "sdpa ms"]
    emulated = os.environ.get("FLASH_METAL_CPU_VNNI") == "emulate"
    if emulated:
        print("FLASH_METAL_CPU_VNNI=emulate: brgemm ran the scalar VNNI emulation (a test seam, slow by design); "
              "its times are not a performance figure")
    for p in paths:
        label = "brgemm[VNNI emulated]" if emulated and p == "brgemm" else p
        header += [f"{label} ms", f"{label} vs sdpa"]
    print(H.format_table(header, rows))
    for (p, dname), rs in sorted(ratios.items()):
        geo = math.exp(sum(math.log(r) for r in rs) / len(rs))
        label = "brgemm[VNNI emulated]" if emulated and p == "brgemm" else p
        print(f"{label} {dname}: geomean {geo:.2f}x, min {min(rs):.2f}x over {len(rs)} shapes")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", choices=["issue", "small", "llm", "llm-quick"], default="issue")
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--paths", default="vector,brgemm", help="comma-separated subset of vector,brgemm")
    ap.add_argument("--backward", action="store_true", help="time forward + backward")
    ap.add_argument("--cpu-time", action="store_true", help="one thread, timed by process CPU time (load-robust)")
    ap.add_argument("--heads", type=int, default=0, help="cap query heads at this (GQA ratio kept); 0: as the preset")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
