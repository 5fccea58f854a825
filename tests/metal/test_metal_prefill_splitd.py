"""The split-D forward at head dim 512 (issue 20 section 3,
shaders/prefill/attention_prefill_splitd.h): its routing and explain() text, its
results through the sanitizing emulator against the float64 oracle by the 2x
rule (tests/numerics.py), and planted bugs.

Routing (csrc/metal/families/prefill_splitd.cpp): impl='auto' runs it for causal
D_qk = D_v = 512 forwards with Nq > 8 (the model's verdict: about 2x ahead of
the composite path, benchmarks/model/families/d512.py; a model, not a
measurement); not causal stays composite (the verdict is level), as do
D_v != D_qk and a right window, and auto backward calls (the split-D
backward's verdict: tests/metal/test_metal_backward_splitd.py); impl='prefill' at
512 forces it.
Every run here is sanitized (races, out-of-bounds, barrier divergence
raise), outputs are poisoned with NaN (tests/backends.py), and each proves
the split-D kernel ran (the emulator's dispatch list). Shapes stay small and
ragged (CI time): Nq != Nk both ways, rows with no visible key, GQA; and a
paged KV cache at 512, whose pages the gather path packs before the varlen
plan runs the split-D kernel.
"""
import math
import os
import shutil

import pytest
import torch

import backends
import flash_metal
from backends import emulated_metal_attention, emulated_metal_kvcache, emulated_metal_varlen
from numerics import DTYPES, NotClose, assert_attention_close, assert_varlen_close, dtype_id
from test_metal_decode_paged import check_against_oracle, make_paged_cache
from repo_paths import ROOT_DIR

D = 512
PREFIX = "flash_attention_prefill_splitd_"


def _ran(dtype):
    """The last emulated call ran the split-D kernel of `dtype`, once, from the sanitizing build."""
    names = [d.kernel_name for d, _ in backends.LAST_DISPATCHES]
    assert names == [f"{PREFIX}{str(dtype)[6:]}_d512_bq8_bk32_wm8"], names
    assert names[0] in backends.metal_library(True).dispatched_names()


def _qkv(B, Hq, Hkv, nq, nk, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, nq, D, generator=g).to(dtype), torch.randn(B, Hkv, nk, D, generator=g).to(dtype),
            torch.randn(B, Hkv, nk, D, generator=g).to(dtype))


def _explain(nq=64, nk=64, causal=True, impl="auto", dv=D, hq=2, hkv=1, **options):
    q = torch.empty(1, hq, nq, D, dtype=torch.float16)
    k = torch.empty(1, hkv, nk, D, dtype=torch.float16)
    return flash_metal.explain(q, k, torch.empty(1, hkv, nk, dv, dtype=torch.float16), causal, None, impl, **options)


# ---------------------------------------------------------------- routing

def test_causal_d512_routes_to_split_d_with_the_model_verdict():
    plan = _explain()
    (d,) = plan.dispatches
    assert d.kernel_name == PREFIX + "float16_d512_bq8_bk32_wm8"
    assert d.grid == (8, 2, 1) and d.threadgroup == (256, 1, 1) and d.threadgroup_memory == 9728
    assert d.threadgroup_memory <= 32 * 1024 and d.max_threads_per_threadgroup == 256
    assert plan.reason.startswith("prefill (split-D): D_qk = D_v = 512, causal")
    assert "about 2x ahead" in plan.reason and "a model, not a measurement" in plan.reason
    assert "not yet verified on Apple hardware" in plan.reason
    # The options it takes keep it: GQA, window_left, softcap, masks, sinks.
    mask = torch.ones(1, 1, 64, 64, dtype=torch.bool)
    for options in (dict(window_left=16), dict(softcap=30.0), dict(attn_mask=mask), dict(sinks=torch.zeros(2))):
        assert _explain(**options).dispatches[0].kernel_name.startswith(PREFIX), options


def test_what_split_d_does_not_take_stays_composite_with_the_reason():
    cases = {  # call -> the reason's words
        "not causal": (_explain(causal=False), "the model puts the split-D plan level"),
        "backward": (_explain(backward=True), "the model puts the split-D backward behind"),
        "D_v != D_qk": (_explain(dv=256), "(576, 512) or (256, 512) exactly"),
        "right window": (_explain(causal=False, window_right=4), "a right window"),
        "decode rows": (_explain(nq=8, hq=4), "the model priced the split-D plan on prefill shapes only"),
    }
    for name, (plan, words) in cases.items():
        assert plan.dispatches == () and plan.reason.startswith("composite"), (name, plan.reason)
        assert words in plan.reason, (name, plan.reason)


def test_impl_prefill_forces_split_d_at_512():
    for causal in (False, True):
        plan = _explain(causal=causal, impl="prefill")
        assert plan.dispatches[0].kernel_name.startswith(PREFIX)
        assert "requested by the caller (impl='prefill') at D = 512" in plan.reason
    with pytest.raises(NotImplementedError, match=r"\(576, 512\) or \(256, 512\) exactly"):
        _explain(dv=256, impl="prefill")


# ---------------------------------------------------------------- results

# (Nq, Nk): more keys than queries, and more queries than keys (causal:
# rows 0..Nq-Nk-1 see no key, zeros and lse -inf).
SHAPES = ((13, 37), (37, 13))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"q{s[0]}k{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_causal_gqa_matches_float64(dtype, shape):
    nq, nk = shape
    q, k, v = _qkv(1, 2, 1, nq, nk, dtype, seed=nq + 3 * nk)
    out, lse = emulated_metal_attention(q, k, v, True, None, instrumented=True)
    _ran(dtype)
    assert_attention_close(out, lse, q, k, v, True)
    if nq > nk:  # the rows that see no key
        assert (out[:, :, : nq - nk] == 0).all() and (lse[:, :, : nq - nk] == -math.inf).all()


def _mask(kind, nq, nk, dtype, g):
    """(1, 1, Nq, Nk) bool (a random tenth dropped, and row 0 all dropped), or additive in `kind`'s dtype
    (random, with -inf on a tenth)."""
    drop = torch.rand(1, 1, nq, nk, generator=g) < 0.1
    if kind == "bool":
        keep = ~drop
        keep[..., 0, :] = False
        return keep
    add = torch.randn(1, 1, nq, nk, generator=g).masked_fill(drop, -math.inf)
    return add.to(torch.float32 if kind == "float32" else dtype)


# Each option on its own (causal, float16, GQA 2:1, 21 x 45), plus bfloat16's additive mask.
OPTIONS = [("bool_mask", torch.float16), ("input_mask", torch.bfloat16), ("float32_mask", torch.float16),
           ("window_left", torch.float16), ("softcap", torch.float16), ("sinks", torch.float32)]


@pytest.mark.parametrize("option, dtype", OPTIONS, ids=[o for o, _ in OPTIONS])
def test_options_match_float64(option, dtype):
    nq, nk = 21, 45
    q, k, v = _qkv(1, 2, 1, nq, nk, dtype, seed=len(option))
    g = torch.Generator().manual_seed(7)
    options = {}
    if option.endswith("mask"):
        options["attn_mask"] = _mask(option.split("_")[0], nq, nk, dtype, g)
    elif option == "window_left":
        options["window_left"] = 9  # key blocks behind every row's window are skipped
    elif option == "softcap":
        options["softcap"] = 2.0
    else:
        options["sinks"] = torch.tensor([0.5, -1.0])
    out, lse = emulated_metal_attention(q, k, v, True, None, instrumented=True, **options)
    _ran(dtype)
    assert_attention_close(out, lse, q, k, v, True, **options)
    if option == "bool_mask":  # row 0 sees no key
        assert (out[:, :, 0] == 0).all() and (lse[:, :, 0] == -math.inf).all()


def test_sinks_on_rows_with_no_key_give_zeros_and_the_sink():
    # Nq > Nk, causal: the first rows see no key and attend to the sink only.
    q, k, v = _qkv(1, 2, 2, 19, 6, torch.float16, seed=5)
    sinks = torch.tensor([0.25, 1.5])
    out, lse = emulated_metal_attention(q, k, v, True, None, instrumented=True, sinks=sinks)
    _ran(torch.float16)
    assert_attention_close(out, lse, q, k, v, True, sinks=sinks)
    assert (out[:, :, :13] == 0).all() and torch.allclose(lse[0, :, :13], sinks[:, None].expand(2, 13), rtol=1e-6)


def test_varlen_matches_float64():
    # Three sequences, one of them empty, Nq != Nk in both directions; causal (bottom-right per sequence).
    cu_q = torch.tensor([0, 11, 11, 30], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 25, 34], dtype=torch.int32)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(n, 2, D, generator=g).to(torch.float16) for n in (30, 34, 34))
    out, lse = emulated_metal_varlen(q, k, v, cu_q, cu_k, 19, 20, True, None, instrumented=True)
    _ran(torch.float16)
    assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, True)


def test_forced_not_causal_matches_float64():
    q, k, v = _qkv(2, 2, 1, 17, 9, torch.bfloat16, seed=4)
    out, lse = emulated_metal_attention(q, k, v, False, 0.05, "prefill", instrumented=True)
    _ran(torch.bfloat16)
    assert_attention_close(out, lse, q, k, v, False, 0.05)


# ---------------------------------------------------------------- planted bugs

@pytest.mark.parametrize("old, new, caught", [
    # the third barrier removed: P and the row sums read before they are written
    ("    threadgroup_barrier(mem_flags::mem_threadgroup);  // P and row sums written before they are read (RAW)\n",
     "", "race"),
    # the causal mask off by one: each row's diagonal key dropped (the window test, inlined wrong)
    ("key_in_window(seq, b_query, b_key)", "b_key < b_query + seq.upper", "2x rule"),
])
def test_planted_bugs_are_caught(tmp_path, monkeypatch, old, new, caught):
    # A copy of shaders/ with one bug in the split-D kernel, built alone (sanitizing): the sanitizer or
    # the 2x rule must reject it.
    from metal_emulator import EmulatorError, compile_library

    root = ROOT_DIR
    shutil.copytree(os.path.join(root, "shaders"), tmp_path / "shaders")
    header = tmp_path / "shaders" / "prefill" / "attention_prefill_splitd.h"
    text = header.read_text()
    assert text.count(old) == 1
    header.write_text(text.replace(old, new))
    lib = compile_library([str(tmp_path / "shaders" / "attention.metal")], instrumented=True,
                          only=[PREFIX + "float16_*"])
    monkeypatch.setattr(backends, "metal_library", lambda instrumented, fast_math=False: lib)
    q, k, v = _qkv(1, 2, 1, 21, 37, torch.float16, seed=2)
    with pytest.raises(EmulatorError if caught == "race" else NotClose) as e:
        out, lse = emulated_metal_attention(q, k, v, True, None, instrumented=True)
        assert_attention_close(out, lse, q, k, v, True)
    assert caught != "race" or "race" in e.value.kinds


def test_paged_kvcache_prefill_gathers_then_runs_split_d():
    # attention_kvcache at 512 with 9 query rows: the wide decode does not take it, so the pages in use are
    # gathered (csrc/kvcache.cpp) and the varlen plan runs: causal, so the split-D kernel (one sequence empty).
    seqlens, g = [30, 0, 17], torch.Generator().manual_seed(12)
    k_cache, v_cache, table, k_contig, v_contig = make_paged_cache(3, 1, D, torch.float16, 16, seqlens, g)
    q = torch.randn(3, 2, 9, D, generator=g).to(torch.float16)
    lengths = torch.tensor(seqlens, dtype=torch.int32)
    plan = flash_metal.explain(q, k_cache, v_cache, True, block_table=table, cache_seqlens=lengths)
    assert "gather path" in plan.reason and plan.dispatches[0].kernel_name.startswith(PREFIX), plan.reason
    out, lse = emulated_metal_kvcache(q, k_cache, v_cache, lengths, table, True, instrumented=True)
    _ran(torch.float16)
    check_against_oracle(out, lse, q, k_contig, v_contig, seqlens, True)
