"""The quantized-KV decode kernels on Metal (issue 44), through the emulator's sanitizing build.

flash_decode_quant / flash_decode_quant_split (shaders/decode/attention_decode_quant.h)
read int8, 4-bit (MLX affine, uint32 or uint8 packing, groups of 32 / 64 /
128, float32, float16 or bfloat16 scales) and float8_e4m3fn (descale per
(B, Hkv) or per tensor) caches in place and dequantize in registers; K and
V may differ, and either may stay in q's dtype. Each case builds a cache in
its format with tests/kvq_cases.py (paged and shuffled, or plain; rows past
each sequence poisoned: NaN scales and biases, fp8 NaN codes), runs the
launches the planner makes for attention_kvcache on it (the "quantized
decode" row, csrc/metal/families/decode_quant.cpp; bound as the MPS host
binds them: tests/backends.py emulated_metal_kvcache) with NaN-poisoned
outputs, and holds every sequence to the 2x rule against float64 attention
over the *dequantized* cache (the quantization error is the format's, not
the kernel's).

Also: the K/V bytes the emulator counts drop by each format's ratio against
the cache in float16, and three planted 4-bit bugs (a scale from the wrong
group, nibbles swapped, the zero point ignored), switched on by function
constants in a patched copy of the shaders, each fail the same check.
"""
import shutil

import pytest
import torch

import backends
import flash_metal
from backends import emulated_metal_kvcache
from kvq_cases import Case
from numerics import assert_attention_close
from repo_paths import ROOT_DIR


def run_quant(case, causal=False, impl="auto", library=None, planted=None, **options):
    """attention_kvcache's Metal plan on `case`, emulated and sanitized: (out, lse, counts, kernel names).

    library / planted: a patched build and its planted switches (test_planted_bugs)."""
    k, v = case.sides["k"], case.sides["v"]
    out, lse = emulated_metal_kvcache(case.q, k[1], v[1], case.lens, case.table, causal, None, impl,
                                      instrumented=library is None, k_scale=k[2], k_bias=k[3], v_scale=v[2],
                                      v_bias=v[3], library=library, extra_constants=planted, **options)
    ran = list(backends.LAST_DISPATCHES)
    return out, lse, [c for _, c in ran], [d.kernel_name for d, _ in ran]


def check(case, out, lse, causal=False, **options):
    """Every sequence by the 2x rule against float64 attention over its dequantized keys and values."""
    for b, n in enumerate(case.seqlens):
        k, v = case.reference_kv(b)
        assert_attention_close(out[b:b + 1], lse[b:b + 1], case.q[b:b + 1], k, v, causal, **options)


# (K format, V format, B, Hq, Hkv, Nq, D, seqlens, page, q dtype, causal, options, Case extras, impl)
CASES = [
    ("int8", "int8", 2, 8, 2, 1, 128, [150, 57], 16, torch.float32, False, {}, {}, "decode"),
    ("q4", "q4", 2, 4, 2, 2, 64, [70, 33], 16, torch.float16, True, {}, {"group_size": 32}, "decode"),
    ("q4", "q4", 1, 4, 1, 1, 64, [140], None, torch.bfloat16, False, {"softcap": 4.0},
     {"group_size": 64, "packing": "uint8"}, "decode_split"),
    ("q4", "int8", 1, 2, 1, 1, 128, [90], 32, torch.float16, True, {"window_left": 40},
     {"group_size": 128, "scale_dtype": torch.float16}, "decode"),
    ("fp8_e4m3", "fp8_e4m3", 2, 4, 2, 1, 64, [45, 100], 8, torch.float16, False, {"sinks": True}, {},
     "decode_split"),
    ("fp8_e4m3", "native-float16", 1, 4, 2, 1, 64, [66], None, torch.float16, False, {}, {"per_tensor": True},
     "decode"),
    ("int8", "q4", 2, 8, 2, 1, 128, [64, 129], 16, torch.float32, True, {},
     {"group_size": 64, "scale_dtype": torch.bfloat16, "outliers": True}, "decode_split"),
]
IDS = ["int8-gqa-f32", "q4g32-causal-nq2-f16", "q4g64-uint8-plain-softcap-split-bf16",
       "q4g128-half-scales-k-int8v-window", "fp8-head-sinks-split", "fp8-tensor-k-native-v-plain",
       "int8k-q4v-bf16-scales-outliers-split"]


def make_case(kf, vf, B, Hq, Hkv, Nq, D, seqlens, page, dtype, extras, seed):
    extras = dict(extras)
    per_tensor = extras.pop("per_tensor", False)
    case = Case(B, Hq, Hkv, Nq, D, kf, vf, seqlens, page, dtype, seed=seed, **extras)
    if per_tensor:  # one descale for K's whole tensor (a plain cache): the reference dequantized through it
        assert page is None
        fmt, codes, scale, bias, ref, x = case.sides["k"]
        one = scale.flatten()[:1].clone()
        case.sides["k"] = (fmt, codes, one, bias, flash_metal.dequantize_kv(codes, one), x)
    return case


@pytest.mark.parametrize("kf,vf,B,Hq,Hkv,Nq,D,seqlens,page,dtype,causal,opts,extras,impl", CASES, ids=IDS)
def test_against_dequantized_oracle(kf, vf, B, Hq, Hkv, Nq, D, seqlens, page, dtype, causal, opts, extras, impl):
    case = make_case(kf, vf, B, Hq, Hkv, Nq, D, seqlens, page, dtype, extras, seed=sum(map(ord, kf + vf)) + D)
    options = dict(opts)
    if options.get("sinks"):
        options["sinks"] = torch.randn(Hq)
    out, lse, counts, names = run_quant(case, causal, impl, **options)
    # The planner's quantized row planned the quantized kernels (and the native merge after a split).
    t = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    bucket = 64 if D <= 64 else 128
    split = impl == "decode_split"
    assert names == ([f"flash_decode_quant_split_{t}_d{bucket}", f"flash_decode_merge_{t}_d{bucket}"] if split
                     else [f"flash_decode_quant_{t}_d{bucket}"]), names
    assert names[0] in backends.quant_decode_library(True, f"{t}_d{bucket}").dispatched_names()
    k, v = case.sides["k"], case.sides["v"]
    plan = flash_metal.explain(case.q, k[1], v[1], causal, None, impl, block_table=case.table,
                               cache_seqlens=case.lens, k_scale=k[2], k_bias=k[3], v_scale=v[2], v_bias=v[3],
                               **options)
    assert "quantized decode: took the call" in plan.families and plan.reason.count("quantized decode: k "), plan
    check(case, out, lse, causal, **options)


def test_kv_bytes_drop_by_the_format_ratio():
    """The emulator's unique bytes per format: K quantized beside V in float16 (the baseline, read by the
    same kernel), D = 128, 96 keys, 2 kv heads: each K/V byte once per (batch, kv head)."""
    keys, hkv, D = 96, 2, 128
    ratios = {}
    for fmt, extras, codes_per_row, scale_bytes in (
            ("int8", {}, D, 4),                                                     # a float32 scale per token
            ("fp8_e4m3", {}, D, 0),                                                 # a descale per kv head
            ("q4", {"group_size": 64, "scale_dtype": torch.float16}, D // 2, 2 * 2 * 2)):  # scale + bias, half
        case = Case(1, 2, hkv, 1, D, fmt, "native-float16", [keys], None, torch.float16, seed=3, **extras)
        out, lse, counts, names = run_quant(case, impl="decode")
        check(case, out, lse)
        assert names == ["flash_decode_quant_float16_d128"], names
        u = counts[0].device_unique_bytes_read_by_index
        assert u[2] == keys * hkv * D * 2, u  # V in float16: the baseline
        assert u[1] == keys * hkv * codes_per_row, (fmt, u)
        scales = u.get(21, 0) + (u.get(22, 0) if fmt == "q4" else 0)
        assert scales == (keys * hkv * scale_bytes if fmt != "fp8_e4m3" else hkv * 4), (fmt, u)
        ratios[fmt] = u[2] / (u[1] + scales)
    assert 1.9 < ratios["int8"] < 2.0 and 1.99 < ratios["fp8_e4m3"] <= 2.0, ratios
    assert 3.5 < ratios["q4"] < 3.6, ratios  # 64 code bytes + 8 of scales per 256


def test_planted_bugs(tmp_path):
    """Three 4-bit bugs, each behind a function constant in a patched copy of the shaders: each fails the check."""
    shutil.copytree(f"{ROOT_DIR}/shaders", tmp_path / "shaders")
    h = tmp_path / "shaders" / "decode" / "attention_decode_quant.h"
    src = h.read_text()
    patches = [
        ("constant bool fc_k_int8 [[function_constant(15)]];",
         "constant bool fc_k_int8 [[function_constant(15)]];\n"
         "constant bool fc_plant_group [[function_constant(28)]];\n"
         "constant bool fc_plant_nibble [[function_constant(29)]];\n"
         "constant bool fc_plant_bias [[function_constant(30)]];"),
        ("const int64_t g = sat + (f >> group_shift);",
         "const int64_t g = sat + ((f >> group_shift) ^ (fc_plant_group ? 1 : 0));"),  # the neighbour group's
        ("float((f & 1) ? (b >> 4) : (b & 0xFu))", "float(((f & 1) != int(fc_plant_nibble)) ? (b >> 4) : (b & 0xFu))"),
        ("decode_quant_scale(bias, g, scale_half(), scale_bf16()));",
         "fc_plant_bias ? 0.0f : decode_quant_scale(bias, g, scale_half(), scale_bf16()));"),
    ]
    for old, new in patches:
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    h.write_text(src)
    from metal_emulator import compile_library

    lib = compile_library([str(tmp_path / "shaders" / "attention.metal")], only=("flash_decode_quant_float16_d64",))
    case = Case(1, 4, 2, 1, 64, "q4", "q4", [80], 16, torch.float16, seed=21, group_size=32)
    off = {28: False, 29: False, 30: False}
    out, lse, *_ = run_quant(case, False, "decode", library=lib, planted=off)
    check(case, out, lse)  # the patched kernel with every bug off agrees...
    for index in off:
        out, lse, *_ = run_quant(case, False, "decode", library=lib, planted={**off, index: True})
        with pytest.raises(AssertionError):
            check(case, out, lse)  # ...and each bug on fails the same check


@pytest.mark.parametrize("impl", ["decode", "decode_split"])
def test_binding_table_matches_the_kernel_signature(impl):
    """The plan's binding table (what the MPS host binds) names each quantized kernel's [[buffer(n)]]."""
    from metal_emulator import _prepass

    case = Case(1, 4, 2, 1, 64, "int8", "q4", [40], 16, torch.float16, seed=9, group_size=32)
    k, v = case.sides["k"], case.sides["v"]
    plan = flash_metal.explain(case.q, k[1], v[1], False, None, impl, block_table=case.table,
                               cache_seqlens=case.lens, k_scale=k[2], v_scale=v[2], v_bias=v[3])
    lib = backends.quant_decode_library(True, "float16_d64")
    names = {"q": "q", "k": "k", "v": "v", "out": "o", "lse": "lse", "partial_out": "partial_o",
             "partial_stats": "partial_stats", "attn_mask": "mask", "cu_seqlens_q": "cu_seqlens_q",
             "cu_seqlens_k": "cu_seqlens_k", "sinks": "sinks", "block_table": "block_table",
             "cache_seqlens": "cache_seqlens", "k_scale": "k_scale", "k_bias": "k_bias", "v_scale": "v_scale",
             "v_bias": "v_bias"}
    for d in plan.dispatches:
        buffers = {p.index: p.name for p in lib.signature(d.kernel_name) if p.role == _prepass.ROLE_BUFFER}
        expected = {i: names[t] for t, i in d.buffers.items()}
        expected[d.params_index] = "p"
        if d.quant_params_index:
            expected[d.quant_params_index] = "qp"
            assert d.quant_params.numel() == 56  # KvQuantParams (shaders/common/params.h)
        assert buffers == expected, d.kernel_name
