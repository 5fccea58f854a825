"""Ring attention (plain and zigzag): K/V shards travel around the ring while the local blocks compute.

The algorithm is ring-flash-attention's (zhuzilin/ring-flash-attention:
ring_flash_attn.py, zigzag_ring_flash_attn.py), written here for
flash_metal's op and torch.distributed:

- Forward: at step s rank r holds the K/V shard of rank (r - s) mod P. It
  starts sending that shard to r + 1 (and receiving the next from r - 1)
  with batch_isend_irecv, computes its visible blocks against it while the
  transfer runs, and merges each block's (out, lse) into float32
  accumulators (_blocks.merge). Sinks are merged once, at the end.
- Backward: each block's backward needs the *merged* lse and the *final*
  out (its P is exp(s - lse), its Delta rowsum(dO * out)), so every block's
  gradients are exact pieces of the global ones. dQ stays home; the dK/dV
  accumulator of a shard travels with the shard, gaining each rank's
  contribution, and is sent home after the last step.

Tensors are (B, H, N, D) (varlen: B = 1, the packed rows as N).
"""
import time
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _blocks, _layout
from ._blocks import stats
from ._comm import TAG_DK, TAG_DV, TAG_HOME_K, TAG_HOME_V, TAG_K, TAG_V, Exchange, Group


class RingConfig(NamedTuple):
    g: Group
    variant: str
    lengths: Tuple[int, ...]  # every rank's local length
    band: _layout.Band
    causal: bool
    window_left: int
    window_right: int
    scale: float
    softcap: float
    cu_seqlens: Optional[Tuple[int, ...]]  # global document boundaries (varlen), or None
    steps: int  # ring steps (< P when a window leaves the far shards out of every rank's sight)

    def source(self, step: int) -> int:
        """Whose K/V shard this rank holds at `step`."""
        return (self.g.rank - step) % self.g.size


def _segments(cfg: RingConfig, rank: int) -> List[_layout.Segment]:
    return _layout.segments(cfg.variant, cfg.lengths, rank)


class Call(NamedTuple):
    kind: str  # "dense" or "varlen"
    q0: int
    nq: int
    k0: int
    nk: int
    window_left: int
    window_right: int
    cu: Optional[Tuple[int, ...]] = None  # varlen: local cu_seqlens over rows q0 .. q0 + nq (q0 == k0, nq == nk)


def step_calls(cfg: RingConfig, src: int) -> List[Call]:
    """The local op calls of this rank's queries against src's keys."""
    qsegs, ksegs = _segments(cfg, cfg.g.rank), _segments(cfg, src)
    if cfg.cu_seqlens is None:
        return [Call("dense", *b) for b in _layout.step_blocks(qsegs, ksegs, cfg.band)]
    calls = []
    for qs in qsegs:
        for ks in ksegs:
            if src == cfg.g.rank and qs == ks:
                if qs.length:
                    cu = tuple(_layout.varlen_diagonal(qs, cfg.cu_seqlens))
                    calls.append(Call("varlen", qs.offset, qs.length, qs.offset, qs.length, cfg.window_left,
                                      cfg.window_right, cu))
                continue
            part = _layout.varlen_crossing(qs, ks, cfg.cu_seqlens)
            if part is None:
                continue
            b = _layout.pair_block(_layout.Segment(part.qstart, part.nq, part.q0),
                                   _layout.Segment(part.kstart, part.nk, part.k0), cfg.band)
            if b is not None:
                calls.append(Call("dense", *b))
    return calls


def _rows(x: Tensor, start: int, n: int) -> Tensor:
    return x[:, :, start:start + n]


def _packed(x: Tensor) -> Tensor:
    """(1, H, T, D) -> the (T, H, D) view the varlen op takes (no copy)."""
    return x[0].transpose(0, 1)


def _cu(call: Call, device) -> Tuple[Tensor, int]:
    cu = torch.tensor(call.cu, dtype=torch.int32, device=device)
    return cu, max(b - a for a, b in zip(call.cu[:-1], call.cu[1:]))


def _block_forward(cfg: RingConfig, call: Call, qs: Tensor, ks: Tensor, vs: Tensor) -> Tuple[Tensor, Tensor]:
    """The op's forward on one block, as (B, H, n, D_v) and (B, H, n) (varlen calls unpacked)."""
    if call.kind == "dense":
        return _blocks.KERNELS.forward(qs, ks, vs, cfg.scale, call.window_left, call.window_right, cfg.softcap)
    cu, max_len = _cu(call, qs.device)
    out, lse = _blocks.KERNELS.varlen_forward(_packed(qs), _packed(ks), _packed(vs), cu, max_len, cfg.causal,
                                              cfg.scale, call.window_left, call.window_right, cfg.softcap)
    return out.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0)


def _forward_block(cfg: RingConfig, call: Call, q, k, v, acc_out, acc_lse) -> None:
    t0 = time.perf_counter()
    out, lse = _block_forward(cfg, call, _rows(q, call.q0, call.nq), _rows(k, call.k0, call.nk),
                              _rows(v, call.k0, call.nk))
    stats["compute_s"] += time.perf_counter() - t0
    stats["block_calls"] += 1
    stats[f"{call.kind}_blocks"] += 1
    if call.kind == "dense":
        stats["score_pairs"] += _layout.Block(*call[1:7]).visible() * q.shape[0] * q.shape[1]
    _blocks.merge(_rows(acc_out, call.q0, call.nq), _rows(acc_lse, call.q0, call.nq), out, lse)


def _send_next(cfg: RingConfig, step: int, k: Tensor, v: Tensor) -> Optional[Tuple[Exchange, int, int]]:
    """Starts passing (k, v) to the next rank and receiving the shard this rank holds at step + 1."""
    if step + 1 >= cfg.steps:
        return None
    g = cfg.g
    nxt, prv = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    n = cfg.lengths[cfg.source(step + 1)]
    ex = Exchange(g)
    ex.send(k, nxt, TAG_K)
    ex.send(v, nxt, TAG_V)
    ik = ex.recv(k.shape[:2] + (n, k.shape[3]), k.dtype, prv, TAG_K)
    iv = ex.recv(v.shape[:2] + (n, v.shape[3]), v.dtype, prv, TAG_V)
    return ex.start(), ik, iv


def ring_forward(cfg: RingConfig, q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    B, H, N = q.shape[:3]
    acc_out = torch.zeros(B, H, N, v.shape[3], dtype=torch.float32, device=q.device)
    acc_lse = torch.full((B, H, N), float("-inf"), dtype=torch.float32, device=q.device)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    for step in range(cfg.steps):
        stats["ring_steps"] += 1
        pending = _send_next(cfg, step, k_cur, v_cur)
        calls = step_calls(cfg, cfg.source(step))
        if not calls:
            stats["idle_steps"] += 1
        for call in calls:
            _forward_block(cfg, call, q, k_cur, v_cur, acc_out, acc_lse)
        if pending is not None:
            ex, ik, iv = pending
            got = ex.wait()
            k_cur, v_cur = got[ik], got[iv]
    _blocks.add_sinks(acc_out, acc_lse, sinks)
    return acc_out.to(q.dtype), acc_lse


def _backward_block(cfg: RingConfig, call: Call, saved, k, v, dq, dk, dv) -> None:
    """One block's share of dQ, dK, dV, through the merge's own derivative.

    The block's forward runs again, for its own (out_b, lse_b); the merge
    out = sum_b w_b out_b, lse = logsumexp_b lse_b (w_b = e^(lse_b - lse))
    hands it d out_b = w_b dO and d lse_b = w_b (rowsum(dO out_b) -
    rowsum(dO out) + d lse), and the op's backward takes those with the
    block's own out_b and lse_b: exactly the op's contract. (Handing it the
    merged lse and the final out instead, as ring-flash-attention does with
    flash-attn, would save that forward, but flash_metal's float32 backward
    renormalizes each row's P over the keys it is given (issue 40,
    csrc/cpu/backward_precise.h), which is only right for the block's own lse.)
    """
    grad_out, q, out, lse, grad_lse, delta = saved
    r = lambda x: _rows(x, call.q0, call.nq)  # noqa: E731
    qs, ks, vs = r(q), _rows(k, call.k0, call.nk), _rows(v, call.k0, call.nk)
    t0 = time.perf_counter()
    out_b, lse_b = _block_forward(cfg, call, qs, ks, vs)
    merged = r(lse)
    w = torch.where(torch.isfinite(lse_b) & torch.isfinite(merged), torch.exp(lse_b - merged), 0.0)
    go = r(grad_out).float()
    grad_out_b = (go * w.unsqueeze(-1)).to(grad_out.dtype)
    grad_lse_b = w * ((go * out_b.float()).sum(-1) - r(delta))
    if call.kind == "dense":
        gq, gk, gv = _blocks.KERNELS.backward(grad_out_b, qs, ks, vs, out_b, lse_b, cfg.scale, grad_lse_b,
                                              call.window_left, call.window_right, cfg.softcap)
    else:
        cu, max_len = _cu(call, q.device)
        gq, gk, gv = _blocks.KERNELS.varlen_backward(
            _packed(grad_out_b), _packed(qs), _packed(ks), _packed(vs), _packed(out_b), lse_b[0], cu, max_len,
            cfg.causal, cfg.scale, grad_lse_b[0], call.window_left, call.window_right, cfg.softcap)
        gq, gk, gv = (g.transpose(0, 1).unsqueeze(0) for g in (gq, gk, gv))
    stats["compute_s"] += time.perf_counter() - t0
    stats["block_calls"] += 1
    stats["recomputed_blocks"] += 1
    r(dq).add_(gq.float())
    _rows(dk, call.k0, call.nk).add_(gk.float())
    _rows(dv, call.k0, call.nk).add_(gv.float())


def ring_backward(cfg: RingConfig, saved: Sequence[Tensor], k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in float32 for this rank's shards. saved: (grad_out, q, out, lse, grad_lse): the final
    out and the merged lse (with the sinks).

    A dK/dV send is waited for one step later, not at once: a gloo send
    completes once its receiver has posted the receive, and the next rank
    posts it at the start of its next step. (Waiting for all of them only at
    the end would keep every step's accumulators alive: O(N) memory.)
    """
    g = cfg.g
    grad_out, q, out, lse, grad_lse = saved
    # rowsum(dO out) - d lse, once for every block (see _backward_block).
    delta = (grad_out.float() * out.float()).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse
    saved = (grad_out, q, out, lse, grad_lse, delta)
    nxt, prv = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    sends: List[Exchange] = []
    dk_home = dv_home = None
    for step in range(cfg.steps):
        src = cfg.source(step)
        pending = _send_next(cfg, step, k_cur, v_cur)
        # The dK/dV accumulator of src's shard, from the rank that held it at the previous step.
        incoming = None
        if step > 0:
            incoming = Exchange(g)
            incoming.recv(k_cur.shape, torch.float32, prv, TAG_DK)
            incoming.recv(v_cur.shape, torch.float32, prv, TAG_DV)
            incoming.start()
        dk = torch.zeros(k_cur.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v_cur.shape, dtype=torch.float32, device=q.device)
        for call in step_calls(cfg, src):
            _backward_block(cfg, call, saved, k_cur, v_cur, dq, dk, dv)
        if incoming is not None:
            got_dk, got_dv = incoming.wait()
            dk.add_(got_dk)
            dv.add_(got_dv)
        if step + 1 < cfg.steps:
            out = Exchange(g)
            out.send(dk, nxt, TAG_DK)
            out.send(dv, nxt, TAG_DV)
            sends.append(out.start())
        elif src == g.rank:
            dk_home, dv_home = dk, dv
        else:
            # The last step: this accumulator is complete; send it home, and receive this rank's own.
            home = (g.rank + cfg.steps - 1) % g.size
            out = Exchange(g)
            out.send(dk, src, TAG_HOME_K)
            out.send(dv, src, TAG_HOME_V)
            out.recv(k.shape, torch.float32, home, TAG_HOME_K)
            out.recv(v.shape, torch.float32, home, TAG_HOME_V)
            dk_home, dv_home = out.start().wait()
        if pending is not None:
            ex, ik, iv = pending
            kv = ex.wait()
            k_cur, v_cur = kv[ik], kv[iv]
        while len(sends) > 1:  # the sends of earlier steps have been received by now, or soon will be
            sends.pop(0).wait()
    for ex in sends:
        ex.wait()
    return dq, dk_home, dv_home
