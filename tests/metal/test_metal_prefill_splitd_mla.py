"""The split-D forward at MLA's head dims (issue 20 sections 2 and 3,
shaders/prefill/attention_prefill_splitd.h): (D_qk, D_v) = (576, 512) and (256, 512),
k and v as overlapping views of one latent cache, and the absorbed-MLA decode
packed over its query heads (fc_pack_gqa: a threadgroup's 8 rows are
(head, query) pairs of one kv head).

Routing (csrc/metal/families/prefill_splitd.cpp, splitd_takes) follows the model in
benchmarks/model/families/splitd_mla.py (a model, not a measurement). Results
run on a sanitizing PARTIAL emulator library holding only the split-D kernels
(races, out-of-bounds and barrier divergence raise), outputs poisoned with
NaN (tests/backends.py), compared with the float64 oracle by the 2x rule
(tests/numerics.py); each run proves the split-D kernel was its only dispatch
(_ran). Shapes stay small and ragged (CI time).
"""
import math
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
PACK = 13  # fc_pack_gqa's function constant (csrc/metal/plan.h kPackGqaFunctionConstant)


@pytest.fixture(scope="module")
def splitd_lib():
    """The sanitizing partial library of the split-D kernels (9: 3 pairs x 3 dtypes), shared by the module."""
    from shader_builds import shipped_library

    # The same build as benchmarks/model/families/splitd.py's (tests/model/test_metal_model_d512.py): one compile.
    return shipped_library(instrumented=True, only=[PREFIX + "*"])


@pytest.fixture
def lib(splitd_lib, monkeypatch):
    monkeypatch.setattr(backends, "metal_library", lambda instrumented, fast_math=False: splitd_lib)
    return splitd_lib


def _name(dtype, dqk, dv):
    dims = f"d{dqk}" if dqk == dv else f"dqk{dqk}_dv{dv}"
    return f"{PREFIX}{str(dtype)[6:]}_{dims}_bq8_bk32_wm8"


def _ran(lib, dtype, dqk, dv, packed=None):
    """The last emulated call ran the split-D kernel of (dtype, dqk, dv), once, from `lib`; packed: its
    fc_pack_gqa constant must be this."""
    dispatches = [d for d, _ in backends.LAST_DISPATCHES]
    assert [d.kernel_name for d in dispatches] == [_name(dtype, dqk, dv)]
    assert dispatches[0].kernel_name in lib.dispatched_names()
    if packed is not None:
        assert bool(dispatches[0].function_constants[PACK]) == packed
    return dispatches[0]


def _qkv(B, Hq, Hkv, nq, nk, dqk, dv, dtype, seed, latent=False):
    """q (B, Hq, Nq, D_qk), k (B, Hkv, Nk, D_qk), v (B, Hkv, Nk, D_v); latent: v = k[..., :D_v], a view."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, nq, dqk, generator=g).to(dtype)
    k = torch.randn(B, Hkv, nk, dqk, generator=g).to(dtype)
    v = k[..., :dv] if latent else torch.randn(B, Hkv, nk, dv, generator=g).to(dtype)
    return q, k, v


def _explain(dqk=576, dv=512, hq=2, hkv=1, nq=64, nk=64, causal=True, impl="auto", b=1, **options):
    q = torch.empty(b, hq, nq, dqk, dtype=torch.float16)
    k = torch.empty(b, hkv, nk, dqk, dtype=torch.float16)
    return flash_metal.explain(q, k, torch.empty(b, hkv, nk, dv, dtype=torch.float16), causal, None, impl, **options)


# ---------------------------------------------------------------- routing

@pytest.mark.parametrize("dqk", [576, 256])
def test_impl_prefill_runs_split_d_at_mla_pairs(dqk):
    for causal in (False, True):
        plan = _explain(dqk=dqk, causal=causal, impl="prefill")
        (d,) = plan.dispatches
        assert d.kernel_name == _name(torch.float16, dqk, 512)
        assert d.grid == (8, 2, 1) and d.threadgroup == (256, 1, 1) and d.threadgroup_memory == 9728
        assert f"requested by the caller (impl='prefill') at D_qk = {dqk}, D_v = 512" in plan.reason
        assert "not yet verified on Apple hardware" in plan.reason
    # Other dims above 256 are refused by the split-D kernel (composite under 'auto').
    with pytest.raises(NotImplementedError, match=r"\(576, 512\) or \(256, 512\) exactly"):
        _explain(dqk=320, impl="prefill")


def test_many_heads_mla_decode_packs_the_group():
    # DeepSeek's absorbed MLA: 128 query heads on one latent kv head, one row: past the wide decode's 16 rows
    # per kv head, so split-D, packed: 16 threadgroups of 8 heads each read K/V once.
    plan = _explain(hq=128, nq=1, nk=300, b=2, causal=True)
    (d,) = plan.dispatches
    assert d.kernel_name == _name(torch.float16, 576, 512), plan.reason
    assert d.grid == (16, 1, 2) and bool(d.function_constants[PACK])
    assert "pack GQA (fc_pack_gqa)" in plan.reason and "a model, not a measurement" in plan.reason
    # 16 heads on one kv head, one row: the wide decode still takes it.
    plan16 = _explain(hq=16, nq=1, nk=300)
    assert plan16.dispatches[0].kernel_name.startswith("flash_decode"), plan16.reason
    # Unpacked when a head's rows fill more than half a block (2 * Nq > 8).
    plan5 = _explain(hq=8, nq=5, nk=300, impl="prefill")
    assert plan5.dispatches[0].grid == (1, 8, 1) and not plan5.dispatches[0].function_constants[PACK]


@pytest.mark.parametrize("dqk", [576, 256])
def test_causal_mla_prefill_routes_to_split_d_with_the_model_verdict(dqk):
    plan = _explain(dqk=dqk, nq=40, nk=70)
    (d,) = plan.dispatches
    assert d.kernel_name == _name(torch.float16, dqk, 512) and d.grid == (5, 2, 1)
    assert plan.reason.startswith(f"prefill (split-D): D_qk = {dqk}, D_v = 512, causal: the model predicts")
    assert "2.0-2.1x ahead" in plan.reason and "a model, not a measurement" in plan.reason
    mask = torch.ones(1, 1, 40, 70, dtype=torch.bool)
    for options in (dict(window_left=16), dict(softcap=30.0), dict(attn_mask=mask), dict(sinks=torch.zeros(2))):
        assert _explain(dqk=dqk, nq=40, nk=70, **options).dispatches[0].kernel_name == d.kernel_name, options


def test_what_split_d_does_not_take_at_mla_pairs_says_why():
    cases = {  # call -> the reason's words
        "not causal": (_explain(causal=False), "level with the composite (unfused) path at (576, 512)"),
        "right window": (_explain(causal=False, window_right=4), "a right window"),
        "backward": (_explain(backward=True), "the split-D backward runs D_qk = D_v = 512 exactly"),
        "dims": (_explain(dqk=320), "(576, 512) or (256, 512) exactly"),
        # 128 heads, B 1: 16 packed threadgroups, each walking all keys on one core
        "small decode grid": (_explain(hq=128, nq=1, nk=300), "a decode grid of 16 split-D threadgroups < 32"),
    }
    for name, (plan, words) in cases.items():
        assert plan.dispatches == () and plan.reason.startswith("composite"), (name, plan.reason)
        assert words in plan.reason, (name, plan.reason)


# ---------------------------------------------------------------- results

# (D_qk, dtype, Nq, Nk, causal, impl): both pairs, every dtype once, ragged both ways.
RUNS = [(576, torch.float16, 13, 37, True, "prefill"), (576, torch.bfloat16, 37, 13, True, "prefill"),
        (576, torch.float32, 9, 20, False, "prefill"), (256, torch.float16, 21, 45, True, "prefill"),
        (256, torch.bfloat16, 17, 9, False, "prefill")]


@pytest.mark.parametrize("dqk, dtype, nq, nk, causal, impl", RUNS,
                         ids=[f"{r[0]}-{str(r[1])[6:]}-q{r[2]}k{r[3]}-{'causal' if r[4] else 'full'}" for r in RUNS])
def test_mla_pairs_match_float64(lib, dqk, dtype, nq, nk, causal, impl):
    q, k, v = _qkv(1, 2, 1, nq, nk, dqk, 512, dtype, seed=dqk + nq + 3 * nk)
    out, lse = emulated_metal_attention(q, k, v, causal, None, impl, instrumented=True)
    _ran(lib, dtype, dqk, 512, packed=False)
    assert_attention_close(out, lse, q, k, v, causal)
    if causal and nq > nk:  # the rows that see no key
        assert (out[:, :, : nq - nk] == 0).all() and (lse[:, :, : nq - nk] == -math.inf).all()


def test_latent_cache_views_match_float64(lib):
    # k and v overlapping views of one latent cache (v = k[..., :512]): strides in elements, nothing copied.
    q, k, v = _qkv(1, 4, 1, 11, 29, 576, 512, torch.float16, seed=3, latent=True)
    assert v.data_ptr() == k.data_ptr() and not v.is_contiguous()
    out, lse = emulated_metal_attention(q, k, v, True, None, "prefill", instrumented=True)
    d = _ran(lib, torch.float16, 576, 512)
    assert d.params is not None
    assert_attention_close(out, lse, q, k, v, True)


@pytest.mark.parametrize("nq", [1, 3])
def test_packed_many_heads_decode_matches_float64(lib, nq):
    # 16 query heads on one latent kv head (impl='prefill': 'auto' gives 16 x 1 to the wide decode), k and v
    # one latent cache, causal (bottom-right), B = 2, Nk ragged: 2 (Nq 1) or 6 (Nq 3) packed blocks per batch.
    q, k, v = _qkv(2, 16, 1, nq, 45, 576, 512, torch.bfloat16, seed=nq, latent=True)
    out, lse = emulated_metal_attention(q, k, v, True, None, "prefill", instrumented=True)
    d = _ran(lib, torch.bfloat16, 576, 512, packed=True)
    assert d.grid == (math.ceil(16 * nq / 8), 1, 2)
    assert_attention_close(out, lse, q, k, v, True)


def test_packed_decode_options_match_float64(lib):
    # Packed rows carry their own head: a per-head bool mask (one head's row fully masked), per-head sinks,
    # softcap and a left window, 12 heads on 2 kv heads (G = 6), Nq 3 (18 packed rows: a ragged block).
    q, k, v = _qkv(1, 12, 2, 3, 40, 576, 512, torch.float16, seed=8)
    g = torch.Generator().manual_seed(4)
    mask = torch.rand(1, 12, 3, 40, generator=g) > 0.2
    mask[0, 5, 1] = False
    sinks = torch.randn(12, generator=g)
    options = dict(attn_mask=mask, sinks=sinks, softcap=3.0, window_left=20)
    out, lse = emulated_metal_attention(q, k, v, True, None, "prefill", instrumented=True, **options)
    d = _ran(lib, torch.float16, 576, 512, packed=True)
    assert d.grid == (3, 2, 1)
    assert_attention_close(out, lse, q, k, v, True, **options)
    assert (out[0, 5, 1] == 0).all() and lse[0, 5, 1] == pytest.approx(float(sinks[5]), rel=1e-6)


def test_packed_d512_matches_float64(lib):
    # The pack holds for D_qk = D_v = 512 too (8 heads on one kv head, 2 rows, float32 additive mask).
    q, k, v = _qkv(1, 8, 1, 2, 21, 512, 512, torch.float16, seed=6)
    mask = torch.randn(1, 8, 2, 21)
    out, lse = emulated_metal_attention(q, k, v, False, None, "prefill", instrumented=True, attn_mask=mask)
    _ran(lib, torch.float16, 512, 512, packed=True)
    assert_attention_close(out, lse, q, k, v, False, attn_mask=mask)


def test_varlen_mla_matches_float64(lib):
    # Three sequences, one empty, at (256, 512), causal per sequence.
    cu_q = torch.tensor([0, 10, 10, 23], dtype=torch.int32)
    cu_k = torch.tensor([0, 19, 24, 31], dtype=torch.int32)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(23, 2, 256, generator=g).to(torch.float16)
    k = torch.randn(31, 2, 256, generator=g).to(torch.float16)
    v = torch.randn(31, 2, 512, generator=g).to(torch.float16)
    out, lse = emulated_metal_varlen(q, k, v, cu_q, cu_k, 13, 19, True, None, "prefill", instrumented=True)
    _ran(lib, torch.float16, 256, 512)
    assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, True)


# ---------------------------------------------------------------- planted bugs

@pytest.mark.parametrize("old, new", [
    # Q's part width one tile short (8 fragments of 72 features instead of 9): the 9th tile's features dropped
    ("constexpr int TQ = DQK / 8 / PARTS;", "constexpr int TQ = DQK / 8 / PARTS - 1;"),
    # the packed shared step's mask slice from the fragment view's head, not its own row's head
    ("mask_head_offset(p, group.z, head0 + uint(b_hoff))", "mask_head_offset(p, group.z, head0 + uint(hoff))"),
], ids=["q_part_one_tile_short", "packed_mask_wrong_head"])
def test_planted_bugs_are_caught(tmp_path, monkeypatch, old, new):
    # A copy of shaders/ with one bug in the split-D kernel, only float16's (576, 512) built (sanitizing).
    from metal_emulator import compile_library

    root = ROOT_DIR
    shutil.copytree(os.path.join(root, "shaders"), tmp_path / "shaders")
    header = tmp_path / "shaders" / "prefill" / "attention_prefill_splitd.h"
    text = header.read_text()
    assert text.count(old) == 1
    header.write_text(text.replace(old, new))
    bad = compile_library([str(tmp_path / "shaders" / "attention.metal")], instrumented=True,
                          only=[_name(torch.float16, 576, 512)])
    monkeypatch.setattr(backends, "metal_library", lambda instrumented, fast_math=False: bad)
    q, k, v = _qkv(1, 8, 1, 2, 21, 576, 512, torch.float16, seed=2)
    mask = torch.rand(1, 8, 2, 21, generator=torch.Generator().manual_seed(1)) > 0.5
    with pytest.raises(NotClose):
        out, lse = emulated_metal_attention(q, k, v, True, None, "prefill", instrumented=True, attn_mask=mask)
        _ran(bad, torch.float16, 576, 512, packed=True)
        assert_attention_close(out, lse, q, k, v, True, attn_mask=mask)


def test_paged_latent_mla_decode_gathers_then_runs_packed_split_d(lib):
    # attention_kvcache on a paged latent cache (v_cache = k_cache[..., :512]), 64 heads on one kv head, one
    # token, 4 sequences (one empty): past the wide decode's rows, so the pages in use are gathered
    # (csrc/kvcache.cpp) and the varlen plan runs the packed split-D kernel (8 threadgroups per sequence).
    from backends import emulated_metal_kvcache
    from test_metal_decode_paged import check_against_oracle, make_paged_cache

    seqlens, g = [30, 0, 17, 40], torch.Generator().manual_seed(12)
    k_cache, _, table, k_contig, _ = make_paged_cache(4, 1, 576, torch.float16, 16, seqlens, g)
    q = torch.randn(4, 64, 1, 576, generator=g).to(torch.float16)
    lengths = torch.tensor(seqlens, dtype=torch.int32)
    plan = flash_metal.explain(q, k_cache, k_cache[..., :512], True, block_table=table, cache_seqlens=lengths)
    assert "gather path" in plan.reason and "pack GQA" in plan.reason, plan.reason
    out, lse = emulated_metal_kvcache(q, k_cache, k_cache[..., :512], lengths, table, True, instrumented=True)
    d = _ran(lib, torch.float16, 576, 512, packed=True)
    assert d.grid == (8, 1, 4)
    check_against_oracle(out, lse, q, k_contig, k_contig[..., :512], seqlens, True)
