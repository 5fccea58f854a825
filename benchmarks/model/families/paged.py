"""The paged family of the Metal performance model (issue 20, section 4):
paged against contiguous caches, a prediction from the emulator's exact
counts, never a measurement, and not yet verified on Apple hardware.

    python -m benchmarks.model paged-kv [--quick]         # the one-pass decode
    python -m benchmarks.model paged-prefill [--quick]    # the prefill, varlen and pack-GQA tables

Decode (`decode_rows`, `report_decode`). Each case runs the one-pass decode
kernel twice in the instrumented emulator on the same keys: contiguous (the
planner's own plan, launched as planned) and paged (fc_paged: pages
scattered and shuffled, launched as tests/metal/test_metal_decode_paged.py
launches it), and both counts go through core/timing.py predict_band on
named Apple GPUs. The counts show what paging changes: the block table's
bytes (4 per page per kv head's threadgroup) and nothing else of K/V's (each
page in use read once per GQA group). What the time model does not see: at
each page boundary the next row's address waits on its table entry (a
dependent load, one per page per key group, and one at each block's start).
"stall bound" prices each such load at one DRAM latency, serially and
unhidden (the table's lines are likely in the L1 after the first touch): a
pessimistic upper end, printed apart.

Prefill (`prefill_rows`, `varlen_rows`, `pack_rows`, `report_prefill`).
Each case runs attention_kvcache's plan twice in the instrumented emulator on
the same keys: the prefill kernel on a contiguous cache (attention_forward's
plan) and on a paged one (fc_paged: pages scattered and shuffled,
tests/metal/test_metal_decode_paged.make_paged_cache, run as the MPS host runs
attention_kvcache: backends.emulated_metal_kvcache). What paging changes in
the counts: the block table's bytes (one entry per key block per
threadgroup when a tile lies in one page; an entry per page a thread enters
otherwise), the general per-element loader where tiles cross pages (page
sizes not a multiple of the key block: more, narrower loads), and nothing
of K/V's bytes (each key in use read once per threadgroup either way).
Pack GQA (fc_pack_gqa, pack_rows below): the same paged prefill with and
without the GQA group's heads packed into each threadgroup's rows, on the
same cache in the same run; the K/V bytes follow the threadgroup count,
ceil(Nq * G / BQ) * Hkv against ceil(Nq / BQ) * Hq (G times fewer for a
chunk of Nq * G <= BQ rows, about the same for long causal prefills).
The planner packs only where one head's rows fill at most half a block.
What the time model does not see: each tile's address waits on its table
entry (a dependent load per key block, or per page entered); "stall bound"
prices each at one DRAM latency, serially and unhidden (a pessimistic upper
end: the table's lines are likely in the L1 after the first touch).
"""
import math

import torch

import flash_metal

from ..core import counts as M
from ..core import gpus as G
from ..core import timing as T
from ..core.emulator import backends, tests_module

COLUMNS = ["gpu", "keys", "page", "contig_ms", "paged_ms", "paged_over_contig", "stall_bound_ms"]


def _paged():
    return tests_module("test_metal_decode_paged")


def _paged_record(s: M.Shape, dtype, page: int):
    """Record of the paged one-pass decode over the same shape (every sequence s.nk keys)."""
    P = _paged()
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
                   M.count_dict(type("D", (), {"buffers": names})(), c), False, ("decode", False))
    return rec


def decode_rows(quick: bool):
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


def report_decode(quick=False):
    print("Metal model (a prediction, not a measurement; not yet verified on Apple hardware): one-pass decode, "
          "B 1, Hq 32, Hkv 8, D 128, float16, one query")
    print(f"{'gpu':<16}{'keys':>6}{'page':>6}{'contig ms':>11}{'paged ms':>10}{'ratio':>7}{'stall bound':>13}"
          f"{'table B':>9}  K/V bytes equal")
    for r in decode_rows(quick):
        print(f"{r['gpu']:<16}{r['keys']:>6}{r['page']:>6}{r['contig_ms']:>11.4f}{r['paged_ms']:>10.4f}"
              f"{r['paged_over_contig']:>7.3f}{r['stall_bound_ms']:>13.4f}{r['table_bytes']:>9}  {r['kv_bytes_equal']}")


def _records(paged: bool, s: M.Shape, dtype, page: int):
    P = _paged()
    g = torch.Generator().manual_seed(page)
    k_cache, v_cache, table, k_contig, v_contig = P.make_paged_cache(s.b, s.hkv, s.d, dtype, page, [s.nk] * s.b, g,
                                                                     0, 0)
    q = torch.randn(s.b, s.hq, s.nq, s.d, generator=g).to(dtype)
    lengths = torch.full((s.b,), s.nk, dtype=torch.int32)
    if paged:
        out, _ = backends.emulated_metal_kvcache(q, k_cache, v_cache, lengths, table, True, instrumented=True)
    else:
        out, _ = backends.emulated_metal_attention(q, k_contig[:, :, :s.nk].contiguous(),
                                                   v_contig[:, :, :s.nk].contiguous(), True, None, "prefill",
                                                   instrumented=True)
    if not bool(torch.isfinite(out).all()):
        raise AssertionError("the prefill left NaN in the output")
    return [M.Record(d.kernel_name, d.grid, d.threadgroup, d.threadgroup_memory, M.count_dict(d, c), False,
                     ("prefill", False)) for d, c in backends.LAST_DISPATCHES]


def prefill_rows(quick: bool):
    dtype = torch.float16
    s = M.Shape(1, 4, 2, 64, 256, 64) if quick else M.Shape(1, 8, 2, 64, 512, 64)
    pages = (16, 32) if quick else (1, 16, 32, 64, 256)
    gpus = [G.BY_NAME[n] for n in (("M3 Max",) if quick else ("M3 Max", G.POST_GPU))]
    contig = _records(False, s, dtype, 16)
    out = []
    for page in pages:
        paged = _records(True, s, dtype, page)
        d = paged[0]
        bk = int(d.kernel.split("_bk")[1].split("_")[0])
        for gpu in gpus:
            lo_c, t_c, hi_c = T.predict_band(contig, gpu, s, dtype, True)
            lo_p, t_p, hi_p = T.predict_band(paged, gpu, s, dtype, True)
            # dependent table loads per threadgroup, serially: one per key block, or one per page entered
            loads = math.ceil(s.nk / bk) * (1 if page % bk == 0 else max(1, math.ceil(bk / page)))
            waves = max(1, math.ceil(math.prod(d.grid) / gpu.cores))
            stall = waves * loads * G.DRAM_LATENCY_NS[1] * 1e-9
            out.append(dict(gpu=gpu.name, page=page, block_k=bk, contig_ms=t_c * 1e3, paged_ms=t_p * 1e3,
                            paged_over_contig=t_p / t_c, stall_bound_ms=(t_p + stall) * 1e3,
                            band=f"{lo_p * 1e3:.3g}-{hi_p * 1e3:.3g}",
                            table_bytes=d.counts["dram_block_table"],
                            kv_bytes_equal=(d.counts["dram_k"] == contig[0].counts["dram_k"]
                                            and d.counts["dram_v"] == contig[0].counts["dram_v"])))
    return s, out


def varlen_rows(quick: bool):
    """flash_attn_varlen_func's paged prefill (packed queries of their own
    lengths, fc_varlen with fc_paged, 16-key pages) against the varlen kernel
    on the same keys packed, plus the gather it no longer runs: K and V's
    rows in use read and written once, priced at the chip's bandwidth (a
    floor for that copy). The timing model sizes key blocks by the longest
    sequence, the same approximation for both kernels."""
    P = _paged()
    run_paged_varlen = tests_module("test_metal_prefill_paged_varlen").run_paged_varlen
    dtype, hq, hkv, d, page = torch.float16, 8, 2, 64, 16
    q_lens, k_lens = ([32, 9], [256, 100]) if quick else ([64, 17, 40], [512, 200, 333])
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache, table, k_contig, v_contig = P.make_paged_cache(len(q_lens), hkv, d, dtype, page, k_lens, g)
    cu = lambda n: torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    packed = [torch.cat([c[b, :, :n].transpose(0, 1) for b, n in enumerate(k_lens)]) for c in (k_contig, v_contig)]
    s = M.Shape(len(q_lens), hq, hkv, max(q_lens), max(k_lens), d)

    def records():
        return [M.Record(r.kernel_name, r.grid, r.threadgroup, r.threadgroup_memory, M.count_dict(r, c), False,
                         ("prefill", False)) for r, c in backends.LAST_DISPATCHES]

    run_paged_varlen(q, k_cache, v_cache, cu(q_lens), max(q_lens), torch.tensor(k_lens, dtype=torch.int32), table,
                     True)
    paged = records()
    backends.emulated_metal_varlen(q, *packed, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens), True,
                                   instrumented=True)
    contig = records()
    gather_bytes = 2 * 2 * sum(k_lens) * hkv * d * 2  # K and V, read and written, float16
    out = []
    for gpu in [G.BY_NAME[n] for n in (("M3 Max",) if quick else ("M3 Max", G.POST_GPU))]:
        t_c = T.predict_band(contig, gpu, s, dtype, True)[1]
        t_p = T.predict_band(paged, gpu, s, dtype, True)[1]
        t_g = gather_bytes / (gpu.bandwidth_gbs * 1e9)
        out.append(dict(gpu=gpu.name, q_lens=q_lens, k_lens=k_lens, contig_ms=t_c * 1e3, paged_ms=t_p * 1e3,
                        gather_ms=t_g * 1e3, paged_over_gather_then_varlen=t_p / (t_c + t_g),
                        table_bytes=paged[0].counts["dram_block_table"],
                        kv_bytes_equal=(paged[0].counts["dram_k"] == contig[0].counts["dram_k"]
                                        and paged[0].counts["dram_v"] == contig[0].counts["dram_v"])))
    return out


def pack_rows(quick: bool):
    """The paged prefill with and without the GQA group's heads packed, on
    the same cache in the same run: causal, 16-key pages, a batch that fills
    the GPU (8 sequences of 1024 keys, Hq 32, Hkv 8: G = 4), D 64, float16,
    impl='prefill'. Packed is the planner's plan where it packs (2 * Nq <= BQ)
    and forced elsewhere (tests/metal/test_metal_prefill_pack_gqa.packed_plan);
    unpacked is the same kernel with fc_pack_gqa false on the (ceil(Nq / BQ),
    Hq, B) grid (unpacked_plan). The emulator's DRAM K/V bytes of each and the
    predicted times (a prediction, not a measurement). The routing rule in
    csrc/metal/routing.cpp (prefill_pack_gqa) quotes this table."""
    P = _paged()
    pack = tests_module("test_metal_prefill_pack_gqa")
    packed_plan, run_plan, unpacked_plan = pack.packed_plan, pack.run_plan, pack.unpacked_plan
    dtype, b, hq, hkv, d, page, nk = torch.float16, 8, 32, 8, 64, 16, 1024
    if quick:
        b, nk = 2, 256
    gpus = [G.BY_NAME[n] for n in (("M3 Max",) if quick else ("M1 Max", "M3 Max", "M4 Pro", G.POST_GPU))]
    out = []
    for nq in ((12, 40) if quick else (12, 16, 24, 40)):
        g = torch.Generator().manual_seed(nq)
        k_cache, v_cache, table, _, _ = P.make_paged_cache(b, hkv, d, dtype, page, [nk] * b, g, 0, 0)
        q = torch.randn(b, hq, nq, d, generator=g).to(dtype)
        lengths = torch.full((b,), nk, dtype=torch.int32)
        plan = flash_metal.explain(q, k_cache, v_cache, True, None, "prefill", block_table=table,
                                   cache_seqlens=lengths)
        routed = bool(plan.dispatches[0].function_constants[13])
        base = unpacked_plan(plan, hq, nq) if routed else plan
        s = M.Shape(b, hq, hkv, nq, nk, d)
        recs = {}
        for name, pl in (("packed", packed_plan(base, hq, hkv, nq)), ("unpacked", base)):
            o, _, counts = run_plan(pl, q, k_cache, v_cache, table, lengths)
            if not bool(torch.isfinite(o).all()):
                raise AssertionError("the prefill left NaN in the output")
            dd = pl.dispatches[0]
            recs[name] = [M.Record(dd.kernel_name, dd.grid, dd.threadgroup, dd.threadgroup_memory,
                                   M.count_dict(dd, counts), False, ("prefill", False))]
        kv = {n: r[0].counts["dram_k"] + r[0].counts["dram_v"] for n, r in recs.items()}
        for gpu in gpus:
            t_p = T.predict_band(recs["packed"], gpu, s, dtype, True)[1]
            t_u = T.predict_band(recs["unpacked"], gpu, s, dtype, True)[1]
            out.append(dict(gpu=gpu.name, nq=nq, routed=routed, packed_tgs=math.prod(recs["packed"][0].grid),
                            unpacked_tgs=math.prod(recs["unpacked"][0].grid), packed_kv=kv["packed"],
                            unpacked_kv=kv["unpacked"], packed_ms=t_p * 1e3, unpacked_ms=t_u * 1e3))
    return out


def report_prefill(quick=False):
    s, table = prefill_rows(quick)
    print(f"Metal model (a prediction, not a measurement; not yet verified on Apple hardware): causal prefill, "
          f"B {s.b}, Hq {s.hq}, Hkv {s.hkv}, Nq {s.nq}, {s.nk} keys, D {s.d}, float16")
    print(f"{'gpu':<16}{'page':>6}{'BK':>4}{'contig ms':>11}{'paged ms':>10}{'ratio':>7}{'stall bound':>13}"
          f"{'table B':>9}  K/V bytes equal")
    for r in table:
        print(f"{r['gpu']:<16}{r['page']:>6}{r['block_k']:>4}{r['contig_ms']:>11.4f}{r['paged_ms']:>10.4f}"
              f"{r['paged_over_contig']:>7.3f}{r['stall_bound_ms']:>13.4f}{r['table_bytes']:>9}  "
              f"{r['kv_bytes_equal']}")
    print("Paged varlen prefill (flash_attn_varlen_func with block_table; 16-key pages, Hq 8, Hkv 2, D 64, "
          "float16, causal) against the gather then the varlen kernel (the gather at the chip's bandwidth):")
    print(f"{'gpu':<16}{'varlen ms':>11}{'gather ms':>11}{'paged ms':>10}{'ratio':>7}{'table B':>9}  K/V bytes equal")
    for r in varlen_rows(quick):
        print(f"{r['gpu']:<16}{r['contig_ms']:>11.4f}{r['gather_ms']:>11.4f}{r['paged_ms']:>10.4f}"
              f"{r['paged_over_gather_then_varlen']:>7.3f}{r['table_bytes']:>9}  {r['kv_bytes_equal']}  "
              f"(q {r['q_lens']}, keys {r['k_lens']})")
    print("Pack GQA (fc_pack_gqa) in the paged prefill, causal, B 8 x 1024 keys in 16-key pages (--quick: B 2 x "
          "256), Hq 32, Hkv 8, D 64, float16: packed against unpacked, same cache, same run (K/V: the emulator's "
          "DRAM bytes, exact; 'routed': the planner packs this Nq):")
    print(f"{'gpu':<16}{'Nq':>5}{'routed':>7}{'TGs':>11}{'K/V bytes':>23}{'ratio':>7}{'unpacked ms':>13}"
          f"{'packed ms':>11}{'ratio':>7}")
    for r in pack_rows(quick):
        print(f"{r['gpu']:<16}{r['nq']:>5}{'yes' if r['routed'] else 'no':>7}{r['unpacked_tgs']:>5}->{r['packed_tgs']:<4}"
              f"{r['unpacked_kv']:>11}->{r['packed_kv']:<10}{r['unpacked_kv'] / r['packed_kv']:>7.2f}"
              f"{r['unpacked_ms']:>13.4f}{r['packed_ms']:>11.4f}{r['unpacked_ms'] / r['packed_ms']:>7.2f}")
