"""The routing table of kernel families (csrc/metal/families/table.cpp), through explain() and its ops.

- The table and the registries of compiled kernels agree: every row plans only kernels that exist (the
  portable library's registry, csrc/metal/registry.cpp, or the MSL 4 library's instantiations for the
  tensor-op rows), each name within the row's declared patterns, and every compiled kernel is reachable
  from some row.
- explain() shows one line per family (took the call, or why not), then the composite path's; a few known
  routes.
- A family of the tests' own (tests/routing_family/test_double_family.cpp, built here, never shipped) is
  registered at the head of the forward table and seen routed and explained.
"""
import ctypes
import fnmatch
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import flash_metal
from prereqs import unavailable
from repo_paths import ROOT_DIR as ROOT

LINE = re.compile(r"^(?P<name>[^:]+): (?P<verdict>took the call|no: .+|would take it too; .+ comes first)$")
COMPOSITE = ("composite: took the call (no kernel of ours)", "composite: no: a kernel family takes the call")


def table():
    passes, names, declares, kernels = torch.ops.flash_metal.metal_routing_table()
    return [dict(pass_=p, name=n, declares=d, kernels=k.split(",")) for p, n, d, k in
            zip(passes, names, declares, kernels)]


def rows(pass_):
    return [r for r in table() if r["pass_"] == pass_]


def matches(name, row):
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in row["kernels"])


def is_tensor_ops(name):
    return name.startswith(("flash_attention_prefill_mpp_", "flash_backward_mpp_"))


def msl4_names():
    """Every host name the MSL 4 library's sources instantiate (their FM_MPP_INSTANTIATE lines, preprocessed)."""
    from metal_emulator import _build

    names = set()
    for path in glob.glob(os.path.join(ROOT, "shaders", "**", "*mpp*.metal"), recursive=True):
        # clang's preprocessor with the emulator's MSL 4 flags (compile_library(..., msl=4)'s).
        text = _build._run([_build.find_clang(), *_build.common_flags(4), "-I", os.path.dirname(path), "-E", "-P",
                            path], f"preprocessing {path}").stdout
        for literals in re.findall(r"host_name\(((?:\s*\"[^\"]*\")+)\s*\)", text):
            names.add("".join(re.findall(r"\"([^\"]*)\"", literals)))
    assert names, "no MSL 4 instantiations found under shaders/"
    return names


def t(*shape, dtype=torch.float16):
    return torch.empty(*shape, dtype=dtype)


def took(plan):
    taken = [LINE.match(line)["name"] for line in plan.families if line.endswith(": took the call")]
    assert len(taken) == 1, plan.families
    return taken[0]


def check_lines(plan, pass_):
    names = [r["name"] for r in rows(pass_)]
    assert plan.families[-1] in COMPOSITE, plan.families
    lines = plan.families[:-1]
    assert [LINE.match(line)["name"] for line in lines] == names, plan.families
    if plan.dispatches:
        assert plan.families[-1] == COMPOSITE[1]
        return took(plan)
    assert plan.families[-1] == COMPOSITE[0] and not any(line.endswith("took the call") for line in lines)
    return "composite"


# (label, q shape, kv shape, dtype, dims (D_qk, D_v), kwargs for explain) covering every family.
def cases():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for dqk, dv in ((64, 64), (128, 128), (192, 128), (256, 256), (80, 80)):
            for gpu in ("base", "m3-max", "m5+tensor_ops"):
                for hq, hkv, nq, nk in ((8, 2, 1, 300), (8, 2, 4, 8192), (8, 8, 200, 200), (4, 1, 12, 100)):
                    for impl in ("auto", "prefill", "decode", "decode_split", "tiled", "tensor_ops"):
                        if impl == "tiled" and dqk != dv:
                            continue
                        if impl == "tensor_ops" and (dtype == torch.float32 or dqk in (80,)):
                            continue
                        if impl in ("decode", "decode_split") and nq > 8:
                            continue
                        yield (dict(q=(1, hq, nq, dqk), k=(1, hkv, nk, dqk), v=(1, hkv, nk, dv), dtype=dtype),
                               dict(causal=True, impl=impl, gpu=gpu))
                        if impl in ("auto", "tensor_ops") and nq > 8:
                            yield (dict(q=(1, hq, nq, dqk), k=(1, hkv, nk, dqk), v=(1, hkv, nk, dv), dtype=dtype),
                                   dict(causal=False, impl=impl, gpu=gpu, backward=True))
        for dqk, dv, hq, nq in ((512, 512, 8, 1), (576, 512, 16, 1), (576, 512, 128, 1), (512, 512, 8, 300),
                                (256, 512, 8, 300)):
            for causal in (False, True):
                yield (dict(q=(1, hq, nq, dqk), k=(1, 1, 4096, dqk), v=(1, 1, 4096, dv), dtype=dtype),
                       dict(causal=causal, impl="auto", gpu="m3-max"))
        yield (dict(q=(1, 8, 300, 512), k=(1, 8, 300, 512), v=(1, 8, 300, 512), dtype=dtype),
               dict(causal=True, impl="prefill", gpu="base", backward=True))


def explain(shapes, kw):
    dtype = shapes["dtype"]
    return flash_metal.explain(t(*shapes["q"], dtype=dtype), t(*shapes["k"], dtype=dtype),
                               t(*shapes["v"], dtype=dtype), kw["causal"], None, kw["impl"], kw["gpu"],
                               backward=kw.get("backward", False))


def test_rows_declare_what_they_take():
    names = [r["name"] for r in table()]
    assert len(names) == len(set(names))
    assert [r["name"] for r in rows("forward")] == [
        "quantized decode", "wide decode", "prefill split-D", "post kernels", "tensor ops split-D", "tensor ops", "paged", "decode",
        "split decode", "prefill"]
    assert [r["name"] for r in rows("backward")] == [
        "backward split-D", "backward tensor ops split-D", "backward tensor ops", "backward"]
    for r in table():
        assert r["declares"].startswith(r["pass_"]) and all(r["kernels"]), r


def test_registry_kernels_are_reachable_from_rows_that_declare_them():
    kernels, families = torch.ops.flash_metal.metal_registry_routes()
    by_name = {r["name"]: r for r in table()}
    assert kernels and len(kernels) == len(families)
    for kernel, family in zip(kernels, families):
        assert family in by_name, (kernel, family)  # every compiled kernel: planned by some row
        assert matches(kernel, by_name[family]), (kernel, family, by_name[family]["kernels"])
    # Every row but the tensor-op ones (their kernels are the MSL 4 library's) plans some registry kernel.
    portable_rows = {r["name"] for r in table() if not all(is_tensor_ops(p) for p in r["kernels"]
                                                          if p != "flash_sinks_grad")}
    assert portable_rows == set(families)


def test_msl4_kernels_are_reachable_from_the_tensor_op_rows():
    tensor_rows = [r for r in table() if "tensor ops" in r["name"]]
    names = msl4_names()
    for name in names:
        assert any(matches(name, r) for r in tensor_rows), name
    for r in tensor_rows:
        assert any(matches(name, r) for name in names), r


def test_rows_plan_only_kernels_that_exist():
    registry = set(torch.ops.flash_metal.metal_registry_routes()[0])
    msl4 = msl4_names()
    by_name = {r["name"]: r for r in table()}
    seen = set()
    for shapes, kw in cases():
        try:
            plan = explain(shapes, kw)
        except (ValueError, TypeError, NotImplementedError):
            continue
        family = check_lines(plan, "backward" if kw.get("backward") else "forward")
        seen.add(family)
        for d in plan.dispatches:
            assert matches(d.kernel_name, by_name[family]), (family, d.kernel_name, shapes, kw)
            assert d.kernel_name in (msl4 if is_tensor_ops(d.kernel_name) else registry), (d.kernel_name, kw)
    # paged and quantized decode (attention_kvcache's caches): test_known_routes_and_lines
    assert seen >= {r["name"] for r in table()} - {"paged", "quantized decode"}, seen


def test_known_routes_and_lines():
    f16 = torch.float16
    q, k = t(1, 8, 1, 128), t(1, 2, 100, 128)  # fewer than 2 x 128 keys: one key block
    plan = flash_metal.explain(q, k, k)
    assert took(plan) == "decode" and "split decode: no: one key block fills the GPU" in "\n".join(plan.families)
    assert took(flash_metal.explain(q, t(1, 2, 65536, 128), t(1, 2, 65536, 128))) == "split decode"
    q = t(1, 8, 200, 128)
    k = t(1, 8, 200, 128)
    plan = flash_metal.explain(q, k, k, True)
    assert took(plan) == "prefill" and plan.reason.startswith("prefill:")
    assert "tensor ops: no: an Apple 9 GPU" in "\n".join(plan.families)
    plan = flash_metal.explain(q, k, k, True, gpu="m5+tensor_ops")
    assert took(plan) == "tensor ops" and "prefill: would take it too; tensor ops comes first" in plan.families
    assert took(flash_metal.explain(t(1, 8, 200, 256), t(1, 8, 200, 256), t(1, 8, 200, 256), True,
                                    gpu="m5+tensor_ops")) == "tensor ops split-D"
    assert took(flash_metal.explain(q, k, k, True, impl="tiled")) == "post kernels"
    assert took(flash_metal.explain(q, k, k, True, backward=True)) == "backward"
    assert took(flash_metal.explain(q, k, k, True, gpu="m5+tensor_ops", backward=True)) == "backward tensor ops"
    mla_q, latent, v = t(1, 16, 1, 576), t(1, 1, 4096, 576), t(1, 1, 4096, 512)
    assert took(flash_metal.explain(mla_q, latent, v, True)) == "wide decode"
    d512 = t(1, 8, 300, 512)
    assert took(flash_metal.explain(d512, d512, d512, True)) == "prefill split-D"
    assert took(flash_metal.explain(d512, d512, d512, True, impl="prefill", backward=True)) == "backward split-D"
    plan = flash_metal.explain(d512, d512, d512, False)
    assert not plan.dispatches and plan.families[-1] == COMPOSITE[0]
    assert "prefill split-D: no: not causal" in "\n".join(plan.families)
    plan = flash_metal.explain(q, k, k, impl="composite")
    assert plan.families[:-1] == tuple(f"{r['name']}: no: impl='composite' names the composite path"
                                       for r in rows("forward"))
    # Paged: the decode kernels and the prefill reading the table.
    kc = t(10, 16, 2, 128, dtype=f16)
    table_ = torch.arange(8, dtype=torch.int32).view(2, 4)
    lengths = torch.tensor([40, 60], dtype=torch.int32)
    for nq in (1, 9):
        plan = flash_metal.explain(t(2, 8, nq, 128), kc, kc, True, block_table=table_, cache_seqlens=lengths)
        assert took(plan) == "paged" and check_lines(plan, "forward") == "paged"
        assert "decode: no: a paged KV cache" in "\n".join(plan.families)
    # A quantized cache (issue 44): the quantized decode row, one pass or split, kernels of the registry
    # within its patterns; chunked prefill over it is refused with an error that says so.
    registry = set(torch.ops.flash_metal.metal_registry_routes()[0])
    by_name = {r["name"]: r for r in table()}
    codes = torch.zeros(10, 16, 2, 128, dtype=torch.int8)
    scales = torch.ones(10, 16, 2)
    for impl in ("decode", "decode_split"):
        plan = flash_metal.explain(t(2, 8, 1, 128), codes, codes, True, None, impl, block_table=table_,
                                   cache_seqlens=lengths, k_scale=scales, v_scale=scales)
        assert took(plan) == "quantized decode" and check_lines(plan, "forward") == "quantized decode"
        assert "paged: no: a quantized KV cache" in "\n".join(plan.families)
        for d in plan.dispatches:
            assert matches(d.kernel_name, by_name["quantized decode"]) and d.kernel_name in registry, d.kernel_name
        assert plan.dispatches[0].kernel_name.startswith("flash_decode_quant_")
    with pytest.raises(NotImplementedError, match="quantized KV cache is read on Metal by the decode kernels only"):
        flash_metal.explain(t(2, 8, 9, 128), codes, codes, True, block_table=table_, cache_seqlens=lengths,
                            k_scale=scales, v_scale=scales)


def _build_test_double(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        unavailable("no C++ compiler to build the routing test double")
    from torch.utils import cpp_extension

    source = os.path.join(ROOT, "tests", "routing_family", "test_double_family.cpp")
    flags = ["-std=c++17", "-O1", "-fPIC", "-shared", "-fvisibility=hidden",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             *(f"-I{p}" for p in cpp_extension.include_paths()), f"-I{os.path.join(ROOT, 'csrc')}",
             f"-I{os.path.join(ROOT, 'shaders')}"]
    if sys.platform == "darwin":
        flags += ["-undefined", "dynamic_lookup"]
    # Cached by the texts it depends on (the planner's headers), the flags and torch.
    digest = hashlib.sha256(" ".join([cxx, *flags, torch.__version__]).encode())
    for path in sorted([source, *glob.glob(os.path.join(ROOT, "csrc", "**", "*.h"), recursive=True)]):
        with open(path, "rb") as f:
            digest.update(f.read())
    cache = os.environ.get("FLASH_METAL_EMULATOR_CACHE") or str(tmp_path_factory.mktemp("routing_family"))
    lib = os.path.join(cache, f"routing_test_double.{digest.hexdigest()[:16]}.so")
    if not os.path.exists(lib):
        os.makedirs(cache, exist_ok=True)
        tmp = f"{lib}.{os.getpid()}"
        proc = subprocess.run([cxx, *flags, source, "-o", tmp], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-4000:]
        os.replace(tmp, lib)
    return lib


@pytest.fixture(scope="module")
def test_double_library(tmp_path_factory):
    lib = ctypes.CDLL(_build_test_double(tmp_path_factory))
    lib.fm_test_double_family.restype = ctypes.c_void_p
    return lib


@pytest.fixture
def test_double(test_double_library):
    lib = test_double_library
    torch.ops.flash_metal.metal_routing_register_family(lib.fm_test_double_family(), 0)
    try:
        yield lib
    finally:
        torch.ops.flash_metal.metal_routing_register_family(0, 0)


def test_a_registered_family_is_routed_and_explained(test_double):
    assert [r["name"] for r in rows("forward")][0] == "test double"
    q = t(1, 8, 200, 64)
    plan = flash_metal.explain(q, q, q, True, softcap=7.25)
    assert took(plan) == "test double" and check_lines(plan, "forward") == "test double"
    assert plan.families[0] == "test double: took the call"
    assert "prefill: would take it too; test double comes first" in plan.families
    assert plan.reason.startswith("test double: the prefill kernel at d64")
    (d,) = plan.dispatches
    assert d.kernel_name == "flash_attention_prefill_float16_d64_bq32_bk32_wm4"
    assert d.kernel_name in torch.ops.flash_metal.metal_registry_routes()[0]
    # Any other call: the row says why not, and the table routes as before.
    other = flash_metal.explain(q, q, q, True, softcap=30.0)
    assert other.families[0] == "test double: no: softcap is not the test's signature, 7.25"
    assert took(other) == "prefill"
    assert other.dispatches[0].kernel_name != d.kernel_name or "test double" not in other.reason


def test_the_test_double_is_gone_after_the_test():
    assert "test double" not in [r["name"] for r in table()]
    q = t(1, 8, 200, 64)
    assert took(flash_metal.explain(q, q, q, True, softcap=7.25)) == "prefill"
