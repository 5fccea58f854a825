"""Partial libraries (compile_library's `only` and `exclude`): globs over host
names decide which registration sites are instantiated, so a flavour whose
tests need few kernels of attention.metal (the fast-math one,
tests/backends.py) does not compile the rest, and the default builds leave out
kernels only a few tests run (the wide decode, tests/backends.py
WIDE_DECODE_KERNELS). A left-out kernel is still named (omitted_names), with
its declaration, so what enumerates the source's kernels still sees it."""

import fnmatch
import os
import re
import shutil
import subprocess

import pytest

from conftest import kernel_path
from metal_emulator import EmulatorError, compile_library
from metal_emulator import _build
from metal_emulator._library import filter_flags


def test_only_keeps_exactly_the_matching_kernels():
    full = set(compile_library([kernel_path("basic.metal")]).kernel_names())
    part = compile_library([kernel_path("basic.metal")], only=["reverse_tg_*"])
    assert set(part.kernel_names()) == {n for n in full if n.startswith("reverse_tg_")}
    assert set(part.kernel_names()) != full  # the filter dropped something
    assert set(part.omitted_names()) == full - set(part.kernel_names())
    # No '*': the whole name must match, neither a prefix of the name nor of the pattern.
    exact = compile_library([kernel_path("basic.metal")], only=["reverse_tg_half", "reverse_tg_float_x", "reverse_tg_flo"])
    assert exact.kernel_names() == ["reverse_tg_half"]
    with pytest.raises(EmulatorError, match="'reverse_tg_float' was left out of this partial library"):
        exact.dispatch("reverse_tg_float")
    with pytest.raises(EmulatorError, match="no kernel named 'reverse_tg_double'.*reverse_tg_half"):
        exact.dispatch("reverse_tg_double")


def test_exclude_leaves_out_the_matching_kernels_and_still_names_them():
    whole = compile_library([kernel_path("basic.metal")])
    full = set(whole.kernel_names())
    assert whole.omitted_names() == [] and set(whole.source_kernel_names()) == full
    # exclude after only: of the reverse_tg kernels, all but the half one.
    part = compile_library([kernel_path("basic.metal")], only=["reverse_tg_*"], exclude=["*_half"])
    assert part.kernel_names() == ["reverse_tg_float"]
    assert set(part.omitted_names()) == full - {"reverse_tg_float"} and "reverse_tg_half" in part.omitted_names()
    assert set(part.source_kernel_names()) == full
    # A left-out kernel keeps its declaration (what the registry and the pipelines enumerate) ...
    assert [p.name for p in part.signature("reverse_tg_half")] == [p.name for p in whole.signature("reverse_tg_half")]
    assert part.max_threads("reverse_tg_half") == whole.max_threads("reverse_tg_half")
    # ... but nothing to run.
    with pytest.raises(EmulatorError, match="'reverse_tg_half' was left out of this partial library"):
        part.dispatch("reverse_tg_half", buffers={0: b"\0" * 8}, grid=(1,), threadgroup=(1,))


@pytest.mark.parametrize("what", ["only", "exclude"])
@pytest.mark.parametrize("bad", [[], ["reverse tg"], ["a?b"]])
def test_filters_reject_bad_patterns(what, bad):
    with pytest.raises(EmulatorError, match=f"{what}="):
        compile_library([kernel_path("basic.metal")], **{what: bad})


# The matcher itself (include/fm/kernel.h: fmemu::wanted, glob_match), checked
# at compile time against fnmatch over names where a wrong answer is easy:
# prefixes, suffixes, a '*' in the middle, both filters at once.
NAMES = ["flash_decode_half_d512", "flash_decode_split_half_d512", "flash_decode_half_d576",
         "flash_decode_half_d64", "flash_decode_merge_float_d512", "flash_decode_merge_float_d5120",
         "xflash_decode_half_d512", "flash_backward_dq_half_d512_bq8", "flash_sinks_grad", "d512", "flash_decode"]
FILTERS = [(None, ("flash_decode*_d512", "flash_decode*_d576")),
           (("flash_decode*",), ("*merge*", "*_d576")),
           (("flash_decode_*_d512", "flash_sinks_grad", "d512"), None),
           (("*",), ("*_d5*",))]


def _wanted(name, only, exclude):
    """The rule, in Python: some only pattern (or none given) and no exclude pattern matches the whole name."""
    return ((only is None or any(fnmatch.fnmatchcase(name, p) for p in only))
            and not any(fnmatch.fnmatchcase(name, p) for p in exclude or ()))


def _matcher_mistakes(shim_dir):
    """The (filters, name) pairs where kernel.h's fmemu::wanted disagrees with _wanted, from one
    -fsyntax-only compile per filter pair (static_asserts; a fraction of a second each)."""
    flags = [shim_dir if f == _build.SHIM_DIR else f for f in _build.common_flags()]
    mistakes = []
    for i, (only, exclude) in enumerate(FILTERS):
        body = "#include <metal_stdlib>\n" + "".join(
            f'static_assert(fmemu::wanted("{n}") == {str(_wanted(n, only, exclude)).lower()}, "mistake {j}");\n'
            for j, n in enumerate(NAMES))
        proc = subprocess.run([_build.find_clang(), *flags, *filter_flags(only, exclude), "-fsyntax-only", "-"],
                              input=body, capture_output=True, text=True)
        mistakes += sorted({(i, NAMES[int(j)]) for j in re.findall(r"mistake (\d+)", proc.stderr)})
        assert proc.returncode == 0 or mistakes, proc.stderr  # a failure other than a mistake: a broken check
    return mistakes


def test_matcher_agrees_with_fnmatch():
    for only, exclude in FILTERS:  # each filter pair keeps some names and drops others
        assert len({_wanted(n, only, exclude) for n in NAMES}) == 2, (only, exclude)
    assert _matcher_mistakes(_build.SHIM_DIR) == []


# Planted bugs in the matcher, each a one-token slip; the check above must catch every one.
PLANTS = {
    "exclude_ignored_under_only": ("return in_only(host_name) && !in_except(host_name);",
                                   "return in_only(host_name) || !in_except(host_name);"),
    "exclude_never_matches": ("if (glob_match(p, host_name)) return true;\n  return false;\n}\n#else\n"
                              "constexpr bool in_except",
                              "if (glob_match(p, host_name)) return false;\n  return false;\n}\n#else\n"
                              "constexpr bool in_except"),
    "trailing_star_unmatched": ("while (*p == '*') ++p;\n  return *p == 0;", "return *p == 0;"),
    "prefix_matches": ("  while (*p == '*') ++p;\n  return *p == 0;", "  return true;"),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_planted_matcher_bugs_are_caught(plant, tmp_path):
    old, new = PLANTS[plant]
    shim = tmp_path / "include"
    shutil.copytree(_build.SHIM_DIR, shim)
    kernel_h = shim / "fm" / "kernel.h"
    text = kernel_h.read_text(encoding="utf-8")
    assert text.count(old) == 1, plant  # the plant still applies to today's kernel.h
    kernel_h.write_text(text.replace(old, new), encoding="utf-8")
    assert _matcher_mistakes(os.fspath(shim)), plant
