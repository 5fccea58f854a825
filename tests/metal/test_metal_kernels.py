"""The Metal path on Linux: every shader instantiation, the host's plan, the rules.

Each instantiation in shaders/ is dispatched through the sanitizing build of
the Metal emulator (races, barrier divergence, out-of-bounds, threadgroup
limits) with the launch plan the MPS host computes, on ragged shapes, and
compared with the float64 oracle. The wide shape sweep runs on the fast
build through test_attention.py's "metal-emu" backend.
"""
import glob
import os
import struct

import pytest
import torch

import flash_metal
from backends import SHADER, emulated_metal_attention, metal_library
from shader_builds import is_quant_decode, is_splitd_backward, is_wide_decode, shipped_library
from numerics import DTYPES, assert_attention_close, dtype_id, make_qkv
from repo_paths import ROOT_DIR as ROOT

IMPLS = ["untiled", "tiled"]
# One head_dim per bucket of csrc/metal/plan.h (32, 64, 128, 256), each ragged
# inside its bucket so partial vectors and tile rows are exercised.
BUCKET_DIMS = {32: 17, 64: 63, 128: 80, 256: 256}
# Ragged (Nq, Nk): not multiples of the 32-row groups or the 16-key tiles,
# plus Nk < Nq so causal masking leaves some rows with no key at all.
RAGGED = [(1, 23), (33, 17), (45, 70)]


# The fast kernels' buckets (kFastHeadDimBuckets), each with a head_dim
# ragged inside it where the bucket allows.
FAST_BUCKET_DIMS = {32: 17, 64: 63, 72: 72, 80: 77, 96: 90, 128: 100, 192: 192, 256: 256}
# Every kernel family, with the (Nq, Nk) that reaches it and its buckets.
FAMILIES = {"untiled": ((2, 2), BUCKET_DIMS), "tiled": ((2, 2), BUCKET_DIMS),
            "prefill": ((9, 9), FAST_BUCKET_DIMS), "decode": ((2, 9), FAST_BUCKET_DIMS),
            "decode_split": ((2, 600), FAST_BUCKET_DIMS)}


def _plans():
    """Every (impl, dtype, bucket) the planner serves, with its plan (one or two dispatches)."""
    plans = {}
    for impl, ((nq, nk), dims) in FAMILIES.items():
        for dtype in DTYPES:
            for bucket, d in dims.items():
                q = torch.empty(1, 1, nq, d, dtype=dtype)
                k = torch.empty(1, 1, nk, d, dtype=dtype)
                plans[(impl, dtype, bucket)] = (flash_metal.explain(q, k, k, impl=impl), d)
    # The decode-only buckets 512 and 576 (tests/metal/test_metal_decode_wide.py): a ragged Gemma-like 500 in 512,
    # MLA's (576, 512) in 576 (v a view of k's first 512 features).
    for impl, nk in (("decode", 9), ("decode_split", 600)):
        for dtype in DTYPES:
            for bucket, (dqk, dv) in {512: (500, 500), 576: (576, 512)}.items():
                q = torch.empty(1, 1, 2, dqk, dtype=dtype)
                k = torch.empty(1, 1, nk, dqk, dtype=dtype)
                plans[(impl + "_wide", dtype, bucket)] = (flash_metal.explain(q, k, k[..., :dv], impl=impl), dqk)
    # The split-D forward at (512, 512), (576, 512) and (256, 512) (shaders/prefill/attention_prefill_splitd.h;
    # impl='prefill'; tests/metal/test_metal_prefill_splitd.py and tests/metal/test_metal_prefill_splitd_mla.py run them,
    # sanitized). Keyed by D_qk.
    for dtype in DTYPES:
        for dqk in (512, 576, 256):
            q, v = torch.empty(1, 1, 9, dqk, dtype=dtype), torch.empty(1, 1, 9, 512, dtype=dtype)
            plans[("prefill_splitd", dtype, dqk)] = (flash_metal.explain(q, q, v, impl="prefill"), dqk)
    # Its packed MLA decode split along keys (fc_split_kv), then the decode's merge at D_v = 512: 16 heads on
    # one latent kv head, 600 keys (tests/metal/test_metal_prefill_splitd_splitkv.py runs it, sanitized).
    for dtype in DTYPES:
        q, k = torch.empty(1, 16, 1, 576, dtype=dtype), torch.empty(1, 1, 600, 576, dtype=dtype)
        plans[("prefill_splitd_splitkv", dtype, 576)] = (flash_metal.explain(q, k, k[..., :512], impl="prefill"), 576)
    # The split-D backward at 512 (shaders/backward/attention_backward_splitd.h; impl='prefill' at D = 512;
    # tests/metal/test_metal_backward_splitd.py runs it, sanitized, from its own partial library).
    for dtype in DTYPES:
        q = torch.empty(1, 1, 9, 512, dtype=dtype)
        plans[("backward_splitd", dtype, 512)] = (flash_metal.explain(q, q, q, impl="prefill", backward=True), 512)
    # The backward's two kernels (shaders/backward/attention_backward.h).
    for dtype in DTYPES:
        for bucket, d in FAST_BUCKET_DIMS.items():
            q = torch.empty(1, 1, 9, d, dtype=dtype)
            plans[("backward", dtype, bucket)] = (flash_metal.explain(q, q, q, backward=True), d)
    # With sinks: the backward's third kernel, flash_sinks_grad (shaders/backward/attention_sinks.h; float32 only).
    q = torch.empty(1, 1, 9, 32)
    plans[("backward_sinks", torch.float32, 32)] = (flash_metal.explain(q, q, q, backward=True,
                                                                        sinks=torch.zeros(1)), 32)
    return plans


def _plan_names():
    """Kernel names the planner can produce, by (impl, dtype, bucket) and dispatch."""
    return {key + (i,): disp.kernel_name for key, (plan, _) in _plans().items()
            for i, disp in enumerate(plan.dispatches)}


def test_every_instantiation_is_reachable_from_the_planner():
    # Each instantiation in shaders/ is produced by some plan, and every plan
    # names an existing instantiation: the sanitized tests (here and in
    # test_metal_prefill.py, test_metal_decode.py, test_metal_decode_wide.py,
    # test_metal_backward_splitd.py) then run all of them. The default build
    # leaves the wide decode's 18, the split-D backward's 6 and the quantized
    # decode's 48 out (tests/shader_builds.py) and names them: the source's
    # names count. The quantized decode's (attention_kvcache over a quantized
    # cache, tests/metal/test_metal_decode_quant.py.py) are held to the planner's
    # registry (csrc/metal/registry.cpp).
    lib = metal_library(False)
    omitted = [n for n in lib.source_kernel_names() if is_wide_decode(n) or is_splitd_backward(n) or
               is_quant_decode(n)]
    assert sorted(lib.omitted_names()) == sorted(omitted)
    # (one pass, split, merge) x dtypes x (512, 576), the split-D backward's pair x dtypes, and the quantized
    # decode's (one pass, split) x dtypes x the 8 buckets up to 256
    assert len(lib.omitted_names()) == 3 * 3 * 2 + 2 * 3 + 2 * 3 * 8
    quant = {n for n in lib.source_kernel_names() if is_quant_decode(n)}
    assert quant == {n for n in torch.ops.flash_metal.metal_registry_routes()[0] if is_quant_decode(n)}
    lib_names = set(lib.source_kernel_names()) - quant
    planned = set(_plan_names().values())
    assert planned == lib_names, f"never planned: {sorted(lib_names - planned)}; missing: {sorted(planned - lib_names)}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("bucket", list(BUCKET_DIMS), ids=[f"d{b}" for b in BUCKET_DIMS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("impl", IMPLS)
def test_instantiation_sanitized(impl, dtype, bucket, causal):
    d = BUCKET_DIMS[bucket]
    for i, (nq, nk) in enumerate(RAGGED):
        g = torch.Generator().manual_seed(1000 + i)
        q, k, v = make_qkv(1, 2, 1, nq, nk, d, dtype, layout="offset_slice", generator=g)
        out, lse = emulated_metal_attention(q, k, v, causal, None, impl, instrumented=True)
        assert_attention_close(out, lse, q, k, v, causal)
    assert flash_metal.explain(q, k, v, causal, impl=impl).kernel_name in metal_library(True).dispatched_names()


# (q, k, v) layouts whose views end exactly where their storage ends
# (numerics.LAYOUTS), one per RAGGED shape. The emulator binds a tensor from
# its first element to the end of its storage, so in the offset slices above
# a read past the view stays inside the NaN padding and inside the buffer:
# nothing reports it, and a value read but never used (a tile row past
# kv_len) changes no result. Here the element after the last row or the last
# feature lies past the buffer, and the sanitizer reports any read of it.
END_LAYOUTS = [("storage_end",) * 3, ("storage_end_bnhd",) * 3, ("storage_end_bnhd", "storage_end", "storage_end_bnhd")]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("bucket", list(BUCKET_DIMS), ids=[f"d{b}" for b in BUCKET_DIMS])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("impl", IMPLS)
def test_instantiation_sanitized_views_at_storage_end(impl, dtype, bucket, causal):
    d = BUCKET_DIMS[bucket]
    for i, ((nq, nk), layouts) in enumerate(zip(RAGGED, END_LAYOUTS)):
        g = torch.Generator().manual_seed(2000 + i)
        q, k, v = make_qkv(1, 2, 1, nq, nk, d, dtype, layout=layouts, generator=g)
        for t in (q, k, v):
            last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
            assert (last + 1) * t.element_size() == t.untyped_storage().nbytes()
        out, lse = emulated_metal_attention(q, k, v, causal, None, impl, instrumented=True)
        assert_attention_close(out, lse, q, k, v, causal)


@pytest.mark.parametrize("impl", IMPLS)
def test_sanitized_gqa_batch_and_transposed_layout(impl):
    q, k, v = make_qkv(2, 6, 2, 40, 37, 64, torch.float16, layout="transposed")
    for causal in (False, True):
        out, lse = emulated_metal_attention(q, k, v, causal, 0.2, impl, instrumented=True)
        assert_attention_close(out, lse, q, k, v, causal, 0.2)


def test_plan_reasons_and_choices():
    q, k, v = make_qkv(1, 4, 2, 100, 300, 64, torch.float16)
    assert flash_metal.explain(q, k, v, causal=True).reason.startswith("prefill:")  # test_metal_routing.py has more
    auto = flash_metal.explain(q, k, v, causal=True, impl="tiled")
    assert auto.kernel_name == "flash_attention_tiled_float16_d64_bk16_t32"
    assert auto.reason.startswith("tiled:") and "threadgroup memory" in auto.reason
    untiled = flash_metal.explain(q, k, v, impl="untiled")
    assert untiled.kernel_name == "flash_attention_untiled_float16_d64_t32"
    assert "requested by the caller" in untiled.reason
    assert auto.grid == (4, 4, 1)  # ceil(100 / 32) query blocks, 4 heads, batch 1
    assert auto.threadgroup == (32, 1, 1)
    assert auto.threadgroup_memory == 2 * 16 * 64 * 2  # K and V tiles: 16 rows of the d64 bucket, in float16
    assert auto.function_constants == (True,)
    assert untiled.threadgroup_memory == 0 and untiled.function_constants == (False,)


@pytest.mark.parametrize("impl", list(FAMILIES))
def test_threadgroup_memory_within_metal_limit_for_every_head_dim(impl):
    (nq, nk), _ = FAMILIES[impl]
    for d in range(1, 257):
        q = torch.empty(1, 1, nq, d)
        k = torch.empty(1, 1, nk, d)
        for disp in flash_metal.explain(q, k, k, impl=impl).dispatches:
            assert disp.threadgroup_memory <= 32 * 1024 and disp.threadgroup_memory % 16 == 0
            assert disp.threadgroup[0] * disp.threadgroup[1] * disp.threadgroup[2] <= 1024


def test_params_bytes_carry_strides_and_sizes():
    # The params block, decoded with the layout of shaders/common/params.h.
    q, k, v = make_qkv(2, 6, 3, 9, 11, 40, torch.bfloat16, layout="offset_slice")
    plan = flash_metal.explain(q, k, v, causal=True, scale=0.5)
    raw = plan.params.numpy().tobytes()
    assert len(raw) == 328
    fields = struct.unpack("<19q8i2f2i7q4q2i2f2i2i2i", raw)
    strides, sizes, (scale, scale_log2), splits = fields[:19], fields[19:27], fields[27:29], fields[29:31]
    assert strides[0:4] == q.stride() and strides[4:8] == k.stride() and strides[8:12] == v.stride()
    assert strides[12:16] == (6 * 9 * 40, 9 * 40, 40, 1) and strides[16:19] == (6 * 9, 9, 1)
    assert sizes == (2, 6, 3, 2, 9, 11, 40, 11 - 9)
    assert scale == 0.5 and abs(scale_log2 - 0.5 * 1.4426950408889634) < 1e-6
    assert splits == (1, 11)  # not a split-KV launch: one block of all the keys
    assert fields[-4:-2] == (0, 0)  # page_size, table_stride: not paged
    assert fields[-2:] == (40, 0)  # head_dim_v (v's head dim, here q's), reserved


def test_packaged_shader_sources_are_complete():
    # What pip installs into flash_metal/shaders/ (the MPS backend's runtime-
    # compile fallback) compiles as-is and holds the same kernels.
    pkg = os.path.join(os.path.dirname(flash_metal.__file__), "shaders")
    shipped = os.path.join(pkg, "attention.metal")
    assert os.path.exists(shipped), f"shader sources not installed in {pkg}"
    # Every shader source, in every family folder (shaders/README.md is not one and is not installed).
    repo = os.path.join(ROOT, "shaders")
    repo_files = sorted(os.path.relpath(p, repo) for p in glob.glob(os.path.join(repo, "**", "*"), recursive=True)
                        if p.endswith((".metal", ".h")))
    assert sorted(os.path.relpath(p, pkg) for p in glob.glob(os.path.join(pkg, "**", "*"), recursive=True)
                  if os.path.isfile(p)) == repo_files
    lib = shipped_library(path=shipped)
    assert set(lib.source_kernel_names()) == set(metal_library(False).source_kernel_names())
    assert set(lib.kernel_names()) == set(metal_library(False).kernel_names())
    assert os.path.abspath(SHADER) != os.path.abspath(shipped)


# The parameter each binding-table entry must land on, by name in the kernel
# templates' signatures (shaders/attention_*.h).
_SIGNATURE_NAMES = {"q": "q", "k": "k", "v": "v", "out": "o", "lse": "lse", "partial_out": "partial_o",
                    "partial_stats": "partial_stats", "grad_out": "dout", "grad_q": "dq", "grad_k": "dk",
                    "grad_v": "dv", "grad_lse": "dlse", "delta": "delta", "attn_mask": "mask",
                    "cu_seqlens_q": "cu_seqlens_q", "cu_seqlens_k": "cu_seqlens_k", "sinks": "sinks",
                    "grad_sinks": "grad_sinks", "block_table": "block_table", "cache_seqlens": "cache_seqlens"}


@pytest.mark.parametrize("impl", list(FAMILIES) + ["decode_wide", "decode_split_wide", "prefill_splitd",
                                  "prefill_splitd_splitkv", "backward", "backward_splitd", "backward_sinks"])
def test_binding_table_matches_every_kernel_signature(impl):
    # The plan's binding table is what the MPS host and the emulated backend
    # bind from; each entry must name the kernel parameter with that
    # [[buffer(n)]] (a swapped k/v slot in csrc/metal/launch.cpp fails here).
    from metal_emulator import _prepass

    lib = metal_library(False)
    for (kind, dtype, bucket), (plan, _) in _plans().items():
        if kind != impl:
            continue
        for disp in plan.dispatches:
            params = lib.signature(disp.kernel_name)
            buffers = {p.index: p.name for p in params if p.role == _prepass.ROLE_BUFFER}
            expected = {index: _SIGNATURE_NAMES[tensor] for tensor, index in disp.buffers.items()}
            expected[disp.params_index] = "p"
            assert buffers == expected, disp.kernel_name
            groups = {p.index: p.name for p in params if p.role == _prepass.ROLE_THREADGROUP}
            if disp.threadgroup_memory:
                assert groups == {disp.threadgroup_memory_index: "smem"}, disp.kernel_name
            else:
                assert groups == {}, disp.kernel_name
