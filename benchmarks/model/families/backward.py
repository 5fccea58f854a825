"""The backward family of the Metal performance model (issue 10), on the
emulator's exact counts: a prediction, not a measurement; nothing here ran on
a GPU.

    python -m benchmarks.model backward [--quick] [--occupancy]

0. Registers and occupancy (issue 19): a before/after table of the prefill and
   backward plans' live values per lane and resident SIMD-groups per core
   (the planner's estimates) on an M1 and an M3 Max; --occupancy prints only it.

1. Counts: core/backward_counts.py (the dQ kernel, then the dK/dV kernel, in
   the instrumented emulator; sizes too big to emulate scaled by the
   quadratic rule).
2. I/O model: the split's FlashAttention-2 traffic. dQ kernel: Q, dO, O read
   once, K and V once per query block up to its last visible key. dK/dV
   kernel: K and V once (its feature parts are SIMD-groups sharing the
   threadgroup's tiles), Q and dO once per key block from its first seeing
   query row. Printed next to the counted bytes.
3. Time: core/timing.py's predict on the counted records (the forward's time
   model: MMAs at the generation's rate, exp2, memory under the streaming
   ceiling, on-core data; residency from the planner's estimates hiding each
   streamed block's serial section, timing.backward_blocks; feature parts sum
   S and dP split-K, except float32 D = 256, whose recomputation is in the
   counted MMAs; the fused side printed as a band), against an UNFUSED
   backward's model (core/unfused.py): the composite path (PyTorch's MPS math
   path, MLX's unfused VJP) has P (N x N, saved by its forward) and runs
   dV = P^T dO, dP = dO V^T, the softmax backward dS = P * (dP - rowsum(P * dP))
   over N x N, then dQ = dS K and dK = dS^T Q: 4 GEMMs of 2 N^2 D FLOPs and
   7 N^2 elements of traffic per head. Each of its 5 kernels costs
   max(compute at the same MMA rate as ours, bytes at the same streaming
   ceiling) plus the same dispatch overhead: generous to unfused (no occupancy
   or cache effects), dense even when causal (the composite path masks, it
   does not skip).
"""
import torch

import flash_metal

from ..core import counts as M
from ..core import gpus as G
from ..core import timing as T
from ..core.backward_counts import counts_for
from ..core.counts import Shape
from ..core.iomodel import visible
from ..core.report import band_ms, fmt_ms
from ..core.unfused import unfused_seconds


def _blocks(kernel):
    fields = {p[:2]: int(p[2:]) for p in kernel.split("_") if p[:2] in ("bq", "bk", "ds") and p[2:].isdigit()}
    return fields["bq"], fields["bk"], fields.get("ds", 1)


def io_model(s: Shape, elem, records, causal):
    """Modelled device bytes read of (K + V, Q + dO), summed over both kernels."""
    bq = _blocks(records[0].kernel)[0]
    bk = _blocks(records[1].kernel)[1]
    row = s.d * elem
    kv_dq = sum(visible(min(q0 + bq, s.nq) - 1, s, causal) for q0 in range(0, s.nq, bq)) * s.hq
    first_row = lambda k0: max(0, k0 - (s.nk - s.nq)) if causal else 0  # noqa: E731
    q_dkdv = sum(max(0, s.nq - first_row(k0) // bq * bq) for k0 in range(0, s.nk, bk)) * s.hq
    kv = 2 * (kv_dq + s.nk * s.hkv) * row * s.b
    qdo = 2 * (s.nq * s.hq + q_dkdv) * row * s.b
    return kv, qdo


def io_measured(records):
    kv = sum(r.counts["read_k"] + r.counts["read_v"] for r in records)
    qdo = sum(r.counts["read_q"] + r.counts["read_grad_out"] for r in records)
    return kv, qdo


SHAPES_FULL = [Shape(1, 32, 32, 4096, 4096, d) for d in (64, 96, 128)] + [Shape(1, 8, 8, 8192, 8192, 128)]
SHAPES_QUICK = [Shape(1, 32, 32, 4096, 4096, d) for d in (64, 96, 128)]


def table(quick):
    gpus = [G.BY_NAME[n] for n in (("M3 Max",) if quick else ("M1 Max", "M3 Max", "M4 Max", G.POST_GPU))]
    print("\n## Backward, float16: fused (this kernel pair) vs unfused, predicted ms: model, not measurement")
    print("(fwd+bwd: the prefill forward's predicted time added to the fused side, the unfused forward's to the "
          "other)")
    print("| shape | causal | counts | K+V read / model | Q+dO read / model | MMAs | exp2 | "
          + " | ".join(f"{g.name} backward fused / unfused (speedup) | {g.name} fwd+bwd speedup" for g in gpus)
          + " |")
    print("|" + "---|" * (7 + 2 * len(gpus)))
    wins = []
    for s in (SHAPES_QUICK if quick else SHAPES_FULL):
        for causal in (False, True):
            recs = counts_for(s, torch.float16, causal)
            (kv, qdo), (mkv, mqdo) = io_measured(recs), io_model(s, 2, recs, causal)
            cells = []
            fwd = M.counts_for("prefill", s, torch.float16, causal)
            for g in gpus:
                t = T.predict(recs, g, s, torch.float16, causal)[0]
                u = unfused_seconds(s, torch.float16, g)
                tf = T.predict(fwd, g, s, torch.float16, causal)[0]
                uf = unfused_seconds(s, torch.float16, g, forward=True)
                wins.append((g.name, s, causal, u / t, (u + uf) / (t + tf)))
                cells.append(f"{band_ms(recs, g, s, torch.float16, causal)} / {fmt_ms(u)} ({u / t:.2f}x) "
                             f"| {(u + uf) / (t + tf):.2f}x")
            print(f"| {s.b}x{s.hq}x{s.nq}x{s.d} | {causal} | {'scaled' if recs[0].scaled else 'emulated'} "
                  f"| {kv / mkv:.3f} | {qdo / mqdo:.3f} | {sum(r.counts['simdgroup_mmas'] for r in recs)} "
                  f"| {sum(r.counts['exp2_calls'] for r in recs)} | " + " | ".join(cells) + " |")
    return wins


# The tile tables before issue 19's occupancy work (prefill: MLX's steel table; backward: one 8-row group
# per SIMD-group, dK/dV split over 2 threadgroups at D = 256), for the before/after table below:
# (elem bytes, D) -> (own rows, streamed rows, SIMD-groups per threadgroup, [live values per kernel]).
_OLD = {
    "prefill": {(e, d): (bq, bk, wm, [d // 4 + bk // 4 + 22]) for e in (2, 4)
                for d, (bq, bk, wm) in {64: (32, 32, 4), 80: (32, 32, 4), 96: (32, 32, 4), 128: (32, 16, 4),
                                        256: (16, 8, 2)}.items()},
    "backward": {(e, d): (r, st, r // 8, [d // 4 + st // 2 + 16, d // 2 // sp + st // 2 + 16])
                 for (e, d), (r, st, sp) in {
                     (4, 64): (32, 16, 1), (4, 80): (32, 16, 1), (4, 96): (32, 8, 1), (4, 128): (16, 8, 1),
                     (4, 256): (8, 8, 2), (2, 64): (32, 32, 1), (2, 80): (32, 32, 1), (2, 96): (32, 32, 1),
                     (2, 128): (32, 16, 1), (2, 256): (16, 8, 2)}.items()},
}
_CHIP_TG = {"m1": 60 * 1024, "m3-max": 32 * 1024}  # Apple 7/8 and Apple 9+ threadgroup memory per core


def _old_resident(kind, e, d, chip):
    """(max live values, fewest resident SIMD-groups per core) of the old table on `chip`: estimate_launch's rule."""
    own, st, sgs, lives = _OLD[kind][(e, d)]
    if kind == "prefill":
        tg = (own + st) * (d * e + 16)
    else:
        rows, padded = 2 * (own + st), d * e + 16
        tg = rows * (padded if rows * padded <= 32 * 1024 else padded - 16)
    res = min(max(1, min(208 * 1024 // (live * 128 * sgs), _CHIP_TG[chip] // tg)) * sgs for live in lives)
    return max(lives), res


def occupancy_table():
    """Before/after: live values per lane (budget 72) and resident SIMD-groups per core (target 8) of the
    prefill and backward plans on the model grid, on an M1 (60 KB of threadgroup memory per core) and an
    M3 Max (32 KiB): the planner's estimates (explain), not measurements."""
    print("\n## Registers and occupancy, before -> after (planner estimates, not measurements)")
    print("| pass | dtype | D | live values (max over kernels) | SIMD-groups per core M1 | M3 Max | kernels now |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("prefill", "backward"):
        for dtype in (torch.float32, torch.float16):
            e = torch.empty((), dtype=dtype).element_size()
            for d in (64, 80, 96, 128, 256):
                q = torch.zeros(1, dtype=dtype).expand(1, 8, 1024, d)
                cells = []
                for chip in _CHIP_TG:
                    plan = flash_metal.explain(q, q, q, True, None, "auto", chip, backward=kind == "backward")
                    cells.append((max(x.live_registers for x in plan.dispatches),
                                  min(x.simdgroups_per_core for x in plan.dispatches)))
                old = [_old_resident(kind, e, d, chip) for chip in _CHIP_TG]
                names = ", ".join(x.kernel_name.split("_", 3)[-1] for x in plan.dispatches)
                print(f"| {kind} | {str(dtype)[6:]} | {d} | {old[0][0]} -> {cells[0][0]} | {old[0][1]} -> {cells[0][1]} "
                      f"| {old[1][1]} -> {cells[1][1]} | {names} |")


def report(quick=False, occupancy=False):
    """The occupancy table, then (unless occupancy) the fused / unfused table and its claims."""
    occupancy_table()
    if occupancy:
        return []
    wins = table(quick)
    for i, what in ((3, "backward"), (4, "forward+backward")):
        faster = [w for w in wins if w[i] > 1.0]
        print(f"\nClaim (a prediction of this model, not yet verified on Apple hardware): the fused {what} is "
              f"predicted faster than the unfused one in {len(faster)} of {len(wins)} (GPU, shape, causal) cases; "
              f"slowest ratio {min(w[i] for w in wins):.2f}x, fastest {max(w[i] for w in wins):.2f}x.")
    print("Why dense loses: the atomics-free split recomputes S and dP in both kernels (7 products of 2 N^2 D "
          "FLOPs per head against the unfused path's 4), and at N = 4096 the MMA time of 3 extra products exceeds "
          "the N x N traffic the fused path saves; causal halves the fused work and not the unfused path's.")
    return wins

