"""Compile-only check of MSL rules that plain C++ accepts.

The shaders are parsed with the address spaces mapped to clang address
spaces (include/fm/base.h under FMEMU_CHECK_MSL), so passing a device pointer
where a thread or threadgroup pointer is expected, assigning a threadgroup
array to a plain pointer, or writing through `constant` are compile errors.
The AST of every kernel is then checked for two rules clang cannot express:
each pointer or reference parameter names an address space, and each
parameter carries an MSL attribute.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile

from . import _build, _registry


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
            proc = subprocess.run(
                [clang, *_build.common_flags(), "-I", os.path.dirname(src), "-DFMEMU_CHECK_MSL", "-fsyntax-only",
                 "-ferror-limit=0", "-Xclang", "-ast-dump=json", src],
                capture_output=True, text=True)
            violations += _diagnostics(proc.stderr)
            try:
                decls = _registry.parse_dump(proc.stdout)
            except json.JSONDecodeError:
                decls = []
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
