"""Decode above head dim 256 on Metal (issue 20 sections 2/3): the model's
verdict on the fused decode in the decode-only buckets 512 and 576
(benchmarks/model/families/decode_wide.py), that the closed-form counts it
prices are the kernels' own (the instrumented emulator's), and that the
planner quotes the verdict's figure."""
import os
import re
import sys

import pytest
import torch

import backends
import flash_metal
from numerics import assert_attention_close
from repo_paths import ROOT_DIR

# benchmarks/ is a package at the repository root, not installed: put the root on the path.
sys.path.insert(0, ROOT_DIR)
from benchmarks.model.families import decode_wide as W  # noqa: E402


@pytest.mark.parametrize("shape", [(1, 16, 1, 1, 200, 576, 512, "decode"), (2, 4, 2, 2, 300, 512, 512, "decode_split")],
                         ids=["mla-one-pass", "gemma-split"])
def test_closed_form_counts_are_the_emulators(shape):
    # The fused side's bytes (K, V once per threadgroup; out, lse or the partials written) are what the
    # kernels move in the instrumented emulator, exactly.
    b, hq, hkv, nq, nk, dqk, dv, impl = shape
    g = torch.Generator().manual_seed(nk)
    # bfloat16: the sanitizing wide library's dtype (tests/backends.py SANITIZED_WIDE_DECODE_KERNELS); 2 bytes
    # an element, as the model's f16 / bf16 rows price.
    q = torch.randn(b, hq, nq, dqk, generator=g).bfloat16()
    k = torch.randn(b, hkv, nk, dqk, generator=g).bfloat16()
    v = torch.randn(b, hkv, nk, dv, generator=g).bfloat16()
    out, lse = backends.emulated_metal_attention(q, k, v, False, None, impl, instrumented=True)
    assert_attention_close(out, lse, q, k, v)
    plan = flash_metal.explain(q, k, v, False, None, impl)
    assert all(d.kernel_name.endswith(f"_d{512 if dqk == 512 else 576}") for d in plan.dispatches)
    for d, counts in backends.LAST_DISPATCHES:
        want = W.fused_counts(d, b, hq, hkv, nq, nk, dqk, dv, 2)
        if d.kernel_name.startswith("flash_decode_merge_"):
            continue
        assert counts.threadgroups == want["threadgroups"]
        for name in ("k", "v"):
            i = d.buffers[name]
            assert counts.device_unique_bytes_read_by_index[i] == want["dram_" + name], (name, counts)
            assert counts.device_bytes_read_by_index[i] == want["read_" + name], (name, counts)
        writes = {"out": b * hq * nq * dv * 2, "lse": b * hq * nq * 4} if len(plan.dispatches) == 1 else \
            {"partial_out": b * hq * nq * d.grid[2] * dv * 4, "partial_stats": b * hq * nq * d.grid[2] * 8}
        for name, n in writes.items():
            assert counts.device_bytes_written_by_index[d.buffers[name]] == n, name


def test_fused_decode_is_predicted_ahead_where_it_is_routed():
    # The gate. Up to 16 query rows per kv head (MLA with 16 heads at one token, Gemma-like GQA 2:1
    # at Nq 1 and 8), the fused decode's slow end beats the composite path it replaces (the ATen ops
    # csrc/composite.cpp runs) at every context, chip and dtype, by at least the factor explain() quotes
    # (csrc/metal/families/wide_decode.cpp kWideDecodeLeastSpeedup). At 128 rows (MLA's 128 heads, or 16 heads x 8
    # rows) each row's SIMD-group pulls every K/V row through L1 ("on-core data") and the composite path is
    # ahead on some chip at every context: those stay composite (kWideDecodeMaxRows).
    rows = W.table()
    assert len(rows) == len(W.MODELS) * len(W.QUERY_ROWS) * len(W.CONTEXTS) * len(W.DTYPES) * len(W.CHIPS)
    routed = [r for r in rows if r[2] // r[3] * r[6] <= W.ROUTED_ROWS]
    kept = [r for r in rows if r[2] // r[3] * r[6] > W.ROUTED_ROWS]
    assert routed and kept
    for row in routed:
        (lo, pt, hi), composite = row[10], row[13]
        assert hi < composite, row
    for key in {(r[0], r[6], r[7]) for r in kept}:
        assert any(r[13] < r[10][1] for r in kept if (r[0], r[6], r[7]) == key), key
    least = min(r[13] / r[10][1] for r in routed)
    # ... and the planner routes such a decode to the fused kernels quoting the least speedup.
    q = torch.empty(1, 16, 1, 576, dtype=torch.float16)
    kv = torch.empty(1, 1, 4096, 576, dtype=torch.float16)
    plan = flash_metal.explain(q, kv, kv[..., :512], False)
    assert plan.dispatches and plan.dispatches[0].kernel_name.startswith("flash_decode")
    m = re.search(r"predicted at least ([\d.]+)x faster than the composite path", plan.reason)
    assert m, plan.reason
    assert least >= float(m.group(1)), least
