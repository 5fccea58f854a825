"""Where a KV cache keeps each sequence's keys, for flash_attn_with_kvcache
and the paged flash_attn_varlen_func (flash-attn's conventions).

A cache is addressed through a table: key j of batch b is row j % page of
block table[b, j // page]. A paged cache (num_blocks, page, H, D) has
block_table (B, max_blocks) as its table; a plain cache (B_cache, S, H, D)
is the special case page = S, table[b] = [cache_batch_idx[b]] (b without
cache_batch_idx). Appends write through the table in place; reads gather
only the rows in use, so pages and table entries past a sequence's length
are never touched (they may hold anything, NaN included).

The gather copies the rows in use into one packed (total, H, D) buffer that
the varlen op reads: O(N) memory, one extra pass over the keys. It serves
cache_leftpad; flash_attn_with_kvcache otherwise, and the paged
flash_attn_varlen_func (with its packed queries), call attention_kvcache,
whose Metal decode and prefill kernels read through the table themselves (csrc/kvcache.cpp gathers by the same rule
elsewhere).
"""
from typing import Optional, Tuple, Union

import torch
from torch import Tensor


def _err(what: str, msg: str) -> ValueError:
    return ValueError(f"flash_metal.{what}: {msg}")


def int_vector(value: Union[int, Tensor, None], name: str, batch: int, device, what: str,
               default: Optional[int] = None) -> Optional[Tensor]:
    """An int or a (batch,) integer tensor as int64 on `device`; None stays None unless a default is given."""
    if value is None:
        return None if default is None else torch.full((batch,), default, dtype=torch.int64, device=device)
    if isinstance(value, int):
        return torch.full((batch,), value, dtype=torch.int64, device=device)
    if not isinstance(value, Tensor) or value.dtype not in (torch.int32, torch.int64) or value.shape != (batch,):
        got = f"{value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)
        raise _err(what, f"{name} must be an int32 tensor of shape ({batch},) (one entry per batch); got {got}")
    return value.to(device=device, dtype=torch.int64)


def table_of(k_cache: Tensor, v_cache: Tensor, batch: int, block_table: Optional[Tensor],
             cache_batch_idx: Optional[Tensor], what: str) -> Tuple[Tensor, int, int]:
    """(table (batch, blocks) int64, page, capacity in keys per sequence) of the cache."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise _err(what, f"{name} must be 4-D ({'num_blocks, page_size' if block_table is not None else 'batch, seqlen'}"
                             f", heads, head_dim); got shape {tuple(t.shape)}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        dims = "(num_blocks, page_size, heads)" if block_table is not None else "(batch, seqlen, heads)"
        raise _err(what, f"k_cache and v_cache must agree in {dims}; got {tuple(k_cache.shape[:3])} and "
                         f"{tuple(v_cache.shape[:3])}")
    device = k_cache.device
    if block_table is not None:
        if cache_batch_idx is not None:
            raise _err(what, "cache_batch_idx cannot be combined with block_table (as in flash-attn): give each "
                             "batch its own row of block_table instead")
        if not isinstance(block_table, Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
                or block_table.shape[0] != batch:
            got = (f"{block_table.dtype} tensor of shape {tuple(block_table.shape)}" if isinstance(block_table, Tensor)
                   else repr(block_table))
            raise _err(what, f"block_table must be an int32 tensor of shape ({batch}, max_blocks_per_seq); got {got}")
        if block_table.device != device:
            raise _err(what, f"block_table must be on k_cache's device ({device}); got {block_table.device}")
        page = k_cache.shape[1]
        if page < 1:
            raise _err(what, "k_cache's page_size (dim 1) must be at least 1; got 0")
        return block_table.to(torch.int64), page, block_table.shape[1] * page
    rows = k_cache.shape[0]
    idx = int_vector(cache_batch_idx, "cache_batch_idx", batch, device, what)
    if idx is None:
        if rows < batch:
            raise _err(what, f"k_cache holds {rows} sequences but q has batch {batch}; give cache_batch_idx to pick "
                             f"the cache rows")
        idx = torch.arange(batch, device=device)
    elif batch and bool(((idx < 0) | (idx >= rows)).any()):
        b = int(((idx < 0) | (idx >= rows)).nonzero()[0, 0])
        raise _err(what, f"cache_batch_idx[{b}] = {int(idx[b])} is out of range for k_cache's {rows} sequences")
    return idx[:, None], k_cache.shape[1], k_cache.shape[1]


def check_entries(table: Tensor, page: int, ends: Tensor, num_blocks: int, what: str) -> None:
    """Every table entry a sequence uses (its first ceil(end / page)) names a block of the cache."""
    if table.numel() == 0:
        return
    used = torch.arange(table.shape[1], device=table.device)[None, :] < ((ends + page - 1) // page)[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bool(bad.any()):
        b, e = (int(x) for x in bad.nonzero()[0])
        raise _err(what, f"block_table[{b}, {e}] = {int(table[b, e])} is out of range: entries in use must name "
                         f"one of k_cache's {num_blocks} blocks, 0 .. {num_blocks - 1}")


def _locate(table: Tensor, page: int, b_of: Tensor, j: Tensor) -> Tuple[Tensor, Tensor]:
    return table[b_of, j // page], j % page


def append(cache: Tensor, new: Tensor, table: Tensor, page: int, at: Tensor) -> None:
    """Write new (B, S_new, H, D) in place at keys at[b] .. at[b] + S_new - 1 of each batch."""
    batch, s_new = new.shape[0], new.shape[1]
    if batch * s_new == 0:
        return
    b_of = torch.arange(batch, device=cache.device).repeat_interleave(s_new)
    j = at[b_of] + torch.arange(s_new, device=cache.device).repeat(batch)
    blk, off = _locate(table, page, b_of, j)
    cache.index_put_((blk, off), new.reshape(batch * s_new, *new.shape[2:]).to(cache.dtype))


def rows_in_use(table: Tensor, page: int, starts: Tensor, ends: Tensor) -> Tuple[Tensor, Tensor]:
    """(block, row) of keys starts[b] .. ends[b] - 1 of every batch, in batch order (sum of lengths each)."""
    lengths = ends - starts
    b_of = torch.arange(lengths.shape[0], device=table.device).repeat_interleave(lengths)
    first = torch.cumsum(lengths, 0) - lengths
    j = torch.arange(b_of.shape[0], device=table.device) + (starts - first)[b_of]
    return _locate(table, page, b_of, j)


def gather(cache: Tensor, rows: Tuple[Tensor, Tensor]) -> Tensor:
    """The cache's rows (rows_in_use), packed: (sum of lengths, H, D)."""
    blk, off = rows
    if cache.numel() and cache.stride(0) == cache.shape[1] * cache.stride(1):
        # Blocks and rows merge into one dim (a view): index_select copies
        # whole rows, several times faster than indexing two dims.
        return cache.view(-1, *cache.shape[2:]).index_select(0, blk * cache.shape[1] + off)
    return cache[blk, off]


def cumulative(lengths: Tensor) -> Tensor:
    """int32 cu_seqlens (B + 1,) of lengths."""
    return torch.cat((lengths.new_zeros(1), torch.cumsum(lengths, 0))).to(torch.int32)
