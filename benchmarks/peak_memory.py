"""Peak extra memory of one attention call, measured in a fresh process.

    python benchmarks/peak_memory.py --impl flash --n 16384 --d 64 [--causal] [--backward] [--window W]

Prints one JSON line: {"impl", "n", "d", "input_bytes", "peak_extra_bytes",
"nxn_float32_bytes"}. "Extra" is the growth of the process's peak resident
memory during the call, after the inputs exist and the op has been warmed up
on a tiny problem, so it counts the outputs and every temporary. With
--backward the call is forward + backward (q, k, v require grad; the loss is
sum(out * w) for a fixed random w), so it also counts what autograd saves
for the backward, the three gradients and the backward's temporaries. On Linux the
peak is reset just before the call by writing 5 to /proc/self/clear_refs
(resets VmHWM); elsewhere the measurement is unavailable and the script says so.

--window W: a sliding window (window_left = W; flash_metal's window, SDPA's
and explicit's band mask), with "seconds" the call's wall time, to show the
cost growing with N * W.

Used by benchmarks (the memory table) and by tests/cpu/test_memory.py.
"""
import argparse
import json
import os
import sys
import time

import torch


def _vm_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _band(n, causal, window):
    # True = attend: the window's band (and causality) as a dense N x N mask.
    i = torch.arange(n)
    keep = i[None, :] >= i[:, None] - window
    return keep & (i[None, :] <= i[:, None]) if causal else keep & (i[None, :] <= i[:, None] + window)


def _explicit(q, k, v, causal, window):
    # The post's explicit PyTorch attention: materializes S and P (N x N).
    S = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    n = q.shape[-2]
    if window >= 0:
        S = S.masked_fill(~_band(n, causal, window), float("-inf"))
    elif causal:
        S = S.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(S, dim=-1) @ v


def _runner(impl):
    if impl == "flash":
        import flash_metal

        def flash(q, k, v, causal, window):
            right = -1 if causal or window < 0 else window
            return flash_metal.attention(q, k, v, causal=causal, window_left=window, window_right=right)

        return flash
    if impl == "sdpa":
        def sdpa(q, k, v, causal, window):
            if window >= 0:
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=_band(q.shape[-2], causal, window))
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return sdpa
    if impl == "explicit":
        return _explicit
    raise SystemExit(f"unknown --impl {impl}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=["flash", "sdpa", "explicit"], required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--backward", action="store_true", help="measure forward + backward")
    ap.add_argument("--window", type=int, default=-1, help="sliding window: keys up to W before the query")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    args = ap.parse_args(argv)
    if not os.path.exists("/proc/self/clear_refs"):
        print(json.dumps({"error": "peak-memory measurement needs Linux /proc"}))
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    run = _runner(args.impl)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, args.n, args.d, generator=g, requires_grad=args.backward) for _ in range(3))
    w = torch.randn(1, 1, args.n, args.d, generator=g) if args.backward else None

    def call(q, k, v):
        if not args.backward:
            with torch.no_grad():
                return (run(q, k, v, args.causal, args.window),)
        return torch.autograd.grad((run(q, k, v, args.causal, args.window) * w[:, :, : q.shape[2]]).sum(), (q, k, v))

    small = [t[:, :, :64].detach().clone().requires_grad_(args.backward) for t in (q, k, v)]
    call(*small)  # load libraries, spin up the thread pool, outside the measurement
    _reset_peak()
    base = _vm_kib("VmRSS")
    t0 = time.perf_counter()
    out = call(q, k, v)
    seconds = time.perf_counter() - t0
    peak = _vm_kib("VmHWM")
    assert all(torch.isfinite(t).all() for t in out)
    print(json.dumps({
        "impl": args.impl, "n": args.n, "d": args.d, "causal": args.causal, "backward": args.backward,
        "window": args.window, "seconds": seconds,
        "input_bytes": 3 * q.numel() * 4,
        "peak_extra_bytes": max(0, peak - base) * 1024,
        "nxn_float32_bytes": args.n * args.n * 4,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
