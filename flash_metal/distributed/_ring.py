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
import math
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


def _take_or_add(acc: Optional[Tensor], g: Tensor, start: int, n: int, shape) -> Tensor:
    """acc (float32, `shape`) with g added at rows [start, start + n); acc None: g itself becomes the
    accumulator when it covers every row (no zeros, no copy: the op's float32 output is ours), else zeros."""
    if acc is None:
        if start == 0 and n == shape[2] and tuple(g.shape) == tuple(shape):
            return g.float()
        acc = torch.zeros(shape, dtype=torch.float32, device=g.device)
    _rows(acc, start, n).add_(g)
    return acc


class _Slots:
    """Two receive buffers for one kind of tensor, reused every other step (double buffering).

    What is received at step s is read, and passed on, at step s + 1; that
    send has completed by the end of step s + 1, so the buffer takes the
    receive of step s + 2. Each slot is one flat storage of the largest
    shard of any rank (shards may be uneven), viewed as the shape at hand.
    """

    def __init__(self, g: Group, numel: int, dtype):
        self.g, self.numel, self.dtype = g, numel, dtype
        self.flat: List[Optional[Tensor]] = [None, None]

    def take(self, step: int, shape) -> Tensor:
        i = step % 2
        if self.flat[i] is None:
            self.flat[i] = self.g.buffer((self.numel,), self.dtype)
            stats["receive_buffers"] += 1
        return self.flat[i][:math.prod(shape)].view(tuple(shape))

    def release(self) -> None:
        """No receive follows: a slot's storage lives on only while a tensor still views it."""
        self.flat = [None, None]


def _shard_shape(cfg: RingConfig, like: Tensor, src: int) -> Tuple[int, ...]:
    return (like.shape[0], like.shape[1], cfg.lengths[src], like.shape[3])


class _KVRing:
    """The K/V shard this rank holds (its own at step 0), passed on each step while the next one arrives."""

    def __init__(self, cfg: RingConfig, k: Tensor, v: Tensor):
        self.cfg = cfg
        self.k, self.v = k.contiguous(), v.contiguous()
        longest = max(cfg.lengths)
        self.slots = [_Slots(cfg.g, x.shape[0] * x.shape[1] * longest * x.shape[3], x.dtype) for x in (k, v)]
        self.pending: Optional[Exchange] = None

    def start(self, step: int) -> None:
        """Starts sending the shard held at `step` to the next rank and receiving the one held at step + 1."""
        cfg, g = self.cfg, self.cfg.g
        if step + 1 >= cfg.steps:
            for s in self.slots:
                s.release()
            return
        nxt, prv = (g.rank + 1) % g.size, (g.rank - 1) % g.size
        src = cfg.source(step + 1)
        ex = Exchange(g)
        ex.send(self.k, nxt, TAG_K)
        ex.send(self.v, nxt, TAG_V)
        for x, slot, tag in ((self.k, self.slots[0], TAG_K), (self.v, self.slots[1], TAG_V)):
            shape = _shard_shape(cfg, x, src)
            ex.recv(shape, x.dtype, prv, tag, into=slot.take(step, shape))
        self.pending = ex.start()

    def advance(self) -> None:
        """Waits for this step's exchange; the received shard becomes the current one (the sent one is let go)."""
        if self.pending is not None:
            self.k, self.v = self.pending.wait()
            self.pending = None


def _forward_block(cfg: RingConfig, call: Call, q, k, v, acc: List[Optional[Tensor]]) -> None:
    """One block's (out, lse), merged into acc = [out (float32), lse]; the first block that covers every row
    becomes the accumulator itself."""
    t0 = time.perf_counter()
    out, lse = _block_forward(cfg, call, _rows(q, call.q0, call.nq), _rows(k, call.k0, call.nk),
                              _rows(v, call.k0, call.nk))
    stats["compute_s"] += time.perf_counter() - t0
    stats["block_calls"] += 1
    stats[f"{call.kind}_blocks"] += 1
    if call.kind == "dense":
        stats["score_pairs"] += _layout.Block(*call[1:7]).visible() * q.shape[0] * q.shape[1]
    B, H, N = q.shape[:3]
    if acc[0] is None:
        if call.q0 == 0 and call.nq == N and out.is_contiguous():
            acc[0], acc[1] = out.float(), lse.float()
            return
        acc[0] = torch.zeros(B, H, N, v.shape[3], dtype=torch.float32, device=q.device)
        acc[1] = torch.full((B, H, N), float("-inf"), dtype=torch.float32, device=q.device)
    _blocks.merge(_rows(acc[0], call.q0, call.nq), _rows(acc[1], call.q0, call.nq), out, lse)


def ring_forward(cfg: RingConfig, q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    B, H, N = q.shape[:3]
    ring = _KVRing(cfg, k, v)
    acc: List[Optional[Tensor]] = [None, None]
    for step in range(cfg.steps):
        stats["ring_steps"] += 1
        ring.start(step)
        calls = step_calls(cfg, cfg.source(step))
        if not calls:
            stats["idle_steps"] += 1
        for call in calls:
            _forward_block(cfg, call, q, ring.k, ring.v, acc)
        ring.advance()
    del ring
    if acc[0] is None:  # no block at all (an empty shard, or every row outside the window)
        acc = [torch.zeros(B, H, N, v.shape[3], dtype=torch.float32, device=q.device),
               torch.full((B, H, N), float("-inf"), dtype=torch.float32, device=q.device)]
    acc_out, acc_lse = acc
    _blocks.add_sinks(acc_out, acc_lse, sinks)
    return acc_out.to(q.dtype), acc_lse


def whole_call(cfg: RingConfig, n: int) -> Optional[Call]:
    """The one call that is this rank's whole attention (one ring step, one block over every row and key), or
    None. Its forward is the op's, out and lse unmerged: the backward hands them to the op's backward as they
    are, with no block forward run again (one process, or a window that keeps every rank home)."""
    if cfg.steps != 1:
        return None
    calls = step_calls(cfg, cfg.g.rank)
    if len(calls) == 1 and calls[0][1:5] == (0, n, 0, n) and n > 0:
        return calls[0]
    return None


def _backward_block(cfg: RingConfig, call: Call, saved, k, v, whole: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """One block's share of dQ, dK, dV (as the op returns them; (B, H, n, D) views for varlen blocks), through
    the merge's own derivative.

    The block's forward runs again, for its own (out_b, lse_b); the merge
    out = sum_b w_b out_b, lse = logsumexp_b lse_b (w_b = e^(lse_b - lse))
    hands it d out_b = w_b dO and d lse_b = w_b (rowsum(dO out_b) -
    rowsum(dO out) + d lse), and the op's backward takes those with the
    block's own out_b and lse_b: exactly the op's contract. (Handing it the
    merged lse and the final out instead, as ring-flash-attention does with
    flash-attn, would save that forward, but flash_metal's float32 backward
    renormalizes each row's P over the keys it is given (issue 40,
    csrc/cpu/backward_precise.h), which is only right for the block's own lse;
    and in that renormalized path it replaces rowsum(dO' o out') by its own
    rowsum(P dP), so d lse_b must carry rowsum(dO out_b): out_b is needed.)
    whole (whole_call): out and lse are the block's own; nothing is run again.
    """
    grad_out, q, out, lse, grad_lse, delta = saved
    r = lambda x: _rows(x, call.q0, call.nq)  # noqa: E731
    qs, ks, vs = r(q), _rows(k, call.k0, call.nk), _rows(v, call.k0, call.nk)
    t0 = time.perf_counter()
    if whole:
        out_b, lse_b, grad_out_b, grad_lse_b = out, lse, grad_out, grad_lse
    else:
        out_b, lse_b = _block_forward(cfg, call, qs, ks, vs)
        stats["recomputed_blocks"] += 1
        merged = r(lse)
        w = torch.where(torch.isfinite(lse_b) & torch.isfinite(merged), torch.exp(lse_b - merged), 0.0)
        go = r(grad_out)
        grad_lse_b = w * ((go.float() * out_b.float()).sum(-1) - r(delta))
        grad_out_b = (go.float() * w.unsqueeze(-1)).to(grad_out.dtype)
        del w, go, merged
    if call.kind == "dense":
        gq, gk, gv = _blocks.KERNELS.backward(grad_out_b, qs, ks, vs, out_b, lse_b, cfg.scale, grad_lse_b,
                                              call.window_left, call.window_right, cfg.softcap)
    else:
        cu, max_len = _cu(call, q.device)
        gq, gk, gv = _blocks.KERNELS.varlen_backward(
            _packed(grad_out_b), _packed(qs), _packed(ks), _packed(vs), _packed(out_b), lse_b[0], cu, max_len,
            cfg.causal, cfg.scale, None if grad_lse_b is None else grad_lse_b[0], call.window_left,
            call.window_right, cfg.softcap)
        gq, gk, gv = (g.transpose(0, 1).unsqueeze(0) for g in (gq, gk, gv))
    stats["compute_s"] += time.perf_counter() - t0
    stats["block_calls"] += 1
    return gq, gk, gv


def ring_backward(cfg: RingConfig, saved: Sequence[Tensor], k: Tensor, v: Tensor,
                  whole_ok: bool = True) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in float32 for this rank's shards. saved: (grad_out, q, out, lse, grad_lse): the final
    out and the merged lse (with the sinks). whole_ok: lse is the blocks' own (no sinks merged into it).

    Memory: K/V and the dK/dV accumulator of the shard held travel
    together. Each is received into one of two reused slots (_Slots); the
    accumulator is the receive buffer itself (each block's dK/dV is added
    into it in place) and is sent on from there. A dK/dV send is waited for
    one step later, not at once: a gloo send completes once its receiver has
    posted the receive, and the next rank posts it at the start of its next
    step. (Waiting for all of them only at the end would keep every step's
    accumulators alive: O(N) memory.) dQ is the first block's own dQ where
    that block covers every row.
    """
    g = cfg.g
    grad_out, q, out, lse, grad_lse = saved
    N = q.shape[2]
    one = whole_call(cfg, N) if whole_ok else None
    if one is not None:
        dq, dk, dv = _backward_block(cfg, one, (grad_out, q, out, lse, grad_lse, None), k, v, whole=True)
        return dq.float(), dk.float(), dv.float()
    # rowsum(dO out) - d lse, once for every block (see _backward_block).
    delta = (grad_out.float() * out.float()).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse
    saved = (grad_out, q, out, lse, grad_lse, delta)
    nxt, prv = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    ring = _KVRing(cfg, k, v)
    longest = max(cfg.lengths)
    slots = [_Slots(g, x.shape[0] * x.shape[1] * longest * x.shape[3], torch.float32) for x in (k, v)]
    dq = None
    sends: List[Exchange] = []  # dK/dV sends in flight, oldest first
    dk_home = dv_home = None
    for step in range(cfg.steps):
        src = cfg.source(step)
        ring.start(step)
        shapes = [_shard_shape(cfg, x, src) for x in (k, v)]
        # The dK/dV accumulator of src's shard, from the rank that held it at the previous step, received
        # into a slot in which this rank's blocks then add their share.
        incoming = None
        if step > 0:
            incoming = Exchange(g)
            incoming.recv(shapes[0], torch.float32, prv, TAG_DK, into=slots[0].take(step, shapes[0]))
            incoming.recv(shapes[1], torch.float32, prv, TAG_DV, into=slots[1].take(step, shapes[1]))
            incoming.start()
        acc: List[Optional[Tensor]] = [None, None]
        for call in step_calls(cfg, src):
            gq, gk, gv = _backward_block(cfg, call, saved, ring.k, ring.v)
            dq = _take_or_add(dq, gq, call.q0, call.nq, q.shape)
            del gq
            if acc[0] is None and incoming is not None:
                acc = incoming.wait()
                incoming = None
            acc = [_take_or_add(a, x, call.k0, call.nk, s) for a, x, s in zip(acc, (gk, gv), shapes)]
            del gk, gv
        if incoming is not None:  # no block this step: the accumulator passes on as it came
            acc = incoming.wait()
        if acc[0] is None:  # step 0 without a block
            acc = [torch.zeros(s, dtype=torch.float32, device=q.device) for s in shapes]
        if step + 1 < cfg.steps:
            ex = Exchange(g)
            ex.send(acc[0], nxt, TAG_DK)
            ex.send(acc[1], nxt, TAG_DV)
            sends.append(ex.start())
        elif src == g.rank:
            dk_home, dv_home = acc
        else:
            # The last step: this accumulator is complete; send it home, and receive this rank's own (into a
            # buffer of its own: it is the gradient autograd keeps), once the slots are let go.
            for s in slots:
                s.release()
            while sends:
                sends.pop(0).wait()
            home = (g.rank + cfg.steps - 1) % g.size
            ex = Exchange(g)
            ex.send(acc[0], src, TAG_HOME_K)
            ex.send(acc[1], src, TAG_HOME_V)
            ex.recv(k.shape, torch.float32, home, TAG_HOME_K)
            ex.recv(v.shape, torch.float32, home, TAG_HOME_V)
            dk_home, dv_home = ex.start().wait()
        del acc
        ring.advance()
        while len(sends) > 1:  # the sends of earlier steps have been received by now, or soon will be
            sends.pop(0).wait()
    for ex in sends:
        ex.wait()
    if dq is None:
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    return dq, dk_home, dv_home
