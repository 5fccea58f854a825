"""The executed MPS host (csrc/mps/attention_mps.mm) on a quantized KV cache (issue 44).

attention_kvcache on fake MPS tensors through the real .mm (tests/mps_exec:
recording fakes of Metal), replayed into the emulator's quantized-decode
build: the host binds what the plan says (the codes at 1 and 2, the scales
and biases at 21-24, KvQuantParams with setBytes at 25) and the replayed
kernels meet the float64 oracle over the dequantized cache by the 2x rule.
"""
import pytest
import torch

import flash_metal
from backends import quant_decode_library
from kvq_cases import Case
from mps_exec.fixtures import built, emu, host  # noqa: F401  (pytest fixtures, by name)
from numerics import assert_attention_close


@pytest.mark.parametrize("impl", ["decode", "decode_split"])
def test_host_reads_a_quantized_cache(host, impl):
    case = Case(2, 4, 2, 1, 64, "int8", "q4", [37, 64], 16, torch.float16, seed=5, group_size=32)
    k, v = case.sides["k"], case.sides["v"]
    quant = dict(k_scale=k[2], v_scale=v[2], v_bias=v[3])
    (out, lse), rec = host.call("attention_kvcache", case.q, k[1], v[1], case.lens, case.table, True, None, -1, -1,
                                0.0, None, impl, library=quant_decode_library(False, "float16_d64"), **quant)
    assert rec["errors"] == []
    for b in range(2):
        kr, vr = case.reference_kv(b)
        assert_attention_close(out[b:b + 1], lse[b:b + 1], case.q[b:b + 1], kr, vr, True)
    plan = flash_metal.explain(case.q, k[1], v[1], True, None, impl, block_table=case.table,
                               cache_seqlens=case.lens, **quant)
    state = [e["kernel"] for e in rec["events"] if e["op"] == "setComputePipelineState"]
    assert state == [d.kernel_name for d in plan.dispatches]
    assert state[0] == ("flash_decode_quant_split_float16_d64" if impl == "decode_split" else
                        "flash_decode_quant_float16_d64")
    bound = {e["index"] for e in rec["events"] if e["op"] == "setBuffer"}
    assert {19, 20, 21, 22, 23, 24} <= bound
    constants = [e["index"] for e in rec["events"] if e["op"] == "setBytes"]
    assert 25 in constants and 5 in constants
