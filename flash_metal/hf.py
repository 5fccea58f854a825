"""Hugging Face transformers on flash_metal: the attention implementation "metal_attention".

    import flash_metal                       # registers it, when transformers is installed
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="metal_attention")
    model.set_attn_implementation("metal_attention")   # or switch a loaded model

Why not "flash_metal": transformers 5 treats any implementation whose name
contains "flash" as a flash-attn kernel, looks for it through its kernel hub
and fails to load the model; so the name avoids "flash", "sdpa",
"flex_attention", "paged", "/" and ":".

The implementation is registered with AttentionInterface, and with
AttentionMaskInterface under the same name with transformers' own sdpa_mask,
so models hand it SDPA's 4-D bool mask (True = attend) or None. It serves:
padded batches (the mask), generate() with DynamicCache and StaticCache
(mask None with Nq < Nk is a StaticCache prefill, which transformers means
top-left: keys are cropped to Nq, as its sdpa path does), sliding windows
(Mistral, Qwen 2: the mask, or window_left = sliding_window - 1 when there is
none), softcapping (Gemma 2's softcap kwarg), padding-free packed batches
(cu_seq_lens_q/k and max_length_q/k: attention_varlen), gpt-oss's attention
sinks (s_aux: the ops' sinks), DeepSeek-V3's MLA (a value head dim of its own,
on CPU) and training (the ops' backward). It never
imports transformers itself unless transformers is installed; register() may
also be called by hand.
"""
import collections
import importlib.abc
import importlib.machinery
import importlib.util
import sys

import torch

from . import ops

NAME = "metal_attention"

# How many times each route of metal_attention_forward ran: "mask",
# "mask_cropped" (a mask wider than the keys, as StaticCache hands over),
# "causal", "static_prefill" (keys cropped to Nq), "decode" and "varlen";
# "sinks" counts the calls (of any route) that carried attention sinks (s_aux),
# "value_head_dim" those whose value has a head dim of its own (DeepSeek's
# MLA: q/k 192, v 128 at full size; CPU only, the Metal kernels refuse it);
# "quantized_kv" those that read a MetalQuantizedCache's codes in place.
# Tests read it to prove a model really ran this implementation; users may
# read it to see which path their model takes.
calls = collections.Counter()

# Why "metal_attention" is not registered (None once it is, or before
# transformers is imported): register() never raises, so a transformers
# that cannot run with this torch never breaks the user's own import.
skip_reason = None


def metal_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                            sliding_window=None, softcap=None, **kwargs):
    """transformers' attention interface: query (B, Hq, Nq, D), key/value (B, Hkv, Nk, D) (GQA not
    repeated), the mask of sdpa_mask. Returns (out (B, Nq, Hq, D), None)."""
    if dropout and module.training:
        raise ValueError(f"{NAME}: attention dropout ({dropout}) is not supported by flash_metal; set the model's "
                         "attention_dropout to 0.0")
    # gpt-oss's attention sinks: one logit per query head (module.sinks),
    # passed as s_aux; the ops take them as `sinks` on every route.
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        calls["sinks"] += 1
    if value.shape[-1] != query.shape[-1]:
        calls["value_head_dim"] += 1
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window_left = int(sliding_window) - 1 if sliding_window else -1
    softcap = float(softcap) if softcap else 0.0
    n_q, n_k = query.shape[2], key.shape[2]
    # A MetalQuantizedCache layer's stand-in keys (flash_metal/hf_quantized.py): its codes, read in place.
    quantized_layer = getattr(key, "_flash_metal_kv", None)
    if quantized_layer is not None:
        from .hf_quantized import quantized_forward

        calls["quantized_kv"] += 1
        return quantized_forward(quantized_layer, query, attention_mask, scaling, causal, window_left, softcap,
                                 sinks), None

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and query.shape[0] == 1:
        # Padding-free packed batch (DataCollatorWithFlattening): one row of
        # sequences; each attends only within itself.
        calls["varlen"] += 1
        out = ops.attention_varlen(
            query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu_q.to(torch.int32),
            cu_k.to(torch.int32), int(kwargs["max_length_q"]), int(kwargs["max_length_k"]), causal=causal,
            scale=scaling, window_left=window_left, softcap=softcap, sinks=sinks,
        )
        return out.unsqueeze(0), None

    if attention_mask is not None:
        # The mask already holds causality, padding and the window. A mask
        # wider than the keys covers the keys' positions first (its columns
        # past Nk are cache slots not handed over): keep its first Nk.
        mask = attention_mask
        if attention_mask.shape[-1] > n_k:
            mask = attention_mask[..., :n_k]
            calls["mask_cropped"] += 1
        calls["mask"] += 1
        out = ops.attention(query, key, value, causal=False, scale=scaling, attn_mask=mask, softcap=softcap,
                            sinks=sinks)
    elif causal and n_q > 1:
        calls["causal"] += 1
        if n_k > n_q:
            # A StaticCache prefill: transformers means top-left alignment,
            # so the (empty) cache rows past Nq are never seen.
            calls["static_prefill"] += 1
            key, value = key[:, :, :n_q], value[:, :, :n_q]
        out = ops.attention(query, key, value, causal=True, scale=scaling, window_left=window_left, softcap=softcap,
                            sinks=sinks)
    else:
        # One query (decoding): every cached key, bottom-right window.
        calls["decode"] += 1
        out = ops.attention(query, key, value, causal=False, scale=scaling, window_left=window_left,
                            softcap=softcap, sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


_registered = False


def register() -> bool:
    """Register "metal_attention" with transformers (idempotent).

    Returns False, never raises, when it cannot: transformers is absent, or
    it runs without PyTorch support (transformers 5 disables PyTorch older
    than it supports, and its AttentionInterface is then a placeholder that
    raises). `skip_reason` then says why.
    """
    global _registered, skip_reason
    if _registered:
        return True
    if importlib.util.find_spec("transformers") is None:
        skip_reason = "transformers is not installed"
        return False
    try:
        import transformers
        from transformers.utils import is_torch_available

        if not is_torch_available():
            skip_reason = (f"transformers {transformers.__version__} does not enable PyTorch {torch.__version__} "
                           "(it needs a newer torch), so it has no attention implementations to register with")
            return False
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, metal_attention_forward)
        AttentionMaskInterface.register(NAME, sdpa_mask)
    except Exception as e:  # never break the user's `import transformers`
        skip_reason = f"registering with transformers failed: {type(e).__name__}: {e}"
        return False
    _registered = True
    skip_reason = None
    return True


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Registers once transformers itself is imported, so `import flash_metal` stays free of it."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        # The spec the path finders would give (find_spec alone, such as
        # importlib.util.find_spec, executes nothing, so the hook stays until
        # the module really runs).
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        hook = self

        def exec_then_register(module):
            exec_module(module)
            if hook in sys.meta_path:
                sys.meta_path.remove(hook)
            register()

        spec.loader.exec_module = exec_then_register
        return spec


def install() -> None:
    """Called by `import flash_metal`: register now if transformers is loaded, else when it is."""
    if "transformers" in sys.modules:
        register()
    elif importlib.util.find_spec("transformers") is not None:
        if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _RegisterAfterImport())
