"""The 192-wide head-dim bucket (issue 20 section 3) through the emulator.

DeepSeek-V2/V3 and Kimi prefill and train at D_qk = 192; before this bucket
every D in 129..256 ran the 256-wide kernels zero-padded. Here: D 129..192
routes to the d192 kernels (prefill, decode, backward), 193..256 stays on
256, and D = 192, 160 and 136 (ragged: 160 and 136 leave padding columns in
the bucket) match the float64 oracle by the 2x rule (tests/numerics.py) in
all three dtypes, causal and not, forward and backward, each run proving the
d192 kernels did the work (the emulator's dispatched names, the plan's).
The sanitized runs of every d192 instantiation sit with the others'
(test_metal_prefill.py, test_metal_decode.py, test_metal_backward.py); the
model's before/after in test_metal_model.py.
"""
import pytest
import torch

import backends
import flash_metal
from backends import emulated_metal_attention, emulated_metal_attention_backward
from numerics import DTYPES, assert_attention_close, assert_gradients_close, dtype_id, make_qkv, make_tensor

DIMS = (192, 160, 136)


def _ran(bucket):
    """Kernel names of the last emulated call; every one of them the given bucket's."""
    names = [d.kernel_name for d, _ in backends.LAST_DISPATCHES]
    assert names and all(f"_d{bucket}" in n for n in names), names
    return names


def _explain(nq, nk, d, dtype, backward=False, impl="auto"):
    q = torch.empty(1, 2, nq, d, dtype=dtype)
    k = torch.empty(1, 1, nk, d, dtype=dtype)
    return flash_metal.explain(q, k, k, False, None, impl, backward=backward)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_head_dims_129_to_192_route_to_192_and_193_up_to_256(dtype):
    # Every family: prefill (Nq 45), decode (Nq 1, one pass and split) and
    # the backward's two kernels; 128 stays in 128.
    for d in (128, 129, 136, 160, 191, 192, 193, 200, 256):
        want = 128 if d <= 128 else 192 if d <= 192 else 256
        for plan in (_explain(45, 70, d, dtype), _explain(1, 70, d, dtype), _explain(1, 8192, d, dtype),
                     _explain(45, 70, d, dtype, backward=True)):
            assert all(f"_d{want}" in x.kernel_name for x in plan.dispatches), (d, plan.dispatches)
            assert ("zero-padded in the " + str(want) + "-wide" in plan.reason) == (d != want), (d, plan.reason)
    # One split decode plan among them (the 8192-key context on the base chip).
    assert len(_explain(1, 8192, 192, dtype).dispatches) == 2


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_forward_prefill_matches_float64(dtype, d, causal):
    # GQA 2:1, Nq and Nk ragged against every d192 block (16 and 32 rows, 8
    # and 16 keys), Nk < Nq under causal: rows that see no key.
    g = torch.Generator().manual_seed(d * 10 + causal)
    q, k, v = make_qkv(1, 2, 1, 45, 37, d, dtype, generator=g)
    out, lse = emulated_metal_attention(q, k, v, causal)
    assert_attention_close(out, lse, q, k, v, causal)
    (name,) = _ran(192)
    assert name.startswith("flash_attention_prefill_")


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_forward_decode_matches_float64(dtype, d):
    # One token and a speculative 3, GQA 4:1, one pass (short context) and
    # split-KV (forced), causal on the 3-row case.
    g = torch.Generator().manual_seed(d)
    for nq, nk, impl, causal in ((1, 90, "decode", False), (3, 300, "decode_split", True)):
        q, k, v = make_qkv(1, 4, 1, nq, nk, d, dtype, generator=g)
        out, lse = emulated_metal_attention(q, k, v, causal, None, impl)
        assert_attention_close(out, lse, q, k, v, causal)
        names = _ran(192)
        assert names[0].startswith("flash_decode_") and len(names) == (2 if impl == "decode_split" else 1)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_backward_matches_float64(dtype, d, causal):
    # dQ and dK/dV with a gradient into lse too, GQA 2:1, ragged lengths.
    g = torch.Generator().manual_seed(d * 10 + causal + 1)
    q, k, v = make_qkv(1, 2, 1, 37, 29, d, dtype, generator=g)
    out, lse = torch.ops.flash_metal.attention_forward(q, k, v, causal, None, "auto")
    grad_out = make_tensor(out.shape, "contiguous", dtype, g)
    grad_lse = torch.randn(lse.shape, generator=g)
    grads = emulated_metal_attention_backward(grad_out, q, k, v, out, lse, causal, None, grad_lse)
    assert_gradients_close(grads, q, k, v, grad_out, causal, None, grad_lse)
    dq, dkdv = _ran(192)
    assert dq.startswith("flash_backward_dq_") and dkdv.startswith("flash_backward_dkdv_")
