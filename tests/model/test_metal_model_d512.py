"""Head dim 512 on Metal (issue 20, section 3): the model's verdicts on two
fused plans, from exact emulator counts at D = 512: the prefill template
(benchmarks/model/families/d512.py, tests/prefill_d512_probe.metal) and the
shipped split-D kernel (benchmarks/model/families/splitd.py,
shaders/prefill/attention_prefill_splitd.h: its counts' correctness, its verdict per
chip), and the planner's routing that follows from them: causal to the
split-D kernel, not causal to the composite path. The kernel's own tests
(options, planted bugs) are tests/metal/test_metal_prefill_splitd.py."""
import math
import os
import sys

import pytest
import torch

import flash_metal
from numerics import assert_attention_close
from repo_paths import ROOT_DIR

# The checkout's root, for `benchmarks` (also when this file runs alone).
sys.path.insert(0, ROOT_DIR)
from benchmarks.model.core import counts as M  # noqa: E402
from benchmarks.model.families import d512 as W  # noqa: E402
from benchmarks.model.families import splitd as S  # noqa: E402


@pytest.mark.parametrize("causal", [False, True])
def test_probe_computes_attention_at_d512(causal):
    # The counts below are of a kernel that computes the right thing: every
    # element written (out poisoned with NaN by run_probe), 2x rule vs float64.
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 37, 512, generator=g).to(torch.float16) for _ in range(3))
    out, lse, counts, _ = W.run_probe(q, k, v, causal, *W.PLANS[0])
    assert counts.simdgroup_mmas > 0 and not out.isnan().any()
    assert_attention_close(out, lse, q, k, v, causal, 1 / math.sqrt(512))


def test_params_layout_is_parsed_from_the_header():
    offsets = W.params_offsets()
    assert offsets["q_batch_stride"] == (0, "int64_t")
    assert offsets["o_batch_stride"][0] == 12 * 8  # the 13th int64 field
    # head_dim follows the 19 int64 strides and 6 int32 sizes.
    assert offsets["head_dim"] == (19 * 8 + 6 * 4, "int32_t")


def test_fused_d512_is_predicted_slower_than_unfused_so_it_is_not_routed():
    # The gate: a fused D = 512 plan is routed only where the model
    # puts it ahead of unfused. The legal fused plan (8 x 8 blocks, 8 feature
    # parts) is predicted 2-3x slower when not causal on M3 and later, even
    # at the fast end of its band...
    s = M.Shape(1, 8, 8, 1024, 1024, 512)
    for chip in ("M3 Max", "M4 Pro", "M5 (10-core)"):
        r = W.compare(s, False, chip)
        assert r["fused"][0] > 1.5 * r["unfused"], (chip, r)
        assert r["bound"] == "compute"  # the serial section of each 8 x 8 block, not bandwidth
    # ... so the planner keeps that plan out: not causal, D = 512 runs the composite (unfused, chunked) path
    # and says why, citing the split-D verdict (level); causal runs the split-D kernel (~2x ahead).
    one = torch.empty(1, 1, 1, 512, dtype=torch.float16)
    q = one.expand(1, 8, 1024, 512)
    plan = flash_metal.explain(q, q, q, False, None, "auto")
    assert plan.dispatches == () and "predicted 2-3x slower than unfused" in plan.reason
    assert "the model puts the split-D plan level" in plan.reason
    (d,) = flash_metal.explain(q, q, q, True, None, "auto").dispatches
    assert d.kernel_name.startswith("flash_attention_prefill_splitd_float16_d512")
    (d,) = flash_metal.explain(q, q, q, False, None, "prefill").dispatches  # forced: the split-D kernel
    assert d.kernel_name.startswith("flash_attention_prefill_splitd_float16_d512")


# ---------------------------------------------------------------- split-D
# The shipped split-D kernel (shaders/prefill/attention_prefill_splitd.h, benchmarks/model/families/splitd.py):
# K/V read per feature part from device memory, Q and O in registers, 32-key blocks, the softmax shared.

@pytest.mark.parametrize("dtype, n", [(torch.float16, 37), (torch.bfloat16, 70), (torch.float32, 21)])
@pytest.mark.parametrize("causal", [False, True])
def test_splitd_counts_come_from_a_kernel_that_computes_attention(dtype, n, causal):
    # The model's runner (S.run: the planner's launch, instrumented, out and lse poisoned with NaN),
    # ragged N, 2x rule vs float64.
    g = torch.Generator().manual_seed(n + 2 * causal)
    q, k, v = (torch.randn(1, 2, n, 512, generator=g).to(dtype) for _ in range(3))
    out, lse, counts, _ = S.run(q, k, v, causal)
    assert counts.simdgroup_mmas > 0 and counts.threadgroup_barriers > 0
    assert_attention_close(out, lse, q, k, v, causal, 1 / math.sqrt(512))


# The model's verdict on the split-D plan (S.PLAN: the shared softmax, 8 rows x
# 32 keys, 8 feature parts) against unfused, per chip, at 1x8xNx512:
# (N, causal) -> verdicts in W.CHIPS order. Causal: about 2x ahead, the whole
# band, on every chip (unfused computes every score). Not causal: level
# (0.99-1.03x at the point), so the verdict sits on the band's middle and
# differs by chip. A change in the kernel's counts or the model that flips
# any of them fails here (csrc/metal/families/prefill_splitd.cpp routes on them).
AHEAD = ("ahead",) * 4
SPLITD_VERDICTS = {
    (1024, False): ("point only", "point only", "behind", "ahead"),
    (4096, False): AHEAD,
    (1024, True): AHEAD,
    (4096, True): AHEAD,
}


def test_splitd_verdict_against_unfused():
    for (n, causal), expected in SPLITD_VERDICTS.items():
        s = M.Shape(1, 8, 8, n, n, 512)
        got = tuple(S.verdict(S.compare(s, causal, chip)) for chip in W.CHIPS)
        assert got == expected, (n, causal, got)
        # On M5, unfused with its matmuls on the neural accelerators (tensor
        # ops) is predicted ahead of this simdgroup-matrix plan, even causal.
        r = S.compare(s, causal, "M5 (10-core)")
        assert r["fused"][0] > r["unfused_accel"], r


@pytest.mark.parametrize("causal, factor", [(False, 1.3), (True, 2.5)])
def test_splitd_verdict_follows_the_counts(monkeypatch, causal, factor):
    # The gate bites: the same plan with more MMAs (a repeated product, say)
    # is behind unfused on every chip.
    s = M.Shape(1, 8, 8, 1024, 1024, 512)
    real = S.records

    def heavier(*args, **kwargs):
        (r,) = real(*args, **kwargs)
        return [r._replace(counts=dict(r.counts, simdgroup_mmas=int(r.counts["simdgroup_mmas"] * factor)))]

    monkeypatch.setattr(S, "records", heavier)
    assert [S.verdict(S.compare(s, causal, chip)) for chip in W.CHIPS] == ["behind"] * 4
