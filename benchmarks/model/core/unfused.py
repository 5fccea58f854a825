"""The unfused baselines the fused plans are priced against (issue 10,
issue 20 section 3): the composite path (PyTorch's MPS math path, MLX's
unfused VJP) as a list of kernels, each costing max(compute at the same MMA
rate as ours, bytes at the same streaming ceiling) plus the same dispatch
overhead: generous to unfused (no occupancy or cache effects), dense even
when causal (the composite path masks, it does not skip).

The backward has P (N x N, saved by its forward) and runs dV = P^T dO,
dP = dO V^T, the softmax backward dS = P * (dP - rowsum(P * dP)) over N x N,
then dQ = dS K and dK = dS^T Q: 4 GEMMs of 2 N^2 D FLOPs and 7 N^2 elements
of traffic per head. Its forward: S = Q K^T written, the softmax read and
written, O = P V.
"""
import torch

from . import gpus as G
from . import timing as T

# Dispatch overhead (point of its band; gpus.DISPATCH_OVERHEAD_S, an estimate).
DISPATCH_OVERHEAD_S = G.DISPATCH_OVERHEAD_S[1]


def kernels_seconds(kernels, gpu: G.AppleGPU, flops_per_core_cycle=None):
    """Seconds of a list of (FLOPs, bytes) kernels on `gpu`, each max(compute, bytes) plus a dispatch.
    flops_per_core_cycle: the matmuls' rate (default: the same MMA rate as ours; G.tensor_op_rate(5)[1]
    prices them on M5's neural accelerators)."""
    hz = gpu.clock_ghz * 1e9
    per_cycle = flops_per_core_cycle or 2 * G.MMA_RATE[gpu.generation][1]
    rate = per_cycle * gpu.cores * hz  # the same MMA rate and streaming ceiling as ours, unless given
    bw = min(G.STREAM_CEILING[1] * gpu.bandwidth_gbs * 1e9, gpu.cores * T.ON_GPU_BYTES_PER_CYCLE * hz)
    return sum(DISPATCH_OVERHEAD_S + max(f / rate, b / bw) for f, b in kernels)


def unfused_seconds(s, dtype, gpu: G.AppleGPU, forward=False, flops_per_core_cycle=None):
    """The composite backward's modelled time (the module docstring); forward=True:
    its forward instead (S = Q K^T written, softmax read and written, O = P V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    heads, nn, nd = s.b * s.hq, s.nq * s.nk, (s.nq + s.nk) * s.d
    gemm_flops = 2 * nn * s.d * heads
    if forward:
        kernels = [  # (FLOPs, bytes) per kernel
            (gemm_flops, (nn + nd) * elem * heads),  # S = Q K^T
            (0, 2 * nn * elem * heads),  # P = softmax(S * scale)
            (gemm_flops, (nn + nd + s.nq * s.d) * elem * heads),  # O = P V
        ]
    else:
        kernels = [
            (gemm_flops, (nn + nd + s.nk * s.d) * elem * heads),  # dV = P^T dO
            (gemm_flops, (nn + nd) * elem * heads),  # dP = dO V^T
            (0, 3 * nn * elem * heads),  # dS = P * (dP - rowsum(P * dP))
            (gemm_flops, (nn + nd + s.nq * s.d) * elem * heads),  # dQ = dS K
            (gemm_flops, (nn + nd + s.nk * s.d) * elem * heads),  # dK = dS^T Q
        ]
    return kernels_seconds(kernels, gpu, flops_per_core_cycle)
