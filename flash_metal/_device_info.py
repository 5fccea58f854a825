"""flash_metal.device_info(): torch.ops.flash_metal.metal_device_info's JSON as a dict.

The op (csrc/mps/device_info.mm on macOS builds, csrc/device_info.cpp
elsewhere) describes the Metal device, the macOS version, where the shader
library came from, the pipelines built and, under "tensor_ops", whether Auto
runs the Metal 4 tensor-op kernels here and why not (the routing's own rule,
tensor_ops_problem in csrc/metal/plan.h). Its keys are documented at the
schema, in csrc/flash_metal.cpp.
"""
import json

import torch

# The layout this wrapper reads (csrc/device_info.h, kSchemaVersion).
SCHEMA = 1


def device_info(build_pipelines: bool = False) -> dict:
    """What this process's Metal device and flash_metal's kernels report; never raises for a missing device
    or an MPS-less build ("available" is then False and "reason" says why).

    build_pipelines: first build the pipeline of every kernel the planner can choose (slow the first time).
    result["tensor_ops"]: {"usable": bool, "reason": why Auto does not run the tensor-op kernels (None when it
    does), "forced_reason": why impl="tensor_ops" cannot run (None when it can), "gpu_family": int or None}.
    """
    if not isinstance(build_pipelines, bool):
        raise TypeError(f"flash_metal.device_info: build_pipelines must be a bool; got {type(build_pipelines).__name__}")
    info = json.loads(torch.ops.flash_metal.metal_device_info(build_pipelines))
    if info.get("schema") != SCHEMA:
        raise RuntimeError(f"flash_metal.device_info: the extension answered schema {info.get('schema')!r}, this "
                           f"wrapper reads schema {SCHEMA}: reinstall flash_metal so the two match")
    return info
