"""The packed absorbed-MLA decode split along keys (issue 20; fc_split_kv in
shaders/prefill/attention_prefill_splitd.h): each split-D threadgroup attends its 8
packed rows to one key range and writes unnormalized partials, then the
decode's own merge (flash_decode_merge_<dtype>_d512) sums them.

Routing (csrc/metal/families/prefill_splitd.cpp: splitd_takes and the split rule in
choose_splitd) follows benchmarks/model/families/splitd_mla.py (a model, not a
measurement). Results run bfloat16 on two sanitizing PARTIAL libraries the
suite already builds: the split-D kernels' (tests/model/test_metal_model_d512.py,
tests/metal/test_metal_prefill_splitd_mla.py) and the wide decode's bfloat16
kernels, whose merge at d512 this plan reuses (tests/backends.py
wide_decode_library). Outputs and partials are poisoned with NaN, the results
compared with the float64 oracle by the 2x rule (tests/numerics.py), and
_ran proves both passes ran, from those libraries. Shapes small and ragged
(Nk not a multiple of the split), for CI time.
"""
import os
import shutil

import pytest
import torch

import backends
import flash_metal
from backends import emulated_metal_attention, emulated_metal_varlen
from numerics import NotClose, assert_attention_close, assert_varlen_close
from repo_paths import ROOT_DIR

PREFIX = "flash_attention_prefill_splitd_"
SPLITD = PREFIX + "bfloat16_dqk576_dv512_bq8_bk32_wm8"
MERGE = "flash_decode_merge_bfloat16_d512"
PACK, SPLIT_KV = 13, 14  # fc_pack_gqa, fc_split_kv (csrc/metal/plan.h)
SPLIT_FIELDS_OFFSET = 192  # (kv_splits, split_keys) in AttentionParams (shaders/common/params.h)


@pytest.fixture(scope="module")
def splitd_lib():
    from shader_builds import shipped_library

    return shipped_library(instrumented=True, only=[PREFIX + "*"])  # the suite's shared split-D build


@pytest.fixture
def libs(splitd_lib, monkeypatch):
    monkeypatch.setattr(backends, "metal_library", lambda instrumented, fast_math=False: splitd_lib)
    return splitd_lib, backends.wide_decode_library(True)


def _splits(d):
    import struct

    return struct.unpack_from("<2i", d.params.numpy().tobytes(), SPLIT_FIELDS_OFFSET)


def _ran(libs, splits, grid_x):
    """The last emulated call ran the split pass (fc_split_kv, packed, `splits` ranges, grid x = grid_x) then
    the merge, each once, from the sanitizing libraries."""
    ds = [d for d, _ in backends.LAST_DISPATCHES]
    assert [d.kernel_name for d in ds] == [SPLITD, MERGE]
    assert SPLITD in libs[0].dispatched_names() and MERGE in libs[1].dispatched_names()
    assert ds[0].function_constants[PACK] and ds[0].function_constants[SPLIT_KV]
    assert _splits(ds[0])[0] == splits and ds[0].grid[0] == grid_x, (_splits(ds[0]), ds[0].grid)
    return ds


def _qkv(B, Hq, nq, nk, seed):
    """bfloat16 q (B, Hq, Nq, 576), k (B, 1, Nk, 576) and v = k[..., :512], the latent cache's view."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, nq, 576, generator=g).to(torch.bfloat16)
    k = torch.randn(B, 1, nk, 576, generator=g).to(torch.bfloat16)
    return q, k, k[..., :512]


def _explain(b=1, hq=128, nq=1, nk=4096, impl="auto", gpu="base"):
    one = torch.empty(1, 1, 1, 576, dtype=torch.float16)
    q, k = one.expand(b, hq, nq, 576), one.expand(b, 1, nk, 576)
    return flash_metal.explain(q, k, k[..., :512], True, None, impl, gpu)


# ---------------------------------------------------------------- routing

def test_b1_many_heads_decode_is_split_along_keys():
    # B 1 x 128 heads on one latent kv head: 16 packed threadgroups; split to the chip's resident slots
    # (cores x 3 over 16, rounded down), then the merge at d512.
    for gpu, splits in (("m1-max", 6), ("m3-max", 7), ("m4-pro", 3)):
        plan = _explain(gpu=gpu)
        d, m = plan.dispatches
        assert d.kernel_name == PREFIX + "float16_dqk576_dv512_bq8_bk32_wm8" and d.function_constants[SPLIT_KV]
        assert _splits(d) == (splits, 32 * -(-4096 // splits // 32)) and d.grid == (16 * splits, 1, 1)
        assert m.kernel_name == "flash_decode_merge_float16_d512" and m.grid == (1, 128, 1)
        assert not m.function_constants and m.threadgroup == (32, 1, 1)
        assert f"split along keys (fc_split_kv) into {splits} ranges" in plan.reason, plan.reason
        assert "a model, not a measurement" in plan.reason and "not yet verified on Apple hardware" in plan.reason
    # M5 (10 cores x 3 resident over 16): no second split fits a wave, so one pass (the model has it ahead).
    (d,) = _explain(gpu="m5").dispatches
    assert not d.function_constants[SPLIT_KV] and d.grid == (16, 1, 1)


def test_what_the_split_does_not_take_says_why():
    # Below the model's Nk (4096) the small grid stays composite, and says so.
    plan = _explain(nk=2048)
    assert plan.dispatches == () and "Nk = 2048 < 4096 for the split along keys" in plan.reason, plan.reason
    # 32 threadgroups and more: one pass, as before (the model's band is ahead unsplit there).
    (d,) = _explain(b=2).dispatches
    assert not d.function_constants[SPLIT_KV] and d.grid == (16, 1, 2)
    # Hq 16: the wide decode keeps it.
    assert _explain(hq=16).dispatches[0].kernel_name.startswith("flash_decode_split_")


# ---------------------------------------------------------------- results

@pytest.mark.parametrize("nq, nk, splits", [(1, 600, 2), (2, 555, 2)])
def test_split_decode_matches_float64(libs, nq, nk, splits):
    # 16 heads on one latent kv head (impl='prefill': 'auto' gives them to the wide decode), causal, Nk ragged:
    # 2 ranges of 320 (288) keys, the last one short; Nq 2 packs 32 rows into 4 blocks.
    q, k, v = _qkv(1, 16, nq, nk, seed=nq + nk)
    out, lse = emulated_metal_attention(q, k, v, True, None, "prefill", instrumented=True)
    _ran(libs, splits, 2 * nq * splits)
    assert_attention_close(out, lse, q, k, v, True)


def test_split_decode_options_match_float64(libs):
    # Per-head sinks (seeded in split 0 only), a per-head bool mask with one row fully masked (its output the
    # sink's: zeros, lse = the sink), softcap and a left window reaching into split 0, Nq 2, B 2.
    q, k, v = _qkv(2, 16, 2, 530, seed=5)
    g = torch.Generator().manual_seed(6)
    mask = torch.rand(2, 16, 2, 530, generator=g) > 0.3
    mask[1, 9, 0] = False
    sinks = torch.randn(16, generator=g)
    options = dict(attn_mask=mask, sinks=sinks, softcap=4.0, window_left=400)
    out, lse = emulated_metal_attention(q, k, v, True, None, "prefill", instrumented=True, **options)
    _ran(libs, 2, 8)
    assert_attention_close(out, lse, q, k, v, True, **options)
    assert (out[1, 9, 0] == 0).all() and lse[1, 9, 0] == pytest.approx(float(sinks[9]), rel=1e-6)


def test_varlen_split_decode_matches_float64(libs):
    # The gather path's plan (attention_kvcache past the wide decode): packed sequences of one row each, the
    # second's keys ending inside split 0, so its split 1 is the "no key" partial the merge weighs 0.
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    cu_k = torch.tensor([0, 590, 890], dtype=torch.int32)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 16, 576, generator=g).to(torch.bfloat16)
    k = torch.randn(890, 1, 576, generator=g).to(torch.bfloat16)
    v = k[..., :512]
    out, lse = emulated_metal_varlen(q, k, v, cu_q, cu_k, 1, 590, True, None, "prefill", instrumented=True)
    _ran(libs, 2, 4)
    assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, True)


# ---------------------------------------------------------------- planted bug

def test_planted_split_range_bug_is_caught(tmp_path, monkeypatch):
    # A split's key range one block too long (it overlaps the next split's first block, counted twice), in a
    # copy of shaders/ with only this plan's two kernels built (sanitizing).
    from metal_emulator import compile_library

    old = "n_blocks = min(n_blocks, (split + 1) * (p.split_keys / BK));"
    root = ROOT_DIR
    shutil.copytree(os.path.join(root, "shaders"), tmp_path / "shaders")
    header = tmp_path / "shaders" / "prefill" / "attention_prefill_splitd.h"
    text = header.read_text()
    assert text.count(old) == 1
    header.write_text(text.replace(old, old.replace("/ BK))", "/ BK) + 1)")))
    bad = compile_library([str(tmp_path / "shaders" / "attention.metal")], instrumented=True, only=[SPLITD, MERGE])
    monkeypatch.setattr(backends, "metal_library", lambda instrumented, fast_math=False: bad)
    monkeypatch.setattr(backends, "wide_decode_library", lambda instrumented: bad)
    q, k, v = _qkv(1, 16, 1, 600, seed=1)
    with pytest.raises(NotClose):
        out, lse = emulated_metal_attention(q, k, v, True, None, "prefill", instrumented=True)
        _ran((bad, bad), 2, 4)
        assert_attention_close(out, lse, q, k, v, True)
