"""The backends the op tests run on: cpu, emulated Metal, and (on a Mac) mps.

"metal-emu" is test-only: it runs the op's own C++ planning code
(torch.ops.flash_metal.metal_plan, the code the MPS backend runs) and hands
the plan to the Metal emulator instead of a command encoder, so every shader
is exercised on Linux exactly as the MPS host would launch it.
"""
import functools
import json
import os

import pytest
import torch

import flash_metal
from shader_builds import (SHADER, SPLITD_BACKWARD_KERNELS, WIDE_DECODE_KERNELS, is_quant_decode, is_splitd_backward,
                           is_wide_decode,
                           shipped_library)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The MSL 4 library (Metal 4 tensor ops, impl='tensor_ops'): a library of its
# own, as on a Mac, where attention.metal stays MSL 3.1.
MPP_SHADER = os.path.join(ROOT, "shaders", "attention_mpp.metal")
MPP_KERNEL_PREFIX = "flash_attention_prefill_mpp_"
# Every kernel of the MSL 4 library: the forward's and the backward's
# (csrc/metal/plan.h, is_tensor_ops_kernel).
MPP_KERNEL_PREFIXES = (MPP_KERNEL_PREFIX, "flash_backward_mpp_")
# The D = 256 split-D forward (attention_prefill_mpp_dsplit.h) stays out of
# the default MPP build (CI time: only tests/metal/test_metal_tensor_ops_d256.py and
# the model run it); metal_mpp_dsplit_library builds it alone.
MPP_DSPLIT_KERNELS = "flash_attention_prefill_mpp_dsplit_*"
# The D = 256 split-D backward (attention_backward_mpp_dsplit.h): also out of
# the default MPP build; metal_mpp_dsplit_backward_library builds it alone
# (tests/metal/test_metal_tensor_ops_backward_d256.py, the model).
MPP_DSPLIT_BACKWARD_KERNELS = "flash_backward_mpp_dsplit_*"
# The MLA pair's kernels (a v head dim of its own: "_dqk<D>_dv<DV>_" in the
# name) stay out of it too (CI time: tests/metal/test_metal_tensor_ops_mla.py and
# the model run them); metal_mpp_mla_library builds them alone.
MPP_MLA_KERNELS = "flash_*_mpp_*_dqk*"


# FLASH_METAL_MPS_FULL=1 runs every mps case of the op grids. By default only
# a smoke set runs (mps_smoke_selection): the hosted macOS runners' GPU is a
# paravirtual device that has failed allocations and given wrong MPSGraph
# results, and the full grid on it takes a long time and says little more.
MPS_FULL_ENV = "FLASH_METAL_MPS_FULL"
# The GPU families (MTLGPUFamily) with simdgroup matrices, which the prefill
# and backward kernels are built on: Apple7 and newer Apple families, and Mac2
# (Apple's Metal feature set tables, "SIMD-group matrix"). Every Apple-silicon
# Mac is Apple7 or newer; a device with neither is a virtual or foreign GPU.
SIMDGROUP_MATRIX_FAMILIES = ("Apple7", "Apple8", "Apple9", "Apple10", "Mac2")


def metal_device_info():
    """torch.ops.flash_metal.metal_device_info() as a dict; raises if the op is missing or fails."""
    return json.loads(torch.ops.flash_metal.metal_device_info())


def device_family_gaps(info) -> list:
    """What the device's GPU families (metal_device_info's "device"."families") rule out, as sentences.

    Reports; never raises. A family the OS could not be asked about (null)
    rules nothing out.
    """
    device = (info or {}).get("device") or {}
    families = device.get("families") or {}
    answers = [families.get(f) for f in SIMDGROUP_MATRIX_FAMILIES]
    if answers and all(a is False for a in answers if a is not None) and any(a is False for a in answers):
        return [f"no simdgroup matrices (the device is in none of {', '.join(SIMDGROUP_MATRIX_FAMILIES)}): "
                "the prefill and backward kernels cannot run on it"]
    return []


@functools.lru_cache(maxsize=None)
def mps_skip_reason():
    """None if the mps tests can run here; else why not (the skip reason they report).

    MPS must be present and really working (hosted macOS runners have reported
    it while failing simple ops), and the device's GPU family must not rule out
    the kernels (device_family_gaps, when the metal_device_info op is built).
    """
    if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        return "no usable MPS device (torch.backends.mps.is_available() is False)"
    try:
        x = torch.arange(4.0, device="mps")
        if (x * 2).sum().item() != 12.0:
            return "no usable MPS device: (arange(4) * 2).sum() on MPS is not 12"
    except Exception as err:  # noqa: BLE001  (any failure means: not usable)
        return f"no usable MPS device: a trivial MPS op failed ({type(err).__name__}: {err})"
    try:
        info = metal_device_info()
    except Exception:  # noqa: BLE001  (an older build without the op: nothing to rule out)
        return None
    gaps = device_family_gaps(info)
    if gaps:
        name = (info.get("device") or {}).get("name", "?")
        return f"the MPS device ({name}) cannot run these kernels: " + "; ".join(gaps)
    return None


def mps_usable() -> bool:
    """MPS present, really working, and of a GPU family that can run the kernels (see mps_skip_reason)."""
    return mps_skip_reason() is None


def mps_full() -> bool:
    """Whether the full mps grid runs (FLASH_METAL_MPS_FULL=1) rather than the smoke set."""
    return os.environ.get(MPS_FULL_ENV) == "1"


def _param_values(item):
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return set()
    return {(name, repr(value)) for name, value in callspec.params.items()}


def mps_smoke_selection(items):
    """The smoke set out of the mps cases `items` (pytest items of any test functions).

    Per test function, a greedy cover of its parameters' values: every value
    each parameter takes in that function's mps grid (each dtype, head dim,
    shape, layout, causal or not ...) appears in at least one kept case, so the
    smoke set touches every kernel family and option the full grid does, in
    far fewer cases. Deterministic: the same items give the same selection.
    Returns the kept items, in their original order.
    """
    by_test = {}
    for item in items:
        by_test.setdefault(item.nodeid.split("[", 1)[0], []).append(item)
    kept = set()
    for group in by_test.values():
        values = [_param_values(item) for item in group]
        uncovered = set().union(*values)
        while True:
            gains = [len(v & uncovered) for v in values]
            best = max(range(len(group)), key=lambda i: (gains[i], -i))
            if gains[best] == 0:
                break
            kept.add(id(group[best]))
            uncovered -= values[best]
        if not any(id(item) in kept for item in group):  # no parameters at all: keep the one case
            kept.add(id(group[0]))
    return [item for item in items if id(item) in kept]


def select_mps_cases(items, full=None):
    """Splits collected `items` into (kept, deselected): the mps cases outside the
    smoke set are deselected unless `full` (default: FLASH_METAL_MPS_FULL=1).
    Cases on other backends are always kept."""
    if full is None:
        full = mps_full()
    mps = [item for item in items if item.get_closest_marker("mps_backend") is not None]
    if full or not mps:
        return list(items), []
    smoke = {id(item) for item in mps_smoke_selection(mps)}
    kept = [item for item in items if item.get_closest_marker("mps_backend") is None or id(item) in smoke]
    deselected = [item for item in mps if id(item) not in smoke]
    return kept, deselected


# The fast-math flavour's kernels. Its tests (tests/metal/test_fast_math.py and the
# fast_math cases of the kernel files) run every forward kernel but only a few
# backward and decode buckets, so the flavour is a partial library
# (metal_emulator.compile_library's `only`): the whole of attention.metal under
# -ffast-math was the CI run's slowest build. A fast-math test reaching past
# this list fails with the emulator's "no kernel named ..." error, which names
# what the library holds; add its pattern here.
FAST_MATH_KERNELS = (
    "flash_attention_untiled_*",
    "flash_attention_tiled_*",
    "flash_attention_prefill_float*",  # the FA2 template's (not split-D's: no fast-math test runs it)
    "flash_attention_prefill_bfloat*",
    "flash_decode*_d32",  # test_sinks' decode cases
    "flash_decode*_d64",  # test_nonfinite's D = 40, test_metal_features' cases
    "flash_backward_*_d64_*",  # test_metal_backward's fast-math buckets 64 and 256
    "flash_backward_*_d256_*",
    "flash_sinks_grad",
)


@functools.lru_cache(maxsize=None)
def metal_library(instrumented: bool, fast_math: bool = False):
    """The default build of attention.metal: every kernel but the wide decode's (shader_builds)."""
    only = FAST_MATH_KERNELS if fast_math else None
    return shipped_library(instrumented=instrumented, fast_math=fast_math, only=only)


# The wide decode kernels' own partial libraries (the default builds leave them
# out: tests/shader_builds.py). The sanitizing one holds bfloat16's only: the
# sanitized wide runs (tests/metal/test_metal_decode_wide.py,
# tests/model/test_metal_model_decode_wide.py) use that dtype, and every kernel of
# the build costs minutes at -O1 with the checks. A wide run outside these
# lists fails with the emulator's "no kernel named ..." error; add it here.
SANITIZED_WIDE_DECODE_KERNELS = ("flash_decode*_bfloat16_d512", "flash_decode*_bfloat16_d576")


@functools.lru_cache(maxsize=None)
def wide_decode_library(instrumented: bool):
    from metal_emulator import compile_library

    only = SANITIZED_WIDE_DECODE_KERNELS if instrumented else WIDE_DECODE_KERNELS
    return compile_library([SHADER], instrumented=instrumented, only=only)


@functools.lru_cache(maxsize=None)
def quant_decode_library(instrumented: bool, suffix: str):
    """The quantized-cache decode's partial library for one "<dtype>_d<bucket>" (the default builds leave
    them out: tests/shader_builds.py): its one-pass and split kernels and the merge its split runs."""
    from metal_emulator import compile_library

    only = tuple(f"flash_decode_{k}{suffix}" for k in ("quant_", "quant_split_", "merge_"))
    return compile_library([SHADER], instrumented=instrumented, only=only)


@functools.lru_cache(maxsize=None)
def splitd_backward_library(instrumented: bool):
    """The split-D backward's partial library (the default builds leave it out: tests/shader_builds.py),
    with flash_sinks_grad, which its plans with sinks run after it."""
    from metal_emulator import compile_library

    return compile_library([SHADER], instrumented=instrumented, only=SPLITD_BACKWARD_KERNELS + ("flash_sinks_grad",))


@functools.lru_cache(maxsize=None)
def metal_mpp_library(instrumented: bool, fast_math: bool = False):
    from metal_emulator import compile_library

    return compile_library([MPP_SHADER], instrumented=instrumented, fast_math=fast_math, msl=4,
                           exclude=[MPP_DSPLIT_KERNELS, MPP_DSPLIT_BACKWARD_KERNELS, MPP_MLA_KERNELS])


@functools.lru_cache(maxsize=None)
def metal_mpp_mla_library(instrumented: bool, fast_math: bool = False):
    """The tensor-op kernels of the MLA pair (q/k 192, v 128) alone (a partial MSL 4 build)."""
    from metal_emulator import compile_library

    return compile_library([MPP_SHADER], instrumented=instrumented, fast_math=fast_math, msl=4,
                           only=[MPP_MLA_KERNELS])


@functools.lru_cache(maxsize=None)
def metal_mpp_dsplit_library(instrumented: bool, fast_math: bool = False):
    """The D = 256 split-D tensor-op forward alone (a partial MSL 4 build: seconds, not minutes)."""
    from metal_emulator import compile_library

    return compile_library([MPP_SHADER], instrumented=instrumented, fast_math=fast_math, msl=4,
                           only=[MPP_DSPLIT_KERNELS])


@functools.lru_cache(maxsize=None)
def metal_mpp_dsplit_backward_library(instrumented: bool, fast_math: bool = False):
    """The D = 256 split-D tensor-op backward alone (its dQ and dK/dV kernels, both dtypes: a partial build)."""
    from metal_emulator import compile_library

    return compile_library([MPP_SHADER], instrumented=instrumented, fast_math=fast_math, msl=4,
                           only=[MPP_DSPLIT_BACKWARD_KERNELS])


# What each dispatch of the last emulated call reported (the emulator's
# per-dispatch counts), for the counting tests and the model (benchmarks/model).
LAST_DISPATCHES: list = []
# The reasons of the emulated calls that ran the composite path (no kernel of
# ours: csrc/composite.h), for the tests that prove it ran.
COMPOSITE_RUNS: list = []


def _option_tensors(q, attn_mask=None, cu_seqlens_q=None, cu_seqlens_k=None, sinks=None):
    """The options' bindings, as the MPS host binds them: the mask expanded to
    (B, Hq, Nq, Nk) as a stride-0 view (never materialized), the varlen offsets,
    the sinks as contiguous float32 (attention_mps.mm, sinks_as_float32), and q
    in every slot that has nothing (csrc/metal/plan.h)."""
    t = {"attn_mask": q, "cu_seqlens_q": q, "cu_seqlens_k": q, "sinks": q, "block_table": q, "cache_seqlens": q}
    if attn_mask is not None:
        t["attn_mask"] = attn_mask
    if cu_seqlens_q is not None:
        t["cu_seqlens_q"], t["cu_seqlens_k"] = cu_seqlens_q, cu_seqlens_k
    if sinks is not None:
        t["sinks"] = sinks.float().contiguous()
    return t


def _expanded_mask(attn_mask, q, k):
    if attn_mask is None:
        return None
    return attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def emulated_metal_attention(q, k, v, causal=False, scale=None, impl="auto", instrumented=False, fast_math=False,
                             gpu="base", attn_mask=None, window_left=-1, window_right=-1, softcap=0.0, sinks=None,
                             mpp_layout="scrambled", mpp_seed=1):
    """attention_forward through the Metal emulator. mpp_layout / mpp_seed: the
    cooperative-tensor lane layout of MPP kernels (impl='tensor_ops'), "m5" or
    "scrambled" (tests/metal_emulator/README.md, "MPP tensor ops")."""
    options = dict(attn_mask=attn_mask, window_left=window_left, window_right=window_right, softcap=softcap,
                   sinks=sinks)
    plan = flash_metal.explain(q, k, v, causal, scale, impl, gpu, **options)
    if not plan.dispatches:  # the composite path: the op's own code (csrc/composite.cpp) on CPU tensors
        COMPOSITE_RUNS.append(plan.reason)
        return flash_metal.attention_with_lse(q, k, v, causal, scale, "composite", **options)
    B, H, N, _ = q.shape
    # Outputs and scratch poisoned with NaN: an element never written stays NaN.
    # out has v's head dim (D_v: q's, except in MLA-style calls).
    out = torch.full((B, H, N, v.shape[-1]), float("nan"), dtype=q.dtype)
    lse = torch.full((B, H, N), float("nan"), dtype=torch.float32)
    tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse,
               **_option_tensors(q, _expanded_mask(attn_mask, q, k), sinks=sinks)}
    for name, n in plan.scratch.items():
        tensors[name] = torch.full((max(n, 1),), float("nan"), dtype=torch.float32)
    _run_plan(plan, tensors, instrumented, fast_math, mpp_layout=mpp_layout, mpp_seed=mpp_seed)
    return out, lse


def emulated_metal_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, scale=None,
                          impl="auto", instrumented=False, window_left=-1, window_right=-1, softcap=0.0, sinks=None,
                          mpp_layout="scrambled", mpp_seed=1):
    """attention_varlen_forward through the Metal emulator: q, k, v packed (total, H, D).
    mpp_layout / mpp_seed: as emulated_metal_attention's."""
    varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                  max_seqlen_k=max_seqlen_k)
    plan = flash_metal.explain(q, k, v, causal, scale, impl, window_left=window_left, window_right=window_right,
                               softcap=softcap, sinks=sinks, **varlen)
    if not plan.dispatches:  # the composite path (see emulated_metal_attention)
        COMPOSITE_RUNS.append(plan.reason)
        return flash_metal.attention_varlen_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                     causal, scale, window_left, window_right, softcap, "composite",
                                                     sinks)
    T, H, _ = q.shape
    out = torch.full((T, H, v.shape[-1]), float("nan"), dtype=q.dtype)  # v's head dim (D_v)
    lse = torch.full((H, T), float("nan"), dtype=torch.float32)
    tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse,
               **_option_tensors(q, None, cu_seqlens_q, cu_seqlens_k, sinks)}
    for name, n in plan.scratch.items():
        tensors[name] = torch.full((max(n, 1),), float("nan"), dtype=torch.float32)
    _run_plan(plan, tensors, instrumented, False, mpp_layout=mpp_layout, mpp_seed=mpp_seed)
    return out, lse


def emulated_metal_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None, causal=False, scale=None,
                           impl="auto", instrumented=False, window_left=-1, window_right=-1, softcap=0.0, sinks=None,
                           k_scale=None, k_bias=None, v_scale=None, v_bias=None, k_format="auto", v_format="auto",
                           library=None, extra_constants=None):
    """attention_kvcache through the Metal emulator, as the MPS host runs it (attention_mps.mm).

    The plan is the op's own (explain with cache_seqlens): the decode
    kernels reading the table, bound to the caches themselves, block_table
    and cache_seqlens (a plain cache: the op's table of row b per batch);
    or, on the gather path, the varlen plan run on the rows in use gathered
    as csrc/kvcache.cpp gathers them (flash_metal._kvcache, the same rule).
    A quantized cache (k_scale, ..., as the op takes them): the quantized
    decode kernels, with the scales and biases bound as the MPS host binds
    them (a slot without one: the side's scale, or q) and KvQuantParams;
    library: a build to run them from (default quant_decode_library);
    extra_constants: {index: value} added to the kernels' function constants
    (a patched build's planted switches, tests/metal/test_metal_decode_quant.py).
    Returns (out (B, Hq, Nq, D_v), lse (B, Hq, Nq)), outputs poisoned with NaN.
    """
    options = dict(window_left=window_left, window_right=window_right, softcap=softcap, sinks=sinks)
    quant = dict(k_scale=k_scale, k_bias=k_bias, v_scale=v_scale, v_bias=v_bias, k_format=k_format, v_format=v_format)
    plan = flash_metal.explain(q, k_cache, v_cache, causal, scale, impl, block_table=block_table,
                               cache_seqlens=cache_seqlens, **options, **quant)
    B, Hq, Nq, _ = q.shape
    if "gather path" in plan.reason:
        from flash_metal import _kvcache

        table = (torch.arange(B)[:, None] if block_table is None else block_table).to(torch.int64)
        lengths = cache_seqlens.to(torch.int64)
        rows = _kvcache.rows_in_use(table, k_cache.shape[1], torch.zeros_like(lengths), lengths)
        k, v = _kvcache.gather(k_cache, rows), _kvcache.gather(v_cache, rows)
        cu_q = (torch.arange(B + 1) * Nq).to(torch.int32)
        max_k = int(lengths.max()) if B else 0
        out, lse = emulated_metal_varlen(q.transpose(1, 2).reshape(B * Nq, Hq, -1), k, v, cu_q,
                                         _kvcache.cumulative(lengths), Nq, max_k, causal, scale,
                                         instrumented=instrumented, **options)
        return (out.view(B, Nq, Hq, -1).transpose(1, 2).contiguous(),
                lse.view(Hq, B, Nq).permute(1, 0, 2).contiguous())
    d_v = v_cache.shape[3] if v_scale is None else v_cache.shape[3] * (v_cache.element_size() * 8 // 4 if
                                                                          v_bias is not None else 1)
    out = torch.full((B, Hq, Nq, d_v), float("nan"), dtype=q.dtype)
    lse = torch.full((B, Hq, Nq), float("nan"), dtype=torch.float32)
    if block_table is None:
        block_table = torch.arange(B, dtype=torch.int32)[:, None]
    tensors = {"q": q, "k": k_cache, "v": v_cache, "out": out, "lse": lse, **_option_tensors(q, sinks=sinks),
               "block_table": block_table, "cache_seqlens": cache_seqlens.contiguous()}
    for side, scale_, bias_ in (("k", k_scale, k_bias), ("v", v_scale, v_bias)):
        if bias_ is not None and (bias_.stride() != scale_.stride() or scale_.stride(-1) != 1):
            scale_, bias_ = scale_.contiguous(), bias_.contiguous()  # as scales_for_metal (csrc/kvcache_quant.h)
        tensors[f"{side}_scale"] = q if scale_ is None else scale_
        tensors[f"{side}_bias"] = bias_ if bias_ is not None else tensors[f"{side}_scale"]
    for name, n in plan.scratch.items():
        tensors[name] = torch.full((max(n, 1),), float("nan"), dtype=torch.float32)
    _run_plan(plan, tensors, instrumented, False, library=library, extra_constants=extra_constants)
    return out, lse


def emulated_metal_attention_backward(grad_out, q, k, v, out, lse, causal=False, scale=None, grad_lse=None,
                                      instrumented=False, fast_math=False, gpu="base", seed=0, attn_mask=None,
                                      window_left=-1, window_right=-1, softcap=0.0, cu_seqlens_q=None,
                                      cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, sinks=None, impl="auto",
                                      mpp_layout="scrambled", mpp_seed=1):
    """attention_backward (or, with cu_seqlens, attention_varlen_backward) through the Metal emulator,
    launched from the op's own backward plan.

    seed: the emulator's thread schedule (0: fixed order; else a seeded shuffle), for determinism tests.
    impl: "auto" or "tensor_ops"; mpp_layout / mpp_seed: as emulated_metal_attention's.
    Returns (grad_q, grad_k, grad_v), and grad_sinks (float32, as the kernel writes it) last with sinks.
    """
    options = dict(attn_mask=attn_mask, window_left=window_left, window_right=window_right, softcap=softcap,
                   cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                   max_seqlen_k=max_seqlen_k, sinks=sinks)
    plan = flash_metal.explain(q, k, v, causal, scale, impl, gpu, backward=True, grad_out=grad_out, out=out,
                               lse=lse, grad_lse=grad_lse, **options)
    if not plan.dispatches:  # the composite path (see emulated_metal_attention)
        COMPOSITE_RUNS.append(plan.reason)
        if cu_seqlens_q is None:
            grads = torch.ops.flash_metal.attention_backward(grad_out, q, k, v, out, lse, causal, scale, grad_lse,
                                                             "composite", attn_mask, window_left, window_right,
                                                             softcap, sinks)
        else:
            grads = torch.ops.flash_metal.attention_varlen_backward(
                grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                grad_lse, window_left, window_right, softcap, "composite", sinks)
        return tuple(grads) if sinks is not None else tuple(grads[:3])
    # Gradients and scratch poisoned with NaN: an element never written stays NaN.
    if cu_seqlens_q is None:
        grads = [torch.full(t.shape, float("nan"), dtype=t.dtype) for t in (q, k, v)]
        bound = grads
    else:  # the kernels write packed (1, H, total, D) buffers, returned as (total, H, D) views
        bound = [torch.full((1, t.shape[1], t.shape[0], t.shape[2]), float("nan"), dtype=t.dtype) for t in (q, k, v)]
        grads = [b.transpose(1, 2).squeeze(0) for b in bound]
    tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "grad_out": grad_out,
               "grad_q": bound[0], "grad_k": bound[1], "grad_v": bound[2],
               # Without grad_lse the plan binds lse in its place (csrc/metal/plan.h), as the MPS host does.
               "grad_lse": lse if grad_lse is None else grad_lse,
               **_option_tensors(q, None if cu_seqlens_q is not None else _expanded_mask(attn_mask, q, k),
                                 cu_seqlens_q, cu_seqlens_k, sinks)}
    for name, n in plan.scratch.items():
        tensors[name] = torch.full((max(n, 1),), float("nan"), dtype=torch.float32)
    if sinks is not None:
        tensors["grad_sinks"] = torch.full((q.shape[1],), float("nan"))  # Hq, 4-D or packed
        grads.append(tensors["grad_sinks"])
    _run_plan(plan, tensors, instrumented, fast_math, seed, mpp_layout=mpp_layout, mpp_seed=mpp_seed)
    return tuple(grads)


# Function constants the MSL 4 library's kernels do not declare: the simdgroup
# prefill's and backward's align_q / align_k / dense (1, 2, 10). The plan
# carries them false; Metal ignores values set for constants a function does
# not declare, the emulator refuses them, so they are dropped. has_grad_lse
# (3) is declared by the tensor-op backward (attention_backward_mpp.h).
MPP_UNDECLARED_CONSTANTS = (1, 2, 10)


def _run_plan(plan, tensors, instrumented, fast_math, seed=0, mpp_layout="scrambled", mpp_seed=1, library=None,
              extra_constants=None):
    LAST_DISPATCHES.clear()
    given_library = library
    quant_plan = any(is_quant_decode(d.kernel_name) for d in plan.dispatches)
    # A split-D backward plan runs all of its dispatches (flash_sinks_grad too) from its partial library.
    splitd = any(is_splitd_backward(d.kernel_name) for d in plan.dispatches) and not fast_math
    # Each dispatch bound from the plan's binding table, exactly as
    # csrc/mps/attention_mps.mm binds, in the plan's order.
    for d in plan.dispatches:
        constants = dict(enumerate(d.function_constants))
        if extra_constants and d.quant_params_index:
            constants.update(extra_constants)
        extra = {}
        if d.kernel_name.startswith(MPP_KERNEL_PREFIXES):
            if d.kernel_name.startswith(MPP_KERNEL_PREFIX + "dsplit_"):
                build = metal_mpp_dsplit_library
            elif d.kernel_name.startswith("flash_backward_mpp_dsplit_"):
                build = metal_mpp_dsplit_backward_library
            elif "_dqk" in d.kernel_name:
                build = metal_mpp_mla_library
            else:
                build = metal_mpp_library
            library = build(instrumented, fast_math)
            assert not any(constants.pop(i, False) for i in MPP_UNDECLARED_CONSTANTS), d.function_constants
            extra = dict(mpp_layout=mpp_layout, mpp_seed=mpp_seed)
        elif splitd:
            library = splitd_backward_library(instrumented)
        elif is_wide_decode(d.kernel_name) and not fast_math:
            library = wide_decode_library(instrumented)
        elif given_library is not None:
            library = given_library
        elif is_quant_decode(d.kernel_name) or (quant_plan and "merge" in d.kernel_name):
            library = quant_decode_library(instrumented, d.kernel_name.rsplit("_", 2)[-2] + "_" +
                                           d.kernel_name.rsplit("_", 1)[-1])
        else:
            library = metal_library(instrumented, fast_math)
        by = {d.params_index: d.params}
        if d.quant_params_index:  # the quantized decode's KvQuantParams (setBytes, as the MPS host)
            by[d.quant_params_index] = d.quant_params
        counts = library.dispatch(
            d.kernel_name,
            buffers={index: tensors[name] for name, index in d.buffers.items()},
            bytes=by,
            function_constants=constants,
            grid=d.grid,
            threadgroup=d.threadgroup,
            threadgroup_memory={d.threadgroup_memory_index: d.threadgroup_memory} if d.threadgroup_memory else {},
            seed=seed,
            **extra,
        )
        LAST_DISPATCHES.append((d, counts))


def to_mps_same_layout(t):
    """Copies t to MPS keeping its exact view: same strides, same storage offset."""
    base = t._base if t._base is not None else t
    return base.to("mps").as_strided(t.size(), t.stride(), t.storage_offset())


def _mps_options(options):
    """The options' tensors (attn_mask, sinks) on MPS, in their own layouts."""
    return {n: (to_mps_same_layout(t) if isinstance(t, torch.Tensor) else t) for n, t in options.items()}


def _metal_emu_flags(backend):
    return dict(instrumented=backend == "metal-emu-sanitized")


def run_attention(backend, q, k, v, causal=False, scale=None, impl="auto", **options):
    """Runs attention_forward on `backend`; inputs and results live on the CPU.

    options: attn_mask, window_left, window_right, softcap (as the op takes them).
    """
    if backend == "cpu":
        return flash_metal.attention_with_lse(q, k, v, causal, scale, impl, **options)
    if backend in ("metal-emu", "metal-emu-sanitized"):
        return emulated_metal_attention(q, k, v, causal, scale, impl, **_metal_emu_flags(backend), **options)
    if backend == "metal-emu-fast-math":  # the shaders built with -ffast-math (see test_fast_math.py)
        return emulated_metal_attention(q, k, v, causal, scale, impl, fast_math=True, **options)
    if backend == "mps":
        dev = [to_mps_same_layout(t) for t in (q, k, v)]
        out, lse = flash_metal.attention_with_lse(*dev, causal, scale, impl, **_mps_options(options))
        return out.cpu(), lse.cpu()
    raise ValueError(backend)


def run_varlen(backend, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, scale=None,
               impl="auto", **options):
    """Runs attention_varlen_forward on `backend` (options: window_left, window_right, softcap)."""
    args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)
    if backend == "cpu":
        return flash_metal.attention_varlen_with_lse(q, k, v, *args, impl=impl, **options)
    if backend in ("metal-emu", "metal-emu-sanitized"):
        return emulated_metal_varlen(q, k, v, *args, impl=impl, **_metal_emu_flags(backend), **options)
    if backend == "mps":
        dev = [to_mps_same_layout(t) for t in (q, k, v)]
        out, lse = flash_metal.attention_varlen_with_lse(
            *dev, cu_seqlens_q.to("mps"), cu_seqlens_k.to("mps"), *args[2:], impl=impl, **_mps_options(options)
        )
        return out.cpu(), lse.cpu()
    raise ValueError(backend)


def run_backward(backend, grad_out, q, k, v, out, lse, causal=False, scale=None, grad_lse=None, impl="auto",
                 **options):
    """Runs attention_backward on `backend`; inputs and gradients live on the CPU.

    out and lse are the forward's results (from any backend: the backward
    only needs them to be the attention of q, k, v). options: attn_mask,
    window_left, window_right, softcap, sinks. impl: "auto", or "tensor_ops" on the Metal backends.
    Returns (grad_q, grad_k, grad_v), and grad_sinks last with sinks (every backend).
    """
    args = (grad_out, q, k, v, out, lse)
    n = _n_grads(options)
    if backend == "cpu":
        return torch.ops.flash_metal.attention_backward(*args, causal, scale, grad_lse, impl, **options)[:n]
    if backend in ("metal-emu", "metal-emu-sanitized", "metal-emu-fast-math"):
        return emulated_metal_attention_backward(
            *args, causal, scale, grad_lse, instrumented=backend == "metal-emu-sanitized",
            fast_math=backend == "metal-emu-fast-math", impl=impl, **options,
        )
    if backend == "mps":
        dev = [to_mps_same_layout(t) for t in args]
        g = None if grad_lse is None else to_mps_same_layout(grad_lse)
        return tuple(t.cpu() for t in torch.ops.flash_metal.attention_backward(*dev, causal, scale, g, impl,
                                                                              **_mps_options(options))[:n])
    raise ValueError(backend)


def _n_grads(options):
    """The backward's outputs a run_* helper returns: q, k and v's gradients, and the sinks' with sinks."""
    return 4 if options.get("sinks") is not None else 3


def run_varlen_backward(backend, grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, causal=False, scale=None, grad_lse=None, **options):
    """Runs attention_varlen_backward on `backend` (options: window_left, window_right, softcap, sinks);
    returns the gradients as run_backward does."""
    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    n = _n_grads(options)
    if backend == "cpu":
        return torch.ops.flash_metal.attention_varlen_backward(
            grad_out, q, k, v, out, lse, *lengths, causal, scale, grad_lse, **options
        )[:n]
    if backend in ("metal-emu", "metal-emu-sanitized"):
        return emulated_metal_attention_backward(
            grad_out, q, k, v, out, lse, causal, scale, grad_lse, instrumented=backend == "metal-emu-sanitized",
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, **options,
        )
    if backend == "mps":
        dev = [to_mps_same_layout(t) for t in (grad_out, q, k, v, out, lse)]
        g = None if grad_lse is None else to_mps_same_layout(grad_lse)
        grads = torch.ops.flash_metal.attention_varlen_backward(
            *dev, cu_seqlens_q.to("mps"), cu_seqlens_k.to("mps"), max_seqlen_q, max_seqlen_k, causal, scale, g,
            **_mps_options(options),
        )
        return tuple(t.cpu() for t in grads[:n])
    raise ValueError(backend)


def backend_param(name):
    """A pytest param for `name`, skipped (and reported as skipped) where unavailable.

    mps cases also carry the `mps_backend` mark: `pytest -m mps_backend` runs
    the real Metal tests, and tests/conftest.py keeps only their smoke set
    unless FLASH_METAL_MPS_FULL=1 (select_mps_cases).
    """
    if name == "mps":
        reason = mps_skip_reason()
        return pytest.param(name, marks=[pytest.mark.mps_backend,
                                         pytest.mark.skipif(reason is not None, reason=reason or "")])
    return pytest.param(name)
