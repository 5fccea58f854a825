"""Hugging Face transformers models on attn_implementation="metal_attention" (flash_metal/hf.py).

Small randomly initialized Llama, Mistral, Gemma 2, gpt-oss and DeepSeek-V3
models built from configs (no download), each compared with the same weights
on "sdpa" (or "eager" where sdpa lacks the feature: Gemma 2's softcapping,
gpt-oss's attention sinks, passed as s_aux; DeepSeek-V3 against eager, as
issue 20 asks, its MLA giving q/k and v different head dims): logits of
padded batches, greedy generate() with DynamicCache and StaticCache, left
padded or not, padding-free packed batches, and the gradients of a
training step. transformers is the optional extra '.[hf]'; CI installs it.
"""
import collections
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
    if kind == "gpt_oss":  # layers alternate sliding (window 6) and full, as gpt-oss's; a tiny MoE
        return tf.GptOssConfig(**common, head_dim=16, sliding_window=6, num_local_experts=4, num_experts_per_tok=2)
    if kind == "deepseek_v3":  # MLA: q/k head dim 16 + 8 (nope + rope) = 24, v 16; a tiny MoE after one dense layer
        return tf.DeepseekV3Config(**dict(common, num_key_value_heads=4), q_lora_rank=48, kv_lora_rank=32,
                                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                                   num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
                                   n_shared_experts=1, first_k_dense_replace=1)
    return tf.Gemma2Config(**common, head_dim=16, sliding_window=6, attn_logit_softcapping=3.0,
                           final_logit_softcapping=None, query_pre_attn_scalar=16)


def _models(tf, kind, reference):
    """(ours, reference) with the same random weights, in float32, eval mode.

    Each model gets a config object of its own: transformers stores the
    attention implementation on the config, so two models built from one
    config would both end up on whichever was built last (the reference).
    """
    torch.manual_seed(0)
    ours = tf.AutoModelForCausalLM.from_config(_config(tf, kind), attn_implementation="metal_attention").eval()
    if kind == "gpt_oss":
        # gpt-oss initializes its sinks near 0 (std 0.02); spread them so each
        # head's sink takes a different, real share of its rows.
        with torch.no_grad():
            for name, p in ours.named_parameters():
                if name.endswith(".sinks"):
                    p.copy_(torch.randn(p.shape) * 1.5)
    ref = tf.AutoModelForCausalLM.from_config(_config(tf, kind), attn_implementation=reference).eval()
    ref.load_state_dict(ours.state_dict())
    assert ours.config is not ref.config
    assert ours.config._attn_implementation == "metal_attention", ours.config._attn_implementation
    assert ref.config._attn_implementation == reference, ref.config._attn_implementation
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), f"{name}: the two models do not share their weights"
    return ours, ref


class _Ran:
    """Proves metal_attention ran: the routes of flash_metal.hf.calls that moved inside the block."""

    def __enter__(self):
        self.before = collections.Counter(flash_metal.hf.calls)
        return self

    def __exit__(self, *exc):
        self.moved = flash_metal.hf.calls - self.before
        return False

    def assert_ran(self, *routes):
        assert sum(self.moved.values()) > 0, "metal_attention never ran: the model under test is on another implementation"
        for r in routes:
            assert self.moved[r] > 0, f"route {r!r} never ran (ran: {dict(self.moved)})"


REFERENCE = {"llama": "sdpa", "mistral": "sdpa", "gemma2": "eager", "gpt_oss": "eager", "deepseek_v3": "eager"}
# The hf.calls routes each kind must run besides the mask/causal/decode ones:
# gpt-oss's sinks, DeepSeek-V3's value head dim of its own (proves D_v != D_qk reached the ops).
KIND_ROUTES = {"gpt_oss": ["sinks"], "deepseek_v3": ["value_head_dim"]}


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


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_padded_forward_logits(tf, kind, padding):
    ours, ref = _models(tf, kind, REFERENCE[kind])
    ids, mask = _batch(padding, torch.Generator().manual_seed(1))
    with torch.no_grad(), _Ran() as ran:
        got = ours(input_ids=ids, attention_mask=mask).logits
    ran.assert_ran(*(["mask"] if padding != "none" else []), *KIND_ROUTES.get(kind, []))
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()  # padded positions' logits are meaningless in both
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2", "gpt_oss", "deepseek_v3"])
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
    with torch.no_grad(), _Ran() as ran:
        got = ours.generate(ids, **kwargs)
    # Left padding always hands over a mask (in transformers 5.24 as wide as
    # the keys, StaticCache included; test_mask_wider_than_the_keys_...
    # covers a wider one directly).
    ran.assert_ran(*(["mask"] if padding == "left" else []), *KIND_ROUTES.get(kind, []))
    with torch.no_grad():
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
    with torch.no_grad(), _Ran() as ran:
        got = ours(input_ids=ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=11,
                   max_length_k=11, use_cache=False).logits
    ran.assert_ran("varlen")
    assert set(ran.moved) == {"varlen"}
    with torch.no_grad():
        want = torch.cat([ref(input_ids=s, use_cache=False).logits for s in seqs], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _labels(ids, mask):
    """Causal-LM labels that score only real tokens predicted from real positions.

    transformers scores labels[t] with the logits of position t - 1. A padded
    position's hidden state is arbitrary (implementations legitimately differ
    there: ours gives a fully masked row zeros), so a label is ignored (-100)
    where the token or the position predicting it is padding.
    """
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    return labels


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("padding", ["left", "right"])
def test_training_step_gradients(tf, kind, padding):
    ours, ref = _models(tf, kind, REFERENCE[kind])
    ours.train()
    ref.train()
    ids, mask = _batch(padding, torch.Generator().manual_seed(4))
    labels = _labels(ids, mask)
    # Every scored label is a real token whose predicting position is real.
    scored = (labels[:, 1:] != -100)
    assert scored.any() and bool((mask[:, :-1].bool() & mask[:, 1:].bool())[scored].all())
    with _Ran() as ran:
        loss = ours(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
    ran.assert_ran("mask", *KIND_ROUTES.get(kind, []))
    ref_loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
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
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    ref.set_attn_implementation("metal_attention")
    assert ref.config._attn_implementation == "metal_attention"
    with torch.no_grad(), _Ran() as ran:
        switched = ref(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    ran.assert_ran("mask")
    with torch.no_grad():
        torch.testing.assert_close(switched, ours(input_ids=ids, attention_mask=mask).logits[mask.bool()])
    torch.testing.assert_close(switched, want, rtol=1e-4, atol=1e-4)


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
    with torch.no_grad(), _Ran() as ran:
        got = ours(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    ran.assert_ran("mask")
    with torch.no_grad():
        torch.testing.assert_close(got, ref(input_ids=ids, attention_mask=mask).logits[mask.bool()], rtol=1e-4,
                                   atol=1e-4)


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


def test_mask_wider_than_the_keys_keeps_its_first_columns(tf):
    # A StaticCache hands over a mask as wide as the cache while the keys may
    # be fewer: the mask's first Nk columns belong to the keys. The columns
    # past Nk are garbage here (every other one masked), so keeping the last
    # Nk columns, or any other window of them, changes the result.
    g = torch.Generator().manual_seed(9)
    B, Hq, Hkv, Nq, Nk, D = 2, 4, 2, 5, 11, 16
    q = torch.randn(B, Hq, Nq, D, generator=g)
    k = torch.randn(B, Hkv, Nk, D, generator=g)
    v = torch.randn(B, Hkv, Nk, D, generator=g)
    mask = torch.rand(B, 1, Nq, Nk + 6, generator=g) > 0.3
    mask[..., 0] = True  # every row sees a key
    mask[..., Nk:] = torch.arange(6) % 2 == 0
    module = torch.nn.Module()
    module.is_causal = True
    with _Ran() as ran:
        out, _ = flash_metal.hf.metal_attention_forward(module, q, k, v, mask, scaling=0.3)
    ran.assert_ran("mask_cropped")
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                            attn_mask=mask[..., :Nk], scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out.double(), want.transpose(1, 2), rtol=1e-5, atol=1e-5)
    shifted = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[..., 6:], scale=0.3,
                                                               enable_gqa=True)
    assert (out - shifted.transpose(1, 2)).abs().max() > 1e-2  # the test can tell the columns apart


def test_registration_never_breaks_the_users_import(tmp_path):
    # transformers 5 with a torch it does not support (torch < 2.6) disables
    # PyTorch: AttentionInterface is a placeholder whose register raises.
    # Here a stand-in transformers package does exactly that; importing it
    # after flash_metal (the import hook registers) must still succeed, and
    # flash_metal.hf.skip_reason must say why nothing was registered.
    import subprocess
    import sys

    pkg = tmp_path / "transformers"
    (pkg / "utils").mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "__version__ = '5.99.0'\n"
        "class AttentionInterface:\n"
        "    @staticmethod\n"
        "    def register(*a, **k):\n"
        "        raise ImportError('AttentionInterface requires the PyTorch library')\n")
    (pkg / "masking_utils.py").write_text("AttentionMaskInterface = None\nsdpa_mask = None\n")
    for torch_ok, expect in (("True", "registering with transformers failed: ImportError"),
                             ("False", "does not enable PyTorch")):
        (pkg / "utils" / "__init__.py").write_text(f"def is_torch_available():\n    return {torch_ok}\n")
        code = ("import flash_metal, transformers, sys\n"
                "assert 'transformers' in sys.modules and flash_metal.hf._registered is False\n"
                "print(flash_metal.hf.skip_reason)\n")
        env = dict(__import__("os").environ, PYTHONPATH=str(tmp_path))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        assert expect in out.stdout, out.stdout


@pytest.mark.parametrize("n_q", [1, 9], ids=["decode", "prefill"])
def test_no_mask_routes_apply_the_sliding_window(n_q):
    # With no mask, the window comes from the sliding_window kwarg alone:
    # transformers' overlay lets query position p see keys p - W < j <= p.
    g = torch.Generator().manual_seed(10)
    W, Nk = 4, 9
    q = torch.randn(1, 4, n_q, 16, generator=g)
    k = torch.randn(1, 2, Nk, 16, generator=g)
    v = torch.randn(1, 2, Nk, 16, generator=g)
    module = torch.nn.Module()
    module.is_causal = True
    with _Ran() as ran:
        out, _ = flash_metal.hf.metal_attention_forward(module, q, k, v, None, scaling=0.25, sliding_window=W)
    ran.assert_ran("decode" if n_q == 1 else "causal")
    pos = torch.arange(Nk - n_q, Nk).unsqueeze(1)
    j = torch.arange(Nk).unsqueeze(0)
    allowed = (j <= pos) & (j > pos - W)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=allowed,
                                                            scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out.double(), want.transpose(1, 2), rtol=1e-5, atol=1e-5)
