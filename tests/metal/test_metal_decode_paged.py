"""The decode kernels reading a paged KV cache (fc_paged; issue 20, section 4).

K/V live in pages of a (num_blocks, page, Hkv, D) cache, addressed through
an int32 block_table (B, max_blocks), with each sequence's own key count
cache_seqlens[b] (shaders/common/attention_decode_paged.h). Every case runs through
the emulator's sanitizing build with the pages scattered and shuffled, every
table entry a sequence does not use poisoned with an out-of-range page id
and every cache row past a sequence's length filled with NaN: a kernel that
read either would trip the bounds checker or turn the output NaN. Outputs are
poisoned with NaN too, and compared with the float64 oracle (2x rule) and,
bit for bit, with the same kernel on the sequence's keys copied contiguous.
"""
import math
import struct

import pytest
import torch

import flash_metal
from backends import metal_library
from numerics import assert_attention_close

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
BUCKETS = [32, 64, 72, 80, 96, 128, 256]
BLOCK = 32  # keys per block of the decode kernels' softmax (kDecodeBlock)
PARAMS_BYTES = 328  # sizeof(AttentionParams), shaders/common/params.h
# Byte offsets in AttentionParams (shaders/common/params.h): k's and v's four
# strides, (kv_splits, split_keys), and (page_size, table_stride).
K_STRIDES, V_STRIDES, SPLIT_FIELDS, PAGE_FIELDS = 32, 64, 192, 312
PAGED = 12  # fc_paged (csrc/metal/plan.h, kPagedFunctionConstant)
# A table entry no sequence uses: a page id so far out of range (2^30 pages,
# terabytes past the cache, either way) that a read through it lands outside
# every buffer, where the sanitizer reports it (a small id such as -7 or
# num_blocks + 1000 could land inside another bound buffer and go unseen).
POISON = 1 << 30
TABLE, SEQLENS = 19, 20  # [[buffer(n)]] of block_table and cache_seqlens (csrc/metal/launch.cpp kSlot*)


def bucket_of(d):
    return min(b for b in BUCKETS if b >= d)


def make_paged_cache(B, Hkv, D, dtype, page, seqlens, g, spare_entries=2, spare_blocks=3):
    """A scattered, shuffled paged cache holding each sequence's keys, and the same keys contiguous.

    Returns (k_cache, v_cache, table, k_contig, v_contig): caches
    (num_blocks, page, Hkv, D) with every row not in use NaN; table int32
    (B, max_blocks) with the entries past each sequence's pages set to
    out-of-range ids (+-POISON); k_contig/v_contig (B, Hkv,
    capacity, D) with NaN past each length.
    """
    pages_of = [math.ceil(n / page) for n in seqlens]
    max_blocks = max(pages_of) + spare_entries
    num_blocks = sum(pages_of) + spare_blocks
    order = torch.randperm(num_blocks, generator=g)  # every page id, shuffled: sequences' pages interleave
    k_cache = torch.full((num_blocks, page, Hkv, D), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    cap = max_blocks * page
    k_contig = torch.full((B, Hkv, cap, D), float("nan"), dtype=dtype)
    v_contig = torch.full_like(k_contig, float("nan"))
    table = torch.empty((B, max_blocks), dtype=torch.int32)
    used = 0
    for b, n in enumerate(seqlens):
        for e in range(max_blocks):
            table[b, e] = int(order[used + e]) if e < pages_of[b] else (POISON if e % 2 else -POISON)
        used += pages_of[b]
        kb = torch.randn(n, Hkv, D, generator=g).to(dtype)
        vb = torch.randn(n, Hkv, D, generator=g).to(dtype)
        for r in range(n):
            k_cache[table[b, r // page], r % page] = kb[r]
            v_cache[table[b, r // page], r % page] = vb[r]
        k_contig[b, :, :n] = kb.transpose(0, 1)
        v_contig[b, :, :n] = vb.transpose(0, 1)
    return k_cache, v_cache, table, k_contig, v_contig


def _pack_strides(raw, offset, t):
    # t viewed as (blocks, Hkv, page, D): page stride, head stride, row stride, feature stride
    s = t.stride()
    struct.pack_into("<4q", raw, offset, s[0], s[2], s[1], s[3])


def launch_paged(q, k_cache, v_cache, table, seqlens, causal=False, splits=1, window_left=-1, dense=False,
                 lib=None, chunks=None, rgl=None, sinks=None):
    """The paged decode kernels launched directly (one pass, or the split pair); returns (out, lse, counts).

    Params and function constants come from the planner's own decode plan
    for the contiguous problem (B, Hkv, capacity, D), then the paging fields
    are set: k/v strides to the cache's (page stride as the batch stride),
    page_size, table_stride, fc_paged; block_table and cache_seqlens bound
    at 19 and 20. chunks, rgl: as test_metal_decode.decode_launch. sinks:
    (Hq,) float32, fc_has_sinks. Outputs poisoned with NaN.
    """
    from test_metal_decode import decode_launch, kernel_names, split_keys_of

    B, Hq, Nq, D = q.shape
    page, Hkv = k_cache.shape[1], k_cache.shape[2]
    cap = table.shape[1] * page
    shadow = torch.empty(B, Hkv, cap, D, dtype=q.dtype)
    plan = flash_metal.explain(q, shadow, shadow, causal, None, "decode", window_left=window_left)
    d0 = plan.dispatches[0]
    raw = bytearray(d0.params.numpy().tobytes())
    assert len(raw) == PARAMS_BYTES  # (an installed package older than shaders/common/params.h: reinstall)
    _pack_strides(raw, K_STRIDES, k_cache)
    _pack_strides(raw, V_STRIDES, v_cache)
    struct.pack_into("<2i", raw, SPLIT_FIELDS, splits, split_keys_of(cap, splits) if splits > 1 else cap)
    struct.pack_into("<2i", raw, PAGE_FIELDS, page, table.stride(0))
    params = torch.frombuffer(raw, dtype=torch.uint8)
    fcs = dict(enumerate(d0.function_constants))
    fcs[10] = dense
    fcs[PAGED] = True
    fcs[11] = sinks is not None  # fc_has_sinks
    seqlens32 = torch.tensor(seqlens, dtype=torch.int32)
    out = torch.full((B, Hq, Nq, D), float("nan"), dtype=q.dtype)
    lse = torch.full((B, Hq, Nq), float("nan"), dtype=torch.float32)
    lib = lib or metal_library(True)
    one, split, merge = kernel_names(q.dtype, bucket_of(D))
    shape = decode_launch(B, Hq, Hkv, Nq, bucket_of(D), splits, q.element_size(), chunks, rgl)
    paged = {1: k_cache, 2: v_cache, 14: q, 15: q, 16: q, 17: q if sinks is None else sinks, TABLE: table,
             SEQLENS: seqlens32}
    if splits == 1:
        grid, tg, mem = shape["one_pass"]
        c = lib.dispatch(one, buffers={0: q, 3: out, 4: lse, **paged}, bytes={5: params}, function_constants=fcs,
                         grid=grid, threadgroup=tg, threadgroup_memory={0: mem})
        return out, lse, [c]
    part_o = torch.full((B, Hq, Nq, splits, D), float("nan"), dtype=torch.float32)
    part_s = torch.full((B, Hq, Nq, splits, 2), float("nan"), dtype=torch.float32)
    grid, tg, mem = shape["split"]
    c1 = lib.dispatch(split, buffers={0: q, 6: part_o, 7: part_s, **paged}, bytes={5: params},
                      function_constants=fcs, grid=grid, threadgroup=tg, threadgroup_memory={0: mem})
    grid, tg, _ = shape["merge"]
    c2 = lib.dispatch(merge, buffers={3: out, 4: lse, 6: part_o, 7: part_s}, bytes={5: params}, grid=grid,
                      threadgroup=tg)
    return out, lse, [c1, c2]


def check_against_oracle(out, lse, q, k_contig, v_contig, seqlens, causal, window_left=-1, sinks=None):
    """Each sequence against the float64 oracle on its own keys (2x rule); an empty one is zeros and -inf
    (with sinks: zeros and lse = the sink)."""
    extra = {} if sinks is None else {"sinks": sinks}
    for b, n in enumerate(seqlens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])), b
            if sinks is None:
                assert bool((lse[b] == float("-inf")).all()), b
            else:  # the sink in base 2 and back (sink * log2 e * ln 2): within float32 rounding
                assert torch.allclose(lse[b], sinks[:, None].expand_as(lse[b]), rtol=1e-6, atol=1e-6), b
            continue
        assert_attention_close(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_contig[b:b + 1, :, :n],
                               v_contig[b:b + 1, :, :n], causal, window_left=window_left, **extra)


def launch_contiguous(q, k, v, causal, window_left=-1, dense=False):
    """The same kernel, not paged, on one sequence's keys (B = 1, contiguous): (out, lse)."""
    from test_metal_decode import launch_decode

    if window_left < 0:
        out, lse, _, _, _ = launch_decode(q, k, v, causal, instrumented=True, dense=dense)
        return out, lse
    # with a window: the planner's own one-pass plan, run as planned (fc_dense as the planner decides it)
    from backends import LAST_DISPATCHES, emulated_metal_attention

    out, lse = emulated_metal_attention(q, k, v, causal, None, "decode", instrumented=True, window_left=window_left)
    assert LAST_DISPATCHES[0][0].function_constants[10] == dense
    return out, lse


# (B, Hq, Hkv, Nq, D, dtype, page, seqlens, causal, splits, window_left, dense, spare_entries):
# page sizes 1, odd, 16 (vLLM's default) and 32; ragged lengths with 0, one key, a length that
# fills its table row (spare_entries 0), page boundaries inside the window and at the causal edge
# (length 37, page 5, Nq 3: the rows' causal edges end before keys 35, 36, 37, and key 35 starts a page);
# GQA 1, 2, 3 and MQA; one pass and split (blocks past a short sequence's end); every dtype.
CASES = [
    (3, 4, 2, 1, 64, torch.float16, 16, [37, 0, 64], False, 1, -1, True, 2),
    (3, 4, 2, 3, 64, torch.float16, 5, [37, 1, 70], True, 1, -1, False, 1),
    (2, 2, 1, 2, 32, torch.float32, 1, [9, 40], True, 3, -1, False, 0),
    (2, 6, 2, 1, 80, torch.bfloat16, 7, [50, 13], True, 2, 20, False, 2),
    (2, 3, 3, 4, 40, torch.float32, 32, [96, 33], True, 1, 9, False, 0),
    (3, 8, 1, 1, 128, torch.bfloat16, 16, [0, 100, 17], False, 2, -1, True, 1),
]


def _case_id(c):
    return f"{c[0]}x{c[1]}:{c[2]}-q{c[3]}-d{c[4]}-{DTYPE_NAMES[c[5]]}-p{c[6]}-{'c' if c[8] else 'n'}-s{c[9]}-w{c[10]}"


def _table_entries_read(seqlens, page, nq, causal, window_left):
    """Table entries in use by some visible key: one per page holding a key some query row sees."""
    total = 0
    for n in seqlens:
        if n == 0:
            continue
        lo = max(0, n - nq - window_left) if window_left >= 0 else 0
        hi = n  # causal: the last row sees up to the last key
        total += (hi - 1) // page - lo // page + 1 if hi > lo else 0
    return total


def check_pages_read_once(counts, k_cache, seqlens, page, nq, causal, window_left, readers, splits=1):
    """Each page in use reaches DRAM once per GQA group, no other page at all, and the table only where used.

    K/V (buffers 1, 2): unique bytes (the emulator's DRAM rule: new to the
    threadgroup within its L1 window) = the visible keys' rows of this kv
    head summed over sequences (every kv head's threadgroup reads its own
    slice); raw bytes = `readers` (row groups) times that. The table (19):
    every entry of a page read, 4 bytes, per kv head's threadgroup, at
    least once; at most once more per 32-key block and per split (an entry
    a block boundary cuts, read by two key groups, may fall out of the L1
    window between them): so a kernel reading every entry fails it. With
    pages of whole blocks and one split, exactly once (a kernel reading one
    entry past a sequence's last page fails that).
    cache_seqlens (20): one int per sequence, kv head and split at most.
    """
    hkv = k_cache.shape[2]
    row = hkv * k_cache.shape[3] * k_cache.element_size()  # all kv heads of one key
    keys, blocks = 0, 0
    for n in seqlens:
        lo = max(0, n - nq - window_left) if window_left >= 0 else 0
        keys += max(0, n - lo)
        blocks += (math.ceil(max(0, n - lo) / BLOCK) + 1) * splits if n > lo else 0
    unique, raw = counts.device_unique_bytes_read_by_index, counts.device_bytes_read_by_index
    for buf in (1, 2):
        assert unique.get(buf, 0) == keys * row, (buf, unique.get(buf, 0), keys * row)
        assert raw.get(buf, 0) == readers * keys * row, (buf, raw.get(buf, 0), readers, keys * row)
    entries = _table_entries_read(seqlens, page, nq, causal, window_left)
    assert 4 * hkv * entries <= unique.get(TABLE, 0) <= 4 * hkv * (entries + blocks), (unique.get(TABLE), entries)
    if page % BLOCK == 0 and splits == 1:  # no block shares a page entry with another: each entry read exactly once
        assert unique.get(TABLE, 0) == 4 * hkv * entries, (unique.get(TABLE), entries)
    assert 0 < unique.get(SEQLENS, 0) <= 4 * len(seqlens) * hkv * splits


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_paged_decode_equals_contiguous(case):
    B, Hq, Hkv, Nq, D, dtype, page, seqlens, causal, splits, wl, dense, spare = case
    g = torch.Generator().manual_seed(sum(seqlens) + page)
    k_cache, v_cache, table, k_contig, v_contig = make_paged_cache(B, Hkv, D, dtype, page, seqlens, g, spare)
    q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype)
    out, lse, counts = launch_paged(q, k_cache, v_cache, table, seqlens, causal, splits, wl, dense)
    check_against_oracle(out, lse, q, k_contig, v_contig, seqlens, causal, wl)
    # the paged path ran: it read the table and the lengths, and only the visible keys' pages
    from test_metal_decode import row_groups

    check_pages_read_once(counts[0], k_cache, seqlens, page, Nq, causal, wl, row_groups(Hq, Hkv, Nq, bucket_of(D)),
                          splits)
    if splits == 1:  # the same arithmetic in the same order as the contiguous kernel: equal bit for bit
        for b, n in enumerate(seqlens):
            if n:
                ko, kl = launch_contiguous(q[b:b + 1], k_contig[b:b + 1, :, :n].contiguous(),
                                           v_contig[b:b + 1, :, :n].contiguous(), causal, wl, dense)
                assert torch.equal(out[b:b + 1], ko) and torch.equal(lse[b:b + 1], kl), b


def test_cases_cover_the_edges():
    pages = {c[6] for c in CASES}
    assert {1, 16, 32} <= pages and any(p % 2 for p in pages if p > 1)
    assert any(0 in c[7] for c in CASES) and any(1 in c[7] for c in CASES)
    assert any(c[12] == 0 for c in CASES)  # some sequence fills its whole table row
    assert {1} < {c[9] for c in CASES} and {True, False} == {c[8] for c in CASES} == {c[11] for c in CASES}
    assert any(c[10] >= 0 for c in CASES) and set(DTYPE_NAMES) == {c[5] for c in CASES}
    # a page boundary at some row's causal edge, and one inside some sequence's window
    assert any(c[8] and c[3] > 1 and any((n - c[3] + i + 1) % c[6] == 0 for n in c[7] if n for i in range(c[3]))
               for c in CASES)
    assert any(c[10] >= 0 and any(any(k % c[6] == 0 for k in range(max(1, n - c[3] - c[10] + 1), n)) for n in c[7])
               for c in CASES)


def test_read_once_check_catches_extra_reads():
    # Planted: (a) two row chunks where one threadgroup would do (each reads
    # the pages again: raw and unique bytes doubled); (b) counts of a kernel
    # reading every table entry (unused ones included), (c) one reading a page
    # not in use, (d) one reading K twice per SIMD-group. All fail the check.
    import dataclasses

    g = torch.Generator().manual_seed(5)
    seqlens, page = [37, 20], 8
    k_cache, v_cache, table, _, _ = make_paged_cache(2, 2, 64, torch.float16, page, seqlens, g)
    q = torch.randn(2, 4, 1, 64, generator=g).to(torch.float16)
    _, _, counts = launch_paged(q, k_cache, v_cache, table, seqlens)
    c = counts[0]
    check_pages_read_once(c, k_cache, seqlens, page, 1, False, -1, 1)
    _, _, two = launch_paged(q, k_cache, v_cache, table, seqlens, chunks=2, rgl=1)
    with pytest.raises(AssertionError):
        check_pages_read_once(two[0], k_cache, seqlens, page, 1, False, -1, 1)
    u, r = c.device_unique_bytes_read_by_index, c.device_bytes_read_by_index
    page_bytes = page * 2 * 64 * 2
    for planted in (dataclasses.replace(c, device_unique_bytes_read_by_index={**u, TABLE: 4 * table.numel()}),
                    dataclasses.replace(c, device_unique_bytes_read_by_index={**u, 1: u[1] + page_bytes},
                                        device_bytes_read_by_index={**r, 1: r[1] + page_bytes}),
                    dataclasses.replace(c, device_bytes_read_by_index={**r, 1: 2 * r[1]})):
        with pytest.raises(AssertionError):
            check_pages_read_once(planted, k_cache, seqlens, page, 1, False, -1, 1)


def test_poisoned_entry_in_use_trips_the_bounds_checker():
    # The poison proves itself: the same table with one entry a sequence
    # does use set to an out-of-range page id makes the sanitizing build
    # report an out-of-bounds read, so the passing cases' poisoned unused
    # entries were never read.
    from metal_emulator import EmulatorError

    g = torch.Generator().manual_seed(6)
    seqlens, page = [37, 20], 8
    k_cache, v_cache, table, _, _ = make_paged_cache(2, 2, 64, torch.float16, page, seqlens, g)
    q = torch.randn(2, 4, 1, 64, generator=g).to(torch.float16)
    launch_paged(q, k_cache, v_cache, table, seqlens)
    table[1, 2] = POISON  # sequence 1's third page (keys 16..19)
    with pytest.raises(EmulatorError, match="(?i)out.of.bounds|bounds"):
        launch_paged(q, k_cache, v_cache, table, seqlens)


@pytest.mark.parametrize("case", [CASES[1], CASES[5]], ids=_case_id)
def test_paged_decode_with_sinks(case):
    # gpt-oss's sinks through the paged kernels: counted once (key group 0,
    # split 0) whatever the pages; an empty sequence attends to its sink only.
    B, Hq, Hkv, Nq, D, dtype, page, seqlens, causal, splits, wl, dense, spare = case
    g = torch.Generator().manual_seed(7 + page)
    k_cache, v_cache, table, k_contig, v_contig = make_paged_cache(B, Hkv, D, dtype, page, seqlens, g, spare)
    q = torch.randn(B, Hq, Nq, D, generator=g).to(dtype)
    sinks = torch.randn(Hq, generator=g)
    out, lse, _ = launch_paged(q, k_cache, v_cache, table, seqlens, causal, splits, wl, dense, sinks=sinks)
    check_against_oracle(out, lse, q, k_contig, v_contig, seqlens, causal, wl, sinks)
