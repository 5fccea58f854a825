"""Which CPU tile-product path the CPU kernel takes, and the CPU's features (issue 22).

The CPU flash kernel runs its Q·Kᵀ and P·V tile products either on float32
FMA tiles ("vector", every dtype) or, for bfloat16/float16, through PyTorch's
block GEMM at::native::cpublas::brgemm ("brgemm": the matrix units, AMX, where
ATen can drive them; ATen's non-AMX fallback elsewhere). The choice is made at
every call, in C++ (csrc/cpu/matrix_units.h), from the environment variable
FLASH_METAL_CPU_PATH:

    auto    (default) brgemm for a 16-bit dtype where ATen can pack it for the
            matrix units (AMX-BF16 / AMX-FP16), forward and backward alike,
            vector otherwise;
    vector  always the FMA tiles;
    brgemm  brgemm for bfloat16/float16 (without AMX: ATen's fallback, slow,
            for testing the path); float32 keeps the FMA tiles.

FLASH_METAL_CPU_VNNI sets how brgemm lays out its B operands:

    auto    (default) pair-interleaved (VNNI, packed by ATen) where ATen can pack
            the dtype for the matrix units, plain rows otherwise;
    emulate a test seam: VNNI packing and products by the project's scalar code on
            any CPU (slow), and auto takes brgemm as if the matrix units were
            there; the reason then says "VNNI emulated";
    off     plain rows always (no matrix units), and auto keeps vector.

Any other value of either is a ValueError at the next CPU call.
"""
from typing import Dict, NamedTuple

import torch


class CpuPath(NamedTuple):
    path: str     # "vector" or "brgemm"
    reason: str   # why, e.g. "forward bfloat16: vector (auto: no AMX for bfloat16 here, ...)"
    vnni: bool    # brgemm with VNNI-packed operands, on the matrix units


def cpu_path(dtype: torch.dtype = torch.bfloat16, backward: bool = False) -> CpuPath:
    """The path a CPU call in `dtype` takes now (forward, or backward=True), and why."""
    return CpuPath(*torch.ops.flash_metal.cpu_path_info(dtype, backward))


def cpu_features() -> Dict[str, bool]:
    """The CPU's ISA flags as cpuid and the OS report them (avx2, fma, avx512f, avx512_bf16,
    avx512_fp16, amx_tile, amx_bf16, amx_fp16), whether this torch has brgemm
    (torch_brgemm), and whether ATen can pack each 16-bit dtype for AMX (could_pack_*)."""
    names, values = torch.ops.flash_metal.cpu_features()
    return {n: bool(v) for n, v in zip(names, values)}


def cpu_path_counts() -> Dict[str, int]:
    """CPU kernel calls so far in this process, per path (for tests and logs)."""
    c = torch.ops.flash_metal.cpu_path_counts()
    return {"forward_vector": c[0], "forward_brgemm": c[1], "backward_vector": c[2], "backward_brgemm": c[3],
            "forward_vnni_emulated": c[4], "backward_vnni_emulated": c[5], "emulated_tile_products": c[6],
            "forward_brgemm_column_form": c[7], "backward_float32_first_pass_blocks": c[8],
            "forward_float16_split_bf16": c[9], "forward_key_split": c[10]}


def cpu_label() -> str:
    """The CPU model and its flags on one line, for benchmark tables: "AMD EPYC ... | avx2 fma -avx512f ..."."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        import platform
        model = platform.processor() or platform.machine()
    feats = cpu_features()
    flags = " ".join(n if feats[n] else "-" + n for n in
                     ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16"))
    return f"{model} | {flags} | torch {torch.__version__}, {torch.get_num_threads()} threads"
