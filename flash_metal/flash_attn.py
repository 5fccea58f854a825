"""flash-attn 2.8's Python API on flash_metal: change one import.

    from flash_metal import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

Same signatures, (batch, seqlen, heads, head_dim) layout and semantics as
flash_attn.flash_attn_interface: bottom-right causal, window_size =
(left, right) with -1 unbounded, softcap, GQA, return_attn_probs giving the
log-sum-exp. v (and v_cache) may have a head dim of its own, D_v, as in
flash-attn 3 (hdim_v; MLA's 192/128 and 576/512): out then has D_v (CPU
tensors; Metal refuses it for now). What flash_metal does not implement raises a ValueError naming
the argument: dropout, alibi_slopes, rotary embedding, paged KV (block_table),
cache_batch_idx, cache_leftpad. (The third value of return_attn_probs,
flash-attn's debugging S_dmask, is None.) Deterministic always.
"""
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import ops


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
                    return_attn_probs: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor, None]]:
    """flash-attn's flash_attn_func: q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D).

    Returns out (B, Sq, Hq, D), or with return_attn_probs (out, lse (B, Hq, Sq), None).
    """
    what = "flash_attn_func"
    _dropout(dropout_p, what)
    _unsupported("alibi_slopes", alibi_slopes, what)
    left, right = _window(window_size, what)
    # (B, S, H, D) -> (B, H, S, D): views, read in place through their strides.
    out, lse = ops.attention_with_lse(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal,
                                      softmax_scale, window_left=left, window_right=right, softcap=softcap)
    out = out.transpose(1, 2).contiguous()  # flash-attn returns (B, Sq, Hq, D) contiguous
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Optional[Tensor] = None):
    """flash-attn's flash_attn_varlen_func: q (total_q, Hq, D), k and v (total_k, Hkv, D), int32 cu_seqlens.

    Returns out (total_q, Hq, D), or with return_attn_probs (out, lse (Hq, total_q), None).
    """
    what = "flash_attn_varlen_func"
    _dropout(dropout_p, what)
    _unsupported("alibi_slopes", alibi_slopes, what)
    _unsupported("block_table (paged KV)", block_table, what)
    left, right = _window(window_size, what)
    out, lse = ops.attention_varlen_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                             int(max_seqlen_k), causal, softmax_scale, left, right, softcap)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                            v: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None,
                            rotary_sin: Optional[Tensor] = None,
                            cache_seqlens: Optional[Union[int, Tensor]] = None,
                            cache_batch_idx: Optional[Tensor] = None, cache_leftpad: Optional[Tensor] = None,
                            block_table: Optional[Tensor] = None, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Optional[Tensor] = None,
                            num_splits: int = 0, return_softmax_lse: bool = False):
    """flash-attn's flash_attn_with_kvcache: attention of q against a KV cache, appending k/v first.

    q (B, Sq, Hq, D); k_cache, v_cache (B, S_cache, Hkv, D). With k and v
    (B, S_new, Hkv, D), they are written into the cache in place at rows
    cache_seqlens[b] .. cache_seqlens[b] + S_new - 1 first. Batch b then
    attends to its first cache_seqlens[b] (+ S_new) rows, and never reads the
    rows past them (they may hold anything, NaN included); causal and the
    window are bottom-right aligned to that length (flash-attn's semantics).
    cache_seqlens: an int or an int32 (B,) tensor (None: the whole cache is
    valid, and nothing can be appended).
    Returns out (B, Sq, Hq, D), and lse (B, Hq, Sq) with return_softmax_lse.
    No backward (as in flash-attn). num_splits is a hint only. With
    cache_seqlens given, the call runs the varlen op (on Metal its prefill
    kernel); without, every row is valid and the dense op runs (on Metal the
    routing function may pick the split-KV decode).
    """
    what = "flash_attn_with_kvcache"
    _unsupported("rotary_cos", rotary_cos, what)
    _unsupported("rotary_sin", rotary_sin, what)
    _unsupported("cache_batch_idx", cache_batch_idx, what)
    _unsupported("cache_leftpad", cache_leftpad, what)
    _unsupported("block_table (paged KV)", block_table, what)
    _unsupported("alibi_slopes", alibi_slopes, what)
    left, right = _window(window_size, what)
    if (k is None) != (v is None):
        raise ValueError(f"flash_metal.{what}: give both k and v (new keys and values to append) or neither")
    B, s_cache = k_cache.shape[0], k_cache.shape[1]
    if cache_seqlens is None:
        if k is not None:
            raise ValueError(f"flash_metal.{what}: appending k and v needs cache_seqlens (where each batch's new "
                             "rows go)")
        lengths = torch.full((B,), s_cache, dtype=torch.int64, device=k_cache.device)
    elif isinstance(cache_seqlens, int):
        lengths = torch.full((B,), cache_seqlens, dtype=torch.int64, device=k_cache.device)
    else:
        lengths = cache_seqlens.to(device=k_cache.device, dtype=torch.int64)
    if k is not None:
        # The new rows must have their cache's head dims (v's D_v may differ from k's D_qk).
        for name, new, cache in (("k", k, "k_cache"), ("v", v, "v_cache")):
            want = (k_cache if name == "k" else v_cache).shape[-1]
            if new.shape[-1] != want:
                raise ValueError(f"flash_metal.{what}: {name} has head dim {new.shape[-1]} but {cache} has {want}; "
                                 f"the appended rows must have their cache's head dim")
        s_new = k.shape[1]
        rows = lengths[:, None] + torch.arange(s_new, device=k_cache.device)[None, :]  # (B, S_new)
        if bool((rows >= s_cache).any()):
            raise ValueError(f"flash_metal.{what}: appending {s_new} rows at cache_seqlens overflows the cache of "
                             f"{s_cache} rows")
        index = rows[:, :, None, None]
        # v_cache may have a head dim of its own (D_v, MLA-style), so one index each.
        k_cache.scatter_(1, index.expand(B, s_new, k_cache.shape[2], k_cache.shape[3]), k.to(k_cache.dtype))
        v_cache.scatter_(1, index.expand(B, s_new, v_cache.shape[2], v_cache.shape[3]), v.to(v_cache.dtype))
        lengths = lengths + s_new
    if cache_seqlens is None:  # the whole cache is valid: the dense op, bottom-right aligned as flash-attn
        with torch.no_grad():
            out, lse = ops.attention_with_lse(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                              causal, softmax_scale, window_left=left, window_right=right,
                                              softcap=softcap)
        out = out.transpose(1, 2).contiguous()
        return (out, lse) if return_softmax_lse else out
    sq, hq = q.shape[1], q.shape[2]
    # Batch b attends to its first lengths[b] rows, and the rows past them
    # are never read (flash-attn's contract: a cache from torch.empty may
    # hold NaN or inf there; masking them would still let 0 * NaN into
    # P @ V). The cache as one packed varlen problem of 2B sequences: b's
    # queries against rows b*S_cache .. b*S_cache + lengths[b] - 1, then a
    # sequence with no queries holding the unused rows (never read, as it
    # has no query). cu_seqlens_k thus steps over the unused rows; causal
    # and the window are bottom-right aligned to lengths[b] within each
    # sequence. q, the cache and out are reshaped views (the cache is
    # copied only if its batch and sequence dims cannot be merged).
    starts = torch.arange(B + 1, device=k_cache.device, dtype=torch.int64) * s_cache
    cu_k = torch.stack((starts[:-1], starts[:-1] + lengths), dim=1).flatten()
    cu_k = torch.cat((cu_k, starts[-1:])).to(torch.int32)
    q_starts = torch.arange(B + 1, device=q.device, dtype=torch.int64) * sq
    cu_q = torch.stack((q_starts[:-1], q_starts[1:]), dim=1).flatten()
    cu_q = torch.cat((cu_q, q_starts[-1:])).to(device=k_cache.device, dtype=torch.int32)
    packed_k = k_cache.reshape(B * s_cache, *k_cache.shape[2:])
    packed_v = v_cache.reshape(B * s_cache, *v_cache.shape[2:])
    with torch.no_grad():
        out, lse = ops.attention_varlen_with_lse(q.reshape(B * sq, *q.shape[2:]), packed_k, packed_v, cu_q, cu_k,
                                                 sq, s_cache, causal, softmax_scale, left, right, softcap)
    out = out.reshape(B, sq, hq, out.shape[-1])
    lse = lse.reshape(hq, B, sq).permute(1, 0, 2).contiguous()
    return (out, lse) if return_softmax_lse else out
