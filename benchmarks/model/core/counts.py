"""The model's counts (issue 9): each kernel runs in the instrumented Metal
emulator (tests/backends.py emulated_metal_attention, launched from the
host's own plan), which counts per dispatch: device bytes read/written per
tensor, threadgroup bytes, simdgroup MMAs, exp2 calls, barriers,
threadgroups. Problems too big to emulate are SCALED (marked "scaled" in
every table) by the rule of `scaled_counts`: heads are independent (linear
in B * Hq), and for Nq = Nk = n * UNIT every count is a polynomial of degree
<= 2 in n (each query block does work linear in its visible key blocks, and
there are n of them), so three emulated sizes fix it exactly;
tests/model/test_metal_model.py checks the fit against a fourth emulated size.
The backward's counts: backward_counts.py, on the same rule.
"""
import contextlib
from fractions import Fraction
from typing import NamedTuple

import torch

import flash_metal

from .emulator import backends

# Aligned-size unit of the scaling rule: a multiple of every query block (32
# rows) and key block (8, 16, 32 keys) the planner picks, so that n -> n + 1
# adds whole blocks and every block keeps the same shape.
UNIT = 64
BASE_NS = (2, 3, 4)  # the three emulated sizes n * UNIT that fix the quadratic
# Largest problem (query-key pairs summed over heads) emulated directly; above
# it the scaling rule is used. 512 x 512 runs in about a second.
MAX_EMULATED_PAIRS = 512 * 512


class Shape(NamedTuple):
    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int
    dv: int = 0  # v's head dim when it has its own (MLA, issue 20 section 2); 0: d

    @property
    def d_v(self):
        return self.dv or self.d


class Record(NamedTuple):
    """One dispatch: the plan's launch and its counts (exact or scaled)."""
    kernel: str
    grid: tuple
    threadgroup: tuple
    tg_memory: int
    counts: dict
    scaled: bool
    source: tuple = None  # (impl, backward): the plan that launched it, for the planner's per-chip estimates


def dtype_name(dt):
    return str(dt).replace("torch.", "")


def _inputs(s: Shape, dtype, real: bool):
    if real:
        g = torch.Generator().manual_seed(0)
        return (torch.randn(s.b, s.hq, s.nq, s.d, generator=g).to(dtype),
                torch.randn(s.b, s.hkv, s.nk, s.d, generator=g).to(dtype),
                torch.randn(s.b, s.hkv, s.nk, s.d_v, generator=g).to(dtype))
    # planning only: zero-stride views, no memory
    one = torch.empty(1, 1, 1, s.d, dtype=dtype)
    one_v = torch.empty(1, 1, 1, s.d_v, dtype=dtype)
    return one.expand(s.b, s.hq, s.nq, s.d), one.expand(s.b, s.hkv, s.nk, s.d), one_v.expand(s.b, s.hkv, s.nk, s.d_v)


def plan(impl, s: Shape, dtype, causal):
    return flash_metal.explain(*_inputs(s, dtype, real=False), causal, None, impl, "base")


def available(impl) -> bool:
    """The plan for impl names kernels the emulator's library has (the new kernels land during issue 9)."""
    s = Shape(1, 1, 1, 4 if impl.startswith("decode") else 64, 64, 64)
    names = set(backends.metal_library(True).kernel_names())  # no clang: the emulator's own error, not "absent"
    try:
        return all(d.kernel_name in names for d in plan(impl, s, torch.float16, False).dispatches)
    except Exception:  # noqa: BLE001  (a planner that refuses the impl means: not available)
        return False


def count_dict(d, c):
    out = {f: getattr(c, f) for f in ("threadgroups", "threads", "threadgroup_barriers", "simdgroup_mmas",
                                      "exp2_calls", "threadgroup_bytes_read", "threadgroup_bytes_written")}
    if getattr(c, "mpp_flops", 0):  # Metal 4 tensor ops (impl='tensor_ops'): matmul2d runs and their 2 M N K
        out["mpp_runs"], out["mpp_flops"] = c.mpp_runs, c.mpp_flops
    for name, index in d.buffers.items():  # tensors by name; the params struct (bytes=) is left out
        out["read_" + name] = c.device_bytes_read_by_index[index]
        out["write_" + name] = c.device_bytes_written_by_index[index]
        # The traffic rules (issue 19, timing.py): bytes new to their threadgroup (DRAM, if the L1
        # keeps what a threadgroup shares) and bytes requested after the broadcast rule.
        out["dram_" + name] = c.device_unique_bytes_read_by_index[index]
        out["req_" + name] = c.device_request_bytes_by_index[index]
    return out


_CACHE = {}
# The bucket padded_to() runs every plan in (None: the planner's own).
_PAD = None


def record_source(impl, backward):
    """A Record's source: the plan, and under padded_to() the bucket it was planned in."""
    return (impl, backward) + ((_PAD,) if _PAD else ())


@contextlib.contextmanager
def padded_to(bucket):
    """Within it, every plan of a head dim under `bucket` is the one the
    planner makes for `bucket` (kernel, blocks, grid, threadgroup memory,
    alignment constants), carrying the real head dim's params and the general
    loader (fc_dense off, as for any padded D): the launch a padded bucket
    makes, such as D = 192 in the 256-wide kernels before the 192 bucket
    (issue 20 section 3), emulated exactly. Prefill and backward plans."""
    global _PAD
    real = flash_metal.explain

    def widened(t):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[-1] >= bucket:
            return t
        return torch.empty(1, dtype=t.dtype).expand(*t.shape[:-1], bucket)

    def explain(*args, **kw):
        own = real(*args, **kw)
        if args[0].shape[-1] >= bucket:
            return own
        wide = real(*(widened(a) for a in args), **{n: widened(a) for n, a in kw.items()})
        if any(d.kernel_name.startswith("flash_decode") for d in wide.dispatches):
            raise ValueError("padded_to: prefill and backward plans only (a decode split count depends on D)")
        dense = 10  # kDenseFunctionConstant (csrc/metal/plan.h)
        dispatches = tuple(w._replace(params=o.params, function_constants=w.function_constants[:dense] + (False,) +
                                      w.function_constants[dense + 1:])
                           for w, o in zip(wide.dispatches, own.dispatches))
        return own._replace(dispatches=dispatches, reason=wide.reason)

    saved, _PAD = _PAD, bucket
    flash_metal.explain = explain
    try:
        yield
    finally:
        flash_metal.explain, _PAD = real, saved


def emulate(impl, s: Shape, dtype, causal):
    """Runs the plan's dispatches in the instrumented emulator; exact counts."""
    key = (impl, s, dtype, causal, _PAD)
    if key not in _CACHE:
        # Tensor-op kernels in the published M5 lane layout: the scrambled one (the tests') has invalid
        # cooperative-tensor slots, which the kernel's element loops also visit (exp2 calls, loads).
        backends.emulated_metal_attention(*_inputs(s, dtype, real=True), causal, None, impl, instrumented=True,
                                          mpp_layout="m5")
        _CACHE[key] = [Record(d.kernel_name, d.grid, d.threadgroup, d.threadgroup_memory, count_dict(d, c), False,
                              record_source(impl, False))
                       for d, c in backends.LAST_DISPATCHES]
    return _CACHE[key]


def quadratic_at(points, x):
    """The degree-2 polynomial through three (n, value) points, at x (exact, Lagrange)."""
    total = Fraction(0)
    for i, (xi, yi) in enumerate(points):
        term = Fraction(yi)
        for j, (xj, _) in enumerate(points):
            if j != i:
                term *= Fraction(x - xj, xi - xj)
        total += term
    return total


# Index of fc_pack_gqa (kPackGqaFunctionConstant, csrc/metal/plan.h): the prefill packs a GQA group's heads.
PACK_GQA = 13


def pack_group(impl, s: Shape, dtype, causal):
    """G when the plan's prefill packs GQA (one threadgroup per (batch, kv head, packed block)), else 1."""
    fc = plan(impl, s, dtype, causal).dispatches[0].function_constants
    return s.hq // s.hkv if len(fc) > PACK_GQA and fc[PACK_GQA] else 1


def scaled_counts(impl, s: Shape, dtype, causal, base_ns=BASE_NS):
    """Counts of a problem too big to emulate, from three emulated ones.

    Rule: every (batch, query head) runs the same dispatches on its own data,
    so counts are linear in B * Hq; for Nq = Nk = n * UNIT, counts of one head
    are a polynomial of degree <= 2 in n, fixed by n in base_ns. Only for
    query-block kernels (not decode) with Nq = Nk a multiple of UNIT. A packed
    GQA prefill (fc_pack_gqa) shares K/V tiles within a group, so its unit is
    one (batch, kv head) with its G query heads: linear in B * Hkv."""
    if s.nq != s.nk or s.nq % UNIT or impl.startswith("decode"):
        raise ValueError(f"the scaling rule needs Nq = Nk, a multiple of {UNIT}, and a query-block kernel; got {s}")
    g = pack_group(impl, s, dtype, causal)
    bases = [emulate(impl, Shape(1, g, 1, n * UNIT, n * UNIT, s.d, s.dv), dtype, causal) for n in base_ns]
    full = plan(impl, s, dtype, causal).dispatches
    n = s.nq // UNIT
    heads = s.b * (s.hkv if g > 1 else s.hq)
    records = []
    for i, d in enumerate(full):
        counts = {}
        for field in bases[0][i].counts:
            v = quadratic_at([(m, b[i].counts[field]) for m, b in zip(base_ns, bases)], n) * heads
            if v.denominator != 1:
                raise AssertionError(f"scaling rule gave a fractional {field}: {v}")
            counts[field] = int(v)
        records.append(Record(d.kernel_name, d.grid, d.threadgroup, d.threadgroup_memory, counts, True,
                              record_source(impl, False)))
    return records


def counts_for(impl, s: Shape, dtype, causal, base_ns=BASE_NS):
    if s.b * s.hq * s.nq * s.nk <= MAX_EMULATED_PAIRS or impl.startswith("decode"):
        return emulate(impl, s, dtype, causal)
    return scaled_counts(impl, s, dtype, causal, base_ns)
