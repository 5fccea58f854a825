"""The tensor-op prefill at head dim 256, split along D (issue 21, item 1): shaders/tensor_ops/attention_prefill_mpp_dsplit.h.

Pairs of SIMD-groups share 16 query rows, each half owning 128 features of Q
and O; their partial scores meet in threadgroup memory. Two kernels: 32 query
rows (Q staged in threadgroup memory, 32 keys per block, 2 barriers per block)
and 64 rows (8 SIMD-groups, Q in left-input cooperative tensors, 16 keys, two
slots of partials, 1 barrier per block); the routing picks by the grid
(csrc/metal/families/tensor_ops_dsplit.cpp), FLASH_METAL_TENSOR_OPS_DSPLIT_ROWS
forces one (the tests below run each kernel so). The kernels run from a
partial MSL 4 build of their own (backends.metal_mpp_dsplit_library: only the
four dsplit instantiations, seconds to build), launched from the op's plan
(csrc/metal/launch.cpp), under both cooperative-tensor lane layouts ("m5",
the published Apple10 map, and "scrambled"), with outputs NaN-poisoned before
each launch and compared with the float64 oracle by the 2x rule. Proof the
kernel ran: the plan's kernel name, the library's dispatched_names() and the
exact number of matmul2d runs and threadgroup barriers.

Planted bugs (kept below): the threadgroup barrier between the partials'
write and their sum removed (the sanitizer reports a race), each half
adding its own partial instead of the other's (NotClose); in the 64-row
kernel, one slot of partials with its one barrier per block (a race: the
double buffer is what lets it drop the second barrier).
"""
import contextlib
import math
import os
import shutil

import pytest
import torch

import backends
import flash_metal
from backends import LAST_DISPATCHES, emulated_metal_attention, emulated_metal_varlen, metal_mpp_dsplit_library
from metal_emulator import EmulatorError, compile_library
from numerics import NotClose, assert_attention_close, assert_varlen_close, dtype_id, make_qkv
from test_metal_features import make_mask, packed
from repo_paths import ROOT_DIR

LAYOUTS = ("m5", "scrambled")
NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
D, ROWS, HALVES = 256, 16, 2  # head dim, rows per pair
# rows per threadgroup -> keys per block: the 32-row kernel and the 64-row one (csrc/metal/plan_detail.h)
BK_OF = {32: 32, 64: 16}
KERNELS = tuple(BK_OF)
BQ, BK = 32, 32  # the 32-row kernel's (the routing's pick for the small grids below unless forced)
ROWS_ENV = "FLASH_METAL_TENSOR_OPS_DSPLIT_ROWS"


def kernel_name(dtype, rows=32):
    return f"flash_attention_prefill_mpp_dsplit_{NAMES[dtype]}_d{D}_bq{rows}_bk{BK_OF[rows]}_wn{HALVES}"


@contextlib.contextmanager
def forced_rows(rows):
    """Plans at D = 256 take the `rows`-row kernel (the routing's switch), whatever the grid."""
    saved = os.environ.get(ROWS_ENV)
    os.environ[ROWS_ENV] = str(rows)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ROWS_ENV)
        else:
            os.environ[ROWS_ENV] = saved


def key_blocks(Nq, Nk, q0, causal, rows=32):
    """Key blocks threadgroup `q0` runs: the threadgroup's, up to what its last real row sees (bottom-right)."""
    last = min(q0 + rows, Nq) - 1
    visible = min(max(last + (Nk - Nq) + 1, 0), Nk) if causal else Nk
    return math.ceil(visible / BK_OF[rows])


def expected(B, Hq, Nq, Nk, causal, rows=32):
    """(matmul2d runs, threadgroup barriers) of one launch: per threadgroup and key block, 2 runs (Q.K^T, P.V)
    by each of its rows / 16 x 2 SIMD-groups; 2 barriers (partials written; partials read) at 32 rows, 1 at 64
    (two slots of partials), as the emulator counts a barrier: once per threadgroup."""
    blocks = sum(key_blocks(Nq, Nk, q0, causal, rows) for q0 in range(0, Nq, rows))
    return B * Hq * blocks * 2 * rows // ROWS * HALVES, B * Hq * blocks * (2 if rows == 32 else 1)


def threadgroup_bytes(rows):
    """Per SIMD-group P (16 x BK) in the dtype and a float per row; at 32 rows its Q slice (16 x 128) too and
    one float slot of partial S (16 x BK) per SIMD-group, at 64 rows two slots (Q in registers)."""
    bk, sgs = BK_OF[rows], rows // ROWS * HALVES
    q_slices = sgs * ROWS * D // 2 * 2 if rows == 32 else 0
    slots = 1 if rows == 32 else 2
    return sgs * (ROWS * bk * 2 + ROWS * 4) + q_slices + slots * sgs * ROWS * bk * 4


def run(q, k, v, causal, layout, instrumented=False, counted=True, rows=32, **options):
    """The forced tensor_ops launch at D = 256 under `layout` on the `rows`-row kernel; checks the plan and,
    with counted, the counts (the spy: the plan's kernel, the library's dispatched names, exact counts)."""
    with forced_rows(rows):
        plan = flash_metal.explain(q, k, v, causal, None, "tensor_ops", **options)
        B, Hq, Nq, _ = q.shape
        assert plan.kernel_name == kernel_name(q.dtype, rows)
        assert plan.grid == (math.ceil(Nq / rows), Hq, B) and plan.threadgroup == (rows * 4, 1, 1)
        assert plan.threadgroup_memory == threadgroup_bytes(rows) == {32: 28928, 64: 20992}[rows]
        out, lse = emulated_metal_attention(q, k, v, causal, None, "tensor_ops", instrumented=instrumented,
                                            mpp_layout=layout, **options)
    ((d, counts),) = LAST_DISPATCHES
    assert d.kernel_name == plan.kernel_name
    assert d.kernel_name in metal_mpp_dsplit_library(instrumented).dispatched_names()
    assert counts.mpp_runs > 0
    if counted:
        assert (counts.mpp_runs, counts.threadgroup_barriers) == expected(B, Hq, Nq, k.shape[2], causal, rows)
    return out, lse


# (Nq, Nk): one row and one key; a ragged block of each; two threadgroups, the second's second row group with
# no row; more queries than keys (causal: the first rows see no key).
SHAPES = ((1, 1), (17, 33), (40, 70), (40, 20))
CASES = [(32, torch.float16, s) for s in SHAPES] + [(32, torch.bfloat16, (17, 33)), (32, torch.bfloat16, (40, 70))]
# The 64-row kernel: one row and one key; two threadgroups, Lq not a multiple of 64 (the second with one row
# group of 6 rows and three empty ones), ragged 16-key blocks, and causal, more queries than keys.
CASES += [(64, torch.float16, (1, 1)), (64, torch.float16, (70, 45)), (64, torch.bfloat16, (70, 45))]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("rows, dtype, shape", CASES, ids=lambda c: dtype_id(c) if isinstance(c, torch.dtype)
                         else f"{c[0]}x{c[1]}" if isinstance(c, tuple) else f"bq{c}")
def test_matches_float64(rows, dtype, shape, causal, layout):
    Nq, Nk = shape
    g = torch.Generator().manual_seed(hash((causal, Nq, Nk, str(dtype), rows)) % 2**31)
    q, k, v = make_qkv(1, 2, 1, Nq, Nk, D, dtype, generator=g)  # GQA 2
    out, lse = run(q, k, v, causal, layout, rows=rows)
    assert_attention_close(out, lse, q, k, v, causal)
    if causal and Nq > Nk:  # rows that see no key: zeros and lse = -inf
        blind = Nq - Nk
        assert torch.all(out[:, :, :blind] == 0) and torch.all(lse[:, :, :blind] == float("-inf"))


# (The 64-row kernel's scrambled sanitized run: test_every_option_at_once_sanitized.)
@pytest.mark.parametrize("rows, layout", [(32, "m5"), (32, "scrambled"), (64, "m5")])
def test_sanitized_ragged(rows, layout):
    # The instrumented build: device bounds exact (ragged Q, K, V blocks and the second threadgroup's empty row
    # groups read nothing past the ends), threadgroup races between SIMD-groups (the partials) and lanes (Q, P).
    nq = rows + 8
    q, k, v = make_qkv(1, 2, 1, nq, 45, D, torch.float16, generator=torch.Generator().manual_seed(40))
    out, lse = run(q, k, v, True, layout, instrumented=True, rows=rows)
    assert_attention_close(out, lse, q, k, v, True)


@pytest.mark.parametrize("rows, layout", [(32, "m5"), (32, "scrambled"), (64, "scrambled")])
def test_strided_inputs_and_batches(rows, layout):
    # Batch 2, GQA 3, q with a feature stride of 2 (each half's slice starts at feature 128, element 256 of
    # the row; staged element by element), k transposed (row stride H * D), v a slice of a larger buffer
    # (offset, wider rows), a scale of its own. (k and v need a unit feature stride: test_metal_tensor_ops.py.)
    g = torch.Generator().manual_seed(5)
    q, k, v = make_qkv(2, 3, 1, 20, 37, D, torch.bfloat16, layout=("every_other", "transposed", "offset_slice"),
                       generator=g)
    with forced_rows(rows):
        plan = flash_metal.explain(q, k, v, False, 0.3, "tensor_ops")
        assert plan.kernel_name == kernel_name(torch.bfloat16, rows)
        out, lse = emulated_metal_attention(q, k, v, False, 0.3, "tensor_ops", mpp_layout=layout)
    assert LAST_DISPATCHES[0][1].mpp_runs == expected(2, 3, 20, 37, False, rows)[0]
    assert_attention_close(out, lse, q, k, v, False, 0.3)


# ---- the options, each once (the layouts alternate) ----------------------------------------------------------

OPTION_CASES = {
    "window": (False, dict(window_left=20, window_right=5)),
    "causal-window": (True, dict(window_left=24)),
    "softcap": (True, dict(softcap=3.0)),
    "sinks": (False, dict(sinks=True)),
    "mask-bool": (True, dict(attn_mask="bool")),
    "mask-float32": (False, dict(attn_mask="float32")),
}


def _options(case, q, k, g):
    causal, opts = OPTION_CASES[case]
    opts = dict(opts)
    if "attn_mask" in opts:
        opts["attn_mask"] = make_mask(opts["attn_mask"], q.shape[:3] + k.shape[2:3], q.dtype, g)
    if opts.get("sinks"):
        opts["sinks"] = torch.randn(q.shape[1], generator=g)
    return causal, opts


# Each option once per kernel; the layouts alternate (and differ between the kernels for each option).
@pytest.mark.parametrize("rows", KERNELS, ids=lambda r: f"bq{r}")
@pytest.mark.parametrize("case, i", [(c, i) for i, c in enumerate(OPTION_CASES)])
def test_options_match_float64(case, i, rows):
    layout = LAYOUTS[(i + rows // 32) % 2]
    g = torch.Generator().manual_seed(hash((case, rows)) % 2**31)
    q, k, v = make_qkv(1, 2, 1, rows + 8, 70, D, torch.float16, generator=g)
    causal, opts = _options(case, q, k, g)
    out, lse = run(q, k, v, causal, layout, counted=False, rows=rows, **opts)
    assert_attention_close(out, lse, q, k, v, causal, **opts)


@pytest.mark.parametrize("rows", KERNELS, ids=lambda r: f"bq{r}")
def test_every_option_at_once_sanitized(rows):
    g = torch.Generator().manual_seed(9)
    nq = rows + 5
    q, k, v = make_qkv(1, 2, 1, nq, 45, D, torch.bfloat16, generator=g)
    opts = dict(attn_mask=make_mask("bool", (1, 2, nq, 45), q.dtype, g), window_left=30, softcap=4.0,
                sinks=torch.randn(2, generator=g))
    out, lse = run(q, k, v, True, "scrambled", instrumented=True, counted=False, rows=rows, **opts)
    assert_attention_close(out, lse, q, k, v, True, **opts)


@pytest.mark.parametrize("rows, layout", [(32, "m5"), (32, "scrambled"), (64, "m5")])
def test_varlen_matches_float64(rows, layout):
    # Packed sequences, empty ones included; causal with a left window; GQA 2. A threadgroup past its
    # sequence leaves whole (before any barrier).
    g = torch.Generator().manual_seed(21)
    q, k, v, cu_q, cu_k, mq, mk = packed([(40, 20), (1, 1), (0, 4), (4, 0), (70, 33)], 2, 1, D, torch.float16, g)
    with forced_rows(rows):
        out, lse = emulated_metal_varlen(q, k, v, cu_q, cu_k, mq, mk, True, None, "tensor_ops",
                                         mpp_layout=layout, window_left=12)
    ((d, counts),) = LAST_DISPATCHES
    assert d.kernel_name == kernel_name(torch.float16, rows) and d.function_constants[9] and counts.mpp_runs > 0
    assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, True, None, window_left=12)


# ---- routing ----------------------------------------------------------------------------------------------

def _qkv(dtype, dqk=D, dv=D, nq=64):
    g = torch.Generator().manual_seed(nq + dqk)
    return (torch.randn(1, 4, nq, dqk, generator=g).to(dtype), torch.randn(1, 2, 200, dqk, generator=g).to(dtype),
            torch.randn(1, 2, 200, dv, generator=g).to(dtype))


def test_forced_plan_and_reason():
    plan = flash_metal.explain(*_qkv(torch.float16), True, None, "tensor_ops")
    assert plan.kernel_name == kernel_name(torch.float16)
    assert plan.reason.startswith("forced: tensor_ops (impl='tensor_ops'); FlashAttention-2 on Metal 4 tensor ops")
    assert "split along D" in plan.reason and "28928 bytes of threadgroup memory" in plan.reason
    assert "32 rows: 4 threadgroups of 64 rows < 20" in plan.reason and "32-row kernel ahead" in plan.reason
    # A grid of 64-row threadgroups at least 2 per core: the 64-row kernel, and why.
    q = torch.zeros(1, 4, 64 * 5, D, dtype=torch.float16)
    plan = flash_metal.explain(q, q, q, True, None, "tensor_ops", "m5")
    assert plan.kernel_name == kernel_name(torch.float16, 64)
    assert plan.threadgroup == (256, 1, 1) and plan.dispatches[0].max_threads_per_threadgroup == 256
    # Per lane O 64 + Q 32 + S 8 + 8 row values + 16: the addressable 128 (csrc/metal/plan_detail.h).
    assert plan.dispatches[0].live_registers == 128
    for words in ("20992 bytes", "into registers (left-input cooperative tensors", "64 rows: 20 threadgroups of 64 "
                  "rows >= 20 (2 per core of the M5's 10)", "a model, not a measurement", "64-row kernel ahead"):
        assert words in plan.reason, (words, plan.reason)


# (gpu, dtype, D_v, Nq, rows of the kernel picked (0: none), words in the reason)
GATE = [
    ("m5+tensor_ops", torch.float16, D, 128, 32, "a model, not a measurement"),
    ("m5-max+tensor_ops", torch.bfloat16, D, 4096, 64, "ahead of the simdgroup prefill at D = 256"),
    ("m5", torch.float16, D, 128, 0, "tensor ops not used: planned without a Mac"),
    ("m4-max+tensor_ops", torch.float16, D, 128, 0, "prefill: Nq = 128"),
    ("m5+tensor_ops", torch.float32, D, 128, 0, "float32 stays on simdgroup matrices"),
    ("m5+tensor_ops", torch.float16, 128, 128, 0, "head dims 256 / 128"),
    ("m5+tensor_ops", torch.float16, D, 8, 0, "decode: Nq = 8"),
]


@pytest.mark.parametrize("gpu, dtype, dv, nq, picked, words", GATE)
def test_auto_takes_it_only_where_the_gate_and_the_model_hold(gpu, dtype, dv, nq, picked, words):
    plan = flash_metal.explain(*_qkv(dtype, dv=dv, nq=nq), True, None, "auto", gpu)
    assert (plan.kernel_name == kernel_name(dtype, picked) if picked else "_mpp_" not in plan.kernel_name), \
        plan.reason
    assert words in plan.reason, plan.reason
    if gpu.startswith("m4"):
        assert "tensor ops" not in plan.reason


# (gpu, its cores): the 64-row kernel from 2 threadgroups of 64 rows per core (kDsplitWideMinPerCore).
@pytest.mark.parametrize("gpu, cores", [("m5", 10), ("m5-max", 40)])
@pytest.mark.parametrize("impl", ["tensor_ops", "auto"])
def test_rows_rule_at_its_threshold(gpu, cores, impl):
    for tgs, rows in ((2 * cores - 1, 32), (2 * cores, 64)):
        q = torch.zeros(1, tgs, 64, D, dtype=torch.float16).expand(1, tgs, 64, D)  # Hq threadgroups of 64 rows
        k = torch.zeros(1, 1, 100, D, dtype=torch.float16).expand(1, 1, 100, D)
        plan = flash_metal.explain(q, k, k, False, None, impl, gpu + "+tensor_ops")
        assert plan.kernel_name == kernel_name(torch.float16, rows), plan.reason
        assert f"{tgs} threadgroups of 64 rows {'>=' if rows == 64 else '<'} {2 * cores}" in plan.reason


def test_the_rows_switch_forces_either_kernel_and_checks_its_value(monkeypatch):
    q = torch.zeros(1, 32, 256, D, dtype=torch.bfloat16)
    assert flash_metal.explain(q, q, q, True, None, "tensor_ops", "m5").kernel_name == kernel_name(q.dtype, 64)
    monkeypatch.setenv(ROWS_ENV, "32")
    plan = flash_metal.explain(q, q, q, True, None, "auto", "m5+tensor_ops")
    assert plan.kernel_name == kernel_name(q.dtype, 32) and f"{ROWS_ENV}=32 picks the 32-row kernel" in plan.reason
    monkeypatch.setenv(ROWS_ENV, "48")
    with pytest.raises(ValueError, match=f"{ROWS_ENV} must be 32 or 64; got '48'"):
        flash_metal.explain(q, q, q, True, None, "tensor_ops", "m5")


def test_the_switch_keeps_auto_off_it(monkeypatch):
    qkv = _qkv(torch.float16)
    assert flash_metal.explain(*qkv, True, None, "auto", "m5+tensor_ops").kernel_name == kernel_name(torch.float16)
    monkeypatch.setenv("FLASH_METAL_DISABLE_TENSOR_OPS", "1")
    plan = flash_metal.explain(*qkv, True, None, "auto", "m5+tensor_ops")
    assert "_mpp_" not in plan.kernel_name and "FLASH_METAL_DISABLE_TENSOR_OPS=1" in plan.reason


def test_an_auto_routed_plan_runs_it():
    g = torch.Generator().manual_seed(27)
    q, k, v = make_qkv(1, 2, 1, 33, 40, D, torch.bfloat16, generator=g)
    out, lse = emulated_metal_attention(q, k, v, True, None, "auto", gpu="m5+tensor_ops", mpp_layout="scrambled")
    ((d, counts),) = LAST_DISPATCHES
    assert d.kernel_name == kernel_name(torch.bfloat16) and counts.mpp_runs == expected(1, 2, 33, 40, True)[0]
    assert_attention_close(out, lse, q, k, v, True)
    # 20 query heads: 20 threadgroups of 64 rows, 2 per core of the M5's 10: Auto runs the 64-row kernel.
    q, k, v = make_qkv(1, 20, 5, 33, 20, D, torch.float16, generator=g)
    out, lse = emulated_metal_attention(q, k, v, False, None, "auto", gpu="m5+tensor_ops", mpp_layout="scrambled")
    ((d, counts),) = LAST_DISPATCHES
    assert d.kernel_name == kernel_name(torch.float16, 64)
    assert (counts.mpp_runs, counts.threadgroup_barriers) == expected(1, 20, 33, 20, False, 64)
    assert_attention_close(out, lse, q, k, v, False)


@pytest.mark.parametrize("what, dv, dtype, err, words", [
    ("float32", D, torch.float32, TypeError, ["float16 or bfloat16", "float32"]),
    ("v head dim 128", 128, torch.float16, ValueError, ["v's head dim 256", "128"]),
])
def test_forced_refuses_what_it_does_not_cover(what, dv, dtype, err, words):
    with pytest.raises(err) as info:
        flash_metal.explain(*_qkv(dtype, dv=dv), False, None, "tensor_ops")
    for w in words + ["impl='tensor_ops'"]:
        assert w in str(info.value), (w, str(info.value))


def test_the_backward_at_256_runs_the_split_d_backward():
    # The tensor-op backward at D = 256 has split-D kernels of its own (attention_backward_mpp_dsplit.h;
    # tests/metal/test_metal_tensor_ops_backward_d256.py runs them): forced, and by Auto on an M5 with the library.
    q, k, v = _qkv(torch.float16)
    lse = torch.zeros(1, 4, 64)
    for impl, gpu in (("tensor_ops", "base"), ("auto", "m5+tensor_ops")):
        plan = flash_metal.explain(q, k, v, False, None, impl, gpu, backward=True, grad_out=q, out=q, lse=lse)
        assert [d.kernel_name for d in plan.dispatches] == [
            "flash_backward_mpp_dsplit_dq_float16_d256_bq16_bk32_wn2",
            "flash_backward_mpp_dsplit_dkdv_float16_d256_bk32_bq16_wn2"], plan.reason


def test_library_holds_the_four_instantiations_apart_from_the_default_build():
    lib = metal_mpp_dsplit_library(False)
    assert sorted(lib.kernel_names()) == sorted(kernel_name(dt, rows) for dt in NAMES for rows in KERNELS)
    assert all(lib.max_threads(kernel_name(dt, rows)) == rows * 4 for dt in NAMES for rows in KERNELS)
    assert not any("dsplit" in n for n in backends.metal_mpp_library(False).kernel_names())


# ---- planted bugs ----------------------------------------------------------------------------------------

def _planted(tmp_path, monkeypatch, old, new, rows=32):
    """A copy of shaders/ with `old` (once in attention_prefill_mpp_dsplit.h) replaced by `new`, the `rows`-row
    float16 kernel alone in an instrumented partial library the emulated backend then runs."""
    root = ROOT_DIR
    shutil.copytree(os.path.join(root, "shaders"), tmp_path / "shaders")
    header = tmp_path / "shaders" / "tensor_ops" / "attention_prefill_mpp_dsplit.h"
    text = header.read_text()
    assert text.count(old) == 1
    header.write_text(text.replace(old, new))
    lib = compile_library([str(tmp_path / "shaders" / "attention_mpp.metal")], instrumented=True, msl=4,
                          only=[kernel_name(torch.float16, rows)])
    monkeypatch.setattr(backends, "metal_mpp_dsplit_library", lambda instrumented, fast_math=False: lib)
    return lib


def test_planted_missing_barrier_before_the_sum_is_a_race(tmp_path, monkeypatch):
    barrier = "    threadgroup_barrier(mem_flags::mem_threadgroup);  // both halves' partials written"
    _planted(tmp_path, monkeypatch, barrier, "    // (planted: no barrier) both halves' partials written")
    q, k, v = make_qkv(1, 1, 1, 17, 33, D, torch.float16, generator=torch.Generator().manual_seed(72))
    with pytest.raises(EmulatorError) as info:
        emulated_metal_attention(q, k, v, False, None, "tensor_ops", instrumented=True, mpp_layout="m5")
    assert "race" in info.value.kinds


def test_planted_summing_the_wrong_partial_is_not_close(tmp_path, monkeypatch):
    # Each half adds its own partial (2 S_h) instead of the other's: the kernel runs clean, the numbers fail.
    right = "s[i] + other[code]"
    lib = _planted(tmp_path, monkeypatch, right, "s[i] + mine[code]")
    q, k, v = make_qkv(1, 1, 1, 17, 33, D, torch.float16, generator=torch.Generator().manual_seed(73))
    out, lse = emulated_metal_attention(q, k, v, False, None, "tensor_ops", instrumented=True, mpp_layout="m5")
    assert LAST_DISPATCHES[0][0].kernel_name in lib.dispatched_names()
    with pytest.raises(NotClose):
        assert_attention_close(out, lse, q, k, v, False)


def test_planted_one_slot_with_one_barrier_is_a_race(tmp_path, monkeypatch):
    # The 64-row kernel drops the second barrier of each block because its partials are double-buffered: with
    # one slot, a half's next partial overwrites what the other half may still be reading (WAR).
    _planted(tmp_path, monkeypatch, "(Shape::kSlots == 2 ? (kb & 1) : 0)", "0", rows=64)
    q, k, v = make_qkv(1, 1, 1, 17, 33, D, torch.float16, generator=torch.Generator().manual_seed(74))
    with forced_rows(64), pytest.raises(EmulatorError) as info:
        emulated_metal_attention(q, k, v, False, None, "tensor_ops", instrumented=True, mpp_layout="m5")
    assert "race" in info.value.kinds

