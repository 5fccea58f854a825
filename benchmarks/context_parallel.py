"""Context-parallel attention on CPU processes: time and peak memory per rank against the number of ranks.

    python -m benchmarks.context_parallel [--tokens 8192] [--worlds 1,2,4] [--variants ring,zigzag,ulysses]
                                          [--csv PATH]

Part 1, measured. For each variant and world size P, P spawned processes
(gloo over localhost TCP, max(1, cores // P) threads each) run one causal
forward + backward of flash_metal.distributed.attention over a sequence of
--tokens tokens (float32, H 4, D 64 by default) of which each holds 1/P. Per
rank: the forward's and backward's wall time; the peak extra resident memory
of that call (VmHWM reset through /proc/self/clear_refs after the inputs
exist and a warm-up, so it counts outputs, saved tensors, gradients,
received shards and every temporary; glibc's mmap threshold is fixed at
1 MiB, so that freed buffers leave the resident set); the forward's block compute time and
its exposed wait for transfers (flash_metal.distributed.stats), and the same
transfers timed alone (a ring of K/V exchanges with no compute). Overlap =
1 - exposed wait / transfers alone: the share of the communication hidden
behind compute. The table gives the slowest rank's times and the largest
rank's memory: in MiB, in shards (one float32 (1, H, n, D) tensor of the
rank's n tokens: the O(shard) buffers a rank keeps, whatever P), relative to
P = 1 of the same variant, and as P x peak / the single-process op's peak
(the first row, "op": flash_metal.attention on the whole sequence, one
process), which is 1.00 where memory per rank falls exactly as 1/P.

Part 2, a projection (no measurement): per ring step on 8-64 Macs over
Thunderbolt 5 (80 Gb/s) and 10 GbE, the communication time of one K/V shard
(and of K/V + dK/dV in the backward) against the compute of one block, from
(a) this CPU's per-pair times measured in part 1 and (b) an Apple GPU's
matrix rate at an assumed efficiency (benchmarks/model/core/gpus.py's M4 Max);
the communication-to-compute ratio per step says when the ring hides its
transfers (ratio < 1). Every assumption is printed with it.
"""
import argparse
import csv
import math
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def _vm_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _transfers_alone(g, k, v, steps):
    """The forward's K/V ring (steps - 1 exchanges) with no compute: the communication time alone."""
    from flash_metal.distributed._comm import TAG_K, TAG_V, Exchange

    torch.distributed.barrier()
    t0 = time.perf_counter()
    cur_k, cur_v = k, v
    for _ in range(steps - 1):
        ex = Exchange(g)
        ex.send(cur_k, (g.rank + 1) % g.size, TAG_K)
        ex.send(cur_v, (g.rank + 1) % g.size, TAG_V)
        ik = ex.recv(k.shape, k.dtype, (g.rank - 1) % g.size, TAG_K)
        iv = ex.recv(v.shape, v.dtype, (g.rank - 1) % g.size, TAG_V)
        got = ex.start().wait()
        cur_k, cur_v = got[ik], got[iv]
    return time.perf_counter() - t0


def _rank(rank, world, init, args, results):
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    import flash_metal
    import flash_metal.distributed as fmd
    from flash_metal.distributed import _blocks, _comm

    variant = args.variant
    op = variant == "op"  # the reference: the single-process op (flash_metal.attention) on the whole sequence
    if op:
        variant = "ring"
    n = fmd._layout.split_sizes(args.tokens, world)[rank] if variant != "zigzag" else sum(
        fmd._layout.split_sizes(args.tokens, 2 * world)[c] for c in fmd._layout.zigzag_chunks(rank, world))
    g = torch.Generator().manual_seed(rank)
    shape = (1, args.heads, n, args.dim)
    q, k, v, do = (torch.randn(shape, generator=g) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    # Warm-up on a small problem (allocator, gloo connections, op dispatch).
    small = [t.detach()[:, :, :64].clone().requires_grad_(True) for t in (q, k, v)]
    if variant == "zigzag":
        small = [fmd.shard(torch.randn(1, args.heads, 64 * world, args.dim), 2, "zigzag").requires_grad_(True)
                 for _ in range(3)]
    attend = (lambda a, b, c: flash_metal.attention(a, b, c, causal=True)) if op else \
        (lambda a, b, c: fmd.attention(a, b, c, variant=variant, causal=True))
    attend(*small).sum().backward()
    dist.barrier()

    base_rss = _vm_kib("VmRSS")
    _reset_peak()
    before = _blocks.stats.copy()
    t0 = time.perf_counter()
    out = attend(q, k, v)
    forward_s = time.perf_counter() - t0
    fwd = _blocks.stats - before
    before = _blocks.stats.copy()
    t0 = time.perf_counter()
    (out * do).sum().backward()
    backward_s = time.perf_counter() - t0
    bwd = _blocks.stats - before
    peak_extra = (_vm_kib("VmHWM") - base_rss) * 1024
    comm = _transfers_alone(_comm.Group(None, q.device), k.detach(), v.detach(), world) \
        if variant != "ulysses" and world > 1 and not op else 0.0
    results.put(dict(rank=rank, n=n, forward_s=forward_s, backward_s=backward_s, peak_extra=peak_extra,
                     fwd_compute_s=fwd["compute_s"], fwd_wait_s=fwd["wait_s"], bwd_compute_s=bwd["compute_s"],
                     bwd_wait_s=bwd["wait_s"], fwd_blocks=fwd["block_calls"], pairs=fwd["score_pairs"],
                     comm_alone_s=comm, bytes_sent=fwd["bytes_sent"], shard_bytes=q.numel() * q.element_size()))
    dist.destroy_process_group()


def measure(variant, world, args):
    # glibc raises its mmap threshold after each large free (up to 32 MiB), after which freed shards stay in
    # the heap and count in the resident peak; a fixed threshold returns every large buffer on free, so the
    # peak resident memory follows the live tensors (spawned processes inherit it).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    ctx = mp.get_context("spawn")
    fd, init = tempfile.mkstemp(prefix="cp_bench_")
    os.close(fd)
    os.unlink(init)
    results = ctx.Queue()
    a = argparse.Namespace(**vars(args), variant=variant)
    procs = [ctx.Process(target=_rank, args=(r, world, init, a, results)) for r in range(world)]
    for p in procs:
        p.start()
    rows = [results.get(timeout=1800) for _ in range(world)]
    for p in procs:
        p.join()
    return sorted(rows, key=lambda r: r["rank"])


def _mib(b):
    return b / 2**20


# ---------------------------------------------------------------- the projection

# Assumptions of the projection, printed with it.
LINKS = {  # name: (bytes per second, per-message latency in seconds)
    "Thunderbolt 5 (80 Gb/s)": (80e9 / 8, 50e-6),
    "10 GbE": (10e9 / 8, 50e-6),
}
GPU_EFFICIENCY = 0.5  # share of the matrix rate an attention block reaches (assumed)


def _m4_max_rate():
    sys.path.insert(0, os.path.dirname(HERE))
    from benchmarks.model.core import gpus as G

    gpu = next(x for x in G.GPUS if x.name == "M4 Max")
    return gpu.cores * gpu.clock_ghz * 1e9 * 2 * G.MMA_FFMA16_PER_CORE_CYCLE, gpu


def projection(cpu_fwd_s_per_pair_dim, cpu_bwd_s_per_pair_dim):
    """Rows of the per-step projection: one layer of a Llama-3-8B-like attention (Hq 32, Hkv 8, D 128, bf16),
    causal zigzag (every step: half a block's pairs per rank), sequences of 128k and 1M tokens."""
    rate, gpu = _m4_max_rate()
    hq, hkv, d, elem = 32, 8, 128, 2
    rows = []
    for tokens in (131072, 1048576):
        for world in (8, 16, 32, 64):
            n = tokens // world
            pairs = hq * n * n / 2  # zigzag, causal: half of an n x n block per step, every rank
            fwd_flops = 4 * pairs * d
            bwd_flops = 3.5 * fwd_flops  # the backward (2.5x) and its recomputed forward (1x)
            computes = {
                "this CPU (measured rate)": (pairs * d * cpu_fwd_s_per_pair_dim, pairs * d * cpu_bwd_s_per_pair_dim),
                f"{gpu.name} GPU ({GPU_EFFICIENCY:.0%} of its matrix rate)":
                    (fwd_flops / (rate * GPU_EFFICIENCY), bwd_flops / (rate * GPU_EFFICIENCY)),
            }
            kv = 2 * hkv * n * d * elem  # K and V shard
            grads = 2 * hkv * n * d * 4  # dK and dV accumulators, float32
            for link, (bw, lat) in LINKS.items():
                fwd_comm = kv / bw + 2 * lat
                bwd_comm = (kv + grads) / bw + 4 * lat
                for who, (fc, bc) in computes.items():
                    rows.append(dict(tokens=tokens, world=world, link=link, compute=who, shard_tokens=n,
                                     fwd_comm_ms=fwd_comm * 1e3, fwd_compute_ms=fc * 1e3, fwd_ratio=fwd_comm / fc,
                                     bwd_comm_ms=bwd_comm * 1e3, bwd_compute_ms=bc * 1e3, bwd_ratio=bwd_comm / bc,
                                     layer_fwd_bwd_s=world * (max(fwd_comm, fc) + max(bwd_comm, bc))))
    return rows, rate


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--variants", default="ring,zigzag,ulysses")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    print(f"# context-parallel attention on CPU processes: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}; causal, float32, tokens {args.tokens}, "
          f"H {args.heads}, D {args.dim}, gloo over localhost")
    print("| variant | ranks | threads/rank | forward s | backward s | peak extra MiB/rank | shards | vs 1 rank | "
          "P x peak / op's | fwd block compute s | fwd exposed wait s | transfers alone s | overlap |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    table, base = [], {}
    worlds = [int(w) for w in args.worlds.split(",")]
    per_pair = []
    op_mem = None
    for variant, world in [("op", 1)] + [(v, w) for v in args.variants.split(",") for w in worlds]:
        rows = measure(variant, world, args)
        mem = max(r["peak_extra"] for r in rows)
        if variant == "op":
            op_mem = mem
        base.setdefault(variant, mem if world == 1 else None)
        rel = mem / base[variant] if base.get(variant) else float("nan")
        shards = max(r["peak_extra"] / r["shard_bytes"] for r in rows)
        wait = max(r["fwd_wait_s"] for r in rows)
        alone = max(r["comm_alone_s"] for r in rows)
        overlap = (1 - min(1.0, wait / alone)) if alone > 0 else float("nan")
        row = dict(variant=variant, world=world, threads=max(1, (os.cpu_count() or 1) // world),
                   forward_s=max(r["forward_s"] for r in rows), backward_s=max(r["backward_s"] for r in rows),
                   peak_mib=_mib(mem), shards=shards, mem_vs_1=rel, p_times_vs_op=world * mem / op_mem,
                   fwd_compute_s=max(r["fwd_compute_s"] for r in rows), fwd_wait_s=wait, comm_alone_s=alone,
                   overlap=overlap)
        table.append(row)
        if world == 1 and variant not in ("ulysses", "op"):
            r = rows[0]
            per_pair.append((r["fwd_compute_s"] / (r["pairs"] * args.dim),
                             r["backward_s"] / (r["pairs"] * args.dim)))
        ov = "n/a" if math.isnan(overlap) else f"{overlap:.0%}"
        print(f"| {variant} | {world} | {row['threads']} | {row['forward_s']:.2f} | {row['backward_s']:.2f} | "
              f"{row['peak_mib']:.1f} | {shards:.1f} | {rel:.2f} | {row['p_times_vs_op']:.2f} | "
              f"{row['fwd_compute_s']:.2f} | {wait:.3f} | {alone:.3f} | {ov} |", flush=True)
    if per_pair:
        fwd_pp = statistics.median(p[0] for p in per_pair)
        bwd_pp = statistics.median(p[1] for p in per_pair)
        rows, rate = projection(fwd_pp, bwd_pp)
        print("\n# PROJECTION, not a measurement: one causal zigzag attention layer (Hq 32, Hkv 8, D 128, bf16) "
              "per ring step.")
        print(f"# Compute: this CPU's measured seconds per (query, key) pair x dim (forward {fwd_pp:.3g}, "
              f"backward {bwd_pp:.3g}, one process, {os.cpu_count()} threads), or the M4 Max GPU's matrix rate "
              f"({rate / 1e12:.1f} TFLOP/s, benchmarks/model/core/gpus.py) at an assumed {GPU_EFFICIENCY:.0%}.")
        print("# Links: raw bandwidth, 50 us per message (assumed); the ring hides a transfer when "
              "communication / compute < 1.")
        print("| tokens | Macs | link | compute | shard | fwd comm ms | fwd compute ms | fwd ratio | bwd comm ms | "
              "bwd compute ms | bwd ratio | layer fwd+bwd s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['tokens']} | {r['world']} | {r['link']} | {r['compute']} | {r['shard_tokens']} | "
                  f"{r['fwd_comm_ms']:.2f} | {r['fwd_compute_ms']:.2f} | {r['fwd_ratio']:.3f} | "
                  f"{r['bwd_comm_ms']:.2f} | {r['bwd_compute_ms']:.2f} | {r['bwd_ratio']:.3f} | "
                  f"{r['layer_fwd_bwd_s']:.3g} |")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)


if __name__ == "__main__":
    main()
