"""compile_library() and Library.dispatch(): the Python face of the emulator."""

from __future__ import annotations

import ctypes
import json
import re
import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from . import _build, _prepass, _registry


class EmulatorError(Exception):
    """A sanitizer finding or an invalid dispatch. `reports` holds the parsed findings."""

    def __init__(self, message: str, reports: list[dict] | None = None):
        super().__init__(message)
        self.reports = reports or []

    @property
    def kinds(self) -> set[str]:
        return {r["kind"] for r in self.reports}


# ---- ctypes mirror of runtime/internal.h -------------------------------------------
class _Role(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("index", ctypes.c_int)]


class _BufferDesc(ctypes.Structure):
    _fields_ = [("index", ctypes.c_int), ("writable", ctypes.c_int), ("data", ctypes.c_void_p), ("size", ctypes.c_uint64)]


class _DispatchDesc(ctypes.Structure):
    _fields_ = [
        ("kernel", ctypes.c_int),
        ("nroles", ctypes.c_int),
        ("roles", ctypes.POINTER(_Role)),
        ("nbuffers", ctypes.c_int),
        ("buffers", ctypes.POINTER(_BufferDesc)),
        ("ntg", ctypes.c_int),
        ("tg_lengths", ctypes.POINTER(ctypes.c_uint64)),
        ("grid", ctypes.c_uint * 3),
        ("threadgroup", ctypes.c_uint * 3),
        ("max_threads", ctypes.c_uint),
        ("seed", ctypes.c_uint64),
    ]


class _KernelCounts(ctypes.Structure):
    _fields_ = [(n, ctypes.c_ulonglong) for n in ("simdgroup_mmas", "simdgroup_loads", "simdgroup_stores", "exp2_calls",
                                                  "mpp_runs", "mpp_flops", "mpp_coord_queries",
                                                  "mpp_checked_runs", "mpp_relaxed_runs")]


class _CountsDesc(ctypes.Structure):
    _fields_ = [
        ("threadgroups", ctypes.c_uint64),
        ("threads", ctypes.c_uint64),
        ("threadgroup_barriers", ctypes.c_uint64),
        ("simdgroup_barriers", ctypes.c_uint64),
        ("threadgroup_bytes_read", ctypes.c_uint64),
        ("threadgroup_bytes_written", ctypes.c_uint64),
        ("device_bytes_read", ctypes.c_uint64 * 32),
        ("device_bytes_written", ctypes.c_uint64 * 32),
        ("kernel", _KernelCounts),
        ("device_loads", (ctypes.c_uint64 * 5) * 32),
        ("threadgroup_loads", ctypes.c_uint64 * 5),
        ("device_unique_bytes_read", ctypes.c_uint64 * 32),
        ("device_load_requests", ctypes.c_uint64 * 32),
        ("device_request_bytes", ctypes.c_uint64 * 32),
        ("device_load_windows", ctypes.c_uint64 * 32),
        ("device_window_loads", ctypes.c_uint64 * 32),
        ("device_window_max", ctypes.c_uint64 * 32),
    ]


_WIDTHS = (1, 2, 4, 8, 16)  # bytes of the access-callback widths, slot by slot


def _by_width(row) -> dict[int, int]:
    return {w: int(row[i]) for i, w in enumerate(_WIDTHS) if row[i]}


@dataclass(frozen=True)
class DispatchCounts:
    """What one Library.dispatch did, counted exactly (see README.md, "Counters").

    Every build: threadgroups and threads launched; threadgroup_barriers
    (threadgroup_barrier rendezvous, once per threadgroup per barrier);
    simdgroup_barriers (once per SIMD-group per barrier); simdgroup_mmas
    (simdgroup_multiply_accumulate and simdgroup_multiply), simdgroup_loads
    and simdgroup_stores, once per SIMD-group per call; exp2_calls (metal::,
    fast:: and precise:: exp2 and exp, per thread per call, a vector of n
    elements counting n); mpp_runs (MPP matmul2d run(), once per scope per
    call: per SIMD-group on execution_simdgroup, per threadgroup on
    execution_simdgroups<N>) and mpp_flops (2 M N K per counted run);
    mpp_coord_queries (cooperative-tensor bookkeeping, per thread per call:
    get_multidimensional_index of a cooperative tensor or its iterator,
    is_valid_element and map_iterator); mpp_checked_runs, the counted runs
    with a tensor operand of some dynamic extent (edge-checked against it;
    static slices are not), and mpp_relaxed_runs, those whose descriptor
    sets relaxed_precision.

    Instrumented build only (None in the fast build, whose loads and stores
    are not hooked): device_bytes_read / device_bytes_written, the bytes of
    every load and store of device memory as the -O1 kernel performs them,
    in total and per [[buffer(n)]] index (..._by_index, one entry per bound
    index, bytes= buffers included: constant-space reads such as a params
    struct count too); threadgroup_bytes_read / threadgroup_bytes_written.
    The instruction mix of those reads: device_loads_by_index, {index:
    {width in bytes: load instructions}} (one access of the -O1 kernel each,
    so a 16-byte uint4 load counts once, a 2-byte half load once), and
    threadgroup_loads_by_width, {width: loads}; widths with no load are left
    out. The traffic model's rules (issue 19), {index: n}:
    device_unique_bytes_read_by_index, the bytes of each load whose address
    its threadgroup did not read within its last 8 KiB of such bytes
    (runtime kL1WindowBytes), summed over threadgroups (DRAM traffic if
    SIMD-groups of a threadgroup share lines through the core's L1: an
    assumption); device_load_requests_by_index and
    device_request_bytes_by_index, the loads and their bytes after the
    broadcast rule: the lanes of a SIMD-group executing one load instruction
    at the same address count once. Loads in flight (issue 43):
    device_load_windows_by_index, device_window_loads_by_index and
    device_window_max_by_index: a SIMD-group's load window is its run of
    load instructions (as the broadcast rule counts them) between two of its
    meetings (collective, barrier, threadgroup end), loads that can all be
    in flight at once; the windows holding a load of buffer n, their load
    instructions, and the most in one window.
    """

    threadgroups: int
    threads: int
    threadgroup_barriers: int
    simdgroup_barriers: int
    simdgroup_mmas: int
    simdgroup_loads: int
    simdgroup_stores: int
    exp2_calls: int
    device_bytes_read: int | None
    device_bytes_written: int | None
    device_bytes_read_by_index: dict[int, int] | None
    device_bytes_written_by_index: dict[int, int] | None
    threadgroup_bytes_read: int | None
    threadgroup_bytes_written: int | None
    device_loads_by_index: dict[int, dict[int, int]] | None
    threadgroup_loads_by_width: dict[int, int] | None
    device_unique_bytes_read_by_index: dict[int, int] | None = None
    device_load_requests_by_index: dict[int, int] | None = None
    device_request_bytes_by_index: dict[int, int] | None = None
    device_load_windows_by_index: dict[int, int] | None = None
    device_window_loads_by_index: dict[int, int] | None = None
    device_window_max_by_index: dict[int, int] | None = None
    mpp_runs: int = 0
    mpp_flops: int = 0
    mpp_coord_queries: int = 0
    mpp_checked_runs: int = 0
    mpp_relaxed_runs: int = 0


def _counts(raw: _CountsDesc, instrumented: bool, indices) -> DispatchCounts:
    k = raw.kernel
    exact = {}
    if instrumented:
        read = {i: int(raw.device_bytes_read[i]) for i in sorted(indices)}
        written = {i: int(raw.device_bytes_written[i]) for i in sorted(indices)}
        exact = dict(device_bytes_read=sum(read.values()), device_bytes_written=sum(written.values()),
                     device_bytes_read_by_index=read, device_bytes_written_by_index=written,
                     threadgroup_bytes_read=int(raw.threadgroup_bytes_read),
                     threadgroup_bytes_written=int(raw.threadgroup_bytes_written),
                     device_loads_by_index={i: _by_width(raw.device_loads[i]) for i in sorted(indices)},
                     threadgroup_loads_by_width=_by_width(raw.threadgroup_loads),
                     device_unique_bytes_read_by_index={i: int(raw.device_unique_bytes_read[i]) for i in sorted(indices)},
                     device_load_requests_by_index={i: int(raw.device_load_requests[i]) for i in sorted(indices)},
                     device_request_bytes_by_index={i: int(raw.device_request_bytes[i]) for i in sorted(indices)},
                     device_load_windows_by_index={i: int(raw.device_load_windows[i]) for i in sorted(indices)},
                     device_window_loads_by_index={i: int(raw.device_window_loads[i]) for i in sorted(indices)},
                     device_window_max_by_index={i: int(raw.device_window_max[i]) for i in sorted(indices)})
    else:
        exact = dict.fromkeys(("device_bytes_read", "device_bytes_written", "device_bytes_read_by_index",
                               "device_bytes_written_by_index", "threadgroup_bytes_read", "threadgroup_bytes_written",
                               "device_loads_by_index", "threadgroup_loads_by_width"))
    return DispatchCounts(threadgroups=int(raw.threadgroups), threads=int(raw.threads),
                          threadgroup_barriers=int(raw.threadgroup_barriers),
                          simdgroup_barriers=int(raw.simdgroup_barriers), simdgroup_mmas=int(k.simdgroup_mmas),
                          simdgroup_loads=int(k.simdgroup_loads), simdgroup_stores=int(k.simdgroup_stores),
                          exp2_calls=int(k.exp2_calls), mpp_runs=int(k.mpp_runs), mpp_flops=int(k.mpp_flops),
                          mpp_coord_queries=int(k.mpp_coord_queries),
                          mpp_checked_runs=int(k.mpp_checked_runs), mpp_relaxed_runs=int(k.mpp_relaxed_runs),
                          **exact)


_UNSET = 2**64 - 1
# Library.dispatch(mpp_layout=): FMEMU_MPP_LAYOUT_* in include/fm/abi.h.
_MPP_LAYOUTS = {"m5": 0, "scrambled": 1}
_MAX_INDEX = 32  # Metal's buffer / threadgroup argument table size (indices 0..30 usable)

# Every kernel host name any Library dispatched in this process.
DISPATCHED: set[str] = set()


def _as3(v) -> tuple[int, int, int]:
    if isinstance(v, int):
        v = (v,)
    v = tuple(int(x) for x in v)
    return (v + (1, 1, 1))[:3]


class _Binding:
    """Memory for one [[buffer(n)]]: a tensor's storage, a numpy array, or bytes."""

    def __init__(self, value, writable: bool):
        self.keep = None
        if hasattr(value, "untyped_storage"):  # torch.Tensor
            if value.device.type != "cpu":
                raise EmulatorError(f"the emulator binds CPU tensors only, got a {value.device} tensor")
            storage = value.untyped_storage()
            offset = value.storage_offset() * value.element_size()
            self.data = storage.data_ptr() + offset
            self.size = storage.nbytes() - offset
            self.keep = value
        elif hasattr(value, "__array_interface__"):  # numpy
            if not value.flags["C_CONTIGUOUS"]:
                raise EmulatorError("numpy buffers must be C-contiguous")
            self.data = value.ctypes.data
            self.size = value.nbytes
            self.keep = value
            writable = writable and value.flags["WRITEABLE"]
        elif isinstance(value, (bytes, bytearray, memoryview)):
            raw = bytes(value)
            self.keep = ctypes.create_string_buffer(raw, len(raw) or 1)
            self.data = ctypes.addressof(self.keep)
            self.size = len(raw)
            writable = False
        else:
            raise EmulatorError(f"cannot bind {type(value).__name__} as a buffer (tensor, numpy array or bytes)")
        self.writable = writable


class Library:
    """One compiled set of .metal files (a stand-in for an MTLLibrary)."""

    def __init__(self, so_path: str, decls: list[_registry.KernelDecl], sources: list[str], instrumented: bool,
                 fast_math: bool = False):
        self.path = so_path
        self.instrumented = instrumented
        self.fast_math = fast_math
        self.sources = sources
        self._lib = ctypes.CDLL(so_path)
        self._lock = threading.Lock()
        lib = self._lib
        for name in ("fm_kernel_host_name", "fm_kernel_expr", "fm_kernel_file", "fm_function_constant_name", "fm_last_reports",
                     "fm_omitted_kernel_host_name", "fm_omitted_kernel_expr"):
            getattr(lib, name).restype = ctypes.c_char_p
        lib.fm_set_function_constant.argtypes = [ctypes.c_int, ctypes.c_double]
        lib.fm_dispatch.argtypes = [ctypes.POINTER(_DispatchDesc)]
        lib.fm_last_counts.argtypes = [ctypes.POINTER(_CountsDesc)]
        lib.fm_last_counts.restype = ctypes.c_ulong
        lib.fm_set_mpp_layout.argtypes = [ctypes.c_int, ctypes.c_ulonglong]
        self._kernels: dict[str, tuple[int, _registry.KernelDecl]] = {}
        for i in range(lib.fm_num_kernels()):
            host = lib.fm_kernel_host_name(i).decode()
            expr = lib.fm_kernel_expr(i).decode()
            if host in self._kernels:
                raise EmulatorError(f"two kernels share the host name {host!r}")
            self._kernels[host] = (i, _registry.match(expr, decls))
        # Kernels of the source a partial build left out (compile_library's only / exclude): their
        # declarations (signature, max threads) but nothing to run.
        self._omitted: dict[str, _registry.KernelDecl] = {}
        for i in range(lib.fm_num_omitted_kernels()):
            host = lib.fm_omitted_kernel_host_name(i).decode()
            if host in self._kernels or host in self._omitted:
                raise EmulatorError(f"two kernels share the host name {host!r}")
            self._omitted[host] = _registry.match(lib.fm_omitted_kernel_expr(i).decode(), decls)
        self._fc_indices = {lib.fm_function_constant_index(i) for i in range(lib.fm_num_function_constants())}
        self.dispatched: set[str] = set()

    def kernel_names(self) -> list[str]:
        """Every host name (instantiation) in the library, sorted: the kernels it can run."""
        return sorted(self._kernels)

    def omitted_names(self) -> list[str]:
        """The host names of the source a partial build left out (compile_library's only / exclude),
        sorted; [] for a whole library. signature() and max_threads() answer for them, dispatch() refuses."""
        return sorted(self._omitted)

    def source_kernel_names(self) -> list[str]:
        """Every host name the source holds, built or left out, sorted: what a Metal compiler's library
        of the same source would hold."""
        return sorted([*self._kernels, *self._omitted])

    def dispatched_names(self) -> set[str]:
        return set(self.dispatched)

    def signature(self, name: str) -> list[_registry.Param]:
        """The kernel's parameters (a left-out kernel's too: omitted_names)."""
        return list(self._decl(name).params)

    def max_threads(self, name: str) -> int:
        """The kernel's [[max_total_threads_per_threadgroup(N)]], 0 when it declares none (a left-out
        kernel's too: omitted_names)."""
        return self._decl(name).max_threads

    def _decl(self, name: str) -> _registry.KernelDecl:
        return self._omitted[name] if name in self._omitted else self._kernel(name)[1]

    def _kernel(self, name: str):
        try:
            return self._kernels[name]
        except KeyError:
            if name in self._omitted:
                raise EmulatorError(f"kernel {name!r} was left out of this partial library (compile_library's "
                                    f"only / exclude); build one that holds it") from None
            raise EmulatorError(f"no kernel named {name!r}; the library has: {', '.join(self.kernel_names())}") from None

    def dispatch(self, name: str, buffers=None, bytes=None, function_constants=None, grid=(1, 1, 1),
                 threadgroup=(1, 1, 1), threadgroup_memory=None, seed: int = 0, mpp_layout: str = "scrambled",
                 mpp_seed: int = 1) -> DispatchCounts:
        """Run kernel `name` like dispatchThreadgroups:threadsPerThreadgroup:.

        buffers: {index: tensor | numpy array} bound like setBuffer:offset:atIndex:
        (the bound range runs from the tensor's first element to its storage's
        end; results are written back). bytes: {index: bytes | uint8 tensor}
        like setBytes:length:atIndex:. function_constants: {index: bool | int |
        float}. grid: threadgroups per grid. threadgroup: threads per
        threadgroup. threadgroup_memory: {index: bytes} like
        setThreadgroupMemoryLength:atIndex:. seed: 0 runs threads in a fixed
        order; any other value shuffles the order of ready threads (seeded).
        Returns the run's DispatchCounts (byte counts None unless this is the
        instrumented build). Raises EmulatorError on any finding.
        """
        index, decl = self._kernel(name)
        if mpp_layout not in _MPP_LAYOUTS:
            raise EmulatorError(f"mpp_layout must be one of {sorted(_MPP_LAYOUTS)}, got {mpp_layout!r}")
        if not 0 <= int(mpp_seed) < 2**64:
            raise EmulatorError(f"mpp_seed must be in 0..2**64-1, got {mpp_seed!r}")
        buffers = dict(buffers or {})
        for k, v in (bytes or {}).items():
            if k in buffers:
                raise EmulatorError(f"index {k} bound both as a buffer and as bytes")
            if hasattr(v, "untyped_storage"):
                v = v.detach().contiguous().numpy().tobytes()
            buffers[k] = v if isinstance(v, (type(b""), bytearray, memoryview)) else v
        bindings = {}
        for k, v in buffers.items():
            if not 0 <= int(k) < _MAX_INDEX:
                raise EmulatorError(f"buffer index {k} outside 0..{_MAX_INDEX - 1}")
            bindings[int(k)] = _Binding(v, writable=True)
        tg_mem = {int(k): int(v) for k, v in (threadgroup_memory or {}).items()}
        roles = []
        for p in decl.params:
            if p.role is None:
                raise EmulatorError(f"{name}: parameter {p.name!r} has no MSL attribute")
            if p.role == _prepass.ROLE_BUFFER and p.index not in bindings:
                raise EmulatorError(f"{name}: parameter {p.name!r} [[buffer({p.index})]] is not bound")
            if p.role == _prepass.ROLE_THREADGROUP and p.index not in tg_mem:
                raise EmulatorError(f"{name}: parameter {p.name!r} [[threadgroup({p.index})]] has no threadgroup memory length")
            roles.append(_Role(p.role, p.index))
        lens = (ctypes.c_uint64 * _MAX_INDEX)(*([_UNSET] * _MAX_INDEX))
        for k, v in tg_mem.items():
            if not 0 <= k < _MAX_INDEX or v < 0:
                raise EmulatorError(f"bad threadgroup memory entry {k}: {v}")
            lens[k] = v
        descs = (_BufferDesc * max(1, len(bindings)))()
        for i, (k, b) in enumerate(sorted(bindings.items())):
            descs[i] = _BufferDesc(k, int(b.writable), b.data, b.size)
        desc = _DispatchDesc()
        desc.kernel = index
        desc.nroles = len(roles)
        desc.roles = (_Role * max(1, len(roles)))(*roles)
        desc.nbuffers = len(bindings)
        desc.buffers = descs
        desc.ntg = _MAX_INDEX
        desc.tg_lengths = lens
        desc.grid[:] = _as3(grid)
        desc.threadgroup[:] = _as3(threadgroup)
        desc.max_threads = decl.max_threads
        desc.seed = seed
        with self._lock:
            self._lib.fm_reset_function_constants()
            for k, v in (function_constants or {}).items():
                if int(k) not in self._fc_indices:
                    raise EmulatorError(f"no function constant has index {k}")
                self._lib.fm_set_function_constant(int(k), float(v))
            self._lib.fm_set_mpp_layout(_MPP_LAYOUTS[mpp_layout], int(mpp_seed))
            rc = self._lib.fm_dispatch(ctypes.byref(desc))
            reports = json.loads(self._lib.fm_last_reports().decode())
            raw = _CountsDesc()
            if self._lib.fm_last_counts(ctypes.byref(raw)) != ctypes.sizeof(_CountsDesc):
                raise EmulatorError("the runtime's fm_dispatch_counts does not match _CountsDesc")
        self.dispatched.add(name)
        DISPATCHED.add(name)
        if rc == 2:
            raise EmulatorError("invalid dispatch description")
        if rc:
            raise EmulatorError(self._format(name, reports), reports)
        return _counts(raw, self.instrumented, bindings)

    def _format(self, name: str, reports: list[dict]) -> str:
        pcs = sorted({pc for r in reports for pc in r["pcs"]})
        where = symbolize(self.path, pcs)
        lines = [f"{len(reports)} emulator finding(s) in kernel {name}:"]
        for r in reports:
            msg = r["message"]
            for i, pc in enumerate(r["pcs"]):
                msg = msg.replace("{pc%d}" % i, where.get(pc, hex(pc)))
            r["text"] = msg
            lines.append(f"[{r['kind']}] {msg}")
        return "\n".join(lines)


def symbolize(so_path: str, pcs: list[int]) -> dict[int, str]:
    """PC offset -> 'file:line' of the innermost frame outside the shim (with the shim frame noted)."""
    tool = _build.find_symbolizer()
    if not pcs or not tool:
        return {}
    kind, exe = tool
    # a return address points after the call; step back into the instruction
    addrs = [hex(max(pc - 1, 0)) for pc in pcs]
    if kind == "llvm":
        out = subprocess.run([exe, f"--obj={so_path}", "--inlines", "--no-demangle"], input="\n".join(addrs) + "\n",
                             capture_output=True, text=True).stdout
        blocks = out.strip("\n").split("\n\n")
        frames_per = [[ln for ln in b.splitlines()[1::2]] for b in blocks]
    else:
        frames_per = []
        for a in addrs:
            out = subprocess.run([exe, "-e", so_path, "-i", a], capture_output=True, text=True).stdout
            frames_per.append(out.splitlines())
    result = {}
    for pc, frames in zip(pcs, frames_per):
        frames = [f for f in frames if f and not f.startswith("??")]
        user = [f for f in frames if not f.startswith(_build.SHIM_DIR)]
        best = user[0] if user else (frames[0] if frames else hex(pc))
        best = best.rsplit(":", 1)[0] if best.count(":") >= 2 else best  # drop the column
        result[pc] = best
    return result


_CACHE: dict[tuple, Library] = {}
_CACHE_LOCK = threading.Lock()


def compile_library(paths, instrumented: bool = False, fast_math: bool = False, msl: int = 3,
                    only=None, exclude=None) -> Library:
    """Compile .metal files (unmodified) into an emulator library, cached on disk and per process.

    instrumented: the sanitizing -O1 build (else -O2). fast_math: compile the
    kernels with -ffast-math, clang's counterpart of the Metal compiler's
    default fast-math mode (no infinities, no NaNs); see README.md. msl: 3
    (default) compiles as MSL 3.1 in C++17, like the shipped shaders; 4 as MSL
    4 in C++20, for kernels using <metal_tensor> and MPP tensor ops.
    only: None (every kernel) or glob patterns over host names ('*' matches
    any run of characters): a partial library holding only the kernels that
    match, built in a fraction of the time. Asking it for another kernel raises
    EmulatorError naming what it holds. exclude: None or glob patterns of
    kernels to leave out (applied after only): a default build can leave out
    kernels that only a few tests run, and those tests build them alone.
    A partial library still names the kernels it left out (omitted_names).
    """
    if isinstance(paths, str):
        paths = [paths]
    paths = [os.path.abspath(p) for p in paths]
    with _CACHE_LOCK:
        only = _host_patterns(only, "only")
        exclude = _host_patterns(exclude, "exclude")
        key = (tuple(paths), bool(instrumented), bool(fast_math), msl, only, exclude)
        if key in _CACHE:
            return _CACHE[key]
        _build.common_flags(msl)  # validates msl
        lib = _compile(paths, bool(instrumented), bool(fast_math), msl, only, exclude)
        _CACHE[key] = lib
        return lib


# A library whose kernels are all template instantiations is compiled as one
# translation unit per core (at most 4), each instantiating every S-th
# registration site (include/fm/kernel.h): attention.metal's ~100 instantiations
# take minutes in one clang process. Not with a plain (non-template) kernel,
# which every unit would define: its symbol would clash at link time.
_PLAIN_KERNEL_SITE = re.compile(r'FMEMU_REGISTER_KERNEL\("(\w+)", \1\)')


def _shards(rewritten_path: str) -> int:
    with open(rewritten_path, encoding="utf-8") as f:
        text = f.read()
    if "FMEMU_REGISTER_KERNEL" not in text or _PLAIN_KERNEL_SITE.search(text):
        return 1
    return max(1, min(4, os.cpu_count() or 1))


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


_HOST_NAME_PATTERN = re.compile(r"[A-Za-z0-9_*]+")


def _host_patterns(patterns, what: str):
    """only= / exclude= as a sorted tuple of validated glob patterns (None: no filter)."""
    if patterns is None:
        return None
    if isinstance(patterns, str):
        patterns = [patterns]
    patterns = tuple(sorted(set(patterns)))
    if not patterns:
        raise EmulatorError(f"{what}= needs at least one host-name pattern (None: no filter)")
    for p in patterns:
        if not isinstance(p, str) or not _HOST_NAME_PATTERN.fullmatch(p):
            raise EmulatorError(f"{what}= pattern {p!r}: letters, digits, '_' and '*' only")
    return patterns


def filter_flags(only=None, exclude=None) -> list[str]:
    """The kernel compile's -D flags for a partial build (include/fm/kernel.h: FMEMU_ONLY, FMEMU_EXCEPT)."""
    only, exclude = _host_patterns(only, "only"), _host_patterns(exclude, "exclude")
    flags = []
    if only is not None:
        flags.append("-DFMEMU_ONLY=" + ",".join(f'"{p}"' for p in only))
    if exclude is not None:
        flags.append("-DFMEMU_EXCEPT=" + ",".join(f'"{p}"' for p in exclude))
    return flags


def _compile(paths: list[str], instrumented: bool, fast_math: bool, msl: int = 3, only=None, exclude=None) -> Library:
    clang = _build.find_clang()
    kflags = _build.kernel_flags(instrumented, fast_math, msl) + filter_flags(only, exclude)
    # kflags are part of the key, so each flavour has its own cache entry.
    key = _build.source_key(paths, *kflags, *_build.RUNTIME_FLAGS, *_build.link_flags(),
                            *(_read_bytes(os.path.join(_build.RUNTIME_DIR, s))
                              for s in _build.RUNTIME_SOURCES + _build.RUNTIME_HEADERS))
    flavour = (("inst-" if instrumented else "fast-") + ("fastmath-" if fast_math else "") + ("msl4-" if msl == 4 else "")
               + ("part-" if only is not None or exclude is not None else ""))
    final = os.path.join(_build.CACHE_DIR, flavour + key)

    def build(tmp: str) -> None:
        mapping = _build.write_rewritten(paths, os.path.join(tmp, "src"))
        with ThreadPoolExecutor(max_workers=(os.cpu_count() or 2) + 1) as pool:  # +1: the runtime task waits on its own jobs
            runtime = pool.submit(_build.runtime_objects, pool)
            objs, scans = [], []
            for i, p in enumerate(paths):
                src = mapping[p]
                shards = _shards(src)
                inc = ["-I", os.path.dirname(src)]
                scans.append(pool.submit(_build._run, [clang, *_build.common_flags(msl), *inc, "-DFMEMU_SCAN", "-fsyntax-only",
                                                       "-Xclang", "-ast-dump=json", src], f"scanning {p}"))
                for n in range(shards):
                    out = os.path.join(tmp, f"k{i}s{n}.o")
                    objs.append(out)
                    flags = [] if shards == 1 else [f"-DFMEMU_SHARDS={shards}", f"-DFMEMU_SHARD={n}"]
                    scans.append(pool.submit(_build._run, [clang, *kflags, *flags, *inc, "-c", src, "-o", out],
                                             f"compiling {p}" + (f" (shard {n + 1} of {shards})" if shards > 1 else "")))
            results = [s.result() for s in scans]
            rt_objs = runtime.result()
        decls = []
        for r in results:
            if "-DFMEMU_SCAN" not in r.args:
                continue
            decls += _registry.parse_dump(r.stdout)
        with open(os.path.join(tmp, "kernels.json"), "w", encoding="utf-8") as f:
            json.dump([{"name": d.qualified_name, "max_threads": d.max_threads,
                        "params": [vars(p) for p in d.params]} for d in decls], f)
        so = os.path.join(tmp, "lib.so")
        _build._run([clang, "-shared", "-o", so, *objs, *rt_objs, *_build.link_flags(), "-lm"], "linking")
        step = _build.debug_info_step(so)
        if step:
            _build._run(step, "collecting debug info")

    _build._atomic_dir(final, build)
    with open(os.path.join(final, "kernels.json"), encoding="utf-8") as f:
        decls = [_registry.KernelDecl(d["name"], [_registry.Param(**p) for p in d["params"]], d["max_threads"])
                 for d in json.load(f)]
    return Library(os.path.join(final, "lib.so"), decls, paths, instrumented, fast_math)



def preprocessed(path: str) -> str:
    """The tokens of one .metal file after clang's preprocessor, with the
    emulator's flags and stand-in headers (line markers and blank lines
    dropped). Two files giving the same text are the same program, so a caller
    can reuse the build of one for the other: the executed host's
    runtime-compile scenarios replay the recorded source against the shipped
    library this way. (Before the pre-pass, whose registrations name the file
    and line of each kernel: they differ between the two, the code does not.)"""
    path = os.path.abspath(path)
    proc = _build._run([_build.find_clang(), *_build.common_flags(), "-I", os.path.dirname(path), "-E", "-P", path],
                       f"preprocessing {path}")
    return "\n".join(line.rstrip() for line in proc.stdout.splitlines() if line.strip())
