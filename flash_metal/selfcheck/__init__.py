"""Check flash_metal on this machine and write a report to paste into an issue.

    python -m flash_metal.selfcheck [--backend mps|metal-emu] [--out DIR] [--quick]

Writes DIR/selfcheck.md (Markdown, for an issue) and DIR/selfcheck.json
(the same, for tools): the platform (macOS, chip, GPU and its families,
torch and flash_metal versions); where the kernels came from (the metallib,
or a runtime compile and why); every pipeline built, with its
maxTotalThreadsPerThreadgroup against the planner's N; the lane-layout
probe (the simdgroup_matrix layout the prefill and backward kernels assume),
run first; a correctness sweep of every kernel family, forward and backward,
against the float64 oracle by FlashAttention's 2x rule; and a short timing
table against torch's SDPA (and MLX's, when mlx is installed), measured on
this machine; then the accelerator section: where the device reports the
Metal 4 tensor-op kernels usable (flash_metal.device_info()["tensor_ops"]),
impl="tensor_ops" against the simdgroup prefill (and the tensor-op backward
against the simdgroup backward), both by the 2x rule, and each pair (the
forward's, the backward's) timed as a ratio on that Mac; elsewhere "skipped"
with the reason, and the emulator never times them
(--accelerator-only runs just that section, as the macOS 26 CI leg does).

Exit status: 0 when the lane probe and every check passed; 1 when any
failed; 2 when the backend cannot run here (the message says why).

--backend mps (the default where torch.backends.mps.is_available()) runs on
the Mac's GPU. --backend metal-emu runs the same sweep through the project's
Metal emulator, in a source checkout (it imports tests/backends.py).

The package: __init__.py (this public API: main, run, make_backend),
__main__.py (python -m flash_metal.selfcheck), cli.py (the command: arguments,
the order of the sections, the exit status), backends.py (where the kernels
run: mps or metal-emu), lanes.py (the lane-layout probe), sweep.py (the
correctness sweep and the timing table), accel.py (the tensor-op section) and
report.py (selfcheck.md, selfcheck.json, the progress bar). The modules are
internal: only the names in __all__ are the API.
"""
from .cli import main, make_backend, run

__all__ = ["main", "make_backend", "run"]
