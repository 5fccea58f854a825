"""torch.distributed plumbing: the group, ranks, point-to-point exchanges and all-to-all, staged through the CPU.

Everything goes through torch.distributed (gloo on CPU and across machines
over TCP); no transport of our own. gloo takes CPU tensors only, so a tensor
on another device (MPS) is copied to the CPU before it is sent and copied
back after it arrives ("staging"; cheap on unified memory, but a copy). On
a backend that takes the device's tensors, nothing is staged.
"""
import time
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ._blocks import stats

# Message tags, one per kind of message (gloo matches a receive to the send
# with the same peer and tag, in order).
TAG_K, TAG_V, TAG_DK, TAG_DV, TAG_HOME_K, TAG_HOME_V = 11, 12, 13, 14, 15, 16

# Test hook: stage every tensor through the CPU, even on the CPU (proves the
# staging path on a machine without MPS). Never set outside tests.
FORCE_STAGING = False


class Group:
    """A process group as the ring sees it: size, this rank, global ranks of its neighbours, staging."""

    def __init__(self, group: Optional["dist.ProcessGroup"], device: torch.device):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("flash_metal.distributed: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group('gloo') first (torchrun sets the environment)")
        self.group = group if group is not None else dist.group.WORLD
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.backend = dist.get_backend(self.group)
        self.stage = FORCE_STAGING or (self.backend == "gloo" and device.type != "cpu")
        self.device = device

    def global_rank(self, group_rank: int) -> int:
        if self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def wire(self, t: Tensor) -> Tensor:
        """t as it is sent: contiguous, on the CPU when staging."""
        if self.stage:
            stats["staged"] += 1
            return t.detach().to("cpu", copy=True).contiguous()
        return t.detach().contiguous()

    def buffer(self, shape, dtype) -> Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu" if self.stage else self.device)

    def arrived(self, t: Tensor) -> Tensor:
        return t.to(self.device) if self.stage else t

    def all_lengths(self, n: int, ok: bool = True) -> List[int]:
        """Every rank's local length (in rank order): one small all_gather.

        ok=False says this rank's inputs failed its own checks: every rank then
        raises (rather than the others waiting forever in the next collective).
        """
        if self.size == 1:
            return [n]
        mine = torch.tensor([n, int(ok)], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        bad = [r for r, x in enumerate(every) if not int(x[1])]
        if bad and ok:
            raise ValueError(f"flash_metal.distributed: the inputs of rank(s) {bad} of the group failed their checks "
                             "(their own error says why); every rank stops")
        return [int(x[0]) for x in every]


class Exchange:
    """One batch of point-to-point sends and receives (batch_isend_irecv), waited for later.

    Empty tensors are not sent (every rank knows every length, so both sides skip them).
    """

    def __init__(self, g: Group):
        self.g = g
        self.ops: List = []
        self.received: List[Tensor] = []
        self.works = None

    def send(self, t: Tensor, to: int, tag: int) -> None:
        if t.numel():
            w = self.g.wire(t)
            stats["bytes_sent"] += w.numel() * w.element_size()
            self.ops.append(dist.P2POp(dist.isend, w, self.g.global_rank(to), self.g.group, tag))

    def recv(self, shape: Sequence[int], dtype, frm: int, tag: int, into: Optional[Tensor] = None) -> int:
        """Posts a receive, into `into` (a reused buffer, contiguous, of that shape and dtype) or a new buffer;
        returns its index in what wait() returns."""
        if into is None:
            buf = self.g.buffer(tuple(shape), dtype)
        else:
            if tuple(into.shape) != tuple(shape) or into.dtype != dtype or not into.is_contiguous():
                raise AssertionError(f"receive buffer {tuple(into.shape)} {into.dtype} for {tuple(shape)} {dtype}")
            buf = into
        if buf.numel():
            self.ops.append(dist.P2POp(dist.irecv, buf, self.g.global_rank(frm), self.g.group, tag))
        self.received.append(buf)
        return len(self.received) - 1

    def start(self) -> "Exchange":
        if self.ops:
            self.works = dist.batch_isend_irecv(self.ops)
        return self

    def wait(self) -> List[Tensor]:
        """Waits for every transfer of the batch; returns the received tensors (on the device). The exchange
        then holds no tensor: a sent buffer is freed (or reused) as soon as its owner lets go of it."""
        if self.works:
            t0 = time.perf_counter()
            for w in self.works:
                w.wait()
            stats["wait_s"] += time.perf_counter() - t0
        received = [self.g.arrived(t) for t in self.received]
        self.works, self.ops, self.received = None, [], []
        return received


def _leading_ones(shape: Sequence[int], dim: int) -> bool:
    return all(n == 1 for n in shape[:dim])


def all_to_all(g: Group, x: Tensor, split_dim: int, split_sizes: Sequence[int], cat_dim: int,
               out_shapes: Sequence[Sequence[int]]) -> Tensor:
    """Sends part p of x (split along split_dim into split_sizes) to rank p, and returns the parts every rank
    sent here (shapes out_shapes[p]) joined along cat_dim: one all_to_all_single.

    At most one copy each way. The parts go out as x's own storage where
    they lie end to end in it (x contiguous, every dim before split_dim of
    size 1), else packed into one buffer; they arrive in one buffer, which
    is the result itself where the join is a view of it (every dim before
    cat_dim of size 1), else each is copied once into the result. Staged
    (gloo with MPS tensors), the packing and the unpacking are the copies
    to and from the CPU.
    """
    if g.size == 1:
        return x.view(x.shape)
    dtype = x.dtype
    chunks = x.split(list(split_sizes), split_dim)
    if not g.stage and x.is_contiguous() and _leading_ones(x.shape, split_dim):
        flat_in = x.view(-1)
    else:
        flat_in = g.buffer((x.numel(),), dtype)
        at = 0
        for c in chunks:
            flat_in[at:at + c.numel()].view(c.shape).copy_(c.detach())
            at += c.numel()
        if g.stage:
            stats["staged"] += 1
    sizes_out = [int(torch.Size(s).numel()) for s in out_shapes]
    flat_out = g.buffer((sum(sizes_out),), dtype)
    stats["bytes_sent"] += flat_in.numel() * flat_in.element_size()
    t0 = time.perf_counter()
    dist.all_to_all_single(flat_out, flat_in, output_split_sizes=sizes_out,
                           input_split_sizes=[c.numel() for c in chunks], group=g.group)
    stats["wait_s"] += time.perf_counter() - t0
    del flat_in, chunks
    shape = list(out_shapes[0])
    shape[cat_dim] = sum(s[cat_dim] for s in out_shapes)
    if not g.stage and _leading_ones(shape, cat_dim):
        return flat_out.view(shape)
    result = torch.empty(shape, dtype=dtype, device=g.device)
    at = start = 0
    for s in out_shapes:
        result.narrow(cat_dim, start, s[cat_dim]).copy_(flat_out[at:at + int(torch.Size(s).numel())].view(tuple(s)))
        at += int(torch.Size(s).numel())
        start += s[cat_dim]
    return result
