"""Compile-only check of MSL rules that plain C++ accepts.

The shaders are parsed with the address spaces mapped to clang address
spaces (include/fm/base.h under FMEMU_CHECK_MSL), so passing a device pointer
where a thread or threadgroup pointer is expected, assigning a threadgroup
array to a plain pointer, or writing through `constant` are compile errors.
The AST is then checked for rules clang cannot express: each kernel pointer
or reference parameter names an address space, each kernel parameter carries
an MSL attribute, and every variable with static storage in the shaders'
own files (namespace scope, static data members, function-local statics)
lives in the constant address space (a function-local `threadgroup`
variable aside), as MSL requires: Apple's compiler rejects
`static constexpr int N = 4;` in a struct, where Apple's own headers write
`static constexpr constant int`.
A second parse uses C++14, MSL 3.1's base language, with the C++17 (and
later) extensions clang would otherwise accept with a warning made errors:
`if constexpr`, inline variables, structured bindings, hexadecimal float
literals (Apple's compiler warns, and the metallib build has -Werror).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile

from . import _build, _prepass, _registry


# clang spells an address space by the macro that wrote it, or as the attribute
_ADDRESS_SPACE = re.compile(r"\b(device|constant|threadgroup|threadgroup_imageblock)\b|address_space")


class MslRuleError(Exception):
    """The shader breaks an MSL rule; `violations` lists them."""

    def __init__(self, violations: list[str]):
        super().__init__("MSL rule violations:\n" + "\n".join(violations))
        self.violations = violations


def _diagnostics(stderr: str) -> list[str]:
    out = []
    for line in stderr.splitlines():
        if re.search(r": (error|fatal error|note): ", line):
            out.append(line.strip())
    return out


# MSL 3.1 is C++14-based; clang accepts later features in C++14 as
# extensions with a warning (as Apple's compiler does), so those become errors.
CXX14_FLAGS = ["-std=c++14", "-Werror=c++17-extensions", "-Werror=c++17-attribute-extensions",
               "-Werror=c++20-extensions", "-Werror=c++20-attribute-extensions", "-Werror=c++23-extensions"]

# Address spaces a variable with static storage may take: constant anywhere,
# threadgroup for a kernel's own `threadgroup T x[N];` (the numbers of
# include/fm/base.h under FMEMU_CHECK_MSL).
_CONSTANT_SPACE = re.compile(r"address_space\(2\)")
_THREADGROUP_SPACE = re.compile(r"address_space\(3\)")
_NAMESPACE_SCOPES = ("TranslationUnitDecl", "NamespaceDecl", "LinkageSpecDecl")
_RECORDS = ("CXXRecordDecl", "ClassTemplateSpecializationDecl", "ClassTemplatePartialSpecializationDecl")


def static_storage_violations(ast: dict, copies: dict[str, str]) -> list[str]:
    """Variables with static storage outside `constant`, declared in the pre-passed copies.

    copies maps each pre-passed copy to its original (write_rewritten's
    mapping, inverted): the rules apply to the shaders' own files, not to the
    emulator's stand-in headers. clang's JSON dump names a location's file
    (the copy; the #line name only as presumedFile) and line only when they
    differ from the previous location printed, so the walk follows the dump
    in order and carries the last file and line, as clang's dumper does
    (an `includedFrom` file is not a location and does not count).
    """
    found: dict[tuple, str] = {}
    where = {"file": None, "line": 0}

    def location(loc: dict) -> None:
        if "spellingLoc" in loc or "expansionLoc" in loc:
            for key in ("spellingLoc", "expansionLoc"):  # clang's order; the expansion is where it was written
                if isinstance(loc.get(key), dict):
                    location(loc[key])
            return
        if "file" in loc:
            where["file"] = loc["file"]
        if "line" in loc:
            where["line"] = loc["line"]

    def walk(node, parent_kind: str | None) -> None:
        if isinstance(node, list):
            for x in node:
                walk(x, parent_kind)
            return
        if not isinstance(node, dict):
            return
        kind = node.get("kind")
        decl = None
        for key, value in node.items():
            if key == "loc" and isinstance(value, dict):
                location(value)
                decl = (where["file"], where["line"])
            elif key == "range" and isinstance(value, dict):
                for end in ("begin", "end"):
                    if isinstance(value.get(end), dict):
                        location(value[end])
            elif key == "inner":
                walk(value, kind)
            elif key != "referencedDecl" and isinstance(value, (dict, list)):
                walk(value, parent_kind)
        if kind != "VarDecl" or decl is None or decl[0] not in copies:
            return
        at_namespace = parent_kind in _NAMESPACE_SCOPES
        member = parent_kind in _RECORDS
        if not (at_namespace or member or node.get("storageClass") == "static"):
            return  # an automatic variable
        qual = node.get("type", {}).get("qualType", "")
        if _CONSTANT_SPACE.search(qual):
            return
        if not (at_namespace or member) and _THREADGROUP_SPACE.search(qual):
            return  # `threadgroup T x[N];` in a kernel body (the pre-pass makes it a static)
        what = ("a namespace-scope variable" if at_namespace else "a static data member" if member
                else "a function-local static variable")
        line = decl[1] - 1  # the copy starts with one #line directive
        found.setdefault((decl[0], line, node.get("name")),
                         f"{copies[decl[0]]}:{line}: {what} {node.get('name')!r} ({qual}) must be in the constant "
                         "address space (MSL puts every variable with static storage there: write "
                         "`constant constexpr T x = ...;` or, in a struct, `static constexpr constant T x = ...;`)")

    walk(ast, None)
    return list(found.values())


def check_msl_rules(paths) -> None:
    """Raise MslRuleError if any of the .metal files (and their includes) breaks an MSL rule."""
    if isinstance(paths, str):
        paths = [paths]
    paths = [os.path.abspath(p) for p in paths]
    clang = _build.find_clang()
    violations: list[str] = []
    with tempfile.TemporaryDirectory(prefix="fm-check-") as tmp:
        mapping = _build.write_rewritten(paths, tmp)
        for p in paths:
            src = mapping[p]
            check = [*_build.common_flags(), "-I", os.path.dirname(src), "-DFMEMU_CHECK_MSL", "-fsyntax-only",
                     "-ferror-limit=0"]
            proc = subprocess.run([clang, *check, "-Xclang", "-ast-dump=json", src], capture_output=True, text=True)
            violations += _diagnostics(proc.stderr)
            cxx14 = subprocess.run([clang, *[f for f in check if f != "-std=c++17"], *CXX14_FLAGS, src],
                                   capture_output=True, text=True)
            violations += [f"C++14 (MSL 3.1's base language): {d}" for d in _diagnostics(cxx14.stderr)]
            try:
                ast = json.loads(proc.stdout)
            except json.JSONDecodeError:
                ast = {}
            try:
                decls = _registry.kernels_in_ast(ast)
            except _prepass.PrepassError as err:
                violations.append(f"{p}: {err}")
                decls = []
            violations += static_storage_violations(ast, {copy: orig for orig, copy in mapping.items()})
            for d in decls:
                for prm in d.params:
                    where = f"{p}: kernel {d.qualified_name}, parameter {prm.name!r} ({prm.type})"
                    if prm.role is None:
                        violations.append(f"{where}: a kernel parameter needs an attribute such as [[buffer(n)]]")
                    if ("*" in prm.type or "&" in prm.type) and not _ADDRESS_SPACE.search(prm.type):
                        violations.append(f"{where}: a kernel pointer or reference parameter needs an address space "
                                          "(device, constant or threadgroup)")
    if violations:
        raise MslRuleError(violations)
