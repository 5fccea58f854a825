"""Hugging Face transformers models on attn_implementation="metal_attention" (flash_metal/hf.py).

Small randomly initialized Llama, Mistral and Gemma 2 models built from
configs (no download), each compared with the same weights on "sdpa" (or
"eager" where sdpa lacks the feature: Gemma 2's softcapping): logits of
padded batches, greedy generate() with DynamicCache and StaticCache, left
padded or not, padding-free packed batches, and the gradients of a
training step. transformers is the optional extra '.[hf]'; CI installs it.
"""
import importlib.util

import pytest
import torch

import flash_metal
from prereqs import unavailable

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def tf():
    if importlib.util.find_spec("transformers") is None:
        unavailable("transformers is not installed (pip install '.[hf]')")
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def _config(tf, kind):
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, attention_dropout=0.0)
    if kind == "llama":
        return tf.LlamaConfig(**common)
    if kind == "mistral":
        return tf.MistralConfig(**common, sliding_window=6)  # far shorter than the sequences below
    return tf.Gemma2Config(**common, head_dim=16, sliding_window=6, attn_logit_softcapping=3.0,
                           final_logit_softcapping=None, query_pre_attn_scalar=16)


def _models(tf, kind, reference):
    """(ours, reference) with the same random weights, in float32, eval mode."""
    torch.manual_seed(0)
    config = _config(tf, kind)
    ours = tf.AutoModelForCausalLM.from_config(config, attn_implementation="metal_attention").eval()
    ref = tf.AutoModelForCausalLM.from_config(config, attn_implementation=reference).eval()
    ref.load_state_dict(ours.state_dict())
    return ours, ref


REFERENCE = {"llama": "sdpa", "mistral": "sdpa", "gemma2": "eager"}


def _batch(padding, g):
    ids = torch.randint(3, 97, (3, 14), generator=g)
    mask = torch.ones(3, 14, dtype=torch.long)
    lengths = [14, 9, 5]
    for b, n in enumerate(lengths):
        if padding == "left":
            mask[b, : 14 - n] = 0
            ids[b, : 14 - n] = 0
        elif padding == "right":
            mask[b, n:] = 0
            ids[b, n:] = 0
    return ids, mask


def test_registered_name_has_no_flash(tf):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert "flash" not in flash_metal.hf.NAME
    assert AttentionInterface._global_mapping[flash_metal.hf.NAME] is flash_metal.hf.metal_attention_forward
    assert flash_metal.hf.NAME in AttentionMaskInterface._global_mapping


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_padded_forward_logits(tf, kind, padding):
    ours, ref = _models(tf, kind, REFERENCE[kind])
    ids, mask = _batch(padding, torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask).logits
        want = ref(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()  # padded positions' logits are meaningless in both
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padding", ["none", "left"])
def test_generate_matches(tf, kind, cache, padding):
    ours, ref = _models(tf, kind, REFERENCE[kind])
    ids, mask = _batch(padding, torch.Generator().manual_seed(2))
    if padding == "none":
        ids, mask = ids[:1], mask[:1]
    kwargs = dict(max_new_tokens=8, do_sample=False, attention_mask=mask, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        got = ours.generate(ids, **kwargs)
        want = ref.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    # The logits of every step too: greedy tokens of a small random model can
    # survive a wrong attention (e.g. a StaticCache prefill seeing its empty rows).
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_packed_batch_through_cu_seq_lens(tf, kind):
    # Padding-free training input (DataCollatorWithFlattening): 3 sequences in
    # one row, position_ids restarting, cu_seq_lens and max_length kwargs.
    # Each sequence's logits equal the same sequence run alone on sdpa.
    ours, ref = _models(tf, kind, "sdpa")
    g = torch.Generator().manual_seed(3)
    lengths = [5, 11, 8]
    seqs = [torch.randint(3, 97, (1, n), generator=g) for n in lengths]
    ids = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = torch.tensor([0, 5, 16, 24], dtype=torch.int32)
    with torch.no_grad():
        got = ours(input_ids=ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=11,
                   max_length_k=11, use_cache=False).logits
        want = torch.cat([ref(input_ids=s, use_cache=False).logits for s in seqs], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_training_step_gradients(tf, kind):
    ours, ref = _models(tf, kind, REFERENCE[kind])
    ours.train()
    ref.train()
    ids, mask = _batch("right", torch.Generator().manual_seed(4))
    labels = ids.masked_fill(mask == 0, -100)
    for model in (ours, ref):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert a.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-5, msg=name)


def test_attention_dropout_in_training_raises(tf):
    config = _config(tf, "llama")
    config.attention_dropout = 0.1
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="metal_attention").train()
    ids, mask = _batch("none", torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match=r"metal_attention: attention dropout \(0.1\) is not supported"):
        model(input_ids=ids, attention_mask=mask)
    model.eval()(input_ids=ids, attention_mask=mask)  # no dropout at inference: runs


def test_demo_hf_runs_and_agrees(tf, capsys):
    from flash_metal import demo_hf

    assert demo_hf.main(["--device", "cpu", "--prompt", "24", "--new", "4"]) == 0
    out = capsys.readouterr().out
    assert "metal_attention vs sdpa" in out and "tokens identical at 100.0 % of positions" in out


def test_set_attn_implementation_switches_a_loaded_model(tf):
    ours, ref = _models(tf, "llama", "sdpa")
    ids, mask = _batch("left", torch.Generator().manual_seed(6))
    ref.set_attn_implementation("metal_attention")
    assert ref.config._attn_implementation == "metal_attention"
    with torch.no_grad():
        torch.testing.assert_close(ref(input_ids=ids, attention_mask=mask).logits[mask.bool()],
                                   ours(input_ids=ids, attention_mask=mask).logits[mask.bool()])


def test_import_flash_metal_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, flash_metal; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_from_pretrained_with_metal_attention(tf, tmp_path):
    # The path users take: a saved checkpoint loaded with attn_implementation="metal_attention".
    _, ref = _models(tf, "mistral", "sdpa")
    ref.save_pretrained(tmp_path)
    ours = tf.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="metal_attention").eval()
    assert ours.config._attn_implementation == "metal_attention"
    ids, mask = _batch("right", torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask).logits[mask.bool()],
                                   ref(input_ids=ids, attention_mask=mask).logits[mask.bool()], rtol=1e-4, atol=1e-4)


def test_static_cache_prefill_is_top_left(tf):
    # The case transformers hands over with no mask and Nq < Nk: the prefill
    # of a StaticCache, whose rows past Nq are not filled yet. transformers
    # means top-left alignment there (its sdpa path crops the keys), so rows
    # past Nq must not be seen, whatever they hold (here: large garbage).
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 4, 14, 16, generator=g)
    k = torch.randn(2, 2, 22, 16, generator=g)
    v = torch.randn(2, 2, 22, 16, generator=g)
    k[:, :, 14:] *= 100
    v[:, :, 14:] = 1e4
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = flash_metal.hf.metal_attention_forward(module, q, k, v, None, scaling=0.25)
    want = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :14], v[:, :, :14], is_causal=True,
                                                            scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-5, atol=1e-5)
