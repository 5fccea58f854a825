"""The backends the op tests run on: cpu, emulated Metal, and (on a Mac) mps.

"metal-emu" is test-only: it runs the op's own C++ planning code
(torch.ops.flash_metal.metal_plan, the code the MPS backend runs) and hands
the plan to the Metal emulator instead of a command encoder, so every shader
is exercised on Linux exactly as the MPS host would launch it.
"""
import functools
import os

import pytest
import torch

import flash_metal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHADER = os.path.join(ROOT, "shaders", "attention.metal")


@functools.lru_cache(maxsize=None)
def mps_usable() -> bool:
    """MPS present and really working (hosted macOS runners report it but cannot run kernels)."""
    if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        return False
    try:
        x = torch.arange(4.0, device="mps")
        return (x * 2).sum().item() == 12.0
    except Exception:  # noqa: BLE001  (any failure means: not usable)
        return False


@functools.lru_cache(maxsize=None)
def metal_library(instrumented: bool, fast_math: bool = False):
    from metal_emulator import compile_library

    return compile_library([SHADER], instrumented=instrumented, fast_math=fast_math)


# What each dispatch of the last emulated call reported (the emulator's
# per-dispatch counts), for the counting tests and benchmarks.metal_model.
LAST_DISPATCHES: list = []


def emulated_metal_attention(q, k, v, causal=False, scale=None, impl="auto", instrumented=False, fast_math=False,
                             gpu="base"):
    plan = flash_metal.explain(q, k, v, causal, scale, impl, gpu)
    B, H, N, D = q.shape
    # Outputs and scratch poisoned with NaN: an element never written stays NaN.
    out = torch.full((B, H, N, D), float("nan"), dtype=q.dtype)
    lse = torch.full((B, H, N), float("nan"), dtype=torch.float32)
    tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse}
    for name, n in plan.scratch.items():
        tensors[name] = torch.full((max(n, 1),), float("nan"), dtype=torch.float32)
    _run_plan(plan, tensors, instrumented, fast_math)
    return out, lse


def emulated_metal_attention_backward(grad_out, q, k, v, out, lse, causal=False, scale=None, grad_lse=None,
                                      instrumented=False, fast_math=False, gpu="base", seed=0):
    """attention_backward through the Metal emulator, launched from the op's own backward plan.

    seed: the emulator's thread schedule (0: fixed order; else a seeded shuffle), for determinism tests.
    """
    plan = flash_metal.explain(q, k, v, causal, scale, "auto", gpu, backward=True, grad_out=grad_out, out=out,
                               lse=lse, grad_lse=grad_lse)
    # Gradients and scratch poisoned with NaN: an element never written stays NaN.
    grads = [torch.full(t.shape, float("nan"), dtype=t.dtype) for t in (q, k, v)]
    tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "grad_out": grad_out,
               "grad_q": grads[0], "grad_k": grads[1], "grad_v": grads[2],
               # Without grad_lse the plan binds lse in its place (csrc/metal_plan.h), as the MPS host does.
               "grad_lse": lse if grad_lse is None else grad_lse}
    for name, n in plan.scratch.items():
        tensors[name] = torch.full((max(n, 1),), float("nan"), dtype=torch.float32)
    _run_plan(plan, tensors, instrumented, fast_math, seed)
    return tuple(grads)


def _run_plan(plan, tensors, instrumented, fast_math, seed=0):
    library = metal_library(instrumented, fast_math)
    LAST_DISPATCHES.clear()
    # Each dispatch bound from the plan's binding table, exactly as
    # csrc/mps/attention_mps.mm binds, in the plan's order.
    for d in plan.dispatches:
        counts = library.dispatch(
            d.kernel_name,
            buffers={index: tensors[name] for name, index in d.buffers.items()},
            bytes={d.params_index: d.params},
            function_constants=dict(enumerate(d.function_constants)),
            grid=d.grid,
            threadgroup=d.threadgroup,
            threadgroup_memory={d.threadgroup_memory_index: d.threadgroup_memory} if d.threadgroup_memory else {},
            seed=seed,
        )
        LAST_DISPATCHES.append((d, counts))


def to_mps_same_layout(t):
    """Copies t to MPS keeping its exact view: same strides, same storage offset."""
    base = t._base if t._base is not None else t
    return base.to("mps").as_strided(t.size(), t.stride(), t.storage_offset())


def run_attention(backend, q, k, v, causal=False, scale=None, impl="auto"):
    """Runs attention_forward on `backend`; inputs and results live on the CPU."""
    if backend == "cpu":
        return torch.ops.flash_metal.attention_forward(q, k, v, causal, scale, impl)
    if backend == "metal-emu":
        return emulated_metal_attention(q, k, v, causal, scale, impl, instrumented=False)
    if backend == "metal-emu-sanitized":
        return emulated_metal_attention(q, k, v, causal, scale, impl, instrumented=True)
    if backend == "metal-emu-fast-math":  # the shaders built with -ffast-math (see test_fast_math.py)
        return emulated_metal_attention(q, k, v, causal, scale, impl, fast_math=True)
    if backend == "mps":
        dev = [to_mps_same_layout(t) for t in (q, k, v)]
        out, lse = torch.ops.flash_metal.attention_forward(*dev, causal, scale, impl)
        return out.cpu(), lse.cpu()
    raise ValueError(backend)


def run_backward(backend, grad_out, q, k, v, out, lse, causal=False, scale=None, grad_lse=None):
    """Runs attention_backward on `backend`; inputs and gradients live on the CPU.

    out and lse are the forward's results (from any backend: the backward
    only needs them to be the attention of q, k, v).
    """
    args = (grad_out, q, k, v, out, lse)
    if backend == "cpu":
        return torch.ops.flash_metal.attention_backward(*args, causal, scale, grad_lse)
    if backend in ("metal-emu", "metal-emu-sanitized", "metal-emu-fast-math"):
        return emulated_metal_attention_backward(
            *args, causal, scale, grad_lse, instrumented=backend == "metal-emu-sanitized",
            fast_math=backend == "metal-emu-fast-math",
        )
    if backend == "mps":
        dev = [to_mps_same_layout(t) for t in args]
        g = None if grad_lse is None else to_mps_same_layout(grad_lse)
        return tuple(t.cpu() for t in torch.ops.flash_metal.attention_backward(*dev, causal, scale, g))
    raise ValueError(backend)


def backend_param(name):
    """A pytest param for `name`, skipped (and reported as skipped) where unavailable."""
    if name == "mps":
        return pytest.param(name, marks=pytest.mark.skipif(not mps_usable(), reason="no usable MPS device"))
    return pytest.param(name)
