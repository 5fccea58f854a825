"""Hugging Face transformers with the sequence split across ranks: the attention implementation "metal_ring_attention".

    import torch.distributed as dist
    import flash_metal.distributed as fmd
    from flash_metal.distributed import hf as fmd_hf

    dist.init_process_group("gloo")
    name = fmd_hf.register(group=None, variant="zigzag")        # "metal_ring_attention"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    ids, pos = fmd.shard(input_ids, 1, "zigzag"), fmd.shard(position_ids, 1, "zigzag")
    labels = fmd.shard(next_tokens, 1, "zigzag")   # shift the labels globally, before sharding
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits

Each rank feeds its shard of the tokens with their global position_ids (the
rotary embedding needs them); every layer's attention then runs
flash_metal.distributed.attention over the group. The model's other layers
are per token, so they need nothing. The loss is each rank's sum over its
own tokens, divided by the global count; after backward, sum the gradients
across the group (DDP, or dist.all_reduce): the result is the
single-process gradient. Not served: padding masks (the sequence must be
whole: pass no attention_mask), a KV cache (generate), attention dropout.

The mask transformers builds from the local length would be wrong for a
shard, so the name is registered with a mask function that builds none
(and refuses a padding mask).
"""
import collections
import functools
from typing import Optional

import torch

from . import attention

NAME = "metal_ring_attention"

# How many times each variant ran (tests read it to prove the model used it).
calls = collections.Counter()


def ring_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                           sliding_window=None, softcap=None, *, group=None, variant="ring", **kwargs):
    """transformers' attention interface over a sharded sequence: query (B, Hq, n, D), key/value (B, Hkv, n, D)."""
    if dropout and module.training:
        raise ValueError(f"{NAME}: attention dropout ({dropout}) is not supported; set attention_dropout to 0.0")
    if attention_mask is not None:
        raise ValueError(f"{NAME}: attention masks are not supported (each rank holds a shard of one whole "
                         "sequence); pass no attention_mask")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    calls[variant] += 1
    out = attention(query, key, value, group=group, variant=variant, causal=bool(causal), scale=scaling,
                    window_left=int(sliding_window) - 1 if sliding_window else -1,
                    softcap=float(softcap) if softcap else 0.0, sinks=kwargs.get("s_aux"))
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, attention_mask: Optional[torch.Tensor] = None, q_offset: int = 0, **kwargs):
    """The mask function: no mask (causality and windows are the distributed attention's, by global position)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(f"{NAME}: padded batches are not supported (each rank holds a shard of whole sequences)")
    if q_offset:
        raise ValueError(f"{NAME}: a KV cache (generate, past_key_values) is not supported")
    return None


def register(group=None, variant: str = "ring", name: str = NAME) -> str:
    """Registers `name` with transformers' AttentionInterface and AttentionMaskInterface for this group and
    variant ("ring", "zigzag" or "ulysses"); returns the name. Register another name for another group."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if variant not in ("ring", "zigzag", "ulysses"):
        raise ValueError(f"flash_metal.distributed.hf.register: variant must be 'ring', 'zigzag' or 'ulysses'; "
                         f"got {variant!r}")
    if "flash" in name or "sdpa" in name:
        raise ValueError(f"flash_metal.distributed.hf.register: transformers treats names containing 'flash' or "
                         f"'sdpa' as its own kernels; got {name!r}")
    AttentionInterface.register(name, functools.partial(ring_attention_forward, group=group, variant=variant))
    AttentionMaskInterface.register(name, _no_mask)
    return name
