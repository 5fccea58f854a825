"""torch.library.opcheck: schema, fake kernel, and dispatcher registrations agree."""
import pytest
import torch

from numerics import DTYPES, dtype_id, make_qkv



SAMPLES = [
    # (B, Hq, Hkv, Nq, Nk, D, layout, causal, scale)
    (1, 2, 2, 17, 33, 32, "contiguous", False, None),
    (2, 4, 1, 9, 9, 64, "transposed", True, 0.3),
    (1, 4, 2, 40, 7, 80, "offset_slice", True, None),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("sample", SAMPLES, ids=["mha", "mqa-transposed", "gqa-slice-causal"])
def test_opcheck_attention_forward(dtype, sample):
    B, Hq, Hkv, Nq, Nk, D, layout, causal, scale = sample
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype, layout=layout)
    # No input requires grad here; test_backward.py runs opcheck's
    # test_autograd_registration with inputs that do.
    torch.library.opcheck(
        torch.ops.flash_metal.attention_forward.default,
        (q, k, v, causal, scale, "auto"),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic"),
    )


def test_fake_kernel_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 5, 64, dtype=torch.bfloat16)
        k = torch.empty(2, 2, 11, 64, dtype=torch.bfloat16)
        out, lse = torch.ops.flash_metal.attention_forward(q, k, k, True)
    assert out.shape == (2, 8, 5, 64) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 8, 5) and lse.dtype == torch.float32
