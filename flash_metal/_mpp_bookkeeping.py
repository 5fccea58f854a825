"""The tensor-op kernels' per-block bookkeeping, as the Metal emulator counts it (issue 40).

Emulator counts, not measurements on Apple hardware: tests/mpp_bookkeeping.py runs each kernel (float16,
the published M5 lane layout, nothing ragged, no options) at two lengths of its main loop and divides the
difference by the lanes (SIMD-groups, threadgroups) and the added blocks. How much of it Apple's compiler
folds away (a coordinate query of a fully unrolled loop may become a constant) only a Mac can say.
benchmarks/results/mpp_bookkeeping_{before,after}_issue40.txt hold the full tables;
tests/metal/test_mpp_speed_structure.py checks this table against a live measurement and the recorded
"before" file, so it cannot go stale silently.

Per block of the kernel's main loop (key blocks; query blocks in the dK/dV kernels):
  coord_queries         cooperative-tensor coordinate queries per lane (get_multidimensional_index,
                        is_valid_element, map_iterator)
  simdgroup_barriers    per SIMD-group
  threadgroup_barriers  per threadgroup
  mpp_runs              matmul2d runs per SIMD-group
  checked_runs          of them, runs over an operand of dynamic extents (edge-checked)
  coord_queries_before_issue40   the same kernel's coordinate queries per lane before issue 40's changes
"""
from typing import Dict, Optional

# Kernel name with its dtype replaced by {dtype} -> counts (float16 measured; bfloat16 runs the same code).
_COLUMNS = ("coord_queries", "simdgroup_barriers", "threadgroup_barriers", "mpp_runs", "checked_runs",
            "coord_queries_before_issue40")
_TABLE = {
    "flash_attention_prefill_mpp_{dtype}_d64_bq64_bk32": (32.0, 2.0, 0.0, 2.0, 0.0, 326.0),
    "flash_backward_mpp_dq_{dtype}_d64_bq64_bk32": (0.0, 2.0, 0.0, 3.0, 0.0, 32.0),
    "flash_backward_mpp_dkdv_{dtype}_d64_bk64_bq32": (0.0, 1.0, 2.0, 4.0, 0.0, 32.0),
    "flash_attention_prefill_mpp_{dtype}_d128_bq64_bk32": (64.0, 2.0, 0.0, 2.0, 0.0, 518.0),
    "flash_backward_mpp_dq_{dtype}_d128_bq32_bk32": (0.0, 2.0, 0.0, 3.0, 0.0, 32.0),
    "flash_backward_mpp_dkdv_{dtype}_d128_bk64_bq32": (0.0, 1.0, 2.0, 4.0, 0.0, 32.0),
    "flash_attention_prefill_mpp_dsplit_{dtype}_d256_bq32_bk32_wn2": (64.0, 1.0, 2.0, 2.0, 0.0, 550.0),
    "flash_attention_prefill_mpp_dsplit_{dtype}_d256_bq64_bk16_wn2": (64.0, 2.0, 1.0, 2.0, 0.0, 470.0),
    "flash_backward_mpp_dsplit_dq_{dtype}_d256_bq16_bk32_wn2": (0.0, 1.0, 2.0, 3.0, 0.0, 64.0),
    "flash_backward_mpp_dsplit_dkdv_{dtype}_d256_bk32_bq16_wn2": (0.0, 1.0, 3.0, 4.0, 0.0, 32.0),
}


def key(kernel_name: str) -> str:
    """The table's key of a kernel name: its dtype replaced by {dtype}."""
    for dtype in ("float16", "bfloat16", "float32"):
        kernel_name = kernel_name.replace(f"_{dtype}_", "_{dtype}_", 1)
    return kernel_name


def counts(kernel_name: str) -> Optional[Dict[str, float]]:
    """The bookkeeping of a tensor-op kernel (emulator counts, per block; see the module's docstring), or None
    for a kernel the table does not cover (not a tensor-op kernel, or the MLA pair's)."""
    row = _TABLE.get(key(kernel_name))
    return None if row is None else dict(zip(_COLUMNS, row))
