"""Line-preserving source rewrite that makes MSL files valid clang C++.

Only forms that macros cannot express are rewritten; every edit keeps the
number of lines, so clang's diagnostics, __LINE__ and the emulator's reports
point at the original lines (each rewritten file starts with a #line directive
naming the original path):

* ``[[buffer(n)]]``, ``[[threadgroup(n)]]``, ``[[kernel]]``, position attributes
  -> ``[[clang::annotate("msl", ROLE, INDEX)]]`` that the registry scan reads;
* ``template [[host_name("x")]] [[kernel]] decltype(f<A>) f<A>;`` (clang rejects
  attributes on explicit instantiations) -> ``FMEMU_INSTANTIATE(...)
  FMEMU_REGISTER_KERNEL("x", f<A>)``, also inside #define bodies;
* a non-template ``[[kernel]] void f(...) {...}`` gets ``FMEMU_REGISTER_KERNEL("f", f)``
  after its closing brace;
* ``threadgroup T name[N];`` in a body -> ``FMEMU_TG_VAR(name, [N], T);`` (one object
  per threadgroup instead of one per thread);
* ``constant T name [[function_constant(i)]];`` -> ``FMEMU_FUNCTION_CONSTANT(...)``
  and program-scope constants computed from function constants ->
  ``FMEMU_DERIVED_CONSTANT(...)``.
"""

from __future__ import annotations

import dataclasses
import os
import re

# MSL position attributes, in the order of enum fm_pos_kind in include/fm/abi.h.
POSITION_ATTRIBUTES = (
    "thread_position_in_grid",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threads_per_threadgroup",
    "threadgroups_per_grid",
    "threads_per_grid",
    "thread_index_in_threadgroup",
    "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup",
    "threads_per_simdgroup",
    "simdgroups_per_threadgroup",
    "dispatch_threads_per_threadgroup",
    "thread_index_in_quadgroup",
    "quadgroup_index_in_threadgroup",
)
# Role codes, mirroring include/fm/abi.h.
ROLE_KERNEL = 1
ROLE_BUFFER = 2
ROLE_THREADGROUP = 3
ROLE_MAX_THREADS = 4
ROLE_POS_FIRST = 16

_SIMPLE_ATTR = re.compile(r"\[\[\s*(\w+)\s*(?:\(([^()\]]*)\))?\s*\]\]")
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)
_TG_VAR = re.compile(
    r"(?<![\w.])threadgroup\s+((?:const\s+)?[A-Za-z_][\w:]*(?:\s*<[^;{}()*&]*?>)?)\s+([A-Za-z_]\w*)\s*"
    r"((?:\[[^\];]+\]\s*)*);"
)
_FUNCTION_CONSTANT = re.compile(
    r"(?<![\w.])constant\s+([A-Za-z_][\w:]*)\s+([A-Za-z_]\w*)\s*\[\[\s*function_constant\s*\(([^()]*)\)\s*\]\]\s*;"
)
_PROGRAM_CONSTANT = re.compile(r"(?<![\w.])constant\s+([A-Za-z_][\w:]*)\s+([A-Za-z_]\w*)\s*=\s*([^;{}]*);")
# `[[kernel]] void f(` or `kernel void f(`, other attributes (such as
# [[max_total_threads_per_threadgroup(N)]]) allowed between `[[kernel]]` and `void`.
_PLAIN_KERNEL = re.compile(
    r"(?:\[\[\s*kernel\s*\]\](?:\s*\[\[[^\[\]]*\]\])*|(?<![\w.])kernel)\s+void\s+([A-Za-z_]\w*)\s*\("
)


class PrepassError(Exception):
    """An MSL construct outside the subset the emulator supports."""


def mask_comments(text: str) -> str:
    """The text with comments and string/char literal bodies blanked (same offsets)."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            # a backslash-newline continues a // comment; keep it simple: stop at the newline
            for k in range(i, j):
                out[k] = " "
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if text[k] != "\n":
                    out[k] = " "
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            for k in range(i + 1, min(j, n)):
                out[k] = " "
            i = j + 1
        else:
            i += 1
    return "".join(out)


def _match_bracket(masked: str, start: int, open_ch: str, close_ch: str) -> int:
    """Index just past the bracket matching masked[start] == open_ch."""
    depth = 0
    for i in range(start, len(masked)):
        ch = masked[i]
        if ch == open_ch:
            depth += 1
        elif ch == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1
    raise PrepassError(f"unbalanced {open_ch}{close_ch}")


@dataclasses.dataclass
class _Edit:
    start: int
    end: int
    text: str


def _line_preserving(old: str, new: str) -> str:
    """`new` padded with the line breaks `old` spanned (escaped inside #define)."""
    count = old.count("\n")
    if not count:
        return new
    if "\\\n" in old:
        return new + " \\\n" * count
    return new + "\n" * count


def _attribute_edits(text: str, masked: str) -> list[_Edit]:
    edits = []
    for m in _SIMPLE_ATTR.finditer(masked):
        name, arg = m.group(1), m.group(2)
        raw_arg = text[m.start(2) : m.end(2)] if arg is not None else None
        if name == "kernel" and raw_arg is None:
            code = f"{ROLE_KERNEL}, 0"
        elif name == "buffer" and raw_arg:
            code = f"{ROLE_BUFFER}, ({raw_arg})"
        elif name == "threadgroup" and raw_arg:
            code = f"{ROLE_THREADGROUP}, ({raw_arg})"
        elif name == "max_total_threads_per_threadgroup" and raw_arg:
            code = f"{ROLE_MAX_THREADS}, ({raw_arg})"
        elif name in POSITION_ATTRIBUTES and raw_arg is None:
            code = f"{ROLE_POS_FIRST + POSITION_ATTRIBUTES.index(name)}, 0"
        else:
            continue
        edits.append(_Edit(m.start(), m.end(), f'[[clang::annotate("msl", {code})]]'))
    return edits


def _instantiation_edits(text: str, masked: str) -> list[_Edit]:
    edits = []
    for m in re.finditer(r"(?<![\w.])template\s*\[\[", masked):
        pos = m.start() + len("template")
        attrs = []
        while True:
            while pos < len(masked) and masked[pos] in " \t\r\n\\":
                pos += 1
            if not masked.startswith("[[", pos):
                break
            end = masked.index("]]", pos) + 2
            attrs.append(text[pos + 2 : end - 2].strip())
            pos = end
        host = [a for a in attrs if re.match(r"host_name\s*\(", a)]
        if not host:
            continue
        host_name = re.match(r"host_name\s*\((.*)\)\s*$", host[0], re.S).group(1).strip()
        semi = masked.index(";", pos)
        decl = text[pos:semi].strip()
        decl_masked = masked[pos:semi]
        if decl.startswith("decltype"):
            close = _match_bracket(decl_masked, decl_masked.index("("), "(", ")")
            func = text[pos + close : semi].strip()
        else:
            paren = decl_masked.index("(")
            head = text[pos : pos + paren]
            found = re.search(r"([\w:]+\s*<.*>)\s*$", head, re.S)
            if not found:
                raise PrepassError(f"cannot find the function in explicit instantiation: {decl!r}")
            func = found.group(1)
        func_one_line = " ".join(func.replace("\\\n", " ").split())
        decl_one_line = " ".join(decl.replace("\\\n", " ").split())
        new = f"FMEMU_INSTANTIATE({decl_one_line}) FMEMU_REGISTER_KERNEL({host_name}, {func_one_line})"
        old = text[m.start() : semi + 1]
        edits.append(_Edit(m.start(), semi + 1, _line_preserving(old, new)))
    return edits


def _plain_kernel_edits(text: str, masked: str) -> list[_Edit]:
    edits = []
    for m in _PLAIN_KERNEL.finditer(masked):
        # A template kernel has `template <...>` since the previous statement end.
        before = masked[: m.start()]
        boundary = max(before.rfind(";"), before.rfind("}"), before.rfind("{"))
        if re.search(r"(?<![\w.])template\b", before[boundary + 1 :]):
            continue
        params_end = _match_bracket(masked, m.end() - 1, "(", ")")
        rest = masked[params_end:]
        nxt = re.search(r"[{;]", rest)
        if not nxt or nxt.group() == ";":
            continue  # a declaration, not a definition
        body_start = params_end + nxt.start()
        body_end = _match_bracket(masked, body_start, "{", "}")
        name = m.group(1)
        edits.append(_Edit(body_end, body_end, f' FMEMU_REGISTER_KERNEL("{name}", {name})'))
    return edits


def _threadgroup_var_edits(text: str, masked: str) -> list[_Edit]:
    edits = []
    for m in _TG_VAR.finditer(masked):
        ctype = " ".join(text[m.start(1) : m.end(1)].split())
        name = m.group(2)
        dims = "".join(text[m.start(3) : m.end(3)].split())
        old = text[m.start() : m.end()]
        edits.append(_Edit(m.start(), m.end(), _line_preserving(old, f"FMEMU_TG_VAR({name}, {dims}, {ctype});")))
    return edits


def _function_constant_edits(text: str, masked: str, names: set[str]) -> list[_Edit]:
    edits = []
    for m in _FUNCTION_CONSTANT.finditer(masked):
        ctype, name, index = m.group(1), m.group(2), text[m.start(3) : m.end(3)].strip()
        names.add(name)
        old = text[m.start() : m.end()]
        edits.append(_Edit(m.start(), m.end(), _line_preserving(old, f"FMEMU_FUNCTION_CONSTANT({name}, {index}, {ctype});")))
    return edits


def _derived_constant_edits(text: str, masked: str, fc_names: set[str]) -> list[_Edit]:
    edits = []
    for m in _PROGRAM_CONSTANT.finditer(masked):
        expr = text[m.start(3) : m.end(3)]
        words = set(re.findall(r"[A-Za-z_]\w*", masked[m.start(3) : m.end(3)]))
        if not (words & fc_names or "is_function_constant_defined" in words):
            continue
        ctype, name = m.group(1), m.group(2)
        one_line = " ".join(expr.split())
        old = text[m.start() : m.end()]
        edits.append(_Edit(m.start(), m.end(), _line_preserving(old, f"FMEMU_DERIVED_CONSTANT({name}, ({one_line}), {ctype});")))
    return edits


def _apply(text: str, edits: list[_Edit]) -> str:
    edits = sorted(edits, key=lambda e: (e.start, e.end))
    out, last = [], 0
    for e in edits:
        if e.start < last:
            raise PrepassError("overlapping rewrites")
        out.append(text[last : e.start])
        out.append(e.text)
        last = e.end
    out.append(text[last:])
    return "".join(out)


def collect_sources(roots: list[str]) -> list[str]:
    """The .metal files and every file they reach through #include "...", in a stable order."""
    seen: list[str] = []
    stack = [os.path.abspath(p) for p in roots]
    while stack:
        path = stack.pop(0)
        if path in seen:
            continue
        seen.append(path)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for inc in _INCLUDE.findall(text):
            cand = os.path.normpath(os.path.join(os.path.dirname(path), inc))
            if os.path.isfile(cand):
                stack.append(cand)
    return seen


def rewrite_sources(paths: list[str]) -> dict[str, str]:
    """Rewritten text for each path; the function-constant names are shared by all files."""
    texts = {}
    for p in paths:
        with open(p, encoding="utf-8") as f:
            texts[p] = f.read()
    masked = {p: mask_comments(t) for p, t in texts.items()}
    fc_names: set[str] = set()
    first_edits = {}
    for p, t in texts.items():
        first_edits[p] = _function_constant_edits(t, masked[p], fc_names)
    out = {}
    for p, t in texts.items():
        m = masked[p]
        edits = (
            first_edits[p]
            + _derived_constant_edits(t, m, fc_names)
            + _instantiation_edits(t, m)
            + _attribute_edits(t, m)
            + _plain_kernel_edits(t, m)
            + _threadgroup_var_edits(t, m)
        )
        # an attribute inside a rewritten instantiation is dropped with it
        spans = [(e.start, e.end) for e in edits if e.end > e.start]
        kept = []
        for e in edits:
            inside = any(s <= e.start and e.end <= t_end and (s, t_end) != (e.start, e.end) for s, t_end in spans)
            if not inside:
                kept.append(e)
        quoted = p.replace("\\", "\\\\").replace('"', '\\"')
        out[p] = f'#line 1 "{quoted}"\n' + _apply(t, kept)
    return out
