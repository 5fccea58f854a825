"""private_arrays(): which per-thread arrays a kernel keeps in memory after optimization.

A GPU keeps a thread's private array in registers only if the compiler can
split it into scalars, which needs every index into it to be a compile-time
constant (after inlining and unrolling); an array indexed by a runtime value
stays in per-thread stack memory. Apple's compiler is LLVM-based and applies
the same rule, so asking LLVM is a faithful proxy: each kernel is compiled
exactly as the fast build compiles it (same pre-pass, shim and -O2 flags,
stopping at LLVM IR), and every `alloca` of an array type left in the
kernel's own function is reported. It says nothing about register pressure:
an array split into scalars may still spill if it does not fit.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

from . import _build
from ._library import filter_flags

# One function definition: its mangled name and its body.
_DEFINE = re.compile(r"^define [^\n]*?@([\w.$]+)\((?:[^\n]*)\{\n(.*?)^\}", re.S | re.M)
# An array-typed alloca, e.g. `alloca [32 x float], align 16`.
_ARRAY_ALLOCA = re.compile(r"= alloca (\[.*\])(?:, align \d+)?$", re.M)
# The emulator's kernel registration (include/fm/kernel.h): host name string, expression string, function.
_REGISTER = re.compile(r"call void @fm_rt_register_kernel\(ptr noundef (?:nonnull )?(@[\w.$]+), "
                       r"ptr noundef (?:nonnull )?@[\w.$]+, ptr noundef (?:nonnull )?@([\w.$]+),")
_STRING = re.compile(r'^(@[\w.$]+) = [^\n]*?c"((?:[^"\\]|\\[0-9A-Fa-f]{2})*)\\00"', re.M)


def _c_string(raw: str) -> str:
    return re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), raw)


def _kernels(ir: str):
    """(host name, the kernel function's body, the module's strings) of every kernel registered in one module's IR."""
    strings = {name: _c_string(raw) for name, raw in _STRING.findall(ir)}
    bodies = {name: body for name, body in _DEFINE.findall(ir)}
    for host_ref, fn in _REGISTER.findall(ir):
        if host_ref not in strings or fn not in bodies:
            raise RuntimeError(f"cannot resolve kernel registration {host_ref} -> {fn} in the IR")
        yield strings[host_ref], bodies[fn], strings


def _per_kernel(paths, tag: str, measure, only=None, exclude=None) -> dict:
    """{kernel host name: measure(body, strings)} for every kernel in the .metal files, each compiled
    exactly as the fast build compiles it (same pre-pass, shim and -O2 flags), stopped at LLVM IR.
    Cached on disk like the libraries, under `tag` (one per measure). only / exclude: the kernels
    measured, as compile_library's partial libraries choose them."""
    if isinstance(paths, str):
        paths = [paths]
    paths = [os.path.abspath(p) for p in paths]
    flags = _build.kernel_flags(instrumented=False) + filter_flags(only, exclude)
    final = os.path.join(_build.CACHE_DIR, tag + "-" + _build.source_key(paths, "emit-llvm", *flags))

    def build(tmp: str) -> None:
        mapping = _build.write_rewritten(paths, os.path.join(tmp, "src"))
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            jobs = []
            for i, p in enumerate(paths):
                src = mapping[p]
                ll = os.path.join(tmp, f"k{i}.ll")
                cmd = [_build.find_clang(), *flags, "-I", os.path.dirname(src), "-S", "-emit-llvm", src, "-o", ll]
                jobs.append((ll, pool.submit(_build._run, cmd, f"compiling {p} to LLVM IR")))
            result = {}
            for ll, job in jobs:
                job.result()
                with open(ll, encoding="utf-8") as f:
                    result.update({name: measure(body, strings) for name, body, strings in _kernels(f.read())})
        with open(os.path.join(tmp, "result.json"), "w", encoding="utf-8") as f:
            json.dump(result, f)

    _build._atomic_dir(final, build)
    with open(os.path.join(final, "result.json"), encoding="utf-8") as f:
        return json.load(f)


def private_arrays(paths, only=None, exclude=None) -> dict[str, list[str]]:
    """{kernel host name: array types it keeps in memory}, for every kernel in the .metal files
    (only / exclude: those compile_library's partial library of the same patterns holds).

    An empty list means every private array of that kernel was split into
    scalars (eligible for registers).
    """
    return _per_kernel(paths, "ir", lambda body, _: _ARRAY_ALLOCA.findall(body), only, exclude)


# Instructions that cost an Apple GPU dearly in a loader's inner loop: a 64-bit
# multiply (the GPU's ALUs are 32-bit; a 64-bit product takes several
# instructions), and an integer division or remainder by a value known only
# at run time (no divide unit: a long instruction sequence). Division by a
# constant is left alone: every backend turns it into a multiply and a shift.
_SLOW_MATH = re.compile(r"^\s*%[\w.]+ = (mul(?: nuw)?(?: nsw)? i64 [^\n]*"
                        r"|[su](?:div|rem)(?: exact)? i\d+ [^,\n]+, %[^\n]*)$", re.M)


def slow_integer_math(paths) -> dict[str, list[str]]:
    """{kernel host name: its 64-bit multiplies and runtime-divisor divisions}, for every
    kernel in the .metal files, from the LLVM IR the fast build optimizes (-O2, helpers
    inlined and loops unrolled), so each listed instruction is one the kernel executes.
    Meant for small test kernels wrapping one helper (tests/metal/test_metal_dense_loader.py)."""
    return _per_kernel(paths, "slowmath", lambda body, _: [x.group(1).strip() for x in _SLOW_MATH.finditer(body)])


# A call of the shim's simdgroup_multiply_accumulate (one per MMA the source
# names after unrolling), or, were the shim inlined, its exchange call.
_MMA_CALL = re.compile(r"call void @_ZN5metal29simdgroup_multiply_accumulate\w*\(")


def mma_call_sites(paths) -> dict[str, int]:
    """{kernel host name: the simdgroup MMA call sites in its optimised function}, for every kernel
    in the .metal files, from the IR the fast build optimizes (-O2). A loop the compiler unrolled
    contributes one site per trip; a loop left rolled (a runtime trip count) one per body, so a
    kernel's count tells whether its matrix loops ran to compile-time bounds
    (tests/metal/test_metal_dense_loader.py)."""

    def count(body, strings):
        mma_strings = [name for name, text in strings.items() if text == "simdgroup_multiply_accumulate"]
        inlined = sum(len(re.findall(r"@fm_rt_simd_exchange\([^\n]*" + re.escape(m) + r"\b", body))
                      for m in mma_strings)
        return len(_MMA_CALL.findall(body)) + inlined

    return _per_kernel(paths, "mmasites", count)
