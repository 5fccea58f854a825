"""generate() from a quantized KV cache (flash_metal.hf_quantized.MetalQuantizedCache, issue 44).

A tiny random Llama (head dim 32) decodes greedily with K in int8 and V in
MLX's 4-bit (groups of 32), read in place by metal_attention through
attention_kvcache. Spies: flash_metal.hf.calls["quantized_kv"] and the CPU
kernel's per-format counters. The reference is the same model on sdpa with
a cache that stores quantize-then-dequantize of the same states (the
dequantized-cache reference): tokens equal, logits within float32 noise.
The float cache's logits are reported against it to show the quantization's
own error is real (nonzero) and small.
"""
import collections
import importlib.util

import pytest
import torch

import flash_metal
from flash_metal import dequantize_kv, quantize_kv
from prereqs import unavailable

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def tf():
    if importlib.util.find_spec("transformers") is None:
        unavailable("transformers is not installed (pip install '.[hf]')")
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def _config(tf):
    return tf.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0)


def _dequantizing_cache(tf, k_format, v_format, group_size):
    """A cache whose layers quantize as MetalQuantizedCache does (its _Side: same scales, fp8's descale from
    the first tokens) and hand the attention the dequantized states: the reference's cache."""
    from transformers.cache_utils import Cache, DynamicLayer

    from flash_metal.hf_quantized import _Side

    class Layer(DynamicLayer):
        def __init__(self):
            super().__init__()
            self.sides, self.n = (_Side(k_format, group_size), _Side(v_format, group_size)), 0

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            out = []
            for side, x in zip(self.sides, (key_states, value_states)):
                side.append(x.transpose(1, 2), self.n)
            self.n += key_states.shape[2]
            for side, x in zip(self.sides, (key_states, value_states)):
                codes, scale, bias = side.codes[:, :self.n], side.scale, side.bias
                if side.fmt != "fp8_e4m3":
                    scale = scale[:, :self.n]
                    bias = None if bias is None else bias[:, :self.n]
                out.append(dequantize_kv(codes, scale, bias).transpose(1, 2).to(x.dtype))
            self.keys, self.values = out
            return out[0], out[1]

    return Cache(layers=[Layer() for _ in range(2)])


def test_generate_from_a_quantized_cache(tf):
    from flash_metal.hf_quantized import MetalQuantizedCache

    torch.manual_seed(0)
    ours = tf.AutoModelForCausalLM.from_config(_config(tf), attn_implementation="metal_attention").eval()
    ref = tf.AutoModelForCausalLM.from_config(_config(tf), attn_implementation="sdpa").eval()
    ref.load_state_dict(ours.state_dict())
    ids = torch.randint(3, 97, (1, 11), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    calls0 = collections.Counter(flash_metal.hf.calls)
    counts0 = torch.ops.flash_metal.kvcache_quant_counts()
    with torch.no_grad():
        got = ours.generate(ids, past_key_values=MetalQuantizedCache(ours.config, "int8", "q4", group_size=32), **kw)
    moved = flash_metal.hf.calls - calls0
    counts = torch.ops.flash_metal.kvcache_quant_counts()
    steps = 8 * 2  # 8 forward passes (prefill + 7 decode steps... and the first token), 2 layers each
    assert moved["quantized_kv"] >= steps - 2, dict(moved)
    assert counts[3] - counts0[3] == moved["quantized_kv"]  # int8 K, each call
    assert counts[6 + 4] - counts0[6 + 4] == moved["quantized_kv"]  # q4 V, each call
    with torch.no_grad():
        want = ref.generate(ids, past_key_values=_dequantizing_cache(tf, "int8", "q4", 32), **kw)
        fl = ref.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # The quantization's own error, against the float cache: present, and small next to the logits.
    err = max((a - c).abs().max().item() for a, c in zip(want.logits, fl.logits))
    scale = max(c.abs().max().item() for c in fl.logits)
    assert 0 < err < 0.1 * scale, (err, scale)


def test_generate_gpt_oss_from_a_quantized_cache(tf):
    """gpt-oss: sinks, and layers alternating sliding (window 6) and full; K int8, V fp8 (descale per head)."""
    from flash_metal.hf_quantized import MetalQuantizedCache

    cfg = lambda: tf.GptOssConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,  # noqa
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0, head_dim=16,
                                  sliding_window=6, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    ours = tf.AutoModelForCausalLM.from_config(cfg(), attn_implementation="metal_attention").eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith(".sinks"):
                p.copy_(torch.randn(p.shape) * 1.5)
    ref = tf.AutoModelForCausalLM.from_config(cfg(), attn_implementation="eager").eval()
    ref.load_state_dict(ours.state_dict())
    ids = torch.randint(3, 97, (1, 10), generator=torch.Generator().manual_seed(6))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    calls0 = collections.Counter(flash_metal.hf.calls)
    with torch.no_grad():
        got = ours.generate(ids, past_key_values=MetalQuantizedCache(ours.config, "int8", "fp8_e4m3"), **kw)
        want = ref.generate(ids, past_key_values=_dequantizing_cache(tf, "int8", "fp8_e4m3", 64), **kw)
    moved = flash_metal.hf.calls - calls0
    assert moved["quantized_kv"] >= 10 and moved["sinks"] >= moved["quantized_kv"], dict(moved)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_padding_mask_is_refused(tf):
    from flash_metal.hf_quantized import MetalQuantizedCache

    torch.manual_seed(0)
    ours = tf.AutoModelForCausalLM.from_config(_config(tf), attn_implementation="metal_attention").eval()
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    with torch.no_grad(), pytest.raises(ValueError, match="takes no padding mask"):
        ours.generate(ids, attention_mask=mask, past_key_values=MetalQuantizedCache(ours.config), max_new_tokens=2,
                      do_sample=False, pad_token_id=0)
