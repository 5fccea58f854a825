"""Issue 20 section 3: the performance model at D = 192, its own bucket against
the 256-wide launch it had before (core/counts.py padded_to). Predictions, not
measurements.

    python -m benchmarks.model d192 [--n N] [--heads H]
"""
import torch

from ..core import backward_counts as BM
from ..core import counts as M
from ..core import gpus as G
from ..core import timing as T

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
                    t_own = T.predict(own, g, s, dtype, causal)[0]
                    t_pad = T.predict(pad, g, s, dtype, causal)[0]
                    out.append((name, str(dtype).replace("torch.", ""), causal, chip,
                                " + ".join(r.kernel for r in own), t_own * 1e3,
                                " + ".join(r.kernel for r in pad), t_pad * 1e3))
    return out


def report(n=2048, heads=16):
    print(f"D = 192, B = 1, H = {heads}, N = {n}: predicted ms (model, not measurement)")
    print("| pass | dtype | causal | chip | bucket 256 (padded) | bucket 192 | 256 / 192 |")
    print("|---|---|---|---|---|---|---|")
    kernels = {}
    for name, dt, causal, chip, k_own, ms_own, k_pad, ms_pad in rows(n, heads):
        kernels[(name, dt)] = (k_pad, k_own)
        print(f"| {name} | {dt} | {causal} | {chip} | {ms_pad:.3f} | {ms_own:.3f} | {ms_pad / ms_own:.2f}x |")
    print()
    for (name, dt), (k_pad, k_own) in kernels.items():
        print(f"{name} {dt}: 256: {k_pad}; 192: {k_own}")
