"""The tensor-op kernels' speed structure (issue 40), each change held by something the emulator counts or checks.

- Coordinates once per kernel: the emulator's mpp_coord_queries per lane per block, measured now
  (tests/mpp_bookkeeping.py), is below the recorded count of the kernels before issue 40
  (benchmarks/results/mpp_bookkeeping_before_issue40.txt), kernel by kernel, and equals what the after file and
  flash_metal.explain()'s table (flash_metal/_mpp_bookkeeping.py) say.
- Every cooperative-tensor loop unrolled: a source check over every MPP header (FM_UNROLL before each loop
  over a cooperative tensor's slots), which a planted loop without it fails.
- Alpha in registers where is_iterator_compatible allows: the instrumented build's threadgroup stores (no alpha
  stored under "m5"; tests/metal/test_metal_tensor_ops.py, test_q_is_read_once_per_threadgroup, both layouts).
- Static slices on full blocks: mpp_checked_runs is 0 on aligned shapes and counts the ragged block's runs
  otherwise; a static slice on the ragged block (planted) is refused.
- relaxed_precision for 16-bit operands: every matmul2d run of a float16 / bfloat16 call is relaxed
  (mpp_relaxed_runs), and the shim's descriptor is Apple's field for field (the mode in relaxed's place is
  refused: tests/metal_emulator_tests/test_emu_mpp_rules.py, PLANT 14).
Runtime: about 5 s on one core with the emulator's libraries cached (the bookkeeping table runs 22 small
dispatches); a cold cache adds the planted partial library's build and the tensor-op libraries the other
tensor-op tests build anyway.
"""
import os
import re
import shutil

import pytest
import torch

import backends
import mpp_bookkeeping
from backends import LAST_DISPATCHES, emulated_metal_attention, emulated_metal_attention_backward
from metal_emulator import EmulatorError, compile_library
from numerics import make_qkv

from flash_metal import _mpp_bookkeeping
from repo_paths import ROOT_DIR as ROOT

SHADERS = os.path.join(ROOT, "shaders")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
# Every header under shaders/, in every family folder (found by walking, never listed): a cooperative
# tensor can only appear in the MSL 4 ones (shaders/tensor_ops/), but a new header anywhere is checked too.
HEADERS = sorted(os.path.relpath(os.path.join(d, f), SHADERS) for d, _, files in os.walk(SHADERS)
                 for f in files if f.endswith(".h") and not f.startswith("."))


# ---- every cooperative-tensor loop unrolled ---------------------------------------------------------------------

_COOP_LOOP = re.compile(r"^\s*for \(.*(\.get_capacity\(\)|\.begin\(\))")


def not_unrolled(text: str) -> list[int]:
    """Line numbers (1-based) of loops over a cooperative tensor's slots (get_capacity() or begin() in the
    loop header) whose previous non-blank line is not FM_UNROLL."""
    lines = text.splitlines()
    bad = []
    for i, line in enumerate(lines):
        if not _COOP_LOOP.match(line):
            continue
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j < 0 or lines[j].strip() != "FM_UNROLL":
            bad.append(i + 1)
    return bad


def test_every_cooperative_tensor_loop_is_unrolled():
    loops = 0
    assert any(name.startswith("tensor_ops" + os.sep) for name in HEADERS), HEADERS
    for name in HEADERS:
        text = open(os.path.join(SHADERS, name)).read()
        loops += sum(bool(_COOP_LOOP.match(line)) for line in text.splitlines())
        assert not_unrolled(text) == [], name
    assert loops >= 25  # the check sees the kernels' loops (28 when written)


def test_the_unroll_check_bites():
    text = open(os.path.join(SHADERS, "tensor_ops", "attention_prefill_mpp.h")).read()
    assert not_unrolled(text) == []
    planted = text.replace("  FM_UNROLL\n  for (int i = 0; i < s.get_capacity(); ++i) {",
                           "  for (int i = 0; i < s.get_capacity(); ++i) {", 1)
    assert planted != text and len(not_unrolled(planted)) == 1


# ---- coordinates once per kernel: after below before ------------------------------------------------------------

@pytest.fixture(scope="module")
def after():
    return {name: cols for _, _, name, cols in mpp_bookkeeping.table(columns=True)}


def test_coordinate_queries_per_block_fell_below_the_recorded_before(after):
    before = mpp_bookkeeping.read_counts(os.path.join(RESULTS, "mpp_bookkeeping_before_issue40.txt"))
    assert set(before) == set(after)  # every kernel of the before file measured now, and no other
    for name, n in before.items():
        assert after[name]["coord_queries"] < n, (name, after[name]["coord_queries"], n)
    # The forwards keep one map_iterator per element of O per block (alpha's broadcast, Apple's documented
    # way): 16 rows x the SIMD-group's features (D, or D / 2 for a half of the split-D pair) over 32 lanes.
    # Every backward kernel asks nothing per block.
    for name, cols in after.items():
        d = int(re.search(r"_d(\d+)_", name).group(1))
        features = d // 2 if "dsplit" in name else d
        expected = 0.0 if "backward" in name else 16 * features / 32
        assert cols["coord_queries"] == expected, name


def test_the_after_file_and_explains_table_are_the_measurement(after):
    recorded = mpp_bookkeeping.read_counts(os.path.join(RESULTS, "mpp_bookkeeping_after_issue40.txt"))
    before = mpp_bookkeeping.read_counts(os.path.join(RESULTS, "mpp_bookkeeping_before_issue40.txt"))
    assert recorded == {name: cols["coord_queries"] for name, cols in after.items()}
    for name, cols in after.items():
        shipped = _mpp_bookkeeping.counts(name)
        assert shipped == dict(cols, coord_queries_before_issue40=before[name]), name
    assert _mpp_bookkeeping.counts(next(iter(after)).replace("float16", "bfloat16")) is not None
    assert _mpp_bookkeeping.counts("flash_attention_prefill_float16_d64_bq64_bk32_wm4") is None


def test_explain_carries_the_counts_on_tensor_op_routes():
    import flash_metal
    q, k, v = make_qkv(1, 2, 2, 128, 128, 128, torch.float16, generator=torch.Generator().manual_seed(1))
    plan = flash_metal.explain(q, k, v, impl="tensor_ops", gpu="m5")
    counts = plan.dispatches[0].mpp_bookkeeping
    assert counts is not None and counts["coord_queries"] < counts["coord_queries_before_issue40"]
    simd = flash_metal.explain(q, k, v, impl="prefill", gpu="m5")
    assert all(d.mpp_bookkeeping is None for d in simd.dispatches)
    bwd = flash_metal.explain(q, k, v, impl="tensor_ops", gpu="m5", backward=True)
    assert all(d.mpp_bookkeeping is not None for d in bwd.dispatches if "_mpp_" in d.kernel_name)


# ---- static slices on full blocks, relaxed precision ------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_full_blocks_run_static_and_every_run_is_relaxed(dtype):
    g = torch.Generator().manual_seed(40)
    # Aligned: every block full, no checked run anywhere (forward, dQ, dK/dV).
    q, k, v = make_qkv(1, 1, 1, 64, 128, 64, dtype, generator=g)
    out, lse = emulated_metal_attention(q, k, v, False, None, "tensor_ops", mpp_layout="m5")
    mpp = [(d.kernel_name, c) for d, c in LAST_DISPATCHES]  # each call records its own dispatches
    emulated_metal_attention_backward(torch.randn_like(out), q, k, v, out, lse, impl="tensor_ops", mpp_layout="m5")
    mpp += [(d.kernel_name, c) for d, c in LAST_DISPATCHES if "_mpp_" in d.kernel_name]
    assert len(mpp) == 3 and all("_mpp_" in name for name, _ in mpp)
    for name, c in mpp:
        assert c.mpp_runs > 0 and c.mpp_checked_runs == 0, name
        assert c.mpp_relaxed_runs == c.mpp_runs, name
    # Ragged (100 keys: the last block 4 keys): the forward's 4 SIMD-groups each run S and P.V over dynamic
    # extents on that block alone; the full blocks stay static.
    q, k, v = make_qkv(1, 1, 1, 64, 100, 64, dtype, generator=g)
    emulated_metal_attention(q, k, v, False, None, "tensor_ops", mpp_layout="m5")
    ((d, c),) = LAST_DISPATCHES
    assert c.mpp_runs == 4 * 2 * 4 and c.mpp_checked_runs == 4 * 2, d.kernel_name


def test_a_static_slice_on_the_ragged_block_is_refused(tmp_path, monkeypatch):
    """Every block taken as full: the last one's static slice of 32 keys runs past the sequence (33 keys), which
    the emulator refuses (a static extent the tensor does not have; Apple's header keeps static slices for
    inside tiles)."""
    shutil.copytree(SHADERS, tmp_path / "shaders")
    header = tmp_path / "shaders" / "tensor_ops" / "attention_prefill_mpp.h"
    text = header.read_text()
    assert text.count("    const bool full = keys == BK;\n") == 1
    header.write_text(text.replace("    const bool full = keys == BK;\n", "    const bool full = true;\n"))
    lib = compile_library([str(tmp_path / "shaders" / "attention_mpp.metal")], msl=4,
                          only=["flash_attention_prefill_mpp_float16_d64_bq64_bk32"])
    monkeypatch.setattr(backends, "metal_mpp_library", lambda instrumented, fast_math=False: lib)
    q, k, v = make_qkv(1, 1, 1, 17, 33, 64, torch.float16, generator=torch.Generator().manual_seed(41))
    with pytest.raises(EmulatorError, match="static slice past its tensor's extents"):
        emulated_metal_attention(q, k, v, False, None, "tensor_ops", mpp_layout="m5")
