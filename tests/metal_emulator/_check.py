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
`static constexpr constant int`. The Metal Shading Language Specification
(version 4, section 4.2, "Constant Address Space"): variables in program
scope must be declared in the constant address space and initialized in
their declaration, with a core constant expression.

Each library is checked in its own language version (`msl`: 3 is MSL 3.1,
the portable attention.metal; 4 is MSL 4, the tensor-op library, compiled
with __METAL_VERSION__ 400 and the tensor headers of the emulator's include
directory, as setup.py builds it with -std=metal4.0). The specification,
section 1.5 ("Metal and C++17"): Metal 4 is a C++17-based language; earlier
versions are C++14-based. So:
  * MSL 3.1: a second parse as C++14, with the C++17 (and later) extensions
    clang would otherwise accept with a warning made errors: `if constexpr`,
    inline variables, structured bindings, hexadecimal float literals
    (Apple's compiler warns, and the metallib build has -Werror).
  * MSL 4: C++17 features are allowed; C++20's are not. The emulator parses
    MSL 4 as C++20 (the MPP shim's matmul2d<descriptor, scope> takes a
    class-type template argument, as Apple's header does, which clang allows
    only from C++20), so clang's pre-C++20 compatibility warnings are made
    errors for the shaders' own code (the shim is a system header, exempt)
    and the AST is checked for the C++20 constructs clang does not warn
    about (concepts, requires, coroutines, [[likely]] / [[unlikely]]).
Every version: section 1.5.4's C++ features Metal lacks (lambdas before
Metal 3.2, dynamic_cast, typeid, new and delete, the noexcept operator, goto,
thread_local, virtual functions, derived classes, exceptions: clang's
-fno-exceptions / -fno-rtti already refuse throw, try and typeid).

check_msl_rules returns the files a library's parse reached (clang's
dependency list), so the rules check of a shader tree can prove it covered
every file (check_shader_tree, uncovered_shader_files).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

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
# MSL 4 is C++17-based: in the C++20 parse, what C++17 lacks is an error
# (consteval, constinit, designated initializers, ...; later standards' extensions).
MSL4_CXX17_FLAGS = ["-Werror=c++20-compat", "-Werror=pre-c++20-compat", "-Werror=pre-c++20-compat-pedantic",
                    "-Werror=c++23-extensions", "-Werror=c++2c-extensions"]
_MSL4_CXX17_DIAG = re.compile(r"\[-Werror,-W(c\+\+20-compat|pre-c\+\+20-compat(-pedantic)?|c\+\+23-extensions|"
                              r"c\+\+2c-extensions)\]")
LANGUAGE = {3: "MSL 3.1 (C++14-based)", 4: "MSL 4 (C++17-based)"}

# Address spaces a variable with static storage may take: constant anywhere,
# threadgroup for a kernel's own `threadgroup T x[N];` (the numbers of
# include/fm/base.h under FMEMU_CHECK_MSL).
_CONSTANT_SPACE = re.compile(r"address_space\(2\)")
_THREADGROUP_SPACE = re.compile(r"address_space\(3\)")
_NAMESPACE_SCOPES = ("TranslationUnitDecl", "NamespaceDecl", "LinkageSpecDecl")
_RECORDS = ("CXXRecordDecl", "ClassTemplateSpecializationDecl", "ClassTemplatePartialSpecializationDecl")

# Section 1.5.4's C++ features Metal does not have, by AST node kind (all versions).
_NOT_IN_METAL = {
    "GotoStmt": "a goto statement",
    "CXXNewExpr": "a new expression",
    "CXXDeleteExpr": "a delete expression",
    "CXXNoexceptExpr": "the noexcept operator",
    "CXXDynamicCastExpr": "dynamic_cast",
    "CXXTypeidExpr": "typeid",
}
# C++20 constructs (MSL 4 is C++17-based) clang's compatibility warnings miss.
_CXX20_NODES = {
    "ConceptDecl": "a concept",
    "RequiresExpr": "a requires expression",
    "CoroutineBodyStmt": "a coroutine",
    "LikelyAttr": "the [[likely]] attribute",
    "UnlikelyAttr": "the [[unlikely]] attribute",
}


def ast_violations(ast: dict, copies: dict[str, str], msl: int = 3) -> list[str]:
    """The AST rules, in the pre-passed copies' declarations: static storage outside
    `constant`, section 1.5.4's missing C++ features, and (msl 4) C++20 constructs.

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
        if "file" in loc:  # normalized: a header reached through "../common/x.h" is the copy of common/x.h
            where["file"] = os.path.normpath(loc["file"])
        if "line" in loc:
            where["line"] = loc["line"]

    def report(at, name, message) -> None:
        line = at[1] - 1  # the copy starts with one #line directive
        found.setdefault((at[0], line, name, message), f"{copies[at[0]]}:{line}: {message}")

    def walk(node, parent_kind: str | None) -> None:
        if isinstance(node, list):
            for x in node:
                walk(x, parent_kind)
            return
        if not isinstance(node, dict):
            return
        kind = node.get("kind")
        decl = begin = None
        for key, value in node.items():
            if key == "loc" and isinstance(value, dict):
                location(value)
                decl = (where["file"], where["line"])
            elif key == "range" and isinstance(value, dict):
                for end in ("begin", "end"):
                    if isinstance(value.get(end), dict):
                        location(value[end])
                        if end == "begin":
                            begin = (where["file"], where["line"])
            elif key == "inner":
                walk(value, kind)
            elif key != "referencedDecl" and isinstance(value, (dict, list)):
                walk(value, parent_kind)
        at = decl or begin
        if at is None or at[0] not in copies or node.get("isImplicit"):
            return
        what = _NOT_IN_METAL.get(kind)
        if kind == "LambdaExpr" and msl < 4:
            what = "a lambda expression (Metal 3.2 and later only)"
        elif kind == "CXXMethodDecl" and node.get("virtual"):
            what = "a virtual function"
        elif kind in _RECORDS and node.get("bases"):
            what = "a derived class"
        elif kind == "VarDecl" and node.get("tls"):
            what = "a thread_local variable"
        if what:
            report(at, node.get("name"), f"{what}: not available in Metal (MSL specification, section 1.5.4)")
        if msl >= 4 and kind in _CXX20_NODES:
            report(at, node.get("name"), f"{_CXX20_NODES[kind]}: C++20, not in {LANGUAGE[4]}")
        if kind == "VarDecl" and decl is not None:
            static_storage(node, parent_kind, decl)

    def static_storage(node, parent_kind, decl) -> None:
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
        report(decl, node.get("name"),
               f"{what} {node.get('name')!r} ({qual}) must be in the constant address space (MSL puts every "
               "variable with static storage there: write `constant constexpr T x = ...;` or, in a struct, "
               "`static constexpr constant T x = ...;`)")

    walk(ast, None)
    return list(found.values())


# The old name (the static-storage rule was the walk's first).
static_storage_violations = ast_violations


def _dependencies(depfile: str, copies: dict[str, str]) -> set[str]:
    """The originals of the pre-passed copies a parse read (clang's -MD list; the shim's headers are not copies)."""
    try:
        with open(depfile, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return set()
    words = [os.path.normpath(w) for w in text.replace("\\\n", " ").split(":", 1)[-1].split()]
    return {copies[w] for w in words if w in copies}


def _check_one(clang: str, p: str, mapping: dict[str, str], msl: int, tmp: str) -> tuple[list[str], set[str]]:
    src = mapping[p]
    copies = {copy: orig for orig, copy in mapping.items()}
    depfile = os.path.join(tmp, os.path.basename(src) + f".msl{msl}.d")
    check = [*_build.common_flags(msl), "-I", os.path.dirname(src), "-DFMEMU_CHECK_MSL", "-fsyntax-only",
             "-ferror-limit=0"]
    if msl >= 4:
        check += MSL4_CXX17_FLAGS
    ast_cmd = [clang, *check, "-MD", "-MF", depfile, "-Xclang", "-ast-dump=json", src]
    cxx14_cmd = [clang, *[f for f in check if not f.startswith("-std=")], *CXX14_FLAGS, src] if msl < 4 else None
    with ThreadPoolExecutor(max_workers=2) as pool:  # the two parses are independent processes
        ast_run = pool.submit(subprocess.run, ast_cmd, capture_output=True, text=True)
        cxx14_run = pool.submit(subprocess.run, cxx14_cmd, capture_output=True, text=True) if cxx14_cmd else None
        proc = ast_run.result()
        cxx14 = cxx14_run.result() if cxx14_run else None
    violations = []
    for d in _diagnostics(proc.stderr):
        violations.append(f"C++17 ({LANGUAGE[4]}'s base language): {d}" if _MSL4_CXX17_DIAG.search(d) else d)
    if cxx14 is not None:
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
    violations += ast_violations(ast, copies, msl)
    for d in decls:
        for prm in d.params:
            where = f"{p}: kernel {d.qualified_name}, parameter {prm.name!r} ({prm.type})"
            if prm.role is None:
                violations.append(f"{where}: a kernel parameter needs an attribute such as [[buffer(n)]]")
            if ("*" in prm.type or "&" in prm.type) and not _ADDRESS_SPACE.search(prm.type):
                violations.append(f"{where}: a kernel pointer or reference parameter needs an address space "
                                  "(device, constant or threadgroup)")
    return violations, _dependencies(depfile, copies)


def check_msl_rules(paths, msl: int = 3) -> set[str]:
    """Raise MslRuleError if any of the .metal files (and their includes) breaks an MSL rule of
    language version `msl` (3: MSL 3.1, 4: MSL 4). Returns the files the parses reached."""
    if isinstance(paths, str):
        paths = [paths]
    paths = [os.path.abspath(p) for p in paths]
    _build.common_flags(msl)  # validates msl
    clang = _build.find_clang()
    violations: list[str] = []
    covered: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="fm-check-") as tmp:
        mapping = _build.write_rewritten(paths, tmp)
        for p in paths:
            found, files = _check_one(clang, p, mapping, msl, tmp)
            violations += found
            covered |= files
    if violations:
        raise MslRuleError(violations)
    return covered


def shader_files(shader_dir: str) -> list[str]:
    """Every shader source (*.metal, *.h) under shader_dir, in every subfolder, hidden ones aside: what
    the rules must cover. Other files (shaders/README.md) are not code; setup.py ships the same set."""
    out = []
    for root, dirs, files in os.walk(shader_dir):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        out += [os.path.join(root, f) for f in files if not f.startswith(".") and f.endswith((".metal", ".h"))]
    return sorted(os.path.abspath(f) for f in out)


def library_files(path: str, msl: int) -> set[str]:
    """The files one .metal library's parse reads in language version msl (the preprocessor
    alone, with the rules check's flags: what check_msl_rules would cover, in a fraction of a second)."""
    path = os.path.abspath(path)
    with tempfile.TemporaryDirectory(prefix="fm-deps-") as tmp:
        mapping = _build.write_rewritten([path], tmp)
        src = mapping[path]
        depfile = os.path.join(tmp, "deps.d")
        cmd = [_build.find_clang(), *_build.common_flags(msl), "-I", os.path.dirname(src), "-DFMEMU_CHECK_MSL",
               "-E", "-o", os.devnull, "-MD", "-MF", depfile, src]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise MslRuleError(_diagnostics(proc.stderr) or [proc.stderr.strip()])
        return _dependencies(depfile, {copy: orig for orig, copy in mapping.items()})


def uncovered_shader_files(shader_dir: str, libraries: dict[str, int], covered: set[str] | None = None) -> list[str]:
    """The files under shader_dir that no library's parse reaches (libraries: .metal -> msl).
    covered: the files check_msl_rules reported; by default each library's dependency list."""
    if covered is None:
        covered = set()
        for path, msl in libraries.items():
            covered |= library_files(path, msl)
    return [f for f in shader_files(shader_dir) if f not in covered]


def check_shader_tree(shader_dir: str, libraries: dict[str, int]) -> set[str]:
    """Every library (.metal -> msl) checked in its own language version, and every file under
    shader_dir reached by one of them; raises MslRuleError listing all violations and uncovered files."""
    violations: list[str] = []
    covered: set[str] = set()
    for path, msl in sorted(libraries.items()):
        try:
            covered |= check_msl_rules([path], msl)
        except MslRuleError as err:
            violations += err.violations
            covered |= library_files(path, msl)
    violations += [f"{f}: no rules check reads this file (no .metal library under its language version "
                   "includes it)" for f in uncovered_shader_files(shader_dir, libraries, covered)]
    if violations:
        raise MslRuleError(violations)
    return covered
