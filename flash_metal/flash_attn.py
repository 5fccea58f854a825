"""flash-attn 2.8's Python API on flash_metal: change one import.

    from flash_metal import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

Same signatures, (batch, seqlen, heads, head_dim) layout and semantics as
flash_attn.flash_attn_interface: bottom-right causal, window_size =
(left, right) with -1 unbounded, softcap, GQA, return_attn_probs giving the
log-sum-exp. v (and v_cache) may have a head dim of its own, D_v, as in
flash-attn 3 (hdim_v; MLA's 192/128 and 576/512): out then has D_v (CPU
and Metal, forward and backward; on Metal, dims above 256 run the composite
path). Paged KV caches (block_table, any page size), cache_batch_idx and cache_leftpad work as in flash-attn; `sinks`
(gpt-oss's attention sinks, the s_aux / learnable_sink of vLLM's and
flash-attn 4's kernels) is a flash_metal extension on all three functions.
What flash_metal does not implement raises a ValueError naming
the argument: dropout, alibi_slopes, rotary embedding. (The third value of
return_attn_probs, flash-attn's debugging S_dmask, is None.) Deterministic always.
"""
import contextlib
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _kvcache, ops, quantized_kv


def _unsupported(name: str, value, what: str) -> None:
    if value is not None and value is not False and not (isinstance(value, float) and value == 0.0):
        raise ValueError(f"flash_metal.{what}: {name} is not supported by flash_metal (got {_short(value)}); "
                         f"leave it at its default")


def _short(value):
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)


def _window(window_size: Sequence[int], what: str) -> Tuple[int, int]:
    if len(window_size) != 2:
        raise ValueError(f"flash_metal.{what}: window_size must be (left, right); got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _dropout(dropout_p: float, what: str) -> None:
    if dropout_p != 0.0:
        raise ValueError(f"flash_metal.{what}: dropout_p must be 0.0 (flash_metal has no dropout); got {dropout_p}")


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False,
                    sinks: Optional[Tensor] = None) -> Union[Tensor, Tuple[Tensor, Tensor, None]]:
    """flash-attn's flash_attn_func: q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D).

    sinks (Hq,): attention sinks, as in flash_metal.attention (a flash_metal extension; differentiable).

    Returns out (B, Sq, Hq, D), or with return_attn_probs (out, lse (B, Hq, Sq), None).
    """
    what = "flash_attn_func"
    _dropout(dropout_p, what)
    _unsupported("alibi_slopes", alibi_slopes, what)
    left, right = _window(window_size, what)
    # (B, S, H, D) -> (B, H, S, D): views, read in place through their strides.
    out, lse = ops.attention_with_lse(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal,
                                      softmax_scale, window_left=left, window_right=right, softcap=softcap,
                                      sinks=sinks)
    out = out.transpose(1, 2).contiguous()  # flash-attn returns (B, Sq, Hq, D) contiguous
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Optional[Tensor] = None,
                           sinks: Optional[Tensor] = None):
    """flash-attn's flash_attn_varlen_func: q (total_q, Hq, D), k and v (total_k, Hkv, D), int32 cu_seqlens.

    Paged (flash-attn >= 2.6): with block_table (B, max_blocks) int32, k and v
    are caches (num_blocks, page_size, Hkv, D) and sequence b's j-th key is
    row j % page_size of block block_table[b, j // page_size]; cu_seqlens_k
    still gives the key counts; causal and the window are bottom-right
    aligned to each sequence's own lengths. Only the pages in use are read:
    on Metal the prefill kernel takes the packed queries (cu_seqlens_q) and
    reads K/V through the table, nothing copied (head dims past 256: the
    rows in use are gathered into one packed buffer first); on CPU they are
    always gathered (O(total keys) memory) for the varlen kernel. When a
    gradient is wanted (grad mode on and q, k, v or sinks requiring it) the
    pages in use are gathered on every device, so the backward runs as for
    packed K/V. sinks (Hq,): attention sinks (a flash_metal extension).
    Returns out (total_q, Hq, D), or with return_attn_probs (out, lse (Hq, total_q), None).
    """
    what = "flash_attn_varlen_func"
    _dropout(dropout_p, what)
    _unsupported("alibi_slopes", alibi_slopes, what)
    left, right = _window(window_size, what)
    if block_table is not None:
        if not isinstance(cu_seqlens_k, Tensor) or cu_seqlens_k.dim() != 1 or cu_seqlens_k.numel() < 1:
            raise ValueError(f"flash_metal.{what}: cu_seqlens_k must be a 1-D int32 tensor (B + 1,); got "
                             f"{_short(cu_seqlens_k)}")
        batch = cu_seqlens_k.numel() - 1
        table, page, capacity = _kvcache.table_of(k, v, batch, block_table, None, what)
        ends = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(device=k.device, dtype=torch.int64)
        if batch and bool((ends < 0).any()):
            raise ValueError(f"flash_metal.{what}: cu_seqlens_k must be non-decreasing; got {cu_seqlens_k.tolist()}")
        if batch and bool((ends > capacity).any()):
            raise ValueError(f"flash_metal.{what}: a sequence of {int(ends.max())} keys (cu_seqlens_k) exceeds the "
                             f"block table's capacity of {capacity} keys (max_blocks_per_seq * page_size)")
        _kvcache.check_entries(table, page, ends, k.shape[0], what)
        # attention_kvcache with packed queries: on Metal the prefill kernel
        # reads the pages in use through the table (nothing gathered); on CPU
        # the op gathers them for the varlen kernel, as it does for
        # flash_attn_with_kvcache. When a gradient is wanted (q, the caches or
        # sinks requiring grad) the wrapper gathers them as a differentiable
        # copy for the varlen op, whose backward reaches all four.
        out, lse = ops.attention_kvcache_with_lse(q, k, v, ends.to(torch.int32), block_table, causal, softmax_scale,
                                                  left, right, softcap, sinks, cu_seqlens_q=cu_seqlens_q,
                                                  max_seqlen_q=int(max_seqlen_q))
        return (out, lse, None) if return_attn_probs else out
    out, lse = ops.attention_varlen_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                             int(max_seqlen_k), causal, softmax_scale, left, right, softcap,
                                             sinks=sinks)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                            v: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None,
                            rotary_sin: Optional[Tensor] = None,
                            cache_seqlens: Optional[Union[int, Tensor]] = None,
                            cache_batch_idx: Optional[Tensor] = None, cache_leftpad: Optional[Tensor] = None,
                            block_table: Optional[Tensor] = None, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Optional[Tensor] = None,
                            num_splits: int = 0, return_softmax_lse: bool = False, sinks: Optional[Tensor] = None,
                            k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None,
                            k_bias: Optional[Tensor] = None, v_bias: Optional[Tensor] = None,
                            k_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None):
    """flash-attn's flash_attn_with_kvcache: attention of q against a KV cache, appending k/v first.

    Quantized caches (issue 44; layouts in flash_metal.quantized_kv), K and V
    each in its own format: int8 k_cache / v_cache with k_scale / v_scale
    float32 (B, Nk, Hkv); float8_e4m3fn with k_descale / v_descale float32
    (B, Hkv) or one element (flash-attn 3's names); 4-bit uint32 (B, Nk, Hkv,
    D / 8) in MLX's packing (or uint8 (..., D / 2)) with k_scale, k_bias,
    v_scale, v_bias (B, Nk, Hkv, D / group_size), the group size inferred.
    Appended k / v are quantized on the way in (fp8: with the cache's
    descale). Read in place by the CPU kernel (nothing dequantized); no
    cache_leftpad, no backward.

    q (B, Sq, Hq, D). The cache is either plain, k_cache and v_cache
    (B_cache, S_cache, Hkv, D) with cache_batch_idx (B,) picking batch b's
    row (default b), or paged: (num_blocks, page_size, Hkv, D) with
    block_table (B, max_blocks) int32, key j of batch b living at row
    j % page_size of block block_table[b, j // page_size]; any page size from
    1, pages in any order. With k and v (B, S_new, Hkv, D), they are written
    into the cache in place at keys cache_seqlens[b] .. cache_seqlens[b] +
    S_new - 1 first (across page boundaries). Batch b then attends to keys
    cache_leftpad[b] (default 0) .. cache_seqlens[b] (+ S_new) - 1, and never
    reads the others, nor table entries past them (they may hold anything,
    NaN included); causal and the window are bottom-right aligned to that
    range (flash-attn's semantics). cache_seqlens: an int or an int32 (B,)
    tensor (None: the whole cache, or the whole table, is valid, and nothing
    can be appended). sinks (Hq,): attention sinks, as in
    flash_metal.attention (a flash_metal extension).
    Returns out (B, Sq, Hq, D_v), and lse (B, Hq, Sq) with return_softmax_lse.
    num_splits is a hint only. Differentiable in q, the caches and sinks when
    a gradient is wanted (grad mode on and one of them requiring it; a
    flash_metal extension, flash-attn's has no backward): the paths below
    then run their differentiable form (paged: the rows in use gathered); the
    appended k and v are written without one. A plain cache
    without cache_seqlens and cache_leftpad is read in place by the dense op
    (on Metal the routing may pick the split-KV decode). A paged cache, or
    cache_batch_idx (a table of one page per sequence), without
    cache_leftpad goes to attention_kvcache_with_lse: on Metal the decode
    kernels (Sq <= 8) or the prefill kernel (longer q) read K/V through the
    table, nothing copied (head dims past 256: gathered); on CPU the rows in
    use are gathered into one packed buffer (O(N) memory) for the varlen
    kernels. So does a plain cache with cache_seqlens on Metal; on CPU a
    plain cache is read in place by the varlen op, and with cache_leftpad a
    paged one is gathered.
    """
    what = "flash_attn_with_kvcache"
    _unsupported("rotary_cos", rotary_cos, what)
    _unsupported("rotary_sin", rotary_sin, what)
    _unsupported("alibi_slopes", alibi_slopes, what)
    left, right = _window(window_size, what)
    if (k is None) != (v is None):
        raise ValueError(f"flash_metal.{what}: give both k and v (new keys and values to append) or neither")
    if q.dim() != 4:
        raise ValueError(f"flash_metal.{what}: q must be 4-D (batch, seqlen, heads, head_dim); got shape "
                         f"{tuple(q.shape)}")
    if any(x is not None for x in (k_scale, v_scale, k_bias, v_bias, k_descale, v_descale)) or \
            quantized_kv.format_of(k_cache) != "native" or quantized_kv.format_of(v_cache) != "native":
        if (k is None) != (v is None):
            raise ValueError(f"flash_metal.{what}: give both k and v (new keys and values to append) or neither")
        return quantized_kv.with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
                                         block_table, softmax_scale, causal, left, right, softcap,
                                         return_softmax_lse, sinks, k_scale, v_scale, k_bias, v_bias, k_descale,
                                         v_descale)
    B, sq, hq = q.shape[0], q.shape[1], q.shape[2]
    device = k_cache.device
    table, page, capacity = _kvcache.table_of(k_cache, v_cache, B, block_table, cache_batch_idx, what)
    lengths = _kvcache.int_vector(cache_seqlens, "cache_seqlens", B, device, what, default=capacity)
    leftpad = _kvcache.int_vector(cache_leftpad, "cache_leftpad", B, device, what)
    if k is not None:
        if cache_seqlens is None:
            raise ValueError(f"flash_metal.{what}: appending k and v needs cache_seqlens (where each batch's new "
                             "rows go)")
        # The new rows must have their cache's head dims (v's D_v may differ from k's D_qk).
        for name, new, cache in (("k", k, "k_cache"), ("v", v, "v_cache")):
            want = (k_cache if name == "k" else v_cache).shape[-1]
            if new.shape[-1] != want:
                raise ValueError(f"flash_metal.{what}: {name} has head dim {new.shape[-1]} but {cache} has {want}; "
                                 f"the appended rows must have their cache's head dim")
    s_new = 0 if k is None else k.shape[1]
    if B and bool((lengths < 0).any()):
        raise ValueError(f"flash_metal.{what}: cache_seqlens must be >= 0; got {lengths.tolist()}")
    if B and bool((lengths + s_new > capacity).any()):
        where = "the block table's capacity (max_blocks_per_seq * page_size)" if block_table is not None else "the cache"
        raise ValueError(f"flash_metal.{what}: cache_seqlens{' + the appended rows' if s_new else ''} "
                         f"(up to {int((lengths + s_new).max())}) exceed {where} of {capacity} keys")
    if block_table is not None:
        _kvcache.check_entries(table, page, lengths + s_new, k_cache.shape[0], what)
    if k is not None:
        with torch.no_grad():  # an in-place write into the user's cache, outside any graph
            _kvcache.append(k_cache, k, table, page, lengths)
            _kvcache.append(v_cache, v, table, page, lengths)
        lengths = lengths + s_new
    if leftpad is not None and B and bool(((leftpad < 0) | (leftpad > lengths)).any()):
        raise ValueError(f"flash_metal.{what}: cache_leftpad must lie in [0, cache_seqlens] per batch; got "
                         f"{leftpad.tolist()} against lengths {lengths.tolist()}")
    starts = leftpad if leftpad is not None else torch.zeros_like(lengths)
    options = dict(window_left=left, window_right=right, softcap=softcap, sinks=sinks)
    plain = block_table is None and cache_batch_idx is None
    # No graph unless a gradient is wanted (then every path below is differentiable).
    graph = contextlib.nullcontext if ops._wants_grad(q, k_cache, v_cache, sinks) else torch.no_grad
    if plain and cache_seqlens is None and leftpad is None:
        # The whole cache is valid: the dense op, bottom-right aligned as flash-attn.
        with graph():
            out, lse = ops.attention_with_lse(q.transpose(1, 2), k_cache[:B].transpose(1, 2),
                                              v_cache[:B].transpose(1, 2), causal, softmax_scale, **options)
        out = out.transpose(1, 2).contiguous()
        return (out, lse) if return_softmax_lse else out
    # attention_kvcache: on Metal the decode kernels (Nq <= 8) or the
    # prefill kernel read K/V through the table, nothing copied; on CPU the
    # op gathers the rows in use for the varlen kernel. cache_batch_idx is a
    # table of one page per sequence (the cache row), a plain cache the op's
    # own (row b for batch b). A plain cache that the op would gather (CPU,
    # or, for Sq > 8, head dims past the prefill's widest bucket, 256) is
    # read in place by the varlen op below instead.
    widest = max(q.shape[-1], v_cache.shape[-1])
    if leftpad is None and (not plain or (device.type == "mps" and (sq <= 8 or widest <= 256))):
        bt = block_table
        if cache_batch_idx is not None:
            bt = table.to(torch.int32)
        with graph():
            out, lse = ops.attention_kvcache_with_lse(q.transpose(1, 2), k_cache, v_cache, lengths.to(torch.int32),
                                                      bt, causal, softmax_scale, left, right, softcap, sinks)
        out = out.transpose(1, 2).contiguous()
        return (out, lse) if return_softmax_lse else out
    q_starts = torch.arange(B + 1, device=device, dtype=torch.int64) * sq
    if plain:
        # Batch b attends to rows starts[b] .. lengths[b] - 1 of its cache
        # row, and the others are never read (flash-attn's contract: a cache
        # from torch.empty may hold NaN or inf there; masking them would
        # still let 0 * NaN into P @ V). The cache as one packed varlen
        # problem of 3B sequences: per batch, a sequence with no queries
        # over the rows before starts[b], b's queries over its rows, and a
        # sequence with no queries over the rows past them (never read, as
        # they have no query). q, the cache and out are reshaped views (the
        # cache is copied only if its batch and sequence dims cannot merge).
        s_cache = k_cache.shape[1]
        base = torch.arange(B + 1, device=device, dtype=torch.int64) * s_cache
        cu_k = torch.stack((base[:-1], base[:-1] + starts, base[:-1] + lengths), dim=1).flatten()
        cu_k = torch.cat((cu_k, base[-1:])).to(torch.int32)
        cu_q = torch.stack((q_starts[:-1], q_starts[:-1], q_starts[1:]), dim=1).flatten()
        cu_q = torch.cat((cu_q, q_starts[-1:])).to(torch.int32)
        packed_k = k_cache[:B].reshape(B * s_cache, *k_cache.shape[2:])
        packed_v = v_cache[:B].reshape(B * s_cache, *v_cache.shape[2:])
        max_k = s_cache
    else:
        rows = _kvcache.rows_in_use(table, page, starts, lengths)
        packed_k, packed_v = _kvcache.gather(k_cache, rows), _kvcache.gather(v_cache, rows)
        cu_k = _kvcache.cumulative(lengths - starts)
        cu_q = q_starts.to(torch.int32)
        max_k = int((lengths - starts).max()) if B else 0
    with graph():
        out, lse = ops.attention_varlen_with_lse(q.reshape(B * sq, *q.shape[2:]), packed_k, packed_v, cu_q, cu_k,
                                                 sq, max_k, causal, softmax_scale, **options)
    out = out.reshape(B, sq, hq, out.shape[-1])
    lse = lse.reshape(hq, B, sq).permute(1, 0, 2).contiguous()
    return (out, lse) if return_softmax_lse else out
