"""M5's neural accelerators in the Metal performance model (issue 21, item 6).
Nothing here ran on a GPU: every figure is a prediction, and the tensor-op
rate itself is an estimate (core/gpus.py ACCEL_FLOPS_PER_CORE_CYCLE).

    python -m benchmarks.model accel [--quick]

1. The anchor. MLX's accelerator attention (steel_attention_nax.h; MLX PR
   #3943 measured 4.127 ms on an M5 Max, float16, 1 x 32 (8 KV) x 4096 x 96)
   is hand-counted in core/anchors.py (nax_counts), as the steel kernel is,
   and the time model predicts it within +-25 % (the `mlx-nax-m5-max` row of
   `anchors`). It pins the tensor-op rate and the softmax cost together: a
   model that ran matmul2d at the shader cores' rate misses by 2x (tested).
2. Our simdgroup kernels moved to tensor ops (`on_tensor_ops`): the
   emulator's counts of the simdgroup prefill and backward with every 8x8x8
   MMA moved to tensor ops: the same loads, barriers and softmax, the
   products at the accelerator's rate. What the simdgroup kernels' design
   would gain (for the backward, beside our tensor-op backward, item 4).
3. Our tensor-op forward (impl='tensor_ops', attention_prefill_mpp.h), from
   its own counts (`tensor_ops_records`): the emulator runs the MPP kernel
   and counts its matmul2d runs and FLOPs, exp2 calls, barriers (none),
   threadgroup stores and the device bytes new to each threadgroup, exactly.
   What the emulator cannot know is how matmul2d itself moves its operands
   (it reads them lane by lane, as no GPU does): `on_hardware` replaces
   that with MLX's hand count's rule, each SIMD-group asking for its
   operands once per run (a 32-key block of K or V from device memory, its
   16 Q rows and P from threadgroup memory). Q itself is read from device
   memory once, by the kernel's own staging code (counted exactly). Large
   shapes are scaled from one-threadgroup launches (`mpp_scaled_counts`,
   exact: tested).
4. Our tensor-op backward (attention_backward_mpp.h), from its own counts
   (`tensor_ops_backward_records`: core/backward_counts.py's emulation and
   scaling rule with impl='tensor_ops', "m5" layout), matmul2d's operand
   traffic replaced by the same rule (`backward_on_hardware`): each run asks
   for its device operand (32 rows of K or V in the dQ kernel, the
   SIMD-group's 16 rows of K or V in the dK/dV kernel) and its threadgroup
   operands (tiles; the dK/dV kernel's Q / dO block, staged once per
   threadgroup and shared by its SIMD-groups) once.
   16-bit inputs only: the kernels take float16 / bfloat16 (P and dS rounded
   to them before their products), so every backward figure here is float16.
"""
import contextlib
import os
import re

import torch

from ..core import anchors as A
from ..core import backward_counts as BM
from ..core import counts as M
from ..core import gpus as G
from ..core import timing as T
from . import bookkeeping as MB

MMA_FLOPS = 2 * 8 * 8 * 8  # one simdgroup_multiply_accumulate on 8x8 tiles


def on_tensor_ops(records):
    """The same dispatches with every simdgroup MMA moved to tensor ops
    (mpp_flops at gpus.tensor_op_rate); loads, barriers, softmax kept."""
    out = []
    for r in records:
        c = dict(r.counts)
        c["mpp_flops"] = c.get("mpp_flops", 0) + c["simdgroup_mmas"] * MMA_FLOPS
        c["simdgroup_mmas"] = 0
        out.append(r._replace(counts=c))
    return out


# The tensor-op prefill's blocks (csrc/metal/plan_detail.h, kTensorOpsBlockQ / kTensorOpsBlockK): 64 query rows
# per threadgroup, 4 SIMD-groups of 16 rows, 32 keys per block. At D = 256 the split-D kernel
# (attention_prefill_mpp_dsplit.h, kTensorOpsDsplitBlockQ): 32 query rows, 2 pairs of SIMD-groups, each half of a
# pair owning D / 2 features, so each matmul2d's operands are D / 2 wide.
MPP_BQ, MPP_BK, MPP_ROWS = 64, 32, 16
DSPLIT_D, DSPLIT_BQ, DSPLIT_HALVES = 256, 32, 2
# The split-D kernel's 64-row variant (flash_attention_prefill_mpp_dsplit_wide; kTensorOpsDsplitWideBlockQ / K):
# 64 query rows (8 SIMD-groups), 16 keys per block (the register budget: Q is held in registers).
DSPLIT_WIDE_BQ, DSPLIT_WIDE_BK = 64, 16
# The routing's switch (csrc/metal/families/tensor_ops_dsplit.cpp): which split-D kernel a plan at D = 256 takes.
DSPLIT_ROWS_ENV = "FLASH_METAL_TENSOR_OPS_DSPLIT_ROWS"
_ROWS_CACHES = {}


@contextlib.contextmanager
def dsplit_rows(rows):
    """Within it, every plan at D = 256 (forced or Auto) takes the `rows`-row split-D kernel (the routing's
    switch), and the emulated counts and the timing model's plans are cached apart per kernel: the scaling
    rules' small launches and the full shape's plan must be of one kernel (core/timing.py checks it)."""
    saved_env, saved_cache = os.environ.get(DSPLIT_ROWS_ENV), M._CACHE
    os.environ[DSPLIT_ROWS_ENV] = str(rows)
    M._CACHE = _ROWS_CACHES.setdefault(rows, {})
    T._planned.cache_clear()
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop(DSPLIT_ROWS_ENV, None)
        else:
            os.environ[DSPLIT_ROWS_ENV] = saved_env
        M._CACHE = saved_cache
        T._planned.cache_clear()


def _bq(d, rows=DSPLIT_BQ):
    return rows if d == DSPLIT_D else MPP_BQ


def _bk(d, rows=DSPLIT_BQ):
    return DSPLIT_WIDE_BK if d == DSPLIT_D and rows == DSPLIT_WIDE_BQ else MPP_BK


def _rows_context(d, rows):
    return dsplit_rows(rows) if d == DSPLIT_D else contextlib.nullcontext()


def _per_block(dtype, d, rows=DSPLIT_BQ, dv=0):
    """The tensor-op kernel's counts per threadgroup (fixed) and per key block (each block a threadgroup runs),
    non-causal: from two emulated launches of one threadgroup, over one and over two key blocks. dv: v's own
    head dim (the MLA pair), 0 for d."""
    bq, bk = _bq(d, rows), _bk(d, rows)
    with _rows_context(d, rows):
        [one] = M.emulate("tensor_ops", M.Shape(1, 1, 1, bq, bk, d, dv), dtype, False)
        [two] = M.emulate("tensor_ops", M.Shape(1, 1, 1, bq, 2 * bk, d, dv), dtype, False)
    block = {f: two.counts[f] - one.counts[f] for f in one.counts}
    fixed = {f: one.counts[f] - block[f] for f in one.counts}
    return fixed, block


def mpp_scaled_counts(s: M.Shape, dtype, rows=DSPLIT_BQ):
    """The tensor-op forward's counts, non-causal, Nq % 64 == Nk % 32 == 0: every threadgroup (one per 64
    query rows of one query head) runs Nk / 32 identical key blocks, so its counts are the fixed part plus
    the per-block part per block (exact: tests/model/test_metal_model_accel.py checks a direct emulation). At
    D = 256 `rows` picks the split-D kernel: 32 rows and 32 keys, or 64 rows and 16 keys."""
    bq, bk = _bq(s.d, rows), _bk(s.d, rows)
    if s.nq % bq or s.nk % bk:
        raise ValueError(f"the tensor-op scaling rule needs Nq % {bq} == Nk % {bk} == 0; got {s}")
    fixed, block = _per_block(dtype, s.d, rows, s.dv)
    tgs, blocks = s.b * s.hq * (s.nq // bq), s.nk // bk
    counts = {f: tgs * (fixed[f] + blocks * block[f]) for f in fixed}
    with _rows_context(s.d, rows):
        d = M.plan("tensor_ops", s, dtype, False).dispatches[0]
    return [M.Record(d.kernel_name, d.grid, d.threadgroup, d.threadgroup_memory, counts, True, ("tensor_ops", False))]


def on_hardware(records, dtype, d, dv=0):
    """The tensor-op kernel's counts with matmul2d's operand traffic as a GPU would ask for it. The emulator's
    run() reads an operand lane by lane, a row of A and a column of B for every destination element, as no GPU
    does; here each run asks for each operand once, as in MLX's hand count (core/anchors.py nax_counts): per S = Q K^T run a
    32-key K block from device memory (req_ = read_) and its SIMD-group's 16 Q rows from threadgroup memory;
    per O += P V run a V block and the 16 x 32 P tile. Kept from the emulator: everything the kernel's own
    code does (Q's one read from device memory and its staging, P's and the row factors' stores and loads),
    and the device bytes new to each threadgroup (dram_, the L1 rule), which do not depend on how lanes
    split a load. Exact for launches whose every matmul2d destination slot is valid (the "m5" layout
    M.emulate runs: 16 x 32 and 16 x D tiles, D a multiple of 16). The split-D kernel (D = 256): the same rule
    with D / 2 (each SIMD-group's runs take its half of K, V and Q); its partial scores' exchange is the
    kernel's own code (threadgroup stores and loads, barriers), kept from the emulator. Its 64-row variant
    (_bq64_bk16_): blocks of 16 keys, and Q in registers (a left-input cooperative tensor, which the emulator
    moves between lanes, not through threadgroup memory): its S runs read no threadgroup operand, so only P's
    16 x 16 tile is asked for once per P.V run (on-core data in registers is not priced: an assumption).
    dv: the MLA pair's v head dim (V blocks and O's product dv wide), 0 for d."""
    elem = torch.empty((), dtype=dtype).element_size()
    out = []
    full_d = d
    for r in records:
        d = full_d // DSPLIT_HALVES if "_dsplit_" in r.kernel else full_d
        bk = int(re.search(r"_bk(\d+)", r.kernel).group(1))
        q_in_registers = "_dsplit_" in r.kernel and f"_bq{DSPLIT_WIDE_BQ}_" in r.kernel
        d_v = d if "_dsplit_" in r.kernel else (dv or d)
        c = dict(r.counts)
        pairs = c["mpp_runs"] // 2  # one S = Q K^T and one O += P V per SIMD-group and key block
        for n, width in (("k", d), ("v", d_v)):
            c["read_" + n] = c["req_" + n] = pairs * bk * width * elem
        # The emulator's run() reads its threadgroup operands (Q's rows for S when staged, P for O) once per
        # destination element: 16 x BK x D elements for S (when Q is staged), 16 x D_v x BK for O.
        lane_by_lane = pairs * MPP_ROWS * bk * ((0 if q_in_registers else d) + d_v) * elem
        once = MPP_ROWS * bk + (0 if q_in_registers else MPP_ROWS * d)
        c["threadgroup_bytes_read"] += pairs * once * elem - lane_by_lane
        out.append(r._replace(counts=c))
    return out


def tensor_ops_records(s: M.Shape, dtype, causal, rows=DSPLIT_BQ):
    """Our tensor-op forward's dispatch, from the MPP kernel's emulated counts (on_hardware's rule for
    matmul2d's operands): non-causal by mpp_scaled_counts, causal by core/counts.py's quadratic rule. At D = 256
    `rows` picks the split-D kernel (32 or 64 rows); price them inside dsplit_rows(rows) too (the timing
    model plans the shape again)."""
    if causal or s.nq % _bq(s.d, rows) or s.nk % _bk(s.d, rows):
        with _rows_context(s.d, rows):
            recs = M.counts_for("tensor_ops", s, dtype, causal)
    else:
        recs = mpp_scaled_counts(s, dtype, rows)
    return on_hardware(recs, dtype, s.d, s.dv)


# The tensor-op backward's blocks (csrc/metal/plan_detail.h, kTensorOpsBackwardBlock): SIMD-groups of 16 rows,
# 32 keys per dQ block, 32 query rows per dK/dV block.
MPP_BWD_BLOCK = 32
# The split-D backward's dK/dV block (csrc/metal/plan_detail.h, kTensorOpsDsplitBackwardBlock): 16 query rows.
DSPLIT_BWD_BQ = 16


def backward_on_hardware(records, dtype, d, dv=0):
    """The tensor-op backward's counts with matmul2d's operands asked for once per run (on_hardware's rule).
    dQ kernel, per SIMD-group and key block, 3 runs: S = Q.K^T and dP = dO.V^T (Q, dO tiles from threadgroup
    memory; K, V blocks from device memory), dQ += dS.K (dS tile, K block). dK/dV kernel, per SIMD-group, query
    head and query block, 4 runs: S^T = K.Q^T, dP^T = V.dO^T, dV += P^T.dO, dK += dS^T.Q: the SIMD-group's 16
    rows of K and V from device memory; the Q and dO block from threadgroup memory, where the threadgroup staged
    it once for its SIMD-groups (the kernel's own loads: device bytes and threadgroup stores counted exactly by
    the emulator, kept); P^T and dS^T from the SIMD-group's tiles. The device operands read by matmul2d (k, v in
    both kernels) have their read_ / req_ bytes replaced; the kernels' own loads and the dram_ bytes (the L1
    rule) are kept. The emulator reads a threadgroup operand element by element, M x N x K elements per run:
    in the dQ kernel one per run, in the dK/dV kernel one in S^T's and dP^T's runs, two in dV's and dK's.
    dv: the MLA pair's v head dim (V, dO, dP's reduction and dV dv wide; Q, K, dQ, dK d wide), 0 for d."""
    elem = torch.empty((), dtype=dtype).element_size()
    out = []
    full_d = d
    for r in records:
        c = dict(r.counts)
        dkdv = "_dkdv_" in r.kernel
        # The split-D kernels (D = 256, attention_backward_mpp_dsplit.h): the same rule at D / 2 per SIMD-group
        # (each half's runs take its features of Q, K, V, dO), 16 queries per dK/dV block; their partials'
        # exchange is the kernels' own code (threadgroup stores, loads, barriers), kept from the emulator.
        dsplit = "_dsplit_" in r.kernel
        d = full_d // DSPLIT_HALVES if dsplit else full_d
        d_v = d if dsplit else (dv or d)
        bq = DSPLIT_BWD_BQ if dsplit and dkdv else MPP_BWD_BLOCK
        runs = c["mpp_runs"]
        blocks = runs // (4 if dkdv else 3)
        # Device operand bytes matmul2d asks for per streamed block: dQ: K twice (32 rows), V once; dK/dV: the
        # SIMD-group's 16 rows of K and of V once each.
        device = {"k": MPP_ROWS * d * elem, "v": MPP_ROWS * d_v * elem} if dkdv \
            else {"k": 2 * bq * d * elem, "v": bq * d_v * elem}
        for n, per in device.items():
            c["read_" + n] = c["req_" + n] = blocks * per
        if dkdv:
            once = 2 * bq * (d + d_v) + 2 * MPP_ROWS * bq  # Q, dO (twice each), P^T, dS^T
            lane_by_lane = 3 * MPP_ROWS * bq * (d + d_v)  # S^T, dP^T: K x 16 x 32; dV, dK: 2 x 16 x width x 32
        else:
            once = MPP_ROWS * (d + d_v) + MPP_ROWS * bq  # Q, dO, dS
            lane_by_lane = MPP_ROWS * bq * (2 * d + d_v)  # S over d, dP over d_v, dQ 16 x d x 32
        c["threadgroup_bytes_read"] += blocks * (once - lane_by_lane) * elem
        out.append(r._replace(counts=c))
    return out


def dsplit_backward_scaled_counts(s: M.Shape, dtype):
    """The split-D backward's counts (D = 256), non-causal, Nq % 16 == Nk % 32 == 0, Hq = Hkv: each dQ
    threadgroup (16 rows of one head) runs Nk / 32 identical key blocks and each dK/dV threadgroup (32 keys of
    one head) Nq / 16 identical query blocks, so a kernel's counts are its threadgroups times a fixed part plus
    a part per block, fixed by three one-head launches of (Nq, Nk) = (16, 32), (16, 64), (32, 32) (exact:
    tests/model/test_metal_model_accel.py checks a direct emulation; seconds where BM.scaled_counts' 256-token
    launches take minutes)."""
    if s.nq % DSPLIT_BWD_BQ or s.nk % MPP_BWD_BLOCK or s.hq != s.hkv or s.d != DSPLIT_D:
        raise ValueError(f"the split-D backward scaling rule needs D = 256, Nq % 16 == Nk % 32 == 0, Hq = Hkv; got {s}")
    base = {ab: BM.emulate(M.Shape(1, 1, 1, DSPLIT_BWD_BQ * ab[0], MPP_BWD_BLOCK * ab[1], DSPLIT_D), dtype, False,
                           impl="tensor_ops") for ab in ((1, 1), (1, 2), (2, 1))}
    out = []
    # dQ: threadgroups along Nq (a), blocks along Nk (b); dK/dV: threadgroups along Nk, blocks along Nq.
    for i, (tgs, blocks, step) in enumerate(((s.nq // DSPLIT_BWD_BQ, s.nk // MPP_BWD_BLOCK, (1, 2)),
                                             (s.nk // MPP_BWD_BLOCK, s.nq // DSPLIT_BWD_BQ, (2, 1)))):
        one, two = base[(1, 1)][i], base[step][i]
        counts = {}
        for f in one.counts:
            block = two.counts[f] - one.counts[f]
            counts[f] = s.b * s.hq * tgs * (one.counts[f] - block + blocks * block)
        grid = (tgs, s.hq, s.b)
        out.append(M.Record(one.kernel, grid, one.threadgroup, one.tg_memory, counts, True, one.source))
    return out


def tensor_ops_backward_records(s: M.Shape, dtype, causal):
    """Our tensor-op backward's two dispatches (impl='tensor_ops'), from their emulated counts, on_hardware
    (at D = 256, non-causal and aligned, by dsplit_backward_scaled_counts)."""
    if s.d == DSPLIT_D and not causal and not (s.nq % DSPLIT_BWD_BQ or s.nk % MPP_BWD_BLOCK) and s.hq == s.hkv \
            and s.b * s.hq * s.nq * s.nk > M.MAX_EMULATED_PAIRS:
        return backward_on_hardware(dsplit_backward_scaled_counts(s, dtype), dtype, s.d)
    return backward_on_hardware(BM.counts_for(s, dtype, causal, impl="tensor_ops"), dtype, s.d, s.dv)


M5_FAMILY = ("M5 (10-core)", "M5 Pro", "M5 Max")
# The shape of the D = 256 verdict (csrc/metal/families/tensor_ops_dsplit.cpp, kDsplitModelWins): MLX's
# anchor's heads and length (#3943) at head dim 256.
DSPLIT_SHAPE = M.Shape(1, 32, 8, 4096, 4096, DSPLIT_D)


def dsplit_against_simdgroup(gpus=M5_FAMILY, causals=(False, True), s=DSPLIT_SHAPE):
    """The split-D tensor-op forward (impl='tensor_ops' at D = 256) against the simdgroup prefill at D = 256,
    float16, each from its own emulated counts: {(gpu, causal): (simdgroup band, tensor-op band, bound)},
    bands (low, point, high) in seconds."""
    out = {}
    for gname in gpus:
        gpu = G.BY_NAME[gname]
        for causal in causals:
            simd = T.predict_band(M.counts_for("prefill", s, torch.float16, causal), gpu, s, torch.float16, causal)
            tops, bound = dsplit_band(s, gpu, causal, DSPLIT_BQ)
            out[(gname, causal)] = (simd, tops, bound)
    return out


def dsplit_band(s: M.Shape, gpu, causal, rows, dtype=torch.float16):
    """(band, bound) of the `rows`-row split-D kernel at `s` on `gpu`, from its emulated counts."""
    recs = tensor_ops_records(s, dtype, causal, rows)
    with dsplit_rows(rows):
        band = T.predict_band(recs, gpu, s, dtype, causal)
        terms = T.predict(recs, gpu, s, dtype, causal)[1]
    return band, max(terms, key=terms.get)


def wide_ahead(wide, narrow):
    """The 64-row kernel ahead over its whole band: faster at the low end, the point and the high end each."""
    return all(w < n for w, n in zip(wide, narrow))


def wide_against_32(gpus=M5_FAMILY, causals=(False, True), shapes=(DSPLIT_SHAPE,)):
    """The 64-row split-D kernel against the 32-row one, float16: {(gpu, shape, causal): (32-row band, bound,
    64-row band, bound)}."""
    out = {}
    for gname in gpus:
        gpu = G.BY_NAME[gname]
        for s in shapes:
            for causal in causals:
                out[(gname, s, causal)] = dsplit_band(s, gpu, causal, DSPLIT_BQ) + dsplit_band(s, gpu, causal,
                                                                                                DSPLIT_WIDE_BQ)
    return out


def dsplit_model_wins(results):
    """The routing verdict: the tensor-op point ahead of the simdgroup point on every (GPU, causal) priced."""
    return all(tops[1] < simd[1] for simd, tops, _ in results.values())


def print_dsplit(quick=False):
    gpus = M5_FAMILY[-1:] if quick else M5_FAMILY
    res = dsplit_against_simdgroup(gpus)
    wide = wide_against_32(gpus)
    s = DSPLIT_SHAPE
    print(f"\n### D = 256 split along D (1x{s.hq}({s.hkv})x{s.nq}x{s.d} f16): model, not measurement")
    print("| chip | causal | simdgroup prefill ms | split-D 32 rows ms (bound) | split-D 64 rows ms (bound) "
          "| 64 rows vs 32 | 64 rows vs simdgroup |")
    print("|---|---|---|---|---|---|---|")
    for (gname, causal), (simd, tops, bound) in res.items():
        _, _, w, wb = wide[(gname, s, causal)]
        print(f"| {gname} | {causal} | {_ms(simd)} | {_ms(tops)} ({bound}) | {_ms(w)} ({wb}) "
              f"| {tops[1] / w[1]:.2f}x{' (whole band)' if wide_ahead(w, tops) else ''} | {simd[1] / w[1]:.2f}x |")
    print("Auto and impl='tensor_ops' take the 64-row kernel when its grid has at least 2 threadgroups per core "
          "(csrc/metal/families/tensor_ops_dsplit.cpp, kDsplitWideMinPerCore; the model's sweep there), else the "
          "32-row kernel; FLASH_METAL_TENSOR_OPS_DSPLIT_ROWS=32 / 64 forces one.")
    print(f"Verdict for Auto (kDsplitModelWins): {dsplit_model_wins(res)}. Context, not an anchor: MLX #3842 "
          "measured its D = 256 d-split kernel 1.18-1.55x over its unfused path on an M5 Max at GQA 32/8 and "
          "64/8, qL 1024-2048, kL 16K-32K (a different shape and baseline).")
    return res


# The D = 256 backward verdict's shape (kDsplitBackwardModelWins): DSPLIT_SHAPE's, MHA because the backward
# model's scaling rule needs Hq = Hkv (the same FLOPs as 32 (8); GQA only lowers K / V traffic).
DSPLIT_BWD_SHAPE = DSPLIT_SHAPE._replace(hkv=DSPLIT_SHAPE.hq)


def dsplit_backward_against_simdgroup(gpus=M5_FAMILY, causals=(False, True), s=DSPLIT_BWD_SHAPE):
    """The split-D tensor-op backward (impl='tensor_ops' at D = 256) against the simdgroup backward at D = 256,
    float16, each from its own emulated counts: {(gpu, causal): (simdgroup band, tensor-op band, bound)}."""
    out = {}
    for gname in gpus:
        gpu = G.BY_NAME[gname]
        for causal in causals:
            simd = T.predict_band(BM.counts_for(s, torch.float16, causal), gpu, s, torch.float16, causal)
            recs = tensor_ops_backward_records(s, torch.float16, causal)
            tops = T.predict_band(recs, gpu, s, torch.float16, causal)
            terms = T.predict(recs, gpu, s, torch.float16, causal)[1]
            out[(gname, causal)] = (simd, tops, max(terms, key=terms.get))
    return out


def print_dsplit_backward(quick=False):
    res = dsplit_backward_against_simdgroup(M5_FAMILY[-1:] if quick else M5_FAMILY)
    s = DSPLIT_BWD_SHAPE
    print(f"\n### Backward at D = 256 split along D (1x{s.hq}({s.hkv})x{s.nq}x{s.d} f16): model, not measurement")
    print("| chip | causal | simdgroup backward ms | split-D tensor-op backward ms (bound) | speed-up |")
    print("|---|---|---|---|---|")
    for (gname, causal), (simd, tops, bound) in res.items():
        print(f"| {gname} | {causal} | {_ms(simd)} | {_ms(tops)} ({bound}) | {simd[1] / tops[1]:.2f}x |")
    print(f"Verdict for Auto (kDsplitBackwardModelWins): {dsplit_model_wins(res)}. No anchor runs a backward on "
          "the accelerators; not yet verified on Apple hardware.")


# The MLA pair's verdict (csrc/metal/families/tensor_ops.cpp, kMlaModelWins): DeepSeek-V2-Lite's 16 heads
# (MHA: the backward model's scaling rule needs Hq = Hkv), 4096 tokens, q/k 192 and v 128.
MLA_SHAPE = M.Shape(1, 16, 16, 4096, 4096, 192, 128)


def mla_against_simdgroup(gpus=M5_FAMILY, causals=(False, True), s=MLA_SHAPE):
    """The tensor-op forward and backward at the MLA pair against the simdgroup kernels (the prefill and the
    backward at bucket 192, each operand at its own width), float16, each from its own emulated counts:
    {(gpu, pass, causal): (simdgroup band, tensor-op band, bound)}, bands (low, point, high) in seconds."""
    out = {}
    for gname in gpus:
        gpu = G.BY_NAME[gname]
        for causal in causals:
            for pas in ("forward", "backward"):
                simd_recs = M.counts_for("prefill", s, torch.float16, causal) if pas == "forward" \
                    else BM.counts_for(s, torch.float16, causal)
                recs = tensor_ops_records(s, torch.float16, causal) if pas == "forward" \
                    else tensor_ops_backward_records(s, torch.float16, causal)
                simd = T.predict_band(simd_recs, gpu, s, torch.float16, causal)
                tops = T.predict_band(recs, gpu, s, torch.float16, causal)
                terms = T.predict(recs, gpu, s, torch.float16, causal)[1]
                out[(gname, pas, causal)] = (simd, tops, max(terms, key=terms.get))
    return out


def mla_model_wins(results):
    """The routing verdict: the tensor-op point ahead of the simdgroup point on every (GPU, pass, causal)."""
    return all(tops[1] < simd[1] for simd, tops, _ in results.values())


def print_mla(quick=False):
    res = mla_against_simdgroup(M5_FAMILY[-1:] if quick else M5_FAMILY)
    s = MLA_SHAPE
    print(f"\n### The MLA pair (1x{s.hq}x{s.nq}x({s.d}, {s.dv}) f16): model, not measurement")
    print("| chip | pass | causal | simdgroup ms | tensor-op ms (bound) | speed-up |")
    print("|---|---|---|---|---|---|")
    for (gname, pas, causal), (simd, tops, bound) in res.items():
        print(f"| {gname} | {pas} | {causal} | {_ms(simd)} | {_ms(tops)} ({bound}) | {simd[1] / tops[1]:.2f}x |")
    print(f"Verdict for Auto (kMlaModelWins): {mla_model_wins(res)}. No anchor runs this pair on the accelerators.")
    return res


def _ms(band):
    low, point, high = band
    return f"{point * 1e3:.3g} ({low * 1e3:.3g}-{high * 1e3:.3g})"


def accelerators(quick=False):
    """Forward and backward on the M5 family, simdgroup kernels against the same counts on tensor ops."""
    print("\n## M5's neural accelerators (Metal 4 tensor ops): model, not measurement")
    print("Tensor-op rate per core-cycle, (low, point, high) FLOPs: "
          + "; ".join(f"M{g}: {G.tensor_op_rate(g)}" for g in (3, 5))
          + " (M5: estimate from an A19 and an M5 Pro microbenchmark; M3/M4: the shader cores). "
          "'simdgroup on tensor ops' = our simdgroup kernels' emulator counts with the MMAs moved to matmul2d; "
          "'tensor-op kernel' = our forward / backward on matmul2d (impl='tensor_ops') from its own emulated "
          "counts (tensor_ops_records, tensor_ops_backward_records); 'MLX NAX' = MLX's accelerator kernel, hand-counted.")
    shapes = [M.Shape(1, 32, 8, 4096, 4096, 96)] if quick else [M.Shape(1, 32, 8, 4096, 4096, 96),
                                                                M.Shape(1, 32, 8, 4096, 4096, 128)]
    print("| chip | shape | pass | causal | simdgroup ms | simdgroup on tensor ops ms (bound) | speed-up "
          "| tensor-op kernel ms (bound) | MLX NAX ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for gname in (M5_FAMILY[-1:] if quick else M5_FAMILY):
        gpu = G.BY_NAME[gname]
        for shape in shapes:
            for causal in (False, True):
                for pas in ("forward", "backward"):
                    # The backward model's scaling rule needs Hq = Hkv: its rows are the MHA shape.
                    s = shape if pas == "forward" else shape._replace(hkv=shape.hq)
                    recs = M.counts_for("prefill", s, torch.float16, causal) if pas == "forward" \
                        else BM.counts_for(s, torch.float16, causal)
                    moved = on_tensor_ops(recs)
                    simd = T.predict_band(recs, gpu, s, torch.float16, causal)
                    tops = T.predict_band(moved, gpu, s, torch.float16, causal)
                    terms = T.predict(moved, gpu, s, torch.float16, causal)[1]
                    nax = "" if pas == "backward" or causal else _ms(
                        T.predict_band(A.nax_records(s, torch.float16), gpu, s, torch.float16, causal))
                    recs = tensor_ops_records(s, torch.float16, causal) if pas == "forward" \
                        else tensor_ops_backward_records(s, torch.float16, causal)
                    band, terms_k = (T.predict_band(recs, gpu, s, torch.float16, causal),
                                     T.predict(recs, gpu, s, torch.float16, causal)[1])
                    ours = f"{_ms(band)} ({max(terms_k, key=terms_k.get)})"
                    rows.append((gname, s, pas, causal, simd[1], tops[1]))
                    print(f"| {gname} | 1x{s.hq}:{s.hkv}x{s.nq}x{s.d} f16 | {pas} | {causal} | {_ms(simd)} "
                          f"| {_ms(tops)} ({max(terms, key=terms.get)}) | {simd[1] / tops[1]:.2f}x | {ours} | {nax} |")
    print("Our tensor-op forward has MLX's counts (tests/model/test_metal_model_accel.py), Q read from device memory "
          "once included, except that each SIMD-group stages its 16 Q rows in threadgroup memory (MLX keeps them "
          "in registers) and P too, which matmul2d reads from there every key block (on-core data). Our tensor-op "
          "backward: float16 (its kernels take 16-bit inputs); its dK/dV kernel stages each Q / dO block once per "
          "threadgroup for its 4 SIMD-groups; not yet verified on Apple hardware; no anchor runs "
          "a backward on the accelerators (mtlattn reports ~5.8 TFLOPS on an M5 Pro, varlen, unverified here).")
    print_dsplit(quick)
    print_dsplit_backward(quick)
    print_mla(quick)
    MB.print_bookkeeping()
    post = post_point()
    print(f"The post's M5 point (10-core M5, N = 2048, d = 64, causal, one head): simdgroup float32 "
          f"{_ms(post['simdgroup'])} ms; tensor ops {_ms(post['tensor_ops'])} ms, which ASSUMES float32 with "
          "relaxed precision (TF32-style, as MLX runs float32 on the accelerators) at the 16-bit rate; exact "
          "float32 stays on the simdgroup kernel. The post measured 2.159 ms for its tiled float32 kernel.")
    return rows


def post_point():
    """The post's shape on the post's M5, simdgroup prefill against the same counts on tensor ops (float32)."""
    gpu = G.BY_NAME[G.POST_GPU]
    s = M.Shape(1, 1, 1, 2048, 2048, 64)
    recs = M.counts_for("prefill", s, torch.float32, True)
    return {"simdgroup": T.predict_band(recs, gpu, s, torch.float32, True),
            "tensor_ops": T.predict_band(on_tensor_ops(recs), gpu, s, torch.float32, True)}

