"""The CPU kernel's extra memory is O(N), never N x N."""
import json
import os
import subprocess
import sys

import pytest
from repo_paths import ROOT_DIR

SCRIPT = os.path.join(ROOT_DIR, "benchmarks", "peak_memory.py")


def measure(impl, n, causal=False, backward=False, window=-1):
    res = subprocess.run([sys.executable, SCRIPT, "--impl", impl, "--n", str(n), "--d", "64",
                          *(["--causal"] if causal else []), *(["--backward"] if backward else []),
                          "--window", str(window), "--threads", "2"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS reset needs Linux /proc")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_peak_extra_memory_stays_in_megabytes(causal):
    # B=1, H=1, N=16384, D=64, float32: an N x N float32 score matrix is 1 GiB.
    r = measure("flash", 16384, causal)
    assert r["nxn_float32_bytes"] == 1 << 30
    # The output alone is 4 MiB; allow the thread-local blocks and allocator
    # slack, still 1/64 of the N x N matrix.
    assert r["peak_extra_bytes"] < 16 << 20, r


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS reset needs Linux /proc")
def test_measurement_sees_an_nxn_buffer():
    # The same probe on the explicit path must see the N x N matrices, or the
    # test above would prove nothing. N=4096: S and P are 64 MiB each.
    r = measure("explicit", 4096)
    assert r["peak_extra_bytes"] > 64 << 20, r


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS reset needs Linux /proc")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_forward_backward_peak_extra_memory_stays_in_megabytes(causal):
    # Forward + backward at N = 16384, D = 64, float32; every N x D tensor is
    # 4 MiB. What the call itself creates: out, out * w, grad_out and the
    # three gradients (24 MiB), lse and Delta (O(N)). The CPU backward adds
    # float32 accumulators of N x D (dK and dV per item, and with B * Hkv = 1
    # below the 2 threads, one dQ partial per key chunk). 64 MiB bounds all
    # of it with slack: 1/16 of the 1 GiB N x N float32 matrix the composite
    # backward materializes (twice: P and dP).
    r = measure("flash", 16384, causal, backward=True)
    assert r["backward"] and r["nxn_float32_bytes"] == 1 << 30
    assert r["peak_extra_bytes"] < 64 << 20, r


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS reset needs Linux /proc")
def test_measurement_sees_the_explicit_backward():
    # The explicit path's backward keeps S and P for autograd: at N = 4096
    # (64 MiB each) the probe must see them, or the test above proves nothing.
    r = measure("explicit", 4096, backward=True)
    assert r["peak_extra_bytes"] > 128 << 20, r


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS reset needs Linux /proc")
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
def test_sliding_window_at_32k_costs_n_times_d_memory(backward):
    # N = 32768 with a 1024-key causal window (Mistral's shape of problem):
    # every N x D float32 tensor is 8 MiB, the N x N matrix 4 GiB. The same
    # bounds as the dense calls at 16k scaled by 2 (O(N * D)), nothing that
    # grows with N * window or N^2. (Its time, N * window, is in the
    # benchmarks: benchmarks/features.py and the README's window figures.)
    r = measure("flash", 32768, causal=True, backward=backward, window=1024)
    assert r["window"] == 1024 and r["nxn_float32_bytes"] == 4 << 30
    assert r["peak_extra_bytes"] < (128 << 20 if backward else 32 << 20), r
