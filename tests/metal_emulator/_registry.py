"""Kernel signatures from clang's JSON AST dump.

The pre-pass turns every MSL parameter attribute into
``clang::annotate("msl", ROLE, INDEX)``; the AST dump of the pre-passed file
(compiled with -DFMEMU_SCAN, so no template is instantiated and each kernel
template appears once) gives every kernel's parameters, their types and those
two integers. Nothing in a kernel signature is written twice.
"""

from __future__ import annotations

import dataclasses
import json

from . import _prepass


@dataclasses.dataclass
class Param:
    name: str
    type: str
    role: int | None  # ROLE_* / ROLE_POS_FIRST + k, None when the parameter has no MSL attribute
    index: int

    def describe(self) -> str:
        if self.role == _prepass.ROLE_BUFFER:
            return f"[[buffer({self.index})]]"
        if self.role == _prepass.ROLE_THREADGROUP:
            return f"[[threadgroup({self.index})]]"
        if self.role is not None and self.role >= _prepass.ROLE_POS_FIRST:
            return f"[[{_prepass.POSITION_ATTRIBUTES[self.role - _prepass.ROLE_POS_FIRST]}]]"
        return "(no attribute)"


@dataclasses.dataclass
class KernelDecl:
    qualified_name: str
    params: list[Param]
    max_threads: int = 0
    line: int = 0


def _annotations(node: dict) -> list[list[int | None]]:
    out = []
    for child in node.get("inner", []):
        if child.get("kind") != "AnnotateAttr":
            continue
        values = []
        for arg in child.get("inner", []):
            v = arg.get("value")
            values.append(int(v) if v is not None and v.lstrip("-").isdigit() else None)
        out.append(values)
    return out


def _kernel_from(fn: dict, qual: str) -> KernelDecl | None:
    annots = _annotations(fn)
    if not any(a and a[0] == _prepass.ROLE_KERNEL for a in annots):
        return None
    max_threads = 0
    for a in annots:
        if a and a[0] == _prepass.ROLE_MAX_THREADS:
            if len(a) < 2 or a[1] is None or a[1] <= 0:
                # A value that depends on a template parameter is not evaluated in
                # the uninstantiated scan; the limit must not be dropped silently.
                raise _prepass.PrepassError(
                    f"kernel {qual}: [[max_total_threads_per_threadgroup(N)]] needs N to be a positive constant "
                    "that does not depend on template parameters (the emulator reads it from the template), "
                    "e.g. a program-scope `constant constexpr int`")
            max_threads = a[1]
    params = []
    for child in fn.get("inner", []):
        if child.get("kind") != "ParmVarDecl":
            continue
        role, index = None, 0
        for a in _annotations(child):
            if a and a[0] is not None and a[0] != _prepass.ROLE_KERNEL:
                role = a[0]
                index = a[1] if len(a) > 1 and a[1] is not None else 0
        params.append(Param(child.get("name", ""), child.get("type", {}).get("qualType", ""), role, index))
    line = fn.get("loc", {}).get("line", 0)
    return KernelDecl(qual, params, max_threads, line)


def kernels_in_ast(ast: dict) -> list[KernelDecl]:
    """Every function carrying [[kernel]], with namespace-qualified names."""
    found: list[KernelDecl] = []

    def walk(node: dict, prefix: str) -> None:
        for child in node.get("inner", []):
            kind = child.get("kind")
            if kind == "NamespaceDecl":
                walk(child, prefix + child.get("name", "(anonymous)") + "::")
            elif kind == "LinkageSpecDecl":
                walk(child, prefix)
            elif kind == "FunctionTemplateDecl":
                for sub in child.get("inner", []):
                    if sub.get("kind") == "FunctionDecl":
                        k = _kernel_from(sub, prefix + sub.get("name", ""))
                        if k:
                            found.append(k)
            elif kind == "FunctionDecl":
                k = _kernel_from(child, prefix + child.get("name", ""))
                if k:
                    found.append(k)

    walk(ast, "")
    # a kernel declared before it is defined appears twice; keep the first
    unique: dict[str, KernelDecl] = {}
    for k in found:
        unique.setdefault(k.qualified_name, k)
    return list(unique.values())


def parse_dump(text: str) -> list[KernelDecl]:
    return kernels_in_ast(json.loads(text))


def base_name(expr: str) -> str:
    """`flash_metal::f<half, 64>` -> `flash_metal::f`; `::f` -> `f`."""
    depth, out = 0, []
    for ch in expr:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).replace(" ", "").lstrip(":")


def match(expr: str, decls: list[KernelDecl]) -> KernelDecl:
    """The kernel declaration an instantiation expression names."""
    want = base_name(expr)
    hits = [d for d in decls if d.qualified_name == want or d.qualified_name.endswith("::" + want)]
    if len(hits) != 1:
        names = ", ".join(d.qualified_name for d in hits) or "none"
        raise LookupError(f"cannot resolve kernel {expr!r} to one [[kernel]] declaration (matches: {names})")
    return hits[0]
