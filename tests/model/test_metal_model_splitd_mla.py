"""The model's verdicts the split-D routing at MLA's head dims follows
(benchmarks/model/families/splitd_mla.py; csrc/metal/families/prefill_splitd.cpp quotes
them in explain()): a model, not a measurement. Its counts come from the
shipped kernel in the sanitizing emulator (the partial split-D library
tests/model/test_metal_model_d512.py builds too), so these also check that the
counted kernel computes attention. Cheap shapes only (CI time): the decode
verdict over its whole table (two emulator runs, linear in Nk) and the
causal (576, 512) prefill verdict at N = 1024 (three runs, quadratic rule);
the rest of the table is `python -m benchmarks.model splitd-mla`.
"""
import math
import os
import sys

import torch

import flash_metal
from repo_paths import ROOT_DIR
sys.path.insert(0, ROOT_DIR)
from benchmarks.model.families import splitd_mla as S  # noqa: E402
from numerics import assert_attention_close


def test_counted_kernel_computes_attention():
    # The decode counts' run: 8 heads packed on one latent kv head, v a view of k.
    q, k, v = S._inputs(1, 8, 1, 1, 70, 576, 512, 3)
    out, lse, counts, d = S.run(q, k, v, False)
    assert d.function_constants[13] and d.grid == (1, 1, 1) and counts.threadgroups == 1
    assert_attention_close(out, lse, q, k, v, False, 1 / math.sqrt(576))


def test_mla_decode_verdict_and_its_threshold():
    decode = S.decode_table()
    routed = [r for b, hq, _, _, r in decode if hq > 16 and b * hq // 8 >= S.ROUTED_DECODE_THREADGROUPS]
    small = [r for b, hq, _, _, r in decode if hq > 16 and b * hq // 8 < S.ROUTED_DECODE_THREADGROUPS]
    # Routed: every band's slow end ahead of the composite path and of the wide decode (1.1-2.3x, 1.8-3.5x).
    assert routed and all(S.ahead(r, "composite") and S.ahead(r, "wide") for r in routed)
    ratios = [r["composite"] / r["fused"][1] for r in routed]
    assert 1.1 <= min(ratios) and max(ratios) < 2.3, ratios
    # Below the threshold (B 1 x 128: 16 threadgroups) some chip's band is behind: not routed.
    assert small and not all(S.ahead(r, "composite") for r in small)
    # The planner draws the line where the model does: one pass from 32 threadgroups; below, split along keys
    # from Nk 4096 (test_split_verdict), composite under it.
    one = torch.empty(1, 1, 1, 576, dtype=torch.float16)
    for b, nk, gpu, launches in ((1, 2048, "m1-max", 0), (1, 4096, "m1-max", 2), (1, 4096, "m5", 1),
                                 (1, 4096, "base", 1), (2, 4096, "m1-max", 1)):
        q, k = one.expand(b, 128, 1, 576), one.expand(b, 1, nk, 576)
        plan = flash_metal.explain(q, k, k[..., :512], False, gpu=gpu)
        assert len(plan.dispatches) == launches, plan.reason
        assert "a model, not a measurement" in plan.reason


def test_split_verdict():
    # B 1 x 128 heads (16 packed threadgroups), Nk 4096 and 32768: split along keys by the planner's count per
    # chip, its band ahead of the composite path and of the unsplit kernel where it splits (M1 Max, M3 Max,
    # M4 Pro); M5's resident slots allow one split, and its one pass is ahead of composite.
    table = [(1, 128, nk, chip, S.split_row(1, 128, nk, chip)) for nk in S.DECODE_NKS for chip in S.CHIPS]
    assert [r["splits"] for *_, r in table] == [6, 7, 3, 1] * 2
    v = S.split_verdicts(table)
    lo, hi, ulo, uhi, ahead = v["routed"]
    assert ahead and 1.9 <= lo and hi < 2.8 and 1.79 <= ulo and uhi < 4.3, v
    lo, hi, ahead = v["one_pass"]
    assert ahead and 1.75 <= lo and hi < 1.95, v
    # explain() quotes these figures
    plan = flash_metal.explain(torch.empty(1, 128, 1, 576), torch.empty(1, 1, 4096, 576),
                               torch.empty(1, 1, 4096, 512), True, gpu="m1-max")
    assert "1.9-2.8x over composite, 1.8-4.2x over unsplit" in plan.reason and "1.75-1.94x" in plan.reason
    # the base chips (8-10 cores): one pass, as M5, ahead of composite (the sentence's 1.8-2.7x)
    for chip in ("M1", "M2", "M3", "M4"):
        for nk in S.DECODE_NKS:
            r = S.split_row(1, 128, nk, chip)
            assert r["splits"] == 1 and S.ahead(r, "composite") and 1.8 <= r["composite"] / r["fused"][1] < 2.7


def test_causal_mla_prefill_verdict():
    # (576, 512), causal, 1 x 8 x 1024: the band ahead of unfused on every chip, about 2x (the routing's 2.0-2.1x).
    for chip in S.CHIPS:
        r = S.prefill_row(1024, 576, 512, True, chip)
        assert S.ahead(r, "unfused"), (chip, r)
        assert 2.0 <= r["unfused"] / r["fused"][1] < 2.1, (chip, r)
    assert "2.0-2.1x ahead" in flash_metal.explain(
        torch.empty(1, 8, 64, 576), torch.empty(1, 8, 64, 576), torch.empty(1, 8, 64, 512), True).reason
