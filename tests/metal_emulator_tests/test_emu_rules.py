"""The compile-only MSL rules check: every rule on every shader file, each library in its own language version."""

import os
import shutil

import pytest
from conftest import kernel_path

from test_build import load_setup

from metal_emulator import MslRuleError, check_msl_rules, check_shader_tree, uncovered_shader_files

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHADERS = os.path.join(REPO, "shaders")


def libraries(shader_dir):
    """Every .metal under shader_dir -> its language version, as setup.py builds them: *_mpp.metal in
    the MSL 4 library (-std=metal4.0), the others in the MSL 3.1 one (setup.metal_sources globs them)."""
    setup = load_setup()  # setup.py as a module (tests/project/test_build.py)
    out = {src: 3 for src in setup.metal_sources(shader_dir)}
    out.update({src: 4 for src in setup.metal_sources(shader_dir, mpp=True)})
    return out


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
    """Both libraries, each in its own version (attention_mpp.metal as MSL 4: __METAL_VERSION__ 400 and
    the tensor headers, so its headers are parsed, not the empty file MSL 3.1 sees), and every file
    under shaders/ read by one of them (check_shader_tree raises on a file no check reaches)."""
    libs = libraries(SHADERS)
    assert 4 in libs.values() and 3 in libs.values(), libs
    covered = check_shader_tree(SHADERS, libs)
    for header in ("tensor_ops/attention_mpp_common.h", "tensor_ops/attention_prefill_mpp_dsplit.h",
                   "tensor_ops/attention_backward_mpp.h"):
        assert os.path.join(SHADERS, header) in covered  # the MSL 4 headers, reached only by the MSL 4 parse


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
        ("decode/attention_decode.h", "static constexpr constant int RS =", "static constexpr int RS =",
         "a static data member 'RS'"),
        # a C++17-only construct in a shipped shader
        ("decode/attention_decode.h", "const int R = p.gqa_ratio * p.q_len;",
         "const int R = p.gqa_ratio * p.q_len; if constexpr (DMAX > 0) {}", "C++17"),
        ("common/attention_common.h", "constant float kMaskedScore = -1267650600228229401496703205376.0f;",
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
    copy = tmp_path / "shaders"
    shutil.copytree(SHADERS, copy)
    text = (copy / where).read_text()
    assert old in text, f"the planting site moved: {old!r} not in {where}"
    entry = copy / "planted.metal"
    entry.write_text(f'#include "{where}"\n')
    check_msl_rules([str(entry)])  # the unplanted header passes through the same entry
    (copy / where).write_text(text.replace(old, new, 1))
    with pytest.raises(MslRuleError) as e:
        check_msl_rules([str(entry)])
    assert any(fragment in v and where in v for v in e.value.violations), e.value.violations


def test_a_shared_header_reached_through_a_family_folder_is_checked(tmp_path):
    """The family headers include the shared ones by a relative path ("../common/attention_common.h"):
    clang names such a file "post/../common/attention_common.h", and the check must still know it for
    the copy of common/attention_common.h (the rules and the covered files both), or every shared header
    would go unchecked."""
    copy = tmp_path / "shaders"
    shutil.copytree(SHADERS, copy)
    where = "common/attention_common.h"
    text = (copy / where).read_text()
    entry = copy / "planted.metal"
    entry.write_text('#include "post/attention_untiled.h"\n')
    assert str(copy / where) in check_msl_rules([str(entry)])
    # A rule only the AST walk sees (no compiler diagnostic): a static data member without `constant`.
    plant = "\nnamespace flash_metal {\nstruct FmPlanted { static constexpr int kPlanted = 1; };\n}\n"
    (copy / where).write_text(text + plant)
    with pytest.raises(MslRuleError) as e:
        check_msl_rules([str(entry)])
    assert any("a static data member 'kPlanted'" in v and v.startswith(str(copy / where))
               for v in e.value.violations), e.value.violations


def test_static_member_planted_in_an_msl4_header_fails_the_suite(tmp_path):
    """Issue 40's class: a static data member without `constant` in an MSL 4 header. The shaders,
    copied, with MppDsplitShape::kBytes (one of the 15 members issue 40 fixed) stripped of its
    `constant`, checked as the suite checks them (check_shader_tree, the copy's own libraries):
    the MSL 4 library's parse names it. Before issue 40 the check parsed attention_mpp.metal only
    as MSL 3.1, where its guard leaves it empty, and all 15 went through."""
    copy = tmp_path / "shaders"
    shutil.copytree(SHADERS, copy)
    where = "tensor_ops/attention_prefill_mpp_dsplit.h"
    old, new = "static constant constexpr int kBytes =", "static constexpr int kBytes ="
    text = (copy / where).read_text()
    assert old in text, f"the planting site moved: {old!r} not in {where}"
    (copy / where).write_text(text.replace(old, new, 1))
    mpp = {path: msl for path, msl in libraries(str(copy)).items() if msl == 4}
    assert [os.path.basename(p) for p in mpp] == ["attention_mpp.metal"]
    with pytest.raises(MslRuleError) as e:
        check_msl_rules(list(mpp), 4)
    assert any("a static data member 'kBytes'" in v and where in v for v in e.value.violations), e.value.violations


def test_a_shader_file_no_check_reads_is_reported(tmp_path):
    """A file under shaders/ that no library includes (a new header not yet wired in) is listed, so it
    cannot escape the rules, at any depth (the family folders, and a new one); so is one reached only
    under a language version no library is built in. Files that are not shader sources (README.md) are
    not listed."""
    copy = tmp_path / "shaders"
    shutil.copytree(SHADERS, copy)
    assert (copy / "README.md").exists()
    assert uncovered_shader_files(str(copy), libraries(str(copy))) == []
    orphan = "#pragma once\nstruct FmOrphan { static constexpr int kN = 1; };\n"
    (copy / "attention_orphan.h").write_text(orphan)
    (copy / "prefill" / "attention_prefill_orphan.h").write_text(orphan)
    (copy / "newfamily").mkdir()
    (copy / "newfamily" / "attention_newfamily.h").write_text(orphan)
    orphans = sorted(str(copy / f) for f in ("attention_orphan.h", "prefill/attention_prefill_orphan.h",
                                             "newfamily/attention_newfamily.h"))
    # attention_mpp.metal's headers as if its library were MSL 3.1 only: its guard hides them
    as_msl3 = {path: 3 for path in libraries(str(copy))}
    assert uncovered_shader_files(str(copy), libraries(str(copy))) == orphans
    missed = uncovered_shader_files(str(copy), as_msl3)
    assert set(orphans) <= set(missed) and str(copy / "tensor_ops" / "attention_mpp_common.h") in missed


# Section 1.5.4 of the MSL specification: C++ features Metal does not have. Each snippet goes in a
# kernel body (or before the kernel, with `@top`), the msl versions where it is refused.
_KERNEL = """#include <metal_stdlib>
using namespace metal;
{top}
[[kernel]] void planted(device float* out [[buffer(0)]], uint lid [[thread_index_in_threadgroup]]) {{
  float x = float(lid);
  {body}
  out[lid] = x;
}}
"""
_FORBIDDEN = [
    ("goto", "", "if (lid > 3) goto done; x += 1.0f; done:", (3, 4), "a goto statement"),
    ("new", "", "thread float* p = new float(1.0f); x += *p;", (3, 4), "a new expression"),
    ("noexcept", "inline float f(float v) { return v; }", "x += noexcept(f(x)) ? 1.0f : 0.0f;", (3, 4),
     "the noexcept operator"),
    ("virtual", "struct Base { virtual float get() const { return 1.0f; } };", "Base b; x += b.get();", (3, 4),
     "a virtual function"),
    ("derived", "struct A { float a = 1.0f; }; struct B : A {};", "B b; x += b.a;", (3, 4), "a derived class"),
    ("thread_local", "thread_local float tl = 1.0f;", "x += tl;", (3, 4), "a thread_local variable"),
    ("lambda", "", "auto f = [](float v) { return v * 2.0f; }; x = f(x);", (3,),
     "a lambda expression (Metal 3.2 and later only)"),
    # MSL 4 is C++17-based: C++20 is refused there (and by MSL 3.1's C++14 parse)
    ("consteval", "consteval int two() { return 2; }", "x += float(two());", (3, 4), "consteval"),
    ("designated", "struct P { float a, b; };", "P pr{.a = 1.0f, .b = 2.0f}; x += pr.a;", (3, 4), "designated"),
    ("concept", "template <class T> concept Real = true;", "", (3, 4), "concept"),
    ("likely", "", "if (lid > 3) [[likely]] { x += 1.0f; }", (3, 4), "likely"),
]


@pytest.mark.parametrize("name,top,body,refused,fragment", _FORBIDDEN, ids=[f[0] for f in _FORBIDDEN])
@pytest.mark.parametrize("msl", [3, 4])
def test_what_metal_lacks_is_refused(tmp_path, name, top, body, refused, fragment, msl):
    """Each planted construct is refused in the versions the specification names, and only there
    (a lambda is Metal 3.2 and later: refused in MSL 3.1, accepted in MSL 4)."""
    src = tmp_path / f"{name}.metal"
    src.write_text(_KERNEL.format(top=top, body=body))
    if msl not in refused:
        check_msl_rules([str(src)], msl)
        return
    with pytest.raises(MslRuleError) as e:
        check_msl_rules([str(src)], msl)
    assert any(fragment in v for v in e.value.violations), e.value.violations


def test_msl4_headers_may_use_cxx17(tmp_path):
    """MSL 4 is C++17-based: `if constexpr` in an MSL 4 header passes its check, while the same
    construct in an MSL 3.1 header fails (test_planted_in_a_copy_of_the_shaders[if_constexpr])."""
    copy = tmp_path / "shaders"
    shutil.copytree(SHADERS, copy)
    where = "tensor_ops/attention_mpp_common.h"
    text = (copy / where).read_text()
    plant = ("\nnamespace flash_metal {\n"
             "template <int N> inline int fm_planted() { if constexpr (N > 0) return N; return 0; }\n}\n")
    (copy / where).write_text(text + plant)
    entry = copy / "planted_mpp.metal"
    entry.write_text(f'#include "{where}"\n')
    check_msl_rules([str(entry)], 4)
    (copy / where).write_text(text + plant.replace("inline int", "consteval int"))
    with pytest.raises(MslRuleError) as e:
        check_msl_rules([str(entry)], 4)
    assert any("C++17 (MSL 4" in v and where in v for v in e.value.violations), e.value.violations
