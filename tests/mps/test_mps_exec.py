"""Executes the real Objective-C++ MPS host (csrc/mps/*.mm) on Linux.

tests/mps_exec/ compiles the .mm files as they are on disk with clang against
GCC's Objective-C runtime and libBlocksRuntime, links them with recording
fakes of Metal, Foundation, libdispatch and at::mps, and loads the result
into this process, where it registers the op's MPS kernel on fake MPS
tensors. Every encoder call is recorded and replayed into the Metal emulator
(the buffer at index i becomes the kernel's [[buffer(i)]], at its recorded
byte offset), and the result is compared with the float64 oracle. Each
library-loading path runs in a fresh process (tests/mps_exec/scenario.py).
See tests/mps_exec/README.md.

Needs: clang-19, libobjc-12-dev, libblocksruntime-dev (apt). Skips locally
without them; fails with CI=true. Skips on macOS, even with CI=true: the
harness stands in for Apple's frameworks, which run the host for real there.
"""
import itertools
import os
import struct
import subprocess
import zlib

import pytest
import torch

import flash_metal
from flash_metal import reference as R
import mps_exec
from numerics import (DTYPES, assert_attention_close, assert_gradients_close, assert_varlen_close,
                      assert_varlen_gradients_close, dtype_id, lay_out, make_qkv)
from mps_exec import checks
from prereqs import unavailable

ROOT = mps_exec.ROOT
# Every kernel the host can pick ("auto" goes through the routing heuristic).
IMPLS = ["untiled", "tiled", "auto"]
# The op grid's layouts (tests/api/test_attention.py), plus one tensor per layout.
LAYOUTS = ["contiguous", "transposed", "offset_slice", "mixed"]
# (q heads, kv heads): plain multi-head, and two query heads per kv head.
HEADS = {"mha": (4, 4), "gqa": (4, 2)}




def _inputs(layout, dtype, hq, hkv, seed, shape=(2, 63, 65, 80)):
    """q, k, v of one layout; "mixed": q transposed, k an offset slice, v packed."""
    B, nq, nk, d = shape
    g = torch.Generator().manual_seed(seed)
    if layout != "mixed":
        return make_qkv(B, hq, hkv, nq, nk, d, dtype, layout=layout, generator=g)
    q = make_qkv(B, hq, hkv, nq, nk, d, dtype, layout="transposed", generator=g)[0]
    k = make_qkv(B, hq, hkv, nq, nk, d, dtype, layout="offset_slice", generator=g)[1]
    v = make_qkv(B, hq, hkv, nq, nk, d, dtype, layout="contiguous", generator=g)[2]
    return q, k, v


# --- fixtures ---------------------------------------------------------------------------------


from mps_exec.fixtures import built, emu, host  # noqa: F401  (pytest fixtures, by name)

_ops = checks.recorded_ops


@pytest.fixture(scope="session")
def clang():
    return mps_exec.require_toolchain()["clang"]


def _api_check(clang, version, std, api_include):
    from mps_syntax import syntax_check

    try:
        include = syntax_check.macos_torch_include(version)
    except syntax_check.HeadersUnavailable as err:
        unavailable(f"macOS torch {version} headers unavailable: {err}")
    cmd = syntax_check.syntax_check_command(clang, os.path.join(mps_exec.HERE, "api_check.mm"), include,
                                            (f"-I{api_include}",), std=std)
    return subprocess.run(cmd, capture_output=True, text=True), cmd


def _versions():
    from mps_syntax import syntax_check

    return sorted(syntax_check.MACOS_TORCH_VERSIONS.items())


@pytest.mark.parametrize("version,std", _versions(), ids=[v for v, _ in _versions()])
def test_fake_at_mps_api_matches_macos_torch_headers(clang, version, std):
    proc, cmd = _api_check(clang, version, std, os.path.join(mps_exec.HERE, "include"))
    assert proc.returncode == 0, f"$ {' '.join(cmd)}\n{proc.stderr}"


def test_fake_at_mps_api_check_bites(clang, tmp_path):
    # queue() is const in PyTorch; a list that drops the const must fail.
    with open(os.path.join(mps_exec.HERE, "include", "mps_exec", "mps_api.h"), encoding="utf-8") as f:
        text = f.read()
    wrong = text.replace("X(MPSStream, queue, dispatch_queue_t, (), const, ())", "X(MPSStream, queue, dispatch_queue_t, (), , ())")
    assert wrong != text
    (tmp_path / "mps_exec").mkdir()
    (tmp_path / "mps_exec" / "mps_api.h").write_text(wrong, encoding="utf-8")
    version, std = _versions()[-1]
    proc, _ = _api_check(clang, version, std, str(tmp_path))
    assert proc.returncode != 0, "the API check accepted a wrong signature"
    assert "static_cast from 'dispatch_queue_t (at::mps::MPSStream::*)() const'" in proc.stderr, proc.stderr


# --- the host's results, replayed in the emulator, against the oracle -------------------------


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_matches_oracle(host, emu, layout, impl, dtype, causal, heads):
    hq, hkv = HEADS[heads]
    q, k, v = _inputs(layout, dtype, hq, hkv, seed=zlib.crc32(f"{layout}/{impl}/{heads}".encode()))
    out, lse, rec, _ = host.attention(q, k, v, causal, None, impl, emu)
    assert rec["errors"] == []
    assert_attention_close(out, lse, q, k, v, causal)
    kernels = [e["kernel"] for e in rec["events"] if e["op"] == "setComputePipelineState"]
    assert kernels == [d.kernel_name for d in flash_metal.explain(q, k, v, causal, impl=impl).dispatches]
    if impl != "auto":
        assert kernels[0].startswith(f"flash_attention_{impl}_")
    if kernels[0].startswith("flash_attention_prefill_"):  # Nq 63: GQA does not pack (fc_pack_gqa, 13, off)
        (state,) = [e for e in rec["events"] if e["op"] == "setComputePipelineState"]
        assert state["constants"]["13"] in (False, 0), state["constants"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_host_runs_the_packed_gqa_prefill(host, emu, causal):
    # A short chunk of GQA queries (Nq 12, G 2: 2 * Nq <= BQ) packs; the host sets fc_pack_gqa (13) from the plan
    # and launches the packed grid (ceil(Nq * G / BQ), Hkv, B).
    q, k, v = _inputs("contiguous", torch.float16, 4, 2, seed=12, shape=(2, 12, 65, 80))
    out, lse, rec, _ = host.attention(q, k, v, causal, None, "auto", emu)
    assert rec["errors"] == []
    assert_attention_close(out, lse, q, k, v, causal)
    (state,) = [e for e in rec["events"] if e["op"] == "setComputePipelineState"]
    assert state["kernel"].startswith("flash_attention_prefill_") and state["constants"]["13"] in (True, 1), state
    (d,) = flash_metal.explain(q, k, v, causal).dispatches
    assert d.function_constants[13] and d.grid[1:] == (2, 2), d.grid


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("impl", ["decode", "decode_split"])
def test_host_decode_one_pass_and_split(host, emu, impl, dtype, causal):
    # Decode through the real .mm: one dispatch, or the split pass and the
    # merge pass on the one encoder, sharing the float32 scratch the host
    # allocates (poisoned like every fake MPS allocation).
    q, k, v = _inputs("mixed", dtype, 8, 2, seed=zlib.crc32(f"{impl}/{dtype}".encode()), shape=(2, 3, 600, 80))
    out, lse, rec, _ = host.attention(q, k, v, causal, None, impl, emu)
    assert rec["errors"] == []
    assert_attention_close(out, lse, q, k, v, causal)
    kernels = [e["kernel"] for e in rec["events"] if e["op"] == "setComputePipelineState"]
    plan = flash_metal.explain(q, k, v, causal, impl=impl)
    assert kernels == [d.kernel_name for d in plan.dispatches]
    assert len(kernels) == (2 if impl == "decode_split" else 1)


def test_host_matches_oracle_with_scale_and_broadcast_kv(host, emu):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 4, 33, 32, generator=g)
    k = torch.randn(1, 1, 40, 32, generator=g).expand(1, 4, 40, 32)  # stride-0 heads, read in place
    v = torch.randn(1, 1, 40, 32, generator=g).expand(1, 4, 40, 32)
    for impl in ("untiled", "tiled"):
        out, lse, rec, _ = host.attention(q, k, v, True, -0.3, impl, emu)
        assert rec["errors"] == []
        assert_attention_close(out, lse, q, k, v, True, -0.3)


@pytest.mark.parametrize("grad_lse", [False, True], ids=["no_grad_lse", "grad_lse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_host_backward_matches_oracle(host, emu, dtype, grad_lse):
    # attention_backward through the real .mm (encode_plan, shared with the
    # forward): the dQ kernel then the dK/dV kernel on the one encoder, the
    # Delta scratch allocated by the host, strided grad_out and out, GQA,
    # causal with rows that see no key; replayed, against the oracle.
    causal = True
    q, k, v = _inputs("mixed", dtype, 4, 2, seed=zlib.crc32(f"bwd/{dtype}/{grad_lse}".encode()), shape=(2, 45, 38, 72))
    out, lse = torch.ops.flash_metal.attention_forward(q, k, v, causal, None, "auto")
    g = torch.Generator().manual_seed(5)
    grad_out = lay_out(torch.randn(q.shape, generator=g).to(dtype), "every_other")
    gl = torch.randn(lse.shape, generator=g) if grad_lse else None
    grads, rec = host.backward(grad_out, q, k, v, lay_out(out, "transposed"), lse, causal, None, gl, emu)
    assert rec["errors"] == []
    assert_gradients_close(grads, q, k, v, grad_out, causal, None, gl)
    kernels = [e["kernel"] for e in rec["events"] if e["op"] == "setComputePipelineState"]
    plan = flash_metal.explain(q, k, v, causal, backward=True, grad_lse=gl)
    assert kernels == [d.kernel_name for d in plan.dispatches]
    assert kernels[0].startswith("flash_backward_dq_") and kernels[1].startswith("flash_backward_dkdv_")
    ops = _ops(rec)
    # One block; the encoder fetched once per dispatch (the profiler may end it between them).
    assert ops.count("dispatch_sync") == 1 and ops.count("commandEncoder") == 2
    assert ops.count("setBuffer") == (9 + 3) + (8 + 3)  # the two binding tables, each with mask and cu_seqlens slots
    assert ops.count("dispatchThreadgroups") == 2


def test_host_binds_the_sinks(host, emu):
    # Attention sinks through the real .mm: float32 sinks bound at buffer 17
    # (as given: already float32 and contiguous, so no PyTorch op runs), the
    # forward's fc_has_sinks, and the backward's flash_sinks_grad writing
    # grad_sinks straight into the op's output; replayed, vs the oracle.
    g = torch.Generator().manual_seed(23)
    q, k, v = make_qkv(1, 4, 2, 16, 20, 64, torch.float16, generator=g)
    sinks = torch.randn(4, generator=g) + 0.5
    (out, lse), rec = host.call("attention_forward", q, k, v, True, None, "auto", library=emu, sinks=sinks)
    assert rec["errors"] == []
    assert_attention_close(out, lse, q, k, v, True, None, sinks=sinks)
    state = [e for e in rec["events"] if e["op"] == "setComputePipelineState"]
    assert [e["kernel"] for e in state] == [d.kernel_name for d in flash_metal.explain(q, k, v, True, sinks=sinks).dispatches]
    bound = {e["index"] for e in rec["events"] if e["op"] == "setBuffer"}
    assert 17 in bound
    grad_out = torch.randn(q.shape, generator=g).half()
    grad_lse = torch.randn(lse.shape, generator=g)
    grads, rec = host.call("attention_backward", grad_out, q, k, v, out, lse, True, None, grad_lse, "auto",
                           library=emu, sinks=sinks)
    assert rec["errors"] == []
    assert [e["kernel"] for e in rec["events"] if e["op"] == "setComputePipelineState"][-1] == "flash_sinks_grad"
    assert_gradients_close(grads[:3], q, k, v, grad_out, True, None, grad_lse, sinks=sinks)
    s64 = sinks.double().requires_grad_(True)
    ro, rl = R.attention_reference(q, k, v, True, None, sinks=s64)
    (ref,) = torch.autograd.grad((ro * grad_out.double()).sum() + (rl * grad_lse.double()).sum(), s64)
    torch.testing.assert_close(grads[3].double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("nq", [1, 12])
def test_host_reads_the_paged_kv_cache(host, emu, nq):
    # attention_kvcache through the real .mm, the decode route (nq 1) and the
    # paged prefill's (nq 12): the caches bound as k/v (their page stride as
    # the batch stride), block_table at 19 (a slice of a wider table: the row
    # stride the plan carries) and cache_seqlens at 20, fc_paged on; replayed,
    # vs the oracle per sequence.
    from test_kvcache_op import PAGED, check_oracle, make_case

    q, k_cache, v_cache, table, kc, vc = make_case(2, 4, 2, nq, 64, torch.float16, 16, [37, 64], 9, wide=2)
    lengths = torch.tensor([37, 64], dtype=torch.int32)
    (out, lse), rec = host.call("attention_kvcache", q, k_cache, v_cache, lengths, table, True, library=emu)
    assert rec["errors"] == []
    check_oracle(out, lse, q, kc, vc, [37, 64], True)
    plan = flash_metal.explain(q, k_cache, v_cache, True, block_table=table, cache_seqlens=lengths)
    assert plan.dispatches[0].function_constants[PAGED]
    assert plan.dispatches[0].kernel_name.startswith("flash_decode_" if nq == 1 else "flash_attention_prefill_")
    state = [e["kernel"] for e in rec["events"] if e["op"] == "setComputePipelineState"]
    assert state == [d.kernel_name for d in plan.dispatches]
    bound = {e["index"]: e for e in rec["events"] if e["op"] == "setBuffer"}
    assert 19 in bound and 20 in bound


def test_host_reads_the_paged_kv_cache_with_packed_queries(host, emu):
    # flash_attn_varlen_func's paged prefill through the real .mm:
    # attention_kvcache with cu_seqlens_q, q packed (total_q, Hq, D); out and
    # lse allocated as attention_varlen's; cu_seqlens_q bound at 15, the
    # table at 19, the lengths at 20, fc_varlen and fc_paged on; replayed, vs
    # the oracle per sequence (one of them with no query).
    from test_metal_decode_paged import make_paged_cache

    g = torch.Generator().manual_seed(41)
    q_lens, k_lens = [9, 0, 14], [37, 20, 16]
    k_cache, v_cache, table, kc, vc = make_paged_cache(3, 2, 64, torch.float16, 16, k_lens, g)
    cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    q = torch.randn(23, 4, 64, generator=g).half()
    lengths = torch.tensor(k_lens, dtype=torch.int32)
    (out, lse), rec = host.call("attention_kvcache", q, k_cache, v_cache, lengths, table, True, library=emu,
                                cu_seqlens_q=cu_q, max_seqlen_q=14)
    assert rec["errors"] == [] and out.shape == (23, 4, 64) and lse.shape == (4, 23)
    for b, (s, e) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist())):
        if e > s:
            assert_attention_close(out[s:e].transpose(0, 1)[None], lse[:, s:e][None], q[s:e].transpose(0, 1)[None],
                                   kc[b:b + 1, :, :k_lens[b]], vc[b:b + 1, :, :k_lens[b]], True)
    plan = flash_metal.explain(q, k_cache, v_cache, True, cu_seqlens_q=cu_q, max_seqlen_q=14, block_table=table,
                               cache_seqlens=lengths)
    d = plan.dispatches[0]
    assert d.kernel_name.startswith("flash_attention_prefill_") and d.function_constants[9] and d.function_constants[12]
    assert [e["kernel"] for e in rec["events"] if e["op"] == "setComputePipelineState"] == [d.kernel_name]
    bound = {e["index"] for e in rec["events"] if e["op"] == "setBuffer"}
    assert {15, 19, 20} <= bound


@pytest.mark.parametrize("impl", ["auto", "decode_split"])
def test_host_runs_a_value_head_dim_of_its_own(host, emu, impl):
    # MLA-style D_v != D_qk (issue 20 section 2) through the real .mm: out
    # allocated (B, Hq, Nq, D_v), the params block carrying head_dim_v (its
    # bytes as the plan's), the split decode's partials D_v wide; replayed, vs
    # the float64 oracle; then (auto) the backward, the fused dQ and dK/dV
    # kernels at D_v (grad_v allocated D_v wide), replayed, vs the oracle.
    g = torch.Generator().manual_seed(29)
    nq = 3 if impl == "decode_split" else 19
    q = torch.randn(1, 4, nq, 64, generator=g).half()
    k = torch.randn(1, 2, 300, 64, generator=g).half()
    v = lay_out(torch.randn(1, 2, 300, 32, generator=g).half(), "transposed")
    out, lse, rec, _ = host.attention(q, k, v, True, None, impl, emu)
    assert rec["errors"] == [] and out.shape == (1, 4, nq, 32)
    assert_attention_close(out, lse, q, k, v, True)
    plan = flash_metal.explain(q, k, v, True, impl=impl)
    assert "D_v = 32" in plan.reason
    assert [e["kernel"] for e in rec["events"] if e["op"] == "setComputePipelineState"] == \
        [d.kernel_name for d in plan.dispatches]
    params = [e["hex"] for e in rec["events"] if e["op"] == "setBytes"]
    assert params == [bytes(d.params.tolist()).hex() for d in plan.dispatches]
    assert params[0][-16:] == struct.pack("<2i", 32, 0).hex()  # head_dim_v, reserved: the block's last 8 bytes
    if impl != "auto":
        return
    grad_out = torch.randn(out.shape, generator=g).half()  # out and grad_out have D_v
    grads, rec = host.backward(grad_out, q, k, v, out, lse, True, None, None, emu)
    assert rec["errors"] == [] and [t.shape for t in grads] == [q.shape, k.shape, v.shape]
    assert_gradients_close(grads, q, k, v, grad_out, True, None, None)
    plan = flash_metal.explain(q, k, v, True, backward=True)
    kernels = [e["kernel"] for e in rec["events"] if e["op"] == "setComputePipelineState"]
    assert kernels == [d.kernel_name for d in plan.dispatches] and kernels[0].startswith("flash_backward_dq_")
    params = [e["hex"] for e in rec["events"] if e["op"] == "setBytes"]
    assert params[0][-16:] == struct.pack("<2i", 32, 0).hex()  # the backward's params carry head_dim_v too


def test_host_runs_the_split_d_forward_at_512(host, emu):
    # A causal D = 512 forward (issue 20 section 3) through the real .mm: composite_route lets it pass,
    # the planner routes it to the split-D kernel (shaders/prefill/attention_prefill_splitd.h, 9,728 bytes of
    # threadgroup memory, 256 threads), replayed, vs the float64 oracle (GQA 2:1, Nq != Nk, ragged).
    g = torch.Generator().manual_seed(31)
    q = torch.randn(1, 2, 19, 512, generator=g).half()
    k, v = (torch.randn(1, 1, 23, 512, generator=g).half() for _ in range(2))
    out, lse, rec, _ = host.attention(q, k, v, True, None, "auto", emu)
    assert rec["errors"] == []
    assert_attention_close(out, lse, q, k, v, True)
    plan = flash_metal.explain(q, k, v, True)
    kernels = [e["kernel"] for e in rec["events"] if e["op"] == "setComputePipelineState"]
    assert kernels == [d.kernel_name for d in plan.dispatches] == [
        "flash_attention_prefill_splitd_float16_d512_bq8_bk32_wm8"]
    assert [e["length"] for e in rec["events"] if e["op"] == "setThreadgroupMemoryLength"] == [9728]


def test_host_runs_the_packed_mla_decode_on_a_latent_cache(host, emu):
    # The absorbed-MLA decode (issue 20 section 2) through the real .mm: 64 query heads on one latent kv head,
    # v = k[..., :512] (one buffer, row stride 576), B 4: past the wide decode's 16 rows per kv head and at
    # the model's 32 threadgroups, so impl='auto' runs the split-D kernel packed (fc_pack_gqa), replayed.
    g = torch.Generator().manual_seed(37)
    q = torch.randn(4, 64, 1, 576, generator=g).half()
    k = torch.randn(4, 1, 40, 576, generator=g).half()
    v = k[..., :512]
    out, lse, rec, _ = host.attention(q, k, v, False, None, "auto", emu)
    assert rec["errors"] == []
    assert_attention_close(out, lse, q, k, v, False)
    (d,) = flash_metal.explain(q, k, v, False).dispatches
    kernels = [e["kernel"] for e in rec["events"] if e["op"] == "setComputePipelineState"]
    assert kernels == [d.kernel_name] == ["flash_attention_prefill_splitd_float16_dqk576_dv512_bq8_bk32_wm8"]
    assert d.grid == (8, 1, 4) and d.function_constants[13]


def test_host_runs_the_mla_decode_split_along_keys(host, emu):
    # The packed absorbed-MLA decode split along keys (fc_split_kv) through the real .mm: 16 heads on one latent
    # kv head, 600 keys, impl='prefill' (auto gives 16 heads to the wide decode): the split pass, then the
    # decode's merge at d512 on the same encoder, reading the partials the host allocated. Replayed: the split-D
    # kernel from the default build, the merge from the wide decode's sanitizing bfloat16 build (the default
    # builds leave it out).
    import backends

    class Both:  # the replay's one library: the merge from its own build
        def dispatch(self, name, **kw):
            lib = backends.wide_decode_library(True) if name.startswith("flash_decode_merge_") else emu
            return lib.dispatch(name, **kw)

    g = torch.Generator().manual_seed(41)
    q = torch.randn(1, 16, 1, 576, generator=g).to(torch.bfloat16)
    k = torch.randn(1, 1, 600, 576, generator=g).to(torch.bfloat16)
    v = k[..., :512]
    rec, tensors = host.run(q, k, v, True, None, "prefill")
    mps_exec.replay(rec, Both())
    host.complete_gpu_work()
    assert rec["errors"] == []
    assert_attention_close(host.to_cpu(tensors[3]), host.to_cpu(tensors[4]), q, k, v, True)
    pipelines = [e for e in rec["events"] if e["op"] == "setComputePipelineState"]
    assert [e["kernel"] for e in pipelines] == ["flash_attention_prefill_splitd_bfloat16_dqk576_dv512_bq8_bk32_wm8",
                                                "flash_decode_merge_bfloat16_d512"]
    constants = {int(i): c for i, c in pipelines[0]["constants"].items()}
    assert constants[13] and constants[14]  # fc_pack_gqa, fc_split_kv


def test_host_runs_the_split_d_backward_at_512(host):
    # The backward at D = 512 with impl='prefill' (issue 20 section 3: impl='auto' keeps the composite
    # path, the model's verdict) through the real .mm: the split-D pair (shaders/backward/attention_backward_splitd.h,
    # 17,664 and 18,432 bytes of threadgroup memory), replayed into its partial library (the default
    # builds leave it out: tests/shader_builds.py), vs float64 autograd (GQA 2:1, Nq != Nk, ragged).
    import backends

    g = torch.Generator().manual_seed(37)
    q = torch.randn(1, 2, 13, 512, generator=g).half()
    k, v = (torch.randn(1, 1, 17, 512, generator=g).half() for _ in range(2))
    out, lse = R.attention_reference(q, k, v, True)
    out, lse = out.half(), lse.float()
    grad_out = torch.randn(out.shape, generator=g).half()
    rec, grads, _ = host.run_backward(grad_out, q, k, v, out, lse, True, None, None, "prefill")
    mps_exec.replay(rec, backends.splitd_backward_library(True))
    host.complete_gpu_work()
    assert rec["errors"] == []
    grads = tuple(host.to_cpu(t) for t in grads)
    assert_gradients_close(grads, q, k, v, grad_out, True, None, None)
    kernels = [e["kernel"] for e in rec["events"] if e["op"] == "setComputePipelineState"]
    assert kernels == ["flash_backward_splitd_dq_float16_d512_bq8_bk32_wm8",
                       "flash_backward_splitd_dkdv_float16_d512_bq32_bk8_wm8"]
    assert [e["length"] for e in rec["events"] if e["op"] == "setThreadgroupMemoryLength"] == [17664, 18432]


def test_host_refuses_tensor_ops_where_the_process_cannot_run_them(host):
    # The tensor-op kernels (shaders/attention_mpp.metal, MSL 4) need macOS
    # 26.2 and the MSL 4 library: on the fake's macOS 15 the real .mm says so
    # before planning or encoding, instead of failing at the pipeline lookup.
    g = torch.Generator().manual_seed(29)
    q, k, v = (host.to_mps(t) for t in make_qkv(1, 4, 2, 64, 64, 64, torch.float16, generator=g))
    host.take_recording()
    with pytest.raises(NotImplementedError, match=r"impl='tensor_ops' cannot run in this process: this Mac runs a "
                                                  r"macOS older than 26\.2"):
        torch.ops.flash_metal.attention_forward(q, k, v, True, None, "tensor_ops")
    rec = host.take_recording()
    assert not [e for e in rec["events"] if e["op"] in ("setComputePipelineState", "dispatchThreadgroups:threadsPerThreadgroup:")]


def test_host_binds_the_options(host, emu):
    # attn_mask (a broadcast bool view, bound at its storage offset), the
    # window and softcap through the real .mm, forward then backward; and a
    # packed varlen batch with its cu_seqlens buffers. Replayed, vs the oracle.
    g = torch.Generator().manual_seed(17)
    q, k, v = make_qkv(2, 4, 2, 40, 51, 64, torch.float16, generator=g)
    mask = (torch.rand(2, 1, 1, 60, generator=g) > 0.3)[..., 5:56]  # an offset view, heads and rows broadcast
    opts = dict(attn_mask=mask, window_left=20, window_right=-1, softcap=12.0)
    (out, lse), rec = host.call("attention_forward", q, k, v, True, None, "auto", library=emu, **opts)
    assert rec["errors"] == []
    assert_attention_close(out, lse, q, k, v, True, None, **opts)
    bound = {e["index"]: e for e in rec["events"] if e["op"] == "setBuffer"}
    assert bound[14]["offset"] == mask.storage_offset()  # bytes = elements for bool
    grad_out = torch.randn(q.shape, generator=g).half()
    grads, rec = host.call("attention_backward", grad_out, q, k, v, out, lse, True, None, None, "auto",
                           library=emu, **opts)
    assert rec["errors"] == []
    assert_gradients_close(grads, q, k, v, grad_out, True, None, None, **opts)

    cu_q = torch.tensor([0, 7, 7, 40], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 31, 51], dtype=torch.int32)
    qv, kv, vv = q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()
    (out, lse), rec = host.call("attention_varlen_forward", qv, kv, vv, cu_q, cu_k, 33, 20, True, library=emu)
    assert rec["errors"] == []
    assert_varlen_close(out, lse, qv, kv, vv, cu_q, cu_k, True)
    go = torch.randn(qv.shape, generator=g).half()
    grads, rec = host.call("attention_varlen_backward", go, qv, kv, vv, out, lse, cu_q, cu_k, 33, 20, True,
                           library=emu)
    assert rec["errors"] == []
    assert_varlen_gradients_close(grads, qv, kv, vv, go, cu_q, cu_k, True)


# --- how the host encodes -------------------------------------------------------------------


def test_encoding_protocol(host, emu):
    q, k, v = _inputs("mixed", torch.float16, 4, 2, seed=3)
    host.run(q, k, v, True, None, "tiled")  # builds the pipeline if no earlier test did
    rec, tensors = host.run(q, k, v, True, None, "tiled")
    assert rec["errors"] == []
    ops = _ops(rec)
    # One dispatch_sync on the stream's queue; inside it, the stream's encoder
    # is taken first, the profiler brackets the encoding, nothing ends the
    # shared encoder or opens another.
    assert ops == ["dispatch_sync", "commandEncoder", "profiler.beginProfileKernel", "setComputePipelineState",
                   *["setBuffer"] * 5, "setBytes", "setThreadgroupMemoryLength", "dispatchThreadgroups",
                   "profiler.endProfileKernel", "dispatch_sync_end"]
    assert rec["events"][0]["stream_queue"]
    inside = rec["events"][1:-1]
    assert all(e["on_stream_queue"] for e in inside)
    pipeline = inside[2]
    begin, end = inside[1], inside[-1]
    assert begin["handle"] == end["handle"] == pipeline["pipeline"]
    assert begin["kernel"] == pipeline["kernel"] and begin["tensors"] == 3
    assert end["sync_type"] == 0  # SyncType::NONE: the profiler must not commit PyTorch's command buffer
    # Each tensor is bound once, as its own MTLBuffer at its storage offset in bytes.
    bound = {e["buffer"]: e for e in inside if e["op"] == "setBuffer"}
    assert len(bound) == 5 and len({e["index"] for e in bound.values()}) == 5
    for t in tensors:
        e = bound[host.buffer_id(t)]
        assert e["offset"] == t.storage_offset() * t.element_size()
    params = [e for e in inside if e["op"] == "setBytes"]
    assert len(params) == 1 and len(params[0]["hex"]) == 2 * 328  # sizeof(AttentionParams)
    assert params[0]["index"] not in {e["index"] for e in bound.values()}


def test_pipelines_are_cached(host):
    q, k, v = _inputs("contiguous", torch.bfloat16, 2, 1, seed=4, shape=(1, 9, 11, 48))
    host.run(q, k, v, False, None, "untiled")
    again, _ = host.run(q, k, v, False, None, "untiled")
    assert not {"newFunctionWithName", "newComputePipelineState", "newLibraryWithURL"} & set(_ops(again))
    causal, _ = host.run(q, k, v, True, None, "untiled")  # other function-constant values: one new pipeline
    built = [e for e in causal["events"] if e["op"] == "newComputePipelineState"]
    assert [(e["kernel"], e["constants"]) for e in built] == [("flash_attention_untiled_bfloat16_d64_t32", {"0": True})]
    assert "newLibraryWithURL" not in _ops(causal)


def test_library_comes_from_the_fresh_metallib(host):
    ops = _ops(host.first_recording)
    assert "newLibraryWithSource" not in ops
    urls = [e["path"] for e in host.first_recording["events"] if e["op"] == "newLibraryWithURL"]
    assert urls == [os.path.join(host.package, mps_exec.METALLIB_NAME)]


def test_build_all_pipelines_on_the_fake_device(host, emu):
    # csrc/mps/pipelines.mm: what the macOS CI runs with the real Metal framework.
    host.take_recording()
    origin, built = torch.ops.flash_metal.metal_build_all_pipelines()
    rec = host.take_recording()
    assert rec["errors"] == []
    assert origin == "the precompiled " + os.path.join(host.package, mps_exec.METALLIB_NAME)
    # "<kernel>/<function constants as 0/1>": every instantiation, each with
    # both causal settings when it has constants (the decode merge has none),
    # the prefill and backward kernels with both edge alignments (and the dQ
    # kernel both has_grad_lse values), and every feature kernel with each
    # option of issue 11 on its own (constants 4-9: mask, bool mask, float32
    # mask, left window, softcap, varlen; varlen on prefill and backward only),
    # and sinks (constant 11) on the forward kernels and the float32 dQ kernel
    # (issue 40); flash_sinks_grad once.
    pairs = [entry.rsplit("/", 1) for entry in built]
    assert {name for name, _ in pairs} == set(emu.source_kernel_names())  # the wide decode's too
    combos = lambda n: {"".join(c) for c in itertools.product("01", repeat=n)}  # noqa: E731
    for name in emu.source_kernel_names():
        bits = {b for n, b in pairs if n == name}
        if name.startswith(("flash_attention_untiled_", "flash_attention_tiled_")):
            assert bits == {"0", "1"}, name
            continue
        if name.startswith("flash_decode_merge_"):
            assert bits == {""}, name
            continue
        if name == "flash_sinks_grad":  # only fc_varlen is read; the registry plans it without
            assert bits == {"0" * 12}, name
            continue
        if name.startswith("flash_backward_splitd_"):  # 12 constants: causal, grad_lse (dQ), the options
            assert all(len(b) == 12 and b[1:3] + b[10:] == "0000" for b in bits), name
            assert {b[0] + b[3] for b in bits} == ({"00", "01", "10", "11"} if "_dq_" in name else {"00", "10"}), name
            assert {b[4:10] for b in bits} == {"000000", "110000", "100000", "101000", "000100", "000010",
                                               "000001"}, name
            continue
        if name.startswith("flash_attention_prefill_splitd_"):
            # 15 constants: causal, the options, sinks, fc_paged (never), fc_pack_gqa (13), packed only at
            # (576, 512) (the absorbed-MLA decode), each option either way, and fc_split_kv (14), split only
            # there and packed (its 4,096-key decode)
            assert all(len(b) == 15 and b[1:4] + b[10] + b[12] == "00000" for b in bits), name
            assert {b[0] for b in bits} == {"0", "1"}, name
            assert {b[13] for b in bits} == ({"0", "1"} if "_dqk576_" in name else {"0"}), name
            assert {b[14] for b in bits} == ({"0", "1"} if "_dqk576_" in name else {"0"}), name
            assert all(b[13] == "1" for b in bits if b[14] == "1"), name
            assert {b[4:10] + b[11] for b in bits} == {"0000000", "1100000", "1000000", "1010000", "0001000",
                                                        "0000100", "0000010", "0000001"}, name
            continue
        if name.startswith("flash_decode_quant_"):  # issue 44: 25 constants, paged, 15-24 the formats
            assert all(len(b) == 25 and b[12] == "1" and b[13:15] == "00" for b in bits), name
            assert all(b[15:18].count("1") <= 1 and b[18:21].count("1") <= 1 for b in bits), name
            q4 = set() if name.endswith(("_d72", "_d80")) else {"010010"}  # 4-bit: D a multiple of 32
            assert {b[15:21] for b in bits} == {"100100", "001001", "100000"} | q4, name
            continue
        # constant 10 is fc_dense (the dense tile loader; the decode kernels' vector loads), built both ways;
        # the decode and prefill kernels carry a 13th, fc_paged (the paged KV cache: attention_kvcache), built
        # both ways, on only alone among the options (no mask, window or sinks beside it in the registry)
        paged = name.startswith(("flash_decode_", "flash_attention_prefill_"))
        prefill = name.startswith("flash_attention_prefill_")
        # the prefill carries a 14th, fc_pack_gqa (its GQA shapes pack), built both ways: on with the
        # registry's GQA prefill shapes only (both causal settings and query alignments, no option)
        assert all(len(b) == (14 if prefill else 13 if paged else 12) for b in bits), name
        if prefill:
            packed = {b for b in bits if b[13] == "1"}
            assert {b[:2] for b in packed} == combos(2) and all(b[4:10] + b[11:13] == "0" * 8 for b in packed), name
            bits = {b[:13] for b in bits if b[13] == "0"}
        assert not paged or {b[12] for b in bits} == {"0", "1"}, name
        assert all(b[4:10] + b[11] == "0000000" for b in bits if paged and b[12] == "1"), name
        bits = {b[:12] for b in bits if not paged or b[12] == "0"}
        # (the wide decode's 576 bucket never: D_v, at most 512, is never its width)
        assert {b[10] for b in bits} == ({"0"} if name.endswith("_d576") else {"0", "1"}), name
        if name.startswith(("flash_attention_prefill_", "flash_backward_dkdv_")):
            assert {b[:3] for b in bits} == combos(3), name
        elif name.startswith("flash_backward_dq_"):
            assert {b[:4] for b in bits} == combos(4), name
        else:  # the decode kernels: causal only among 0-3
            assert {b[:4] for b in bits} == {"0000", "1000"}, name
        options = {b[4:10] + b[11] for b in bits}
        want = {"0000000", "1100000", "1000000", "1010000", "0001000", "0000100"}
        if name.startswith(("flash_attention_prefill_", "flash_backward_")):
            want.add("0000010")
        # fc_has_sinks: the forward kernels, and the float32 dQ kernel (its first pass is skipped with sinks)
        if not name.startswith("flash_backward_") or name.startswith("flash_backward_dq_float32_"):
            want.add("0000001")
        assert options == want, (name, options)
    assert all(e["found"] for e in rec["events"] if e["op"] == "newFunctionWithName")
    assert "dispatch_sync" not in _ops(rec)


def test_fingerprint_matches_library_mm(host):
    # The harness writes the metallib's fingerprint with a Python copy of
    # shader_source.h's; library.mm's own code must agree, else "fresh" lies.
    assert host.source_tree_hash(mps_exec.SHADER_DIR) == mps_exec.source_tree_hash(mps_exec.SHADER_DIR)


def test_no_objects_leak_per_call(host):
    q, k, v = _inputs("offset_slice", torch.float32, 4, 2, seed=5, shape=(1, 20, 30, 32))
    host.run(q, k, v, True, None, "tiled")  # pipelines built: later calls must create nothing lasting
    before = host.live_objects()
    for _ in range(3):
        rec, tensors = host.run(q, k, v, True, None, "tiled")
        assert rec["errors"] == []
        del tensors
    assert host.live_objects() == before


def test_threadgroup_memory_limit_is_checked_before_encoding(host):
    q, k, v = _inputs("contiguous", torch.float32, 2, 2, seed=6, shape=(1, 8, 8, 256))
    host.configure(max_threadgroup_memory=16384)
    try:
        with pytest.raises(RuntimeError, match=r"needs 32768 bytes of threadgroup memory but this GPU has 16384"):
            host.run(q, k, v, False, None, "tiled")
    finally:
        host.configure(max_threadgroup_memory=32768)
    assert "dispatch_sync" not in _ops(host.take_recording())
