"""Every kernel the planner can name exists, in the shaders and on a real Mac.

- Everywhere: the kernel names the planner returns (torch.ops.flash_metal.metal_plan
  over every dtype, head dim and impl) are exactly the instantiations in
  shaders/attention.metal, as the Metal emulator compiles them.
- On macOS with an MPS build (the macOS CI): torch.ops.flash_metal.metal_build_all_pipelines
  builds, with the real Metal framework, the pipeline of every (name,
  function constants) pair the planner can produce, from the installed library. With
  FLASH_METAL_REQUIRE_METALLIB=1 (the CI's build) that library must be the
  precompiled metallib, not the runtime-compile fallback.
"""
import os
import sys

import pytest
import torch

import flash_metal  # noqa: F401  (registers the ops)
from prereqs import IN_CI
from repo_paths import ROOT_DIR as ROOT

ON_MAC_WITH_MPS = sys.platform == "darwin" and torch.backends.mps.is_built()
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def planner_kernel_names():
    """Every kernel name metal_plan returns, over each dtype, head dim 1..256 and impl, the decode's wide
    buckets (512, 576), the split-D forward at its three (D_qk, D_v) pairs and the split-D backward at 512,
    and the backward's (with sinks: three)."""
    names = set()
    for dtype in DTYPES:
        for d in range(1, 257):
            q = torch.zeros(1, 1, 1, d, dtype=dtype)
            long_k = torch.zeros(1, 1, 4096, d, dtype=dtype)
            for impl in ("untiled", "tiled", "prefill", "decode"):
                names.add(torch.ops.flash_metal.metal_plan(q, q, q, False, None, impl)[0])
            for i in range(2):  # the split pass and the merge pass
                names.add(torch.ops.flash_metal.metal_plan(q, long_k, long_k, False, None, "decode_split", "base", i)[0])
                names.add(torch.ops.flash_metal.metal_plan(q, q, q, False, None, "auto", "base", i, True)[0])  # backward
        # The decode-only buckets 512 and 576 (issue 20): Gemma's D = 512, a ragged 300 in 512's, MLA's
        # (576, 512) and a ragged (520, 64) in 576's (D_v stops at 512); one query row.
        for dqk, dv in ((512, 512), (300, 300), (576, 512), (520, 64)):
            q, k, v = (torch.zeros(1, 1, 1, n, dtype=dtype) for n in (dqk, dqk, dv))
            long_k, long_v = torch.zeros(1, 1, 4096, dqk, dtype=dtype), torch.zeros(1, 1, 4096, dv, dtype=dtype)
            names.add(torch.ops.flash_metal.metal_plan(q, k, v, False, None, "decode")[0])
            for i in range(2):
                names.add(torch.ops.flash_metal.metal_plan(q, long_k, long_v, False, None, "decode_split", "base", i)[0])
        # The split-D forward at (512, 512), (576, 512) and (256, 512) (shaders/prefill/attention_prefill_splitd.h):
        # impl='prefill', 9 query rows.
        for dqk in (512, 576, 256):
            q, v = torch.zeros(1, 1, 9, dqk, dtype=dtype), torch.zeros(1, 1, 9, 512, dtype=dtype)
            names.add(torch.ops.flash_metal.metal_plan(q, q, v, False, None, "prefill")[0])
        # The split-D backward at D = 512 (shaders/backward/attention_backward_splitd.h): impl='prefill', its pair.
        q = torch.zeros(1, 1, 9, 512, dtype=dtype)
        for i in range(2):
            names.add(torch.ops.flash_metal.metal_plan(q, q, q, False, None, "prefill", "base", i, True)[0])
    q = torch.zeros(1, 1, 1, 32)
    # The backward's third dispatch with sinks: grad_sinks (one kernel for every dtype and head dim).
    names.add(torch.ops.flash_metal.metal_plan(q, q, q, False, None, "auto", "base", 2, True, sinks=torch.zeros(1))[0])
    return names


def test_planner_names_are_exactly_the_shader_instantiations():
    from metal_emulator import BuildError
    from shader_builds import is_quant_decode, is_splitd_backward, is_wide_decode, shipped_library

    try:
        library = shipped_library()
    except BuildError as err:
        if IN_CI:
            pytest.fail(str(err))
        pytest.skip(str(err))
    # The default build leaves the wide decode and the split-D backward out (tests/shader_builds.py) but
    # names them: the planner's
    # names are the source's, built or not.
    # The quantized decode (issue 44) is planned only for attention_kvcache over a quantized cache: its
    # names come from the planner's registry (csrc/metal/registry.cpp).
    quant = {n for n in torch.ops.flash_metal.metal_registry_routes()[0] if is_quant_decode(n)}
    assert planner_kernel_names() | quant == set(library.source_kernel_names())
    assert library.omitted_names() and all(is_wide_decode(n) or is_splitd_backward(n) or is_quant_decode(n)
                                           for n in library.omitted_names())


@pytest.mark.skipif(not ON_MAC_WITH_MPS, reason="builds Metal pipelines: macOS with an MPS-enabled torch only")
def test_every_kernel_builds_a_metal_pipeline():
    try:
        origin, built = torch.ops.flash_metal.metal_build_all_pipelines()
    except RuntimeError as err:
        if "no Metal device" in str(err) and not IN_CI:
            pytest.skip(str(err))
        raise
    # "<kernel>/<function constants as 0/1>": every planned name, each with
    # both causal settings (constant 0) when it has constants at all (the
    # decode merge pass has none; flash_sinks_grad reads only fc_varlen, planned off).
    pairs = [entry.rsplit("/", 1) for entry in built]
    assert {name for name, _ in pairs} == planner_kernel_names()
    for name in planner_kernel_names():
        want = ({"0"},) if name == "flash_sinks_grad" else ({"0", "1"}, {""})
        assert {bits[:1] for n, bits in pairs if n == name} in want, name
    if os.environ.get("FLASH_METAL_REQUIRE_METALLIB") == "1":
        assert origin.startswith("the precompiled ") and origin.endswith("flash_metal.metallib"), origin
