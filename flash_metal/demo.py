"""A short demo: flash_metal.attention on random inputs of a realistic size.

    python -m flash_metal.demo [--device cpu|mps] [--dtype float32|float16|bfloat16]

Runs one LLM-sized causal attention (batch 1, 8 heads, 2048 tokens, head dim
64, grouped 8:2), checks it against a float64 reference, and times it against
torch.nn.functional.scaled_dot_product_attention on the same device.
"""
import argparse
import statistics
import time

import torch

import flash_metal
from flash_metal.reference import attention_reference


def _sync(device):
    if device == "mps":
        torch.mps.synchronize()


def _time_ms(fn, device, repeats=7):
    fn()  # warm-up
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None):
    default_device = "mps" if torch.backends.mps.is_available() else "cpu"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=default_device, choices=["cpu", "mps"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    B, Hq, Hkv, N, D = 1, 8, 2, args.seq, 64

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, N, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    dq, dk, dv = (t.to(args.device) for t in (q, k, v))

    out = flash_metal.attention(dq, dk, dv, causal=True)
    ref, _ = attention_reference(q, k, v, causal=True)
    err = (out.cpu().double() - ref).abs().max().item()

    kr, vr = dk.repeat_interleave(Hq // Hkv, 1), dv.repeat_interleave(Hq // Hkv, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_err = (sdpa(dq, kr, vr, is_causal=True).cpu().double() - ref).abs().max().item()
    t_flash = _time_ms(lambda: flash_metal.attention(dq, dk, dv, causal=True), args.device)
    t_sdpa = _time_ms(lambda: sdpa(dq, kr, vr, is_causal=True), args.device)

    print(f"flash_metal demo on {args.device} ({torch.get_num_threads()} threads), {args.dtype}, causal, "
          f"q ({B}, {Hq}, {N}, {D}), k/v ({B}, {Hkv}, {N}, {D})")
    print(f"  max |error| vs float64 reference: flash_metal {err:.2e}, SDPA {sdpa_err:.2e}")
    print(f"  median time: flash_metal {t_flash:.2f} ms, SDPA {t_sdpa:.2f} ms "
          f"(flash_metal is {t_sdpa / t_flash:.2f}x SDPA's speed)")
    if args.device != "cpu":
        print("  kernel:", flash_metal.explain(dq, dk, dv, causal=True).reason)


if __name__ == "__main__":
    main()
