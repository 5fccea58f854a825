"""The lane-layout probe of python -m flash_metal.selfcheck.

The prefill and backward kernels compute each lane's (row, col) in an 8x8
simdgroup_matrix fragment themselves (prefill_frag_row / prefill_frag_col in
shaders/prefill/attention_prefill.h) to mask, reduce rows and store, and build
fragments from threadgroup memory by that layout. Apple does not document
the layout; the kernels assume MLX's (BaseMMAFrag::get_coord). If a GPU
disagrees, every prefill and backward result is wrong, so selfcheck runs
this probe first: it compiles the kernel's own helpers into a one-SIMD-group
kernel (the same test tests/prefill_lanes.metal runs in the emulator) and
checks, lane by lane, that the helpers' coordinates are MLX's and that the
fragments they build equal what the hardware's simdgroup_load gives.

On MPS it runs through torch.mps.compile_shader (torch >= 2.6); on the
metal-emu backend, the same source runs through the project's emulator.
"""
import os
import re
import tempfile
from typing import Dict, List, Optional

import torch

# The probe: tile is a static threadgroup array (compile_shader cannot set a
# dynamic threadgroup length), binding order is the argument order
# (compile_shader binds argument i at [[buffer(i)]]). index is an 8 x 16
# row-major float matrix, element (r, c) = 16 r + c. Per lane l:
#   coords[2l], coords[2l + 1]: prefill_frag_row / prefill_frag_col;
#   read:     prefill_read_frag of block (rows 0..7, cols 8..15) from threadgroup memory;
#   loaded:   thread_elements() of simdgroup_load of the same block from device memory;
#   read_t:   prefill_read_frag_t of the staged matrix (the transpose of that block);
#   loaded_t: thread_elements() of the transposed simdgroup_load of that block.
PROBE_SOURCE = r"""
#include "prefill/attention_prefill.h"

[[kernel]] void fm_selfcheck_prefill_lanes(device const float* index [[buffer(0)]], device int* coords [[buffer(1)]],
                                           device float* read [[buffer(2)]], device float* loaded [[buffer(3)]],
                                           device float* read_t [[buffer(4)]], device float* loaded_t [[buffer(5)]],
                                           uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float tile[8 * 16];
  for (uint i = lane; i < 8 * 16; i += 32) tile[i] = index[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const int fr = flash_metal::prefill_frag_row(lane);
  const int fc = flash_metal::prefill_frag_col(lane);
  coords[2 * lane] = fr;
  coords[2 * lane + 1] = fc;
  flash_metal::PrefillFrag a, b, at, bt;
  flash_metal::prefill_read_frag(a, tile, 16, 0, 8, fr, fc);
  simdgroup_load(b, index, 16, ulong2(8, 0));
  flash_metal::prefill_read_frag_t(at, tile, 16, 8, 0, fr, fc);
  simdgroup_load(bt, index, 16, ulong2(8, 0), true);
  for (int j = 0; j < 2; ++j) {
    read[2 * lane + j] = a.thread_elements()[j];
    loaded[2 * lane + j] = b.thread_elements()[j];
    read_t[2 * lane + j] = at.thread_elements()[j];
    loaded_t[2 * lane + j] = bt.thread_elements()[j];
  }
}
"""
KERNEL = "fm_selfcheck_prefill_lanes"
# One SIMD-group: the probe is about the 32 lanes of one fragment.
SIMD_WIDTH = 32

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\b")


def shader_directory(source_root: Optional[str] = None) -> Optional[str]:
    """Where the shader headers are: the installed package's copy, else a source checkout's shaders/."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # flash_metal/ (this is selfcheck/lanes.py)
    candidates = [os.path.join(package, "shaders")]
    if source_root:
        candidates.insert(0, os.path.join(source_root, "shaders"))
    candidates.append(os.path.join(os.path.dirname(package), "shaders"))
    for c in candidates:
        if os.path.isfile(os.path.join(c, "prefill", "attention_prefill.h")):
            return c
    return None


def flatten(source: str, directory: str, seen=None) -> str:
    """source with every local (quoted) include inlined from `directory`, each file once.

    The rule csrc/mps/shader_source.h applies for the runtime compile
    (Metal's runtime compiler has no include path); <...> includes are left
    for the compiler, `#pragma once` lines dropped.
    """
    seen = set() if seen is None else seen
    out = []
    for line in source.splitlines():
        m = _INCLUDE.match(line)
        if m:
            path = os.path.normpath(os.path.join(directory, m.group(1)))
            if path not in seen:
                seen.add(path)
                with open(path, encoding="utf-8") as f:
                    out.append(flatten(f.read(), os.path.dirname(path), seen))
            continue
        out.append("" if _PRAGMA_ONCE.match(line) else line)
    return "\n".join(out) + "\n"


def probe_source(source_root: Optional[str] = None) -> str:
    directory = shader_directory(source_root)
    if directory is None:
        raise FileNotFoundError("the shader headers (prefill/attention_prefill.h) are neither in the installed package "
                                "(flash_metal/shaders/) nor in a source checkout")
    return flatten(PROBE_SOURCE, directory)


def mlx_coord(lane: int):
    """(row, col) of a lane's first thread_elements() entry: MLX's BaseMMAFrag::get_coord."""
    qid = lane // 4
    return (qid & 4) + (lane // 2) % 4, (qid & 2) * 2 + (lane % 2) * 2


def index_matrix() -> torch.Tensor:
    return torch.arange(128, dtype=torch.float32).reshape(8, 16)


def check_lanes(coords, read, loaded, read_t, loaded_t) -> List[str]:
    """Every way the probe's outputs differ from MLX's layout (empty: the layout is as assumed)."""
    index = index_matrix()
    coords, read, loaded, read_t, loaded_t = (t.cpu() for t in (coords, read, loaded, read_t, loaded_t))
    problems, cells = [], set()
    for lane in range(SIMD_WIDTH):
        r, c = mlx_coord(lane)
        got = (int(coords[2 * lane]), int(coords[2 * lane + 1]))
        if got != (r, c):
            problems.append(f"lane {lane}: the kernel's (row, col) is {got}, MLX's layout says {(r, c)}")
        for j in range(2):
            cells.add((r, c + j))
            if read[2 * lane + j] != index[r, 8 + c + j]:
                problems.append(f"lane {lane}[{j}]: prefill_read_frag gave {float(read[2 * lane + j])}, "
                                f"expected {float(index[r, 8 + c + j])}")
            if read_t[2 * lane + j] != index[c + j, 8 + r]:
                problems.append(f"lane {lane}[{j}]: prefill_read_frag_t gave {float(read_t[2 * lane + j])}, "
                                f"expected {float(index[c + j, 8 + r])}")
            if read[2 * lane + j] != loaded[2 * lane + j]:
                problems.append(f"lane {lane}[{j}]: prefill_read_frag gave {float(read[2 * lane + j])}, "
                                f"simdgroup_load gave {float(loaded[2 * lane + j])}")
            if read_t[2 * lane + j] != loaded_t[2 * lane + j]:
                problems.append(f"lane {lane}[{j}]: prefill_read_frag_t gave {float(read_t[2 * lane + j])}, "
                                f"the transposed simdgroup_load gave {float(loaded_t[2 * lane + j])}")
        # The 4 lanes of a row are l, l^1, l^8, l^9: the kernels' simd_shuffle_xor 1 and 8.
        if {mlx_coord(lane ^ x)[0] for x in (1, 8, 9)} != {r}:
            problems.append(f"lane {lane}: lanes l^1, l^8, l^9 do not share its row")
    if len(cells) != 64:
        problems.append(f"the lanes cover {len(cells)} of the fragment's 64 elements")
    return problems


def _buffers(device) -> Dict[str, torch.Tensor]:
    return {
        "index": index_matrix().to(device),
        "coords": torch.full((64,), -1, dtype=torch.int32, device=device),
        **{n: torch.full((64,), float("nan"), device=device) for n in ("read", "loaded", "read_t", "loaded_t")},
    }


_ORDER = ("index", "coords", "read", "loaded", "read_t", "loaded_t")


def _result(bufs, runner: str) -> dict:
    problems = check_lanes(*(bufs[n] for n in _ORDER[1:]))
    shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
    return {"status": "passed" if not problems else "failed", "runner": runner, "problems": shown,
            "detail": "the simdgroup_matrix lane layout is MLX's, as the prefill and backward kernels assume"
            if not problems else f"{len(problems)} mismatch(es): the prefill and backward kernels' lane layout "
            "is NOT this GPU's; every prefill and backward result is suspect"}


def run_on_mps(source_root: Optional[str] = None) -> dict:
    """The probe on the MPS device through torch.mps.compile_shader."""
    if not hasattr(torch.mps, "compile_shader"):
        return {"status": "skipped", "runner": "torch.mps.compile_shader",
                "detail": f"skipped: torch {torch.__version__} is too old (torch.mps.compile_shader arrived in 2.6); "
                          "the correctness sweep still checks the prefill results", "problems": []}
    try:
        lib = torch.mps.compile_shader(probe_source(source_root))
        bufs = _buffers("mps")
        getattr(lib, KERNEL)(*(bufs[n] for n in _ORDER), threads=SIMD_WIDTH, group_size=SIMD_WIDTH)
        torch.mps.synchronize()
    except Exception as err:  # noqa: BLE001  (reported, never a traceback)
        return {"status": "error", "runner": "torch.mps.compile_shader", "problems": [],
                "detail": f"the probe could not run: {type(err).__name__}: {str(err)[:2000]}"}
    return _result(bufs, "torch.mps.compile_shader")


def run_on_emulator(compile_library, source_root: str) -> dict:
    """The same probe source through the project's Metal emulator (its sanitizing build)."""
    try:
        src = probe_source(source_root)
        directory = os.path.join(tempfile.gettempdir(), f"flash_metal_selfcheck_{os.getuid()}")
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "prefill_lanes_probe.metal")
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(src)
        os.replace(tmp, path)
        lib = compile_library([path], instrumented=True)
        bufs = _buffers("cpu")
        lib.dispatch(KERNEL, buffers={i: bufs[n] for i, n in enumerate(_ORDER)}, grid=(1,), threadgroup=(SIMD_WIDTH,))
    except Exception as err:  # noqa: BLE001
        return {"status": "error", "runner": "Metal emulator", "problems": [],
                "detail": f"the probe could not run: {type(err).__name__}: {str(err)[:2000]}"}
    return _result(bufs, "Metal emulator (sanitizing build)")
