"""The post's figure: forward time of each attention implementation.

    python -m benchmarks.post_figure [--device auto|cpu|mps] [--threads N]

Grid (as in the post): B = H = 1, float32, N in {64, 256, 1024, 2048},
d in {32, 64}, causal and not. Every implementation in benchmarks/impls.py
that joins the "post" preset is checked against the float64 oracle, then
timed (7 batches, median and min-max). Writes a table to stdout,
results/post_figure_<device>.csv and results/post_figure_<device>.png.
"""
import argparse
import sys
import time

import torch

from . import harness as H
from .impls import BASELINE, for_preset

DEFAULT_NS = (64, 256, 1024, 2048)
DEFAULT_DS = (32, 64)
FLASH = "flash_metal"


def _ints(text):
    return tuple(int(x) for x in text.split(",") if x)


def run(args):
    device = H.pick_device(args.device)
    threads = H.set_threads(args.threads)
    impls = for_preset("post", args.impls)
    meta = H.machine_metadata(device)
    meta["preset"] = "post_figure: B=H=1, float32, forward"
    configs = [(d, causal, n) for d in args.ds for causal in (False, True) for n in args.ns]
    bar = H.Progress(len(configs), f"post_figure [{device}, {threads} threads]")
    gen = torch.Generator().manual_seed(0)
    rows, table = [], []
    t_start = time.perf_counter()
    for d, causal, n in configs:
        q, k, v = (torch.randn(1, 1, n, d, generator=gen).to(device) for _ in range(3))
        ref = H.Reference(q, k, v, causal)
        res = H.run_problem(impls, q, k, v, causal, device, ref, args.batches, args.batch_seconds)
        base = {"device": device, "dtype": "float32", "B": 1, "H": 1, "N": n, "d": d, "causal": causal}
        for impl in impls:
            rows.append(H.result_row(base, impl.name, res[impl.name], res.get(BASELINE)))
        speedup = ""
        if res.get(FLASH, {}).get("timing") and res.get(BASELINE, {}).get("timing"):
            speedup = f"{res[BASELINE]['timing'].median_ms / res[FLASH]['timing'].median_ms:.2f}x"
        table.append([d, "yes" if causal else "no", n] + [H.fmt_ms(res[i.name]["timing"]) for i in impls] + [speedup])
        bar.step(f"d={d} causal={causal} N={n}")
    bar.close()
    H.finish_metadata(meta, t_start)

    tag = device
    csv_path = args.out_dir / f"post_figure_{tag}.csv"
    columns = ["device", "dtype", "B", "H", "N", "d", "causal", "impl", "status", "median_ms", "min_ms", "max_ms",
               "calls_per_batch", "batches", "max_rel_err", "speedup_vs_sdpa", "note"]
    H.write_csv(csv_path, meta, rows, columns)

    print(f"Forward time in ms: median [min-max] of {args.batches} batches. float32, B=H=1, "
          f"{device}, {threads} torch threads, {meta['cpu']} [{meta['cpu_isa']}], torch {meta['torch']}, {meta['git_sha'][:12]}")
    header = ["d", "causal", "N"] + [i.name for i in impls] + [f"{FLASH} speedup vs {BASELINE}"]
    print(H.format_table(header, table))
    print(f"\nCSV: {csv_path}")
    if not args.no_plot:
        png = args.out_dir / f"post_figure_{tag}.png"
        plot(rows, impls, meta, png)
        print(f"PNG: {png}")
    return 0


def plot(rows, impls, meta, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install '.[bench]'); no plot", file=sys.stderr)
        return
    ds = sorted({r["d"] for r in rows})
    fig, axes = plt.subplots(len(ds), 2, figsize=(11, 4.2 * len(ds)), squeeze=False, sharex=True)
    markers = "osD^vP*X"
    skipped = set()
    for i_d, d in enumerate(ds):
        for i_c, causal in enumerate((False, True)):
            ax = axes[i_d][i_c]
            for j, impl in enumerate(impls):
                pts = sorted((r["N"], r["median_ms"], r["min_ms"], r["max_ms"]) for r in rows
                             if r["d"] == d and r["causal"] == causal and r["impl"] == impl.name
                             and r.get("median_ms") is not None)
                if not pts:
                    skipped.add(impl.name)
                    continue
                ns, med, lo, hi = zip(*pts)
                yerr = [[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]]
                ax.errorbar(ns, med, yerr=yerr, marker=markers[j % len(markers)], capsize=3,
                            label=impl.name, color=f"C{j}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"d = {d}, {'causal' if causal else 'non-causal'}")
            ax.grid(True, which="both", alpha=0.3)
            if i_d == len(ds) - 1:
                ax.set_xlabel("sequence length N")
            ax.set_ylabel("forward time (ms, log scale)")
            ns_all = sorted({r["N"] for r in rows})
            ax.set_xticks(ns_all)
            ax.set_xticklabels([str(n) for n in ns_all])
    handles, labels = axes[0][0].get_legend_handles_labels()
    na = f"   (n/a on {meta['device']}: {', '.join(sorted(skipped))})" if skipped else ""
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.suptitle(f"Forward time, float32, B = H = 1: median and min-max of {rows[0].get('batches', 7)} batches\n"
                 f"{meta['cpu']} ({meta['device']}, {meta['torch_threads']} threads), torch {meta['torch']}, "
                 f"{meta['git_sha'][:12]}{na}", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    H.common_args(ap, default_batch_s=0.2)
    ap.add_argument("--ns", type=_ints, default=DEFAULT_NS, help="comma-separated sequence lengths")
    ap.add_argument("--ds", type=_ints, default=DEFAULT_DS, help="comma-separated head dims")
    ap.add_argument("--no-plot", action="store_true")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
