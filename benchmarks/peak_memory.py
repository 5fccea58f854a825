"""Peak extra memory of one attention call, measured in a fresh process.

    python benchmarks/peak_memory.py --impl flash --n 16384 --d 64 [--causal] [--backward]

Prints one JSON line: {"impl", "n", "d", "input_bytes", "peak_extra_bytes",
"nxn_float32_bytes"}. "Extra" is the growth of the process's peak resident
memory during the call, after the inputs exist and the op has been warmed up
on a tiny problem, so it counts the outputs and every temporary. With
--backward the call is forward + backward (q, k, v require grad; the loss is
sum(out * w) for a fixed random w), so it also counts what autograd saves
for the backward, the three gradients and the backward's temporaries. On Linux the
peak is reset just before the call by writing 5 to /proc/self/clear_refs
(resets VmHWM); elsewhere the measurement is unavailable and the script says so.

Used by benchmarks (the memory table) and by tests/test_memory.py.
"""
import argparse
import json
import os
import sys

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


def _explicit(q, k, v, causal):
    # The post's explicit PyTorch attention: materializes S and P (N x N).
    S = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    if causal:
        n = q.shape[-2]
        S = S.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(S, dim=-1) @ v


def _runner(impl):
    if impl == "flash":
        import flash_metal

        return lambda q, k, v, causal: flash_metal.attention(q, k, v, causal=causal)
    if impl == "sdpa":
        return lambda q, k, v, causal: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
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
                return (run(q, k, v, args.causal),)
        return torch.autograd.grad((run(q, k, v, args.causal) * w[:, :, : q.shape[2]]).sum(), (q, k, v))

    small = [t[:, :, :64].detach().clone().requires_grad_(args.backward) for t in (q, k, v)]
    call(*small)  # load libraries, spin up the thread pool, outside the measurement
    _reset_peak()
    base = _vm_kib("VmRSS")
    out = call(q, k, v)
    peak = _vm_kib("VmHWM")
    assert all(torch.isfinite(t).all() for t in out)
    print(json.dumps({
        "impl": args.impl, "n": args.n, "d": args.d, "causal": args.causal, "backward": args.backward,
        "input_bytes": 3 * q.numel() * 4,
        "peak_extra_bytes": max(0, peak - base) * 1024,
        "nxn_float32_bytes": args.n * args.n * 4,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
