"""The time model of the Metal performance model (issue 19, "The model"): from a
dispatch's exact counts to predicted seconds on a named Apple GPU, as a band.
Nothing here is a measurement; every constant names its source or says
"estimate" (gpus.py SOURCES).

Per dispatch, seconds = overhead + max(core time, critical path, memory,
on-core data):

- Core time: the ALU work (simdgroup MMAs at the generation's in-GEMM rate,
  scalar softmax work, exp2) spread over the active cores; a key block of one
  threadgroup also has a SERIAL section (the K/V tile load's DRAM latency,
  the barriers, the MMA dependency chains at ~36 cycles per 8x8 float32 MMA,
  the softmax's shuffles and exp2; the backward's kernels: a streamed block,
  backward_blocks, with its S and dP chains over all features). With r threadgroups resident per core (the
  planner's estimate, flash_metal.explain(gpu=...).threadgroups_per_core,
  capped by the grid's share) a core finishes r blocks in
  max(r * work, latency + work): latency is hidden only when r * work covers
  it. A partial last wave costs a whole one (equal threadgroups, no mask).
  Each SIMD-group issues from one of a core's 4 schedulers, so a
  threadgroup of fewer than 4 runs its block at (its SIMD-groups) / 4 of
  the core's rate, and a core with fewer than 4 resident at that share.
- Critical path: the longest threadgroup's blocks x (latency + work): a
  causal tail or a grid smaller than the cores cannot go faster than that.
- The post's scalar kernels (untiled, tiled): per key a dependent dot product
  (D FFMAs at ILP 1) and the output update (2 D at ILP 4), each at
  metal-benchmarks' measured FFMA cost for the resident SIMD-groups
  (FFMA32_CYCLES), plus the key's load latency (device memory for untiled,
  threadgroup memory for tiled, with a DRAM tile load per tile).
- Memory: device bytes over the MEASURED streaming ceiling (0.79-0.87 of
  nominal bandwidth), over Little's law per core (bytes in flight per core /
  DRAM latency), and over 32 B per core-cycle to the rest of the GPU.
  Device bytes follow the emulator's two traffic rules (issue 19): requests
  by the broadcast rule (one per address per SIMD-group load instruction),
  and DRAM bytes as those new to their threadgroup within an 8 KiB window
  (SIMD-groups sharing lines through the L1: an assumption).
- On-core data: threadgroup and device bytes at 64 B per core-cycle.

Bands: `predict` at the point figures; `predict_band` at the low and high
ends of every uncertain figure together (clock, MMA rate, threadgroup memory
per core, DRAM latency, dispatch overhead, streaming ceiling, tensor-op
rate and its overlap with the ALUs). Tensor ops (Metal 4 matmul2d, counted
as mpp_flops) run at gpus.tensor_op_rate: M5's neural accelerators,
else the shader cores' simdgroup-matrix rate (benchmarks/model/families/accel.py).
"""
import math
import re
from functools import lru_cache

import torch

import flash_metal

from . import gpus as G

# On-core data bandwidth, bytes per core-cycle (threadgroup memory and L1):
# metal-benchmarks "On-Core Data BW/Cycle 64 B" (Apple 7, 8; assumed later).
ON_CORE_BYTES_PER_CYCLE = 64
# Bytes per core-cycle one core moves to and from the rest of the GPU:
# metal-benchmarks "On-GPU Data BW/Cycle ~32 B".
ON_GPU_BYTES_PER_CYCLE = 32
FFMA_PER_MMA = 512  # 8 x 8 x 8 in one simdgroup_multiply_accumulate
LANES_PER_CORE = 128  # FP32 lanes per core (metal-benchmarks: 128 ALUs)
# Scalar lane-ops per exp2 call in the MMA kernels (scale, mask tests, max,
# subtract, select, sum, the O rescale's share): counted by eye from
# attention_prefill.h, an estimate (the emulator does not count scalar ops).
SCALAR_OPS_PER_EXP2 = 8
# Serial latencies in GPU cycles (estimate-gpu-latencies): no Apple source.
MMA_LATENCY = 36      # one 8x8 float32 MMA to the next that depends on it
TG_LOAD_LATENCY = 24  # a threadgroup-memory load
SHUFFLE_LATENCY = 16  # a simd_shuffle_xor, and an exp2 result
BARRIER_CYCLES = 40   # a threadgroup barrier with every SIMD-group arrived
# K/V rows a decode SIMD-group keeps in flight, each lane its D/32
# features: the key being used and the next one, prefetched (attention_decode.h,
# decode_attend; an estimate: the compiler may issue further ahead).
DECODE_ROWS_IN_FLIGHT = 2

# "lockstep" (decode, several row groups reading the same keys): 1, the
# siblings keep the same lines in flight (only one SIMD-group's misses are
# unique: the point and slow end); 0, they drift apart and each one's misses
# are its own lines (the fast end). Which it is, only a Mac can say.
# "overlap" (tensor ops on M5's neural accelerators): 0, the accelerator's
# time and the ALUs' (softmax) add; 1, they overlap (estimate-accel-overlap).
POINT = {"clock": 1, "mma": 1, "tg": 1, "dram": 1, "overhead": 1, "stream": 1, "lockstep": 1, "overlap": 0}
FAST = {"clock": 2, "mma": 2, "tg": 2, "dram": 0, "overhead": 0, "stream": 2, "lockstep": 0, "overlap": 1}
SLOW = {"clock": 0, "mma": 0, "tg": 0, "dram": 2, "overhead": 2, "stream": 0, "lockstep": 1, "overlap": 0}


def _clock(gpu, k):
    lo, hi = gpu.clock_band or (gpu.clock_ghz, gpu.clock_ghz)
    return (lo, gpu.clock_ghz, hi)[k] * 1e9


def ffma_cycles(ilp, sgs):
    """metal-benchmarks' FFMA32 cost (1.0 = full rate) at `sgs` resident
    SIMD-groups per core, interpolated in log(sgs) between its 4, 8, 88
    columns and clamped to them (fewer than 4 still leave each SIMD-group its
    own scheduler)."""
    table = G.FFMA32_CYCLES[ilp]
    xs = sorted(table)
    s = min(max(sgs, xs[0]), xs[-1])
    for a, b in zip(xs, xs[1:]):
        if a <= s <= b:
            f = (math.log(s) - math.log(a)) / (math.log(b) - math.log(a))
            return table[a] + f * (table[b] - table[a])
    return table[xs[-1]]


def issue_share(sgs):
    """The share of a core's issue rate `sgs` resident SIMD-groups can use:
    each is bound to one of the core's 4 schedulers (metal-benchmarks, ALU
    layout), so fewer than 4 leave schedulers idle."""
    return min(max(sgs, 1), G.SCHEDULERS_PER_CORE) / G.SCHEDULERS_PER_CORE


def sg_cycles_per_ffma(ilp, sgs):
    """Cycles between one SIMD-group's FFMAs when `sgs` share the core's 4 schedulers."""
    return ffma_cycles(ilp, sgs) * max(sgs, G.SCHEDULERS_PER_CORE) / G.SCHEDULERS_PER_CORE


@lru_cache(maxsize=None)
def _planned(impl, s, dtype, causal, key, backward):
    one = torch.empty(1, 1, 1, s.d, dtype=dtype)
    dv = getattr(s, "dv", 0) or s.d  # MLA: v's own head dim
    q, k = one.expand(s.b, s.hq, s.nq, s.d), one.expand(s.b, s.hkv, s.nk, s.d)
    v = torch.empty(1, 1, 1, dv, dtype=dtype).expand(s.b, s.hkv, s.nk, dv)
    return flash_metal.explain(q, k, v, causal, None, impl, key, backward=backward)


def planner_residency(r, index, gpu, s, dtype, causal):
    """(threadgroups per core, limit) from the planner's estimate for this
    dispatch on this chip; records without a plan (synthetic) fall back to
    threadgroup memory alone."""
    if r.source and r.source[0] == "live":
        return probe_residency(r, gpu)
    if r.source is None or gpu.key is None:
        by_mem = gpu.tgmem_per_core // r.tg_memory if r.tg_memory else 64
        return max(1, by_mem), "threadgroup memory (no plan)"
    impl, backward, *padded = r.source  # counts.padded_to: planned in that bucket
    if padded:
        s = s._replace(d=padded[0])
    d = _planned(impl, s, dtype, causal, gpu.key, backward).dispatches[index]
    if d.kernel_name != r.kernel:
        raise AssertionError(f"plan for {gpu.key} launches {d.kernel_name}, the counts are of {r.kernel}")
    return d.threadgroups_per_core, d.occupancy_limit


# A core's register file, bytes: csrc/metal/gpus.cpp kRegisterFile (metal-benchmarks' ~208 KB, an estimate).
REGISTER_FILE_PER_CORE = 208 * 1024


def probe_residency(r, gpu, tgmem_per_core=None):
    """(threadgroups per core, limit) of a probe kernel the planner does not
    plan (the split-D probes, families/d512.py, splitd.py): Record.source =
    ("live", live values per lane), and the planner's rule
    (metal_gpus.cpp, estimate_launch): the fewer of the register file over
    the threadgroup's live registers and the core's threadgroup memory over
    its bytes."""
    sgs = max(1, math.ceil(r.threadgroup[0] * r.threadgroup[1] * r.threadgroup[2] / 32))
    by_regs = REGISTER_FILE_PER_CORE // (r.source[1] * 4 * 32 * sgs)
    by_mem = (tgmem_per_core or gpu.tgmem_per_core) // r.tg_memory if r.tg_memory else 64
    return max(1, min(by_regs, by_mem)), "registers" if by_regs <= by_mem else "threadgroup memory"


def visible(row, s, causal):
    return min(max(row + s.nk - s.nq + 1, 0), s.nk) if causal else s.nk


def key_blocks(kernel, s, causal, group=1):
    """Key blocks (or keys, for the untiled kernel) each threadgroup of one
    head runs, from the shape: [(rows, blocks)] per query block. None for
    kernels whose loop this model does not know. group = G > 1: the packed
    GQA prefill (fc_pack_gqa), whose threadgroups of one kv head each take
    bq packed rows (query row m // G of head m % G) and run the key blocks
    their last query row sees."""
    m = re.search(r"_bq(\d+)_bk(\d+)_", kernel)
    if m:
        bq, bk = int(m.group(1)), int(m.group(2))
    elif (m := re.search(r"_bk(\d+)_t(\d+)$", kernel)):
        bk, bq = int(m.group(1)), int(m.group(2))
    elif (m := re.search(r"untiled.*_t(\d+)$", kernel)):
        bk, bq = 1, int(m.group(1))
    else:
        return None
    rows = s.nq * group
    return [math.ceil(visible((min(p0 + bq, rows) - 1) // group, s, causal) / bk) for p0 in range(0, rows, bq)], bk


def packed_group(r, s):
    """G when dispatch record r is the packed GQA prefill (its grid runs over kv heads: fc_pack_gqa), else 1."""
    g = s.hq // s.hkv
    packed = g > 1 and "prefill" in r.kernel and "_mpp_" not in r.kernel and r.grid[1] == s.hkv
    return g if packed else 1


def backward_blocks(kernel, s, causal):
    """The backward kernels' loop, from the shape: ([streamed blocks per
    threadgroup of one head], rows per streamed block, heads the grid repeats
    it over). dQ (flash_backward_dq_..._bq<R>_bk<S>_): a query block of R rows
    streams the key blocks its last row sees. dK/dV (..._bq<S>_bk<R>_): a key
    block of R keys streams, for each query head of its GQA group, the query
    blocks from the first row that sees it (attention_backward_dkdv.h)."""
    m = re.search(r"_bq(\d+)_bk(\d+)_", kernel)
    bq, bk = int(m.group(1)), int(m.group(2))
    if "_dq_" in kernel:
        return [math.ceil(visible(min(q0 + bq, s.nq) - 1, s, causal) / bk) for q0 in range(0, s.nq, bq)], bk, \
            s.b * s.hq
    first_row = lambda k0: max(0, k0 - (s.nk - s.nq)) if causal else 0  # noqa: E731
    group = s.hq // s.hkv
    # Feature parts (_ds<F>) are SIMD-groups of one threadgroup: the grid is not multiplied by them.
    return [group * math.ceil(max(0, s.nq - first_row(k0) // bq * bq) / bq) for k0 in range(0, s.nk, bk)], bq, \
        s.b * s.hkv


def _dmax(kernel):
    return int(re.search(r"_d(\d+)", kernel).group(1))


def dispatch_time(r, index, gpu, s, dtype, causal, k=POINT):
    """(seconds, {term: seconds}, resident SIMD-groups per core) of one dispatch."""
    c = r.counts
    hz = _clock(gpu, k["clock"])
    elem = torch.empty((), dtype=dtype).element_size()
    sg_per_tg = max(1, math.ceil(r.threadgroup[0] * r.threadgroup[1] * r.threadgroup[2] / 32))
    tgs_core, limit = planner_residency(r, index, gpu, s, dtype, causal)
    if limit.startswith("threadgroup memory") and k["tg"] == 2 and gpu.tgmem_per_core <= 32768:
        # 64 KiB per core instead of the 32 KiB estimate (its low end: estimate-tgmem-m3); a probe's
        # registers still bound it
        tgs_core = probe_residency(r, gpu, 2 * gpu.tgmem_per_core)[0] if r.source and r.source[0] == "live" \
            else tgs_core * 2
    grid_tgs = c["threadgroups"]
    active = min(gpu.cores, grid_tgs)
    r_core = min(tgs_core, grid_tgs / active)  # threadgroups resident per core, on average
    sgs = r_core * sg_per_tg
    waves = grid_tgs / (active * tgs_core)
    quant = math.ceil(waves) / waves if waves > 1 and not causal else 1.0
    dram_cycles = G.DRAM_LATENCY_NS[k["dram"]] * 1e-9 * hz
    group = packed_group(r, s)
    kb = key_blocks(r.kernel, s, causal, group)
    heads = s.b * (s.hkv if group > 1 else s.hq)  # threadgroup rows of the grid (kv heads when packed)
    terms = {}
    if "untiled" in r.kernel or "_tiled_" in r.kernel:
        # One SIMD-group-key: 32 rows' (row, key) pairs, two exp2 each (OnlineSoftmax.update).
        sg_keys = c["exp2_calls"] / 2 / 32
        d = _dmax(r.kernel)
        per_key = d * sg_cycles_per_ffma(1, sgs) + 2 * d * sg_cycles_per_ffma(4, sgs) \
            + 2 * SHUFFLE_LATENCY + 4 * sg_cycles_per_ffma(1, sgs)
        if "untiled" in r.kernel:
            per_key += dram_cycles  # the key's K row from device memory, waited on by the dot chain
        else:
            per_key += TG_LOAD_LATENCY + (dram_cycles + 2 * BARRIER_CYCLES) / kb[1]
        terms["compute"] = sg_keys * per_key / (sgs * active * hz)
        blocks = kb[0] if kb else [1]
        skew = max(blocks) / (sum(blocks) / len(blocks))  # longest threadgroup over the mean
        keys_tg = sg_keys / (grid_tgs * sg_per_tg)
        terms["critical path"] = keys_tg * skew * per_key / hz
    elif c["simdgroup_mmas"] or c.get("mpp_flops"):
        mma_rate = G.MMA_RATE[gpu.generation][k["mma"]]
        # core-cycles, the whole dispatch: the products (simdgroup MMAs on
        # the ALUs; tensor ops, mpp_flops, at gpus.tensor_op_rate) and
        # the softmax's ALU work. On a neural accelerator (M5) the products
        # may run beside the ALUs: added at the point, overlapped at the fast end.
        matrix = (c["simdgroup_mmas"] * FFMA_PER_MMA / mma_rate
                  + c.get("mpp_flops", 0) / G.tensor_op_rate(gpu.generation)[k["mma"]])
        alu = c["exp2_calls"] * SCALAR_OPS_PER_EXP2 / LANES_PER_CORE + c["exp2_calls"] / G.EXP2_PER_CORE_CYCLE
        on_accel = c.get("mpp_flops") and gpu.generation in G.ACCEL_FLOPS_PER_CORE_CYCLE
        work = max(matrix, alu) if on_accel and k["overlap"] else matrix + alu
        d_frags = math.ceil(s.d / 8)
        serial = None
        busy = sg_per_tg  # SIMD-groups of a threadgroup that run the products (the prefill's below)
        # The tensor-op prefill (_mpp_) has no such chain of its own to count:
        # matmul2d's latency is Apple's, unpublished; it is modelled as MLX's
        # accelerator kernel is (families/accel.py), by throughput alone.
        if kb and "flash_backward_splitd_" in r.kernel:
            # The split-D backward (shaders/backward/attention_backward_splitd.h): per
            # streamed block, the operands' fragments from device memory (two
            # DRAM latencies: S's, then dP's, counted, not assumed hoisted),
            # each part's S and dP chains over its d_frags / F fragments one
            # after the other (the kernel writes S out before it computes
            # dP, for registers), a barrier and the F partials' sums, the
            # shared step's exp2 (no shuffles: P comes from lse), a second
            # barrier and the dS reads, then the accumulation over the
            # block's streamed / 8 fragments (dQ += dS.K; dV and dK alike).
            blocks, streamed, bheads = backward_blocks(r.kernel, s, causal)
            parts = int(re.search(r"_wm(\d+)", r.kernel).group(1))
            lat = (2 * dram_cycles + 2 * BARRIER_CYCLES + (parts + 1) * TG_LOAD_LATENCY
                   + (2 * math.ceil(d_frags / parts) + streamed // 8) * MMA_LATENCY)
            serial = blocks, bheads, lat
        elif kb and "_splitd_" in r.kernel:
            # The split-D forward (shaders/prefill/attention_prefill_splitd.h): per key
            # block, K's fragments from device memory (one DRAM latency: a
            # part's loads are independent), each part's S chain over its
            # d_frags / F fragments, the scratch's one barrier and the F
            # partials' sum, the softmax's shuffles and exp2, V's fragments
            # from device memory (a second DRAM latency: counted, not assumed
            # hoisted), and the P.V chain over the block's bk / 8 fragments.
            # The softmax is shared: 3 barriers, F reads after each
            # (partials, row maxima, row sums), 2 quad shuffles twice.
            blocks, bk = kb
            m = re.search(r"_bq(\d+)_bk\d+_wm(\d+)", r.kernel)
            parts = 8 * int(m.group(2)) // int(m.group(1))
            steps = 3
            lat = (2 * dram_cycles + steps * (BARRIER_CYCLES + parts * TG_LOAD_LATENCY)
                   + (math.ceil(d_frags / parts) + bk // 8) * MMA_LATENCY + 6 * SHUFFLE_LATENCY)
            serial = blocks, heads, lat
        elif kb and "prefill" in r.kernel and "_mpp_" not in r.kernel:
            blocks, bk = kb
            # Feature parts (8 * WM / BQ, split-K, attention_prefill.h): the
            # S chain over d_frags / F fragments, then the partials' sum (F
            # dependent reads; the barrier is the K tile's, already counted).
            m = re.search(r"_bq(\d+)_bk\d+_wm(\d+)", r.kernel)
            parts = 8 * int(m.group(2)) // int(m.group(1)) if m else 1
            reduce = parts * TG_LOAD_LATENCY if parts > 1 else 0
            lat = (dram_cycles + 4 * BARRIER_CYCLES + (math.ceil(d_frags / parts) + bk // 8) * MMA_LATENCY
                   + 2 * TG_LOAD_LATENCY + 4 * SHUFFLE_LATENCY + 2 * SHUFFLE_LATENCY + reduce)
            serial = blocks, heads, lat
            # SIMD-groups with rows: a SIMD-group whose 8 rows are all past Nq
            # skips the block's products (the emulator counts none), so a
            # threadgroup of few rows (Nq < bq unpacked; pack GQA fills them)
            # issues from fewer schedulers. The average over the grid's
            # threadgroups of one head (kv head when packed), times the parts.
            rows = s.nq * group
            bq_rows = int(m.group(1)) if m else 32
            avg_rows = rows / math.ceil(rows / bq_rows)
            busy = min(sg_per_tg, max(1, math.ceil(avg_rows / 8)) * parts)
        elif "flash_backward_" in r.kernel and "_mpp_" not in r.kernel:
            # (The tensor-op backward, flash_backward_mpp_*, by throughput
            # alone, as the tensor-op prefill above.)
            # A streamed block of the backward: its two tiles' DRAM latency,
            # 2 barriers, S and dP (independent chains over the features),
            # then the accumulation over the block's rows (dQ += dS.K; dV,
            # dK likewise), 2 fragment reads and one exp2, no shuffles (P
            # comes from lse).
            # Feature parts (_ds<F>, split-K, attention_backward.h): each
            # part's S and dP chains run over its d_frags / F fragments, then
            # a third barrier and the partials' sum (F dependent reads).
            blocks, streamed, bheads = backward_blocks(r.kernel, s, causal)
            # Where the scratch does not fit beside the tiles (float32 at
            # DMAX 256, backward_partials_bytes) the parts recompute instead:
            # whole chains, no third barrier.
            ds = re.search(r"_ds(\d+)", r.kernel)
            parts = int(ds.group(1)) if ds else 1
            m = re.search(r"_bq(\d+)_bk(\d+)_wm(\d+)", r.kernel)
            dmax = _dmax(r.kernel)
            if parts > 1 and (2 * (int(m.group(1)) + int(m.group(2))) * dmax * elem
                              + int(m.group(3)) * 2 * (streamed // 8) * 256 > 32768):
                parts = 1
            reduce = (BARRIER_CYCLES + parts * TG_LOAD_LATENCY) if parts > 1 else 0
            lat = (dram_cycles + 2 * BARRIER_CYCLES + (math.ceil(d_frags / parts) + streamed // 8) * MMA_LATENCY
                   + 2 * TG_LOAD_LATENCY + SHUFFLE_LATENCY + reduce)
            serial = blocks, bheads, lat
        if serial:
            blocks, heads, lat = serial
            total = sum(blocks) * heads
            w = work / total  # one threadgroup's streamed block, core-cycles at full rate
            # A SIMD-group issues from one of the core's 4 schedulers, so a
            # threadgroup of fewer than 4 SIMD-groups runs its block at
            # sg_per_tg / 4 of the core's rate, and the core as a whole at
            # (resident SIMD-groups) / 4 until all 4 schedulers have one.
            w_tg = w / issue_share(busy)
            if causal:  # unequal threadgroups: the average residency, no wave structure
                cycles = total * max(w / issue_share(sgs), (lat + w_tg) / r_core) / active
            else:  # equal threadgroups in waves of active x tgs_core, a partial last wave costing a whole one
                # (an assumption: its threadgroups could run faster with fewer per core, but MLX's timings at
                # N = 256-512 are slower than even this rule predicts, not faster)
                nb = total / grid_tgs
                waves = math.ceil(grid_tgs / (active * tgs_core))
                per_core = min(tgs_core, math.ceil(grid_tgs / active))
                cycles = waves * nb * max(per_core * w / issue_share(per_core * busy), lat + w_tg)
            terms["compute"] = cycles / hz
            terms["critical path"] = max(blocks) * (lat + w_tg) / hz
        else:
            terms["compute"] = work / (active * hz) * quant / issue_share(sgs)
    elif "decode" in r.kernel and "merge" not in r.kernel:
        terms["compute"] = 2 * s.d * s.nq * s.hq * s.b * s.nk / (active * LANES_PER_CORE * hz)
    else:
        terms["compute"] = c["exp2_calls"] / (active * G.EXP2_PER_CORE_CYCLE * hz)
    # Device bytes requested, by the broadcast rule (issue 19, the
    # emulator's device_request_bytes: the lanes of a SIMD-group loading one
    # address in one instruction make one request; the untiled kernel's K/V
    # rows, say, one per SIMD-group and key). Records without the rule's
    # counts (hand counts) take every load as its own request.
    reads = {f[5:]: v for f, v in c.items() if f.startswith("read_")}
    req = {n: c.get("req_" + n, v) for n, v in reads.items()}
    dev = sum(req.values()) + sum(v for f, v in c.items() if f.startswith("write_"))
    # DRAM bytes: K and V as the bytes new to their threadgroup (the
    # emulator's device_unique_bytes_read: SIMD-groups of one threadgroup
    # that read the same keys share them through the core's L1, an
    # assumption, decode's row groups), and at most once per (batch, kv head)
    # when other threadgroups re-read them, an estimate: the grid runs a
    # head's query blocks side by side (x fastest), and a head's K and V
    # (<= 4 MiB at Nk = 8192, D = 128, 16-bit) stay in the GPU's caches
    # meanwhile. Re-reads move over the on-GPU link (32 B per core-cycle).
    kv_once = s.b * s.hkv * s.nk * (s.d + (getattr(s, "dv", 0) or s.d)) * elem  # K, then V (D_v wide if MLA)
    kv_req = req.get("k", 0) + req.get("v", 0)
    kv_new = sum(c.get("dram_" + n, reads.get(n, 0)) for n in ("k", "v"))
    dram = dev - kv_req + min(kv_new, kv_once) if kv_req else dev
    stream = G.STREAM_CEILING[k["stream"]] * gpu.bandwidth_gbs * 1e9
    # Bytes that leave their core: re-reads by SIMD-groups of one threadgroup
    # are served by the core's L1 (the same assumption as the DRAM bytes).
    link = dev - kv_req + kv_new if kv_req else dev
    terms["memory"] = max(dram / stream, link / (active * ON_GPU_BYTES_PER_CYCLE * hz))
    if "decode" in r.kernel and "merge" not in r.kernel:
        # Unique bytes in flight per core: row groups that read the same keys
        # (threadgroup (32, 1, RGL), attention_decode.h) count once in lockstep.
        readers = r.threadgroup[2] if r.threadgroup[1] == 1 and k["lockstep"] else 1
        in_flight = sgs / readers * 32 * DECODE_ROWS_IN_FLIGHT * max(1, _dmax(r.kernel) // 32) * elem
        terms["little"] = dram / (active * in_flight / (G.DRAM_LATENCY_NS[k["dram"]] * 1e-9))
    onchip = c["threadgroup_bytes_read"] + c["threadgroup_bytes_written"] + dev
    terms["on-core data"] = onchip / (active * ON_CORE_BYTES_PER_CYCLE * hz) * quant
    return G.DISPATCH_OVERHEAD_S[k["overhead"]] + max(terms.values()), terms, sgs


def predict(records, gpu, s, dtype, causal, k=POINT):
    """(seconds, {term: seconds summed over dispatches}, resident SIMD-groups of the first)."""
    total, terms_sum, first = 0.0, {}, None
    for i, r in enumerate(records):
        t, terms, sgs = dispatch_time(r, i, gpu, s, dtype, causal, k)
        total += t
        first = sgs if first is None else first
        for name, v in terms.items():
            terms_sum[name] = terms_sum.get(name, 0.0) + v
    return total, terms_sum, first


def predict_band(records, gpu, s, dtype, causal):
    """(low, point, high) seconds: the point figures, and the least and most
    time over every uncertain figure at its fast end and at its slow end
    together (more residency can cost time through a worse last wave)."""
    corners = [predict(records, gpu, s, dtype, causal, k)[0] for k in (FAST, POINT, SLOW)]
    return min(corners), corners[1], max(corners)
