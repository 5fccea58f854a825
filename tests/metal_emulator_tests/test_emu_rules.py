"""The compile-only MSL rules check."""

import os
import shutil

import pytest
from conftest import kernel_path

from metal_emulator import MslRuleError, check_msl_rules

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_good_kernel_passes():
    check_msl_rules([kernel_path("rules/good.metal")])


@pytest.mark.parametrize(
    "name,fragment",
    [
        ("device_to_thread", "address space"),
        ("threadgroup_to_plain", "address space"),
        ("write_constant", "read-only"),
        ("no_address_space", "needs an address space"),
        ("no_attribute", "needs an attribute"),
        # every variable with static storage must be in `constant`
        ("static_member", "a static data member 'kHalf'"),
        ("namespace_variable", "a namespace-scope variable 'kScale'"),
        ("local_static", "a function-local static variable 'kOffset'"),
        # C++14, MSL 3.1's base language
        ("if_constexpr", "constexpr if is a C++17 extension"),
    ],
)
def test_violation_is_caught(name, fragment):
    with pytest.raises(MslRuleError) as e:
        check_msl_rules([kernel_path(f"rules/{name}.metal")])
    assert any(fragment in v.replace("_", " ") for v in e.value.violations), e.value.violations


def test_own_proof_kernels_follow_the_rules():
    for name in ("basic", "collectives", "matrix", "rounding", "threadgroup", "bugs"):
        check_msl_rules([kernel_path(f"{name}.metal")])


def test_shipped_shaders_follow_the_rules():
    shaders = os.path.join(REPO, "shaders")
    metal = sorted(f for f in os.listdir(shaders) if f.endswith(".metal")) if os.path.isdir(shaders) else []
    if not metal:
        pytest.skip("no shaders/*.metal yet")
    for name in metal:
        check_msl_rules([os.path.join(shaders, name)])


def test_good_kernel_passes_as_cxx14_too():
    """good.metal has static-storage variables (in constant) and passes both parses;
    the C++14 flags are really applied (the planted if_constexpr kernel fails only there)."""
    from metal_emulator import _check

    assert "-std=c++14" in _check.CXX14_FLAGS and "-Werror=c++17-extensions" in _check.CXX14_FLAGS
    check_msl_rules([kernel_path("rules/good.metal")])


@pytest.mark.parametrize(
    "where,old,new,fragment",
    [
        # the class issue 18 found: a static data member without `constant`
        ("attention_decode.h", "static constexpr constant int RS =", "static constexpr int RS =",
         "a static data member 'RS'"),
        # a C++17-only construct in a shipped shader
        ("attention_decode.h", "const int R = p.gqa_ratio * p.q_len;",
         "const int R = p.gqa_ratio * p.q_len; if constexpr (DMAX > 0) {}", "C++17"),
        ("attention_common.h", "constant float kMaskedScore = -1267650600228229401496703205376.0f;",
         "constant float kMaskedScore = -0x1p100f;", "hexadecimal floating literals are a C++17 feature"),
    ],
    ids=["static_member", "if_constexpr", "hex_float"],
)
def test_planted_in_a_copy_of_the_shaders(tmp_path, where, old, new, fragment):
    """The shipped shaders, copied, with one planted violation: the check names it.
    The check reads the planted header through a one-line .metal that includes
    it (no kernel instantiated): these rules hold in templates' definitions,
    and the whole attention.metal's AST (every instantiation) would cost ~20 s
    a case; test_shipped_shaders_follow_the_rules checks that one."""
    shaders = os.path.join(REPO, "shaders")
    copy = tmp_path / "shaders"
    shutil.copytree(shaders, copy)
    text = (copy / where).read_text()
    assert old in text, f"the planting site moved: {old!r} not in {where}"
    entry = copy / "planted.metal"
    entry.write_text(f'#include "{where}"\n')
    check_msl_rules([str(entry)])  # the unplanted header passes through the same entry
    (copy / where).write_text(text.replace(old, new, 1))
    with pytest.raises(MslRuleError) as e:
        check_msl_rules([str(entry)])
    assert any(fragment in v and where in v for v in e.value.violations), e.value.violations
