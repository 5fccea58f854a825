"""Where each rank's tokens sit in the global sequence, and which local blocks a ring step computes.

Pure index arithmetic (no torch.distributed, no tensors but index lists), so
that every rank derives the same plan from the same shard lengths, and the
tests can check it without processes.

A rank's shard is a list of *segments* (global start, length), concatenated
in order in its local tensors:
- "ring" and "ulysses": one contiguous segment; segment r follows segment
  r - 1 (any lengths: uneven shards are allowed);
- "zigzag" (ring-flash-attention's load balancing for causal masks): the
  sequence is split into 2P chunks as ``tensor_split`` splits it, and rank r
  holds chunks r and 2P - 1 - r, so that under a causal mask every rank has
  the same amount of work at every ring step.
"""
from typing import List, NamedTuple, Optional, Sequence, Tuple

VARIANTS = ("ring", "zigzag", "ulysses")


class Segment(NamedTuple):
    start: int  # global position of its first token
    length: int
    offset: int  # where it begins in the rank's local tensor


def split_sizes(total: int, parts: int) -> List[int]:
    """The sizes torch.tensor_split(x, parts) gives a dim of `total`: the first total % parts one longer."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def zigzag_chunks(rank: int, world: int) -> Tuple[int, int]:
    """The two chunks (of 2 * world) that rank holds under the zigzag layout, in local order."""
    return rank, 2 * world - 1 - rank


def segments(variant: str, lengths: Sequence[int], rank: int) -> List[Segment]:
    """Rank's segments, given every rank's local length (in rank order)."""
    world = len(lengths)
    if variant == "zigzag":
        sizes = split_sizes(sum(lengths), 2 * world)
        starts = [sum(sizes[:c]) for c in range(2 * world)]
        out, offset = [], 0
        for c in zigzag_chunks(rank, world):
            out.append(Segment(starts[c], sizes[c], offset))
            offset += sizes[c]
        return out
    return [Segment(sum(lengths[:rank]), lengths[rank], 0)]


def check_zigzag_lengths(lengths: Sequence[int]) -> Optional[str]:
    """None if the local lengths are those of shard(x, dim, "zigzag") of their total; else why not."""
    world, total = len(lengths), sum(lengths)
    sizes = split_sizes(total, 2 * world)
    want = [sizes[a] + sizes[b] for a, b in (zigzag_chunks(r, world) for r in range(world))]
    if list(lengths) != want:
        return (f"the ranks' local lengths {list(lengths)} are not a zigzag sharding of {total} tokens "
                f"(shard(x, dim, 'zigzag') gives {want}: chunks r and 2P-1-r of torch.tensor_split(x, 2P))")
    return None


class Band(NamedTuple):
    """The visible (query, key) pairs by global position: -right <= p_q - p_k <= left (None: unbounded)."""

    left: Optional[int]
    right: Optional[int]

    @staticmethod
    def of(causal: bool, window_left: int, window_right: int) -> "Band":
        right = 0 if causal else window_right  # causal sets window_right to 0, as in flash-attn and the op
        return Band(None if window_left < 0 else window_left, None if right < 0 else right)


class Block(NamedTuple):
    """One call of the local op: q rows [q0, q0 + nq) against kv rows [k0, k0 + nk) of the local tensors,
    with the op's own (bottom-right aligned) window; -1 is unbounded. window_right >= 0 is causal-like."""

    q0: int
    nq: int
    k0: int
    nk: int
    window_left: int
    window_right: int

    @property
    def full(self) -> bool:
        return self.window_left < 0 and self.window_right < 0

    def visible(self) -> int:
        """How many (query, key) pairs of the block the window lets through."""
        import torch

        i = torch.arange(self.nq)
        o = self.nk - self.nq
        lo = (i + o - self.window_left).clamp(min=0) if self.window_left >= 0 else torch.zeros_like(i)
        hi = (i + o + self.window_right).clamp(max=self.nk - 1) if self.window_right >= 0 else \
            torch.full_like(i, self.nk - 1)
        return int((hi - lo + 1).clamp(min=0).sum())


def pair_block(qseg: Segment, kseg: Segment, band: Band) -> Optional[Block]:
    """The call that computes query segment qseg against key segment kseg under band, or None (nothing visible).

    In local indices (i in qseg, j in kseg) the band is lo <= i - j <= hi. The
    call is trimmed to the band's bounding box, whose bottom-right diagonal
    always lies inside the band (a nonempty band cannot cut off both the last
    row and the last column), so the op's window arguments are >= 0 there.
    """
    nq, nk = qseg.length, kseg.length
    if nq == 0 or nk == 0:
        return None
    delta = qseg.start - kseg.start  # p_q - p_k = (i - j) + delta
    lo = -(nk - 1) if band.right is None else max(-band.right - delta, -(nk - 1))
    hi = nq - 1 if band.left is None else min(band.left - delta, nq - 1)
    if lo > hi:
        return None
    i0, i1 = max(0, lo), min(nq - 1, hi + nk - 1)
    j0, j1 = max(0, -hi), min(nk - 1, nq - 1 - lo)
    nq2, nk2 = i1 - i0 + 1, j1 - j0 + 1
    lo2, hi2 = lo - i0 + j0, hi - i0 + j0  # the band in the trimmed block's indices
    o = nk2 - nq2  # the op's bottom-right offset: query i sees j <= i + o + right, j >= i + o - left
    right = -o - lo2 if lo2 > -(nk2 - 1) else -1
    left = hi2 + o if hi2 < nq2 - 1 else -1
    assert right >= -1 and left >= -1, (qseg, kseg, band)
    return Block(qseg.offset + i0, nq2, kseg.offset + j0, nk2, left, right)


def _merge_full(blocks: List[Block]) -> List[Block]:
    """Joins full blocks that share their rows and have adjacent keys, or share their keys and have adjacent rows."""
    blocks = list(blocks)
    changed = True
    while changed:
        changed = False
        for a in range(len(blocks)):
            for b in range(len(blocks)):
                x, y = blocks[a], blocks[b]
                if a == b or not (x.full and y.full):
                    continue
                if x.q0 == y.q0 and x.nq == y.nq and x.k0 + x.nk == y.k0:
                    blocks[a] = x._replace(nk=x.nk + y.nk)
                elif x.k0 == y.k0 and x.nk == y.nk and x.q0 + x.nq == y.q0:
                    blocks[a] = x._replace(nq=x.nq + y.nq)
                else:
                    continue
                del blocks[b]
                changed = True
                break
            if changed:
                break
    return sorted(blocks)


def step_blocks(qsegs: Sequence[Segment], ksegs: Sequence[Segment], band: Band) -> List[Block]:
    """The local op calls for this rank's queries against one rank's keys (dense, non-varlen).

    Its own keys under a plain causal band are one causal call over the
    whole shard: the local order keeps the global order, so local causality
    is global causality (for zigzag too). Otherwise one block per visible
    segment pair, full ones joined where they are adjacent.
    """
    if list(qsegs) == list(ksegs) and band == Band(None, 0):
        n = sum(s.length for s in qsegs)
        return [Block(0, n, 0, n, -1, 0)] if n else []
    blocks = [b for qs in qsegs for ks in ksegs for b in [pair_block(qs, ks, band)] if b is not None]
    return _merge_full(blocks)


def ring_steps(variant: str, lengths: Sequence[int], band: Band) -> int:
    """How many ring steps any rank needs: 1 + the largest step at which some rank still sees some key.

    A window makes the far steps empty for every rank; the ring stops there
    (no compute and no transfer), and the backward sends each dK/dV home
    from wherever it is then.
    """
    world = len(lengths)
    segs = [segments(variant, lengths, r) for r in range(world)]
    last = 0
    for step in range(1, world):
        for r in range(world):
            src = (r - step) % world
            if any(pair_block(qs, ks, band) for qs in segs[r] for ks in segs[src]):
                last = step
                break
    return last + 1


class DocPart(NamedTuple):
    q0: int  # local row of the document's first query in the q segment
    k0: int  # local row of its first key in the key segment
    nq: int
    nk: int
    qstart: int  # global position of that first query
    kstart: int  # global position of that first key


def varlen_diagonal(seg: Segment, cu_seqlens: Sequence[int]) -> List[int]:
    """The documents of cu_seqlens (global) clipped to one segment, as local cu_seqlens (no empty documents)."""
    lo, hi = seg.start, seg.start + seg.length
    cuts = sorted({min(max(c, lo), hi) - lo for c in cu_seqlens} | {0, seg.length})
    return cuts


def varlen_crossing(qseg: Segment, kseg: Segment, cu_seqlens: Sequence[int]) -> Optional[DocPart]:
    """The one document (if any) with queries in qseg and keys in kseg, for two different segments.

    Segments are disjoint intervals and documents are too, so at most one
    document can reach into both: it must cover every position between them.
    """
    for b in range(len(cu_seqlens) - 1):
        d0, d1 = cu_seqlens[b], cu_seqlens[b + 1]
        q_lo, q_hi = max(d0, qseg.start), min(d1, qseg.start + qseg.length)
        k_lo, k_hi = max(d0, kseg.start), min(d1, kseg.start + kseg.length)
        if q_lo < q_hi and k_lo < k_hi:
            return DocPart(qseg.offset + q_lo - qseg.start, kseg.offset + k_lo - kseg.start, q_hi - q_lo,
                           k_hi - k_lo, q_lo, k_lo)
    return None
