"""transformers with the sequence split across ranks: "metal_ring_attention" (flash_metal/distributed/hf.py).

A tiny random Llama (2 layers, 4 query heads, 2 kv heads) trained three SGD
steps on 2 spawned gloo ranks, each holding half of every sequence (its
shard of input_ids, labels and position_ids), against the same model trained
in one process on the whole sequences with transformers' sdpa: the loss
curves match, and so do the gradients (summed over the ranks) at every step.
"""
import importlib.util

import pytest

from distributed_pool import Pools
from prereqs import unavailable


@pytest.fixture(scope="module")
def pools():
    if importlib.util.find_spec("transformers") is None:
        unavailable("transformers is not installed (pip install '.[hf]')")
    p = Pools()
    yield p
    p.close()


@pytest.mark.parametrize("variant", ["ring", "zigzag", "ulysses"])
def test_sharded_llama_trains_like_one_process(pools, variant):
    results = pools.run(2, "train_llama", variant=variant, steps=3, n=48)
    for r in results:
        assert r["local_tokens"] == 24  # half of each sequence
        assert r["attention_calls"] >= 3 * 2  # every layer of every step ran the distributed attention
        assert r["history"] == results[0]["history"]  # the ranks agree (losses and gradients all-reduced)
    losses = [(ours, ref) for ours, ref, _ in results[0]["history"]]
    assert losses[-1][1] < losses[0][1]  # it trains
    for ours, ref in losses:
        assert abs(ours - ref) <= 1e-5 * abs(ref), losses
    for _, _, grad_diff in results[0]["history"]:
        assert grad_diff <= 1e-4, results[0]["history"]


def test_refuses_padding_and_dropout(pools):
    for errors in pools.run(2, "llama_refuses"):
        assert errors[0] is not None and "padded" in errors[0], errors
        assert errors[1] is not None and "dropout" in errors[1], errors
