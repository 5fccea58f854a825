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

FLASH_METAL_CPU_VNNI=emulate (matrix_units.h) makes every brgemm choice pack
its B operands pair-interleaved (VNNI) with the project's scalar pack and
multiply them with its scalar gemm, on any CPU: the forward's and the
backward's VNNI operand code (even pads of odd D / Nq / Nk, packed leading
dimensions) runs here although no machine here has AMX. Emulated, the kernels
NaN-poison their staging buffers before each fill, so a pad left unzeroed
fails these tests. Counter slots 4-6 prove the emulation ran.
"""
import zlib

import pytest
import torch

import flash_metal
from numerics import (assert_attention_close, assert_gradients_close, assert_varlen_close,
                      assert_varlen_gradients_close, dtype_id, make_qkv, threads)

COUNTS = torch.ops.flash_metal.cpu_path_counts
FWD_VECTOR, FWD_BRGEMM = 0, 1
EMU_FWD, EMU_BWD, EMU_GEMM = 4, 5, 6  # brgemm calls with emulated VNNI (forward, backward), emulated products
FWD_COLS = 7  # forward brgemm calls in the column form (csrc/cpu/brgemm_cols.h)
FWD_SPLIT = 9  # float16 forward calls as bfloat16 pairs (csrc/cpu/brgemm_split.h)
INFO = flash_metal.cpu_path  # (path, reason, vnni) as a NamedTuple
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
    monkeypatch.delenv("FLASH_METAL_CPU_VNNI", raising=False)
    feats = dict(zip(*torch.ops.flash_metal.cpu_features()))
    for dtype, key in ((torch.bfloat16, "could_pack_bf16"), (torch.float16, "could_pack_f16")):
        path, reason, vnni = INFO(dtype, True)  # the backward: on the matrix units where the dtype packs
        want = "brgemm" if feats[key] else "vector"
        assert (path, vnni) == (want, bool(feats[key])), (dtype, reason, feats)
        assert "auto" in reason
    # The forward: float16 also takes them, as bfloat16 pairs, where only bfloat16 packs (brgemm_split.h).
    split = feats["could_pack_bf16"] and not feats["could_pack_f16"]
    for dtype, packs in ((torch.bfloat16, feats["could_pack_bf16"]), (torch.float16, feats["could_pack_f16"] or split)):
        path, reason, vnni = INFO(dtype)
        assert (path, vnni) == ("brgemm" if packs else "vector", bool(packs)), (dtype, reason, feats)
        assert "auto" in reason and ("split exactly into two bfloat16s" in reason) == (split and dtype == torch.float16)
    assert torch.ops.flash_metal.cpu_path_info(torch.float32)[0] == "vector"


def test_bad_path_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("FLASH_METAL_CPU_PATH", "amx")
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="FLASH_METAL_CPU_PATH='amx'.*'auto'.*'vector'.*'brgemm'"):
        flash_metal.attention(q, q, q)


def blocked_vnni(b):
    """matrix_units.h's packed B: 64-column blocks, block b of nb columns packed pair-interleaved with
    ld_out = nb rounded up to 16 (pad columns zero): out[(k // 2) * 2 ld_out + 2n + k % 2] = in[k][n]."""
    K, N = b.shape
    parts = []
    for c0 in range(0, N, 64):
        nb = min(64, N - c0)
        ldo = -(-nb // 16) * 16
        blk = torch.zeros(K, ldo, dtype=b.dtype)
        blk[:, :nb] = b[:, c0:c0 + nb]
        parts.append(blk.view(K // 2, 2, ldo).transpose(1, 2).reshape(-1))
    return torch.cat(parts)


@pytest.mark.parametrize("N", [40, 64, 100, 128, 200])
def test_vnni_pack_layout(N):
    """The blocked pair-interleaved layout brgemm_tiles.h relies on, packed by ATen (matrix_units.h pack_b),
    and the emulation bit for bit equal to it. Only where ATen can pack for AMX. (Before issue 39 one pack of
    all N columns: ATen refuses N > 64, so every bfloat16 call on an AMX Xeon raised.)"""
    feats = dict(zip(*torch.ops.flash_metal.cpu_features()))
    if not feats["could_pack_bf16"]:
        pytest.skip("ATen cannot pack bfloat16 for the matrix units on this CPU (no AMX): layout not checkable here")
    K = 6
    b = torch.randn(K, N).to(torch.bfloat16)
    packed = torch.ops.flash_metal.cpu_vnni_pack(b)
    assert torch.equal(packed, blocked_vnni(b))
    assert torch.equal(torch.ops.flash_metal.cpu_vnni_pack(b, emulated=True), packed)  # the emulation is ATen's


# ld_out values around ATen's accepted set {16, 32, 48, 64} (oneDNN's transform; measured on an AMX Xeon).
LD_OUTS = [8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 128]


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=dtype_id)
def test_emulated_pack_refuses_what_aten_refuses(dtype):
    """One pack call per ld_out: the emulation accepts exactly ld_out in {16, 32, 48, 64} and refuses the rest
    with oneDNN's words, on any CPU. Where ATen can pack (AMX), ATen's own pack is asked the same and must agree,
    call by call, and write the same bits. Planted "pack all D columns at once" (kPackBlock = 128 in
    matrix_units.h): the emulated D = 128 / 80 cases below raise this refusal."""
    can_aten = dict(zip(*torch.ops.flash_metal.cpu_features()))[
        "could_pack_bf16" if dtype == torch.bfloat16 else "could_pack_f16"] == 1
    K, N = 10, 8
    b = torch.randn(K, N).to(dtype)
    for ld_out in LD_OUTS:
        ok = ld_out in (16, 32, 48, 64)
        if ok:
            got = torch.ops.flash_metal.cpu_vnni_pack(b, emulated=True, ld_out=ld_out)
            pad = torch.zeros(K, ld_out, dtype=dtype)
            pad[:, :N] = b
            assert torch.equal(got, pad.view(K // 2, 2, ld_out).transpose(1, 2).reshape(-1)), ld_out
        else:
            with pytest.raises(RuntimeError, match="could not create a BRGeMM ukernel packing B object"):
                torch.ops.flash_metal.cpu_vnni_pack(b, emulated=True, ld_out=ld_out)
        if can_aten:
            if ok:
                assert torch.equal(torch.ops.flash_metal.cpu_vnni_pack(b, ld_out=ld_out), got), ld_out
            else:
                with pytest.raises(RuntimeError, match="could not create a BRGeMM ukernel packing B object"):
                    torch.ops.flash_metal.cpu_vnni_pack(b, ld_out=ld_out)
    with pytest.raises(ValueError, match="ld_out must be at least b's column count"):
        torch.ops.flash_metal.cpu_vnni_pack(torch.randn(4, 40).to(dtype), emulated=True, ld_out=32)


# --- backward ----------------------------------------------------------------------------------
FWD_BWD = {"vector": 2, "brgemm": 3}  # cpu_path_counts() slots of the backward


def _run_backward(case, dtype, layout="contiguous"):
    """Gradients of one case with 2 threads vs the float64 oracle; returns the counters' change."""
    name, B, Hq, Hkv, Nq, Nk, D, Dv, causal, build = case
    g = _gen("bwd", name, str(dtype), layout)
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, layout=layout, generator=g)
    if Dv != D:
        v = torch.randn(B, Hkv, Nk, Dv, generator=g).to(dtype)
    options = build(B, Hq, Nq, Nk, g) if build else {}
    out, lse = flash_metal.attention_with_lse(q, k, v, causal, None, "auto", **options)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    grad_lse = torch.where(torch.isfinite(lse), torch.randn(lse.shape, generator=g), 0.0)
    before = COUNTS()
    with threads(2):
        grads = torch.ops.flash_metal.attention_backward(grad_out, q, k, v, out, lse, causal, None, grad_lse, "auto",
                                                         **options)[:3]
    after = COUNTS()
    assert_gradients_close(grads, q, k, v, grad_out, causal, None, grad_lse, **options)
    return [x - y for x, y in zip(after, before)]


@pytest.mark.parametrize("path", ["vector", "brgemm"], indirect=True)
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=dtype_id)
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4], CASES[5], CASES[7]],
                         ids=[CASES[i][0] for i in (1, 3, 4, 5, 7)])
def test_forced_path_backward(path, dtype, case):
    """Gradients on each forced path vs the float64 oracle. Hkv = 1 cases (window, D_qk != D_v) with
    2 threads take the chunked decomposition (partial dK/dV per chunk), the others one item per kv head."""
    if path == "brgemm" and not HAS_BRGEMM:
        pytest.skip("this torch has no at::native::cpublas::brgemm")
    delta = _run_backward(case, dtype)
    assert delta[FWD_BWD[path]] == 1, "the backward did not run the forced path"
    assert INFO(dtype, True)[0] == path


def test_backward_auto_follows_the_forward(monkeypatch):
    """auto takes brgemm + VNNI for the 16-bit backward exactly where the dtype packs (could_pack), as
    the forward does, except the forward's float16 as bfloat16 pairs (brgemm_split.h), which the
    backward has not: there the float16 backward stays on the vector path."""
    monkeypatch.delenv("FLASH_METAL_CPU_PATH", raising=False)
    monkeypatch.delenv("FLASH_METAL_CPU_VNNI", raising=False)
    feats = dict(zip(*torch.ops.flash_metal.cpu_features()))
    split = feats["could_pack_bf16"] and not feats["could_pack_f16"]
    for dtype, key in ((torch.bfloat16, "could_pack_bf16"), (torch.float16, "could_pack_f16"), (torch.float32, None)):
        fwd, bwd = INFO(dtype, False), INFO(dtype, True)
        if not (split and dtype == torch.float16):
            assert (bwd.path, bwd.vnni) == (fwd.path, fwd.vnni), (fwd, bwd)
        assert bwd.path == ("brgemm" if key and feats[key] else "vector") and "backward" in bwd.reason, bwd


# --- emulated VNNI (FLASH_METAL_CPU_VNNI=emulate) ----------------------------------------------
# Odd D_qk / D_v (a zero pad column in K / V, a zero row in QT / dOT), odd Nq and Nk (zero rows
# in Q / dO / K, zero columns in P / dS), 1 to 3 key blocks of 96 (97 leaves a last block of one key;
# 221 three blocks), D_qk != D_v, GQA, masks, window + softcap.
EMU_CASES = [
    ("odd-d", 1, 2, 2, 67, 131, 33, 33, False, None),
    ("gqa-dqk-ne-dv", 1, 4, 2, 131, 97, 40, 25, True, None),
    ("bool-mask", 2, 2, 2, 45, 101, 63, 63, False, _mask_bool),
    ("window-softcap", 1, 2, 1, 99, 221, 47, 47, True, lambda *a: {"window_left": 37, "softcap": 5.0}),
    # Wider than one 64-column pack block (issue 39): D_qk 128 (two blocks), D_v 80 (64 + a ragged 16).
    ("d128-dv80", 1, 4, 2, 77, 109, 128, 80, True, None),
]
EMU_FWD_ONLY = [  # the forward's GQA-packed decode items and sinks
    ("decode-gqa", 2, 8, 2, 1, 197, 65, 65, False, None),
    ("sinks-causal", 1, 2, 2, 97, 97, 64, 64, True, _sinks),
]


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setenv("FLASH_METAL_CPU_PATH", "brgemm")
    monkeypatch.setenv("FLASH_METAL_CPU_VNNI", "emulate")


def _assert_emulated(delta, dtype, backward):
    slot, emu = (FWD_BWD["brgemm"], EMU_BWD) if backward else (FWD_BRGEMM, EMU_FWD)
    assert delta[slot] == 1 and delta[emu] == 1, f"the emulated VNNI path did not run: {delta}"
    assert delta[EMU_GEMM] > 0, f"no emulated tile product ran: {delta}"
    path, reason, vnni = INFO(dtype, backward)
    assert path == "brgemm" and vnni and "VNNI emulated" in reason, reason


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=dtype_id)
@pytest.mark.parametrize("case", EMU_CASES + EMU_FWD_ONLY, ids=[c[0] for c in EMU_CASES + EMU_FWD_ONLY])
def test_emulated_vnni_forward(emulated, dtype, case):
    before = COUNTS()
    _run_case(case, dtype)
    delta = [x - y for x, y in zip(COUNTS(), before)]
    _assert_emulated(delta, dtype, backward=False)
    # Query blocks of >= 32 columns take the column form (P as the packed B operand, V^T as A); the
    # decode item (1 query x 4 heads) keeps the row form (P^T, V packed per block).
    assert delta[FWD_COLS] == (0 if case[0] == "decode-gqa" else 1), delta
    # float16's column form splits into bfloat16 pairs wherever float16 itself does not pack (the
    # emulation mirrors a Xeon with AMX-BF16 and no AMX-FP16); the decode item runs float16's row form.
    split = dtype == torch.float16 and not dict(zip(*torch.ops.flash_metal.cpu_features()))["could_pack_f16"]
    assert delta[FWD_SPLIT] == (1 if split and case[0] != "decode-gqa" else 0), delta


@pytest.mark.parametrize("block_k", ["34", "96", "256"])
@pytest.mark.parametrize("case", EMU_CASES + EMU_FWD_ONLY[1:], ids=[c[0] for c in EMU_CASES + EMU_FWD_ONLY[1:]])
def test_emulated_column_form_block_sizes(emulated, monkeypatch, block_k, case):
    """The column form's key blocks (FLASH_METAL_CPU_MX_BLOCK_K): 34 leaves odd ragged blocks and many
    rescales, 256 one block for most cases; each must match the oracle."""
    monkeypatch.setenv("FLASH_METAL_CPU_MX_BLOCK_K", block_k)
    before = COUNTS()[FWD_COLS]
    _run_case(case, torch.bfloat16)
    assert COUNTS()[FWD_COLS] == before + 1


@pytest.mark.parametrize("bad", ["33", "30", "258", "x", "96k"])
def test_bad_column_block_is_a_clear_error(emulated, monkeypatch, bad):
    monkeypatch.setenv("FLASH_METAL_CPU_MX_BLOCK_K", bad)
    q = torch.randn(1, 2, 64, 32).to(torch.bfloat16)
    with pytest.raises(ValueError, match="FLASH_METAL_CPU_MX_BLOCK_K must be an even key count in \\[32, 256\\]"):
        flash_metal.attention(q, q, q)


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=dtype_id)
@pytest.mark.parametrize("case", EMU_CASES, ids=[c[0] for c in EMU_CASES])
def test_emulated_vnni_backward(emulated, dtype, case):
    _assert_emulated(_run_backward(case, dtype), dtype, backward=True)


@pytest.mark.parametrize("layout", ["every_other", "transposed"])
def test_emulated_vnni_strided(emulated, layout):
    """Feature stride 2 and (B, N, H, D) rows: every operand copied before its pack."""
    before = COUNTS()
    _run_case(EMU_CASES[0], torch.bfloat16, layout=layout)
    _assert_emulated([x - y for x, y in zip(COUNTS(), before)], torch.bfloat16, backward=False)
    _assert_emulated(_run_backward(EMU_CASES[1], torch.bfloat16, layout=layout), torch.bfloat16, backward=True)


def test_emulated_vnni_varlen(emulated):
    g = _gen("varlen-emulated")
    lq, lk = [5, 0, 130, 33], [40, 17, 130, 101]
    cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(lq), 4, 47, generator=g).to(torch.float16)
    k = torch.randn(sum(lk), 2, 47, generator=g).to(torch.float16)
    v = torch.randn(sum(lk), 2, 47, generator=g).to(torch.float16)
    before = COUNTS()
    out, lse = flash_metal.attention_varlen_with_lse(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True,
                                                     window_left=50)
    _assert_emulated([x - y for x, y in zip(COUNTS(), before)], torch.float16, backward=False)
    assert_varlen_close(out, lse, q, k, v, cu_q, cu_k, causal=True, window_left=50)
    grad_out = torch.randn(out.shape, generator=g).to(torch.float16)
    before = COUNTS()
    grads = torch.ops.flash_metal.attention_varlen_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max(lq),
                                                            max(lk), True, None, None, 50, -1)[:3]
    _assert_emulated([x - y for x, y in zip(COUNTS(), before)], torch.float16, backward=True)
    assert_varlen_gradients_close(grads, q, k, v, grad_out, cu_q, cu_k, True, None, window_left=50)


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=dtype_id)
@pytest.mark.parametrize("N", [37, 64, 150])
def test_emulated_pack_layout(dtype, N):
    """The emulated pack writes the documented blocked layout (blocked_vnni), on any CPU."""
    K = 6
    b = torch.randn(K, N).to(dtype)
    packed = torch.ops.flash_metal.cpu_vnni_pack(b, emulated=True)
    assert torch.equal(packed, blocked_vnni(b))
    with pytest.raises(ValueError, match="even row count"):
        torch.ops.flash_metal.cpu_vnni_pack(b[:5], emulated=True)


def test_auto_rule_through_the_vnni_switch(monkeypatch):
    """could_pack cannot be faked: the auto rule's other branches through FLASH_METAL_CPU_VNNI."""
    monkeypatch.delenv("FLASH_METAL_CPU_PATH", raising=False)
    monkeypatch.setenv("FLASH_METAL_CPU_VNNI", "emulate")  # as if the matrix units were there
    for dtype in HALF_TYPES:
        for backward in (False, True):
            path, reason, vnni = INFO(dtype, backward)
            assert (path, vnni) == ("brgemm", True) and "auto" in reason and "VNNI emulated" in reason, reason
    assert INFO(torch.float32, True)[:1] == ("vector",) and INFO(torch.float32, False)[:1] == ("vector",)
    monkeypatch.setenv("FLASH_METAL_CPU_VNNI", "off")  # never the matrix units: auto keeps vector
    for dtype in HALF_TYPES:
        for backward in (False, True):
            path, reason, vnni = INFO(dtype, backward)
            assert (path, vnni) == ("vector", False) and "FLASH_METAL_CPU_VNNI=off" in reason, reason
    monkeypatch.setenv("FLASH_METAL_CPU_PATH", "brgemm")  # forced brgemm without packing
    path, reason, vnni = INFO(torch.bfloat16, True)
    assert (path, vnni) == ("brgemm", False) and "non-VNNI" in reason, reason


def test_auto_with_emulation_runs_it(monkeypatch):
    """auto + emulate: forward and backward both take brgemm with emulated VNNI (the rule, end to end)."""
    monkeypatch.delenv("FLASH_METAL_CPU_PATH", raising=False)
    monkeypatch.setenv("FLASH_METAL_CPU_VNNI", "emulate")
    _assert_emulated(_run_backward(EMU_CASES[0], torch.bfloat16), torch.bfloat16, backward=True)


def test_bad_vnni_mode_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("FLASH_METAL_CPU_VNNI", "amx")
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="FLASH_METAL_CPU_VNNI='amx'.*'auto'.*'emulate'.*'off'"):
        flash_metal.attention(q, q, q)
