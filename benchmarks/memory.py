"""Peak extra memory of one forward (or forward + backward) call: flash_metal vs SDPA vs explicit.

    python -m benchmarks.memory [--ns 1024,4096,16384,32768] [--d 64] [--causal] [--backward]
                                [--explicit-max-n 16384] [--threads N]

B = H = 1, float32. Each (impl, N) runs benchmarks/peak_memory.py in a fresh
process, which reports the growth of the process's peak resident memory
(VmHWM) during one call, after the inputs exist and the op has been warmed up:
outputs plus every temporary. Linux only (it resets the peak through
/proc/self/clear_refs). --backward measures forward + backward (autograd
through each implementation; see peak_memory.py) and writes
results/memory_backward_cpu.csv.

The explicit path materializes S and P, N x N each. Above --explicit-max-n it
is not run (at N = 32768 it needs 8+ GiB); the table shows the N x N float32
size instead, marked as computed rather than measured. Writes a table to
stdout and results/memory_cpu.csv.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from . import harness as H

PROBE = Path(__file__).resolve().parent / "peak_memory.py"
IMPLS = ("flash", "sdpa", "explicit")
MiB = 2.0 ** 20


def _ints(text):
    return tuple(int(x) for x in text.split(",") if x)


def measure(impl, n, d, causal, threads, timeout, backward=False):
    cmd = [sys.executable, str(PROBE), "--impl", impl, "--n", str(n), "--d", str(d)]
    if causal:
        cmd.append("--causal")
    if backward:
        cmd.append("--backward")
    if threads:
        cmd += ["--threads", str(threads)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}{r.stderr[-2000:]}")
    return json.loads(lines[-1])


def run(args):
    threads = H.set_threads(args.threads)
    meta = H.machine_metadata("cpu")
    what = "forward + backward" if args.backward else "one forward call"
    meta["preset"] = (f"memory: B=H=1, float32, d={args.d}, causal={args.causal}; peak RSS growth during {what}")
    jobs = [(n, impl) for n in args.ns for impl in IMPLS]
    bar = H.Progress(len(jobs), "memory")
    rows, by_n = [], {}
    t_start = time.perf_counter()
    for n, impl in jobs:
        row = {"N": n, "d": args.d, "causal": args.causal, "impl": impl,
               "input_bytes": 3 * n * args.d * 4, "nxn_float32_bytes": n * n * 4}
        if impl == "explicit" and n > args.explicit_max_n:
            row.update(status="computed", note=f"not run above --explicit-max-n {args.explicit_max_n}; "
                                                "S alone is N x N float32")
        else:
            res = measure(impl, n, args.d, args.causal, args.threads, args.timeout, args.backward)
            row.update(status="measured", peak_extra_bytes=res["peak_extra_bytes"])
        rows.append(row)
        by_n.setdefault(n, {})[impl] = row
        bar.step(f"{impl} N={n}")
    bar.close()
    H.finish_metadata(meta, t_start)

    csv_path = args.out_dir / ("memory_backward_cpu.csv" if args.backward else "memory_cpu.csv")
    H.write_csv(csv_path, meta, rows, ["N", "d", "causal", "impl", "status", "peak_extra_bytes",
                                       "input_bytes", "nxn_float32_bytes", "note"])

    def cell(r):
        if r["status"] == "computed":
            return f">= {r['nxn_float32_bytes'] / MiB:,.0f} (computed)"
        return f"{r['peak_extra_bytes'] / MiB:,.1f}"

    print(f"Peak extra memory of {what}, MiB (B=H=1, float32, d={args.d}, "
          f"{'causal' if args.causal else 'non-causal'}; {threads} torch threads; {meta['cpu']}, "
          f"torch {meta['torch']}, {meta['git_sha'][:12]})")
    header = ["N", "inputs q,k,v", "output", "flash_metal", "sdpa", "explicit", "N x N float32"]
    table = []
    for n, r in by_n.items():
        table.append([n, f"{3 * n * args.d * 4 / MiB:,.1f}", f"{n * args.d * 4 / MiB:,.1f}",
                      cell(r["flash"]), cell(r["sdpa"]), cell(r["explicit"]), f"{n * n * 4 / MiB:,.0f}"])
    print(H.format_table(header, table))
    print("\n'computed': not run; the explicit path needs at least S (N x N float32), "
          "and in practice S and P together.")
    print(f"CSV: {csv_path}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", type=_ints, default=(1024, 4096, 16384, 32768))
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--backward", action="store_true", help="measure forward + backward")
    ap.add_argument("--explicit-max-n", type=int, default=16384,
                    help="largest N the explicit path is run at (it needs ~2 N^2 x 4 bytes)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in each probe (0: torch's default)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per probe")
    ap.add_argument("--out-dir", type=Path, default=H.RESULTS)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
