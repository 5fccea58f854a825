"""Runs flash_metal's real Objective-C++ MPS host (csrc/mps/*.mm) on Linux.

The host is compiled against fakes of Metal, Foundation, libdispatch and the
few at::mps entry points it calls (see README.md), loaded into this process,
and called through torch.ops.flash_metal.attention_forward on fake MPS
tensors. The fakes record every encoder call; replay() runs the recording
in the Metal emulator, buffer for buffer, so the result is what a GPU would
compute from exactly the bindings the host made.

    host = load(package_dir(build(), tmp, kernel_names=emu_library.source_kernel_names()))  # once per process
    out, lse, recording, tensors = host.attention(q, k, v, causal, scale, impl, emu_library)
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil

import torch

from ._build import (APT_PACKAGES, CACHE_DIR, MACOS_REASON, SDK_VIEWS, BuildFailed, LinuxOnly, ToolchainMissing,  # noqa: F401
                     build, check_platform, copy_library, host_sources, toolchain, tsan_runtime)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SHADER_DIR = os.path.join(ROOT, "shaders")
SHADER = os.path.join(SHADER_DIR, "attention.metal")
MPP_SHADER = os.path.join(SHADER_DIR, "attention_mpp.metal")
# File names library.mm looks for next to the loaded library (csrc/mps/library.mm).
METALLIB_NAME = "flash_metal.metallib"
METALLIB_HASH_NAME = "flash_metal.metallib.fnv1a64"
# The MSL 4 library (setup.py's build_mpp_metallib) and the prefix of its kernels.
MPP_METALLIB_NAME = "flash_metal_mpp.metallib"
MPP_METALLIB_HASH_NAME = "flash_metal_mpp.metallib.fnv1a64"
MPP_KERNEL_PREFIX = "flash_attention_prefill_mpp_"
# The MSL 4 library's kernels: the forward's and the backward's (csrc/metal/plan.h, is_tensor_ops_kernel).
MPP_KERNEL_PREFIXES = (MPP_KERNEL_PREFIX, "flash_backward_mpp_")
# The D = 256 split-D forward: left out of the default MSL 4 emulator build,
# built alone where a scenario runs it (tests/backends.py, MPP_DSPLIT_KERNELS).
MPP_DSPLIT_KERNELS = MPP_KERNEL_PREFIX + "dsplit_*"
# The D = 256 split-D backward: likewise (tests/backends.py, MPP_DSPLIT_BACKWARD_KERNELS).
MPP_DSPLIT_BACKWARD_KERNELS = "flash_backward_mpp_dsplit_*"
# The MLA pair's kernels (q/k 192, v 128: "_dqk192_dv128_"), left out of the default build too and built
# alone where a check runs them (tests/backends.py, MPP_MLA_KERNELS).
MPP_MLA_KERNELS = "flash_*_mpp_*_dqk*"


def mpp_library(head_dim=None, backward=False):
    """The emulator's MSL 4 build a scenario replays with: the default one (the dsplit and MLA kernels left
    out, the same build as tests/backends.py's), at head dim 256 the dsplit forward (backward=True: backward)
    kernels alone, at "mla" the MLA pair's alone. Each names every kernel of the source (source_kernel_names:
    the fake metallib's contents)."""
    from metal_emulator import compile_library

    if head_dim == 256:
        only = MPP_DSPLIT_BACKWARD_KERNELS if backward else MPP_DSPLIT_KERNELS
        return compile_library([MPP_SHADER], instrumented=False, msl=4, only=[only])
    if head_dim == "mla":
        return compile_library([MPP_SHADER], instrumented=False, msl=4, only=[MPP_MLA_KERNELS])
    return compile_library([MPP_SHADER], instrumented=False, msl=4,
                           exclude=[MPP_DSPLIT_KERNELS, MPP_DSPLIT_BACKWARD_KERNELS, MPP_MLA_KERNELS])
# Constants the .mm sets that the MPP kernels do not declare (tests/backends.py's MPP_UNDECLARED_CONSTANTS).
MPP_UNDECLARED_CONSTANTS = (1, 2, 10)
# First line of a fake metallib (fake_runtime.h: kFakeMetallibMagic).
FAKE_METALLIB_MAGIC = "flash_metal fake metallib v1"


def package_dir(lib: str, dest: str, metallib: str = "fresh", kernel_names=None, shaders: bool = True,
                mpp_metallib: str = "none", mpp_kernel_names=None) -> str:
    """An installed-package look-alike in `dest`; returns the library path inside it.

    metallib: "fresh" (a fake metallib of `kernel_names` with the fingerprint
    of the shaders beside it), "stale" (a wrong fingerprint), "unloadable"
    (not a metallib at all, fresh fingerprint), or "none". mpp_metallib: the
    same for the MSL 4 library (flash_metal_mpp.metallib, of
    `mpp_kernel_names`), "none" by default (most builds have none).
    """
    path = copy_library(lib, dest)
    if shaders:
        for name in shader_sources(SHADER_DIR):  # the family subfolders too, as setup.py installs them
            target = os.path.join(dest, "shaders", *name.split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(os.path.join(SHADER_DIR, *name.split("/")), target)
    for state, names, lib_name, hash_name in ((metallib, kernel_names, METALLIB_NAME, METALLIB_HASH_NAME),
                                              (mpp_metallib, mpp_kernel_names, MPP_METALLIB_NAME,
                                               MPP_METALLIB_HASH_NAME)):
        if state == "none":
            continue
        with open(os.path.join(dest, lib_name), "w", encoding="utf-8") as f:
            f.write(("garbage, not a metallib\n" if state == "unloadable" else FAKE_METALLIB_MAGIC + "\n")
                    + "".join(n + "\n" for n in sorted(names or [])))
        fingerprint = "0123456789abcdef" if state == "stale" else source_tree_hash(SHADER_DIR)
        with open(os.path.join(dest, hash_name), "w", encoding="utf-8") as f:
            f.write(fingerprint + "\n")
    return path


def _is_shader_file(name: str) -> bool:
    """shader_source.h's is_shader_file: *.metal and *.h, never a dot-file (AppleDouble ._x.metal)."""
    return not name.startswith(".") and name.endswith((".metal", ".h"))


def shader_sources(directory: str) -> list[str]:
    """The shader files under directory, at any depth (hidden folders aside), as '/'-separated paths
    relative to it ("common/params.h"): shader_source.h's list_shader_files."""
    out = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        out += [os.path.relpath(os.path.join(root, f), directory).replace(os.sep, "/")
                for f in files if _is_shader_file(f)]
    return sorted(out)


# FNV-1a 64-bit offset basis and prime (the published constants).
_FNV_BASIS, _FNV_PRIME = 0xCBF29CE484222325, 0x100000001B3


def source_tree_hash(directory: str) -> str:
    """The fingerprint library.mm checks a metallib against (shader_source.h's
    source_tree_hash; Host.source_tree_hash runs the C++ one to prove they agree)."""
    h = _FNV_BASIS
    for name in sorted(n.encode() for n in shader_sources(directory)):
        with open(os.path.join(directory, *name.decode().split("/")), "rb") as f:
            text = f.read()
        for byte in name + b"\n" + str(len(text)).encode() + b"\n" + text:
            h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


class Host:
    """The loaded host library and its fakes' controls."""

    def __init__(self, path: str):
        import flash_metal  # noqa: F401  (the op schemas the .mm implements)

        self.path = path
        self._dll = ctypes.CDLL(path)
        d = self._dll
        d.fm_exec_take_recording_json.restype = ctypes.c_char_p
        d.fm_exec_live_objects_json.restype = ctypes.c_char_p
        d.fm_exec_configure.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
        d.fm_exec_set_runtime_compile.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        d.fm_exec_set_failing_pipelines.argtypes = [ctypes.c_char_p]
        d.fm_exec_race_get_pipeline.restype = ctypes.c_char_p
        d.fm_exec_race_get_pipeline.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
        d.fm_exec_source_tree_hash.restype = ctypes.c_size_t
        d.fm_exec_source_tree_hash.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]

    def source_tree_hash(self, directory: str) -> str:
        """library.mm's own fingerprint code (csrc/mps/shader_source.h) run on `directory`."""
        buf = ctypes.create_string_buffer(64)
        n = self._dll.fm_exec_source_tree_hash(directory.encode(), buf, len(buf))
        if n == 0 or n > len(buf):
            raise RuntimeError(f"cannot fingerprint {directory}")
        return buf.value.decode()

    def take_recording(self) -> dict:
        """{"events": [...], "errors": [...]} since the last call."""
        return json.loads(d.decode()) if (d := self._dll.fm_exec_take_recording_json()) else {}

    def complete_gpu_work(self) -> None:
        """Releases the fake MPS storage freed since the last replay (see fake_mps.mm, freed_buffers)."""
        self._dll.fm_exec_complete_gpu_work()

    def live_objects(self) -> dict[str, int]:
        self.complete_gpu_work()  # a GPU that has finished: nothing freed is still held for it
        return json.loads(self._dll.fm_exec_live_objects_json().decode())

    def configure(self, **knobs) -> None:
        for name, value in knobs.items():
            if self._dll.fm_exec_configure(name.encode(), int(value)) != 0:
                raise KeyError(name)

    def set_runtime_compile(self, kernel_names=(), error: str = "") -> None:
        self._dll.fm_exec_set_runtime_compile("\n".join(kernel_names).encode(), error.encode())

    def set_failing_pipelines(self, kernel_names=()) -> None:
        """The fake compiler rejects the pipelines of these kernels from now on (() for none)."""
        self._dll.fm_exec_set_failing_pipelines("\n".join(kernel_names).encode())

    def race_get_pipeline(self, kernel: str, bits: str, threads: int, nothrow: bool = False) -> dict:
        """`threads` threads call get_pipeline (try_get_pipeline if nothrow) for the same pipeline at
        once (race_driver.mm): {"states": [pipeline address per thread], "errors": [...]}."""
        return json.loads(self._dll.fm_exec_race_get_pipeline(kernel.encode(), bits.encode(), threads,
                                                               int(nothrow)).decode())

    @staticmethod
    def to_mps(t: torch.Tensor) -> torch.Tensor:
        return torch.ops.mps_exec.to_mps(t)

    @staticmethod
    def to_cpu(t: torch.Tensor) -> torch.Tensor:
        return torch.ops.mps_exec.to_cpu(t)

    @staticmethod
    def buffer_id(t: torch.Tensor) -> int:
        return torch.ops.mps_exec.buffer_id(t)

    def run(self, q, k, v, causal=False, scale=None, impl="auto"):
        """Calls the op on fake MPS copies of q, k, v (layouts kept), without replay.

        Returns (recording, (q, k, v, out, lse) as fake MPS tensors).
        """
        dev = [self.to_mps(t) for t in (q, k, v)]
        self.take_recording()  # drop whatever earlier calls left
        out, lse = torch.ops.flash_metal.attention_forward(*dev, causal, scale, impl)
        return self.take_recording(), (*dev, out, lse)

    def attention(self, q, k, v, causal=False, scale=None, impl="auto", library=None):
        """run(), then replay() into the emulator `library`; returns (out, lse, recording, mps tensors)
        with out and lse copied back to the CPU after the replay."""
        rec, tensors = self.run(q, k, v, causal, scale, impl)
        replay(rec, library)
        self.complete_gpu_work()
        return self.to_cpu(tensors[3]), self.to_cpu(tensors[4]), rec, tensors


    def run_backward(self, grad_out, q, k, v, out, lse, causal=False, scale=None, grad_lse=None, impl="auto"):
        """Calls attention_backward on fake MPS copies (layouts kept), without replay.

        Returns (recording, (grad_q, grad_k, grad_v) as fake MPS tensors, the inputs as fake MPS tensors).
        """
        dev = [self.to_mps(t) for t in (grad_out, q, k, v, out, lse)]
        g = None if grad_lse is None else self.to_mps(grad_lse)
        self.take_recording()
        grads = torch.ops.flash_metal.attention_backward(*dev, causal, scale, g, impl)[:3]
        return self.take_recording(), grads, (*dev, g)

    def backward(self, grad_out, q, k, v, out, lse, causal=False, scale=None, grad_lse=None, library=None):
        """run_backward(), then replay() into the emulator `library`; returns
        (grad_q, grad_k, grad_v) copied back to the CPU, and the recording."""
        rec, grads, _ = self.run_backward(grad_out, q, k, v, out, lse, causal, scale, grad_lse)
        replay(rec, library)
        self.complete_gpu_work()
        return tuple(self.to_cpu(t) for t in grads), rec


    def call(self, op: str, *args, library=None, **kwargs):
        """Any flash_metal op on fake MPS copies of its tensor arguments (layouts
        kept), replayed into `library`. Returns (outputs copied to the CPU, recording)."""
        def dev(x):
            return self.to_mps(x) if isinstance(x, torch.Tensor) else x
        args = [dev(a) for a in args]
        kwargs = {k: dev(v) for k, v in kwargs.items()}
        self.take_recording()
        outs = getattr(torch.ops.flash_metal, op)(*args, **kwargs)
        rec = self.take_recording()
        replay(rec, library)
        self.complete_gpu_work()
        return tuple(self.to_cpu(t) for t in outs), rec


def load(path: str) -> Host:
    return Host(path)


_SESSION: dict = {}


def session_host(lib: str, emu_library, directory: str) -> Host:
    """The host loaded into this process once, from a package look-alike in `directory` with a fresh
    fake metallib of emu_library's source's kernels (source_kernel_names: a metallib holds every kernel,
    the ones a partial emulator build left out too). Later calls (from any test module) return the same Host,
    whatever they pass: a second copy of the library cannot load into the process (its op
    registrations would clash). The process's first op call, which loads the shader library, is kept
    as host.first_recording."""
    if "host" not in _SESSION:
        from numerics import make_qkv

        h = load(package_dir(lib, directory, "fresh", emu_library.source_kernel_names()))
        h.package = directory
        q, k, v = make_qkv(1, 2, 1, 5, 7, 16, torch.float32, generator=torch.Generator().manual_seed(0))
        h.first_recording, _ = h.run(q, k, v)
        _SESSION["host"] = h
    return _SESSION["host"]


def require_toolchain() -> dict:
    """toolchain(), or end the calling test: skipped on macOS, even with CI=true (the real Metal framework
    runs there instead); elsewhere prereqs.unavailable (skipped locally, failed with CI=true)."""
    import pytest
    from prereqs import unavailable

    try:
        return toolchain()
    except LinuxOnly as err:
        pytest.skip(str(err))
    except ToolchainMissing as err:
        unavailable(str(err))


def require_build(overrides=None, sdk=None) -> str:
    """build(), after require_toolchain()."""
    require_toolchain()
    return build(overrides, sdk)


def _buffer_view(contents: int, length: int, offset: int) -> torch.Tensor:
    """A uint8 CPU tensor over a fake MTLBuffer's memory from `offset` to its end."""
    raw = (ctypes.c_uint8 * max(length, 1)).from_address(contents)
    whole = torch.frombuffer(raw, dtype=torch.uint8, count=length)
    return whole[offset:]


class ReplayError(Exception):
    """The recording cannot be replayed (what a GPU would reject or misrun)."""


def replay(recording: dict, library, mpp_library=None) -> list[str]:
    """Runs every dispatch of `recording` in the emulator `library` (an MSL 4
    tensor-op kernel in `mpp_library`, with the constants it does not declare
    dropped, as Metal ignores them), with the
    encoder state (pipeline, buffers at their byte offsets, bytes, threadgroup
    memory) as Metal would have it at that point: a new encoder (after the
    stream ended the previous one) starts empty, and a call on an ended
    encoder is an error. Returns the kernel names.
    """
    pipeline = None
    buffers: dict[int, tuple[int, int, int]] = {}
    inline: dict[int, bytes] = {}
    tg_memory: dict[int, int] = {}
    ran = []
    for e in recording["events"]:
        op = e["op"]
        if e.get("ended"):
            raise ReplayError(f"{op} on compute encoder #{e['encoder']} after it ended: Metal would abort")
        if op == "stream.endKernelCoalescing":
            # A new encoder starts with nothing bound: what the next dispatch
            # needs, it must bind again.
            pipeline = None
            buffers.clear()
            inline.clear()
            tg_memory.clear()
        elif op == "setComputePipelineState":
            pipeline = e
        elif op == "setBuffer":
            buffers[e["index"]] = (e["contents"], e["length"], e["offset"])
            inline.pop(e["index"], None)
        elif op == "setBufferOffset":
            if e["index"] not in buffers:
                raise ReplayError(f"setBufferOffset at index {e['index']} with no buffer bound there")
            contents, length, _ = buffers[e["index"]]
            buffers[e["index"]] = (contents, length, e["offset"])
        elif op == "setBytes":
            inline[e["index"]] = bytes.fromhex(e["hex"])
            buffers.pop(e["index"], None)
        elif op == "setThreadgroupMemoryLength":
            tg_memory[e["index"]] = e["length"]
        elif op in ("dispatchThreadgroups", "dispatchThreads"):
            if pipeline is None:
                raise ReplayError(f"{op} before any setComputePipelineState")
            if op == "dispatchThreads":
                threads, group = e["threads"], e["threadgroup"]
                if any(t % g for t, g in zip(threads, group)):
                    raise ReplayError(f"dispatchThreads {threads} by {group}: non-uniform threadgroups "
                                      "are not modelled by the emulator")
                grid = [t // g for t, g in zip(threads, group)]
            else:
                grid, group = e["grid"], e["threadgroup"]
            constants = {int(i): v for i, v in pipeline["constants"].items()}
            target = library
            if pipeline["kernel"].startswith(MPP_KERNEL_PREFIXES):
                if mpp_library is None:
                    raise ReplayError(f"{pipeline['kernel']} is an MSL 4 kernel and no MSL 4 library was given")
                target = mpp_library
                if any(constants.pop(i, False) for i in MPP_UNDECLARED_CONSTANTS):
                    raise ReplayError(f"{pipeline['kernel']}: a constant it does not declare is set")
            target.dispatch(
                pipeline["kernel"],
                buffers={i: _buffer_view(*b) for i, b in buffers.items()},
                bytes=dict(inline),
                function_constants=constants,
                grid=tuple(grid), threadgroup=tuple(group), threadgroup_memory=dict(tg_memory))
            ran.append(pipeline["kernel"])
    return ran
