"""The backward's counts (issue 10): attention_backward runs in the
instrumented emulator (tests/backends.py emulated_metal_attention_backward,
launched from the host's own plan: the dQ kernel, then the dK/dV kernel).
Sizes too big to emulate are scaled by counts.py's rule (linear in B * H;
for Nq = Nk = n * 64, a polynomial of degree <= 2 in n, fixed by three
emulated sizes); tests/metal/test_metal_backward.py checks it on a fourth.
"""
import torch

from . import counts as C
from .counts import Shape
from .emulator import backends

_CACHE = {}


def _inputs(s: Shape, dtype, causal):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s.b, s.hq, s.nq, s.d, generator=g).to(dtype)
    k = torch.randn(s.b, s.hkv, s.nk, s.d, generator=g).to(dtype)
    v = torch.randn(s.b, s.hkv, s.nk, s.d_v, generator=g).to(dtype)
    out, lse = torch.ops.flash_metal.attention_forward(q, k, v, causal, None, "auto")
    return torch.randn(out.shape, generator=g).to(dtype), q, k, v, out, lse


def emulate(s: Shape, dtype, causal, impl="auto"):
    """The backward's dispatches in the instrumented emulator; exact counts. impl="tensor_ops": the tensor-op
    backward (attention_backward_mpp.h), in the published M5 lane layout (as counts.emulate runs the
    tensor-op forward)."""
    key = (s, dtype, causal, C._PAD, impl)
    if key not in _CACHE:
        backends.emulated_metal_attention_backward(*_inputs(s, dtype, causal), causal, None, None, instrumented=True,
                                                   impl=impl, mpp_layout="m5")
        _CACHE[key] = [C.Record(d.kernel_name, d.grid, d.threadgroup, d.threadgroup_memory, C.count_dict(d, c), False,
                                C.record_source(impl, True))
                       for d, c in backends.LAST_DISPATCHES]
    return _CACHE[key]


def scaled_counts(s: Shape, dtype, causal, base_ns=C.BASE_NS, impl="auto"):
    """counts.py's scaling rule for the backward (Nq = Nk = n * UNIT, Hq = Hkv)."""
    if s.nq != s.nk or s.nq % C.UNIT or s.hq != s.hkv:
        raise ValueError(f"the scaling rule needs Nq = Nk, a multiple of {C.UNIT}, and Hq = Hkv; got {s}")
    bases = [emulate(Shape(1, 1, 1, n * C.UNIT, n * C.UNIT, s.d, s.dv), dtype, causal, impl) for n in base_ns]
    n, heads = s.nq // C.UNIT, s.b * s.hq
    records = []
    for i, base in enumerate(bases[0]):
        counts = {}
        for field in base.counts:
            v = C.quadratic_at([(m, b[i].counts[field]) for m, b in zip(base_ns, bases)], n) * heads
            if v.denominator != 1:
                raise AssertionError(f"scaling rule gave a fractional {field}: {v}")
            counts[field] = int(v)
        grid = (base.grid[0] * n // base_ns[0], s.hq if i == 0 else s.hkv, s.b)
        records.append(C.Record(base.kernel, grid, base.threadgroup, base.tg_memory, counts, True,
                                C.record_source(impl, True)))
    return records


def counts_for(s: Shape, dtype, causal, base_ns=C.BASE_NS, impl="auto"):
    if s.b * s.hq * s.nq * s.nk <= C.MAX_EMULATED_PAIRS:
        return emulate(s, dtype, causal, impl)
    return scaled_counts(s, dtype, causal, base_ns, impl)
