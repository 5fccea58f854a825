"""Training-shaped attention: forward+backward time against SDPA's.

    python -m benchmarks.training [--quick] [--device cpu|mps] [--threads N]

One call = the forward, then the backward with a random grad_out
(torch.autograd.grad of out, so no .grad accumulation is timed), for
flash_metal.attention and for torch.nn.functional.scaled_dot_product_attention
(enable_gqa=True for GQA shapes; on CPU, SDPA runs ATen's flash-attention
kernels for both passes). Shapes: the LLM preset's (benchmarks/llm.py) without
the decode steps, whose single query is not a training problem. float32 and
bfloat16 by default (--dtypes adds float16); causal and not.

Before timing, the gradients of both implementations are checked on two kv
heads (the first, and the last of the last batch, each with its GQA group of
query heads) against a float64 oracle (flash_metal.reference's blockwise
backward, fed by the float64 forward), by FlashAttention's 2x rule: our
relative error may be at most twice SDPA's in the same dtype plus a rounding
floor. FLOPs = 3.5 x the forward's 4 B Hq pairs D (FlashAttention-2's count:
the backward is 2.5 forwards).

Writes a table to stdout and results/training_<device>.csv
(training_quick_<device>.csv with --quick).
"""
import argparse
import gc
import sys
import time

import torch
import torch.nn.functional as F

from . import harness as H
from .llm import DTYPES, FULL as LLM_FULL, QUICK as LLM_QUICK

FULL = [s for s in LLM_FULL if not s.decode]
QUICK = [s for s in LLM_QUICK if not s.decode]
FLASH, SDPA = "flash_metal", "sdpa"
COLUMNS = ["device", "shape", "B", "Hq", "Hkv", "Nq", "Nk", "D", "dtype", "causal", "impl", "status",
           "median_ms", "min_ms", "max_ms", "calls_per_batch", "batches", "gflop", "tflops",
           "speedup_vs_sdpa", "max_rel_err", "tolerance", "note"]
# Query rows per block of the float64 oracle (blockwiseattention_backward);
# any size gives the same gradients, 512 keeps its tiles a few MB.
ORACLE_BLOCK = 512
# Rounding floor of the 2x rule, relative to max|gradient|: twice the unit
# roundoff of the dtype (storing the exact gradient in it already costs one).
FLOOR = {torch.float32: 2 * 2.0 ** -24, torch.bfloat16: 2 * 2.0 ** -8, torch.float16: 2 * 2.0 ** -11}
# float32 accumulation over N terms: a few ulps times log2(N) (tests/numerics.py's FP32_ULPS).
FP32_ULPS = 8


def oracle(fm, q, k, v, grad_out, causal, b, hk):
    """float64 (dq of the group's query heads, dk, dv) of kv head hk of batch b."""
    group = q.shape[1] // k.shape[1]
    kh, vh = k[b, hk].double(), v[b, hk].double()
    dk, dv, dqs = torch.zeros_like(kh), torch.zeros_like(vh), []
    for h in range(hk * group, (hk + 1) * group):
        qh, doh = q[b, h].double(), grad_out[b, h].double()
        out, lse = fm.reference.attention_reference(qh[None, None], kh[None, None], vh[None, None], causal=causal)
        dq, dk_h, dv_h = fm.reference.blockwiseattention_backward(
            qh, kh, vh, out[0, 0], lse[0, 0], doh, ORACLE_BLOCK, ORACLE_BLOCK, causal=causal)
        dqs.append(dq)
        dk += dk_h
        dv += dv_h
    return torch.stack(dqs), dk, dv


def relative_errors(grads, refs, b, hk, group):
    """max|g - ref| / max|ref| for grad_q (the group's heads), grad_k, grad_v."""
    dq, dk, dv = grads
    got = (dq[b, hk * group:(hk + 1) * group], dk[b, hk], dv[b, hk])
    errs = []
    for g, r in zip(got, refs):
        g = g.detach().double().cpu()
        if not torch.isfinite(g).all():
            errs.append(float("inf"))
            continue
        errs.append(float((g - r).abs().max()) / (float(r.abs().max()) or 1.0))
    return errs


def make_calls(fm, q, k, v, grad_out, causal):
    gqa = q.shape[1] != k.shape[1]

    def flash():
        out = fm.attention(q, k, v, causal=causal)
        return torch.autograd.grad(out, (q, k, v), grad_out)

    def sdpa():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return torch.autograd.grad(out, (q, k, v), grad_out)

    return {FLASH: flash, SDPA: sdpa}


def run(args):
    fm = H.load_flash_metal()
    device = H.pick_device(args.device)
    threads = H.set_threads(args.threads)
    sync = H.synchronizer(device)
    shapes = QUICK if args.quick else FULL
    if args.shapes:
        wanted = args.shapes.split(",")
        shapes = [s for s in shapes if s.label in wanted]
    dtypes = [DTYPES[x] for x in args.dtypes.split(",")]
    configs = [(dt, s, causal) for dt in dtypes for s in shapes for causal in (False, True)]

    meta = H.machine_metadata(device)
    meta["preset"] = (f"training{' --quick' if args.quick else ''}: forward+backward; "
                      "FLOPs = 3.5 * 4*B*Hq*pairs*D")
    tag = f"training_quick_{device}" if args.quick else f"training_{device}"
    csv_path = args.out_dir / f"{tag}.csv"
    bar = H.Progress(len(configs), f"training [{device}, {threads} threads]")
    gen = torch.Generator().manual_seed(0)
    rows, table = [], []
    t_start = time.perf_counter()
    for dt, s, causal in configs:
        def make(*shape):
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

        q, grad_out = make(s.b, s.hq, s.n_q, s.d), make(s.b, s.hq, s.n_q, s.d)
        k, v = make(s.b, s.hkv, s.n_k, s.d), make(s.b, s.hkv, s.n_k, s.d)
        for t in (q, k, v):
            t.requires_grad_(True)
        calls = make_calls(fm, q, k, v, grad_out, causal)
        group = s.hq // s.hkv
        heads = sorted({(0, 0), (s.b - 1, s.hkv - 1)})
        refs = {bh: oracle(fm, *(t.detach().cpu() for t in (q, k, v, grad_out)), causal, *bh) for bh in heads}
        floor = FLOOR[dt] + FP32_ULPS * 2.0 ** -24 * max(1.0, (max(s.n_q, s.n_k)) ** 0.5)
        res = {}
        for name, call in calls.items():
            grads, first_s = H.timed_first_call(call, sync)
            err = max(max(relative_errors(grads, refs[bh], *bh, group)) for bh in heads)
            del grads
            res[name] = {"err": err, "first_s": first_s}
        tol = 2 * res[SDPA]["err"] + floor
        if not res[FLASH]["err"] <= tol:
            raise H.CorrectnessError(
                f"{FLASH} {s.label} {dt} causal={causal}: gradient error {res[FLASH]['err']:.3g} (relative to "
                f"max|grad|) exceeds 2 x SDPA's {res[SDPA]['err']:.3g} + {floor:.2g}; refusing to time it")
        # Interleaved batches, as harness.run_problem: load that comes and
        # goes hits both implementations alike.
        iters = {n: H.calibrate(c, sync, args.batch_seconds, first_call_s=res[n]["first_s"])
                 for n, c in calls.items()}
        samples = {n: [] for n in calls}
        gc.collect()
        for _ in range(args.batches):
            for n, c in calls.items():
                samples[n].append(H.time_batch(c, sync, iters[n]))
        del calls, q, k, v, grad_out, refs
        flops = 3.5 * H.attention_flops(s.b, s.hq, s.n_q, s.n_k, s.d, causal)
        base = {"device": device, "shape": s.label, "B": s.b, "Hq": s.hq, "Hkv": s.hkv, "Nq": s.n_q, "Nk": s.n_k,
                "D": s.d, "dtype": str(dt).replace("torch.", ""), "causal": causal, "gflop": flops / 1e9}
        timing = {n: H.summarize(samples[n], iters[n]) for n in samples}
        for n in (SDPA, FLASH):
            t = timing[n]
            row = dict(base, impl=n, status="ok", median_ms=t.median_ms, min_ms=t.min_ms, max_ms=t.max_ms,
                       calls_per_batch=t.iters, batches=t.batches, tflops=flops / (t.median_ms * 1e-3) / 1e12,
                       max_rel_err=res[n]["err"], tolerance=tol if n == FLASH else "")
            if n == FLASH:
                row["speedup_vs_sdpa"] = timing[SDPA].median_ms / t.median_ms
            rows.append(row)
        table.append([s.label, base["dtype"], "yes" if causal else "no", H.fmt_ms(timing[SDPA]),
                      H.fmt_ms(timing[FLASH]), f"{rows[-1]['tflops']:.3g}",
                      f"{rows[-1]['speedup_vs_sdpa']:.2f}x", f"{res[FLASH]['err']:.2g} / {res[SDPA]['err']:.2g}"])
        bar.step(f"{s.label} {base['dtype']} causal={causal}")
        meta["configs_done"] = f"{len(table)} of {len(configs)}"
        H.write_csv(csv_path, meta, rows, COLUMNS)
    bar.close()
    H.finish_metadata(meta, t_start)
    H.write_csv(csv_path, meta, rows, COLUMNS)

    print(f"Forward+backward time in ms: median [min-max] of {args.batches} batches. {device}, {threads} torch "
          f"threads, {meta['cpu']} [{meta['cpu_isa']}], torch {meta['torch']}, {meta['git_sha'][:12]}")
    header = ["shape", "dtype", "causal", "sdpa ms", "flash_metal ms", "flash_metal TFLOP/s", "vs sdpa",
              "grad rel err (ours / sdpa)"]
    print(H.format_table(header, table))
    print(f"\nCSV: {csv_path}   ({meta['wall_seconds']} s)")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    H.common_args(ap, default_batch_s=0.2)
    ap.add_argument("--quick", action="store_true", help="smaller shapes (a reduced run)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated subset of float32,bfloat16,float16")
    ap.add_argument("--shapes", default="", help="comma-separated subset of the preset's shape labels")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
