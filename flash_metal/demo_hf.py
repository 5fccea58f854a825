"""Generate with a tiny random Llama through attn_implementation="metal_attention", against "sdpa".

    python -m flash_metal.demo_hf [--device cpu|mps] [--dtype float32|float16|bfloat16] [--prompt 512] [--new 32]

Needs transformers (pip install '.[hf]'). Builds a small randomly
initialized Llama from a config (no download; GQA 8:2, head dim 64), loads
the same weights on both attention implementations, generates --new tokens
greedily after a --prompt-token left-padded batch of 4, and prints the
tokens' agreement, each implementation's time and the process's peak memory
growth during each generate (Linux: /proc's VmHWM; MPS: the driver's
allocated memory).
"""
import argparse
import importlib.util
import os
import sys
import time

import torch

import flash_metal


def _sync(device):
    if device == "mps":
        torch.mps.synchronize()


def _peak_reset():
    if os.path.exists("/proc/self/clear_refs"):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def _kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _measure(fn, device):
    """(result, seconds, peak extra MiB) of one call."""
    _sync(device)
    if device == "mps":
        torch.mps.empty_cache()
        base = torch.mps.driver_allocated_memory()
    else:
        _peak_reset()
        base = _kib("VmRSS") * 1024
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    seconds = time.perf_counter() - t0
    peak = torch.mps.driver_allocated_memory() if device == "mps" else _kib("VmHWM") * 1024
    return out, seconds, max(0, peak - base) / 2**20


def main(argv=None):
    default_device = "mps" if torch.backends.mps.is_available() else "cpu"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=default_device, choices=["cpu", "mps"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (the longest of the batch)")
    ap.add_argument("--new", type=int, default=32, help="tokens to generate")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("transformers") is None:
        print("flash_metal.demo_hf needs transformers: pip install '.[hf]'", file=sys.stderr)
        return 2
    import transformers

    transformers.logging.set_verbosity_error()
    dtype = getattr(torch, args.dtype)
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    models = {}
    for name in ("metal_attention", "sdpa"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=name, dtype=dtype)
        if models:
            model.load_state_dict(next(iter(models.values())).state_dict())
        models[name] = model.to(args.device).eval()

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 1000, (4, args.prompt), generator=g)
    mask = torch.ones_like(ids)
    for b, n in enumerate([args.prompt, args.prompt * 3 // 4, args.prompt // 2, args.prompt // 4]):
        mask[b, : args.prompt - n] = 0  # left padding, as batched generation uses
        ids[b, : args.prompt - n] = 0
    ids, mask = ids.to(args.device), mask.to(args.device)

    def generate(name):
        with torch.no_grad():
            return models[name].generate(ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                                         do_sample=False, pad_token_id=0)

    generate("metal_attention")  # warm-up (pipelines, thread pool)
    generate("sdpa")
    results = {name: _measure(lambda n=name: generate(n), args.device) for name in models}
    agree = (results["metal_attention"][0] == results["sdpa"][0]).float().mean().item()
    print(f"flash_metal demo_hf on {args.device}, {args.dtype}: a random 4-layer Llama (GQA 8:2, head dim 64), "
          f"batch of 4 left-padded prompts up to {args.prompt} tokens, {args.new} new tokens, greedy")
    for name, (_, seconds, mib) in results.items():
        tps = 4 * args.new / seconds
        print(f"  {name:>15}: {seconds * 1e3:8.1f} ms  ({tps:7.1f} tokens/s)   peak extra memory {mib:7.1f} MiB")
    speed = results["sdpa"][1] / results["metal_attention"][1]
    print(f"  metal_attention vs sdpa: {speed:.2f}x the speed; tokens identical at {agree * 100:.1f} % of positions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
