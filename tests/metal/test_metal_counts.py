"""The post's two attention kernels do the memory traffic and work the
performance model (issue 9) assumes, counted by the Metal emulator.

Each launch comes from the host's own plan (flash_metal.explain), run
through tests/backends.py's emulated backend; the sanitizing build counts every device and
threadgroup byte exactly (tests/metal_emulator/README.md, "Counters"). The
expected values are derived here from the kernel sources
(shaders/post/attention_tiled.h, attention_untiled.h, attention_common.h):

- one query row per thread, THREADS = 32 rows per threadgroup, grid
  (ceil(Nq / 32), Hq, B);
- each row loads its query row once (D elements) and stores D output elements
  and one float lse;
- untiled: each row reads the D elements of K and of V of every key it sees
  from device memory;
- tiled: the group loads tiles of BK = 16 keys cooperatively, each real
  element once per group, for the tiles up to the group's last row's visible
  keys (a partial last tile loads only keys < Nk); two threadgroup barriers
  per tile; each row reads every key of a tile it sees as a DMAX-wide row
  (padding included) of K and of V from threadgroup memory;
- OnlineSoftmax.update calls exp2 twice per unmasked key (alpha and weight).
The params struct (bytes=) is read from constant memory as often as the
-O1 emulator build reloads it; no model term depends on it, so it is not
checked.
"""
import math

import pytest
import torch

from backends import LAST_DISPATCHES, emulated_metal_attention
from numerics import dtype_id

THREADS = 32  # query rows per threadgroup (the post's _t32 instantiations)
BK = 16  # keys per tile (_bk16)
# Ragged on purpose: Nq not a multiple of 32, Nk not a multiple of 16, D = 63
# runs in the 64 bucket; GQA (2 query heads on 1 kv head).
B, HQ, HKV, NQ, NK, D, DMAX = 1, 2, 1, 45, 70, 63, 64


def visible(row: int, causal: bool) -> int:
    """attention_common.h visible_keys: bottom-right causal alignment."""
    return min(max(row + (NK - NQ) + 1, 0), NK) if causal else NK


def run(dtype, causal, impl, instrumented=True):
    torch.manual_seed(0)
    q = torch.randn(B, HQ, NQ, D, dtype=dtype)
    k = torch.randn(B, HKV, NK, D, dtype=dtype)
    v = torch.randn(B, HKV, NK, D, dtype=dtype)
    out, lse = emulated_metal_attention(q, k, v, causal, None, impl, instrumented=instrumented)
    ((d, counts),) = LAST_DISPATCHES
    assert d.kernel_name.startswith(f"flash_attention_{impl}_") and f"_d{DMAX}_" in d.kernel_name
    assert not out.isnan().any() and not lse.isnan().any()
    return d, counts


def by_tensor(d, per_index):
    return {name: per_index[index] for name, index in d.buffers.items()}


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("impl", ["untiled", "tiled"])
def test_attention_counts(impl, dtype, causal):
    d, c = run(dtype, causal, impl)
    elem = torch.empty((), dtype=dtype).element_size()
    blocks = math.ceil(NQ / THREADS)
    rows = range(NQ)
    seen = sum(visible(r, causal) for r in rows)  # (row, key) pairs of one head
    assert d.grid == (blocks, HQ, B) and d.threadgroup == (THREADS, 1, 1)
    assert (c.threadgroups, c.threads) == (blocks * HQ * B, blocks * HQ * B * THREADS)
    if impl == "untiled":
        kv = seen * D * elem
        tiles = [0] * blocks
    else:
        # tiles walked per block: up to the keys its last row sees
        walked = [visible(min((b + 1) * THREADS, NQ) - 1, causal) for b in range(blocks)]
        tiles = [math.ceil(w / BK) for w in walked]
        kv = sum(min(t * BK, NK) for t in tiles) * D * elem
    heads = HQ * B  # every query head reads its kv head's K and V itself
    assert by_tensor(d, c.device_bytes_read_by_index) == {
        "q": heads * NQ * D * elem, "k": heads * kv, "v": heads * kv, "out": 0, "lse": 0}
    assert by_tensor(d, c.device_bytes_written_by_index) == {
        "q": 0, "k": 0, "v": 0, "out": heads * NQ * D * elem, "lse": heads * NQ * 4}
    assert c.exp2_calls == heads * 2 * seen
    assert c.threadgroup_barriers == heads * 2 * sum(tiles)
    assert (c.simdgroup_barriers, c.simdgroup_mmas, c.simdgroup_loads, c.simdgroup_stores) == (0, 0, 0, 0)
    if impl == "untiled":
        assert (c.threadgroup_bytes_read, c.threadgroup_bytes_written) == (0, 0)
    else:
        # writes: the padding columns [D, DMAX) of both tiles once, then BK x D
        # elements of both tiles per tile walked (keys past Nk as zeros)
        pad = 2 * BK * (DMAX - D)
        assert c.threadgroup_bytes_written == heads * sum(pad + t * 2 * BK * D for t in tiles) * elem
        # reads: a DMAX-wide row of K and of V for every (row, key) seen
        assert c.threadgroup_bytes_read == heads * seen * 2 * DMAX * elem


def test_tiled_saves_the_model_factor():
    """Tiled reads K and V once per 32-row block, untiled once per row."""
    du, cu = run(torch.float16, False, "untiled")
    dt, ct = run(torch.float16, False, "tiled")
    ku, kt = by_tensor(du, cu.device_bytes_read_by_index)["k"], by_tensor(dt, ct.device_bytes_read_by_index)["k"]
    assert ku * math.ceil(NQ / THREADS) == kt * NQ


def test_fast_build_counts_the_same_events():
    d, fast = run(torch.float32, False, "tiled", instrumented=False)
    _, inst = run(torch.float32, False, "tiled", instrumented=True)
    assert fast.device_bytes_read is None and fast.threadgroup_bytes_read is None
    for field in ("threadgroups", "threads", "threadgroup_barriers", "exp2_calls", "simdgroup_mmas"):
        assert getattr(fast, field) == getattr(inst, field), field
