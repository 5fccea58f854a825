"""The routing function (choose_metal_kernel in csrc/metal_plan.cpp), through flash_metal.explain.

Planner only, no kernel runs: which family each problem gets, with which
blocks, bucket, split count and scratch, and why. The kernels themselves run
in test_metal_kernels.py, test_metal_prefill.py and test_metal_decode.py.
"""
import struct

import pytest
import torch

import flash_metal
from numerics import DTYPES, dtype_id

FAST_BUCKETS = (32, 64, 72, 80, 96, 128, 256)
# (block_q, block_k, simdgroups) per prefill bucket: MLX's steel table, with
# PyTorch's 16/8/2 at 256 (see choose_metal_kernel's why-comments).
PREFILL_BLOCKS = {32: (32, 32, 4), 64: (32, 32, 4), 72: (32, 32, 4), 80: (32, 32, 4), 96: (32, 32, 4),
                  128: (32, 16, 4), 256: (16, 8, 2)}
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _qkv(nq, nk, d, dtype=torch.float16, hq=4, hkv=2, b=1):
    q = torch.empty(b, hq, nq, d, dtype=dtype)
    k = torch.empty(b, hkv, nk, d, dtype=dtype)
    return q, k, k


def _params(dispatch):
    fields = struct.unpack("<19q8i2f2i7q", dispatch.params.numpy().tobytes())
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
        bq, bk, wm = PREFILL_BLOCKS[bucket]
        plan = flash_metal.explain(*_qkv(70, 45, d, dtype), impl="prefill")
        assert plan.kernel_name == f"flash_attention_prefill_{DTYPE_NAMES[dtype]}_d{bucket}_bq{bq}_bk{bk}_wm{wm}"
        assert plan.grid == (-(-70 // bq), 4, 1) and plan.threadgroup == (32 * wm, 1, 1)
        # Q tile plus one K/V tile, rows padded by 16 bytes (attention_prefill.h).
        assert plan.threadgroup_memory == (bq + bk) * (bucket * size + 16)
        assert plan.threadgroup_memory <= 32 * 1024 and plan.threadgroup_memory % 16 == 0
        assert ("zero-padded" in plan.reason) == (d != bucket), (d, plan.reason)
        if dtype != torch.float32:  # two threadgroups per core, and the reason says so
            assert plan.threadgroup_memory <= 16 * 1024 and "two threadgroups" in plan.reason


@pytest.mark.parametrize("nq,nk,aligned", [(64, 64, (True, True)), (65, 64, (False, True)), (64, 70, (True, False)),
                                            (33, 17, (False, False))])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_edge_constants(nq, nk, aligned, causal):
    plan = flash_metal.explain(*_qkv(nq, nk, 64), causal=causal)
    assert plan.function_constants == (causal, *aligned)


def test_decode_one_pass_for_short_contexts_and_split_for_long():
    short = flash_metal.explain(*_qkv(1, 300, 128))
    assert [d.kernel_name for d in short.dispatches] == ["flash_decode_float16_d128"]
    assert "one pass" in short.reason and short.scratch == {"partial_out": 0, "partial_stats": 0}
    assert _params(short.dispatches[0])["kv_splits"] == 1
    long = flash_metal.explain(*_qkv(1, 8192, 128))
    assert [d.kernel_name for d in long.dispatches] == ["flash_decode_split_float16_d128", "flash_decode_merge_float16_d128"]
    assert "split-KV" in long.reason
    with pytest.raises(ValueError, match="2 dispatches"):
        long.kernel_name  # noqa: B018  (the single-dispatch view refuses a two-dispatch plan)


@pytest.mark.parametrize("b,hkv,nk", [(1, 1, 100_000), (1, 8, 8192), (4, 8, 32768), (1, 2, 700), (2, 1, 257)])
@pytest.mark.parametrize("gpu", ["base", "max", "ultra"])
def test_split_count_and_blocks(b, hkv, nk, gpu):
    q, k, v = _qkv(2, nk, 64, hq=hkv * 4, hkv=hkv, b=b)
    plan = flash_metal.explain(q, k, v, gpu=gpu)
    p = _params(plan.dispatches[0])
    splits, per = p["kv_splits"], p["split_keys"]
    cores = {"base": 10, "max": 40, "ultra": 80}[gpu]
    want = -(-cores * 4 // (b * hkv))
    assert 1 <= splits <= min(64, max(1, nk // 256), max(want, 1))
    if splits > 1:
        assert per % 32 == 0 and per >= 256
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
    with pytest.raises(ValueError, match="impl must be one of 'auto', 'untiled', 'tiled', 'prefill', 'decode', 'decode_split'"):
        flash_metal.explain(*_qkv(4, 4, 64), impl="fast")
    with pytest.raises(ValueError, match="gpu must be one of 'base', 'max', 'ultra'"):
        flash_metal.explain(*_qkv(4, 4, 64), gpu="m3")


def test_split_dispatches_share_params_and_bind_the_scratch():
    plan = flash_metal.explain(*_qkv(2, 8192, 64))
    split, merge = plan.dispatches
    assert torch.equal(split.params, merge.params)
    assert set(split.buffers) == {"q", "k", "v", "partial_out", "partial_stats"}
    assert set(merge.buffers) == {"out", "lse", "partial_out", "partial_stats"}
    assert split.buffers["partial_out"] == merge.buffers["partial_out"]
    assert split.buffers["partial_stats"] == merge.buffers["partial_stats"]
