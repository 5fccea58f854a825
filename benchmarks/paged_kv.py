"""The cost of a paged KV cache against the same cache stored contiguously.

    python -m benchmarks.paged_kv [--quick] [--device auto|cpu|mps] [--threads N] [--model]

flash_attn_with_kvcache on a batch of sequences of different lengths, once
with a plain (B, S, Hkv, D) cache (read in place by the varlen op) and once
with the same keys in a paged cache (num_blocks, page, Hkv, D) whose pages
are shuffled, for decode (1 query per sequence) and a short chunked prefill
(64 queries, causal). Both calls are checked equal before timing, and timed
in the same run, alternating. On CPU the paged call (attention_kvcache)
gathers the pages in use into a packed buffer before the kernel, so the
ratio is that gather's price; on MPS the decode row runs the decode kernels
and the 64-query row the prefill kernel, each reading the block table
(fc_paged) for both caches (the plain one as one page per sequence).
Writes a table to stdout and results/paged_kv_<device>.csv. --model: then
the Metal model's paged/contiguous decode (python -m benchmarks.model paged-kv, a
prediction from the emulator's counts, not yet verified on Apple hardware).
"""
import argparse
import sys
import time
from typing import List

import torch

from . import harness as H

COLUMNS = ["device", "case", "B", "Hq", "Hkv", "D", "dtype", "page", "keys", "plain_ms", "paged_ms",
           "paged_over_plain"]
FULL_LENGTHS = [4096, 1500, 8192, 333, 6000, 2048, 7777, 512]
QUICK_LENGTHS = [1024, 300, 2048, 77]


def _paged(plain: torch.Tensor, lengths: List[int], page: int, g: torch.Generator):
    per = -(-plain.shape[1] // page)
    need = [-(-n // page) for n in lengths]
    order = torch.randperm(sum(need), generator=g).tolist()
    pages = plain.new_empty(sum(need), page, *plain.shape[2:])
    table = torch.zeros(len(lengths), per, dtype=torch.int32)
    used = 0
    for b, n_blocks in enumerate(need):
        for e in range(n_blocks):
            blk = order[used]
            used += 1
            table[b, e] = blk
            rows = plain[b, e * page:(e + 1) * page]
            pages[blk, :rows.shape[0]] = rows
    return pages, table.to(plain.device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    H.common_args(ap, default_batch_s=0.2)
    ap.add_argument("--quick", action="store_true", help="4 shorter sequences")
    ap.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--model", action="store_true", help="also the Metal model's paged vs contiguous decode")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    device = H.pick_device(args.device)
    threads = H.set_threads(args.threads)
    fm = H.load_flash_metal()
    sync = H.synchronizer(device)
    dtype = getattr(torch, args.dtype)
    lengths = QUICK_LENGTHS if args.quick else FULL_LENGTHS
    B, hq, hkv, d = len(lengths), 32, 8, 128
    S = max(lengths)
    g = torch.Generator().manual_seed(0)
    k_plain = torch.randn(B, S, hkv, d, generator=g).to(device=device, dtype=dtype)
    v_plain = torch.randn(B, S, hkv, d, generator=g).to(device=device, dtype=dtype)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    rows, table_rows = [], []
    for case, sq, causal in (("decode", 1, False), ("prefill_chunk", 64, True)):
        q = torch.randn(B, sq, hq, d, generator=g).to(device=device, dtype=dtype)
        plain = lambda: fm.flash_attn_with_kvcache(q, k_plain, v_plain, cache_seqlens=seqlens, causal=causal)
        for page in (16, 256):
            k_pages, table = _paged(k_plain, lengths, page, torch.Generator().manual_seed(page))
            v_pages, _ = _paged(v_plain, lengths, page, torch.Generator().manual_seed(page))
            paged = lambda: fm.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table,
                                                       causal=causal)
            if not torch.equal(paged(), plain()):
                raise H.CorrectnessError(f"{case}, page {page}: the paged call differs from the plain call")
            t_plain = H.time_call(plain, sync, args.batches, args.batch_seconds)
            t_paged = H.time_call(paged, sync, args.batches, args.batch_seconds)
            row = dict(device=device, case=case, B=B, Hq=hq, Hkv=hkv, D=d, dtype=args.dtype, page=page,
                       keys=sum(lengths), plain_ms=t_plain.median_ms, paged_ms=t_paged.median_ms,
                       paged_over_plain=t_paged.median_ms / t_plain.median_ms)
            rows.append(row)
            table_rows.append([case, page, sum(lengths), H.ms3(t_plain.median_ms), H.ms3(t_paged.median_ms),
                               f"{row['paged_over_plain']:.2f}"])
    print(H.format_table(["case", "page", "keys", "plain ms", "paged ms", "paged/plain"], table_rows))
    meta = H.machine_metadata(device)
    meta["threads"] = str(threads)
    H.finish_metadata(meta, t_start)
    name = f"paged_kv{'_quick' if args.quick else ''}_{device}.csv"
    H.write_csv(args.out_dir / name, meta, rows, COLUMNS)
    if args.model:
        from .model.families import paged

        paged.report_decode(args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
