"""The CPU kernel's split decode (csrc/cpu/key_split.h, issue 39).

A decode-like call (one block of query rows per item) with fewer work items
than threads spreads each item's keys over S splits; each split writes a
partial output and lse, and the last split of an item merges them. The
automatic rule needs more threads than items; FLASH_METAL_CPU_KEY_SPLITS=n
forces n splits on any decode-like call, so every option (masks, windows,
softcap, sinks, varlen, D_qk != D_v, splits with no keys) runs split on a
2-core machine. Every result is checked against the float64 oracle by the
2x rule (tests/numerics.py) with NaN-poisoned outputs (conftest.py); counter
slot 10 proves the split ran, or that it did not where it must not.
"""
import zlib

import pytest
import torch

import flash_metal
from numerics import assert_attention_close, assert_varlen_close, dtype_id, make_qkv, threads

COUNTS = torch.ops.flash_metal.cpu_path_counts
KEY_SPLIT = 10  # forward calls that split their keys
FWD_COLS = 7  # forward brgemm calls in the column form
HAS_BRGEMM = dict(zip(*torch.ops.flash_metal.cpu_features()))["torch_brgemm"] == 1
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _mask_bool(B, Hq, Nq, Nk, g):
    m = torch.rand(B, 1, Nq, Nk, generator=g) > 0.3
    m[..., -1] = True  # every row sees a key (the last one: a late split)
    return {"attn_mask": m}


# (id, B, Hq, Hkv, Nq, Nk, D_qk, D_v, causal, options). Nk straddles the
# 96-key blocks; "few-keys" has fewer blocks than splits (empty splits).
# FWD_COLS counts the column form: "chunk-cols" must reach it on brgemm.
CASES = [
    ("decode-gqa", 1, 8, 2, 1, 1000, 128, 128, False, None),
    ("spec-causal", 2, 4, 1, 3, 777, 64, 64, True, None),
    ("window-softcap", 1, 4, 2, 2, 900, 64, 64, True, lambda *a: {"window_left": 300, "softcap": 8.0}),
    ("bool-mask", 1, 4, 4, 1, 611, 80, 80, False, _mask_bool),
    ("sinks", 1, 6, 2, 1, 500, 64, 64, False, lambda B, Hq, Nq, Nk, g: {"sinks": torch.randn(Hq, generator=g) + 3}),
    ("dqk-ne-dv", 1, 4, 1, 1, 400, 96, 64, False, None),
    ("few-keys", 1, 4, 4, 2, 5, 64, 64, True, None),
    # one block of 64 query rows: brgemm's column form (and float16's bfloat16 pairs) with splits
    ("chunk-cols", 1, 4, 2, 64, 700, 64, 64, True, lambda B, Hq, Nq, Nk, g: {"sinks": torch.randn(Hq, generator=g)}),
]


def _run(case, dtype):
    name, B, Hq, Hkv, Nq, Nk, D, Dv, causal, build = case
    g = _gen(name, str(dtype))
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, generator=g)
    if Dv != D:
        v = torch.randn(B, Hkv, Nk, Dv, generator=g).to(dtype)
    options = build(B, Hq, Nq, Nk, g) if build else {}
    before = COUNTS()[KEY_SPLIT]
    out, lse = flash_metal.attention_with_lse(q, k, v, causal, None, "auto", **options)
    assert_attention_close(out, lse, q, k, v, causal, None, **options)
    return COUNTS()[KEY_SPLIT] - before


@pytest.mark.parametrize("path", ["vector", "brgemm"])
@pytest.mark.parametrize("splits", [2, 3, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forced_splits_match_oracle(monkeypatch, path, splits, dtype, case):
    if path == "brgemm" and (dtype == torch.float32 or not HAS_BRGEMM):
        pytest.skip("brgemm covers 16-bit dtypes on a torch with at::native::cpublas::brgemm")
    monkeypatch.setenv("FLASH_METAL_CPU_PATH", path)
    monkeypatch.setenv("FLASH_METAL_CPU_KEY_SPLITS", str(splits))
    cols = COUNTS()[FWD_COLS]
    with threads(2):  # the query blocking depends on the thread count: 2 keeps "chunk-cols" one block
        assert _run(case, dtype) == 1
    if case[0] == "chunk-cols" and path == "brgemm":
        assert COUNTS()[FWD_COLS] == cols + 1, "the column form did not run"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_forced_splits_varlen(monkeypatch, dtype):
    """Sequences of their own lengths (one with no query, one with no key): each item splits its own keys."""
    monkeypatch.setenv("FLASH_METAL_CPU_KEY_SPLITS", "4")
    g = _gen("varlen", str(dtype))
    lq, lk = [1, 0, 2, 1, 1], [700, 17, 333, 0, 96]
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lq), 4, 64, generator=g).to(dtype)
    k = torch.randn(sum(lk), 2, 64, generator=g).to(dtype)
    v = torch.randn(sum(lk), 2, 64, generator=g).to(dtype)
    before = COUNTS()[KEY_SPLIT]
    out, lse = flash_metal.attention_varlen_with_lse(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True,
                                                     window_left=200)
    assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, causal=True, window_left=200)
    assert COUNTS()[KEY_SPLIT] == before + 1


def test_automatic_rule(monkeypatch):
    """Auto splits only decode-like calls with fewer items than threads, into splits of >= 512 keys."""
    monkeypatch.delenv("FLASH_METAL_CPU_KEY_SPLITS", raising=False)
    g = _gen("auto")

    def splits_ran(Hq, Hkv, Nq, Nk):
        q, k, v = make_qkv(1, Hq, Hkv, Nq, Nk, 64, torch.float32, generator=g)
        before = COUNTS()[KEY_SPLIT]
        out, lse = flash_metal.attention_with_lse(q, k, v, False, None, "auto")
        assert_attention_close(out, lse, q, k, v, False, None)
        return COUNTS()[KEY_SPLIT] - before

    with threads(2):
        assert splits_ran(4, 1, 1, 1500) == 1  # one item (a GQA group), 2 threads: 2 splits of 750 keys
        assert splits_ran(4, 1, 1, 900) == 0  # 2 splits would be under 512 keys each
        assert splits_ran(4, 2, 1, 1500) == 0  # 2 items already fill 2 threads
        assert splits_ran(1, 1, 200, 1500) == 0  # prefill: several query blocks
    with threads(1):
        assert splits_ran(4, 1, 1, 1500) == 0  # one thread: nothing to spread


def test_forced_splits_leave_prefill_alone(monkeypatch):
    """The override covers decode-like calls only: a call with several query blocks runs unsplit."""
    monkeypatch.setenv("FLASH_METAL_CPU_KEY_SPLITS", "4")
    assert _run(("prefill", 1, 2, 2, 300, 400, 64, 64, True, None), torch.float32) == 0


@pytest.mark.parametrize("bad", ["two", "33", "-1", "2.5"])
def test_bad_split_count_is_a_clear_error(monkeypatch, bad):
    monkeypatch.setenv("FLASH_METAL_CPU_KEY_SPLITS", bad)
    q, k, v = make_qkv(1, 4, 1, 1, 300, 64, torch.float32, generator=_gen("bad", bad))
    with pytest.raises(ValueError, match=r"FLASH_METAL_CPU_KEY_SPLITS must be 0 \(automatic\) or a split count in \[1, 32\]"):
        flash_metal.attention(q, k, v)
