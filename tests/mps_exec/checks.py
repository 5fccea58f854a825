"""Checks of the executed MPS host that run both in the test process and, for
planted bugs, in a fresh process on a planted build (scenario.py's "check").

Each takes the loaded Host and the emulator library, raises AssertionError
(or any error) on failure and returns nothing useful otherwise. Keeping them
here means a planted-bug run executes exactly the assertions the suite does.
"""
from __future__ import annotations

import contextlib
import json
import os

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


def recorded_ops(rec: dict) -> list[str]:
    """The recorded calls' names, in order."""
    return [e["op"] for e in rec["events"]]


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
    defaults = {"torch_mps_device": 1, "system_default_device": 0, "metal_devices": 1, "macos_version": 1500,
                "device_generation": 0}
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
            emu.source_kernel_names()), origin
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
    assert {p["kernel"] for p in info["pipelines"]} == set(emu.source_kernel_names())
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
    assert built == set(emu.source_kernel_names()) - {missing}, sorted(set(emu.source_kernel_names()) ^ built)


# --- building every pipeline at once (issue 18, item 12) ------------------------------------------

# Why 2 ms: far longer than a cache lookup, so builds the host lets overlap do overlap, even on
# 2 busy cores; short enough that a fully serial build of every pipeline stays a few seconds.
COMPILE_US = 2000


def _pairs(events, op="newComputePipelineState"):
    return [f"{e['kernel']}/{''.join('1' if v else '0' for _, v in sorted(e['constants'].items(), key=lambda kv: int(kv[0])))}"
            for e in events if e["op"] == op]


def builds_pipelines_concurrently(host, emu, threads: int = 4) -> dict:
    """metal_build_all_pipelines on a cold cache with `threads` dispatch_apply workers and builds that
    take COMPILE_US each: one dispatch_apply on a global queue over every pair, each pipeline built
    exactly once and cached once (none leaked), more than one build at a time when threads > 1.
    Returns what a sequential run must equal: the list built, the origin, the most concurrent builds."""
    assert host.live_objects().get("FakePipeline", 0) == 0, "not a cold cache: run in a fresh process"
    host.configure(dispatch_apply_threads=threads, pipeline_compile_us=COMPILE_US)
    host.take_recording()
    origin, built = torch.ops.flash_metal.metal_build_all_pipelines()
    rec = host.take_recording()
    assert rec["errors"] == [], rec["errors"]
    applies = [e for e in rec["events"] if e["op"] == "dispatch_apply"]
    assert len(applies) == 1 and applies[0]["global_queue"], f"dispatch_apply calls on a global queue: {applies}"
    assert applies[0]["iterations"] == len(built) and applies[0]["threads"] == min(threads, len(built)), applies
    compiled = _pairs(rec["events"])
    assert sorted(compiled) == sorted(built) and len(set(built)) == len(built)  # each built once
    assert {b.rsplit("/", 1)[0] for b in built} == set(emu.source_kernel_names())
    most = max(e["concurrent"] for e in rec["events"] if e["op"] == "newComputePipelineState")
    if threads > 1:
        assert most > 1, f"{len(built)} pipelines built one at a time with {threads} dispatch_apply threads"
    else:
        assert most == 1, most
    cached = device_info(host)["pipelines"]
    assert sorted(f"{p['kernel']}/{p['function_constants']}" for p in cached) == sorted(built)
    assert host.live_objects().get("FakePipeline", 0) == len(built)  # one reference each, none leaked
    return {"origin": origin, "built": built, "most_concurrent": most}


def pipelines_below_their_declared_n_fail(host, emu, limit: int) -> dict:
    """Every pipeline admits only `limit` threads per threadgroup (a knob of the fake): the kernels whose
    [[max_total_threads_per_threadgroup(N)]] (the plan's max_threads_per_threadgroup) exceeds `limit` fail
    metal_build_all_pipelines, each named with N, even where the representative launch is smaller; the
    others pass."""
    host.configure(max_threads_per_threadgroup=limit)
    try:
        torch.ops.flash_metal.metal_build_all_pipelines()
    except RuntimeError as err:
        message = str(err)
    else:
        raise AssertionError(f"metal_build_all_pipelines accepted pipelines admitting {limit} threads")
    named = {line.strip().split("/", 1)[0] for line in message.splitlines()[1:] if line.strip()}
    return {"message": message, "named": sorted(named)}


def pipeline_failures_reported(host, emu, failing=None) -> dict:
    """Kernels `failing` (default: the first and the last kernel by name) rejected by the (fake) compiler, on a cold cache, with concurrent builds:
    metal_device_info(True) lists exactly their pipelines in pipeline_errors; metal_build_all_pipelines
    raises one error that counts and names every one of them (not just the first), and nothing escapes a
    dispatch_apply block; with the compiler fixed, a retry builds exactly the failed ones (failures are
    not cached) and succeeds."""
    failing = failing or [min(emu.kernel_names()), max(emu.kernel_names())]
    assert host.live_objects().get("FakePipeline", 0) == 0, "not a cold cache: run in a fresh process"
    host.configure(dispatch_apply_threads=4, pipeline_compile_us=200)
    host.set_failing_pipelines(failing)
    info = device_info(host, build_pipelines=True)  # its recording must be clean too
    reported = sorted(f"{e['kernel']}/{e['function_constants']}" for e in info["pipeline_errors"])
    assert {r.rsplit("/", 1)[0] for r in reported} == set(failing), reported
    assert all("fake Metal: compiler error in" in e["error"] for e in info["pipeline_errors"])
    host.take_recording()
    try:
        torch.ops.flash_metal.metal_build_all_pipelines()
    except RuntimeError as err:
        message = str(err)
    else:
        raise AssertionError("metal_build_all_pipelines succeeded with failing pipelines")
    rec = host.take_recording()
    assert rec["errors"] == [], rec["errors"]
    assert sorted(_pairs(rec["events"])) == reported  # only the uncached (failed) ones were tried again
    host.set_failing_pipelines(())
    origin, built = torch.ops.flash_metal.metal_build_all_pipelines()
    retried = host.take_recording()
    assert retried["errors"] == [] and sorted(_pairs(retried["events"])) == reported
    total = len(built)
    assert f"{len(reported)} of {total} pipelines failed" in message, message
    for entry in reported:
        assert f"\n  {entry}: flash_metal: cannot build the pipeline of kernel" in message, (entry, message)
    return {"message": message, "reported": reported}


@contextlib.contextmanager
def slow_builds(host, compile_us: int = 20000):
    """Every pipeline build takes compile_us (default 20 ms: long enough for every racing thread to
    miss the cache before the first build ends)."""
    host.configure(pipeline_compile_us=compile_us)
    try:
        yield
    finally:
        host.configure(pipeline_compile_us=0)


_RACE_KEYS = iter(range(1, 1 << 20))


def racing_builds_share_one_pipeline(host, emu, threads: int = 6, rounds: int = 3) -> None:
    """`threads` threads ask for the same uncached pipeline at the same moment, `rounds` times for each of
    get_pipeline and try_get_pipeline: each gets the same pipeline, more than one of them built it (the
    cache's lock is not held while building), exactly one is kept (the others released: no leak, no
    over-release), and the fakes saw no misuse."""
    kernel = sorted(emu.kernel_names())[0]
    with slow_builds(host):
        for nothrow in (False, True):
            for _ in range(rounds):
                bits = format(next(_RACE_KEYS), "020b")  # constants no launch uses: a key never cached before
                before = host.live_objects().get("FakePipeline", 0)
                host.take_recording()
                result = host.race_get_pipeline(kernel, bits, threads, nothrow)
                rec = host.take_recording()
                assert rec["errors"] == [] and result["errors"] == [""] * threads, (rec["errors"], result)
                assert len(set(result["states"])) == 1 and result["states"][0] != 0, result
                built = [e for e in rec["events"] if e["op"] == "newComputePipelineState"]
                assert len(built) > 1, "one build for racing threads: the cache's lock is held while building"
                assert host.live_objects().get("FakePipeline", 0) == before + 1, "a racing build was not released"


# --- whether the tensor-op kernels run here (issue 21) -------------------------------------------


def tensor_ops_reported(host, emu, expected: list) -> list:
    """metal_device_info's "tensor_ops" against Auto's own choice, under each entry of `expected`:
    {"knobs": fake knobs, "env": variables, "usable": bool, "reason": words of the reason (usable: none),
    "forced_reason": words, or None when impl='tensor_ops' can run, "family": the GPU family}. Auto runs a
    prefill the tensor-op kernels serve (float16, D 64) and must pick them exactly when the answer says
    usable: both come from one rule. Returns the answers."""
    from . import MPP_KERNEL_PREFIX

    q, k, v = make_qkv(1, 4, 2, 70, 90, 64, torch.float16, generator=torch.Generator().manual_seed(21))
    answers = []
    for e in expected:
        env = e.get("env", {})
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            with knobs(host, **e.get("knobs", {})):
                info = device_info(host)
                rec, _ = host.run(q, k, v, True, None, "auto")
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        assert rec["errors"] == [], rec["errors"]
        t = info["tensor_ops"]
        kernels = [ev["kernel"] for ev in rec["events"] if ev["op"] == "setComputePipelineState"]
        picked = any(name.startswith(MPP_KERNEL_PREFIX) for name in kernels)
        assert t["usable"] is e["usable"] and picked is e["usable"], (e, t, kernels)
        assert t["gpu_family"] == e["family"], (e, t)
        if e["usable"]:
            assert t["reason"] is None, (e, t)
        else:
            assert e["reason"] in t["reason"], (e, t)
        if e["forced_reason"] is None:
            assert t["forced_reason"] is None, (e, t)
        else:
            assert e["forced_reason"] in t["forced_reason"], (e, t)
        answers.append(t)
    return answers


# --- the tensor-op backward (issue 21 item 2) through the executed host ---------------------------


def tensor_ops_backward(host, library) -> dict:
    """impl='tensor_ops' backward through the .mm: its two kernels' pipelines come from the MSL 4 library
    (flash_metal_mpp.metallib), bound as planned (a gradient into lse too: function constant 3), replayed in
    the emulator's MSL 4 build ("scrambled" lane layout) and checked against float64 by the 2x rule.
    Returns the kernels the host set, in order."""
    from mps_exec import mpp_library, replay

    mpp = mpp_library()
    g = torch.Generator().manual_seed(41)
    q, k, v = make_qkv(1, 4, 2, 37, 45, 64, torch.float16, generator=g)
    out, lse = torch.ops.flash_metal.attention_forward(q, k, v, True, None, "auto")
    grad_out = torch.randn(q.shape, generator=g).to(torch.float16)
    grad_lse = torch.randn(lse.shape, generator=g)
    rec, grads, _ = host.run_backward(grad_out, q, k, v, out, lse, True, None, grad_lse, impl="tensor_ops")
    replay(rec, library, mpp)
    host.complete_gpu_work()
    assert_gradients_close(tuple(host.to_cpu(t) for t in grads), q, k, v, grad_out, True, None, grad_lse)
    kernels = [e["kernel"] for e in rec["events"] if e["op"] == "setComputePipelineState"]
    # With options (a left window, softcap, sinks): the same two MSL 4 kernels, then flash_sinks_grad from
    # the MSL 3.1 library, one plan across both libraries; grad_sinks checked as tests/api/test_sinks.py does.
    from flash_metal.reference import attention_reference
    from test_sinks import assert_sinks_grad_close

    sinks = torch.randn(4, generator=g)
    opts = dict(window_left=20, softcap=4.0)
    out2, lse2 = attention_reference(q, k, v, True, None, sinks=sinks, **opts)
    dev = [host.to_mps(t) for t in (grad_out, q, k, v, out2.to(torch.float16), lse2.float(), sinks)]
    host.take_recording()
    res = torch.ops.flash_metal.attention_backward(*dev[:6], True, None, None, "tensor_ops", None, 20, -1, 4.0,
                                                   dev[6])
    rec = host.take_recording()
    replay(rec, library, mpp)
    host.complete_gpu_work()
    got = [host.to_cpu(t) for t in res]
    assert_gradients_close(tuple(got[:3]), q, k, v, grad_out, True, None, None, sinks=sinks, **opts)
    assert_sinks_grad_close(got[3], q, k, v, sinks, grad_out, torch.zeros_like(lse), True, opts)
    kernels += [e["kernel"] for e in rec["events"] if e["op"] == "setComputePipelineState"]
    # D = 256: the split-D pair (attention_backward_mpp_dsplit.h) from the same MSL 4 library, replayed in the
    # emulator's build of those kernels alone; their threadgroup memory as planned.
    q, k, v = make_qkv(1, 2, 1, 20, 35, 256, torch.bfloat16, generator=g)
    out, lse = torch.ops.flash_metal.attention_forward(q, k, v, True, None, "auto")
    grad_out = torch.randn(q.shape, generator=g).to(torch.bfloat16)
    rec, grads, _ = host.run_backward(grad_out, q, k, v, out, lse, True, None, None, impl="tensor_ops")
    replay(rec, library, mpp_library(256, backward=True))
    host.complete_gpu_work()
    assert_gradients_close(tuple(host.to_cpu(t) for t in grads), q, k, v, grad_out, True)
    lengths = [e["length"] for e in rec["events"] if e["op"] == "setThreadgroupMemoryLength"]
    assert lengths == [27264, 28928], lengths
    kernels += [e["kernel"] for e in rec["events"] if e["op"] == "setComputePipelineState"]
    # The MLA pair (q/k 192, v 128; issue 20 section 2): the forced forward, then the backward, their
    # pipelines from the MSL 4 library too, replayed in the emulator's partial build of the pair and
    # checked against float64 (out 128 wide; grad_q and grad_k 192, grad_v 128).
    mla = mpp_library("mla")
    q = torch.randn(1, 4, 37, 192, generator=g).to(torch.float16)
    k = torch.randn(1, 2, 45, 192, generator=g).to(torch.float16)
    v = torch.randn(1, 2, 45, 128, generator=g).to(torch.float16)
    rec, tensors = host.run(q, k, v, True, None, "tensor_ops")
    replay(rec, library, mla)
    host.complete_gpu_work()
    out, lse = host.to_cpu(tensors[3]), host.to_cpu(tensors[4])
    assert_attention_close(out, lse, q, k, v, True)
    kernels += [e["kernel"] for e in rec["events"] if e["op"] == "setComputePipelineState"]
    grad_out = torch.randn(out.shape, generator=g).to(torch.float16)
    rec, grads, _ = host.run_backward(grad_out, q, k, v, out, lse, True, None, None, impl="tensor_ops")
    replay(rec, library, mla)
    host.complete_gpu_work()
    assert_gradients_close(tuple(host.to_cpu(t) for t in grads), q, k, v, grad_out, True)
    return kernels + [e["kernel"] for e in rec["events"] if e["op"] == "setComputePipelineState"]
