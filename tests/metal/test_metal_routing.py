"""The routing function (choose_metal_kernel walking the table of csrc/metal/families/table.cpp), through flash_metal.explain.

Planner only, no kernel runs: which family each problem gets, with which
blocks, bucket, split count and scratch, and why. The kernels themselves run
in test_metal_kernels.py, test_metal_prefill.py and test_metal_decode.py.
"""
import itertools
import struct

import pytest
import torch

import flash_metal
from numerics import DTYPES, dtype_id

FAST_BUCKETS = (32, 64, 72, 80, 96, 128, 192, 256)
# (block_q, block_k, simdgroups) per prefill bucket, float16/bfloat16: MLX's steel table, with
# 16 query rows at 256 on 2 SIMD-groups per 8-row group (see choose_metal_kernel's why-comments).
PREFILL_BLOCKS = {32: (32, 32, 4), 64: (32, 32, 4), 72: (32, 32, 4), 80: (32, 32, 4), 96: (32, 32, 4),
                  128: (32, 16, 4), 192: (32, 8, 4), 256: (16, 8, 4)}
# float32 (issue 19: within 72 live values and 8 resident SIMD-groups per core; at D = 128 and 256 each
# 8-row group runs 2 and 4 SIMD-groups, feature parts of O; at 192, 16 query rows on 4 each: 32 rows hold 4).
FLOAT_PREFILL_BLOCKS = {32: (32, 32, 4), 64: (32, 16, 4), 72: (32, 16, 4), 80: (32, 16, 4), 96: (32, 8, 4),
                        128: (32, 16, 8), 192: (16, 16, 8), 256: (16, 8, 8)}
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _qkv(nq, nk, d, dtype=torch.float16, hq=4, hkv=2, b=1):
    q = torch.empty(b, hq, nq, d, dtype=dtype)
    k = torch.empty(b, hkv, nk, d, dtype=dtype)
    return q, k, k


def _params(dispatch):
    fields = struct.unpack("<19q8i2f2i7q4q2i2f2i2i2i", dispatch.params.numpy().tobytes())
    return {"kv_len": fields[24], "kv_splits": fields[29], "split_keys": fields[30]}


@pytest.mark.parametrize("nq,family", [(1, "decode"), (8, "decode"), (9, "prefill"), (300, "prefill")])
def test_auto_picks_decode_up_to_eight_rows_and_prefill_above(nq, family):
    plan = flash_metal.explain(*_qkv(nq, 100, 64))
    assert plan.reason.startswith(family + ":"), plan.reason
    assert plan.dispatches[0].kernel_name.startswith("flash_decode_" if family == "decode" else "flash_attention_prefill_")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_prefill_blocks_memory_and_bucket_for_every_head_dim(dtype):
    size = 4 if dtype == torch.float32 else 2
    for d in range(1, 257):
        bucket = next(b for b in FAST_BUCKETS if b >= d)
        bq, bk, wm = (FLOAT_PREFILL_BLOCKS if dtype == torch.float32 else PREFILL_BLOCKS)[bucket]
        plan = flash_metal.explain(*_qkv(70, 45, d, dtype), impl="prefill")
        assert plan.kernel_name == f"flash_attention_prefill_{DTYPE_NAMES[dtype]}_d{bucket}_bq{bq}_bk{bk}_wm{wm}"
        # GQA 4 / 2 at Nq 70 does not pack (fc_pack_gqa only when 2 * Nq <= BQ)
        assert plan.grid == (-(-70 // bq), 4, 1) and plan.threadgroup == (32 * wm, 1, 1)
        # Q tile plus one K/V tile, rows padded by 16 bytes (attention_prefill.h), plus with feature parts
        # (wm * 8 / bq > 1) each SIMD-group's partial S (bk / 8 fragments of 256 bytes, the split-K sum).
        partials = wm * (bk // 8) * 256 if wm * 8 // bq > 1 else 0
        assert plan.threadgroup_memory == (bq + bk) * (bucket * size + 16) + partials
        assert plan.threadgroup_memory <= 32 * 1024 and plan.threadgroup_memory % 16 == 0
        assert ("zero-padded" in plan.reason) == (d != bucket), (d, plan.reason)
        assert "8 resident simdgroups per core on every named chip" in plan.reason


@pytest.mark.parametrize("nq,nk,aligned", [(64, 64, (True, True)), (65, 64, (False, True)), (64, 70, (True, False)),
                                            (33, 17, (False, False))])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_edge_constants(nq, nk, aligned, causal):
    plan = flash_metal.explain(*_qkv(nq, nk, 64), causal=causal)
    # no grad_lse, no option; fc_dense (index 10): packed inputs, D == its bucket; fc_paged (12) off;
    # fc_pack_gqa (13) off: GQA 4 / 2, but Nq fills more than half a block (tests/metal/test_metal_prefill_pack_gqa.py)
    assert plan.function_constants == (causal, *aligned) + (False,) * 7 + (True, False, False, False)


def test_decode_one_pass_for_short_contexts_and_split_for_long():
    short = flash_metal.explain(*_qkv(1, 200, 128))  # fewer than 2 blocks of >= 128 keys
    assert [d.kernel_name for d in short.dispatches] == ["flash_decode_float16_d128"]
    assert "one pass" in short.reason and short.scratch == {"partial_out": 0, "partial_stats": 0}
    assert _params(short.dispatches[0])["kv_splits"] == 1
    long = flash_metal.explain(*_qkv(1, 8192, 128))
    assert [d.kernel_name for d in long.dispatches] == ["flash_decode_split_float16_d128", "flash_decode_merge_float16_d128"]
    assert "split-KV" in long.reason
    with pytest.raises(ValueError, match="2 dispatches"):
        long.kernel_name  # noqa: B018  (the single-dispatch view refuses a two-dispatch plan)


def _planned_blocks(dispatch, nk, cores):
    """The split count decode_splits plans (issue 43): the most blocks whose threadgroups (the grid's x * y per
    block) fit one wave of the chip's resident threadgroups (explain()'s threadgroups_per_core), within
    max(1, Nk // 128) and 256; blocks of whole quanta of key groups (threadgroup y) x 32 keys, the fewest of
    the smallest such size."""
    per_block = dispatch.grid[0] * dispatch.grid[1]
    cap = max(1, min(cores * dispatch.threadgroups_per_core // per_block, max(1, nk // 128), 256))
    quantum = 32 * dispatch.threadgroup[1]
    per = -(-(-(-nk // cap)) // quantum) * quantum
    return -(-nk // per), per


@pytest.mark.parametrize("b,hkv,nk", [(1, 1, 100_000), (1, 8, 8192), (4, 8, 32768), (1, 2, 700), (2, 1, 257)])
@pytest.mark.parametrize("gpu", ["base", "max", "ultra"])
def test_split_count_and_blocks(b, hkv, nk, gpu):
    q, k, v = _qkv(2, nk, 64, hq=hkv * 4, hkv=hkv, b=b)
    plan = flash_metal.explain(q, k, v, gpu=gpu)
    p = _params(plan.dispatches[0])
    splits, per = p["kv_splits"], p["split_keys"]
    cores = {"base": 10, "max": 40, "ultra": 80}[gpu]
    # Blocks: the most one wave of resident threadgroups holds (csrc/metal/families/decode.cpp's decode_splits), at most
    # 256, each >= 128 keys, in whole quanta of key groups x 32 keys.
    want, want_per = _planned_blocks(plan.dispatches[0], nk, cores)
    assert splits == want
    per_block = plan.dispatches[0].grid[0] * plan.dispatches[0].grid[1]
    slots = cores * plan.dispatches[0].threadgroups_per_core
    assert per_block * splits <= slots or (splits == 1 and per_block > slots and "more than one wave" in plan.reason)
    if splits > 1:
        assert per == want_per and per % (32 * plan.dispatches[0].threadgroup[1]) == 0 and per >= 128
        assert (splits - 1) * per < nk <= splits * per  # every block holds keys
        assert plan.scratch == {"partial_out": b * hkv * 4 * 2 * splits * 64, "partial_stats": b * hkv * 4 * 2 * splits * 2}
    else:
        assert per == nk and len(plan.dispatches) == 1


def test_bigger_gpus_get_more_blocks():
    q, k, v = _qkv(1, 65536, 128, hq=16, hkv=4)
    splits = [_params(flash_metal.explain(q, k, v, gpu=g).dispatches[0])["kv_splits"] for g in ("base", "max", "ultra")]
    assert splits[0] < splits[1] < splits[2], splits


def test_forced_split_has_two_blocks_even_when_short():
    plan = flash_metal.explain(*_qkv(3, 20, 64), impl="decode_split")
    assert len(plan.dispatches) == 2 and _params(plan.dispatches[0])["kv_splits"] >= 2


def test_forced_one_pass_on_a_long_context():
    plan = flash_metal.explain(*_qkv(1, 100_000, 64), impl="decode")
    assert len(plan.dispatches) == 1 and "requested by the caller" in plan.reason


@pytest.mark.parametrize("impl", ["decode", "decode_split"])
def test_decode_refuses_more_than_eight_rows(impl):
    with pytest.raises(ValueError, match=rf"impl='{impl}' serves at most 8 query rows; got 9"):
        flash_metal.explain(*_qkv(9, 100, 64), impl=impl)


def test_bad_impl_and_gpu_names():
    with pytest.raises(ValueError, match="impl must be one of 'auto', 'untiled', 'tiled', 'prefill', 'decode', 'decode_split', "
                                         "'tensor_ops', 'composite'"):
        flash_metal.explain(*_qkv(4, 4, 64), impl="fast")
    with pytest.raises(ValueError, match=r"gpu must be a class \('base', 'max', 'ultra'\) or a chip \('m1', .*'m5-max'\), optionally "
                                         r"with '\+tensor_ops'; got 'm9'"):
        flash_metal.explain(*_qkv(4, 4, 64), gpu="m9")


# Cores per chip: Apple's and metal-benchmarks' figures, as csrc/metal/gpus.cpp cites them.
CHIP_CORES = {"m1": 8, "m1-pro": 16, "m1-max": 32, "m1-ultra": 64, "m2": 10, "m2-pro": 19, "m2-max": 38,
              "m2-ultra": 76, "m3": 10, "m3-pro": 18, "m3-max": 40, "m3-ultra": 80, "m4": 10, "m4-pro": 20,
              "m4-max": 40, "m5": 10, "m5-pro": 20, "m5-max": 40}


@pytest.mark.parametrize("chip", sorted(CHIP_CORES))
def test_named_chips_size_the_split_by_their_cores(chip):
    # One (batch, kv head): the split count fills one wave of the chip's resident threadgroups
    # (long enough context that nothing else bounds it below 256).
    q, k, v = _qkv(1, 200_000, 64, hq=4, hkv=1)
    plan = flash_metal.explain(q, k, v, gpu=chip)
    want = min(256, CHIP_CORES[chip] * plan.dispatches[0].threadgroups_per_core)
    splits = _params(plan.dispatches[0])["kv_splits"]
    assert splits == _planned_blocks(plan.dispatches[0], 200_000, CHIP_CORES[chip])[0]
    assert 0.8 * want <= splits <= want  # rounding to whole quanta may leave a few slots of the wave empty
    assert f"{CHIP_CORES[chip]}-core" in plan.reason
    assert plan.gpu.lower().replace(" ", "-") == chip
    # Spellings: "M3 Pro", "m3_pro", "M3-PRO" name the same chip.
    same = flash_metal.explain(q, k, v, gpu=chip.upper().replace("-", " "))
    assert same.gpu == plan.gpu


def test_classes_are_their_representative_chips():
    q, k, v = _qkv(1, 4096, 64)
    assert [flash_metal.explain(q, k, v, gpu=g).gpu for g in ("base", "max", "ultra")] == ["M3", "M3 Max", "M3 Ultra"]


def _estimates(plan):
    return [(d.live_registers, d.threadgroups_per_core, d.simdgroups_per_core, d.occupancy_limit)
            for d in plan.dispatches]


@pytest.mark.parametrize("shape,impl", [((128, 128, 64), "prefill"), ((128, 128, 256), "prefill"),
                                        ((1, 4096, 128), "decode"), ((1, 65536, 128), "decode_split"),
                                        ((64, 64, 64), "tiled")])
def test_estimates_follow_registers_and_threadgroup_memory(shape, impl):
    # Residency = min(register file / (live x 4 B x 32 lanes x SIMD-groups),
    # threadgroup memory per core / the launch's), recomputed here from the
    # plan's own numbers and the chip's figures (csrc/metal/gpus.cpp).
    nq, nk, d = shape
    for gpu, tg_mem in (("m1", 60 * 1024), ("m3-max", 32 * 1024)):
        plan = flash_metal.explain(*_qkv(nq, nk, d), impl=impl, gpu=gpu)
        for disp in plan.dispatches:
            sgs = -(-(disp.threadgroup[0] * disp.threadgroup[1] * disp.threadgroup[2]) // 32)
            by_regs = 208 * 1024 // (disp.live_registers * 4 * 32 * sgs)
            by_mem = tg_mem // disp.threadgroup_memory if disp.threadgroup_memory else 10**9
            assert disp.threadgroups_per_core == max(1, min(by_regs, by_mem)), (gpu, disp.kernel_name)
            assert disp.simdgroups_per_core == disp.threadgroups_per_core * sgs
            assert disp.occupancy_limit == ("registers" if by_regs <= by_mem else "threadgroup memory")
            assert 16 < disp.live_registers < 400


def test_bigger_tiles_cost_registers():
    # The live-value models grow with the head dim (prefill: output fragments)
    # at one SIMD-group per 8-row group; at D = 256 (float16) the planner
    # splits O's features over 2 SIMD-groups to stay within the budget.
    regs = [flash_metal.explain(*_qkv(128, 128, d), impl="prefill").live_registers for d in (32, 64, 128, 256)]
    assert regs[:3] == sorted(regs[:3]) and regs[0] < regs[2]
    assert regs[3] == 256 // 4 // 2 + 8 // 4 + 22 <= 72


def test_split_dispatches_share_params_and_bind_the_scratch():
    plan = flash_metal.explain(*_qkv(2, 8192, 64))
    split, merge = plan.dispatches
    assert torch.equal(split.params, merge.params)
    assert set(split.buffers) == {"q", "k", "v", "partial_out", "partial_stats", "attn_mask", "cu_seqlens_q", "cu_seqlens_k",
                                  "sinks", "block_table", "cache_seqlens"}
    assert set(merge.buffers) == {"out", "lse", "partial_out", "partial_stats"}
    assert split.buffers["partial_out"] == merge.buffers["partial_out"]
    assert split.buffers["partial_stats"] == merge.buffers["partial_stats"]


# --- issue 11's options -------------------------------------------------------------------------

# Indices of the function constants (csrc/metal/plan.h; shaders/common/attention_features.h).
CAUSAL, ALIGN_Q, ALIGN_K, HAS_GRAD_LSE, HAS_MASK, MASK_BOOL, MASK_F32, WINDOW_LEFT, SOFTCAP, VARLEN = range(10)


def _option_params(dispatch):
    fields = struct.unpack("<19q8i2f2i7q4q2i2f2i2i2i", dispatch.params.numpy().tobytes())
    return {"causal_offset": fields[26], "mask_strides": fields[38:42], "window_left": fields[42],
            "window_right": fields[43], "softcap_log2": fields[44], "inv_softcap_log2": fields[45],
            "total_q": fields[46], "total_k": fields[47], "q_batch_stride": fields[0]}


@pytest.mark.parametrize("nq", [1, 100])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_each_option_sets_its_function_constant_and_params(nq, dtype):
    q, k, v = _qkv(nq, 120, 64, dtype)
    cases = {
        "bool": (dict(attn_mask=torch.ones(120, dtype=torch.bool)), {HAS_MASK, MASK_BOOL}),
        "additive": (dict(attn_mask=torch.zeros(nq, 120, dtype=dtype)), {HAS_MASK}),
        "float32": (dict(attn_mask=torch.zeros(1, 4, 1, 120)), {HAS_MASK} | ({MASK_F32} if dtype != torch.float32
                                                                          else set())),
        "left": (dict(window_left=10), {WINDOW_LEFT}),
        "right": (dict(window_right=3), {CAUSAL}),
        "softcap": (dict(softcap=30.0), {SOFTCAP}),
    }
    for name, (options, on) in cases.items():
        for backward in (False, True):
            plan = flash_metal.explain(q, k, v, backward=backward, **options)
            for d in plan.dispatches:
                if d.kernel_name.startswith("flash_decode_merge"):
                    assert d.function_constants == ()  # the merge reads only the partials
                    continue
                consts = d.function_constants
                # indices 0-9, fc_dense (10; packed, D = 64: on), the decode kernels' too (issue 19), and
                # fc_has_sinks (11; off: no sinks here, tests/api/test_sinks.py has them); the decode and prefill
                # kernels' fc_paged (12; off: the paged cache is tests/metal/test_metal_{decode,prefill}_paged.py's),
                # and the prefill's fc_pack_gqa (13; off: Nq 100 is long, tests/metal/test_metal_prefill_pack_gqa.py)
                prefill = d.kernel_name.startswith("flash_attention_prefill_")
                n = 14 if prefill else 13 if d.kernel_name.startswith("flash_decode") else 12
                assert len(consts) == n and consts[10] is True and consts[11] is False, d.kernel_name
                assert consts[11:13] == (False,) * (min(n, 13) - 11) and consts[13:] == (False,) * (n - 13)
                got = {i for i in (CAUSAL, HAS_MASK, MASK_BOOL, MASK_F32, WINDOW_LEFT, SOFTCAP, VARLEN) if consts[i]}
                assert got == on, (name, d.kernel_name, got)
                assert d.buffers["attn_mask"] == 14 and d.buffers["cu_seqlens_q"] == 15
                prm = _option_params(d)
                if name == "right":
                    assert prm["window_right"] == 3 and prm["causal_offset"] == 120 - nq + 3
                if name == "left":
                    assert prm["window_left"] == 10
                if name == "softcap":
                    assert abs(prm["softcap_log2"] - 30.0 * 1.4426950408889634) < 1e-4
                    assert abs(prm["softcap_log2"] * prm["inv_softcap_log2"] - 1.0) < 1e-6


def test_mask_strides_are_the_broadcast_view():
    q, k, v = _qkv(100, 120, 64, b=2)
    base = torch.zeros(3, 120, 100, dtype=torch.bool).transpose(1, 2)  # (3, 100, 120), keys stride 100
    plan = flash_metal.explain(q, k, v, attn_mask=base.unsqueeze(1)[:1])
    # (B=2, Hq=4, Nq, Nk) view of a (1, 1, Nq, Nk) mask: batch and heads broadcast (stride 0).
    assert _option_params(plan.dispatches[0])["mask_strides"] == (0, 0, 1, 100)


def test_varlen_plans_the_prefill_kernel_per_sequence():
    q = torch.empty(30, 8, 64, dtype=torch.float16)
    k = torch.empty(50, 2, 64, dtype=torch.float16)
    cu_q = torch.tensor([0, 1, 30], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 50], dtype=torch.int32)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=29, max_seqlen_k=30)
    plan = flash_metal.explain(q, k, k, True, **varlen)
    assert plan.reason.startswith("prefill: packed variable-length sequences"), plan.reason
    (d,) = plan.dispatches
    assert d.grid == (1, 8, 2)  # ceil(29 / 32) query blocks x heads x sequences (29 rows: not packed)
    assert d.function_constants[VARLEN] and d.function_constants[CAUSAL]
    assert not d.function_constants[ALIGN_Q] and not d.function_constants[ALIGN_K]
    prm = _option_params(d)
    assert prm["total_q"] == 30 and prm["total_k"] == 50 and prm["q_batch_stride"] == 0
    back = flash_metal.explain(q, k, k, True, backward=True, **varlen)
    assert back.scratch["delta"] == 8 * 30  # Hq * total_q
    assert all(x.function_constants[VARLEN] for x in back.dispatches)


# --- issues 19 and 43: decode fills one wave of the GPU, counted in SIMD-groups ----------------

# (q heads, kv heads, head_dim) from each model's published config.
DECODE_MODELS = {"llama3-8b": (32, 8, 128), "llama3-70b": (64, 8, 128), "qwen2.5-7b": (28, 4, 128),
                 "mistral-7b": (32, 8, 128), "gemma2-9b": (16, 8, 256), "gpt-oss-20b": (64, 8, 64),
                 "phi3-mini": (32, 32, 96)}
DECODE_BATCHES = range(1, 9)
DECODE_NK = tuple(2**e for e in range(9, 18))  # 512 .. 128k
# From this Nk on, no shape of the grid is short of keys for the blocks a wave holds on any chip
# (the exemption below is reached only under it).
DECODE_NK_ALWAYS_FULL = 16384


def _meta_qkv(b, hq, hkv, nq, nk, d, dtype=torch.float16):
    # Stride-0 views of one element: explain() reads only shapes and strides.
    one = torch.zeros(1, dtype=dtype)
    return one.expand(b, hq, nq, d), one.expand(b, hkv, nk, d), one.expand(b, hkv, nk, d)


def _fill_verdict(grid, threadgroup, splits, cores, nk, resident):
    """Against one wave of `resident` threadgroups per core: 'full' (the launch holds at least half the wave's
    SIMD-groups and no more than the wave, or its single block's threadgroups alone exceed it), 'exempt' (less,
    with as many blocks as Nk allows: Nk // 128 blocks, rounded to whole quanta of key groups (threadgroup y)
    x 32 keys), 'over' (more than a wave, splittable) or 'short'."""
    per_block = grid[0] * grid[1]
    slots = cores * resident
    if per_block * splits > slots:
        return "full" if splits == 1 else "over"
    if 2 * per_block * splits >= slots:
        return "full"
    quantum = 32 * threadgroup[1]
    per = -(-(-(-nk // max(1, nk // 128))) // quantum) * quantum
    return "exempt" if splits == -(-nk // per) else "short"


def test_decode_fills_one_wave_on_every_chip_and_model():
    # Every named chip (its own core count), every model of the grid, batch
    # 1-8, Nq 1 and 4, Nk 512-128k: the decode launch holds at least half of
    # one wave of resident SIMD-groups and never more than a wave (issue 43;
    # whole quanta of key groups x 32 keys can leave part of the wave empty),
    # unless Nk allows no more blocks of >= 128 keys (the exemption, reached
    # only below DECODE_NK_ALWAYS_FULL). And in one-token decode each K/V
    # element is read by one threadgroup per (batch, kv head, block): the
    # GQA group's rows share it (the emulator's byte counts,
    # test_metal_decode.py).
    exempt = set()
    for (model, (hq, hkv, d)), b, nq, nk in itertools.product(DECODE_MODELS.items(), DECODE_BATCHES, (1, 4), DECODE_NK):
        q, k, v = _meta_qkv(b, hq, hkv, nq, nk, d)
        for chip, cores in CHIP_CORES.items():
            plan = flash_metal.explain(q, k, v, True, None, "auto", chip)
            first = plan.dispatches[0]
            case = (model, b, nq, nk, chip)
            # One threadgroup per (kv head, batch[, block]) in one-token decode:
            # K/V read once for the GQA group. With Nq = 4 a group of more
            # than 8 row groups (Llama-3-70B, 32 rows of 2) takes row chunks.
            rows = 4 if d <= 64 else 2 if d <= 128 else 1
            chunks = -(-(-(-hq // hkv * nq // rows)) // 8)
            assert first.grid[:2] == (hkv * chunks, b) and (nq > 1 or chunks == 1), (case, first.grid)
            verdict = _fill_verdict(first.grid, first.threadgroup, _params(first)["kv_splits"], cores, nk,
                                    first.threadgroups_per_core)
            assert verdict in ("full", "exempt"), (case, verdict, first.grid, first.threadgroup, plan.reason)
            if verdict == "exempt":
                exempt.add(case)
    assert exempt and max(e[3] for e in exempt) < DECODE_NK_ALWAYS_FULL, sorted(exempt, key=lambda e: e[3])[-5:]


def test_decode_fill_check_catches_a_planted_threadgroup_count():
    # The verdict on planted launches, 3 resident threadgroups per core. The
    # issue-19 rule (24 key-group streams per core) on Llama-3-8B, B = 1, 4k
    # keys, M3 Max: 8 threadgroups x 32 blocks = 256 for a wave of 120:
    # "over". The heuristic before it (SIMD-groups not counted) on
    # Llama-3-70B at 128k, M3 Ultra: 8 x 4 blocks = 32 for 240: "short";
    # the same at Nk = 512 with the 4 blocks Nk allows: "exempt"; 30 blocks:
    # "full".
    assert _fill_verdict((8, 1, 32), (32, 4, 2), 32, 40, 4096, 3) == "over"
    assert _fill_verdict((8, 1, 4), (32, 2, 4), 4, 80, 131072, 3) == "short"
    assert _fill_verdict((8, 1, 4), (32, 2, 4), 4, 80, 512, 3) == "exempt"
    assert _fill_verdict((8, 1, 30), (32, 2, 4), 30, 80, 131072, 3) == "full"
