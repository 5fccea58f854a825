"""The LLM preset's option cases: a padded batch, a sliding window, a packed varlen batch.

    python -m benchmarks.features [--quick] [--device auto|cpu|mps] [--threads N] [--backward]

(also run by ``python -m benchmarks.llm`` after its dense shapes). Each case
is timed against SDPA given the equivalent mask in the same run, batches
interleaved:

* padded: a right-padded batch of 4 sequences (full, 3/4, 1/2 and 1/4 of N
  real tokens), causal, GQA 8:2. flash_metal takes the (B, 1, 1, N) key
  padding mask plus causal=True; SDPA takes the combined (B, 1, N, N) mask
  (it cannot combine is_causal with a mask).
* window: a Mistral-style sliding window (window_left = W, causal) over N
  tokens. SDPA takes the (N, N) band mask and still computes every block.
* varlen: 6 packed sequences of different lengths (flash_metal.attention_varlen,
  cu_seqlens); SDPA takes the packed batch as one sequence with the
  block-diagonal causal mask (transformers' padding-free SDPA path).

Every case is checked against SDPA's output (float32 math) before timing.
--backward times forward+backward instead (SDPA through autograd).
Writes a table to stdout and results/features_<device>.csv
(features_quick_<device>.csv with --quick; _backward added with --backward).
"""
import argparse
import sys
import time
from typing import Callable, Dict, List, NamedTuple

import torch
import torch.nn.functional as F

from . import harness as H
from .impls import _SDPA_HAS_GQA, _expand_kv

COLUMNS = ["device", "case", "B", "Hq", "Hkv", "N", "D", "dtype", "pass", "impl", "median_ms", "min_ms", "max_ms",
           "calls_per_batch", "batches", "speedup_vs_sdpa", "max_abs_err", "visible_fraction"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Case(NamedTuple):
    name: str
    n: int        # tokens per sequence (padded, window) or in the whole pack (varlen)
    window: int   # window_left of the window case
    hq: int = 8
    hkv: int = 2
    d: int = 64


FULL = [Case("padded", 2048, 0), Case("window", 8192, 1024), Case("varlen", 8192, 0)]
QUICK = [Case("padded", 1024, 0), Case("window", 4096, 512), Case("varlen", 4096, 0)]


class Problem(NamedTuple):
    flash: Callable[[], torch.Tensor]    # returns out in the dense (B, H, N, D) layout of the SDPA call
    sdpa: Callable[[], torch.Tensor]
    leaves: List[torch.Tensor]           # the inputs gradients flow to (--backward)
    visible: float                       # fraction of the N x N pairs the mask keeps
    shape: Dict[str, int]


def _tensors(b, hq, hkv, n, d, dtype, device, g):
    q = torch.randn(b, hq, n, d, generator=g).to(device=device, dtype=dtype)
    k, v = (torch.randn(b, hkv, n, d, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    return q, k, v


def _sdpa(q, k, v, mask):
    if q.shape[1] == k.shape[1]:
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if _SDPA_HAS_GQA:
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ke, ve = _expand_kv(q, k, v)  # outside the timed call (older torch)
    return lambda: F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)


def build(case: Case, dtype, device, g, fm) -> Problem:
    n, d = case.n, case.d
    causal_nn = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    if case.name == "padded":
        b = 4
        q, k, v = _tensors(b, case.hq, case.hkv, n, d, dtype, device, g)
        lengths = torch.tensor([n, 3 * n // 4, n // 2, n // 4], device=device)
        keys = torch.arange(n, device=device)[None, :] < lengths[:, None]  # (B, N): real tokens
        pad = keys[:, None, None, :]                                        # (B, 1, 1, N)
        sdpa_mask = pad & causal_nn                                         # (B, 1, N, N)
        # Padded query rows see their real keys under causality, as in SDPA.
        flash = lambda: fm.attention(q, k, v, causal=True, attn_mask=pad)  # noqa: E731
        return Problem(flash, _sdpa(q, k, v, sdpa_mask), [q, k, v], sdpa_mask.float().mean().item(),
                       dict(B=b, N=n))
    if case.name == "window":
        q, k, v = _tensors(1, case.hq, case.hkv, n, d, dtype, device, g)
        i = torch.arange(n, device=device)
        band = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - case.window)
        flash = lambda: fm.attention(q, k, v, causal=True, window_left=case.window)  # noqa: E731
        return Problem(flash, _sdpa(q, k, v, band), [q, k, v], band.float().mean().item(), dict(B=1, N=n))
    # varlen: 6 sequences of unequal lengths packing n tokens.
    parts = [0.3, 0.2, 0.2, 0.15, 0.1, 0.05]
    lengths = [int(n * p) for p in parts]
    lengths[0] += n - sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q, k, v = _tensors(1, case.hq, case.hkv, n, d, dtype, device, g)
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    block_causal = (seq[:, None] == seq[None, :]) & causal_nn
    # The packed (total, H, D) views of the same storage: no copy in the timed call.
    qp, kp, vp = (t[0].transpose(0, 1) for t in (q, k, v))
    m = max(lengths)

    def flash():
        return fm.attention_varlen(qp, kp, vp, cu, cu, m, m, causal=True).transpose(0, 1).unsqueeze(0)

    return Problem(flash, _sdpa(q, k, v, block_causal), [q, k, v], block_causal.float().mean().item(),
                   dict(B=len(lengths), N=n))


def _with_backward(fn: Callable[[], torch.Tensor], leaves: List[torch.Tensor], grad: torch.Tensor):
    def call():
        out = fn()
        out.backward(grad)
        for t in leaves:
            t.grad = None
        return out
    return call


def run(args):
    device = H.pick_device(args.device)
    threads = H.set_threads(args.threads)
    fm = H.load_flash_metal()
    cases = QUICK if args.quick else FULL
    dtypes = [DTYPES[x] for x in args.dtypes.split(",")]
    sync = H.synchronizer(device)
    meta = H.machine_metadata(device)
    pass_name = "forward+backward" if args.backward else "forward"
    meta["preset"] = f"features{' --quick' if args.quick else ''}: {pass_name}, vs SDPA with the equivalent mask"
    tag = f"features{'_quick' if args.quick else ''}{'_backward' if args.backward else ''}_{device}"
    csv_path = args.out_dir / f"{tag}.csv"
    g = torch.Generator().manual_seed(0)
    rows, table = [], []
    t_start = time.perf_counter()
    bar = H.Progress(len(cases) * len(dtypes), f"features [{device}, {threads} threads]")
    for dtype in dtypes:
        for case in cases:
            p = build(case, dtype, device, g, fm)
            # Correctness first: flash_metal vs SDPA computed in float32.
            with torch.no_grad():
                want = p.sdpa().float()
                err = (p.flash().float() - want).abs().max().item()
            limit = 2e-2 if dtype != torch.float32 else 1e-4
            if not err <= limit * max(1.0, want.abs().max().item()):
                raise H.CorrectnessError(f"{case.name} {dtype}: max error {err:.3g} against SDPA")
            calls = {"flash_metal": p.flash, "sdpa": p.sdpa}
            if args.backward:
                for t in p.leaves:
                    t.requires_grad_(True)
                grad = torch.randn(want.shape, generator=g).to(device=device, dtype=dtype)
                calls = {name: _with_backward(fn, p.leaves, grad) for name, fn in calls.items()}
            iters = {name: H.calibrate(fn, sync, args.batch_seconds) for name, fn in calls.items()}
            samples = {name: [] for name in calls}
            for _ in range(args.batches):  # interleaved batches, as harness.run_problem
                for name, fn in calls.items():
                    samples[name].append(H.time_batch(fn, sync, iters[name]))
            timing = {name: H.summarize(s, iters[name]) for name, s in samples.items()}
            speed = timing["sdpa"].median_ms / timing["flash_metal"].median_ms
            for name, t in timing.items():
                rows.append({"device": device, "case": case.name, "Hq": case.hq, "Hkv": case.hkv, "D": case.d,
                             "dtype": str(dtype).replace("torch.", ""), "pass": pass_name, "impl": name,
                             "median_ms": t.median_ms, "min_ms": t.min_ms, "max_ms": t.max_ms,
                             "calls_per_batch": t.iters, "batches": t.batches,
                             "speedup_vs_sdpa": speed if name == "flash_metal" else 1.0,
                             "max_abs_err": err if name == "flash_metal" else 0.0,
                             "visible_fraction": p.visible, **p.shape})
            table.append([case.name, str(dtype).replace("torch.", ""), f"B={p.shape['B']} N={p.shape['N']}",
                          f"{p.visible:.3f}", H.fmt_ms(timing["flash_metal"]), H.fmt_ms(timing["sdpa"]),
                          f"{speed:.2f}x"])
            bar.step(f"{case.name} {dtype}")
            meta["configs_done"] = f"{len(table)} of {len(cases) * len(dtypes)}"
            H.write_csv(csv_path, meta, rows, COLUMNS)
            del p
    bar.close()
    H.finish_metadata(meta, t_start)
    H.write_csv(csv_path, meta, rows, COLUMNS)
    print(f"{pass_name} time in ms: median [min-max] of {args.batches} interleaved batches. {device}, "
          f"{threads} torch threads, {meta['cpu']} [{meta['cpu_isa']}], torch {meta['torch']}, {meta['git_sha'][:12]}")
    print(H.format_table(["case", "dtype", "problem", "visible pairs", "flash_metal ms", "sdpa ms",
                          "flash_metal vs sdpa"], table))
    print(f"\nCSV: {csv_path}   ({meta['wall_seconds']} s)")
    return 0


def add_args(ap):
    H.common_args(ap, default_batch_s=0.1)
    ap.add_argument("--quick", action="store_true", help="smaller problems (a reduced run)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated subset of float32,bfloat16,float16")
    ap.add_argument("--backward", action="store_true", help="time forward+backward")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
