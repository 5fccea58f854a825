"""The tensor-op kernels' per-block bookkeeping beside MLX's NAX attention (issue 40).

Two kinds of numbers, never mixed up:
- ours: Metal-emulator counts (flash_metal/_mpp_bookkeeping.py, measured by tests/mpp_bookkeeping.py:
  float16, the published M5 lane layout, nothing ragged, no options), before and after issue 40;
- MLX's: counted by reading its source (`nax_bookkeeping`), ml-explore/mlx
  mlx/backend/metal/kernels/steel/attn/kernels/steel_attention_nax.h @54f1cc6 and
  steel/attn/nax.h @d0d7b6c (ideas only, nothing copied), at the same tiles (64 query rows, 4 SIMD-groups of
  16 rows, 32 keys per block).
Neither is a measurement on Apple hardware, and neither enters the time model (core/timing.py): what a
coordinate query costs once Apple's compiler has unrolled and folded it is not known, so the model charges
none. They say where the kernels' work differs, not how long it takes.

    python -m benchmarks.model bookkeeping
"""
from flash_metal import _mpp_bookkeeping as B

# Ours, the forward at D 64 / 128 (the kernels MLX's NAX attention compares with at the same tiles).
FORWARD = {64: "flash_attention_prefill_mpp_float16_d64_bq64_bk32",
           128: "flash_attention_prefill_mpp_float16_d128_bq64_bk32"}


def nax_bookkeeping(d: int, bk: int = 32) -> dict:
    """MLX's attention_nax per key block of `bk` keys, by reading (see the module docstring), D a multiple of 32:
    - coord_queries per lane: 0. The lane's (row, column) comes from BaseNAXFrag::get_coord() once per kernel
      (lane arithmetic: MLX hard-codes the M5 map), and every slot after that is a compile-time offset; the
      cooperative tensors of each MMA are filled slot by slot (ct[i] = frag[i]) with no query.
    - mpp_runs per SIMD-group: S = Q.K^T as D / 16 runs of a 16 x 32 x 16 matmul2d (one per 16 features),
      O += P.V as (D / 32) x (bk / 16) runs of 16 x 32 x 16: D / 16 + D / 32 * bk / 16.
    - checked_runs: 0 (every run takes register fragments; the bounds checks are MLX's own load_safe on the
      last, ragged block: not a matmul2d edge check).
    - simdgroup_barriers per SIMD-group: 1 (simdgroup_barrier(mem_none) before P.V).
    - threadgroup_barriers per threadgroup: 1 at D = 128 (threadgroup_barrier(mem_none) halfway through P.V),
      0 otherwise.
    - device elements loaded per lane (its own loads, the fragments): Q again every block (16 x D / 32),
      K and V (bk x D / 32 each); ours reads Q once per kernel and lets matmul2d read K and V.
    - threadgroup memory: none (P and the rescale stay in registers)."""
    if d % 32:
        raise ValueError(f"MLX's NAX attention needs D % 32 == 0; got {d}")
    return {"coord_queries": 0.0, "simdgroup_barriers": 1.0, "threadgroup_barriers": 1.0 if d == 128 else 0.0,
            "mpp_runs": float(d // 16 + (d // 32) * (bk // 16)), "checked_runs": 0.0,
            "device_elements_per_lane": float(16 * d // 32 + 2 * bk * d // 32), "threadgroup_bytes": 0.0}


def rows():
    """(D, column, ours before, ours after, MLX NAX) for the forward at D 64 and 128."""
    out = []
    for d, name in FORWARD.items():
        ours, nax = B.counts(name), nax_bookkeeping(d)
        for col in ("coord_queries", "mpp_runs", "checked_runs", "simdgroup_barriers", "threadgroup_barriers"):
            before = ours["coord_queries_before_issue40"] if col == "coord_queries" else None
            out.append((d, col, before, ours[col], nax[col]))
    return out


def print_bookkeeping():
    print("\n### Per-block bookkeeping, forward, 64 x 32 tiles: ours = emulator counts, MLX NAX = counted by "
          "reading its source (no time attached; not measured on Apple hardware)")
    print("| D | per block | ours before issue 40 | ours now | MLX NAX |")
    print("|---|---|---|---|---|")
    for d, col, before, after, nax in rows():
        print(f"| {d} | {col} | {'' if before is None else f'{before:.0f}'} | {after:.0f} | {nax:.0f} |")
