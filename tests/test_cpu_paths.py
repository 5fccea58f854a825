"""The CPU kernel's tile-product paths (issue 22; csrc/cpu/matrix_units.h).

FLASH_METAL_CPU_PATH forces a path: "vector" (float32 FMA tiles) or
"brgemm" (16-bit tiles through ATen's at::native::cpublas::brgemm, float32
accumulation, P rounded to the input dtype). Where ATen cannot drive the
matrix units (no AMX, as on this CI machine) the forced brgemm path runs
ATen's non-VNNI fallback with the same tiling, leading dimensions, P
rounding and option handling, so everything but the AMX instructions and
the VNNI packing is tested on every x86-64 CPU. Each case also runs the
reference path (impl="composite", csrc/composite.h). Every result is checked
against the float64 oracle by the 2x rule (tests/numerics.py), outputs NaN-
poisoned (conftest.py), and torch.ops.flash_metal.cpu_path_counts() proves
the forced path ran.
"""
import zlib

import pytest
import torch

import flash_metal
from numerics import assert_attention_close, assert_gradients_close, assert_varlen_close, dtype_id, make_qkv

COUNTS = torch.ops.flash_metal.cpu_path_counts
FWD_VECTOR, FWD_BRGEMM = 0, 1
HALF_TYPES = [torch.bfloat16, torch.float16]
HAS_BRGEMM = dict(zip(*torch.ops.flash_metal.cpu_features()))["torch_brgemm"] == 1


def _gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


# Each case: (id, B, Hq, Hkv, Nq, Nk, D_qk, D_v, causal, options builder).
# Lengths straddle the kernel's 96-key / 96-query blocks and are odd (a VNNI
# pad on AMX); D = 72 is not a power of two; (40, 24) is D_qk != D_v.
def _mask_bool(B, Hq, Nq, Nk, g):
    m = torch.rand(B, 1, Nq, Nk, generator=g) > 0.3
    m[..., 0] = True  # every row sees a key
    return {"attn_mask": m}


def _mask_add(B, Hq, Nq, Nk, g):
    return {"attn_mask": torch.randn(1, Hq, Nq, Nk, generator=g)}


def _sinks(B, Hq, Nq, Nk, g):
    return {"sinks": torch.randn(Hq, generator=g)}


CASES = [
    ("plain", 1, 2, 2, 67, 131, 64, 64, False, None),
    ("causal-gqa", 1, 4, 2, 131, 131, 72, 72, True, None),
    ("decode-gqa", 2, 8, 2, 1, 197, 64, 64, False, None),
    ("window", 1, 2, 1, 150, 173, 64, 64, True, lambda *a: {"window_left": 37}),
    ("bool-mask", 2, 2, 2, 45, 101, 64, 64, False, _mask_bool),
    ("add-mask-softcap", 1, 2, 2, 70, 99, 64, 64, False,
     lambda *a: dict(_mask_add(*a), softcap=5.0)),
    ("sinks-causal", 1, 2, 2, 97, 97, 64, 64, True, _sinks),
    ("dqk-ne-dv", 1, 2, 1, 100, 113, 40, 24, True, None),
]


def _run_case(case, dtype, impl="auto", layout="contiguous"):
    name, B, Hq, Hkv, Nq, Nk, D, Dv, causal, build = case
    g = _gen(name, str(dtype), layout)
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, layout=layout, generator=g)
    if Dv != D:
        v = torch.randn(B, Hkv, Nk, Dv, generator=g).to(dtype)
    options = build(B, Hq, Nq, Nk, g) if build else {}
    out, lse = flash_metal.attention_with_lse(q, k, v, causal, None, impl, **options)
    assert_attention_close(out, lse, q, k, v, causal, None, **options)


@pytest.fixture
def path(monkeypatch, request):
    monkeypatch.setenv("FLASH_METAL_CPU_PATH", request.param)
    return request.param


@pytest.mark.parametrize("path", ["vector", "brgemm"], indirect=True)
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forced_path_matches_oracle(path, dtype, case):
    if path == "brgemm" and not HAS_BRGEMM:
        pytest.skip("this torch has no at::native::cpublas::brgemm (torch >= 2.6 has)")
    before = COUNTS()
    _run_case(case, dtype)
    after = COUNTS()
    ran = FWD_BRGEMM if path == "brgemm" else FWD_VECTOR
    assert after[ran] == before[ran] + 1, f"the forward did not run the {path} path: {before} -> {after}"
    info = torch.ops.flash_metal.cpu_path_info(dtype)
    assert info[0] == path and f"FLASH_METAL_CPU_PATH={path}" in info[1], info


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=dtype_id)
@pytest.mark.parametrize("case", [CASES[1], CASES[6]], ids=[CASES[1][0], CASES[6][0]])
def test_reference_path_matches_oracle(dtype, case):
    """The reference (composite) path on the same cases: the third path of the issue."""
    before = COUNTS()
    _run_case(case, dtype, impl="composite")
    assert COUNTS() == before, "impl='composite' must not run the flash kernel"


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=dtype_id)
@pytest.mark.parametrize("layout", ["every_other", "transposed"])
def test_brgemm_strided_inputs(monkeypatch, dtype, layout):
    """Feature stride 2 (K and V copied, not read in place) and (B, N, H, D) rows."""
    if not HAS_BRGEMM:
        pytest.skip("this torch has no at::native::cpublas::brgemm")
    monkeypatch.setenv("FLASH_METAL_CPU_PATH", "brgemm")
    before = COUNTS()[FWD_BRGEMM]
    _run_case(CASES[1], dtype, layout=layout)
    assert COUNTS()[FWD_BRGEMM] == before + 1


@pytest.mark.parametrize("path", ["vector", "brgemm"], indirect=True)
def test_forced_path_varlen(path):
    if path == "brgemm" and not HAS_BRGEMM:
        pytest.skip("this torch has no at::native::cpublas::brgemm")
    g = _gen("varlen", path)
    lq, lk = [5, 0, 130, 33], [40, 17, 130, 101]
    cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(lq), 4, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(sum(lk), 2, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(sum(lk), 2, 64, generator=g).to(torch.bfloat16)
    before = COUNTS()
    out, lse = flash_metal.attention_varlen_with_lse(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True,
                                                     window_left=50)
    assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, causal=True, window_left=50)
    ran = FWD_BRGEMM if path == "brgemm" else FWD_VECTOR
    assert COUNTS()[ran] == before[ran] + 1


def test_brgemm_on_float32_runs_vector(monkeypatch):
    """The documented fallback: the brgemm path is for 16-bit tiles; float32 keeps the FMA tiles."""
    monkeypatch.setenv("FLASH_METAL_CPU_PATH", "brgemm")
    path, reason, vnni = torch.ops.flash_metal.cpu_path_info(torch.float32)
    assert path == "vector" and "16-bit" in reason and not vnni
    before = COUNTS()
    _run_case(CASES[0], torch.float32)
    after = COUNTS()
    assert after[FWD_VECTOR] == before[FWD_VECTOR] + 1 and after[FWD_BRGEMM] == before[FWD_BRGEMM]


def test_auto_takes_brgemm_only_with_matrix_units(monkeypatch):
    monkeypatch.delenv("FLASH_METAL_CPU_PATH", raising=False)
    feats = dict(zip(*torch.ops.flash_metal.cpu_features()))
    for dtype, key in ((torch.bfloat16, "could_pack_bf16"), (torch.float16, "could_pack_f16")):
        path, reason, vnni = torch.ops.flash_metal.cpu_path_info(dtype)
        want = "brgemm" if feats[key] else "vector"
        assert (path, vnni) == (want, bool(feats[key])), (dtype, reason, feats)
        assert "auto" in reason
    assert torch.ops.flash_metal.cpu_path_info(torch.float32)[0] == "vector"


def test_bad_path_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("FLASH_METAL_CPU_PATH", "amx")
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="FLASH_METAL_CPU_PATH='amx'.*'auto'.*'vector'.*'brgemm'"):
        flash_metal.attention(q, q, q)


def test_vnni_pack_layout():
    """The pair-interleaved layout brgemm_tiles.h relies on (matrix_units.h pack_b):
    out[(k // 2) * 2N + 2n + k % 2] = in[k][n]. Only where ATen can pack for AMX."""
    feats = dict(zip(*torch.ops.flash_metal.cpu_features()))
    if not feats["could_pack_bf16"]:
        pytest.skip("ATen cannot pack bfloat16 for the matrix units on this CPU (no AMX): layout not checkable here")
    K, N = 6, 40
    b = torch.randn(K, N).to(torch.bfloat16)
    packed = torch.ops.flash_metal.cpu_vnni_pack(b)
    want = b.view(K // 2, 2, N).transpose(1, 2).reshape(-1)
    assert torch.equal(packed, want)


# --- backward ----------------------------------------------------------------------------------
FWD_BWD = {"vector": 2, "brgemm": 3}  # cpu_path_counts() slots of the backward


@pytest.mark.parametrize("path", ["vector", "brgemm"], indirect=True)
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=dtype_id)
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4], CASES[5], CASES[7]],
                         ids=[CASES[i][0] for i in (1, 3, 4, 5, 7)])
def test_forced_path_backward(path, dtype, case):
    """Gradients on each forced path vs the float64 oracle. Hkv = 1 cases (window, D_qk != D_v) with
    2 threads take the chunked decomposition (partial dK/dV per chunk), the others one item per kv head."""
    if path == "brgemm" and not HAS_BRGEMM:
        pytest.skip("this torch has no at::native::cpublas::brgemm")
    name, B, Hq, Hkv, Nq, Nk, D, Dv, causal, build = case
    g = _gen("bwd", name, str(dtype))
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, generator=g)
    if Dv != D:
        v = torch.randn(B, Hkv, Nk, Dv, generator=g).to(dtype)
    options = build(B, Hq, Nq, Nk, g) if build else {}
    out, lse = flash_metal.attention_with_lse(q, k, v, causal, None, "auto", **options)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    grad_lse = torch.where(torch.isfinite(lse), torch.randn(lse.shape, generator=g), 0.0)
    before = COUNTS()
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = torch.ops.flash_metal.attention_backward(grad_out, q, k, v, out, lse, causal, None, grad_lse, "auto",
                                                         **options)[:3]
    finally:
        torch.set_num_threads(saved)
    assert COUNTS()[FWD_BWD[path]] == before[FWD_BWD[path]] + 1, "the backward did not run the forced path"
    assert_gradients_close(grads, q, k, v, grad_out, causal, None, grad_lse, **options)
    assert torch.ops.flash_metal.cpu_path_info(dtype, True)[0] == path


def test_backward_auto_stays_vector_without_vnni(monkeypatch):
    monkeypatch.delenv("FLASH_METAL_CPU_PATH", raising=False)
    for dtype in HALF_TYPES + [torch.float32]:
        path, reason, vnni = torch.ops.flash_metal.cpu_path_info(dtype, True)
        assert path == "vector" and not vnni and "backward" in reason, reason
