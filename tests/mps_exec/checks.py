"""Checks of the executed MPS host that run both in the test process and, for
planted bugs, in a fresh process on a planted build (scenario.py's "check").

Each takes the loaded Host and the emulator library, raises AssertionError
(or any error) on failure and returns nothing useful otherwise. Keeping them
here means a planted-bug run executes exactly the assertions the suite does.
"""
from __future__ import annotations

import contextlib
import json

import torch

from numerics import (assert_attention_close, assert_gradients_close, assert_varlen_gradients_close, lay_out,
                      make_qkv)

# --- the backward's inputs in the layouts autograd hands over (issue 23, item 3) ----------------

# Every tensor attention_backward reads besides q, k, v, and the layouts each is
# tested in (the others stay packed, so their strides differ from its):
#   expanded: stride 0 over the batch (a gradient broadcast from a reduction over
#             the batch; out and lse of a batch-broadcast q, k, v);
#   sum:      stride 0 everywhere, one value (the gradient of .sum(), e.g. lse.sum());
#   transposed: heads and rows swapped in memory;
#   offset:   a slice of a larger tensor (storage offset, padded strides).
# out and lse hold real attention results, which are not one value: no "sum".
BACKWARD_LAYOUTS = {
    "grad_out": ("expanded", "sum", "transposed", "offset"),
    "out": ("expanded", "transposed", "offset"),
    "lse": ("expanded", "transposed", "offset"),
    "grad_lse": ("expanded", "sum", "transposed", "offset"),
}
# B, Hq, Hkv, Nq, Nk, D: GQA; Nq > Nk with causal, so two rows see no key
# (lse = -inf); lengths and D that fill no block evenly.
_BACKWARD_SHAPE = (2, 4, 2, 21, 19, 40)


def _padded_storage(numel: int, dtype) -> torch.Tensor:
    """A NaN-filled flat tensor twice the size needed: a kernel reading such a view with another
    tensor's strides reads NaN (or its neighbours' values), never memory outside the buffer."""
    return torch.full((2 * numel + 64,), float("nan"), dtype=dtype)


def _broadcast(values: torch.Tensor, strides_of_first: bool) -> torch.Tensor:
    """values (all batches equal if strides_of_first) as a view with batch stride 0 ("expanded"),
    or, with strides_of_first False, one value with every stride 0 ("sum")."""
    shape = values.shape
    store = _padded_storage(values.numel(), values.dtype)
    if strides_of_first:
        first = values[0]
        store[7:7 + first.numel()].view(first.shape).copy_(first)
        dense = first.contiguous().stride()
        return store.as_strided(shape, (0, *dense), 7)
    store[7] = values.flatten()[0]
    return store.as_strided(shape, (0,) * len(shape), 7)


def _lay_out_3d(values: torch.Tensor, layout: str) -> torch.Tensor:
    """lse-shaped (B, H, N) values in `layout`."""
    B, H, N = values.shape
    if layout == "transposed":
        return values.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "offset":
        big = torch.full((B, H + 1, N + 3), float("nan"), dtype=values.dtype)
        view = big[:, 1:, 2:N + 2]
        view.copy_(values)
        return view
    raise ValueError(layout)


def in_layout(values: torch.Tensor, layout: str) -> torch.Tensor:
    """`values` (4-d like out, or 3-d like lse) as a view in one of the BACKWARD_LAYOUTS."""
    if layout in ("expanded", "sum"):
        return _broadcast(values, layout == "expanded")
    if values.dim() == 3:
        return _lay_out_3d(values, layout)
    return lay_out(values, {"offset": "offset_slice"}.get(layout, layout))


def backward_inputs(dtype=torch.float32, seed: int = 23):
    """q, k, v broadcast over the batch (so out and lse are too), their out and lse (CPU kernel),
    a random grad_out and grad_lse whose first batch is repeated, so every layout holds the same values."""
    B, Hq, Hkv, Nq, Nk, D = _BACKWARD_SHAPE
    g = torch.Generator().manual_seed(seed)
    q, k, v = (t.expand(B, *t.shape[1:]) for t in make_qkv(1, Hq, Hkv, Nq, Nk, D, dtype, generator=g))
    out, lse = torch.ops.flash_metal.attention_forward(q, k, v, True, None, "auto")
    grad_out = torch.randn(1, Hq, Nq, D, generator=g).to(dtype).expand(B, Hq, Nq, D).contiguous()
    grad_lse = torch.randn(1, Hq, Nq, generator=g).expand(B, Hq, Nq).contiguous()
    return q, k, v, {"grad_out": grad_out, "out": out.contiguous(), "lse": lse.contiguous(), "grad_lse": grad_lse}


def backward_layout(host, emu, tensor: str, layout: str, dtype=torch.float32) -> None:
    """attention_backward through the host with `tensor` in `layout` (the rest packed), replayed in the
    emulator, against the float64 oracle."""
    q, k, v, packed = backward_inputs(dtype)
    given = dict(packed)
    given[tensor] = in_layout(packed[tensor], layout)
    if layout == "sum":  # the oracle must see the one value the view holds
        packed[tensor] = given[tensor].contiguous()
    assert torch.equal(given[tensor].contiguous().nan_to_num(), packed[tensor].nan_to_num())  # same values, new layout
    grads, rec = host.backward(given["grad_out"], q, k, v, given["out"], given["lse"], True, None,
                               given["grad_lse"], emu)
    assert rec["errors"] == [], rec["errors"]
    assert_gradients_close(grads, q, k, v, packed["grad_out"], True, None, packed["grad_lse"])


def backward_layouts(host, emu) -> None:
    """Every (tensor, layout) of BACKWARD_LAYOUTS; the first failure is raised, naming it."""
    for tensor, layouts in BACKWARD_LAYOUTS.items():
        for layout in layouts:
            try:
                backward_layout(host, emu, tensor, layout)
            except AssertionError as err:
                raise AssertionError(f"{tensor} {layout}: {err}") from err


# --- multi-dispatch plans under the MPS profiler (issue 18, item 5) ----------------------------


@contextlib.contextmanager
def profiling(host):
    """PyTorch's MPS profiler on (endProfileKernel then ends the stream's shared encoder)."""
    host.configure(profiling=1)
    try:
        yield
    finally:
        host.configure(profiling=0)


def _assert_each_dispatch_fetched_the_encoder(rec, dispatches: int) -> None:
    assert rec["errors"] == [], rec["errors"]
    ops = [e["op"] for e in rec["events"]]
    assert ops.count("dispatchThreadgroups") == dispatches
    assert ops.count("commandEncoder") == dispatches  # fetched again for every dispatch
    assert ops.count("stream.endKernelCoalescing") == dispatches  # the profiler really ended each encoder
    used = [e["encoder"] for e in rec["events"] if e["op"] == "dispatchThreadgroups"]
    assert len(set(used)) == dispatches, used  # each dispatch on the encoder open at the time


def profiled_multi_dispatch(host, emu) -> None:
    """Every plan with more than one dispatch, with profiling on: the split-KV decode (split, then
    merge), the backward (dQ and Delta, then dK/dV) with and without grad_lse, and the varlen
    backward. Each must bind on a live encoder and still match the oracle."""
    g = torch.Generator().manual_seed(18)
    with profiling(host):
        q, k, v = make_qkv(2, 8, 2, 3, 600, 80, torch.float16, generator=g)
        out, lse, rec, _ = host.attention(q, k, v, True, None, "decode_split", emu)
        _assert_each_dispatch_fetched_the_encoder(rec, 2)
        assert_attention_close(out, lse, q, k, v, True)

        q, k, v = make_qkv(1, 4, 2, 37, 29, 48, torch.float32, generator=g)
        out, lse = torch.ops.flash_metal.attention_forward(q, k, v, True, None, "auto")
        grad_out = torch.randn(q.shape, generator=g)
        for grad_lse in (None, torch.randn(lse.shape, generator=g)):
            grads, rec = host.backward(grad_out, q, k, v, out, lse, True, None, grad_lse, emu)
            _assert_each_dispatch_fetched_the_encoder(rec, 2)
            assert_gradients_close(grads, q, k, v, grad_out, True, None, grad_lse)

        cu_q = torch.tensor([0, 9, 9, 30], dtype=torch.int32)
        cu_k = torch.tensor([0, 12, 20, 41], dtype=torch.int32)
        qv, kv, vv = (torch.randn(n, h, 32, generator=g).half() for n, h in ((30, 4), (41, 2), (41, 2)))
        out, lse = torch.ops.flash_metal.attention_varlen_forward(qv, kv, vv, cu_q, cu_k, 21, 21, True)
        go = torch.randn(qv.shape, generator=g).half()
        grads, rec = host.call("attention_varlen_backward", go, qv, kv, vv, out, lse, cu_q, cu_k, 21, 21, True,
                               library=emu)
        _assert_each_dispatch_fetched_the_encoder(rec, 2)
        assert_varlen_gradients_close(grads, qv, kv, vv, go, cu_q, cu_k, True)


# --- metal_device_info through the host (issue 18's device-info op) -------------------------------


def device_info(host, build_pipelines: bool = False) -> dict:
    """torch.ops.flash_metal.metal_device_info parsed, with the fakes' recording (which must be clean)."""
    host.take_recording()
    info = json.loads(torch.ops.flash_metal.metal_device_info(build_pipelines))
    rec = host.take_recording()
    assert rec["errors"] == [], rec["errors"]
    info["_recording"] = rec
    return info


def library_reported(host, emu, kind: str, reason: str = "") -> None:
    """metal_device_info's library entry says the shader library came from `kind`, `reason` in its why."""
    assert_library(device_info(host), kind, reason)


def assert_library(info: dict, kind: str, reason: str = "") -> None:
    lib = info["library"]
    assert info["available"] and lib["error"] is None, info
    assert lib["kind"] == kind, lib
    assert reason in lib["reason"], lib
    if kind == "metallib":
        assert lib["reason"] == "" and lib["path"].endswith("flash_metal.metallib"), lib
    else:
        assert lib["path"].endswith("shaders/attention.metal"), lib


# --- finding a device without MTLCreateSystemDefaultDevice (issue 18, item 6) -------------------


@contextlib.contextmanager
def knobs(host, **values):
    """Fake knobs set for the block, then put back to the defaults given here."""
    defaults = {"torch_mps_device": 1, "system_default_device": 0, "metal_devices": 1, "macos_version": 1500}
    host.configure(**values)
    try:
        yield
    finally:
        host.configure(**{k: defaults[k] for k in values})


def builds_all_pipelines(host, emu) -> None:
    """metal_build_all_pipelines (what the macOS CI runs) with MTLCreateSystemDefaultDevice() returning nil,
    as in a non-interactive process on Apple silicon: from PyTorch's device, then, with PyTorch declining
    the GPU, from MTLCopyAllDevices()."""
    for torch_device, source_call in ((1, None), (0, "MTLCopyAllDevices")):
        with knobs(host, system_default_device=0, torch_mps_device=torch_device):
            host.take_recording()
            origin, built = torch.ops.flash_metal.metal_build_all_pipelines()
            rec = host.take_recording()
        assert rec["errors"] == [], rec["errors"]
        assert origin.startswith("the precompiled ") and set(n.rsplit("/", 1)[0] for n in built) == set(
            emu.kernel_names()), origin
        calls = [e["op"] for e in rec["events"] if e["op"] in ("MTLCopyAllDevices", "MTLCreateSystemDefaultDevice")]
        assert calls == ([source_call] if source_call else []), calls


def library_error_reported(host, emu, error: str) -> None:
    """The library failed to load: metal_device_info still answers, with library.error saying why."""
    info = device_info(host)
    assert info["available"] and info["device"] is not None, info
    lib = info["library"]
    assert lib["kind"] is None and lib["origin"] is None and error in lib["error"], lib
    assert info["pipelines"] == [] and info["pipeline_errors"] == [], info


def every_pipeline_built(host, emu) -> None:
    """build_pipelines=True on the full metallib: no errors, every kernel built, and every (kernel,
    function constants) pair metal_build_all_pipelines names among them."""
    info = device_info(host, build_pipelines=True)
    assert info["pipeline_errors"] == [], info["pipeline_errors"]
    assert {p["kernel"] for p in info["pipelines"]} == set(emu.kernel_names())
    _, built = torch.ops.flash_metal.metal_build_all_pipelines()
    listed = {(p["kernel"], p["function_constants"]) for p in info["pipelines"]}
    missing = {tuple(b.rsplit("/", 1)) for b in built} - listed
    assert not missing, sorted(missing)


def pipeline_errors_reported(host, emu, missing: str) -> None:
    """build_pipelines=True on a metallib without kernel `missing`: its pipelines are reported as errors,
    every other kernel's as built."""
    info = device_info(host, build_pipelines=True)
    errors = {e["kernel"] for e in info["pipeline_errors"]}
    assert errors == {missing}, info["pipeline_errors"]
    assert all("is not in the precompiled" in e["error"] for e in info["pipeline_errors"])
    built = {p["kernel"] for p in info["pipelines"]}
    assert built == set(emu.kernel_names()) - {missing}, sorted(set(emu.kernel_names()) ^ built)
