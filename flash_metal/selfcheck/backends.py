"""Where python -m flash_metal.selfcheck runs the kernels: a Mac's GPU (mps), or the Metal emulator (metal-emu).

Each backend runs one sweep case (returning CPU tensors and the launches it
made), describes the platform and where the kernels came from, lists the
pipelines with their thread limits, and runs the lane-layout probe.

Host information on MPS comes from two ops, read defensively (a build
without them says "not available in this build"):
- torch.ops.flash_metal.metal_device_info() -> JSON: the device, its GPU
  families, where the library came from, every pipeline built (see
  parse_device_info: schema 1);
- flash_metal.explain(...).dispatches[i].max_threads_per_threadgroup: the
  planner's N, the most threads it will ever launch that kernel with.
"""
import json
import os
import platform
import subprocess
import sys
from typing import Dict, List, Optional

import torch

import flash_metal

from . import lanes

NOT_AVAILABLE = "not available in this build"


class Unavailable(Exception):
    """The backend cannot run here; the message says why and what to do instead."""


def parse_device_info(raw) -> dict:
    """metal_device_info()'s JSON (schema 1, documented at its schema in
    csrc/flash_metal.cpp), reduced to what the report shows: whether a device
    is available and why not, its name, GPU families (those reported true),
    macOS version, the shader library (origin, whether it was compiled at run
    time and why, a load error), the pipelines built with their limits, and
    the pipelines that failed. The raw JSON is kept, so nothing is lost.
    Raises ValueError on another schema, rather than guessing at keys."""
    info = json.loads(raw) if isinstance(raw, (str, bytes)) else dict(raw)
    if info.get("schema") != 1:
        raise ValueError(f"metal_device_info schema {info.get('schema')!r}; this selfcheck reads schema 1")
    device = info.get("device") or {}
    families = device.get("families") or {}
    lib = info.get("library") or {}
    library = {"origin": lib.get("origin") or lib.get("path"),
               "runtime_compile": None if lib.get("kind") is None else lib.get("kind") == "runtime_compile",
               "reason": lib.get("reason") or None, "error": lib.get("error")}
    pipelines = [{"name": p["kernel"], "function_constants": p.get("function_constants"),
                  "max_threads": p.get("max_total_threads_per_threadgroup"),
                  "thread_execution_width": p.get("thread_execution_width")}
                 for p in info.get("pipelines") or []]
    tops = info.get("tensor_ops") or {"usable": False, "reason": "this build's metal_device_info does not report it"}
    return {"available": bool(info.get("available")), "reason": info.get("reason"), "tensor_ops": tops,
            "name": device.get("name"), "families": sorted(k for k, ok in families.items() if ok) or None,
            "macos": (info.get("macos") or {}).get("version"), "library": library,
            "pipelines": pipelines, "pipeline_errors": list(info.get("pipeline_errors") or []), "raw": info}


def _launch(d) -> dict:
    tg = tuple(d.threadgroup)
    return {"kernel": d.kernel_name, "threads": int(tg[0] * tg[1] * tg[2]),
            "max_threads_per_threadgroup": getattr(d, "max_threads_per_threadgroup", None)}


def planned_launches(case, inputs) -> List[dict]:
    """The planner's launches for a case (flash_metal.explain on the CPU copies: the plan is device-independent)."""
    q, k, v, opts = inputs["q"], inputs["k"], inputs["v"], dict(inputs["options"])
    if "varlen" in inputs:
        cq, ck, mq, mk = inputs["varlen"]
        opts.update(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk)
    if case.backward:
        opts.update(backward=True, grad_out=inputs["grad_out"], out=inputs["out"], lse=inputs["lse"],
                    grad_lse=inputs["grad_lse"])
    return [_launch(d) for d in flash_metal.explain(q, k, v, case.causal, None, case.impl, **opts).dispatches]


def _sysctl(name: str) -> Optional[str]:
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def _cpu_model() -> Optional[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def base_platform() -> dict:
    mlx = None
    try:
        import mlx.core as mx
        mlx = getattr(mx, "__version__", "installed")
    except Exception:  # noqa: BLE001
        pass
    return {
        "os": platform.platform(),
        "macos": platform.mac_ver()[0] or None,
        "machine": platform.machine(),
        "chip": _sysctl("machdep.cpu.brand_string") if sys.platform == "darwin" else _cpu_model(),
        "model": _sysctl("hw.model") if sys.platform == "darwin" else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "flash_metal": getattr(flash_metal, "__version__", None),
        "flash_metal_path": os.path.dirname(os.path.abspath(flash_metal.__file__)),
        "mlx": mlx,
        "env": {k: os.environ[k] for k in ("FLASH_METAL_RUNTIME_COMPILE", "FLASH_METAL_REQUIRE_METALLIB",
                                           "PYTORCH_ENABLE_MPS_FALLBACK") if k in os.environ},
    }


def pipeline_rows(pipelines: List[dict], planner: Dict[str, dict]) -> List[dict]:
    """Each pipeline's thread limit against the planner's N and the largest threadgroup the sweep launched."""
    rows = []
    for p in pipelines:
        seen = planner.get(p["name"], {})
        n, largest, pm = seen.get("planner_max"), seen.get("largest"), p.get("max_threads")
        if not pm:
            status, note = "unchecked", "no limit reported"
        elif n is not None and pm < n:
            status, note = "failed", f"admits {pm} threads, the planner may launch {n}"
        elif largest is not None and pm < largest:
            status, note = "failed", f"admits {pm} threads, the sweep launched {largest}"
        elif n is None and largest is None:
            status, note = "unchecked", "not launched by this sweep"
        else:
            status, note = "ok", ""
        rows.append({**{k: p.get(k) for k in ("name", "function_constants", "max_threads", "thread_execution_width")},
                     "planner_max_threads": n, "largest_launched": largest, "status": status, "note": note})
    return rows


class MpsBackend:
    name = "mps"
    timing_device = "mps"
    poisons_outputs = False  # the op allocates its outputs: poisoned only through torch (sweep.poisoned_allocations)

    def __init__(self):
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            built = hasattr(torch.backends, "mps") and torch.backends.mps.is_built()
            why = ("this torch has MPS support but no usable Metal device is available (macOS older than 12.3, "
                   "or no Apple GPU)" if built else
                   f"this torch ({torch.__version__}) has no MPS support on {platform.system()} {platform.machine()}")
            raise Unavailable(
                f"--backend mps needs a Mac with Apple silicon and an MPS-enabled torch: "
                f"torch.backends.mps.is_available() is False here ({why}).\n"
                "In a source checkout on Linux, `python -m flash_metal.selfcheck --backend metal-emu` runs the same "
                "checks through the project's Metal emulator (needs clang 19 and the test extras).")
        try:
            x = torch.arange(4.0, device="mps")
            ok = (x * 2).sum().item() == 12.0
        except Exception as err:  # noqa: BLE001
            raise Unavailable(f"MPS reports itself available, but a trivial MPS computation failed: {err}") from err
        if not ok:
            raise Unavailable("MPS reports itself available, but a trivial MPS computation gave a wrong result")

    @staticmethod
    def _dev(t):
        return None if t is None else t.to("mps")

    def run(self, case, inputs):
        d = self._dev
        q, k, v = (d(inputs[n]) for n in ("q", "k", "v"))
        opts = {n: (d(t) if isinstance(t, torch.Tensor) else t) for n, t in inputs["options"].items()}
        if case.family == "varlen":
            cq, ck, mq, mk = inputs["varlen"]
            res = flash_metal.attention_varlen_with_lse(q, k, v, d(cq), d(ck), mq, mk, case.causal, None,
                                                        impl=case.impl, **opts)
        elif case.family == "varlen_backward":
            cq, ck, mq, mk = inputs["varlen"]
            res = torch.ops.flash_metal.attention_varlen_backward(
                d(inputs["grad_out"]), q, k, v, d(inputs["out"]), d(inputs["lse"]), d(cq), d(ck), mq, mk,
                case.causal, None, d(inputs["grad_lse"]), **opts)[:3]
        elif case.backward:
            res = torch.ops.flash_metal.attention_backward(
                d(inputs["grad_out"]), q, k, v, d(inputs["out"]), d(inputs["lse"]), case.causal, None,
                d(inputs["grad_lse"]), case.impl, **opts)[:3]
        else:
            res = flash_metal.attention_with_lse(q, k, v, case.causal, None, case.impl, **opts)
        torch.mps.synchronize()
        return tuple(t.cpu() for t in res), planned_launches(case, inputs)

    def device_info(self) -> dict:
        op = getattr(torch.ops.flash_metal, "metal_device_info", None)
        if op is None:
            return {"available": False, "reason": f"torch.ops.flash_metal.metal_device_info: {NOT_AVAILABLE}"}
        try:
            return parse_device_info(op())
        except Exception as err:  # noqa: BLE001
            return {"available": False, "reason": f"metal_device_info() failed: {type(err).__name__}: {err}"}

    def platform(self) -> dict:
        info = self.device_info()
        return {**base_platform(), "backend": "mps", "gpu": info.get("name") or NOT_AVAILABLE,
                "gpu_families": info.get("families") or NOT_AVAILABLE}

    def library(self, built_all: dict) -> dict:
        info = self.device_info()
        pkg = os.path.dirname(os.path.abspath(flash_metal.__file__))
        out = {"metallib_installed": os.path.isfile(os.path.join(pkg, "flash_metal.metallib")),
               "metallib_fingerprint_installed": os.path.isfile(os.path.join(pkg, "flash_metal.metallib.fnv1a64"))}
        if info.get("available"):
            out.update(info["library"])
        elif built_all.get("origin"):
            out["origin"] = built_all["origin"]
        else:
            out["origin"] = NOT_AVAILABLE
            out["reason"] = info.get("reason")
        return out

    def build_all_pipelines(self) -> dict:
        """metal_build_all_pipelines: every (kernel, constants) the planner can return, built with real Metal."""
        op = getattr(torch.ops.flash_metal, "metal_build_all_pipelines", None)
        if op is None:
            return {"status": "skipped", "detail": f"metal_build_all_pipelines: {NOT_AVAILABLE}"}
        try:
            origin, built = op()
        except Exception as err:  # noqa: BLE001
            return {"status": "failed", "detail": f"{type(err).__name__}: {str(err)[:1500]}"}
        self._built = list(built)
        return {"status": "passed", "origin": origin, "count": len(built),
                "detail": f"{len(built)} pipelines built from {origin}"}

    def pipelines(self, planner: Dict[str, dict]) -> dict:
        info = self.device_info()
        if info.get("available"):
            return {"available": True, "source": "metal_device_info() after the sweep",
                    "rows": pipeline_rows(info["pipelines"], planner)}
        built = getattr(self, "_built", None)
        if not built:
            return {"available": False, "reason": info.get("reason"), "rows": []}
        # Without the device-info op: the names metal_build_all_pipelines built ("kernel/constants"), no limits.
        rows = [{"name": e.rsplit("/", 1)[0], "function_constants": e.rsplit("/", 1)[-1] if "/" in e else None,
                 "max_threads": None, "thread_execution_width": None} for e in built]
        return {"available": True, "rows": pipeline_rows(rows, planner),
                "source": f"metal_build_all_pipelines() (thread limits: {info.get('reason')})"}

    def lane_probe(self) -> dict:
        return lanes.run_on_mps()


def find_source_root(explicit: Optional[str] = None) -> Optional[str]:
    """A source checkout: the given directory, the current one, or the one holding this package."""
    # the directory above flash_metal/ (this file is flash_metal/selfcheck/backends.py)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for root in ([explicit] if explicit else [os.getcwd(), here]):
        if all(os.path.exists(os.path.join(root, p)) for p in ("tests/backends.py", "tests/metal_emulator/__init__.py",
                                                                "shaders/attention.metal")):
            return os.path.abspath(root)
    return None


class EmulatorBackend:
    """The same sweep through the project's Metal emulator (tests/metal_emulator), launched by
    tests/backends.py with the host's own plan: only in a source checkout."""

    name = "metal-emu"
    timing_device = "cpu"
    poisons_outputs = True  # tests/backends.py fills outputs and scratch with NaN before every launch

    def __init__(self, source: Optional[str] = None):
        root = find_source_root(source)
        if root is None:
            where = f"--source {source}" if source else f"the current directory ({os.getcwd()})"
            raise Unavailable(
                f"--backend metal-emu needs a source checkout of flash_metal (with tests/backends.py, "
                f"tests/metal_emulator/ and shaders/), and {where} is not one. The emulator is a test tool and is not "
                "installed with the package: run this from the repository root (or pass --source DIR).")
        self.root = root
        tests = os.path.join(root, "tests")
        if tests not in sys.path:
            sys.path.insert(0, tests)
        try:
            import backends  # noqa: F401  (tests/backends.py)
            from metal_emulator import find_clang
        except ImportError as err:
            raise Unavailable(f"cannot import the emulator from {tests}: {err} (install the test extras: "
                              "pip install '.[test]')") from err
        self.backends = backends
        try:
            self.clang = find_clang()
        except Exception as err:  # noqa: BLE001
            raise Unavailable(f"the Metal emulator needs clang 19: {err}") from err

    def prepare(self):
        """Builds (or loads from its cache) the emulator's default library of the shader instantiations
        (every one but the wide decode's, which tests/backends.py builds on first use)."""
        return self.backends.metal_library(False, False)

    def run(self, case, inputs):
        b = self.backends
        q, k, v, opts = inputs["q"], inputs["k"], inputs["v"], inputs["options"]
        if case.family == "varlen":
            res = b.run_varlen("metal-emu", q, k, v, *inputs["varlen"], case.causal, None, case.impl, **opts)
        elif case.family == "varlen_backward":
            res = b.run_varlen_backward("metal-emu", inputs["grad_out"], q, k, v, inputs["out"], inputs["lse"],
                                        *inputs["varlen"], case.causal, None, inputs["grad_lse"], **opts)
        elif case.backward:
            res = b.run_backward("metal-emu", inputs["grad_out"], q, k, v, inputs["out"], inputs["lse"], case.causal,
                                 None, inputs["grad_lse"], impl=case.impl, **opts)
        else:
            res = b.run_attention("metal-emu", q, k, v, case.causal, None, case.impl, **opts)
        # The launches that ran: the emulator's record of this call's dispatches.
        return tuple(res), [_launch(d) for d, _ in b.LAST_DISPATCHES]

    def platform(self) -> dict:
        return {**base_platform(), "backend": "metal-emu", "source_checkout": self.root,
                "gpu": f"none: the project's Metal emulator (clang: {self.clang})", "gpu_families": "n/a (emulator)"}

    def library(self, built_all: dict) -> dict:
        shader = os.path.join(self.root, "shaders", "attention.metal")
        planner = os.path.dirname(os.path.abspath(flash_metal.__file__))
        return {"origin": f"{shader}, compiled as C++ by the Metal emulator ({self.clang}); planned by the "
                          f"imported flash_metal ({planner})",
                "runtime_compile": None, "reason": "metal-emu: no Metal library; the emulator runs the shader sources"}

    def build_all_pipelines(self) -> dict:
        lib = self.prepare()
        built, left_out = len(lib.kernel_names()), len(lib.omitted_names())
        # The default build leaves the wide decode out (tests/shader_builds.py); it is built on first use.
        return {"status": "passed", "count": built,
                "detail": f"the emulator built {built} of the {built + left_out} instantiations of "
                          f"shaders/attention.metal" + (f" (the other {left_out}, the wide decode's, are built when "
                                                        "a case runs them)" if left_out else "")}

    def pipelines(self, planner: Dict[str, dict]) -> dict:
        lib = self.prepare()
        rows = []
        for name in sorted(lib.dispatched_names()):
            try:
                declared = lib._kernel(name)[1].max_threads or None  # [[max_total_threads_per_threadgroup(N)]]
            except Exception:  # noqa: BLE001
                declared = None
            rows.append({"name": name, "max_threads": declared, "thread_execution_width": 32})
        return {"available": True, "rows": pipeline_rows(rows, planner),
                "source": "the emulator's registry: each kernel dispatched by the sweep, with its declared "
                          "[[max_total_threads_per_threadgroup]] (none: not declared)"}

    def lane_probe(self) -> dict:
        from metal_emulator import compile_library

        return lanes.run_on_emulator(compile_library, self.root)
