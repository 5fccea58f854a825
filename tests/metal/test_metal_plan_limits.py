"""The planner never launches a kernel with more threads than it declares.

Every kernel declares [[max_total_threads_per_threadgroup(N)]] (N from
shaders/common/params.h); a Metal pipeline admits at most N threads per
threadgroup, so a plan over N would fail on a Mac. This sweeps the
planner (the code the MPS host runs) over real models' attention shapes,
every dtype, one-token and multi-token decode and prefill, forward and
backward, and checks each dispatch against the N explain() reports, which
must be the N the kernel itself declares (read from the shader source by
the emulator's registry).
"""
import functools
import itertools
import re

import pytest
import torch

import flash_metal
from backends import metal_library

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (q heads, kv heads, head_dim) from each model's published config.
MODELS = {
    "llama3-8b": (32, 8, 128),
    "llama3-70b": (64, 8, 128),
    "qwen2.5-7b": (28, 4, 128),  # GQA 7
    "mistral-7b": (32, 8, 128),
    "gemma2-9b": (16, 8, 256),
    "gemma2-2b": (8, 4, 256),
    "gpt-oss-20b": (64, 8, 64),
    "phi3-mini": (32, 32, 96),
    "phi2": (32, 32, 80),
    "mqa-d128": (32, 1, 128),  # multi-query attention at D = 128
    "falcon-7b": (71, 1, 64),  # MQA, 71 heads
    "deepseek-v3-prefill": (128, 128, 192),  # MLA unabsorbed (prefill, training): D_qk = 128 + 64 rotary
}
BATCHES = (1, 2, 8)
DECODE_ROWS = tuple(range(1, 9))  # one token, and speculative decoding's few
PREFILL_ROWS = (9, 128, 2048)
KV_LENS = (512, 4096, 32768, 131072)
# The most threads each family's plans may use: shaders/common/params.h.
FAMILY_LIMITS = {"flash_attention_untiled_": 32, "flash_attention_tiled_": 32, "flash_attention_prefill_": 256,
                 "flash_decode_merge_": 32, "flash_decode_split_": 256, "flash_decode_": 256,
                 "flash_backward_dq_": 256, "flash_backward_dkdv_": 256, "flash_backward_splitd_": 256,
                 "flash_sinks_grad": 32}


def _family_limit(name):
    return next(limit for prefix, limit in FAMILY_LIMITS.items() if name.startswith(prefix))


def _qkv(B, hq, hkv, nq, nk, d, dtype):
    # Metadata only (explain runs the planner, no kernel): stride-0 views of
    # one element stand in for tensors that would take gigabytes.
    one = torch.zeros(1, dtype=dtype)
    q = one.expand(B, hq, nq, d)
    k = one.expand(B, hkv, nk, d)
    return q, k, k


def _threads(d):
    return d.threadgroup[0] * d.threadgroup[1] * d.threadgroup[2]


def _sweep(model):
    hq, hkv, d = MODELS[model]
    for dtype, B, nq, nk in itertools.product(DTYPES, BATCHES, DECODE_ROWS + PREFILL_ROWS, KV_LENS):
        if nq > nk:
            continue
        q, k, v = _qkv(B, hq, hkv, nq, nk, d, dtype)
        for gpu in ("base", "ultra"):
            yield ("forward", dtype, B, nq, nk, gpu), flash_metal.explain(q, k, v, True, None, "auto", gpu)
        if nk <= 4096:  # the backward's threadgroups do not depend on Nk
            yield ("backward", dtype, B, nq, nk), flash_metal.explain(q, k, v, True, backward=True)


@functools.lru_cache(maxsize=None)
def _most_threads(model):
    """{kernel family: most threads of any dispatch} over the model's sweep, checking each dispatch."""
    seen = {}
    for case, plan in _sweep(model):
        for disp in plan.dispatches:
            n = disp.max_threads_per_threadgroup
            assert n == _family_limit(disp.kernel_name), (model, case, disp.kernel_name, n)
            assert disp.threadgroup[0] % 32 == 0, (model, case, disp)  # whole SIMD-groups
            assert _threads(disp) <= n, (model, case, disp.kernel_name, disp.threadgroup, n)
            family = re.sub(r"_(float32|float16|bfloat16)_.*", "", disp.kernel_name)
            seen[family] = max(seen.get(family, 0), _threads(disp))
    return seen


@pytest.mark.parametrize("model", list(MODELS))
def test_no_dispatch_exceeds_its_declared_limit(model):
    seen = _most_threads(model)
    # The sweep reaches every family of the auto route (a model with few kv
    # heads may always split its decode).
    assert {"flash_attention_prefill", "flash_decode_split", "flash_decode_merge", "flash_backward_dq",
            "flash_backward_dkdv"} <= set(seen) <= {"flash_attention_prefill", "flash_decode", "flash_decode_split",
                                                     "flash_decode_merge", "flash_backward_dq",
                                                     "flash_backward_dkdv"}, seen


def test_sweep_reaches_the_decode_limit():
    # The cap binds: some real shapes plan the decode kernels at exactly N
    # (one row group with 8 key groups, or 8 row groups sharing the keys), none above.
    most = {}
    for model in MODELS:
        for family, n in _most_threads(model).items():
            most[family] = max(most.get(family, 0), n)
    assert most["flash_decode"] == most["flash_decode_split"] == 256, most
    assert most["flash_attention_prefill"] == most["flash_backward_dq"] == most["flash_backward_dkdv"] == 256, most


def test_forced_decode_never_exceeds_the_limit():
    # impl="decode" / "decode_split" on the biggest GQA groups Nq <= 8 allows,
    # including groups no model above has (GQA 64, D 32).
    for (hq, hkv), d, nq, impl in itertools.product([(64, 1), (128, 2), (16, 1), (4, 4)], (32, 64, 80, 128, 192, 256),
                                                    DECODE_ROWS, ("decode", "decode_split")):
        q, k, v = _qkv(1, hq, hkv, nq, 1024, d, torch.float16)
        for disp in flash_metal.explain(q, k, v, False, None, impl).dispatches:
            assert _threads(disp) <= disp.max_threads_per_threadgroup, (hq, hkv, d, nq, impl, disp)


def test_declared_limits_match_the_shaders():
    # explain()'s N is the N each kernel declares in its source (the emulator
    # reads the attribute), for every instantiation the planner names.
    lib = metal_library(False)
    for name in lib.source_kernel_names():  # the wide decode's too (declarations of kernels the build left out)
        assert lib.max_threads(name) == _family_limit(name), name


# ---- decode registers (issue 19) ---------------------------------------------------------

# The decode kernels' register budget, 32-bit values per lane (kDecodeRegisterBudget,
# shaders/decode/attention_decode_rows.h).
DECODE_REGISTER_BUDGET = 72
DECODE_MODELS = ("llama3-8b", "llama3-70b", "qwen2.5-7b", "mistral-7b", "gemma2-9b", "gpt-oss-20b", "phi3-mini")


def _decode_live(bucket, rows, mask, keys_in_flight=4):
    """decode_live_registers (csrc/metal/plan_detail.h): per row q, acc and block slices plus 5 scalars (+1 with a
    mask: the block's mask term), the K/V slices of the unrolled step's keys in flight (4 up to D 256, issue 43;
    2 before it: the key's and the prefetched next one's), and 16 of addresses and counters."""
    dpl = -(-bucket // 32)
    return rows * (3 * dpl + 5 + (1 if mask else 0)) + keys_in_flight * dpl + 16


# The buckets of one row per SIMD-group (192, 256): 256's row exceeds the budget with 4 keys in flight
# (issue 43) and runs at the occupancy its registers give it (explain()'s threadgroups_per_core), within the
# 128 a thread addresses.
ADDRESSABLE_REGISTERS = 128


def _over_budget(dispatches):
    """The decode dispatches (not the merge) above the register budget (at one row per SIMD-group, D 192 and
    256: above the addressable registers) or their declared thread limit."""
    def limit(d):
        return ADDRESSABLE_REGISTERS if re.search(r"_d(192|256)$", d.kernel_name) else DECODE_REGISTER_BUDGET
    return [(d.kernel_name, d.live_registers, _threads(d)) for d in dispatches
            if d.kernel_name.startswith(("flash_decode_", "flash_decode_split_")) and not
            d.kernel_name.startswith("flash_decode_merge_") and
            (d.live_registers > limit(d) or _threads(d) > d.max_threads_per_threadgroup)]


@pytest.mark.parametrize("model", DECODE_MODELS)
def test_decode_plans_fit_the_register_budget(model):
    # Every decode plan of the model grid (every dtype, batch, Nq 1-8, Nk,
    # with and without a mask): live values per lane within the budget, as
    # the model counts them for the kernel's rows per SIMD-group, and
    # threads within the declared limit.
    hq, hkv, d = MODELS[model]
    bucket = next(b for b in GRID_DIMS if b >= d)
    rows = 4 if bucket <= 64 else 2 if bucket <= 128 else 1
    seen = set()
    for dtype, B, nq, nk in itertools.product(DTYPES, BATCHES, DECODE_ROWS, KV_LENS):
        q, k, v = _qkv(B, hq, hkv, nq, nk, d, dtype)
        for mask in (None, torch.zeros(1, dtype=torch.bool).expand(B, hq, nq, nk)):
            plan = flash_metal.explain(q, k, v, False, None, "auto", "m3-ultra", attn_mask=mask)
            assert _over_budget(plan.dispatches) == [], (model, dtype, B, nq, nk, mask is not None)
            first = plan.dispatches[0]
            assert first.live_registers == _decode_live(bucket, rows, mask is not None), (model, first.live_registers)
            seen.add(first.live_registers)
    assert len(seen) == 2  # with and without a mask
    assert max(seen) <= (DECODE_REGISTER_BUDGET if rows > 1 else ADDRESSABLE_REGISTERS)


def test_register_check_catches_the_old_rows_per_simd():
    # The rows per SIMD-group before issue 19 (8 up to D 64, 4 up to 128, 2
    # at 256) through the same model: every bucket over the budget, which
    # _over_budget reports on a dispatch carrying those figures.
    class Planted:
        kernel_name, threadgroup, max_threads_per_threadgroup = "flash_decode_float16_d64", (32, 8, 1), 256
    for bucket, old_rows in ((32, 8), (64, 8), (96, 4), (128, 4)):
        Planted.live_registers = _decode_live(bucket, old_rows, False, keys_in_flight=2)
        assert _over_budget([Planted]) == [("flash_decode_float16_d64", Planted.live_registers, 256)], bucket
    Planted.live_registers, Planted.threadgroup = 60, (32, 8, 2)  # 512 threads: over the declared limit
    assert _over_budget([Planted]) != []


# ---- prefill and backward: registers and occupancy (issue 19) ------------------------------

# Every named chip (csrc/metal/gpus.cpp; tests/metal/test_metal_routing.py pins their cores).
CHIPS = ("m1", "m1-pro", "m1-max", "m1-ultra", "m2", "m2-pro", "m2-max", "m2-ultra", "m3", "m3-pro", "m3-max",
         "m3-ultra", "m4", "m4-pro", "m4-max", "m5")
# The planners' register budget (kBackwardRegisterBudget, csrc/metal/families/family.h: live values per lane
# as explain() prints them) and the resident SIMD-groups per core issue 19 asks of every prefill and
# backward plan (kResidentTarget).
REGISTER_BUDGET = 72
RESIDENT_TARGET = 8
GRID_DIMS = (32, 64, 72, 80, 96, 128, 192, 256)  # every head-dim bucket (csrc/metal/plan.h)


def _misses(dispatches, chip):
    """Dispatches over the register budget, under the resident target, or over their declared thread limit."""
    return [(chip, d.kernel_name, d.live_registers, d.simdgroups_per_core, _threads(d)) for d in dispatches
            if d.live_registers > REGISTER_BUDGET or d.simdgroups_per_core < RESIDENT_TARGET or
            _threads(d) > d.max_threads_per_threadgroup]


@pytest.mark.parametrize("backward", [False, True], ids=["prefill", "backward"])
def test_prefill_and_backward_plans_meet_the_budget_and_occupancy_on_every_chip(backward):
    # The prefill kernel, or both backward kernels, at every (dtype, D) of
    # the model grid on every named chip, causal or not, aligned or ragged:
    # at most 72 live values per lane, at least 8 resident SIMD-groups per
    # core (the planner's estimate from registers and threadgroup memory),
    # within the declared thread limit. No exemption: float32 at 72, whose
    # own blocks hold 6, runs 80's (planted: without that, this fails there).
    misses, seen = [], set()
    for dtype, d, chip, causal, n in itertools.product(DTYPES, GRID_DIMS, CHIPS, (False, True), (1024, 1000)):
        q, k, v = _qkv(2, 8, 2, n, n, d, dtype)
        plan = flash_metal.explain(q, k, v, causal, None, "auto", chip, backward=backward)
        misses += _misses(plan.dispatches, chip)
        seen |= {re.match(r"(flash_\w+?)_b?float(16|32)_", x.kernel_name).group(1) for x in plan.dispatches}
    assert misses == []
    assert seen == ({"flash_backward_dq", "flash_backward_dkdv"} if backward else {"flash_attention_prefill"}), seen


def _old_plan(kind, bucket, elem, own, streamed, simdgroups, live):
    """A dispatch of a planted tile table with estimate_launch's residency (csrc/metal/gpus.cpp) per chip."""
    if kind == "prefill":
        tg = (own + streamed) * (bucket * elem + 16)
    else:
        rows, padded = 2 * (own + streamed), bucket * elem + 16
        tg = rows * (padded if rows * padded <= 32 * 1024 else padded - 16)
    out = []
    for chip, tg_mem in (("m1", 60 * 1024), ("m3-max", 32 * 1024)):  # Apple 7/8 and Apple 9+ per core
        by_regs = 208 * 1024 // (live * 128 * simdgroups)
        d = type("Planted", (), {"kernel_name": f"old_{kind}_{elem}_d{bucket}", "threadgroup": (32 * simdgroups, 1, 1),
                                 "max_threads_per_threadgroup": 256, "live_registers": live,
                                 "simdgroups_per_core": max(1, min(by_regs, tg_mem // tg)) * simdgroups})
        out.append((chip, d))
    return out


def test_grid_check_catches_the_old_tile_tables():
    # Planted: the tile tables before this change, through the same models
    # and the same check. Prefill (MLX's table, one 8-row group per
    # SIMD-group): D = 256 at 88 live values, float32 D >= 64 under 8
    # resident SIMD-groups on 32 KiB cores. Backward (one 8-row group per
    # SIMD-group, dK/dV split over 2 threadgroups at D = 256): float32
    # D = 256 at 1 resident SIMD-group per core, 84 live values.
    prefill = {64: (32, 32, 4), 80: (32, 32, 4), 96: (32, 32, 4), 128: (32, 16, 4), 256: (16, 8, 2)}
    backward = {  # (elem, D): (R, S, dK/dV split)
        (4, 64): (32, 16, 1), (4, 80): (32, 16, 1), (4, 96): (32, 8, 1), (4, 128): (16, 8, 1), (4, 256): (8, 8, 2),
        (2, 64): (32, 32, 1), (2, 80): (32, 32, 1), (2, 96): (32, 32, 1), (2, 128): (32, 16, 1), (2, 256): (16, 8, 2)}
    missed = {}
    for elem in (4, 2):
        for d, (bq, bk, wm) in prefill.items():
            live = d // 4 + bk // 4 + 22  # prefill_live_registers with one part
            for chip, disp in _old_plan("prefill", d, elem, bq, bk, wm, live):
                if _misses([disp], chip):
                    missed.setdefault("prefill", set()).add((elem, d))
    for (elem, d), (r, st, split) in backward.items():
        for live in (d // 4 + st // 2 + 16, d // 2 // split + st // 2 + 16):  # dQ, dK/dV
            for chip, disp in _old_plan("backward", d, elem, r, st, r // 8, live):
                if _misses([disp], chip):
                    missed.setdefault("backward", set()).add((elem, d))
    assert missed["prefill"] == {(4, 64), (4, 80), (4, 96), (4, 128), (4, 256), (2, 256)}, missed
    assert missed["backward"] == set(backward), missed  # every old entry misses on some chip
    worst = min(disp.simdgroups_per_core for _, disp in _old_plan("backward", 256, 4, 8, 8, 1, 84))
    assert worst == 1


def test_grid_check_catches_float32_d192_on_32_query_rows():
    # Planted: float32 at D = 192 with prefill's usual 32 query rows. The
    # best such block (8 keys, one part: 72 live values, 31,360 bytes; two
    # parts' scratch does not fit beside the tiles) holds one threadgroup,
    # 4 SIMD-groups, on a 32 KiB core: the grid check above would fail on
    # it, so the planner takes 16 rows on 4 parts (8 resident) instead.
    (_, m1), (_, m3) = _old_plan("prefill", 192, 4, 32, 8, 4, 192 // 4 + 8 // 4 + 22)
    assert m3.live_registers == 72 and m3.simdgroups_per_core == 4 and _misses([m3], "m3-max")
    assert m1.simdgroups_per_core == 4  # 60 KiB: one threadgroup of 31,360 bytes, too
    q, k, v = _qkv(1, 8, 8, 1024, 1024, 192, torch.float32)
    planned = flash_metal.explain(q, k, v, False, None, "auto", "m3-max")
    assert planned.kernel_name == "flash_attention_prefill_float32_d192_bq16_bk16_wm8"
    assert planned.dispatches[0].simdgroups_per_core == 8 and not _misses(planned.dispatches, "m3-max")
