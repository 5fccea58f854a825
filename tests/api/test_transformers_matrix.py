"""metal_attention (flash_metal/hf.py): every route with every option, against transformers' eager (issue 41).

Routes (flash_metal.hf.calls counts each): a 4-D bool mask ("mask"), a mask
wider than the keys ("mask_cropped"), no mask with Nq = Nk ("causal"), no
mask with Nq < Nk, a StaticCache prefill ("static_prefill"), one query
("decode"), and a padding-free packed row with cu_seq_lens ("varlen").
Options: gpt-oss's sinks (s_aux), a sliding window (the sliding_window
kwarg; in the mask too, as transformers builds it), Gemma 2's softcap, MLA
head dims (q/k 24, v 16, as the tiny DeepSeek-V3 here) and GQA (4 query
heads on 2 kv heads). Each cell calls the attention function directly with
tensors laid out as transformers hands them over (query a transposed view of
(B, N, H, D), key/value whole cache tensors, the sdpa_mask bool mask, the
kwargs each model passes) and checks, forward and backward (q, k, v and the
sinks' gradients):
  * the route counters: exactly the cell's route (and "sinks" /
    "value_head_dim" for those options) moved;
  * the semantics: transformers' own eager attention of the model that has
    the option (gpt-oss's eager for sinks, Gemma 2's for softcap, Llama's
    otherwise), run in float64, agrees with the float64 oracle given the
    cell's visibility (flash_metal.reference.attention_reference with the
    mask transformers means: causal, top-left for the StaticCache prefill,
    block-diagonal for packed rows, the window);
  * the precision: ours against that oracle by the 2x rule, the yardstick
    being the same eager attention in float32.
Rows that see no key (left padding) must be zeros; eager gives them a
uniform average there, so they are left out of the eager comparisons.

Cells that cannot occur are listed in NOT_PRODUCED with the reason, and a
recording of tiny whole models (Llama, Mistral, Gemma 2, gpt-oss,
DeepSeek-V3: padded and unpadded forwards, generate() with a DynamicCache
and a StaticCache, a packed batch) asserts the reasons: every call those
models make falls in a cell this file runs, and none in a skipped one; each
recorded call is then replayed against the same oracle.

Planted (flash_metal/hf.py, each run against this file and reverted):
  * the packed route without sinks=sinks (the escaped bug): fails
    test_cell[varlen-sinks] (out off by 1.77, tolerance 8.5e-6) and
    test_models_produce_only_cells_that_run (gpt-oss's packed calls: 0.33).
  * the mask route's sinks dropped: fails test_cell[mask-sinks],
    [mask_cropped-sinks] and the model recording; the decode route's softcap
    dropped: test_cell[decode-softcap]; the StaticCache prefill's crop
    removed: test_cell[static_prefill-*] (all four), its window variant and
    the recording; window_left = sliding_window (off by one):
    test_cell[varlen-window] and the recording (the mask routes carry the
    window in the mask).
Cost: ~6 s on 2 cores (the model recording ~1 s, the cells ~3 s, imports).
"""
import collections
import importlib.util
import itertools
import zlib

import pytest
import torch

import flash_metal
from flash_metal import testing
from flash_metal.reference import attention_reference
from prereqs import unavailable

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

ROUTES = ("mask", "mask_cropped", "causal", "static_prefill", "decode", "varlen")
OPTIONS = ("sinks", "window", "softcap", "mla", "gqa")
# The counters of flash_metal.hf.calls each route moves.
ROUTE_COUNTERS = {"mask": {"mask"}, "mask_cropped": {"mask", "mask_cropped"}, "causal": {"causal"},
                  "static_prefill": {"causal", "static_prefill"}, "decode": {"decode"}, "varlen": {"varlen"}}
OPTION_COUNTERS = {"sinks": {"sinks"}, "mla": {"value_head_dim"}}
# Cells transformers cannot produce, and why (asserted by test_models_produce_only_cells_that_run).
WINDOW_NEEDS_A_MASK = (
    "transformers hands over no mask only when the keys are fewer than the sliding window "
    "(masking_utils._ignore_causal_mask_sdpa returns False once kv_length >= local_attention_size), so a window "
    "reaches this route only where it cannot bind, and then it changes nothing; a binding one always comes with "
    "the mask route (test_transformers.py::test_no_mask_routes_apply_the_sliding_window checks a binding window "
    "here anyway)")
NOT_PRODUCED = {("causal", "window"): WINDOW_NEEDS_A_MASK, ("static_prefill", "window"): WINDOW_NEEDS_A_MASK,
                ("decode", "window"): WINDOW_NEEDS_A_MASK}
CELLS = [c for c in itertools.product(ROUTES, OPTIONS) if c not in NOT_PRODUCED]
D, D_MLA, D_V_MLA, WINDOW, SOFTCAP = 16, 24, 16, 4, 2.0


@pytest.fixture(scope="module")
def tf():
    if importlib.util.find_spec("transformers") is None:
        unavailable("transformers is not installed (pip install '.[hf]')")
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


class _Module(torch.nn.Module):
    """The attention module as the functions read it: num_key_value_groups, is_causal, training, and gpt-oss's
    sinks (its eager attention reads them from the module; metal_attention from s_aux)."""

    def __init__(self, groups, sinks=None):
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.sinks = groups, True, sinks
        self.eval()


def _gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _visibility(route, b, nq, nk, window, cu=None):
    """(B, 1, Nq, Nk) bool: which keys each query sees, as transformers means the route; key position j,
    query position nk - nq + i (the cache's newest rows), but top-left (i) for the StaticCache prefill."""
    i = torch.arange(nq).view(-1, 1)
    j = torch.arange(nk).view(1, -1)
    pos = i if route == "static_prefill" else i + nk - nq
    see = j <= pos
    if window:
        see &= j > pos - window
    if cu is not None:  # packed: only within its own sequence
        seq = torch.bucketize(torch.arange(nk), cu[1:], right=True)
        see &= seq.view(1, -1) == seq.view(-1, 1)
    return see.expand(b, 1, nq, nk).clone()


def make_cell(route, option):
    """(module, query, key, value, attention_mask, kwargs, visibility) shaped as transformers passes them."""
    g = _gen(route, option)
    hq, hkv = (4, 2) if option == "gqa" else (2, 2)
    d, dv = (D_MLA, D_V_MLA) if option == "mla" else (D, D)
    b, nq, nk = {"mask": (2, 9, 9), "mask_cropped": (2, 5, 9), "causal": (2, 9, 9), "static_prefill": (1, 6, 11),
                 "decode": (2, 1, 10), "varlen": (1, 15, 15)}[route]
    window = WINDOW if option == "window" else None
    cu = torch.tensor([0, 3, 10, 15], dtype=torch.int32) if route == "varlen" else None
    amp = 3.0 if option == "softcap" else 1.0  # scores large enough that the cap bends them
    # query: a (B, N, H, D) projection viewed as (B, H, N, D); key/value: the cache's (B, Hkv, Nk, D) tensors.
    q = (torch.randn(b, nq, hq, d, generator=g) * amp).transpose(1, 2)
    k = torch.randn(b, hkv, nk, d, generator=g) * amp
    v = torch.randn(b, hkv, nk, dv, generator=g)
    if route == "static_prefill":  # the cache's rows past Nq are not filled yet: garbage that must not be read
        k[:, :, nq:] = 1e3
        v[:, :, nq:] = 1e4
    see = _visibility(route, b, nq, nk, window, cu)
    mask = None
    if route in ("mask", "mask_cropped"):
        see[1, :, :, :3] = False  # batch 1 left-padded by 3 keys: its first 3 query rows see nothing
        mask = see
        if route == "mask_cropped":  # a cache wider than the keys: columns past Nk belong to no key
            mask = torch.cat([see, torch.rand(b, 1, nq, 4, generator=g) > 0.5], dim=-1)
    kwargs = {"dropout": 0.0, "scaling": d ** -0.5, "position_ids": torch.arange(nk - nq, nk).expand(b, nq)}
    if route == "varlen":
        mask = see  # transformers hands the packed row's block-diagonal mask over too; the route reads cu_seq_lens
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7,
                      position_ids=torch.cat([torch.arange(n) for n in (3, 7, 5)]).view(1, -1))
    if window:
        kwargs["sliding_window"] = window
    if option == "softcap":
        kwargs["softcap"] = SOFTCAP
    sinks = None
    if option == "sinks":
        sinks = torch.randn(hq, generator=g) * 1.5
        kwargs["s_aux"] = sinks
    return _Module(hq // hkv), q, k, v, mask, kwargs, see


def _eager(tf, kwargs):
    """transformers' eager attention of the model that has the option."""
    if kwargs.get("s_aux") is not None:
        return tf.models.gpt_oss.modeling_gpt_oss.eager_attention_forward
    if kwargs.get("softcap"):
        return tf.models.gemma2.modeling_gemma2.eager_attention_forward
    return tf.models.llama.modeling_llama.eager_attention_forward


def _run(fn, module, q, k, v, mask, kwargs, grad_w, dtype):
    """fn on leaves of q, k, v (and sinks) in dtype: (out (B, Nq, Hq, Dv), grads of (out * grad_w).sum())."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q.transpose(1, 2), k, v)]
    kw = dict(kwargs)
    sinks = kw.get("s_aux")
    if sinks is not None:
        leaves.append(sinks.detach().to(dtype).requires_grad_(True))
        kw["s_aux"] = leaves[3]
    mod = _Module(module.num_key_value_groups, kw.get("s_aux"))
    out, _ = fn(mod, leaves[0].transpose(1, 2), leaves[1], leaves[2], mask, **kw)
    grads = torch.autograd.grad((out * grad_w.to(dtype)).sum(), leaves, allow_unused=True)
    return out.detach(), [None if x is None else x.detach() for x in grads]


def _oracle(q, k, v, kwargs, see, grad_w):
    """The float64 oracle with the cell's visibility: (out (B, Nq, Hq, Dv), grads), by autograd."""
    leaves = [t.detach().double().requires_grad_(True) for t in (q.transpose(1, 2), k, v)]
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        leaves.append(sinks.detach().double().requires_grad_(True))
    out, _ = attention_reference(leaves[0].transpose(1, 2), leaves[1], leaves[2], False, kwargs["scaling"],
                                 attn_mask=see, softcap=kwargs.get("softcap") or 0.0,
                                 sinks=leaves[3] if sinks is not None else None)
    out = out.transpose(1, 2)
    grads = torch.autograd.grad((out * grad_w.double()).sum(), leaves)
    return out.detach(), [x.detach() for x in grads]


def _additive(mask):
    """eager_mask's form of a bool mask: 0 where attended, float32's lowest value elsewhere (the model's dtype's:
    the float64 runs keep float32's, which the eager softmaxes, computed in float32, can still hold)."""
    return lambda dtype: torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(torch.float32).min)


def check_call(tf, module, q, k, v, mask, kwargs, see, routes, grads=True):
    """The checks of one call (see the module docstring): route counters, eager = oracle, ours by the 2x rule."""
    b, hq, nq, _ = q.shape
    dv = v.shape[-1]
    sees_a_key = see.any(-1).view(b, 1, nq, 1).transpose(1, 2)  # (B, Nq, 1, 1)
    g = _gen("grad_out", tuple(q.shape), tuple(v.shape))
    # Rows that see no key carry no gradient weight: eager's uniform average there is meaningless.
    grad_w = torch.randn(b, nq, hq, dv, generator=g) * sees_a_key
    before = collections.Counter(flash_metal.hf.calls)
    if grads:
        ours, our_grads = _run(flash_metal.hf.metal_attention_forward, module, q, k, v, mask, kwargs, grad_w,
                               torch.float32)
    else:
        with torch.no_grad():
            ours = flash_metal.hf.metal_attention_forward(module, q, k, v, mask, **kwargs)[0]
    moved = flash_metal.hf.calls - before
    assert set(moved) == routes, f"routes that ran: {dict(moved)}; expected {sorted(routes)}"
    ref, ref_grads = _oracle(q, k, v, kwargs, see, grad_w)
    # Eager gets the visibility as eager_mask would build it (it has no causal or packed route of its own).
    eager, emask = _eager(tf, kwargs), _additive(see)
    e64, e64_grads = _run(eager, module, q, k, v, emask(torch.float64), kwargs, grad_w, torch.float64)
    e32, e32_grads = _run(eager, module, q, k, v, emask(torch.float32), kwargs, grad_w, torch.float32)
    rows = sees_a_key.expand_as(ref)
    # transformers' eager and the oracle mean the same (eager's softmax runs in float32: 1e-5 is its rounding).
    torch.testing.assert_close(e64[rows], ref[rows], rtol=1e-5, atol=1e-5, msg="eager vs the oracle")
    assert (ours[~rows] == 0).all(), "a query row that sees no key must be zeros"
    names = ("out",) + (("grad_q", "grad_k", "grad_v", "grad_sinks") if grads else ())
    pairs = [(ours, ref, e32, rows)] + ([(a, r, e, None) for a, r, e in zip(our_grads, ref_grads, e32_grads)]
                                       if grads else [])
    for name, (got, want, pt, keep) in zip(names, pairs):
        assert got is not None, f"{name}: no gradient at all (the input never reached the op)"
        if keep is not None:
            got, want, pt = got[keep], want[keep], pt[keep]
        err, pt_err = (got.double() - want).abs().max().item(), (pt.double() - want).abs().max().item()
        tol = 2 * pt_err + testing.rounding_floor(want, torch.float32) + testing.fp32_floor(want, k.shape[2])
        assert err <= tol, f"{name}: error {err:.3g} > tolerance {tol:.3g} (eager float32: {pt_err:.3g})"
    if grads:
        for name, (a, e) in zip(names[1:], zip(e64_grads, ref_grads)):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=f"eager's {name} vs the oracle's")


def _expected_counters(route, options):
    out = set(ROUTE_COUNTERS[route])
    for o in options:
        out |= OPTION_COUNTERS.get(o, set())
    return out


def test_matrix_is_complete():
    # Every (route, option) pair is run here or skipped with its reason; nothing is silently absent.
    assert set(CELLS) | set(NOT_PRODUCED) == set(itertools.product(ROUTES, OPTIONS))
    assert not set(CELLS) & set(NOT_PRODUCED) and all(len(why) > 80 for why in NOT_PRODUCED.values())
    assert set(ROUTE_COUNTERS) == set(ROUTES)
    # Every route counter is one flash_metal/hf.py increments.
    import inspect

    source = inspect.getsource(flash_metal.hf.metal_attention_forward)
    for counter in set().union(*ROUTE_COUNTERS.values(), *OPTION_COUNTERS.values()):
        assert f'calls["{counter}"] += 1' in source, counter


@pytest.mark.parametrize("route,option", CELLS, ids=[f"{r}-{o}" for r, o in CELLS])
def test_cell(tf, route, option):
    module, q, k, v, mask, kwargs, see = make_cell(route, option)
    check_call(tf, module, q, k, v, mask, kwargs, see, _expected_counters(route, [option]))


@pytest.mark.parametrize("route", ["causal", "static_prefill", "decode"])
def test_mask_free_routes_with_the_window_transformers_passes_there(tf, route):
    # The window that reaches these routes is longer than the keys (NOT_PRODUCED): it must change nothing.
    module, q, k, v, mask, kwargs, see = make_cell(route, "gqa")
    kwargs["sliding_window"] = k.shape[2] + 1
    check_call(tf, module, q, k, v, mask, kwargs, see, _expected_counters(route, ["gqa"]))


# ---- whole tiny models: what transformers really hands over ------------------------------------


def _record_model_calls(tf, monkeypatch):
    """Every call five tiny models make to metal_attention, with its route: [(kind, routes, options, call)]."""
    import test_transformers as T
    from transformers import AttentionInterface

    real = flash_metal.hf.metal_attention_forward
    calls = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        before = collections.Counter(flash_metal.hf.calls)
        result = real(module, query, key, value, attention_mask, **kwargs)
        moved = set(flash_metal.hf.calls - before)
        kw = {n: (t.detach().clone() if isinstance(t, torch.Tensor) else t) for n, t in kwargs.items()}
        calls.append((kind, moved, (_Module(query.shape[1] // key.shape[1]), *(
            None if t is None else t.detach().clone() for t in (query, key, value, attention_mask)), kw)))
        return result

    monkeypatch.setitem(AttentionInterface._global_mapping, flash_metal.hf.NAME, recording)
    g = torch.Generator().manual_seed(41)
    for kind in ("llama", "mistral", "gemma2", "gpt_oss", "deepseek_v3"):
        ours, _ = T._models(tf, kind, "eager")
        with torch.no_grad():
            for padding in ("right", "none"):
                ids, mask = T._batch(padding, g)
                ours(input_ids=ids, attention_mask=mask)
            for cache in ("dynamic", "static"):
                ids, mask = T._batch("none", g)
                kw = dict(max_new_tokens=2, do_sample=False, attention_mask=mask[:1], pad_token_id=0)
                ours.generate(ids[:1], **kw, **({"cache_implementation": "static"} if cache == "static" else {}))
            lengths = (5, 11, 8)
            cu = torch.tensor([0, 5, 16, 24], dtype=torch.int32)
            ours(input_ids=torch.randint(3, 97, (1, 24), generator=g), use_cache=False,
                 position_ids=torch.cat([torch.arange(n) for n in lengths]).view(1, -1), cu_seq_lens_q=cu,
                 cu_seq_lens_k=cu, max_length_q=11, max_length_k=11)
    return calls


def _options_of(query, key, value, kwargs):
    out = [o for o, present in (("sinks", kwargs.get("s_aux") is not None), ("softcap", bool(kwargs.get("softcap"))),
                                ("mla", value.shape[-1] != query.shape[-1]), ("gqa", query.shape[1] != key.shape[1]))
           if present]
    window = kwargs.get("sliding_window")
    if window and window <= key.shape[2]:  # a window that can bind (one longer than the keys changes nothing)
        out.append("window")
    return out


def _route_of(moved):
    routes = [r for r in ROUTES if ROUTE_COUNTERS[r] == moved & set().union(*ROUTE_COUNTERS.values())]
    assert len(routes) == 1, moved
    return routes[0]


def test_models_produce_only_cells_that_run(tf, monkeypatch):
    calls = _record_model_calls(tf, monkeypatch)
    cells = set()
    for kind, moved, (module, q, k, v, mask, kwargs) in calls:
        route = _route_of(moved)
        options = _options_of(q, k, v, kwargs)
        cells |= {(route, o) for o in options}
        for o in options:
            assert (route, o) not in NOT_PRODUCED, f"{kind} produced {(route, o)}: {NOT_PRODUCED[(route, o)]}"
        assert moved == _expected_counters(route, options), (kind, moved)
    # The tiny models reach every route but the cropped mask (transformers 5.x builds masks as wide as the keys),
    # and every option on some route.
    assert {r for r, _ in cells} >= {"mask", "causal", "static_prefill", "decode", "varlen"}
    assert {o for _, o in cells} == set(OPTIONS)
    assert cells <= set(CELLS)
    # Each recorded call against the oracle (forward): what the models really hand over, every route.
    for kind, moved, (module, q, k, v, mask, kwargs) in calls:
        route = _route_of(moved)
        b, _, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        if mask is not None and route != "varlen":
            see = mask[..., :nk].clone()
        else:
            cu = kwargs.get("cu_seq_lens_k")
            see = _visibility(route, b, nq, nk, kwargs.get("sliding_window"), cu)
        check_call(tf, module, q, k, v, mask, kwargs, see, moved, grads=False)
