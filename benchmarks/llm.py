"""LLM-shaped attention: TFLOP/s and speedup against SDPA.

    python -m benchmarks.llm [--quick] [--device auto|cpu|mps] [--threads N]

Shapes (B, Hq:Hkv, Nq, Nk, D): (1, 32, 4096, 128), (1, 8, 8192, 64),
(4, 16, 1024, 64), GQA (1, 32:8, 4096, 128), and decode steps (one query
against a 4096- or 32768-key cache, 32:8 heads, D = 128); float32, bfloat16
and float16; causal and not (a decode step only once: with one query and the
bottom-right alignment, causal is the same problem). FLOPs = 4 B Hq pairs D,
pairs = Nq Nk, halved for causal with Nq == Nk. Each configuration is checked
against the float64 oracle on its first and last heads before it is timed.

Then the preset's option cases (benchmarks/features.py: a padded batch with
a bool mask, a sliding window, a packed varlen batch, each against SDPA with
the equivalent mask), unless --no-features.

Writes a table to stdout and results/llm_<device>.csv (llm_quick_<device>.csv
with --quick), and the option cases' results/features_*.csv.
"""
import argparse
import sys
import time
from typing import NamedTuple

import torch

from . import harness as H
from .impls import BASELINE, for_preset


class Shape(NamedTuple):
    label: str
    b: int
    hq: int
    hkv: int
    n_q: int
    n_k: int
    d: int

    @property
    def decode(self) -> bool:
        return self.n_q == 1


FULL = [
    Shape("1x32x4096x128", 1, 32, 32, 4096, 4096, 128),
    Shape("1x8x8192x64", 1, 8, 8, 8192, 8192, 64),
    Shape("4x16x1024x64", 4, 16, 16, 1024, 1024, 64),
    Shape("gqa 1x32:8x4096x128", 1, 32, 8, 4096, 4096, 128),
    Shape("decode 1x32:8 1/4096 d128", 1, 32, 8, 1, 4096, 128),
    Shape("decode 1x32:8 1/32768 d128", 1, 32, 8, 1, 32768, 128),
]
# --quick: the same kinds of problem, small enough for a minute or so on 2 cores.
QUICK = [
    Shape("1x8x1024x64", 1, 8, 8, 1024, 1024, 64),
    Shape("2x4x512x128", 2, 4, 4, 512, 512, 128),
    Shape("gqa 1x8:2x1024x64", 1, 8, 2, 1024, 1024, 64),
    Shape("decode 1x32:8 1/4096 d128", 1, 32, 8, 1, 4096, 128),
]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FLASH = "flash_metal"
COLUMNS = ["device", "shape", "B", "Hq", "Hkv", "Nq", "Nk", "D", "dtype", "causal", "impl", "status",
           "median_ms", "min_ms", "max_ms", "calls_per_batch", "batches", "gflop", "tflops",
           "speedup_vs_sdpa", "max_rel_err", "note"]


def run(args):
    device = H.pick_device(args.device)
    threads = H.set_threads(args.threads)
    impls = for_preset("llm", args.impls)
    runnable = [i for i in impls if i.runs_on(device)]
    shapes = QUICK if args.quick else FULL
    dtypes = [DTYPES[x] for x in args.dtypes.split(",")]
    configs = [(dt, s, causal) for dt in dtypes for s in shapes for causal in ((False,) if s.decode else (False, True))]

    meta = H.machine_metadata(device)
    meta["preset"] = f"llm{' --quick' if args.quick else ''}: forward; FLOPs = 4*B*Hq*pairs*D"
    tag = f"llm_quick_{device}" if args.quick else f"llm_{device}"
    csv_path = args.out_dir / f"{tag}.csv"
    bar = H.Progress(len(configs), f"llm [{device}, {threads} threads]")
    gen = torch.Generator().manual_seed(0)
    rows, table = [], []
    t_start = time.perf_counter()
    for dt, s, causal in configs:
        q = torch.randn(s.b, s.hq, s.n_q, s.d, generator=gen).to(device=device, dtype=dt)
        k, v = (torch.randn(s.b, s.hkv, s.n_k, s.d, generator=gen).to(device=device, dtype=dt) for _ in range(2))
        # The oracle on two heads: the first, and the last of the last batch.
        ref = H.Reference(q, k, v, causal, heads=sorted({(0, 0), (s.b - 1, s.hq - 1)}))
        res = H.run_problem(impls, q, k, v, causal, device, ref, args.batches, args.batch_seconds)
        del q, k, v, ref
        flops = H.attention_flops(s.b, s.hq, s.n_q, s.n_k, s.d, causal)
        base = {"device": device, "shape": s.label, "B": s.b, "Hq": s.hq, "Hkv": s.hkv, "Nq": s.n_q, "Nk": s.n_k,
                "D": s.d, "dtype": str(dt).replace("torch.", ""),
                "causal": "decode" if s.decode else causal, "gflop": flops / 1e9}
        cells = []
        for impl in impls:
            row = H.result_row(base, impl.name, res[impl.name], res.get(BASELINE))
            if row.get("median_ms"):
                row["tflops"] = flops / (row["median_ms"] * 1e-3) / 1e12
            rows.append(row)
            if impl in runnable:
                cells += [H.fmt_ms(res[impl.name]["timing"]), f"{row['tflops']:.3g}" if "tflops" in row else "n/a"]
        for impl in runnable:
            if impl.name != BASELINE:
                sp = rows[-len(impls) + impls.index(impl)].get("speedup_vs_sdpa")
                cells.append(f"{sp:.2f}x" if sp else "n/a")
        table.append([s.label, base["dtype"], base["causal"] if s.decode else ("yes" if causal else "no")] + cells)
        bar.step(f"{s.label} {base['dtype']} causal={causal}")
        # Rewritten after every configuration: a long run stopped midway
        # still leaves every finished row on disk (marked incomplete).
        meta["configs_done"] = f"{len(table)} of {len(configs)}"
        H.write_csv(csv_path, meta, rows, COLUMNS)
    bar.close()
    H.finish_metadata(meta, t_start)
    H.write_csv(csv_path, meta, rows, COLUMNS)

    print(f"Forward time in ms: median [min-max] of {args.batches} batches, TFLOP/s from the median. "
          f"{device}, {threads} torch threads, {meta['cpu']} [{meta['cpu_isa']}], torch {meta['torch']}, {meta['git_sha'][:12]}")
    header = ["shape", "dtype", "causal"]
    for impl in runnable:
        header += [f"{impl.name} ms", f"{impl.name} TFLOP/s"]
    header += [f"{i.name} vs {BASELINE}" for i in runnable if i.name != BASELINE]
    print(H.format_table(header, table))
    skipped = [i.name for i in impls if i not in runnable]
    if skipped:
        print(f"\nn/a on {device}: {', '.join(skipped)}")
    print(f"\nCSV: {csv_path}   ({meta['wall_seconds']} s)")
    if not args.no_features:
        # The preset's option cases: padded batch, sliding window, packed varlen.
        from . import features

        print()
        return features.run(argparse.Namespace(**{**vars(args), "backward": False}))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    H.common_args(ap, default_batch_s=0.1)
    ap.add_argument("--quick", action="store_true", help="smaller shapes (a reduced run)")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16",
                    help="comma-separated subset of float32,bfloat16,float16")
    ap.add_argument("--no-features", action="store_true",
                    help="skip the option cases (padded batch, window, varlen: benchmarks/features.py)")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
