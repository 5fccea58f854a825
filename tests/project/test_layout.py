"""Guards on the layout (issue 42): no import cycle among the modules of
flash_metal/ and benchmarks/, no source file over 700 lines, and every test
file inside one of the test groups (tests/repo_paths.py GROUPS) under a
basename no other test file has.

Files are found, never listed by hand: `repo_files` takes what git would
commit (tracked files plus untracked ones that .gitignore does not hide, so
build outputs, .venv and the flash_metal/shaders build copy stay out), or,
outside a git checkout, walks the folders, skipping hidden ones and the
folders .gitignore names. A file added later is checked without editing this
test. Each check is proven on a planted fault in tmp_path.

The import graph's rule (`import_graph`):
  * Nodes: every .py file under the given folders, named as Python names it
    from the repository root (benchmarks/model/cli.py is
    benchmarks.model.cli; a package's __init__.py is the package).
  * Edges: every import statement in the file, wherever it sits: at module
    level (inside `if`, `try` or a class body too) and inside functions.
    Lazy (function-level) imports count: deferring an import hides a cycle
    from Python at import time, but the two modules still need each other
    and cannot be understood or moved apart. The failure message says which
    imports are lazy (and in which function).
  * An import names a module T: `import a.b`, `from a import b` (a.b when
    that is a module, else a), and relative imports resolved against the
    file's package. The importer depends on T, and on every package above T
    that is not also above the importer: Python runs those __init__.py files
    first, while the importer's own packages are already running. So
    `from . import sibling` in pkg/a.py depends on pkg.sibling alone, but
    `from . import name`, a name pkg/__init__.py defines, depends on pkg.
  * Modules that are not .py files under the folders (torch, the stdlib,
    tests/ helpers) are not nodes. `import a.b` or `from a import b` where
    a.b is no .py file depends on a, the nearest source module above (a
    compiled submodule, flash_metal._C, counts as its package; today only
    flash_metal/__init__.py imports it, and a module never depends on itself).
  * importlib.import_module and other dynamic imports are not seen.
"""
import ast
import fnmatch
import os
import subprocess
from collections import defaultdict, deque

import pytest
from repo_paths import ROOT_DIR as ROOT

CYCLE_FREE = ("flash_metal", "benchmarks")  # the folders whose modules must not import one another in a cycle
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".mm", ".metal")
MAX_LINES = 700


# ---- finding the files ----

def _ignored_dirs(base):
    """The folder patterns of base/.gitignore (its lines ending in '/'), for the walk outside git."""
    try:
        with open(os.path.join(base, ".gitignore")) as f:
            lines = [ln.strip() for ln in f]
    except OSError:
        return []
    return [ln.rstrip("/").lstrip("/") for ln in lines if ln.endswith("/") and not ln.startswith("#")]


def repo_files(base):
    """Every file under `base` that a commit would hold, as '/'-separated paths relative to base."""
    try:
        out = subprocess.run(["git", "-C", base, "rev-parse", "--show-toplevel"], capture_output=True, text=True)
        in_git = out.returncode == 0 and os.path.realpath(out.stdout.strip()) == os.path.realpath(base)
    except OSError:  # no git here
        in_git = False
    if in_git:
        out = subprocess.run(["git", "-C", base, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True).stdout
        paths = sorted({p for p in out.decode().split("\0") if p})
        return [p for p in paths if os.path.isfile(os.path.join(base, p))]  # not the ones deleted, not yet staged
    ignored = _ignored_dirs(base)
    found = []
    for top, dirs, files in os.walk(base):
        rel_top = os.path.relpath(top, base).replace(os.sep, "/")
        rel_top = "" if rel_top == "." else rel_top + "/"
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not any(
            fnmatch.fnmatch(d, pat) or fnmatch.fnmatch(rel_top + d, pat) for pat in ignored))
        found += [rel_top + f for f in sorted(files)]
    return found


# ---- the import graph ----

def _module_name(path):
    parts = path[:-len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree):
    """(node, enclosing function name or None) for every import statement in the tree. Imports are
    statements, so only statements (and except and case clauses) are searched, not expressions."""
    out = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append((child, func))
            elif isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
                visit(child, child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func)

    visit(tree, None)
    return out


def import_graph(base, folders):
    """{importer: {imported: [(path, line, function or None), ...]}} among the .py files under `folders`."""
    paths = [p for p in repo_files(base) if p.endswith(".py") and p.split("/")[0] in folders]
    modules = {_module_name(p): p for p in paths}
    graph = {m: defaultdict(list) for m in modules}

    def nearest_module(name):  # `name` or the nearest source module above it
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in modules.items():
        with open(os.path.join(base, path), encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        above_me = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 2)}
        for node, func in _imports(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [nearest_module(alias.name) for alias in node.names]
            else:
                source = node.module
                if node.level:  # relative: from the file's package, up level - 1 packages
                    parts = package.split(".") if package else []
                    if node.level > len(parts):
                        continue  # beyond the top package: an ImportError in Python, no edge here
                    source = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append(sub if sub in modules else nearest_module(source))
            for target in set(targets) - {None}:
                # T and the packages above T that Python runs first, less those above (or being) the importer
                chain = [".".join(target.split(".")[:i]) for i in range(1, target.count(".") + 2)]
                for t in chain:
                    if t in modules and t != mod and (t == target or t not in above_me):
                        graph[mod][t].append((path, node.lineno, func))
    return graph


def strongly_connected(graph):
    """The strongly connected sets of more than one module (Tarjan), each sorted, in sorted order."""
    index, low, on_stack, stack, sets = {}, {}, set(), [], []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                sets.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(sets)


def shortest_cycle(graph, members):
    """The shortest cycle through the first of `members`, within them: [m0, m1, ..., m0]."""
    start, inside = members[0], set(members)
    came_from, queue = {start: None}, deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v]):
            if w == start:  # back at the start: the path to v, then start again
                path = [v]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return path[::-1] + [start]
            if w in inside and w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"{members} is not strongly connected")


def _where(sites):
    return "; ".join(f"{path}:{line}" + (f", lazy, in {func}()" if func else "") for path, line, func in sites)


def describe_cycles(graph, folder=None):
    """One paragraph per import cycle (touching `folder`, when given): the shortest cycle through it, then
    every import inside the set, with file:line and whether it is lazy. Empty when there is none."""
    out = []
    for members in strongly_connected(graph):
        if folder and not any(m.split(".")[0] == folder for m in members):
            continue
        cycle = shortest_cycle(graph, members)
        lines = [f"import cycle among {len(members)} modules: {' -> '.join(cycle)}"]
        lines += [f"    {a} -> {b}  ({_where(graph[a][b])})"
                  for a in members for b in sorted(graph[a]) if b in members]
        out.append("\n".join(lines))
    return out


# ---- the long files ----

def long_files(base, limit=MAX_LINES):
    """(lines, path) of every source file under base with more than `limit` lines, longest first."""
    found = []
    for path in repo_files(base):
        if path.endswith(SOURCE_SUFFIXES):
            with open(os.path.join(base, path), encoding="utf-8", errors="replace") as f:
                n = len(f.read().splitlines())
            if n > limit:
                found.append((n, path))
    return sorted(found, reverse=True)


# ---- the guards, on this repository ----

@pytest.fixture(scope="module")
def repo_graph():
    return import_graph(ROOT, CYCLE_FREE)


@pytest.mark.parametrize("folder", CYCLE_FREE)
def test_no_import_cycle(repo_graph, folder):
    cycles = describe_cycles(repo_graph, folder)
    if cycles:
        pytest.fail(f"{len(cycles)} import cycle(s) in {folder}/ (tests/project/test_layout.py says what counts):\n"
                    + "\n".join(cycles), pytrace=False)


def test_no_source_file_over_700_lines():
    found = long_files(ROOT)
    if found:
        pytest.fail(f"source files over {MAX_LINES} lines (split them by what they do):\n"
                    + "\n".join(f"    {path}: {n} lines" for n, path in found), pytrace=False)


def misplaced_tests(base, groups):
    """Test files outside the groups, and basenames held by two test files.

    A test file at tests/ itself, or in a folder that is no group, is one the map in docs/testing.md
    does not show; in a folder named build/ pytest would not even collect it (its norecursedirs). Test
    files import helpers from one another by basename (tests/conftest.py), so a basename is one file.
    """
    tests = [p for p in repo_files(base)
             if p.startswith("tests/") and fnmatch.fnmatch(os.path.basename(p), "test_*.py")]
    outside = sorted(p for p in tests if p.split("/")[1] not in groups or p.count("/") < 2)
    seen = defaultdict(list)
    for p in tests:
        seen[os.path.basename(p)].append(p)
    twice = sorted(paths for paths in seen.values() if len(paths) > 1)
    return outside, twice


def test_every_test_file_sits_in_a_group():
    from repo_paths import GROUPS

    outside, twice = misplaced_tests(ROOT, GROUPS)
    assert not outside, f"test files outside the groups {GROUPS} (tests/repo_paths.py): {outside}"
    assert not twice, f"test files sharing a basename: {twice}"


# ---- the guards bite ----

def _write(base, files):
    for path, text in files.items():
        full = base / path
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_text(text)


def _git_init(base):
    subprocess.run(["git", "init", "-q", str(base)], check=True, capture_output=True)


@pytest.mark.parametrize("statement", [
    "from . import b", "from .b import f", "from pkg import b", "from pkg.b import f", "import pkg.b",
    "def later():\n    from . import b"])
def test_a_planted_cycle_is_found(tmp_path, statement):
    # pkg.a imports pkg.b (each form of import in turn); pkg.b imports pkg.a back, lazily
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": statement + "\n",
                      "pkg/b.py": "def f():\n    pass\n\n\ndef g():\n    from .a import h\n"})
    cycles = describe_cycles(import_graph(str(tmp_path), ("pkg",)), "pkg")
    assert len(cycles) == 1 and cycles[0].startswith("import cycle among 2 modules: pkg.a -> pkg.b -> pkg.a"), cycles
    assert "pkg/a.py:" in cycles[0] and "pkg/b.py:6, lazy, in g()" in cycles[0]


def test_planted_cycles_through_packages_and_across_folders(tmp_path):
    # other.x imports lib.sub.y, which runs lib/sub/__init__.py first; that imports other.x back: a cycle
    # across two folders. lib.sub.z importing its siblings through its package is none; lib.sub.n taking a
    # name from lib/sub/__init__.py, which imports lib.sub.n, is one.
    _write(tmp_path, {"lib/__init__.py": "", "lib/sub/__init__.py": "from other import x\nfrom . import z\n"
                                                                     "from .n import g\nHELPER = 1\n",
                      "lib/sub/y.py": "", "lib/sub/z.py": "from . import y\nfrom lib.sub import y as w\n",
                      "lib/sub/n.py": "def g():\n    from . import HELPER\n",
                      "other/__init__.py": "", "other/x.py": "import os\nimport lib.sub.y\n"})
    _git_init(tmp_path)  # found as untracked files, as a file added later and not yet committed is
    graph = import_graph(str(tmp_path), ("lib", "other"))
    cycles = describe_cycles(graph)
    assert len(cycles) == 1 and cycles[0].startswith("import cycle among 3 modules: lib.sub -> lib.sub.n -> lib.sub"), \
        cycles
    assert "lib.sub -> other.x  (lib/sub/__init__.py:1)" in cycles[0]
    assert "other.x -> lib.sub  (other/x.py:2)" in cycles[0]
    assert "lib.sub.n -> lib.sub  (lib/sub/n.py:2, lazy, in g())" in cycles[0]
    assert describe_cycles(graph, "lib") == describe_cycles(graph, "other") == cycles
    assert set(graph["lib.sub.z"]) == {"lib.sub.y"}  # neither its own package nor itself


def test_no_cycle_is_reported_where_there_is_none(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "from .a import f\nfrom . import b\n", "pkg/a.py": "from . import b\n",
                      "pkg/b.py": "import torch\nfrom .. import nothing\n", "pkg/c.py": "from pkg import a, b\n"})
    assert describe_cycles(import_graph(str(tmp_path), ("pkg",))) == []


@pytest.mark.parametrize("in_git", [True, False], ids=["git", "walk"])
def test_a_planted_long_file_is_found(tmp_path, in_git):
    long_text = "// a line\n" * (MAX_LINES + 1)
    _write(tmp_path, {"shaders/deep/long.metal": long_text, "a.py": "x = 1\n" * MAX_LINES,  # 700: allowed
                      "notes.txt": long_text, "build/copy.metal": long_text,
                      ".gitignore": "build/\n"})
    if in_git:
        _git_init(tmp_path)
    assert long_files(str(tmp_path)) == [(MAX_LINES + 1, "shaders/deep/long.metal")]


@pytest.mark.parametrize("in_git", [True, False], ids=["git", "walk"])
def test_a_misplaced_test_file_is_found(tmp_path, in_git):
    _write(tmp_path, {"tests/cpu/test_a.py": "", "tests/cpu/helper.py": "", "tests/test_root.py": "",
                      "tests/build/test_b.py": "", "tests/api/test_a.py": "", "tests/api/deep/test_c.py": ""})
    if in_git:
        _git_init(tmp_path)
    outside, twice = misplaced_tests(str(tmp_path), ("cpu", "api"))
    assert outside == ["tests/build/test_b.py", "tests/test_root.py"]
    assert twice == [["tests/api/test_a.py", "tests/cpu/test_a.py"]]
