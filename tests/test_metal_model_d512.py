"""Head dim 512 on Metal (issue 20, section 3): the model's verdicts on two
fused plans, from exact emulator counts at D = 512: the prefill template
(benchmarks/metal_model_d512.py, tests/prefill_d512_probe.metal) and the
split-D probe (benchmarks/metal_model_splitd.py, tests/prefill_splitd_probe.metal:
its correctness, sanitized, its verdict per chip, and planted bugs), and the
planner's routing that follows from them (the composite path)."""
import math
import os
import sys

import pytest
import torch

import flash_metal
from numerics import assert_attention_close

# The checkout's root, for `benchmarks` (also when this file runs alone).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import metal_model as M  # noqa: E402
from benchmarks import metal_model_d512 as W  # noqa: E402
from benchmarks import metal_model_splitd as S  # noqa: E402


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
    # ... so the planner routes head dims above 256 on Metal to the composite
    # (unfused, chunked) path and says why; asking for a fused kernel is refused.
    one = torch.empty(1, 1, 1, 512, dtype=torch.float16)
    q = one.expand(1, 8, 1024, 512)
    plan = flash_metal.explain(q, q, q, False, None, "auto")
    assert plan.dispatches == () and "predicted 2-3x slower than unfused" in plan.reason
    # The reason cites the split-D verdict too (test_splitd_verdict_against_unfused holds it).
    assert "split-D forward probe" in plan.reason and "about 2x ahead when causal" in plan.reason
    with pytest.raises(NotImplementedError, match="head_dim 512"):
        flash_metal.explain(q, q, q, False, None, "prefill")


# ---------------------------------------------------------------- split-D
# The split-D probe (tests/prefill_splitd_probe.metal, benchmarks/metal_model_splitd.py):
# K/V read per feature part from device memory, Q and O in registers, 32-key blocks.

@pytest.mark.parametrize("family, blocks", [("splitd_coop", (8, 32, 8)), ("splitd", (8, 32, 8))])
@pytest.mark.parametrize("n", [37, 70])
@pytest.mark.parametrize("causal", [False, True])
def test_splitd_computes_attention_at_d512(family, blocks, n, causal):
    # Instrumented (races, out-of-bounds, divergence raise), out and lse
    # poisoned with NaN by run(), ragged N, 2x rule vs float64.
    g = torch.Generator().manual_seed(n + 2 * causal)
    q, k, v = (torch.randn(1, 2, n, 512, generator=g).to(torch.float16) for _ in range(3))
    out, lse, counts, _ = S.run(q, k, v, causal, *blocks, family=family)
    assert counts.simdgroup_mmas > 0 and counts.threadgroup_barriers > 0
    assert_attention_close(out, lse, q, k, v, causal, 1 / math.sqrt(512))


@pytest.mark.parametrize("dtype, blocks, n", [(torch.bfloat16, (8, 32, 8), 37), (torch.float16, (16, 32, 16), 70),
                                              (torch.float16, (8, 16, 8), 21)])
def test_splitd_other_instantiations_compute_attention(dtype, blocks, n):
    # bfloat16; two row groups (the second past Nq in the last threadgroup); 16-key blocks.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, n, 512, generator=g).to(dtype) for _ in range(3))
    out, lse, counts, _ = S.run(q, k, v, True, *blocks)
    assert counts.simdgroup_mmas > 0
    assert_attention_close(out, lse, q, k, v, True, 1 / math.sqrt(512))


# The model's verdict on the split-D plan (S.PLAN: the coop softmax, 8 rows x
# 32 keys, 8 feature parts) against unfused, per chip, at 1x8xNx512:
# (N, causal) -> verdicts in W.CHIPS order. Causal: about 2x ahead, the whole
# band, on every chip (unfused computes every score). Not causal: level
# (0.99-1.03x at the point), so the verdict sits on the band's middle and
# differs by chip. A change in the probe's counts or the model that flips
# any of them fails here.
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


@pytest.mark.parametrize("old, new, caught", [
    # the third barrier removed: P and the row sums read before they are written
    ("    threadgroup_barrier(mem_flags::mem_threadgroup);  // P and row sums written before they are read (RAW)\n",
     "", "race"),
    # the causal mask off by one (each row's diagonal key dropped)
    ("b_key <= q0 + b_row + seq.upper", "b_key < q0 + b_row + seq.upper", "2x rule"),
])
def test_planted_splitd_bugs_are_caught(tmp_path, monkeypatch, old, new, caught):
    # A copy of the probe (and shaders/ beside it) with one bug planted in the
    # plan's kernel: the sanitizer or the 2x rule must reject it.
    import shutil

    from metal_emulator import EmulatorError, compile_library
    from numerics import NotClose

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shutil.copytree(os.path.join(root, "shaders"), tmp_path / "shaders")
    (tmp_path / "tests").mkdir()
    text = open(S.PROBE).read()
    assert text.count(old) == 1
    planted = tmp_path / "tests" / os.path.basename(S.PROBE)
    planted.write_text(text.replace(old, new))
    family, bq, bk, wm = S.PLAN
    lib = compile_library([str(planted)], instrumented=True, only=[f"flash_attention_{family}_float16_d512_*"])
    monkeypatch.setattr(S, "library", lambda instrumented=True: lib)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 37, 512, generator=g).to(torch.float16) for _ in range(3))
    with pytest.raises(EmulatorError if caught == "race" else NotClose) as e:
        out, lse, _, _ = S.run(q, k, v, True, bq, bk, wm, family=family)
        assert_attention_close(out, lse, q, k, v, True, 1 / math.sqrt(512))
    assert caught != "race" or "race" in e.value.kinds


def test_splitd_probe_follows_the_msl_rules_and_keeps_its_arrays_in_registers():
    # Q, O and S are fragment arrays indexed by compile-time constants only:
    # LLVM splits every one into scalars (none left in memory), which is what
    # the register count in metal_model_splitd.live_values assumes.
    from metal_emulator import check_msl_rules, private_arrays

    check_msl_rules([S.PROBE])
    left = private_arrays([S.PROBE])
    assert len(left) == 5 and all(arrays == [] for arrays in left.values()), left
