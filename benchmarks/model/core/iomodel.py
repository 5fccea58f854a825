"""The model's I/O model (FlashAttention-2) and useful FLOPs: Q read and O,
lse written once; K and V read once per query block, only up to the block's
last visible key under causal masking. The reports print it next to the
emulator's measured K/V bytes and their ratio.
"""
import re

import torch

from .counts import Shape, pack_group


def visible(row, s: Shape, causal):
    """Keys query row `row` sees (bottom-right causal alignment, attention_common.h)."""
    return min(max(row + s.nk - s.nq + 1, 0), s.nk) if causal else s.nk


def block_rows(impl, kernel):
    """Query rows that share one K/V stream in this kernel (its FA2 "query block")."""
    m = re.search(r"_bq(\d+)_", kernel) or re.search(r"_t(\d+)$", kernel)
    return int(m.group(1)) if m else None


def fa2_kv_bytes(s: Shape, elem, rows, causal, group=1):
    """FlashAttention-2's K (= V) bytes: each query block of `rows` rows of one
    query head reads the keys its last row sees, once. group = G > 1: pack GQA
    (fc_pack_gqa), each block of `rows` packed rows of one kv head (query row
    m // G of head m % G) reads the keys its last query row sees, once: G
    times less than unpacked when Nq * G <= rows, the same when Nq is a
    multiple of rows (and not causal)."""
    packed = s.nq * group
    per_head = sum(visible((min(p0 + rows, packed) - 1) // group, s, causal)
                   for p0 in range(0, packed, rows)) * s.d * elem
    return per_head * s.b * (s.hkv if group > 1 else s.hq)


def fa2_decode_kv_bytes(s: Shape, elem):
    """Decode: each (batch, kv head) reads its K (= V) once for all its query rows."""
    return s.b * s.hkv * s.nk * s.d * elem


def io_row(impl, s, dtype, causal, records):
    """(measured, model) bytes of K plus V read, summed over the call's dispatches. Decode: the bytes that reach
    DRAM (the emulator's bytes new to their threadgroup, "dram_"): a key group's row groups read the same keys,
    their loads of a line hits in the core's L1 (an assumption, issue 19). Else the bytes the loads ask for."""
    elem = torch.empty((), dtype=dtype).element_size()
    field = "dram_" if impl.startswith("decode") else "read_"
    measured = sum(r.counts.get(field + "k", 0) + r.counts.get(field + "v", 0) for r in records)
    if impl.startswith("decode"):
        model = 2 * fa2_decode_kv_bytes(s, elem)
    else:
        group = pack_group(impl, s, dtype, causal)
        model = 2 * fa2_kv_bytes(s, elem, block_rows(impl, records[0].kernel), causal, group)
    return measured, model


def useful_flops(s: Shape, causal):
    """4 * B * Hq * D * (visible query-key pairs): the two products' FLOPs."""
    pairs = sum(visible(r, s, causal) for r in range(s.nq))
    return 4 * s.b * s.hq * s.d * pairs
