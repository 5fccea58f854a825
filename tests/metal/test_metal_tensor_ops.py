"""The prefill on Metal 4 tensor ops (impl='tensor_ops', issue 21): shaders/tensor_ops/attention_prefill_mpp.h.

The kernel runs in the Metal emulator's MSL 4 library (shaders/attention_mpp.metal,
compile_library(..., msl=4)), launched from the op's own plan (csrc/metal/launch.cpp).
Every case runs under both cooperative-tensor lane layouts: "m5" (the Apple10 map
MLX and PyTorch hard-code) and "scrambled" (a seeded permutation): the kernel
learns an element's (row, key) only through get_multidimensional_index, so a
kernel that guessed the map would fail the scrambled runs. Outputs and lse are
poisoned with NaN before each launch (backends.emulated_metal_attention) and
compared with the float64 oracle by FlashAttention's 2x rule (tests/numerics.py).
Proof the MPP kernel ran: the plan's kernel name, the MPP library's
dispatched_names() and the exact count of matmul2d runs (mpp_runs).
Q is read from device memory once (each element by one load, exactly, in
every instrumented run); a planted kernel that reads it per key block is
caught by that count alone (its results are right).
The options (attn_mask bool / additive, windows, softcap, sinks, varlen)
run under both layouts too, and all together in the instrumented build.

Planted bug, checked by hand (not kept: it would need a second kernel in the
shipped header): rescaling O by the row its slot has in S's layout
(s.get_multidimensional_index(i % capacity)) instead of O's own passes under
"m5", where both destinations map slots to rows alike, and fails under
"scrambled" (test_matches_float64[*-64-full-130x257-*], f16 and bf16).
"""
import math
import os
import shutil

import pytest
import torch

import backends
import flash_metal
from backends import LAST_DISPATCHES, emulated_metal_attention, emulated_metal_varlen, metal_mpp_library
from metal_emulator import EmulatorError, compile_library
from numerics import assert_attention_close, assert_varlen_close, dtype_id, make_qkv
from test_metal_features import make_mask, packed
from repo_paths import ROOT_DIR

LAYOUTS = ("m5", "scrambled")
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 96, 128)
# (Nq, Nk): one row and one key; ragged query and key blocks; exactly one
# block of each; more queries than keys (causal: early rows see no key);
# several ragged blocks of both.
SHAPES = ((1, 1), (17, 33), (64, 64), (100, 37), (130, 257))
BQ, BK, ROWS = 64, 32, 16  # query rows per threadgroup, keys per block, rows per SIMD-group
NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def kernel_name(dtype, d):
    return f"flash_attention_prefill_mpp_{NAMES[dtype]}_d{d}_bq{BQ}_bk{BK}"


def expected_runs(B, Hq, Nq, Nk, causal):
    """matmul2d runs of one launch: 2 (Q.K^T, P.V) per key block each SIMD-group sees.

    A SIMD-group owns rows [r0, r0 + 16) with r0 < Nq; under causal masking
    (bottom-right) it sees keys up to its last real row's, the blocks
    before ceil(visible / BK).
    """
    runs = 0
    for r0 in range(0, Nq, ROWS):
        last = min(r0 + ROWS, Nq) - 1
        visible = min(max(last + (Nk - Nq) + 1, 0), Nk) if causal else Nk
        runs += 2 * math.ceil(visible / BK)
    return B * Hq * runs


def run(q, k, v, causal, layout, seed=1, instrumented=False, scale=None, runs=True, **options):
    """The forced tensor_ops launch through the emulator under `layout`; checks the plan and the counts.

    runs: check mpp_runs against expected_runs (plain or causal attention only:
    a left window skips blocks it does not count)."""
    plan = flash_metal.explain(q, k, v, causal, scale, "tensor_ops", **options)
    B, Hq, Nq, D = q.shape
    assert plan.kernel_name == kernel_name(q.dtype, D)
    assert plan.grid == (math.ceil(Nq / BQ), Hq, B) and plan.threadgroup == (128, 1, 1)
    # P (16 x 32) and Q (16 x D) in the input dtype and a float per row, for each of 4 SIMD-groups.
    assert plan.threadgroup_memory == 4 * ROWS * ((BK + D) * q.element_size() + 4)
    out, lse = emulated_metal_attention(q, k, v, causal, scale, "tensor_ops", instrumented=instrumented,
                                        mpp_layout=layout, mpp_seed=seed, **options)
    ((d, counts),) = LAST_DISPATCHES
    assert d.kernel_name in metal_mpp_library(instrumented).dispatched_names()
    assert counts.mpp_runs > 0
    if runs:
        assert counts.mpp_runs == expected_runs(B, Hq, Nq, k.shape[2], causal)
    assert counts.threadgroup_barriers == 0  # SIMD-groups are independent: no threadgroup barrier at all
    if instrumented:
        assert_q_read_once(counts, q)
    return out, lse


def assert_q_read_once(counts, q):
    """Q (buffer 0) read from device memory exactly once: each of its B x Hq x Nq x D elements by one load of
    its own width, whatever the number of key blocks (every SIMD-group stages its 16 rows in threadgroup
    memory before the key loop, attention_prefill_mpp.h); also once by the L1-window rule the model uses."""
    n, elem = q.numel(), q.element_size()
    assert counts.device_bytes_read_by_index[0] == n * elem, (counts.device_bytes_read_by_index[0], n * elem)
    assert counts.device_loads_by_index[0] == {elem: n}, counts.device_loads_by_index[0]
    assert counts.device_unique_bytes_read_by_index[0] == n * elem


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_matches_float64(dtype, d, causal, shape, layout):
    # GQA everywhere: 2 query heads per kv head. Fresh inputs per case.
    Nq, Nk = shape
    g = torch.Generator().manual_seed(hash((d, causal, Nq, Nk)) % 2**31)
    q, k, v = make_qkv(1, 2, 1, Nq, Nk, d, dtype, generator=g)
    out, lse = run(q, k, v, causal, layout)
    assert_attention_close(out, lse, q, k, v, causal)
    if causal and Nq > Nk:  # rows that see no key: zeros and lse = -inf (attention_prefill.h's convention)
        blind = Nq - Nk
        assert torch.all(out[:, :, :blind] == 0) and torch.all(lse[:, :, :blind] == float("-inf"))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(17, 33), (100, 37)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_sanitized_ragged(shape, causal, layout):
    # The instrumented build: exact device bounds (the ragged blocks read
    # nothing past K, V, Q's ends), threadgroup races between the lanes of a
    # SIMD-group (P and the row values go through threadgroup memory).
    Nq, Nk = shape
    q, k, v = make_qkv(1, 2, 1, Nq, Nk, 64, torch.float16, generator=torch.Generator().manual_seed(Nq + Nk))
    out, lse = run(q, k, v, causal, layout, instrumented=True)
    assert_attention_close(out, lse, q, k, v, causal)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_q_is_read_once_per_threadgroup(layout):
    # 5 key blocks and 2 threadgroups per head (the second ragged: one
    # SIMD-group of 6 rows, three with none), instrumented: run() asserts Q's
    # device bytes and loads exactly (assert_q_read_once); a kernel reading Q
    # per key block would read it 1 + 32 x 5 times here (test below).
    q, k, v = make_qkv(1, 2, 1, 70, 130, 64, torch.float16, generator=torch.Generator().manual_seed(70))
    out, lse = run(q, k, v, False, layout, instrumented=True)
    assert_attention_close(out, lse, q, k, v, False)
    ((_, counts),) = LAST_DISPATCHES
    # Threadgroup stores, per head: 5 SIMD-groups with rows (4 + 1), each staging its 16 x 64 Q halves once
    # (zero rows included), then per key block P (16 x 32 halves) and, only where alpha's row reduction cannot
    # serve O's layout (is_iterator_compatible false: "scrambled"), each row's alpha; 1 / l at the end. Under
    # "m5" alpha stays in registers (a_r.map_iterator): 5 x 16 floats fewer per SIMD-group.
    alpha = 0 if layout == "m5" else ROWS * 4
    assert counts.threadgroup_bytes_written == 2 * 5 * (ROWS * 64 * 2 + 5 * (ROWS * BK * 2 + alpha) + ROWS * 4)


# Planted: S = Q.K^T takes Q as a tensor over device memory again (the kernel
# before Q was staged; it still stages, so nothing else changes).
STAGED_Q = "  const MppStaticTileTensor<T, D, R> tq = mpp_static_tile<D, R>(q_tile, D);\n"
REREAD_Q = ("  const MppDeviceTensor<T> tq = mpp_device_rows<D>(q + h.q + int64_t(row0) * p.q_row_stride,\n"
            "                                                  min(R, seq.q_len - row0), p.q_row_stride, p.q_dim_stride);\n")


def _planted_library(tmp_path, monkeypatch, old, new):
    """A copy of shaders/ with `old` (once in attention_prefill_mpp.h) replaced by `new`, its float16 D = 64
    kernel alone in an instrumented partial library, which the emulated backend then runs."""
    root = ROOT_DIR
    shutil.copytree(os.path.join(root, "shaders"), tmp_path / "shaders")
    header = tmp_path / "shaders" / "tensor_ops" / "attention_prefill_mpp.h"
    text = header.read_text()
    assert text.count(old) == 1
    header.write_text(text.replace(old, new))
    lib = compile_library([str(tmp_path / "shaders" / "attention_mpp.metal")], instrumented=True, msl=4,
                          only=[kernel_name(torch.float16, 64)])
    monkeypatch.setattr(backends, "metal_mpp_library", lambda instrumented, fast_math=False: lib)
    return lib


def test_planted_q_reread_is_caught(tmp_path, monkeypatch):
    """The planted kernel's results pass the 2x rule (reading Q again is not wrong, only slow); the exact
    count catches it: the emulator's matmul2d reads a device operand's row per destination element, so Q is
    read 1 + 32 x 5 times."""
    lib = _planted_library(tmp_path, monkeypatch, STAGED_Q, REREAD_Q)
    q, k, v = make_qkv(1, 2, 1, 70, 130, 64, torch.float16, generator=torch.Generator().manual_seed(71))
    out, lse = emulated_metal_attention(q, k, v, False, None, "tensor_ops", instrumented=True, mpp_layout="m5")
    ((d, counts),) = LAST_DISPATCHES
    assert d.kernel_name in lib.dispatched_names()
    assert_attention_close(out, lse, q, k, v, False)
    with pytest.raises(AssertionError):
        assert_q_read_once(counts, q)
    assert counts.device_bytes_read_by_index[0] == (1 + 32 * 5) * q.numel() * 2


def test_planted_missing_barrier_after_staging_q_is_a_race(tmp_path, monkeypatch):
    """Without the simdgroup_barrier between the lanes' Q stores and matmul2d's reads of them, the
    instrumented build reports a threadgroup-memory race (lanes run as independent fibers)."""
    barrier = "  simdgroup_barrier(mem_flags::mem_threadgroup);  // Q written before"
    _planted_library(tmp_path, monkeypatch, barrier, "  // (planted: no barrier) Q written before")
    q, k, v = make_qkv(1, 2, 1, 17, 33, 64, torch.float16, generator=torch.Generator().manual_seed(72))
    with pytest.raises(EmulatorError) as info:
        emulated_metal_attention(q, k, v, False, None, "tensor_ops", instrumented=True, mpp_layout="m5")
    assert "race" in info.value.kinds


def test_planted_static_k_on_the_ragged_key_block_is_nan(tmp_path, monkeypatch):
    """O += P.V with a static K = 32 (the kernel before issue 40) on 33 keys: the last block's product reads V
    rows (and P columns) past the block's valid key, undefined on Apple's GPUs (NaN on M5s, llama.cpp PR
    #27450) and NaN in the emulator, so every row's output is NaN; the dynamic K (mpp_accumulate_descriptor) is right."""
    _planted_library(tmp_path, monkeypatch,
                     "  constexpr auto pv_desc = mpp_accumulate_descriptor(DV, mpp_relaxed(sizeof(T)));\n",
                     "  constexpr auto pv_desc = mpp::tensor_ops::matmul2d_descriptor(kMppRowsPerSimd, DV, BK, false, "
                     "false, true, mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate);\n")
    q, k, v = make_qkv(1, 2, 1, 17, 33, 64, torch.float16, generator=torch.Generator().manual_seed(73))
    out, _ = emulated_metal_attention(q, k, v, False, None, "tensor_ops", instrumented=True, mpp_layout="scrambled")
    assert out.isnan().all()


@pytest.mark.parametrize("seed", [2, 3])
def test_other_scrambled_layouts_and_strided_inputs(seed):
    # Other seeds are other layouts; batch 2, GQA 3, q with a feature stride
    # of 2 (staged element by element), k transposed (row stride H * D), v a
    # slice of a larger buffer (offset, wider rows and heads).
    g = torch.Generator().manual_seed(seed)
    q, k, v = make_qkv(2, 6, 2, 70, 90, 96, torch.bfloat16, layout=("every_other", "transposed", "offset_slice"),
                       generator=g)
    out, lse = run(q, k, v, True, "scrambled", seed=seed, scale=0.3)
    assert_attention_close(out, lse, q, k, v, True, 0.3)


@pytest.mark.parametrize("strided", ["k", "v"])
def test_a_strided_head_dim_of_k_or_v_is_routed_away_or_refused(strided):
    """k and v are read as Metal tensors, whose innermost stride must be 1 (Apple, MTLTensorDescriptor.strides;
    the emulator refuses any other: test_emu_mpp.py). A feature stride of 2: Auto routes to the simdgroup
    prefill, saying why; impl='tensor_ops' refuses, naming the argument. The bug this guards, seen before the
    host checked: forced launches with v's feature stride 2 (this file's strided-inputs test then) failed in
    the emulator with "a tensor's innermost stride must be 1"; without the route's test Auto would pick the
    tensor-op kernel here (the first assertion)."""
    layouts = tuple("every_other" if name == strided else "contiguous" for name in ("q", "k", "v"))
    q, k, v = make_qkv(1, 2, 1, 128, 128, 128, torch.float16, layout=layouts, generator=torch.Generator().manual_seed(9))
    plan = flash_metal.explain(q, k, v, True, None, "auto", "m5+tensor_ops")
    assert "_mpp_" not in plan.kernel_name
    assert f"tensor ops not used: {strided} strided along the head dim (feature stride 2)" in plan.reason
    with pytest.raises(ValueError, match=f"impl='tensor_ops' cannot take {strided} strided along the head dim"):
        flash_metal.explain(q, k, v, True, None, "tensor_ops", "m5+tensor_ops")
    out, lse = emulated_metal_attention(q, k, v, True, None, "auto", gpu="m5+tensor_ops")
    assert_attention_close(out, lse, q, k, v, True)
    # The backward's gate and refusal (csrc/metal/families/tensor_ops_dsplit.cpp's entry) alike.
    grads = dict(backward=True, grad_out=torch.zeros_like(q), out=torch.zeros_like(q), lse=torch.zeros(1, 2, 128))
    plan = flash_metal.explain(q, k, v, True, None, "auto", "m5+tensor_ops", **grads)
    assert all("_mpp_" not in x.kernel_name for x in plan.dispatches) and f"{strided} strided" in plan.reason
    with pytest.raises(ValueError, match=f"attention_backward: impl='tensor_ops' cannot take {strided} strided"):
        flash_metal.explain(q, k, v, True, None, "tensor_ops", "m5+tensor_ops", **grads)


def test_explain_says_forced():
    q, k, v = make_qkv(1, 2, 1, 128, 128, 128, torch.float16)
    forced = flash_metal.explain(q, k, v, True, None, "tensor_ops")
    assert forced.reason.startswith("forced: tensor_ops (impl='tensor_ops'); FlashAttention-2 on Metal 4 tensor ops")


# Auto's gate (tensor_ops_route, csrc/metal/families/tensor_ops.cpp): an Apple 10 GPU,
# macOS 26.2 and the MSL 4 library in the process ("+tensor_ops" in explain's
# gpu says so off a Mac), the switch not off, float16/bfloat16 at 64/96/128.
# (gpu, dtype, D_qk, D_v, Nq, picked, words in the reason)
GATE = [
    ("m5+tensor_ops", torch.float16, 128, 128, 128, True, "tensor ops: an Apple 10 GPU"),
    ("m5-max+tensor_ops", torch.bfloat16, 96, 96, 9, True, "tensor ops: an Apple 10 GPU"),
    ("m5-pro+tensor_ops", torch.bfloat16, 64, 64, 4096, True, "with macOS 26.2 and the MSL 4 library"),
    ("m5", torch.float16, 128, 128, 128, False, "tensor ops not used: planned without a Mac"),
    ("m4-max+tensor_ops", torch.float16, 128, 128, 128, False, "prefill: Nq = 128"),
    ("m3+tensor_ops", torch.bfloat16, 64, 64, 128, False, "prefill: Nq = 128"),
    ("m5+tensor_ops", torch.float32, 128, 128, 128, False, "float32 stays on simdgroup matrices"),
    ("m5+tensor_ops", torch.float16, 80, 80, 128, False, "head dims 80 / 80: the tensor-op kernels serve"),
    ("m5+tensor_ops", torch.float16, 128, 64, 128, False, "head dims 128 / 64"),
    ("m5+tensor_ops", torch.float16, 128, 128, 8, False, "decode: Nq = 8"),
]


@pytest.mark.parametrize("gpu, dtype, dqk, dv, nq, picked, words", GATE)
def test_auto_picks_tensor_ops_only_where_the_gate_holds(gpu, dtype, dqk, dv, nq, picked, words):
    g = torch.Generator().manual_seed(nq + dqk)
    q = torch.randn(1, 4, nq, dqk, generator=g).to(dtype)
    k = torch.randn(1, 2, 200, dqk, generator=g).to(dtype)
    v = torch.randn(1, 2, 200, dv, generator=g).to(dtype)
    plan = flash_metal.explain(q, k, v, True, None, "auto", gpu)
    assert ("_mpp_" in plan.kernel_name) == picked, (plan.kernel_name, plan.reason)
    assert words in plan.reason
    if not picked and gpu.startswith("m5"):
        assert "tensor ops not used" in plan.reason or "decode" in plan.reason
    if gpu.startswith(("m3", "m4")):  # not a candidate there: no word of it
        assert "tensor ops" not in plan.reason


def test_the_switch_keeps_auto_off_them(monkeypatch):
    q, k, v = make_qkv(1, 2, 1, 128, 128, 128, torch.float16)
    assert "_mpp_" in flash_metal.explain(q, k, v, True, None, "auto", "m5+tensor_ops").kernel_name
    monkeypatch.setenv("FLASH_METAL_DISABLE_TENSOR_OPS", "1")
    plan = flash_metal.explain(q, k, v, True, None, "auto", "m5+tensor_ops")
    assert "_mpp_" not in plan.kernel_name
    assert "tensor ops not used: FLASH_METAL_DISABLE_TENSOR_OPS=1 turns them off" in plan.reason
    # Forcing still works: the switch keeps Auto off them, nothing more.
    assert "_mpp_" in flash_metal.explain(q, k, v, True, None, "tensor_ops", "m5+tensor_ops").kernel_name


def test_an_auto_routed_plan_runs_the_tensor_op_kernel():
    # Auto on an M5 with the library: the emulated backend runs the plan it
    # gets (the MSL 4 library's kernel, both layouts), against float64.
    g = torch.Generator().manual_seed(26)
    q, k, v = make_qkv(1, 4, 2, 70, 90, 96, torch.bfloat16, generator=g)
    for layout in LAYOUTS:
        out, lse = emulated_metal_attention(q, k, v, True, None, "auto", gpu="m5+tensor_ops", mpp_layout=layout)
        ((d, counts),) = LAST_DISPATCHES
        assert d.kernel_name == kernel_name(torch.bfloat16, 96) and counts.mpp_runs > 0
        assert_attention_close(out, lse, q, k, v, True)


def test_library_holds_exactly_the_instantiations_and_their_thread_limit():
    lib = metal_mpp_library(False)
    names = {kernel_name(dt, d) for dt in DTYPES for d in HEAD_DIMS}
    # and the backward's two per (dtype, D) (tests/metal/test_metal_tensor_ops_backward.py)
    backward = {n for n in lib.kernel_names() if n.startswith("flash_backward_mpp_")}
    assert len(backward) == 2 * len(DTYPES) * len(HEAD_DIMS)
    assert set(lib.kernel_names()) == names | backward
    for name in names:
        assert lib.max_threads(name) == 128


def test_msl31_library_holds_none_of_them():
    from backends import metal_library

    assert not any("mpp" in n for n in metal_library(False).kernel_names())


@pytest.mark.parametrize("what, kwargs, err, words", [
    ("float32", dict(dtype=torch.float32), TypeError, ["float16 or bfloat16", "float32"]),
    ("head_dim 80", dict(d=80), ValueError, ["head_dim 64, 96, 128 or 256", "80"]),
    # (256 runs on the split-D kernel: tests/metal/test_metal_tensor_ops_d256.py)
    ("head_dim 192", dict(d=192), ValueError, ["head_dim 64, 96, 128 or 256", "192"]),
])
def test_refuses_what_it_does_not_cover_naming_the_argument(what, kwargs, err, words):
    dtype, d = kwargs.get("dtype", torch.float16), kwargs.get("d", 64)
    q, k, v = make_qkv(1, 2, 1, 64, 64, d, dtype)
    with pytest.raises(err) as info:
        flash_metal.explain(q, k, v, False, None, "tensor_ops", **kwargs.get("options", {}))
    for w in words + ["impl='tensor_ops'"]:
        assert w in str(info.value), (w, str(info.value))


def test_backward_takes_it():
    # The tensor-op backward's two kernels (tests/metal/test_metal_tensor_ops_backward.py runs them).
    q, k, v = make_qkv(1, 2, 1, 64, 64, 64, torch.float16)
    plan = flash_metal.explain(q, k, v, False, None, "tensor_ops", backward=True, grad_out=q, out=q,
                               lse=torch.zeros(1, 2, 64))
    assert [d.kernel_name for d in plan.dispatches] == ["flash_backward_mpp_dq_float16_d64_bq64_bk32",
                                                        "flash_backward_mpp_dkdv_float16_d64_bk64_bq32"]


# ---- the options (attention_features.h's helpers, as the simdgroup prefill) -----------------

OPTION_CASES = {
    "window": (False, dict(window_left=20, window_right=5)),
    "causal-window": (True, dict(window_left=40)),
    "softcap": (True, dict(softcap=3.0)),
    "sinks": (False, dict(sinks=True)),
    "mask-bool": (True, dict(attn_mask="bool")),
    "mask-input": (False, dict(attn_mask="input")),
    "mask-float32": (False, dict(attn_mask="float32")),
    "everything": (True, dict(attn_mask="bool", window_left=30, softcap=4.0, sinks=True)),
}


def _options(case, q, k, g):
    causal, opts = OPTION_CASES[case]
    opts = dict(opts)
    if "attn_mask" in opts:  # per (batch, query head): (B, Hq, Nq, Nk)
        opts["attn_mask"] = make_mask(opts["attn_mask"], q.shape[:3] + k.shape[2:3], q.dtype, g)
    if opts.get("sinks"):
        opts["sinks"] = torch.randn(q.shape[1], generator=g)
    return causal, opts


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(OPTION_CASES))
@pytest.mark.parametrize("dtype, d, shape", [(torch.float16, 64, (100, 130)), (torch.bfloat16, 128, (130, 257))],
                         ids=["float16-64-100x130", "bfloat16-128-130x257"])
def test_options_match_float64(dtype, d, shape, case, layout):
    g = torch.Generator().manual_seed(hash((case, d)) % 2**31)
    q, k, v = make_qkv(1, 4, 2, shape[0], shape[1], d, dtype, generator=g)
    causal, opts = _options(case, q, k, g)
    out, lse = run(q, k, v, causal, layout, runs=False, **opts)
    assert_attention_close(out, lse, q, k, v, causal, **opts)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_options_sanitized(layout):
    # Every option at once in the instrumented build: the mask read only
    # inside the sequence, no race on P or the row values.
    g = torch.Generator().manual_seed(7)
    q, k, v = make_qkv(1, 2, 1, 37, 45, 64, torch.float16, generator=g)
    causal, opts = _options("everything", q, k, g)
    out, lse = run(q, k, v, causal, layout, instrumented=True, runs=False, **opts)
    assert_attention_close(out, lse, q, k, v, causal, **opts)


VARLEN_LENGTHS = [(40, 100), (100, 40), (1, 1), (0, 4), (4, 0), (64, 64), (17, 33)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(causal=True, window_left=20, softcap=4.0),
                                  dict(window_left=3, window_right=5)], ids=["full", "causal", "causal-win-cap",
                                                                             "window"])
def test_varlen_matches_float64(opts, layout):
    # Packed sequences, empty ones included (no rows; rows without keys:
    # zeros and lse = -inf), GQA 2.
    opts = dict(opts)
    causal = opts.pop("causal", False)
    g = torch.Generator().manual_seed(len(opts) + causal)
    q, k, v, cu_q, cu_k, mq, mk = packed(VARLEN_LENGTHS, 4, 2, 96, torch.float16, g)
    out, lse = emulated_metal_varlen(q, k, v, cu_q, cu_k, mq, mk, causal, None, "tensor_ops", mpp_layout=layout,
                                     **opts)
    ((d, counts),) = LAST_DISPATCHES
    assert d.kernel_name == kernel_name(torch.float16, 96) and d.function_constants[9] and counts.mpp_runs > 0
    assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, causal, None, **opts)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fast_math_build(layout):
    # Apple compiles with fast math by default: no infinity is computed
    # with (kMaskedScore, attention_common.h); rows that see no key still
    # give zeros and lse = -inf (made from bits), and a -inf additive mask
    # entry is dropped like a False.
    g = torch.Generator().manual_seed(11)
    q, k, v = make_qkv(1, 2, 1, 100, 37, 64, torch.float16, generator=g)
    mask = make_mask("float32", (1, 2, 100, 37), torch.float16, g)
    out, lse = emulated_metal_attention(q, k, v, True, None, "tensor_ops", fast_math=True, mpp_layout=layout,
                                        attn_mask=mask)
    assert LAST_DISPATCHES[0][1].mpp_runs > 0
    assert_attention_close(out, lse, q, k, v, True, attn_mask=mask)
    assert torch.all(lse[:, :, :63] == float("-inf")) and torch.all(out[:, :, :63] == 0)
