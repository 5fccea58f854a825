"""The decode kernels' source (shaders/decode/attention_decode.h), read as text: no
integer division by a runtime value in the per-block loops (issue 19).
Moved out of test_metal_decode.py to keep each file under ~600 lines."""
import pathlib
import re
from repo_paths import ROOT_DIR


DECODE_SOURCE = pathlib.Path(ROOT_DIR) / "shaders" / "decode" / "attention_decode.h"
# Divisors the compiler folds: compile-time template parameters and constants
# (a shift, or a multiply by a constant for 72/80/96), and number literals.
COMPILE_TIME_DIVISORS = re.compile(r"(DMAX|DPL|RS|CPR|kDecodeBlock|kDenseLoadBytes|\d+)\b")


def _function_body(src, signature):
    """Text of the brace-balanced body that follows `signature` in src."""
    start = src.index("{", src.index(signature))
    depth = 0
    for i in range(start, len(src)):
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        if depth == 0:
            return src[start:i + 1]
    raise AssertionError(f"unbalanced body after {signature!r}")


def _runtime_divisions(src):
    """Each `/` or `%` of decode_attend's block loop whose divisor is not a compile-time constant.

    Apple GPUs have no integer divide instruction: a division by a runtime
    int (D, q_len, ...) is a software routine, which the staged path (gone
    since issue 19) paid per element before.
    """
    attend = _function_body(src, "FM_INLINE void decode_attend(")
    loop = attend[attend.index("for (int k0 = "):]
    found = []
    for name, body in (("decode_attend block loop", loop),):
        code = re.sub(r"//[^\n]*", "", body)  # comments may say anything
        for m in re.finditer(r"[^/*](/|%)\s*([A-Za-z_][\w.]*|\d+)", code):
            if not COMPILE_TIME_DIVISORS.fullmatch(m.group(2)):
                found.append((name, f"{m.group(1)} {m.group(2)}"))
        # decode_row divides by the runtime q_len: setup only, never per block.
        found += [(name, "decode_row(") for _ in re.finditer(r"\bdecode_row\(", code)]
    return found


def test_decode_loops_divide_by_compile_time_constants_only():
    src = DECODE_SOURCE.read_text()
    assert _runtime_divisions(src) == []
    # a compile-time divisor in the loop (a shift) is accepted
    folded = src.replace("const int key = k0 + int(lane);", "const int key = k0 + int(lane) / DMAX;", 1)
    assert folded != src and _runtime_divisions(folded) == []


def test_division_check_catches_a_planted_runtime_divisor():
    # A per-key division by the runtime D (as the staged path's element
    # index paid before issue 19), by q_len, and a per-block decode_row
    # call: all found.
    src = DECODE_SOURCE.read_text()
    planted = src.replace("const int key = k0 + int(lane);", "const int key = k0 + int(lane) / D;", 1)
    assert planted != src and ("decode_attend block loop", "/ D") in _runtime_divisions(planted)
    planted = src.replace("const int n = min(kDecodeBlock, key_end - k0);",
                          "const int n = min(kDecodeBlock, key_end - k0) % p.q_len;", 1)
    assert planted != src and ("decode_attend block loop", "% p.q_len") in _runtime_divisions(planted)
    planted = src.replace("const int key = k0 + int(lane);",
                          "const int key = k0 + int(lane) + decode_row(p, 0, 0).row;", 1)
    assert planted != src and ("decode_attend block loop", "decode_row(") in _runtime_divisions(planted)
