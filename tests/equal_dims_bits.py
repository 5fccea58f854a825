"""Equal head dims stay bit-identical across a change of the Metal forward or backward (issue 20 section 2).

Not a pytest module: a tool run twice, once under each build, e.g.

  # the old build: its installed package, its tests/ (backends.py, the emulator) and shaders/
  FLASH_METAL_EMULATOR_CACHE=/tmp/emu-old OLD/.venv/bin/python tests/equal_dims_bits.py OLD/tests save /tmp/bits
  # the new build, in this tree
  .venv/bin/python tests/equal_dims_bits.py tests check /tmp/bits

(`plans-save` / `plans-check`: the same without running any kernel, the plans only.)
`save` runs a fixed set of equal-dims forward plans (prefill aligned with the
dense loader and padded without it, varlen, decode one pass, split decode,
the paged decode; the three dtypes; causal, window, softcap, masks, sinks,
GQA), and equal-dims backward plans (flash_backward_dq + flash_backward_dkdv
with and without feature parts, dense and padded loaders, grad_lse, options,
varlen, sinks), through the emulator's fast build and stores the inputs, the plans
(kernel names, grids, threadgroups, function constants, params bytes, the
reason) and the outputs. `check` reruns the same inputs and requires the
same kernels, launch shapes and constants, the same params bytes over the
old block's length (anything after must be head_dim_v = head_dim and a
zero pad), and outputs equal bit for bit.
"""
import os
import struct
import sys

import torch

# Byte offset of head_dim in AttentionParams (shaders/common/params.h): after 19 int64 strides and 6 int32 sizes.
HEAD_DIM_OFFSET = 19 * 8 + 6 * 4


def _cases():
    g = torch.Generator().manual_seed(20)
    r = lambda *s, dt=torch.float32: torch.randn(*s, generator=g).to(dt)  # noqa: E731
    out = []
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        for d in (64, 40, 128):
            q, k, v = r(2, 4, 45, d, dt=dt), r(2, 2, 50, d, dt=dt), r(2, 2, 50, d, dt=dt)
            out.append(("attn", f"prefill-{d}-{dt}", (q, k, v, True, None, "prefill"), {}))
            out.append(("attn", f"prefill-opts-{d}-{dt}", (q, k, v, False, None, "auto"),
                        dict(softcap=3.0, attn_mask=r(2, 1, 45, 50) > 0, sinks=r(4))))
            qd = r(2, 8, 3, d, dt=dt)
            kd, vd = r(2, 2, 300, d, dt=dt), r(2, 2, 300, d, dt=dt)
            out.append(("attn", f"decode-{d}-{dt}", (qd, kd, vd, True, None, "decode"), dict(window_left=40)))
            out.append(("attn", f"split-{d}-{dt}", (qd, kd, vd, True, None, "decode_split"), dict(sinks=r(8))))
        cu = torch.tensor([0, 5, 5, 40], dtype=torch.int32)
        qv, kv, vv = r(40, 4, 64, dt=dt), r(40, 2, 64, dt=dt), r(40, 2, 64, dt=dt)
        out.append(("varlen", f"varlen-{dt}", (qv, kv, vv, cu, cu, 35, 35, True), dict(window_left=9)))
        kc, vc = r(9, 16, 2, 64, dt=dt), r(9, 16, 2, 64, dt=dt)
        table = torch.tensor([[3, 0, 7], [1, 8, 2]], dtype=torch.int32)
        lens = torch.tensor([37, 20], dtype=torch.int32)
        for impl in ("decode", "decode_split"):
            out.append(("kvcache", f"paged-{impl}-{dt}", (r(2, 4, 1, 64, dt=dt), kc, vc, lens, table, True, None,
                                                             impl), {}))
    return out + _backward_cases()


def _backward_cases():
    # Equal-dims backward plans (the kernels that take head_dim_v since issue
    # 20 section 2): 64 (dense loader; float32 in 2 feature parts), 40 (padded
    # in the 64 bucket), 128 (parts in every dtype), 192 float16 (split-K
    # parts); out and lse from the CPU forward (unchanged by a Metal change).
    import flash_metal

    g = torch.Generator().manual_seed(21)
    r = lambda *s, dt=torch.float32: torch.randn(*s, generator=g).to(dt)  # noqa: E731
    out = []
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        for d, kw in ((64, {}), (40, dict(softcap=3.0)), (128, dict(window_left=9, sinks=True))):
            q, k, v = r(1, 4, 29, d, dt=dt), r(1, 2, 35, d, dt=dt), r(1, 2, 35, d, dt=dt)
            kw = dict(kw)
            if kw.pop("sinks", False):
                kw["sinks"] = r(4)
            o, lse = flash_metal.attention_with_lse(q, k, v, True, **kw)
            glse = r(1, 4, 29) if d == 64 else None
            out.append(("bwd", f"backward-{d}-{dt}", (r(1, 4, 29, d, dt=dt), q, k, v, o, lse, True, glse), kw))
        cu = torch.tensor([0, 7, 7, 30], dtype=torch.int32)
        qv, kv, vv = r(30, 4, 64, dt=dt), r(30, 2, 64, dt=dt), r(30, 2, 64, dt=dt)
        o, lse = flash_metal.attention_varlen_with_lse(qv, kv, vv, cu, cu, 23, 23, True, window_left=5)
        out.append(("bwd", f"backward-varlen-{dt}", (r(30, 4, 64, dt=dt), qv, kv, vv, o, lse, True, None),
                    dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=23, max_seqlen_k=23, window_left=5)))
    q, k, v = r(1, 2, 21, 192, dt=torch.float16), r(1, 2, 19, 192, dt=torch.float16), r(1, 2, 19, 192,
                                                                                       dt=torch.float16)
    o, lse = flash_metal.attention_with_lse(q, k, v, False)
    out.append(("bwd", "backward-192-f16", (r(1, 2, 21, 192, dt=torch.float16), q, k, v, o, lse, False, None), {}))
    return out


def _run(backends, kind, args, kw, emulate=True):
    import flash_metal

    res = (torch.zeros(1), torch.zeros(1))  # emulate=False: plans only
    if kind == "attn":
        q, k, v, causal, scale, impl = args
        plan = flash_metal.explain(q, k, v, causal, scale, impl, **kw)
        if emulate:
            res = backends.emulated_metal_attention(q, k, v, causal, scale, impl, **kw)
    elif kind == "varlen":
        q, k, v, cq, ck, mq, mk, causal = args
        plan = flash_metal.explain(q, k, v, causal, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq,
                                   max_seqlen_k=mk, **kw)
        if emulate:
            res = backends.emulated_metal_varlen(q, k, v, cq, ck, mq, mk, causal, **kw)
    elif kind == "bwd":
        go, q, k, v, o, lse, causal, glse = args
        plan = flash_metal.explain(q, k, v, causal, None, "auto", backward=True, grad_out=go, out=o, lse=lse,
                                   grad_lse=glse, **kw)
        if emulate:
            grads = backends.emulated_metal_attention_backward(go, q, k, v, o, lse, causal, None, glse, **kw)
            res = (torch.cat([t.reshape(-1).float() for t in grads[:3]]),
                   grads[3] if len(grads) > 3 else torch.zeros(1))
    else:
        q, kc, vc, lens, table, causal, scale, impl = args
        plan = flash_metal.explain(q, kc, vc, causal, scale, impl, block_table=table, cache_seqlens=lens)
        if emulate:
            res = backends.emulated_metal_kvcache(q, kc, vc, lens, table, causal, scale, impl)
    launches = [dict(name=d.kernel_name, grid=tuple(d.grid), tg=tuple(d.threadgroup),
                     fc=list(d.function_constants), tgm=d.threadgroup_memory, params=bytes(d.params.tolist()))
                for d in plan.dispatches]
    return dict(reason=plan.reason, launches=launches, out=res[0].clone(), lse=res[1].clone())


def main():
    tests_dir, mode, path = sys.argv[1], sys.argv[2], sys.argv[3]
    sys.path.insert(0, os.path.abspath(tests_dir))
    import backends

    cases = _cases()
    emulate = not mode.startswith("plans-")  # plans-save / plans-check: the host's plans only, no kernel run
    mode = mode.replace("plans-", "")
    if mode == "save":
        torch.save({name: _run(backends, kind, args, kw, emulate) for kind, name, args, kw in cases}, path)
        print(f"saved {len(cases)} cases to {path}")
        return 0
    old = torch.load(path)
    bad = []
    for kind, name, args, kw in cases:
        new, ref = _run(backends, kind, args, kw, emulate), old[name]
        for a, b in zip(new["launches"], ref["launches"]):
            n = len(b["params"])
            tail = a["params"][n:]
            (head_dim,) = struct.unpack_from("<i", a["params"], HEAD_DIM_OFFSET)
            ok_tail = tail == struct.pack("<2i", head_dim, 0) or tail == b""
            if (a["name"], a["grid"], a["tg"], a["fc"], a["tgm"]) != (b["name"], b["grid"], b["tg"], b["fc"], b["tgm"]) \
                    or a["params"][:n] != b["params"] or not ok_tail:
                bad.append(f"{name}: launch {a['name']} differs")
        if len(new["launches"]) != len(ref["launches"]) or new["reason"] != ref["reason"]:
            bad.append(f"{name}: plan differs")
        if not (torch.equal(new["out"].view(torch.uint8), ref["out"].view(torch.uint8))
                and torch.equal(new["lse"].view(torch.uint8), ref["lse"].view(torch.uint8))):
            bad.append(f"{name}: outputs differ")
    print(f"checked {len(cases)} cases: " + ("all bit-identical" if not bad else "\n".join(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
