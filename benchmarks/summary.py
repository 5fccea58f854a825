"""Markdown summary of committed results, for benchmarks/README.md.

    python -m benchmarks.summary [--device cpu] [--results benchmarks/results]

Reads post_figure_<device>.csv, llm_<device>.csv and memory_cpu.csv (each if
present) and prints Markdown tables: flash_metal's speedup over SDPA on the
post's grid and LLM shapes, and the memory table. Paste the output under
"Results on this machine" after a re-run.
"""
import argparse
import csv
import sys
from pathlib import Path

from .harness import RESULTS, ms3

MiB = 2.0 ** 20


def read(path: Path):
    meta, lines = {}, []
    with open(path) as f:
        for line in f:
            if line.startswith("# "):
                key, _, value = line[2:].partition(": ")
                meta[key] = value.strip()
            else:
                lines.append(line)
    return meta, list(csv.DictReader(lines))


def md_table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def machine_line(meta):
    return (f"{meta.get('cpu')} ({meta.get('cpu_capability')}), {meta.get('torch_threads')} torch threads, "
            f"torch {meta.get('torch')}, {meta.get('os')}, git {meta.get('git_sha', '')[:12]}, "
            f"{meta.get('date_utc')}, load average {meta.get('loadavg_1m_at_start')} -> "
            f"{meta.get('loadavg_1m_at_end')}, other processes' CPU use before the run "
            f"{meta.get('cpu_busy_before_start', 'not measured')}, {meta.get('wall_seconds')} s")


def ms(row):
    return f"{ms3(float(row['median_ms']))} [{ms3(float(row['min_ms']))}–{ms3(float(row['max_ms']))}]"


def post_figure(path):
    meta, rows = read(path)
    print(f"### The post's grid ({path.name})\n\n{machine_line(meta)}\n")
    ok = [r for r in rows if r["status"] == "ok"]
    impls = list(dict.fromkeys(r["impl"] for r in ok))
    keys = list(dict.fromkeys((r["d"], r["causal"], r["N"]) for r in ok))
    table = []
    for d, causal, n in keys:
        cells = {r["impl"]: r for r in ok if (r["d"], r["causal"], r["N"]) == (d, causal, n)}
        sp = cells.get("flash_metal", {}).get("speedup_vs_sdpa")
        table.append([d, causal, n] + [ms(cells[i]) if i in cells else "n/a" for i in impls]
                     + [f"{float(sp):.2f}×" if sp else ""])
    print(md_table(["d", "causal", "N"] + [f"{i} ms" for i in impls] + ["flash_metal vs sdpa"], table))
    print()


def llm(path):
    meta, rows = read(path)
    print(f"### LLM shapes ({path.name}, {meta.get('configs_done', '?')} configurations)\n\n{machine_line(meta)}\n")
    ok = [r for r in rows if r["status"] == "ok"]
    keys = list(dict.fromkeys((r["shape"], r["dtype"], r["causal"]) for r in ok))
    table = []
    for key in keys:
        cells = {r["impl"]: r for r in ok if (r["shape"], r["dtype"], r["causal"]) == key}
        s, f = cells.get("sdpa"), cells.get("flash_metal")
        if not (s and f):
            continue
        table.append(list(key) + [ms(s), f"{float(s['tflops']):.3f}", ms(f), f"{float(f['tflops']):.3f}",
                                  f"{float(f['speedup_vs_sdpa']):.2f}×"])
    print(md_table(["shape", "dtype", "causal", "sdpa ms", "sdpa TFLOP/s", "flash_metal ms",
                    "flash_metal TFLOP/s", "flash_metal vs sdpa"], table))
    print()


def memory(path):
    meta, rows = read(path)
    print(f"### Peak extra memory ({path.name})\n\n{machine_line(meta)}\n")
    table = []
    for n in dict.fromkeys(r["N"] for r in rows):
        cells = {r["impl"]: r for r in rows if r["N"] == n}

        def cell(impl):
            r = cells[impl]
            if r["status"] == "computed":
                return f"≥ {int(r['nxn_float32_bytes']) / MiB:,.0f} (computed)"
            return f"{int(r['peak_extra_bytes']) / MiB:,.1f}"

        table.append([n, cell("flash"), cell("sdpa"), cell("explicit"),
                      f"{int(cells['flash']['nxn_float32_bytes']) / MiB:,.0f}"])
    print(md_table(["N", "flash_metal MiB", "sdpa MiB", "explicit MiB", "N×N float32 MiB"], table))
    print()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    for name, fn in ((f"post_figure_{args.device}.csv", post_figure), (f"llm_{args.device}.csv", llm),
                     ("memory_cpu.csv", memory)):
        path = args.results / name
        if path.exists():
            fn(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
