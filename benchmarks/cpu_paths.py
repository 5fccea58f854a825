"""The CPU kernel's tile-product paths against SDPA, forward, in one run (issue 22).

    python -m benchmarks.cpu_paths [--rounds 5] [--threads 2] [--shapes issue|small]

For each (shape, dtype): torch's SDPA, flash_metal with FLASH_METAL_CPU_PATH=vector
and, for bfloat16/float16, with FLASH_METAL_CPU_PATH=brgemm (on a CPU without AMX
that is ATen's non-VNNI brgemm fallback: it measures the path's plumbing, not the
matrix units). Calls are interleaved round by round and the best of the rounds is
kept, so machine load hits every column alike; the ratios are SDPA time over
ours. Every output is first checked against SDPA's. The CPU model and its ISA
flags are printed beside the table: a figure holds only for that CPU class.
"""
import argparse
import os
import time

import torch

from . import harness as H

# The shapes of issue 22's table (B, H, N, D, causal), measured there on a Xeon with AMX.
ISSUE_SHAPES = [(1, 4, 3072, 128, False), (4, 8, 512, 64, True), (1, 8, 4096, 128, True),
                (1, 16, 1024, 96, False), (2, 12, 1536, 64, True)]
SMALL_SHAPES = [(1, 4, 512, 64, False), (1, 4, 512, 128, True)]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _flash(path, q, k, v, causal):
    os.environ["FLASH_METAL_CPU_PATH"] = path
    return H.load_flash_metal().attention(q, k, v, causal=causal)


def run(args):
    fm = H.load_flash_metal()
    from flash_metal.cpu_paths import cpu_label, cpu_path_counts

    H.set_threads(args.threads)
    saved = os.environ.get("FLASH_METAL_CPU_PATH")
    shapes = ISSUE_SHAPES if args.shapes == "issue" else SMALL_SHAPES
    rows = []
    try:
        for (B, Hh, N, D, causal) in shapes:
            for dname in args.dtypes.split(","):
                dtype = DTYPES[dname]
                g = torch.Generator().manual_seed(N * D)
                q, k, v = (torch.randn(B, Hh, N, D, generator=g).to(dtype) for _ in range(3))
                impls = {"sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
                         "vector": lambda: _flash("vector", q, k, v, causal)}
                if dtype != torch.float32:
                    impls["brgemm"] = lambda: _flash("brgemm", q, k, v, causal)
                ref = impls["sdpa"]().float()
                for name, fn in impls.items():
                    before = cpu_path_counts()
                    err = (fn().float() - ref).abs().max().item()
                    assert err < (2e-2 if dtype != torch.float32 else 1e-4), f"{name} differs from sdpa by {err}"
                    if name != "sdpa":  # the forced path ran
                        assert cpu_path_counts()[f"forward_{name}"] == before[f"forward_{name}"] + 1
                best = {n: float("inf") for n in impls}
                for _ in range(args.rounds):
                    for name, fn in impls.items():
                        t = time.perf_counter()
                        fn()
                        best[name] = min(best[name], time.perf_counter() - t)
                flops = H.attention_flops(B, Hh, N, N, D, causal)
                row = [f"{B}x{Hh}x{N}x{D}", dname, "yes" if causal else "no", f"{best['sdpa'] * 1e3:.1f}",
                       f"{best['vector'] * 1e3:.1f} ({flops / best['vector'] / 1e9:.0f} GF/s)",
                       f"{best['sdpa'] / best['vector']:.2f}x"]
                if "brgemm" in best:
                    row += [f"{best['brgemm'] * 1e3:.1f}", f"{best['sdpa'] / best['brgemm']:.2f}x"]
                else:
                    row += ["n/a", "n/a"]
                rows.append(row)
                print(" | ".join(row), flush=True)
    finally:
        if saved is None:
            os.environ.pop("FLASH_METAL_CPU_PATH", None)
        else:
            os.environ["FLASH_METAL_CPU_PATH"] = saved
    print(f"\nForward, best of {args.rounds} interleaved rounds, ms; ratio = SDPA time / ours. flash_metal "
          f"{fm.__version__}\nCPU: {cpu_label()}")
    print(H.format_table(["shape", "dtype", "causal", "sdpa ms", "vector ms", "vector vs sdpa", "brgemm ms",
                          "brgemm vs sdpa"], rows))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", choices=["issue", "small"], default="issue")
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
