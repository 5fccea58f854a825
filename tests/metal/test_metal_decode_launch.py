"""The decode launch's rules (issue 43), through flash_metal.explain (the planner only, no kernel):

1. one wave: every decode launch of the model grid fits one wave of resident threadgroups (counted in
   SIMD-groups: the launch's threadgroups x their SIMD-groups against the cores x the SIMD-groups each holds,
   the planner's own residency) on every named chip, or explain() says why not;
2. the most blocks that wave holds: the block is the smallest whole quantum the wave and Nk allow;
3. balanced key groups: blocks are whole quanta of key groups x 32 keys, so every key group of a full block
   runs the same number of 32-key blocks, and no two key groups of one threadgroup differ by more than one.

The grid (issue 43): Llama-3-8B/70B, Qwen2.5-7B, Mistral-7B, Gemma-2-9B, gpt-oss-20b; batch 1-8; Nk 512-128k;
every chip csrc/metal/gpus.cpp names. Every figure here is the planner's model of a launch, not a measurement.
"""
import struct

import pytest
import torch

import flash_metal

# (q heads, kv heads, head_dim), each model's published config (as tests/metal/test_metal_plan_limits.py).
GRID_MODELS = {"llama3-8b": (32, 8, 128), "llama3-70b": (64, 8, 128), "qwen2.5-7b": (28, 4, 128),
               "mistral-7b": (32, 8, 128), "gemma2-9b": (16, 8, 256), "gpt-oss-20b": (64, 8, 64)}
BATCHES = (1, 2, 3, 4, 8)
KV_LENS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
QUERY_ROWS = (1, 4)  # one token, and speculative decoding's few
CHIPS = ("m1", "m1-pro", "m1-max", "m1-ultra", "m2", "m2-pro", "m2-max", "m2-ultra", "m3", "m3-pro", "m3-max",
         "m3-ultra", "m4", "m4-pro", "m4-max", "m5", "m5-pro", "m5-max")
CORES = {"m1": 8, "m1-pro": 16, "m1-max": 32, "m1-ultra": 64, "m2": 10, "m2-pro": 19, "m2-max": 38, "m2-ultra": 76,
         "m3": 10, "m3-pro": 18, "m3-max": 40, "m3-ultra": 80, "m4": 10, "m4-pro": 20, "m4-max": 40, "m5": 10,
         "m5-pro": 20, "m5-max": 40}
MIN_KEYS_PER_SPLIT, MAX_SPLITS = 128, 256  # kMinKeysPerSplit, kMaxKvSplits (csrc/metal/families/decode.cpp)


def _qkv(b, hq, hkv, nq, nk, d):
    one = torch.zeros(1, dtype=torch.float16)  # metadata only: stride-0 views
    return one.expand(b, hq, nq, d), one.expand(b, hkv, nk, d), one.expand(b, hkv, nk, d)


def _split_fields(dispatch):
    fields = struct.unpack("<19q8i2f2i7q4q2i2f2i2i2i", dispatch.params.numpy().tobytes())
    return fields[24], fields[29], fields[30]  # kv_len, kv_splits, split_keys


def launch(model, b, nk, chip, nq=1):
    """The decode launch's figures: (threadgroups, SIMD-groups per threadgroup, resident threadgroups per core,
    threadgroups per key block, key groups, splits, keys per split, the plan)."""
    hq, hkv, d = GRID_MODELS[model]
    plan = flash_metal.explain(*_qkv(b, hq, hkv, nq, nk, d), gpu=chip)
    first = plan.dispatches[0]
    assert first.kernel_name.startswith("flash_decode_"), first.kernel_name
    gx, gy, gz = first.grid
    _, splits, per = _split_fields(first)
    assert gz == splits
    return dict(tgs=gx * gy * gz, sgs=first.threadgroup[1] * first.threadgroup[2], resident=first.threadgroups_per_core,
                per_block=gx * gy, kg=first.threadgroup[1], splits=splits, per=per, plan=plan)


def _grid():
    return [(m, b, nk, chip, nq) for m in GRID_MODELS for b in BATCHES for nk in KV_LENS for chip in CHIPS
            for nq in QUERY_ROWS]


def _one_wave_or_why(L, chip):
    """[] if the launch fits one wave of resident SIMD-groups, or explain() says why it cannot; else a reason."""
    slots = CORES[chip] * L["resident"] * L["sgs"]  # resident SIMD-groups of the chip
    if L["tgs"] * L["sgs"] <= slots:
        return []
    reason = L["plan"].reason
    if L["per_block"] * L["sgs"] > slots and "more than one wave" in reason and f"exceed the {slots // L['sgs']}" in reason:
        return []  # one block's threadgroups alone exceed a wave: explain() says so, with the wave's size
    return [(L["tgs"], L["sgs"], slots)]


@pytest.mark.parametrize("model", sorted(GRID_MODELS))
def test_every_decode_launch_is_one_wave_or_explained(model):
    bad, waves_explained = [], 0
    for m, b, nk, chip, nq in _grid():
        if m != model:
            continue
        L = launch(m, b, nk, chip, nq)
        got = _one_wave_or_why(L, chip)
        if got:
            bad.append((m, b, nk, chip, got))
        waves_explained += L["tgs"] * L["sgs"] > CORES[chip] * L["resident"] * L["sgs"]
    assert bad == []
    if model == "llama3-70b":  # batch 8 x 8 kv heads = 64 threadgroups per block: over a 10-core chip's wave
        assert waves_explained > 0


def test_the_wave_check_catches_the_old_rule():
    """Planted: the split count before issue 43 (24 key-group streams per core, blocks of 32-key multiples)
    for Llama-3-8B at 4k keys on an M3 Max launched 32 blocks: 256 threadgroups for the 120 a wave holds."""
    L = launch("llama3-8b", 1, 4096, "m3-max")
    assert L["resident"] == 3 and L["sgs"] == 8 and L["per_block"] == 8
    streams = L["per_block"] * L["kg"]
    old_splits = min(4096 // MIN_KEYS_PER_SPLIT, -(-40 * 24 // streams))  # 30, then 32 by the 32-key rounding
    per = -(-(-(-4096 // old_splits)) // 32) * 32
    while -(-4096 // per) < old_splits:
        old_splits += 1
        per = -(-(-(-4096 // old_splits)) // 32) * 32
    planted = dict(L, splits=-(-4096 // per), tgs=L["per_block"] * -(-4096 // per))
    assert planted["tgs"] == 256
    assert _one_wave_or_why(planted, "m3-max") == [(256, 8, 40 * 3 * 8)]
    assert _one_wave_or_why(L, "m3-max") == [] and L["tgs"] <= 120


@pytest.mark.parametrize("chip", CHIPS)
def test_blocks_are_whole_quanta_and_the_most_one_wave_holds(chip):
    """Rule 2 and 3: keys per block a multiple of key groups x 32; the block the smallest such that the blocks
    fit the wave, Nk // 128 and 256 (one fewer quantum would need more blocks than that); no empty block."""
    for m, b, nk, c, nq in _grid():
        if c != chip:
            continue
        L = launch(m, b, nk, chip, nq)
        q = 32 * L["kg"]
        cap = max(1, min(CORES[chip] * L["resident"] // L["per_block"], max(1, nk // MIN_KEYS_PER_SPLIT), MAX_SPLITS))
        if L["splits"] == 1:
            assert L["per"] == nk and (cap == 1 or -(-nk // q) * q <= -(-nk // cap)), (m, b, nk, L["per"], cap)
            continue
        assert L["per"] % q == 0, (m, b, nk, L["per"], q)
        assert (L["splits"] - 1) * L["per"] < nk <= L["splits"] * L["per"]
        assert L["splits"] <= cap
        assert L["per"] - q < -(-nk // cap), (m, b, nk, L["per"], cap)  # a quantum less would need > cap blocks


def _key_group_blocks(nk, per, splits, kg):
    """32-key blocks each key group of each split runs (attention_decode.h: block kg, kg + KG, ... of its split)."""
    out = []
    for s in range(splits):
        keys = max(0, min(nk, (s + 1) * per) - s * per)
        blocks = -(-keys // 32)
        out.append([len(range(g, blocks, kg)) for g in range(kg)])
    return out


def test_key_groups_are_balanced_on_the_grid():
    """Every full block's key groups run the same number of 32-key blocks; a threadgroup's differ by at most one."""
    for m, b, nk, chip, nq in _grid():
        L = launch(m, b, nk, chip, nq)
        per = L["per"] if L["splits"] > 1 else nk
        for s, counts in enumerate(_key_group_blocks(nk, per, L["splits"], L["kg"])):
            assert max(counts) - min(counts) <= 1, (m, b, nk, chip, s, counts)
            if (s + 1) * per <= nk:  # a full block
                assert len(set(counts)) == 1, (m, b, nk, chip, s, counts)


def test_balance_check_catches_32_key_rounding():
    """Planted: the 32-key rounding before issue 43, M4 Pro, Llama-3-8B at 4k keys: 9 blocks over 4 key groups
    (3/2/2/2) in every full block."""
    counts = _key_group_blocks(4096, 288, 15, 4)
    assert counts[0] == [3, 2, 2, 2]
    L = launch("llama3-8b", 1, 4096, "m4-pro")
    assert L["kg"] == 4 and L["per"] % 128 == 0
    assert all(len(set(c)) == 1 for c in _key_group_blocks(4096, L["per"], L["splits"], L["kg"])[:-1])


def test_explain_names_the_wave_and_the_quantum():
    L = launch("llama3-8b", 1, 4096, "m3-max")
    r = L["plan"].reason
    assert "one wave holds 120 threadgroups" in r and "1 wave" in r and "quanta of 4 key groups x 32" in r, r
    many = launch("llama3-70b", 8, 4096, "m1")
    assert many["splits"] == 1 and "more than one wave" in many["plan"].reason, many["plan"].reason
