"""The tensor-op kernels' cooperative-tensor bookkeeping per lane per block, from the Metal emulator (issue 40).

The emulator counts every coordinate query a kernel makes of a cooperative
tensor's layout (DispatchCounts.mpp_coord_queries: get_multidimensional_index
of a cooperative tensor or its iterator, is_valid_element, map_iterator; per
thread per call). This helper turns that into queries per lane per block of
the kernel's main loop: each kernel runs at two lengths of its loop (keys for
the forward and the dQ kernel, queries for the dK/dV kernel), nothing ragged
and no options, under the published M5 ("m5") lane layout, and the difference
of the counts is divided by the threads and by the added blocks, so the
per-kernel prologue and epilogue cancel. An emulator count, not a measurement
on Apple hardware: how many of these queries Apple's compiler folds away is
not known.

    python tests/mpp_bookkeeping.py              # the table, D 64 / 128 / 256, forward and backward
    python tests/mpp_bookkeeping.py OTHER/shaders  # another copy of shaders/ (the host's names must match)

Beside the coordinate queries, per block: SIMD-group barriers per SIMD-group, threadgroup barriers per
threadgroup, matmul2d runs per SIMD-group (every op here runs on one SIMD-group) and those of them over an
operand of dynamic extents (mpp_checked_runs: the op edge-checks them; static slices are not). The first
count column is the coordinate queries, the one read_counts reads back.
"""
import os
import re
import sys

import torch

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import backends  # noqa: E402  (tests/ on sys.path)
from numerics import make_qkv  # noqa: E402

HEAD_DIMS = (64, 128, 256)


def _block(name: str, key: str) -> int:
    return int(re.search(rf"_{key}(\d+)", name).group(1))


def _run(direction: str, d: int, nq: int, nk: int, dtype=torch.float16) -> dict:
    """{kernel name: DispatchCounts} of one emulated call (the tensor-op kernels only)."""
    q, k, v = make_qkv(1, 1, 1, nq, nk, d, dtype, generator=torch.Generator().manual_seed(40))
    backends.LAST_DISPATCHES.clear()
    out, lse = backends.emulated_metal_attention(q, k, v, False, None, "tensor_ops", mpp_layout="m5")
    if direction == "backward":
        g = torch.randn_like(out)
        backends.emulated_metal_attention_backward(g, q, k, v, out, lse, impl="tensor_ops", mpp_layout="m5")
    return {d_.kernel_name: c for d_, c in backends.LAST_DISPATCHES if "_mpp_" in d_.kernel_name}


# What per_block reports, each per block of a kernel's main loop: (name, counter, unit). Units: "lane" (per
# thread), "simdgroup" (per 32 threads), "threadgroup".
COLUMNS = (
    ("coord_queries", "mpp_coord_queries", "lane"),
    ("simdgroup_barriers", "simdgroup_barriers", "simdgroup"),
    ("threadgroup_barriers", "threadgroup_barriers", "threadgroup"),
    ("mpp_runs", "mpp_runs", "simdgroup"),
    ("checked_runs", "mpp_checked_runs", "simdgroup"),
)


def per_block(direction: str, d: int, dsplit_rows: int | None = None) -> dict:
    """{kernel name: {column: count per unit per block of its main loop}} (COLUMNS; floats).

    mpp_runs are counted once per scope (a SIMD-group here: every op runs on execution_simdgroup), so per
    SIMD-group is per scope."""
    saved = os.environ.get("FLASH_METAL_TENSOR_OPS_DSPLIT_ROWS")
    if dsplit_rows:
        os.environ["FLASH_METAL_TENSOR_OPS_DSPLIT_ROWS"] = str(dsplit_rows)
    try:
        nq = 64
        base = _run(direction, d, nq, 128)
        more_keys = _run(direction, d, nq, 256)
        more_queries = _run(direction, d, 2 * nq, 128) if direction == "backward" else {}
    finally:
        if saved is None:
            os.environ.pop("FLASH_METAL_TENSOR_OPS_DSPLIT_ROWS", None)
        else:
            os.environ["FLASH_METAL_TENSOR_OPS_DSPLIT_ROWS"] = saved
    result = {}
    for name, c in base.items():
        if "dkdv" in name:  # its loop: query blocks, the same keys (threads) at both lengths
            blocks, more = nq // _block(name, "bq"), more_queries[name]
        else:  # its loop: key blocks, the same rows (threads) at both lengths
            blocks, more = 128 // _block(name, "bk"), more_keys[name]
        units = {"lane": c.threads, "simdgroup": c.threads // 32, "threadgroup": c.threadgroups}
        result[name] = {col: (getattr(more, field) - getattr(c, field)) / (units[unit] * blocks)
                        for col, field, unit in COLUMNS}
    return result


def per_lane_per_block(direction: str, d: int, dsplit_rows: int | None = None) -> dict:
    """{kernel name: coordinate queries per lane per block of its main loop} (a float)."""
    return {name: cols["coord_queries"] for name, cols in per_block(direction, d, dsplit_rows).items()}


def table(columns: bool = False) -> list[tuple]:
    """(direction, D, kernel, coordinate queries per lane per block), or with columns=True the whole
    per_block dict in place of the count."""
    rows = []
    for d in HEAD_DIMS:
        for direction in ("forward", "backward"):
            variants = (32, 64) if (d == 256 and direction == "forward") else (None,)
            for rows_ in variants:
                for name, cols in per_block(direction, d, rows_).items():
                    if direction == "backward" and "prefill" in name:
                        continue  # the forward that made out and lse: its own row
                    rows.append((direction, d, name, cols if columns else cols["coord_queries"]))
    return rows


def read_counts(path: str) -> dict:
    """{kernel name: coordinate queries per lane per block} from a file this script wrote (its first count
    column), e.g. benchmarks/results/mpp_bookkeeping_before_issue40.txt."""
    out = {}
    with open(path) as f:
        for line in f:
            m = re.match(r"\s*(forward|backward)\s+D=\s*\d+\s+(\S+)\s+([-\d.]+)", line)
            if m:
                out[m.group(2)] = float(m.group(3))
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1:
        backends.MPP_SHADER = os.path.join(os.path.abspath(sys.argv[1]), "attention_mpp.metal")
    print(f"{'':8s} {'':5s} {'kernel':60s} " + " ".join(f"{c[0]:>20s}" for c in COLUMNS))
    print(f"{'':8s} {'':5s} {'(per block of the main loop)':60s} " + " ".join(f"{'per ' + c[2]:>20s}" for c in COLUMNS))
    for direction, d, name, cols in table(columns=True):
        print(f"{direction:8s} D={d:3d} {name:60s} " + " ".join(f"{cols[c[0]]:20.1f}" for c in COLUMNS))
