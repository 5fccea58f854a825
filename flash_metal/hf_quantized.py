"""A transformers cache that stays quantized, read in place by metal_attention (issue 44).

    from flash_metal.hf_quantized import MetalQuantizedCache
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="metal_attention")
    cache = MetalQuantizedCache(model.config, k_format="int8", v_format="q4", group_size=64)
    model.generate(ids, past_key_values=cache, max_new_tokens=32)

Each layer keeps K and V as codes and scales in flash-attn's cache layout
(B, capacity, Hkv, ...), growing by doubling; new tokens are quantized on
the way in (flash_metal.quantize_kv). update() hands the attention a
stand-in tensor of the logical (B, Hkv, Nk, D) shape (zero strides: no
memory) that carries the layer, and metal_attention (flash_metal.hf) then
calls attention_kvcache on the codes: nothing is dequantized, unlike
transformers' QuantizedCache, which dequantizes every step. flash_metal.hf.calls
counts these calls under "quantized_kv".

Formats per side: "int8" (per-token scale), "q4" (MLX's 4-bit, group_size
along D), "fp8_e4m3" (a per-(batch, kv head) descale set from the first
tokens with 4x headroom; later tokens beyond it saturate at +-448 x descale).
Sliding-window layers keep every token and window in the kernel. Forward
only; no padding masks (a left-padded batch is refused), no beam search
reordering, no cropping.
"""
from typing import Optional, Tuple

import torch

from .quantized_kv import quantize_kv

_FP8_HEADROOM = 4.0


def _layer_base():
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


class _Side:
    """One side's codes and scales, (B, capacity, Hkv, ...)."""

    def __init__(self, fmt, group_size):
        self.fmt, self.group_size = fmt, group_size
        self.codes = self.scale = self.bias = None

    def _grow(self, need):
        cap = self.codes.shape[1]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap)

        def grow(t):
            if t is None or t.dim() < 3:
                return t
            out = torch.zeros((t.shape[0], new_cap, *t.shape[2:]), dtype=t.dtype, device=t.device)
            if t.dtype == torch.uint32:
                out.view(torch.int32)[:, :cap] = t.view(torch.int32)
            elif t.dtype == torch.float8_e4m3fn:
                out.view(torch.uint8)[:, :cap] = t.view(torch.uint8)
            else:
                out[:, :cap] = t
            return out

        self.codes, self.scale, self.bias = grow(self.codes), grow(self.scale), grow(self.bias)

    def append(self, x, at):
        """x (B, N, Hkv, D) float, written at rows at .. at + N - 1."""
        n = x.shape[1]
        if self.codes is None:
            if self.fmt == "fp8_e4m3":
                amax = x.float().abs().amax(dim=(1, 3))
                descale = torch.where(amax > 0, amax * _FP8_HEADROOM / 448, torch.ones_like(amax))
                r = quantize_kv(x, self.fmt, descale=descale)
            else:
                r = quantize_kv(x, self.fmt, group_size=self.group_size, scale_dtype=torch.float32)
            self.codes, self.scale, self.bias = r.codes, r.scale, r.bias
            return
        self._grow(at + n)
        if self.fmt == "fp8_e4m3":
            r = quantize_kv(x, self.fmt, descale=self.scale)
        else:
            r = quantize_kv(x, self.fmt, group_size=self.group_size, scale_dtype=torch.float32)
        if self.codes.dtype == torch.uint32:
            self.codes.view(torch.int32)[:, at:at + n] = r.codes.view(torch.int32)
        elif self.codes.dtype == torch.float8_e4m3fn:
            self.codes.view(torch.uint8)[:, at:at + n] = r.codes.view(torch.uint8)
        else:
            self.codes[:, at:at + n] = r.codes
        if self.fmt != "fp8_e4m3":
            self.scale[:, at:at + n] = r.scale
        if r.bias is not None:
            self.bias[:, at:at + n] = r.bias


def make_layer_class():
    base = _layer_base()

    class MetalQuantizedLayer(base):
        """A DynamicLayer whose K and V stay quantized (see the module doc)."""

        def __init__(self, k_format="int8", v_format="int8", group_size=64):
            super().__init__()
            self.k = _Side(k_format, group_size)
            self.v = _Side(v_format, group_size)
            self.length = 0

        def lazy_initialization(self, key_states, value_states):
            self.device = key_states.device
            self.dtype = key_states.dtype
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            with torch.no_grad():
                self.k.append(key_states.transpose(1, 2), self.length)
                self.v.append(value_states.transpose(1, 2), self.length)
            self.length += key_states.shape[2]
            B, H, _, D = key_states.shape
            stand_k = key_states.new_empty(()).expand(B, H, self.length, D)
            stand_v = value_states.new_empty(()).expand(B, H, self.length, value_states.shape[3])
            stand_k._flash_metal_kv = self
            stand_v._flash_metal_kv = self
            return stand_k, stand_v

        def get_seq_length(self) -> int:
            return self.length

        def kernel_args(self) -> Tuple[torch.Tensor, torch.Tensor, dict]:
            """The caches and the op's scale arguments."""
            return self.k.codes, self.v.codes, dict(k_scale=self.k.scale, k_bias=self.k.bias,
                                                    v_scale=self.v.scale, v_bias=self.v.bias)

        def reset(self):
            self.k = _Side(self.k.fmt, self.k.group_size)
            self.v = _Side(self.v.fmt, self.v.group_size)
            self.length = 0
            self.is_initialized = False

        def crop(self, tokens_to_remove):
            raise NotImplementedError("MetalQuantizedLayer: cropping a quantized cache is not supported")

        def batch_repeat_interleave(self, repeats):
            raise NotImplementedError("MetalQuantizedLayer: beam search on a quantized cache is not supported")

        def batch_select_indices(self, indices):
            raise NotImplementedError("MetalQuantizedLayer: reordering a quantized cache is not supported")

    return MetalQuantizedLayer


def MetalQuantizedCache(config, k_format: str = "int8", v_format: str = "int8", group_size: int = 64,
                        num_layers: Optional[int] = None):
    """A transformers Cache of MetalQuantizedLayer, one per decoder layer of config."""
    from transformers.cache_utils import Cache

    layer = make_layer_class()
    n = num_layers or config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[layer(k_format, v_format, group_size) for _ in range(n)])


def quantized_forward(layer, query, attention_mask, scaling, causal, window_left, softcap, sinks):
    """metal_attention's route for a MetalQuantizedLayer's stand-in keys: attention_kvcache on its codes."""
    from . import ops

    B, _, n_q, _ = query.shape
    n_k = layer.length
    if attention_mask is not None:
        # Only a mask that says what causal already says is accepted (no padding).
        m = attention_mask
        if m.dtype != torch.bool:
            m = m == 0
        i = torch.arange(n_q, device=m.device)[:, None]
        j = torch.arange(m.shape[-1], device=m.device)[None, :]
        want = (j <= i + n_k - n_q) & (j < n_k) if causal else j < n_k
        if window_left >= 0:  # a sliding layer's mask (gpt-oss, Mistral): the window too
            want = want & (j >= i + n_k - n_q - window_left)
        if not bool((m[..., :n_k] == want[:, :n_k]).all()):
            raise ValueError("metal_attention: a quantized KV cache (MetalQuantizedCache) takes no padding mask; "
                             "generate unpadded batches (one sequence, or sequences of equal length)")
    k_cache, v_cache, scales = layer.kernel_args()
    lens = torch.full((B,), n_k, dtype=torch.int32, device=query.device)
    with torch.no_grad():
        out, _ = ops.attention_kvcache_with_lse(query, k_cache, v_cache, lens, None, causal and n_q > 1, scaling,
                                                window_left, -1, softcap, sinks, **scales)
    return out.transpose(1, 2).contiguous()
