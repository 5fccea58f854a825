"""The fused decode at head dims above 256 (issue 20 sections 2/3): Gemma's
D = 512 and absorbed MLA's (D_qk, D_v) = (576, 512).

Decode (Nq <= 8, at most 16 query rows per kv head) with dims in (256, 576]
runs the decode kernels in the decode-only buckets 512 and 576 (shaders/attention.metal, csrc/metal/plan.h
kDecodeHeadDimBuckets); prefill and backward above 256 stay on the composite
path. The model's verdict that puts the fused decode ahead is
tests/model/test_metal_model_decode_wide.py. Here: the routing and explain()
text, and results through the emulator against the float64 oracle by the 2x
rule (tests/numerics.py) in all three dtypes, one pass and split, GQA with one
KV head for 16 query heads (row chunks), causal with 2-4 query rows, the
paged kvcache op with shuffled pages, and MLA's latent view (k the whole
576-wide cache, v its first 512 features: same buffer, row stride 576).
Outputs are poisoned with NaN (tests/backends.py) and each run proves the
wide kernels did the work (the emulator's dispatched names). Contexts stay
under 300 keys (CI time).

The default emulator builds leave the 18 wide kernels out
(tests/shader_builds.py: their compile put the CI run over its 30 minutes);
the runs here go to partial libraries of their own (tests/backends.py
wide_decode_library): all 18 on the fast build, bfloat16's 6 on the
sanitizing one. Their private arrays are checked here too, on those 18 alone
(the shipped-kernels check in metal_emulator_tests/test_emu_registers.py
covers the default builds' set).
"""
import pytest
import torch

import backends
import flash_metal
from backends import SHADER, emulated_metal_attention, emulated_metal_kvcache
from metal_emulator import private_arrays
from shader_builds import WIDE_DECODE_KERNELS, is_wide_decode
from numerics import DTYPES, assert_attention_close, dtype_id, make_qkv
from test_metal_decode_paged import check_against_oracle, make_paged_cache

PAGED = 12  # fc_paged (csrc/metal/plan.h kPagedFunctionConstant)
DENSE = 10  # fc_dense (kDenseFunctionConstant)
# (D_qk, D_v) pairs: Gemma's global layers, absorbed MLA, and a ragged dim in 512's bucket.
PAIRS = ((512, 512), (576, 512))


def bucket(dqk, dv):
    """The decode-only bucket the planner picks for the wider dim."""
    return 512 if max(dqk, dv) <= 512 else 576


def _ran(bucket_, splits, instrumented=False):
    """Kernel names of the last emulated call: the wide bucket's decode kernels, split or not, run by the
    wide decode's own library (the default builds lack them)."""
    names = [d.kernel_name for d, _ in backends.LAST_DISPATCHES]
    want = (["flash_decode_split_", "flash_decode_merge_"] if splits else ["flash_decode_"])
    assert len(names) == len(want) and all(n.startswith(w) and n.endswith(f"_d{bucket_}")
                                           for n, w in zip(names, want)), names
    assert set(names) <= backends.wide_decode_library(instrumented).dispatched_names(), names
    return names


def test_default_builds_leave_the_wide_kernels_out_and_their_own_library_holds_them():
    default, wide = backends.metal_library(False), backends.wide_decode_library(False)
    assert not any(is_wide_decode(n) for n in default.kernel_names())
    assert sorted(wide.kernel_names()) == sorted(n for n in default.omitted_names() if is_wide_decode(n))
    assert len(wide.kernel_names()) == 3 * 3 * 2  # (one pass, split, merge) x dtypes x (512, 576)


def test_wide_kernels_keep_no_array_in_memory():
    # The rule test_emu_registers.py checks for the default builds' kernels: a query row and accumulator
    # loop to the compile-time bucket, fully unrolled, so no private array stays in per-thread memory.
    arrays = private_arrays([SHADER], only=WIDE_DECODE_KERNELS)
    assert sorted(arrays) == sorted(backends.wide_decode_library(False).kernel_names())
    assert not {name: a for name, a in arrays.items() if a}


def _inputs(B, Hq, Hkv, nq, nk, dqk, dv, dtype, g, latent=False):
    q = torch.randn(B, Hq, nq, dqk, generator=g).to(dtype)
    if latent:  # MLA's latent cache: k is the whole row, v its first dv features (same storage, row stride dqk)
        kv = torch.randn(B, Hkv, nk, dqk, generator=g).to(dtype)
        return q, kv, kv[..., :dv]
    return q, torch.randn(B, Hkv, nk, dqk, generator=g).to(dtype), torch.randn(B, Hkv, nk, dv, generator=g).to(dtype)


def _explain(nq, nk, dqk, dv, dtype=torch.float16, hq=16, hkv=1, impl="auto", backward=False):
    q = torch.empty(1, hq, nq, dqk, dtype=dtype)
    k = torch.empty(1, hkv, nk, dqk, dtype=dtype)
    v = torch.empty(1, hkv, nk, dv, dtype=dtype)
    return flash_metal.explain(q, k, v, False, None, impl, backward=backward)


def test_routing_decode_fused_prefill_and_backward_composite():
    for dqk, dv in ((257, 257), (512, 512), (513, 512), (576, 512), (576, 64), (300, 200)):
        want = bucket(dqk, dv)
        for nq, hq in ((1, 16), (8, 2)):  # 16 query rows per kv head: the most the wide decode takes
            plan = _explain(nq, 200, dqk, dv, hq=hq)
            assert plan.dispatches and all(d.kernel_name.endswith(f"_d{want}") for d in plan.dispatches), plan
            assert plan.dispatches[0].kernel_name.startswith("flash_decode")
            assert f"in the decode-only bucket {want}" in plan.reason and "composite path" in plan.reason
            assert "faster than the composite path" in plan.reason, plan.reason
        # A long context on the base chip splits (two dispatches: split pass and merge).
        assert [d.kernel_name.rsplit("_d", 1)[0] for d in _explain(1, 32768, dqk, dv).dispatches] == \
            ["flash_decode_split_float16", "flash_decode_merge_float16"]
        # Prefill (Nq > 8, not causal), the backward and more than 16 rows per kv head on a small grid (MLA's
        # 128 heads at B 1: the model puts the composite path ahead of the wide decode there, and of the
        # packed split-D below 32 threadgroups) stay composite; a forced prefill is refused but at the
        # split-D pairs.
        for plan in (_explain(9, 200, dqk, dv), _explain(1, 200, dqk, dv, backward=True),
                     _explain(1, 200, dqk, dv, hq=32), _explain(2, 200, dqk, dv, hq=16)):
            assert plan.dispatches == () and plan.reason.startswith("composite"), plan.reason
        assert "at most 16 query rows per kv head" in _explain(1, 200, dqk, dv, hq=128).reason
        if (dqk, dv) in ((512, 512), (576, 512)):  # the split-D forward takes them (test_metal_prefill_splitd*.py)
            assert _explain(9, 200, dqk, dv, impl="prefill").dispatches[0].kernel_name.startswith(
                "flash_attention_prefill_splitd_")
        else:
            with pytest.raises(NotImplementedError, match="decode kernels, Nq <= 8, take up to"):
                _explain(9, 200, dqk, dv, impl="prefill")
    # MLA's pair at one token: never dense (D != D_v), strided loads; Gemma's 512: dense vector loads.
    assert not _explain(1, 200, 576, 512).dispatches[0].function_constants[DENSE]
    assert _explain(1, 200, 512, 512, hq=8, hkv=4).dispatches[0].function_constants[DENSE]


def test_head_dims_above_576_are_refused_with_the_limit():
    q = torch.empty(1, 4, 1, 577)
    with pytest.raises(ValueError, match="head_dim .* must be between 1 and 576; got 577"):
        flash_metal.explain(q, q[:, :1], q[:, :1], False)
    v = torch.empty(1, 1, 1, 513)
    with pytest.raises(ValueError, match="D_v.* must be between 1 and 512; got 513"):
        flash_metal.explain(torch.empty(1, 4, 1, 576), torch.empty(1, 1, 1, 576), v, False)


# (B, Hq, Hkv, nq, nk, impl, causal): one token, 16 q heads on one KV head (2 row chunks), one pass;
# Gemma-like GQA 2:1 split; a speculative 3 causal split; 2 causal rows one pass.
CASES = ((1, 16, 1, 1, 150, "decode", False), (2, 4, 2, 1, 290, "decode_split", False),
         (1, 4, 1, 3, 260, "decode_split", True), (1, 2, 1, 2, 70, "decode", True))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}h{c[1]}-{c[2]}q{c[3]}k{c[4]}{c[5]}{'c' * c[6]}")
@pytest.mark.parametrize("dims", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_decode_matches_float64(dtype, dims, case):
    B, Hq, Hkv, nq, nk, impl, causal = case
    dqk, dv = dims
    g = torch.Generator().manual_seed(dqk + nk + nq)
    q, k, v = _inputs(B, Hq, Hkv, nq, nk, dqk, dv, dtype, g)
    out, lse = emulated_metal_attention(q, k, v, causal, None, impl)
    assert_attention_close(out, lse, q, k, v, causal)
    _ran(bucket(dqk, dv), impl == "decode_split")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_mla_latent_view(dtype):
    # k = the 576-wide latent cache, v = its first 512 features (a view, row stride 576), 16 query heads
    # on the one latent head (2 row chunks), auto routing.
    g = torch.Generator().manual_seed(7)
    q, k, v = _inputs(1, 16, 1, 1, 120, 576, 512, dtype, g, latent=True)
    assert v.data_ptr() == k.data_ptr() and v.stride(2) == 576
    out, lse = emulated_metal_attention(q, k, v)
    assert_attention_close(out, lse, q, k, v)
    _ran(576, False)


@pytest.mark.parametrize("latent", [False, True], ids=["separate", "latent"])
@pytest.mark.parametrize("dims", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
def test_paged_kvcache_op(dims, latent):
    # The kvcache op reads the shuffled pages through the table (no gather), ragged lengths (one empty),
    # causal 2 rows; under `latent`, v_cache is k_cache's first 512 features.
    dqk, dv = dims
    if latent and dqk == dv:
        pytest.skip("the latent view is MLA's pair")
    dtype, seqlens = torch.float16, [37, 0, 90]
    g = torch.Generator().manual_seed(dqk + latent)
    k_cache, v_cache, table, k_contig, v_contig = make_paged_cache(3, 1, dqk, dtype, 16, seqlens, g)
    if latent:
        v_cache, v_contig = k_cache[..., :dv], k_contig[..., :dv]
    else:  # v's own pages, on k's table: NaN but for each sequence's rows
        v_cache = torch.full((k_cache.shape[0], 16, 1, dv), float("nan"), dtype=dtype)
        v_contig = torch.full((3, 1, k_contig.shape[2], dv), float("nan"), dtype=dtype)
        for b, n in enumerate(seqlens):
            v_contig[b, :, :n] = torch.randn(1, n, dv, generator=g).to(dtype)
            for r in range(n):
                v_cache[table[b, r // 16], r % 16] = v_contig[b, :, r]
    q = torch.randn(3, 8, 2, dqk, generator=g).to(dtype)
    lengths = torch.tensor(seqlens, dtype=torch.int32)
    plan = flash_metal.explain(q, k_cache, v_cache, True, block_table=table, cache_seqlens=lengths)
    assert "decode kernels read K/V through the block table" in plan.reason, plan.reason
    out, lse = emulated_metal_kvcache(q, k_cache, v_cache, lengths, table, True)
    assert backends.LAST_DISPATCHES[0][0].function_constants[PAGED]
    _ran(bucket(dqk, dv), len(plan.dispatches) == 2)
    check_against_oracle(out, lse, q, k_contig, v_contig, seqlens, True)


@pytest.mark.parametrize("dims", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
def test_sanitized_build_on_ragged_shapes(dims):
    # The instrumented build (bounds, races, divergence) on 2 small ragged shapes: split with a last block of
    # 5 keys and 3 causal rows; one pass with GQA 3:1 and 1 key.
    dqk, dv = dims
    g = torch.Generator().manual_seed(3)
    for B, Hq, Hkv, nq, nk, impl, causal in ((1, 2, 1, 3, 69, "decode_split", True), (2, 3, 1, 1, 1, "decode", False)):
        q, k, v = _inputs(B, Hq, Hkv, nq, nk, dqk, dv, torch.bfloat16, g)
        out, lse = emulated_metal_attention(q, k, v, causal, None, impl, instrumented=True)
        assert_attention_close(out, lse, q, k, v, causal)
        _ran(bucket(dqk, dv), impl == "decode_split", instrumented=True)


def test_paged_calls_the_wide_decode_does_not_take_gather():
    # At dims above 256 the table is read only where the wide decode takes the call (csrc/metal/families/paged.cpp
    # kvcache_reads_table asks decode_takes_wide_dims); past 16 query rows per kv head with impl='auto', or
    # past 8 query rows, the pages in use are gathered (then the composite path), never handed to a kernel
    # that cannot take them; impl='decode' still reads the table at 32 rows per kv head.
    seqlens, g = [20, 9], torch.Generator().manual_seed(11)
    k_cache, v_cache, table, _, _ = make_paged_cache(2, 1, 576, torch.float16, 16, seqlens, g)
    lengths = torch.tensor(seqlens, dtype=torch.int32)
    for hq, nq, impl, reads in ((16, 1, "auto", True), (32, 1, "auto", False), (16, 2, "auto", False),
                                (2, 9, "auto", False), (32, 1, "decode", True)):
        q = torch.empty(2, hq, nq, 576, dtype=torch.float16)
        plan = flash_metal.explain(q, k_cache, v_cache[..., :512], False, None, impl, block_table=table,
                                   cache_seqlens=lengths)
        assert ("gather path" not in plan.reason) == reads, (hq, nq, impl, plan.reason)
        if reads:
            assert plan.dispatches[0].kernel_name.endswith("_d576"), plan.reason
        else:
            assert "the wide decode does not take this call" in plan.reason and plan.dispatches == (), plan.reason
