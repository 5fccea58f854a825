"""The Metal model's paged against contiguous decode (issue 20, section 4):
a prediction from the emulator's exact counts, never a measurement, and not
yet verified on Apple hardware.

    python -m benchmarks.paged_kv_model [--quick]

Each case runs the one-pass decode kernel twice in the instrumented
emulator on the same keys: contiguous (the planner's own plan, launched as
planned) and paged (fc_paged: pages scattered and shuffled, launched as
tests/test_metal_decode_paged.py launches it), and both counts go through
benchmarks/metal_model_timing.predict_band on named Apple GPUs. The counts
show what paging changes: the block table's bytes (4 per page per kv head's
threadgroup) and nothing else of K/V's (each page in use read once per GQA
group). What the time model does not see: at each page boundary the next
row's address waits on its table entry (a dependent load, one per page per
key group, and one at each block's start). "stall bound" prices each such load
at one DRAM latency, serially and unhidden (the table's lines are likely in
the L1 after the first touch): a pessimistic upper end, printed apart.
"""
import argparse
import math
import sys

import torch

from . import apple_gpus as G
from . import metal_model as M
from . import metal_model_timing as T

COLUMNS = ["gpu", "keys", "page", "contig_ms", "paged_ms", "paged_over_contig", "stall_bound_ms"]


def _paged_record(s: M.Shape, dtype, page: int):
    """Record of the paged one-pass decode over the same shape (every sequence s.nk keys)."""
    import test_metal_decode_paged as P  # tests/ is on sys.path (metal_model puts it there)

    g = torch.Generator().manual_seed(page)
    k_cache, v_cache, table, _, _ = P.make_paged_cache(s.b, s.hkv, s.d, dtype, page, [s.nk] * s.b, g, 0, 0)
    q = torch.randn(s.b, s.hq, s.nq, s.d, generator=g).to(dtype)
    out, _, counts = P.launch_paged(q, k_cache, v_cache, table, [s.nk] * s.b)
    if not bool(torch.isfinite(out).all()):
        raise AssertionError("paged decode left NaN in the output")
    c = counts[0]
    names = {"q": 0, "k": 1, "v": 2, "out": 3, "lse": 4, "block_table": P.TABLE, "cache_seqlens": P.SEQLENS}
    d = M.plan("decode", s, dtype, False).dispatches[0]
    rec = M.Record(d.kernel_name, d.grid, d.threadgroup, d.threadgroup_memory,
                   M._count_dict(type("D", (), {"buffers": names})(), c), False, ("decode", False))
    return rec


def rows(quick: bool):
    dtype = torch.float16
    lengths = (512,) if quick else (512, 2048)
    pages = (16, 256) if quick else (1, 16, 64, 256)
    gpus = [G.BY_NAME[n] for n in (("M3 Max",) if quick else ("M3 Max", G.POST_GPU))]
    out = []
    for nk in lengths:
        s = M.Shape(1, 32, 8, 1, nk, 128)
        contig = M.emulate("decode", s, dtype, False)
        for page in pages:
            if page > nk:
                continue
            paged = [_paged_record(s, dtype, page)]
            for gpu in gpus:
                lo_c, t_c, hi_c = T.predict_band(contig, gpu, s, dtype, False)
                lo_p, t_p, hi_p = T.predict_band(paged, gpu, s, dtype, False)
                key_groups = contig[0].threadgroup[1]
                # table loads per key group: one at each of its blocks' starts, one per page entered inside a block
                loads = math.ceil(nk / 32 / key_groups) * max(1, 32 // page)
                stall = loads * G.DRAM_LATENCY_NS[1] * 1e-9
                out.append(dict(gpu=gpu.name, keys=nk, page=page, contig_ms=t_c * 1e3, paged_ms=t_p * 1e3,
                                paged_over_contig=t_p / t_c, stall_bound_ms=(t_p + stall) * 1e3,
                                band=f"{lo_p * 1e3:.3g}-{hi_p * 1e3:.3g}",
                                table_bytes=paged[0].counts["dram_block_table"],
                                kv_bytes_equal=paged[0].counts["dram_k"] == contig[0].counts["dram_k"]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    print("Metal model (a prediction, not a measurement; not yet verified on Apple hardware): one-pass decode, "
          "B 1, Hq 32, Hkv 8, D 128, float16, one query")
    print(f"{'gpu':<16}{'keys':>6}{'page':>6}{'contig ms':>11}{'paged ms':>10}{'ratio':>7}{'stall bound':>13}"
          f"{'table B':>9}  K/V bytes equal")
    for r in rows(args.quick):
        print(f"{r['gpu']:<16}{r['keys']:>6}{r['page']:>6}{r['contig_ms']:>11.4f}{r['paged_ms']:>10.4f}"
              f"{r['paged_over_contig']:>7.3f}{r['stall_bound_ms']:>13.4f}{r['table_bytes']:>9}  {r['kv_bytes_equal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
