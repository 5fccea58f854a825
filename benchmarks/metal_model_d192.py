"""Issue 20 section 3: the performance model at D = 192, its own bucket against
the 256-wide launch it had before (metal_model.padded_to). Predictions, not
measurements (benchmarks/metal_model.py).

    python -m benchmarks.metal_model_d192 [--n N] [--heads H]
"""
import argparse

import torch

from . import apple_gpus as G
from . import metal_backward_model as BM
from . import metal_model as M

CHIPS = ("M1", "M3 Max", "M4 Pro", "M5 (10-core)")


def rows(n, heads):
    """[(pass, dtype, causal, chip, kernels 192, ms 192, kernels 256, ms 256)] at B = 1, H = heads, N = n, D = 192."""
    s = M.Shape(1, heads, heads, n, n, 192)
    out = []
    for dtype in (torch.float16, torch.float32):
        for causal in (False, True):
            for name, counts in (("forward", lambda: M.counts_for("auto", s, dtype, causal)),
                                 ("backward", lambda: BM.counts_for(s, dtype, causal))):
                own = counts()
                with M.padded_to(256):
                    pad = counts()
                for chip in CHIPS:
                    g = G.BY_NAME[chip]
                    t_own = M.predict(own, g, s, dtype, causal)[0]
                    t_pad = M.predict(pad, g, s, dtype, causal)[0]
                    out.append((name, str(dtype).replace("torch.", ""), causal, chip,
                                " + ".join(r.kernel for r in own), t_own * 1e3,
                                " + ".join(r.kernel for r in pad), t_pad * 1e3))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    a = ap.parse_args(argv)
    print(f"D = 192, B = 1, H = {a.heads}, N = {a.n}: predicted ms (model, not measurement)")
    print("| pass | dtype | causal | chip | bucket 256 (padded) | bucket 192 | 256 / 192 |")
    print("|---|---|---|---|---|---|---|")
    kernels = {}
    for name, dt, causal, chip, k_own, ms_own, k_pad, ms_pad in rows(a.n, a.heads):
        kernels[(name, dt)] = (k_pad, k_own)
        print(f"| {name} | {dt} | {causal} | {chip} | {ms_pad:.3f} | {ms_own:.3f} | {ms_pad / ms_own:.2f}x |")
    print()
    for (name, dt), (k_pad, k_own) in kernels.items():
        print(f"{name} {dt}: 256: {k_pad}; 192: {k_own}")


if __name__ == "__main__":
    main()
