"""The MPP shim refuses what Apple's MPP headers refuse (include/fm/mpp_rules.h cites each rule).

kernels/mpp_rules.metal is a clean kernel that uses the constructs the shipped tensor-op kernels use;
-DPLANT=n breaks one rule of Apple's MPPTensorOpsMatMul2d.h / MPPTensorOpsMatMul2dImpl.h per n, and each
plant must fail to compile with that rule's message. Syntax-only compiles (about a second each): the
emulator's runtime build (address spaces erased) and its FMEMU_CHECK_MSL build (address spaces as clang's),
which alone can see a tensor over thread memory. The shipped MSL 4 library (shaders/attention_mpp.metal)
must compile clean in both; its pre-issue-40 spellings (a prvalue slice passed to run(), a tensor over
`device const T`) must not.
"""

import os
import shutil
import subprocess
import tempfile

import pytest
from conftest import kernel_path

from metal_emulator import _build

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPP_SHADER = os.path.join(ROOT, "shaders", "attention_mpp.metal")


def syntax_errors(path, *defines, check=False):
    """clang's errors for `path` compiled syntax-only as MSL 4 through the emulator's shim (pre-pass included)."""
    with tempfile.TemporaryDirectory(prefix="fm-mpp-rules-") as tmp:
        copy = _build.write_rewritten([path], tmp)[os.path.abspath(path)]
        cmd = [_build.find_clang(), *_build.common_flags(4), "-I", os.path.dirname(copy), "-fsyntax-only",
               "-ferror-limit=0", *(f"-D{d}" for d in defines), *(["-DFMEMU_CHECK_MSL"] if check else []), copy]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    errors = [line.split(" error: ", 1)[1] for line in proc.stderr.splitlines() if " error: " in line]
    assert (proc.returncode != 0) == bool(errors), proc.stderr[-2000:]
    return errors


# PLANT -> the words of the refusal (each a rule of Apple's headers).
PLANTS = {
    1: "takes non-const lvalue references",              # op.run(a, t.slice(0, k0), c): a prvalue slice
    2: "const element type",                              # a tensor over device const half
    3: "at least one of M or N must be a multiple of 16",  # matmul2d_descriptor(8, 8, 16)
    4: "index type must be int",                          # dextents<uint, 2>
    5: "belongs to another op",                           # another op's destination cooperative tensor
    6: "element type must be the source's",               # a half row reduction of a float destination
    7: "identity's type must be the tensors' element type",  # reduce_rows(..., 0) on float
    8: "require a single SIMD group",                     # reduce_rows on execution_simdgroups<2>
    10: "must be the cooperative tensor's exactly",       # a float cooperative tensor loaded from half
    11: "can only be float, half or int32_t",             # a bfloat destination cooperative tensor
    12: "member of a row or column reduction destination",  # map_iterator of a destination
    13: "iterator over a matmul2d destination",           # map_iterator over a reduction's iterator
    14: "no matching constructor for initialization of",  # the mode passed where relaxed_precision goes
}


@pytest.mark.parametrize("check", [False, True], ids=["runtime", "check-msl"])
def test_the_clean_kernel_compiles(check):
    """Without a plant the kernel compiles in both builds, so each plant's error is the plant's."""
    assert syntax_errors(kernel_path("mpp_rules.metal"), check=check) == []


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_each_planted_violation_is_refused(plant):
    for check in (False, True):
        errors = syntax_errors(kernel_path("mpp_rules.metal"), f"PLANT={plant}", check=check)
        assert any(PLANTS[plant] in e for e in errors), (plant, check, errors[:3])


def test_a_thread_memory_operand_is_refused_where_address_spaces_are_known():
    """Apple's __run takes device or threadgroup tensors on a SIMD-group scope ("Unsupported address space");
    only the FMEMU_CHECK_MSL build knows a thread array from a device buffer."""
    assert syntax_errors(kernel_path("mpp_rules.metal"), "PLANT=9") == []
    errors = syntax_errors(kernel_path("mpp_rules.metal"), "PLANT=9", check=True)
    assert any("must be in device or threadgroup memory" in e for e in errors), errors[:3]


@pytest.mark.parametrize("check", [False, True], ids=["runtime", "check-msl"])
def test_the_shipped_msl4_library_compiles_clean(check):
    assert syntax_errors(MPP_SHADER, check=check) == []


# The kernels' spellings before issue 40, planted back into a copy of shaders/: a temporary slice passed to
# run(), and tensors over the head's `device const T` rows.
OLD_SPELLINGS = {
    "prvalue-slice": ("tensor_ops/attention_prefill_mpp.h",
                      [("      qk.run(tq, k_blk, s);\n    } else {",
                        "      qk.run(tq, k_blk.slice(0, 0), s);\n    } else {")],
                      "takes non-const lvalue references"),
    "const-rows": ("tensor_ops/attention_mpp_common.h",
                   [("using MppDeviceTensor = tensor<device T,", "using MppDeviceTensor = tensor<device const T,"),
                    ("const_cast<device T*>(base)", "base")],
                   "const element type"),
}


@pytest.mark.parametrize("name", sorted(OLD_SPELLINGS))
def test_the_old_spellings_are_refused(tmp_path, name):
    header, edits, want = OLD_SPELLINGS[name]
    shutil.copytree(os.path.join(ROOT, "shaders"), tmp_path / "shaders")
    path = tmp_path / "shaders" / header
    text = path.read_text()
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path.write_text(text)
    errors = syntax_errors(str(tmp_path / "shaders" / "attention_mpp.metal"))
    assert errors and all(want in e for e in errors), errors[:3]
