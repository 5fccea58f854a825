"""attention_kvcache reading quantized KV caches in place on CPU (issue 44).

Each case builds a cache in its format (tests/kvq_cases.py: paged and
shuffled, or plain; rows past each sequence poisoned: NaN scales and
biases, fp8 NaN codes), runs the op (outputs NaN-poisoned by conftest), and
holds every sequence to the 2x rule against float64 attention over the
*dequantized* cache (flash_metal.dequantize_kv), so the quantization error
is neither blamed on the kernel nor hidden by it. The kernel's counters
(kvcache_quant_counts) prove the quantized kernel ran with the formats
asked, and the split path where FLASH_METAL_KVQ_SPLITS forces it.
Planted bugs -- nibbles swapped, a group's scale taken from the next group,
the zero point ignored -- are each caught: the same check fails against a
reference dequantized with the bug.
"""
import os

import pytest
import torch

import flash_metal
from flash_metal.quantized_kv import _unpack_q4
from flash_metal.testing import attention_errors
from kvq_cases import Case
from numerics import assert_attention_close

FMTS = ["native-float32", "native-float16", "native-bfloat16", "int8", "q4", "fp8_e4m3"]
FMT_INDEX = {f: i for i, f in enumerate(FMTS)}


def counts():
    return torch.ops.flash_metal.kvcache_quant_counts()


def check(case, out, lse, causal=False, **options):
    sinks = options.get("sinks")
    for b, n in enumerate(case.seqlens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])), b
            want = torch.full_like(lse[b], float("-inf")) if sinks is None else sinks[:, None].expand_as(lse[b])
            assert torch.allclose(lse[b], want.float()), b
            continue
        k, v = case.reference_kv(b)
        assert_attention_close(out[b:b + 1], lse[b:b + 1], case.q[b:b + 1], k, v, causal, **options)


# (K format, V format, B, Hq, Hkv, Nq, D, seqlens, page, q dtype, exact, causal, options)
CASES = [
    ("int8", "int8", 2, 8, 2, 1, 128, [300, 157], 16, torch.float32, False, False, {}),
    ("q4", "q4", 2, 4, 4, 1, 64, [97, 0], 7, torch.float32, False, True, {}),
    ("fp8_e4m3", "fp8_e4m3", 3, 6, 2, 2, 64, [40, 129, 5], None, torch.float32, False, True, {}),
    ("int8", "q4", 2, 4, 1, 3, 128, [200, 65], 32, torch.bfloat16, True, True, {"window_left": 50}),
    ("q4", "fp8_e4m3", 1, 32, 2, 1, 64, [257], 16, torch.float16, True, False, {"softcap": 4.0}),
    ("fp8_e4m3", "int8", 2, 4, 2, 1, 96, [130, 33], 1, torch.float16, True, True, {"sinks": True}),
    # Chunked prefill: 40 and 70 new queries against their cache, causal, GQA.
    ("int8", "int8", 2, 8, 2, 40, 64, [120, 40], 16, torch.float32, False, True, {}),
    ("q4", "q4", 1, 4, 1, 70, 128, [300], 64, torch.bfloat16, True, True, {"window_left": 100}),
    # The direct kernel on native caches (impl='direct').
    ("native-float16", "native-float16", 2, 4, 2, 1, 80, [77, 150], 16, torch.float16, True, True, {}),
    ("native-bfloat16", "native-bfloat16", 1, 2, 1, 5, 64, [99], None, torch.bfloat16, True, True, {}),
    ("native-float32", "native-float32", 1, 2, 2, 1, 72, [60], 8, torch.float32, True, False, {"softcap": 3.0}),
]
IDS = ["int8-decode-gqa", "q4-mha-ragged-empty", "fp8-plain-nq2", "int8k-q4v-window-bf16", "q4k-fp8v-softcap-f16",
       "fp8k-int8v-sinks-page1", "int8-prefill40", "q4-prefill70-window", "native-f16-direct",
       "native-bf16-direct-plain", "native-f32-d72-softcap"]


@pytest.mark.parametrize("kf, vf, B, Hq, Hkv, Nq, D, seqlens, page, dtype, exact, causal, opts", CASES, ids=IDS)
def test_against_dequantized_oracle(kf, vf, B, Hq, Hkv, Nq, D, seqlens, page, dtype, exact, causal, opts):
    case = Case(B, Hq, Hkv, Nq, D, kf, vf, seqlens, page, dtype, exact, seed=hash((kf, vf, Nq, D)) % 1000)
    options = dict(opts)
    if options.pop("sinks", False):
        options["sinks"] = torch.randn(Hq, generator=torch.Generator().manual_seed(3)) + 2
    before = counts()
    impl = "direct" if kf.startswith("native") else "auto"
    out, lse = case.run(causal, impl=impl, **options)
    after = counts()
    assert after[FMT_INDEX[kf]] == before[FMT_INDEX[kf]] + 1
    assert after[6 + FMT_INDEX[vf]] == before[6 + FMT_INDEX[vf]] + 1
    check(case, out, lse, causal, **options)


@pytest.mark.parametrize("splits", [3, 7])
def test_split_keys(monkeypatch, splits):
    """The split path (forced: few work units, as decode at batch 1) merges splits through their lse."""
    monkeypatch.setenv("FLASH_METAL_KVQ_SPLITS", str(splits))
    case = Case(2, 4, 2, 2, 64, "q4", "int8", [333, 64], 16, torch.float32, seed=splits)
    sinks = torch.randn(4) * 2
    before = counts()
    out, lse = case.run(True, sinks=sinks, window_left=200)
    assert counts()[12] == before[12] + 1
    check(case, out, lse, True, sinks=sinks, window_left=200)


def test_auto_split_long_decode():
    """Batch 1, one kv head, 2k keys: the heuristic itself splits (no env)."""
    case = Case(1, 4, 1, 1, 64, "int8", "fp8_e4m3", [2100], 128, torch.float32, seed=5)
    before = counts()
    out, lse = case.run(False)
    assert counts()[12] == before[12] + 1  # 1 tile < 4 per thread, 2100 keys >= 2 x 512
    check(case, out, lse)


@pytest.mark.parametrize("packing, scale_dtype, group_size", [("uint8", torch.float16, 32),
                                                               ("uint32", torch.bfloat16, 128)])
def test_q4_packings_and_scale_dtypes(packing, scale_dtype, group_size):
    case = Case(2, 4, 2, 1, 128, "q4", "q4", [90, 31], 8, torch.float32, seed=9, group_size=group_size,
                packing=packing, scale_dtype=scale_dtype)
    out, lse = case.run(True)
    check(case, out, lse, True)


def test_packed_queries():
    """cu_seqlens_q (flash_attn_varlen_func's paged prefill): q packed (total_q, Hq, D)."""
    case = Case(3, 4, 2, 1, 64, "int8", "q4", [50, 0, 90], 16, torch.float32, seed=11)
    nq = [3, 2, 5]
    g = torch.Generator().manual_seed(12)
    qs = [torch.randn(n, 4, 64, generator=g) for n in nq]
    cu = torch.tensor([0, 3, 5, 10], dtype=torch.int32)
    k, v = case.sides["k"], case.sides["v"]
    out, lse = flash_metal.attention_kvcache_with_lse(torch.cat(qs), k[1], v[1], case.lens, case.table, True,
                                                      cu_seqlens_q=cu, max_seqlen_q=5, **case.kwargs())
    assert out.shape == (10, 4, 64) and lse.shape == (4, 10)
    for b, n in enumerate(case.seqlens):
        o, l = out[cu[b]:cu[b + 1]].transpose(0, 1)[None], lse[:, cu[b]:cu[b + 1]][None]
        if n == 0:
            assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(l).all()
            continue
        kr, vr = case.reference_kv(b)
        assert_attention_close(o, l, qs[b].transpose(0, 1)[None], kr, vr, True)


# ---------------------------------------------------------------- planted bugs


def _q4_case():
    return Case(1, 4, 2, 1, 128, "q4", "q4", [150], 16, torch.float32, seed=21)


def _buggy_reference(case, side, bug):
    """Sequence 0's (k, v) for the oracle, with `side`'s dequantization carrying `bug`."""
    B, n = 1, case.seqlens[0]
    fmt, codes, scale, bias, ref, x = case.sides[side]
    # The plain cache's codes / scales (rows 0..n-1 of sequence 0), read back through the table.
    t = case.table[0]
    rows = [(int(t[r // case.page]), r % case.page) for r in range(n)]
    c = torch.stack([codes.view(torch.int32)[b, r] for b, r in rows]).view(torch.uint32)
    s = torch.stack([scale[b, r] for b, r in rows]).float()
    bi = torch.stack([bias[b, r] for b, r in rows]).float()
    q = _unpack_q4(c).float()
    if bug == "nibbles swapped":
        q = torch.stack((q[..., 1::2], q[..., 0::2]), -1).flatten(-2)
    if bug == "wrong group's scale":
        s = s.roll(1, dims=-1)
    if bug == "zero point ignored":
        bi = torch.zeros_like(bi)
    G = s.shape[-1]
    deq = (q.reshape(*q.shape[:-1], G, -1) * s[..., None] + bi[..., None]).flatten(-2)
    k, v = case.reference_kv(0)
    bad = deq[None].transpose(1, 2)
    return (bad, v) if side == "k" else (k, bad)


@pytest.mark.parametrize("bug", ["nibbles swapped", "wrong group's scale", "zero point ignored"])
@pytest.mark.parametrize("side", ["k", "v"])
def test_planted_bug_is_caught(bug, side):
    case = _q4_case()
    out, lse = case.run(False)
    check(case, out, lse)  # the kernel agrees with the right reading...
    k, v = _buggy_reference(case, side, bug)
    failed = [c for c in attention_errors(out, lse, case.q, k, v) if not c.ok]
    assert failed, f"a kernel with '{bug}' on {side} would pass this check"  # ...and not with the buggy one


# ---------------------------------------------------------------- bad input


def _args():
    case = Case(1, 4, 2, 1, 64, "int8", "q4", [20], 16, torch.float32, seed=31)
    k, v = case.sides["k"], case.sides["v"]
    return case, dict(q=case.q, k_cache=k[1], v_cache=v[1], cache_seqlens=case.lens, block_table=case.table,
                      k_scale=k[2], k_bias=None, v_scale=v[2], v_bias=v[3])


def _call(**a):
    return torch.ops.flash_metal.attention_kvcache(
        a["q"], a["k_cache"], a["v_cache"], a["cache_seqlens"], a["block_table"], k_scale=a["k_scale"],
        k_bias=a["k_bias"], v_scale=a["v_scale"], v_bias=a["v_bias"], k_format=a.get("k_format", "auto"),
        v_format=a.get("v_format", "auto"))


@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(k_scale=None), "k_scale is missing"),
    (lambda a: a.update(k_scale=a["k_scale"][:, :, :1]), "k_scale must have shape"),
    (lambda a: a.update(k_scale=a["k_scale"].double()), "k_scale must be float32"),
    (lambda a: a.update(k_bias=a["k_scale"]), "k_bias was given but int8 is symmetric"),
    (lambda a: a.update(v_bias=None), "v_bias is missing"),
    (lambda a: a.update(v_scale=a["v_scale"][..., :0]), "v_scale must have shape"),
    (lambda a: a.update(v_bias=a["v_bias"][:, :, :1]), "v_bias must have v_scale's shape"),
    (lambda a: a.update(v_cache=a["v_cache"][..., :6].contiguous()), "do not divide head_dim 48|group size"),
    (lambda a: a.update(v_cache=a["v_cache"][..., :2].contiguous()), r"group size 16 \(head_dim 16 / 1 groups"),
    (lambda a: a.update(v_cache=a["v_cache"].view(torch.int32)), "int32; a 4-bit cache is uint32"),
    (lambda a: a.update(k_format="q4"), "k_format='q4' does not match k_cache's dtype"),
    (lambda a: a.update(k_format="int4"), "k_format='int4' is not a KV cache format"),
    (lambda a: a.update(k_cache=a["k_cache"].float(), k_scale=a["k_scale"]), "k_scale was given but k_cache"),
    (lambda a: a.update(k_cache=a["k_cache"].to(torch.float8_e4m3fn), k_scale=torch.ones(3, 2)),
     r"k_scale \(the descale\) must have shape \(batch, kv_heads\) = \(1, 2\)"),
    (lambda a: a.update(k_cache=a["k_cache"][..., ::2]), "k_cache's last dim must be contiguous|head_dim"),
])
def test_bad_arguments(change, match):
    _, a = _args()
    change(a)
    with pytest.raises((ValueError, TypeError), match=match):
        _call(**a)


def test_mismatched_head_dim_names_the_cache():
    _, a = _args()
    a["q"] = a["q"][..., :32].contiguous()
    with pytest.raises(ValueError, match="k_cache has head_dim 64 but q has head_dim 32"):
        _call(**a)


def test_no_backward():
    case, a = _args()
    q = a["q"].clone().requires_grad_()
    with pytest.raises(ValueError, match="quantized cache has no backward"):
        flash_metal.attention_kvcache_with_lse(q, a["k_cache"], a["v_cache"], a["cache_seqlens"], a["block_table"],
                                               **case.kwargs())


def test_opcheck_and_compile():
    """The schema, the fake (a 4-bit v_cache's logical head dim) and torch.compile agree with the kernel."""
    case = Case(2, 4, 2, 1, 64, "int8", "q4", [30, 17], 16, torch.float32, seed=41)
    k, v = case.sides["k"], case.sides["v"]
    args = (case.q, k[1], v[1], case.lens, case.table)
    kwargs = dict(causal=True, k_scale=k[2], v_scale=v[2], v_bias=v[3])
    torch.library.opcheck(torch.ops.flash_metal.attention_kvcache.default, args, kwargs)
    compiled = torch.compile(lambda *a: torch.ops.flash_metal.attention_kvcache(*a, **kwargs), fullgraph=True)
    out, lse = compiled(*args)
    check(case, out, lse, True)


# Every K x V format pair, decode and chunked prefill, paged and plain, 16-bit and float32 q: an opt-in grid
# (FLASH_METAL_KVQ_WIDE=1; 72 cases, about 3 s on 2 cores), the CASES above being its fast subset.
WIDE = [(kf, vf, nq, page, dtype) for kf in FMTS[3:] for vf in FMTS[3:] for nq in (1, 33) for page in (None, 5)
        for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.skipif(os.environ.get("FLASH_METAL_KVQ_WIDE") != "1", reason="wide grid: set FLASH_METAL_KVQ_WIDE=1")
@pytest.mark.parametrize("kf, vf, nq, page, dtype", WIDE)
def test_wide_grid(kf, vf, nq, page, dtype):
    exact = dtype != torch.float32
    case = Case(2, 6, 2, nq, 64, kf, vf, [70, 41], page, dtype, exact, seed=nq + (page or 0))
    out, lse = case.run(True, window_left=30 if nq == 1 else -1)
    check(case, out, lse, True, window_left=30 if nq == 1 else -1)
