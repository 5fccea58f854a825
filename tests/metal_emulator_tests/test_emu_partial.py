"""Partial libraries (compile_library's `only`): a glob over host names
decides which registration sites are instantiated, so a flavour whose tests
need few kernels of attention.metal (the fast-math one, tests/backends.py)
does not compile the rest."""

import pytest

from conftest import kernel_path
from metal_emulator import EmulatorError, compile_library


def test_only_keeps_exactly_the_matching_kernels():
    full = set(compile_library([kernel_path("basic.metal")]).kernel_names())
    part = compile_library([kernel_path("basic.metal")], only=["reverse_tg_*"])
    assert set(part.kernel_names()) == {n for n in full if n.startswith("reverse_tg_")}
    assert set(part.kernel_names()) != full  # the filter dropped something
    # No '*': the whole name must match, neither a prefix of the name nor of the pattern.
    exact = compile_library([kernel_path("basic.metal")], only=["reverse_tg_half", "reverse_tg_float_x", "reverse_tg_flo"])
    assert exact.kernel_names() == ["reverse_tg_half"]
    with pytest.raises(EmulatorError, match="no kernel named 'reverse_tg_float'.*reverse_tg_half"):
        exact.dispatch("reverse_tg_float")


@pytest.mark.parametrize("bad", [[], ["reverse tg"], ["a?b"]])
def test_only_rejects_bad_patterns(bad):
    with pytest.raises(EmulatorError, match="only="):
        compile_library([kernel_path("basic.metal")], only=bad)
