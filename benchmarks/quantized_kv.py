"""Decode from a quantized KV cache on CPU (issue 44): each format against a float16 cache.

    python -m benchmarks.quantized_kv [--quick] [--threads N] [--keys 4096,32768] [--batches 5]

One decode step (B = 1, one query) of a Llama-3-8B attention layer (32
query heads, 8 kv heads, D = 128) against Nk cached keys, per cache:

    float16       flash_attn_with_kvcache on a float16 cache (the route a
                  user gets today: on CPU the varlen kernel reads it in place)
    float16-direct the float16 cache through the quantized-cache kernel itself
                  (impl='direct'): the same loop, reading 2 bytes per element
    int8 / q4 / fp8_e4m3  the quantized cache read in place (K and V alike;
                  q4 with groups of 64, MLX's default)
    dequant-then-attend  per format: dequantize_kv to float16, then the
                  float16 route (what transformers' QuantizedCache and
                  mlx-lm do today: a full float16 copy per step)

Every call is checked against float64 attention over the dequantized cache
at the first size before timing. All cases of one size are timed in the
same run, interleaved batch by batch (median of --batches), and reported as
speed-ups over the float16 cache and over dequantize-then-attend, with the
bytes each step reads from the cache (codes plus scales). A separate table
gives each format's end-to-end error against the float cache on keys with
outlier channels (a few dims of large, stable magnitude, as real keys have).
Writes results/quantized_kv_cpu.csv. Say which CPU: the table's header does.
"""
import argparse
import statistics
import sys
import time

import torch

from . import harness as H

FORMATS = ["int8", "q4", "fp8_e4m3"]
COLUMNS = ["keys", "case", "ms", "speedup_vs_float16", "speedup_vs_dequant", "cache_MiB_per_step"]


def _quant(x, fmt):
    import flash_metal
    return flash_metal.quantize_kv(x, fmt, per="tensor") if fmt == "fp8_e4m3" else flash_metal.quantize_kv(x, fmt)


def _bytes(r):
    return sum(t.numel() * t.element_size() for t in (r.codes, r.scale, r.bias) if t is not None)


def cases_for(n_keys, g, check):
    import flash_metal
    B, Hq, Hkv, D = 1, 32, 8, 128
    k = torch.randn(B, n_keys, Hkv, D, generator=g).to(torch.float16)
    v = torch.randn(B, n_keys, Hkv, D, generator=g).to(torch.float16)
    q = torch.randn(B, 1, Hq, D, generator=g).to(torch.float16)
    lens = torch.full((B,), n_keys, dtype=torch.int32)
    qt = q.transpose(1, 2)
    cases = {"float16": (lambda: flash_metal.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens),
                         2 * k.numel() * 2),
             "float16-direct": (lambda: flash_metal.attention_kvcache_with_lse(qt, k, v, lens, impl="direct")[0],
                                2 * k.numel() * 2)}
    for fmt in FORMATS:
        kr, vr = _quant(k.float(), fmt), _quant(v.float(), fmt)
        kw = dict(k_scale=kr.scale, k_bias=kr.bias, v_scale=vr.scale, v_bias=vr.bias)
        fn = (lambda kr=kr, vr=vr, kw=kw: flash_metal.attention_kvcache_with_lse(qt, kr.codes, vr.codes, lens,
                                                                                 **kw)[0])
        deq = (lambda kr=kr, vr=vr: flash_metal.flash_attn_with_kvcache(
            q, flash_metal.dequantize_kv(kr.codes, kr.scale, kr.bias, dtype=torch.float16),
            flash_metal.dequantize_kv(vr.codes, vr.scale, vr.bias, dtype=torch.float16), cache_seqlens=lens))
        cases[fmt] = (fn, _bytes(kr) + _bytes(vr))
        cases[f"{fmt}-dequant-then-attend"] = (deq, _bytes(kr) + _bytes(vr))
        if check:
            from flash_metal.testing import assert_attention_close
            kd = flash_metal.dequantize_kv(kr.codes, kr.scale, kr.bias).transpose(1, 2)
            vd = flash_metal.dequantize_kv(vr.codes, vr.scale, vr.bias).transpose(1, 2)
            out, lse = flash_metal.attention_kvcache_with_lse(qt.float(), kr.codes, vr.codes, lens, **kw)
            assert_attention_close(out, lse, qt.float(), kd, vd)
    return cases


def end_to_end_errors(g):
    """Per format: max |out - out_float| / max |out_float| on keys with outlier channels (float32 q)."""
    import flash_metal
    B, Hq, Hkv, D, n = 1, 8, 2, 128, 2048
    k = torch.randn(B, n, Hkv, D, generator=g)
    ch = torch.randperm(D, generator=g)[:4]
    k[..., ch] = k[..., ch] * 8 + 12  # outlier channels, stable across tokens
    v = torch.randn(B, n, Hkv, D, generator=g)
    q = torch.randn(B, Hq, 1, D, generator=g)
    lens = torch.full((B,), n, dtype=torch.int32)
    ref = flash_metal.attention_kvcache_with_lse(q, k, v, lens, impl="direct")[0]
    rows = []
    for fmt in FORMATS + ["q4-g32"]:
        f, gs = ("q4", 32) if fmt == "q4-g32" else (fmt, 64)
        kr = flash_metal.quantize_kv(k, f, group_size=gs) if f == "q4" else _quant(k, f)
        vr = flash_metal.quantize_kv(v, f, group_size=gs) if f == "q4" else _quant(v, f)
        out = flash_metal.attention_kvcache_with_lse(q, kr.codes, vr.codes, lens, k_scale=kr.scale, k_bias=kr.bias,
                                                     v_scale=vr.scale, v_bias=vr.bias)[0]
        rows.append((fmt, (out - ref).abs().max().item() / ref.abs().max().item()))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4k and 32k keys only")
    ap.add_argument("--keys", default=None, help="comma-separated key counts (default 4096,8192,32768,131072)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--no-dequant-above", type=int, default=32768,
                    help="skip dequantize-then-attend above this many keys (it is 10x slower)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    H.set_threads(args.threads)
    meta = H.machine_metadata("cpu")
    keys = [int(x) for x in args.keys.split(",")] if args.keys else \
        ([4096, 32768] if args.quick else [4096, 8192, 32768, 131072])
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"# CPU: {meta['cpu']} | {meta['cpu_isa']} | torch threads {meta['torch_threads']} | "
          f"load {meta.get('loadavg_1m_at_start', '?')}")
    for i, n in enumerate(keys):
        cases = cases_for(n, g, check=(i == 0))
        if n > args.no_dequant_above:
            cases = {c: f for c, f in cases.items() if "dequant" not in c}
        samples = {c: [] for c in cases}
        iters = {c: H.calibrate(fn, lambda: None, batch_s=0.15) for c, (fn, _) in cases.items()}
        for _ in range(args.batches):  # interleaved: every case once per round
            for c, (fn, _) in cases.items():
                samples[c].append(H.time_batch(fn, lambda: None, iters[c]) * 1e3)
        ms = {c: statistics.median(s) for c, s in samples.items()}
        for c, (_, nbytes) in cases.items():
            base = c.split("-dequant")[0]
            deq = ms.get(f"{base}-dequant-then-attend") if c in FORMATS else None
            rows.append(dict(keys=n, case=c, ms=round(ms[c], 3), speedup_vs_float16=round(ms["float16"] / ms[c], 2),
                             speedup_vs_dequant=round(deq / ms[c], 2) if deq else "",
                             cache_MiB_per_step=round(nbytes / 2 ** 20, 1)))
        print(H.format_table(COLUMNS, [[r[c] for c in COLUMNS] for r in rows if r["keys"] == n]), flush=True)
    print("\n# end-to-end error against the float cache (keys with outlier channels; max|diff| / max|out|)")
    errs = end_to_end_errors(g)
    print(H.format_table(["format", "rel_error"], [[f, f"{e:.2e}"] for f, e in errs]))
    H.finish_metadata(meta, t_start)
    out = H.Path(__file__).parent / "results" / "quantized_kv_cpu.csv"
    H.write_csv(out, meta, rows, COLUMNS)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
