"""What the ranks of tests/api/test_distributed*.py run (inside tests/distributed_pool.py's processes).

Every task is called on every rank with the same arguments; rank 0 returns
the verdicts (the others return None or their own observations). Inputs are
drawn from one seed on every rank, so each rank holds the whole sequence and
takes its shard of it; the checks run on the whole results gathered back
(unshard), against the float64 oracle by FlashAttention's 2x rule
(flash_metal.testing) and against the single-process op.
"""
import contextlib

import torch
import torch.distributed as dist

import flash_metal
import flash_metal.distributed as fmd
from flash_metal import testing
from flash_metal.distributed import _blocks, _comm, _layout, _ring

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _docs(total, cuts):
    return torch.tensor([0] + list(cuts) + [total], dtype=torch.int32)


def _inputs(case):
    """The whole problem, the same on every rank: q, k, v, grad_out, grad_lse, sinks, cu_seqlens."""
    g = torch.Generator().manual_seed(case["seed"])
    dtype = DTYPES[case.get("dtype", "float32")]
    B, Hq, Hkv, N, D = case.get("B", 1), case["Hq"], case.get("Hkv", case["Hq"]), case["N"], case.get("D", 16)
    Dv = case.get("Dv", D)
    varlen = case.get("docs") is not None
    if varlen:
        shapes = [(N, Hq, D), (N, Hkv, D), (N, Hkv, Dv), (N, Hq, Dv)]
    else:
        shapes = [(B, Hq, N, D), (B, Hkv, N, D), (B, Hkv, N, Dv), (B, Hq, N, Dv)]
    q, k, v, do = (torch.randn(s, generator=g).to(dtype) for s in shapes)
    dlse = torch.randn((Hq, N) if varlen else (B, Hq, N), generator=g) if case.get("grad_lse") else None
    sinks = (torch.randn(Hq, generator=g) * 1.5).to(dtype) if case.get("sinks") else None
    cu = _docs(N, case["docs"]) if varlen else None
    return q, k, v, do, dlse, sinks, cu


def _options(case):
    return dict(causal=case.get("causal", False), scale=case.get("scale"), window_left=case.get("window_left", -1),
                window_right=case.get("window_right", -1), softcap=case.get("softcap", 0.0))


def _split(t, dim, lengths, group=None):
    """This rank's contiguous shard when the ranks hold the given (uneven) lengths, in rank order."""
    rank = dist.get_rank(group)
    return t.narrow(dim, sum(lengths[:rank]), lengths[rank])


def _distributed(case, q, k, v, do, dlse, sinks, cu, group=None):
    """Runs the distributed attention on this rank's shards; returns whole (out, lse, dq, dk, dv, dsinks)."""
    variant = case["variant"]
    dim = 0 if cu is not None else 2
    ldim = 1 if cu is not None else 2  # lse's sequence dim: (Hq, t) or (B, Hq, n)
    cut = (lambda t, d: _split(t, d, case["split"], group)) if case.get("split") else \
        (lambda t, d: fmd.shard(t, d, variant, group))
    shards = [cut(t, dim).detach().clone().requires_grad_(True) for t in (q, k, v)]
    s = None if sinks is None else sinks.detach().clone().requires_grad_(True)
    out, lse = fmd.attention_with_lse(*shards, group=group, variant=variant, sinks=s, cu_seqlens=cu,
                                      **_options(case))
    loss = (out.float() * cut(do, dim).float()).sum()
    if dlse is not None:
        loss = loss + (lse * cut(dlse, ldim)).sum()
    loss.backward()
    whole = [fmd.unshard(x, d, variant, group) for x, d in
             ((out, dim), (lse, ldim), (shards[0].grad, dim), (shards[1].grad, dim), (shards[2].grad, dim))]
    dsinks = None
    if s is not None:
        dsinks = s.grad.float().clone()
        dist.all_reduce(dsinks, group=group)  # every rank's share of the sinks' gradient
    return whole + [dsinks]


def _single(case, q, k, v, do, dlse, sinks, cu):
    """The single-process op on the whole problem, with autograd."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    s = None if sinks is None else sinks.detach().clone().requires_grad_(True)
    opts = _options(case)
    if cu is None:
        out, lse = flash_metal.attention_with_lse(*leaves, sinks=s, **opts)
    else:
        n = int((cu[1:] - cu[:-1]).max())
        out, lse = flash_metal.attention_varlen_with_lse(*leaves, cu, cu, n, n, opts["causal"], opts["scale"],
                                                         opts["window_left"], opts["window_right"], opts["softcap"],
                                                         sinks=s)
    loss = (out.float() * do.float()).sum() + ((lse * dlse).sum() if dlse is not None else 0)
    loss.backward()
    return [out.detach(), lse.detach()] + [t.grad for t in leaves] + [None if s is None else s.grad.float()]


def _sinks_reference(case, q, k, v, do, dlse, sinks, cu):
    """d loss / d sinks in float64 (autograd through the oracle), and its rounding floor: the error of
    computing it, -sum_i p_i (rowsum(dO_i out_i) - dlse_i), from an output stored in q's dtype
    (eps * sum_i p_i sum_d |dO_id out_id|, per head)."""
    s = sinks.detach().double().requires_grad_(True)
    opts = _options(case)
    if cu is None:
        out, lse = flash_metal.reference.attention_reference(q, k, v, sinks=s, **opts)
        p = torch.exp(s.detach().view(1, -1, 1) - lse.detach())
        rows = (do.double().abs() * out.detach().abs()).sum(-1)
        floor = (p * rows).sum(dim=(0, 2))
    else:
        out, lse = flash_metal.reference.attention_varlen_reference(q, k, v, cu, cu, sinks=s, **opts)
        p = torch.exp(s.detach().view(-1, 1) - lse.detach())  # (Hq, t)
        rows = (do.double().abs() * out.detach().abs()).sum(-1).transpose(0, 1)
        floor = (p * rows).sum(dim=1)
    loss = (out * do.double()).sum() + ((lse.masked_fill(torch.isinf(lse), 0) * dlse.double()).sum()
                                         if dlse is not None else 0)
    loss.backward()
    return s.grad, torch.finfo(q.dtype).eps * floor.max().item()


def _verdicts(case, whole, single, q, k, v, do, dlse, sinks, cu):
    """Comparisons: the oracle's (2x rule) for out, lse and the gradients; the sinks' gradient; and the
    largest difference from the single-process op (reported, bounded by the same tolerances)."""
    out, lse, dq, dk, dv, dsinks = whole
    opts = _options(case)
    if sinks is not None:
        opts["sinks"] = sinks
    if cu is None:
        checks = testing.attention_errors(out, lse, q, k, v, **opts)
        checks += testing.gradient_errors((dq, dk, dv), q, k, v, do, grad_lse=dlse, **opts)
    else:
        causal, scale = opts.pop("causal"), opts.pop("scale")
        checks = testing.varlen_errors(out, lse, q, k, v, cu, cu, causal, scale, **opts)
        checks += testing.varlen_gradient_errors((dq, dk, dv), q, k, v, do, cu, cu, causal, scale, dlse, **opts)
    if sinks is not None:
        ref, floor = _sinks_reference(case, q, k, v, do, dlse, sinks, cu)
        err_single = (single[5].double() - ref).abs().max().item()
        tol = 2 * err_single + floor + 1e-6
        err = (dsinks.double() - ref).abs().max().item()
        checks.append(testing.Comparison("grad_sinks", err, tol, err <= tol,
                                         f"grad_sinks: max error {err:.3g} vs tolerance {tol:.3g}"))
    diffs = {name: (a.double() - b.double()).nan_to_num(posinf=0, neginf=0).abs().max().item()
             for name, a, b in zip(("out", "lse", "grad_q", "grad_k", "grad_v"), whole[:5], single[:5])}
    # The single-process op's result, within the oracle check's own tolerance of ours (for varlen, the
    # loosest document's): the distributed attention reproduces the op, not merely the mathematics.
    for name, diff in diffs.items():
        tols = [c.tolerance for c in checks if c.tolerance is not None and (c.name == name or
                                                                             c.name.endswith(": " + name))]
        if tols:
            ok = diff <= max(tols)
            checks.append(testing.Comparison(f"vs single-process op: {name}", diff, max(tols), ok,
                                             f"{name}: {diff:.3g} from the single-process op "
                                             f"{'<=' if ok else '>'} {max(tols):.3g}"))
    return [tuple(c) for c in checks], diffs


def check(rank, world, case, group_ranks=None):
    """The distributed attention vs the oracle and the single-process op. Rank 0 returns
    (verdicts, differences from the single-process op, stats moved); the others their stats moved."""
    group = dist.new_group(group_ranks) if group_ranks else None
    if group_ranks and rank not in group_ranks:
        return None
    before = _blocks.stats.copy()
    data = _inputs(case)
    whole = _distributed(case, *data, group=group)
    moved = dict(_blocks.stats - before)
    if (dist.get_rank(group) if group else rank) != 0:
        return {"stats": moved}
    single = _single(case, *data)
    verdicts, diffs = _verdicts(case, whole, single, *data)
    return {"verdicts": verdicts, "diffs": diffs, "stats": moved}


def run_twice(rank, world, case):
    """Bitwise equal results run to run (whole out, lse and gradients)."""
    data = _inputs(case)
    a = _distributed(case, *data)
    b = _distributed(case, *data)
    return all(torch.equal(x, y) for x, y in zip(a[:5], b[:5]))


# ------------------------------------------------------------------ planted bugs


def _wrong_merge(acc_out, acc_lse, out, lse):
    """A merge that forgets to rescale the accumulator (adds the new block as if lse were equal)."""
    new = torch.logaddexp(acc_lse, lse)
    w = torch.exp(lse - torch.where(torch.isfinite(new), new, 0.0)).nan_to_num(0.0).unsqueeze(-1)
    acc_out.add_(out.float() * w)
    acc_lse.copy_(new)


def _off_by_one(self, step):
    return (self.g.rank - step - 1) % self.g.size


def _swapped_zigzag(rank, world):
    return 2 * world - 1 - rank, rank


PLANTS = {
    "wrong_merge": (_blocks, "merge", _wrong_merge),
    "ring_off_by_one": (_ring.RingConfig, "source", _off_by_one),
    "zigzag_swapped": (_layout, "zigzag_chunks", _swapped_zigzag),
}


@contextlib.contextmanager
def _planted(name):
    owner, attr, bad = PLANTS[name]
    good = getattr(owner, attr)
    setattr(owner, attr, bad)
    try:
        yield
    finally:
        setattr(owner, attr, good)


def planted(rank, world, case, plant):
    """check() with a bug planted in the attention only: shard and unshard keep the true layout."""
    data = _inputs(case)
    variant = case["variant"]
    dim = 2
    shards = [fmd.shard(t, dim, variant) for t in data[:3]]
    with _planted(plant):
        # The planted attention; its inputs and outputs are laid out by the good shard and unshard.
        for t in shards:
            t.requires_grad_(True)
        out, lse = fmd.attention_with_lse(*shards, variant=variant, **_options(case))
        (out.float() * fmd.shard(data[3], dim, variant).float()).sum().backward()
    whole = [fmd.unshard(x, 2, variant) for x in (out, lse, shards[0].grad, shards[1].grad, shards[2].grad)]
    if rank != 0:
        return None
    q, k, v, do = data[:4]
    opts = _options(case)
    checks = testing.attention_errors(whole[0], whole[1], q, k, v, **opts)
    checks += testing.gradient_errors(tuple(whole[2:5]), q, k, v, do, **opts)
    return [tuple(c) for c in checks]


# ------------------------------------------------------------------ the local blocks on the emulated Metal kernels

# The kernels the emulated test's shapes route to (float32, D 32; flash_metal.explain says which): a partial
# build of attention.metal, seconds rather than minutes (tests/metal_emulator, compile_library's `only`).
EMULATED_KERNELS = ("flash_decode_float32_d32", "flash_attention_prefill_float32_d32_*",
                    "flash_backward_*_float32_d32_*")


def emulated_library():
    from metal_emulator import compile_library
    from shader_builds import SHADER

    return compile_library([SHADER], only=EMULATED_KERNELS)


class EmulatedKernels:
    """_blocks.KERNELS on the Metal emulator: each block planned by the op's own Metal planner
    (flash_metal.explain) and run by tests/backends.py as the MPS host would launch it."""

    def __init__(self):
        import backends

        self.backends = backends
        self.calls = {"forward": 0, "backward": 0, "kernels": set()}
        library = emulated_library()
        backends.metal_library = lambda instrumented=False, fast_math=False: library

    def _ran(self, what):
        self.calls[what] += 1
        self.calls["kernels"].update(d.kernel_name for d, _ in self.backends.LAST_DISPATCHES)

    def forward(self, q, k, v, scale, window_left, window_right, softcap):
        out, lse = self.backends.emulated_metal_attention(q, k, v, False, scale, window_left=window_left,
                                                          window_right=window_right, softcap=softcap)
        self._ran("forward")
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, scale, grad_lse, window_left, window_right, softcap):
        grads = self.backends.emulated_metal_attention_backward(grad_out, q, k, v, out, lse, False, scale, grad_lse,
                                                                window_left=window_left, window_right=window_right,
                                                                softcap=softcap)
        self._ran("backward")
        return grads


def check_emulated(rank, world, case):
    """check() with every local block of the ring on the emulated Metal kernels."""
    emulated = EmulatedKernels()
    good = _blocks.KERNELS
    _blocks.KERNELS = emulated
    try:
        result = check(rank, world, case)
    finally:
        _blocks.KERNELS = good
    calls = dict(emulated.calls, kernels=sorted(emulated.calls["kernels"]))
    return {**(result or {}), "emulated": calls}


# ------------------------------------------------------------------ staging, errors, compile


def check_staged(rank, world, case):
    """check() with every tensor staged through the CPU, as MPS tensors are for gloo (_comm.FORCE_STAGING)."""
    _comm.FORCE_STAGING = True
    try:
        return check(rank, world, case)
    finally:
        _comm.FORCE_STAGING = False


def error_of(rank, world, bad_rank, kwargs_json):
    """The ValueError each rank raises when `bad_rank`'s arguments are broken (-1: every rank's).

    kwargs_json describes the call: shapes and options, the broken ones on the bad rank only."""
    spec = dict(kwargs_json)
    broken = spec.pop("bad")
    if bad_rank in (-1, rank):
        spec.update(broken)
    n = spec.pop("n")
    q = torch.randn(1, spec.pop("Hq", 4), n, 8)
    k = torch.randn(1, spec.pop("Hkv", 2), spec.pop("nk", n), 8)
    if spec.pop("varlen", False):
        q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)
        spec["cu_seqlens"] = torch.tensor(spec.pop("cu"), dtype=torch.int32)
    try:
        fmd.attention(q, k, k, **spec)
    except ValueError as e:
        return str(e)
    return None


def compiled(rank, world, variant):
    """A function with a projection, the distributed attention and a reduction, under torch.compile (aot_eager):
    the same values as eager, and where dynamo breaks the graph."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    x = fmd.shard(torch.randn(1, 4, 24, 16, generator=g), 2, variant)
    w = torch.randn(16, 16, generator=g)

    def f(x):
        q = x @ w
        return fmd.attention(q, x, x, variant=variant, causal=True).sin().sum(-1)

    eager = f(x)
    explained = torch._dynamo.explain(f)(x)
    out = torch.compile(f, backend="aot_eager")(x)
    return {"equal": bool(torch.allclose(out, eager, atol=1e-6, rtol=1e-6)),
            "graph_breaks": explained.graph_break_count,
            "reasons": [str(r.reason)[:200] for r in explained.break_reasons]}


def balance(rank, world, variant, n):
    """The (query, key) pairs each rank computes in a causal forward: zigzag balances them, ring does not."""
    q = fmd.shard(torch.randn(1, 1, n, 8), 2, variant)
    before = _blocks.stats.copy()
    fmd.attention(q, q, q, variant=variant, causal=True)
    return (_blocks.stats - before)["score_pairs"]


def stats_of(rank, world, case):
    """What the forward alone did on this rank (_blocks.stats moved)."""
    data = _inputs(case)
    q, k, v = (fmd.shard(t, 2, case["variant"]) for t in data[:3])
    before = _blocks.stats.copy()
    fmd.attention(q, k, v, variant=case["variant"], **_options(case))
    return dict(_blocks.stats - before)


class _Probe:
    """_blocks.KERNELS with each block's backward followed by a count of the tensors alive in this process
    (gc's view: every tensor Python holds, the saved ones and the op's outputs included; not the op's
    scratch), outside a given set of storages, in units of one shard."""

    def __init__(self, kernels, exclude, shard_bytes):
        self.kernels, self.exclude, self.shard_bytes, self.peak = kernels, exclude, shard_bytes, 0.0

    def __getattr__(self, name):
        return getattr(self.kernels, name)

    def _count(self):
        import gc

        gc.collect()
        live = {}
        for o in gc.get_objects():
            if type(o) is torch.Tensor or type(o) is torch.nn.Parameter:
                st = o.untyped_storage()
                if st.data_ptr() not in self.exclude:
                    live[st.data_ptr()] = st.nbytes()
        self.peak = max(self.peak, sum(live.values()) / self.shard_bytes)

    def backward(self, *args):
        grads = self.kernels.backward(*args)
        self._count()
        return grads


def live_shards(rank, world, variant, n=64):
    """The ring's causal forward + backward on this rank's shards of (1, 4, n, 16) float32 q, k, v and grad_out:
    the most shard-sized buffers alive at any block's backward (besides q, k, v and grad_out's own), and how
    many receive buffers the ring allocated."""
    g = torch.Generator().manual_seed(2)
    q, k, v, do = (fmd.shard(torch.randn(1, 4, n, 16, generator=g), 2, variant).clone() for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    probe = _Probe(_blocks.KERNELS, {t.untyped_storage().data_ptr() for t in (q, k, v, do)},
                   q.numel() * q.element_size())
    good, _blocks.KERNELS = _blocks.KERNELS, probe
    before = _blocks.stats.copy()
    try:
        (fmd.attention(q, k, v, variant=variant, causal=True) * do).sum().backward()
    finally:
        _blocks.KERNELS = good
    moved = _blocks.stats - before
    return {"peak_shards": probe.peak, "receive_buffers": moved["receive_buffers"],
            "recomputed": moved["recomputed_blocks"], "grad_ok": bool(torch.isfinite(q.grad).all())}


# ------------------------------------------------------------------ transformers: a tiny Llama, trained sharded


def _llama(tf, attn):
    config = tf.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def train_llama(rank, world, variant, steps=3, n=48):
    """A tiny random Llama trained `steps` steps (SGD) with each rank holding its shard of the sequence
    (metal_ring_attention), and the same model trained in one process on the whole sequence (sdpa).
    Returns per step: both losses, and the largest gradient difference relative to the largest gradient."""
    import transformers as tf

    from flash_metal.distributed import hf as fmd_hf

    tf.logging.set_verbosity_error()
    name = fmd_hf.register(variant=variant)
    ours, ref = _llama(tf, name), _llama(tf, "sdpa")
    assert ours.config._attn_implementation == name
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (2, n), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)  # next tokens, shifted before sharding
    pos = torch.arange(n).expand(2, n)
    count = int((labels != -100).sum())
    mine = [fmd.shard(t, 1, variant) for t in (ids, labels, pos)]
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.5)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    ran = fmd_hf.calls[variant]
    history = []
    for _ in range(steps):
        logits = ours(input_ids=mine[0], position_ids=mine[2], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mine[1].flatten(), ignore_index=-100,
                                                 reduction="sum") / count
        loss.backward()
        for p in ours.parameters():
            dist.all_reduce(p.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        ref_loss = torch.nn.functional.cross_entropy(
            ref(input_ids=ids, position_ids=pos, use_cache=False).logits.flatten(0, 1), labels.flatten(),
            ignore_index=-100)
        ref_loss.backward()
        diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters()))
        scale = max(b.grad.abs().max().item() for b in ref.parameters())
        history.append((total.item(), ref_loss.item(), diff / scale))
        opt_ours.step(), opt_ref.step()
        opt_ours.zero_grad(), opt_ref.zero_grad()
    return {"history": history, "attention_calls": fmd_hf.calls[variant] - ran, "local_tokens": mine[0].shape[1]}


def llama_refuses(rank, world):
    """metal_ring_attention refuses what it cannot serve: a padding mask, attention dropout in training."""
    import transformers as tf

    from flash_metal.distributed import hf as fmd_hf

    tf.logging.set_verbosity_error()
    model = _llama(tf, fmd_hf.register(variant="ring"))
    ids = fmd.shard(torch.randint(3, 97, (1, 16)), 1, "ring")
    pos = fmd.shard(torch.arange(16)[None], 1, "ring")
    errors = []
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    for kwargs in (dict(attention_mask=mask), ):
        try:
            model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    try:
        model(input_ids=ids, position_ids=pos, use_cache=False)
        errors.append(None)
    except ValueError as e:
        errors.append(str(e))
    return errors
