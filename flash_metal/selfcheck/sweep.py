"""The correctness sweep and the timing table of python -m flash_metal.selfcheck.

Every kernel family (prefill, decode, split decode, the post's untiled and
tiled kernels, the backward pair; packed varlen batches forward and
backward) over every dtype, head dims with a zero-padded one, and the
options (causal, GQA/MQA, bool and additive masks, a sliding window,
softcap), each compared with the float64 oracle by FlashAttention's 2x rule
(flash_metal.testing). Inputs are seeded random values (never zeros); the
backends poison outputs before a kernel runs, where they can.
"""
import contextlib
import math
import statistics
import time
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from .. import testing
from ..reference import attention_reference

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A head dim that is no instantiated bucket (32, 64, 72, 80, 96, 128, 192, 256):
# it runs zero-padded in the 64-wide kernels, the path every odd model's D takes.
PADDED_D = 48


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Case:
    """One correctness check: a kernel family on one problem."""

    family: str  # prefill, decode, decode_split, untiled, tiled, backward, varlen, varlen_backward
    dtype: torch.dtype
    d: int
    shape: Tuple[int, int, int, int, int] = (1, 2, 2, 33, 33)  # B, Hq, Hkv, Nq, Nk
    causal: bool = False
    mask: Optional[str] = None  # "bool" (key padding, (B, 1, 1, Nk)) or "additive" ((1, 1, Nq, Nk), q's dtype)
    window_left: int = -1
    softcap: float = 0.0
    grad_lse: bool = False
    lengths: Tuple[Tuple[int, int], ...] = ()  # varlen: (q rows, k rows) per sequence
    note: str = ""
    dv: int = 0  # v's own head dim (MLA-style, e.g. q/k 192 with v 128); 0: v's is d

    @property
    def backward(self) -> bool:
        return self.family.endswith("backward")

    @property
    def impl(self) -> str:
        return self.family if self.family in ("prefill", "decode", "decode_split", "untiled", "tiled") else "auto"

    @property
    def id(self) -> str:
        B, Hq, Hkv, Nq, Nk = self.shape
        parts = [self.family, dtype_name(self.dtype), f"d{self.d}"] + ([f"dv{self.dv}"] if self.dv else [])
        if self.lengths:
            parts.append("seqs" + "+".join(f"{a}x{b}" for a, b in self.lengths))
        else:
            parts.append(f"{B}x{Hq}:{Hkv}x{Nq}x{Nk}")
        if self.causal:
            parts.append("causal")
        if self.mask:
            parts.append(f"{self.mask}-mask")
        if self.window_left >= 0:
            parts.append(f"window{self.window_left}")
        if self.softcap:
            parts.append(f"softcap{self.softcap:g}")
        if self.grad_lse:
            parts.append("grad_lse")
        return "-".join(parts)

    def options_text(self) -> str:
        B, Hq, Hkv, Nq, Nk = self.shape
        out = []
        if self.causal:
            out.append("causal")
        if not self.lengths and Hq != Hkv:
            out.append("MQA" if Hkv == 1 else "GQA")
        for cond, text in ((self.mask, f"{self.mask} mask"), (self.window_left >= 0, f"window {self.window_left}"),
                           (self.softcap, f"softcap {self.softcap:g}"), (self.grad_lse, "grad_lse"),
                           (self.lengths, "varlen"), (self.d == PADDED_D, "padded D")):
            if cond:
                out.append(text)
        return ", ".join(out) or "plain"


def cases(quick: bool) -> List[Case]:
    """The sweep. Quick: every family, option and dtype once, on small ragged shapes (a few seconds on a Mac,
    well under a minute in the emulator). Full: also every head-dim bucket and longer sequences."""
    out = []
    for dt in DTYPES:
        out += [
            Case("prefill", dt, 64, (1, 4, 2, 37, 45), causal=True),
            Case("prefill", dt, PADDED_D, (1, 2, 2, 33, 29)),
            Case("decode", dt, 64, (1, 4, 2, 3, 45), causal=True),
            Case("decode", dt, PADDED_D, (1, 2, 2, 1, 70)),
            Case("decode_split", dt, 64, (1, 4, 1, 1, 300)),
            Case("untiled", dt, 64, (1, 2, 2, 20, 24), causal=True),
            Case("tiled", dt, PADDED_D, (1, 2, 1, 20, 37), causal=True),
            Case("prefill", dt, 64, (2, 2, 1, 21, 40), causal=True, mask="bool"),
            Case("prefill", dt, 64, (1, 2, 2, 19, 27), mask="additive"),
            Case("prefill", dt, 64, (1, 2, 2, 40, 40), causal=True, window_left=8),
            Case("prefill", dt, 64, (1, 2, 2, 25, 31), softcap=5.0),
            Case("decode", dt, 64, (1, 4, 2, 2, 90), mask="bool", window_left=16, softcap=5.0),
            Case("varlen", dt, 64, (1, 2, 1, 0, 0), causal=True, lengths=((5, 9), (0, 3), (17, 19), (1, 4))),
            Case("backward", dt, 64, (1, 4, 2, 37, 45), causal=True),
            Case("backward", dt, PADDED_D, (1, 2, 2, 33, 29), grad_lse=True),
            Case("backward", dt, 64, (2, 2, 1, 21, 40), causal=True, mask="bool"),
            Case("backward", dt, 64, (1, 2, 2, 40, 40), causal=True, window_left=8, softcap=5.0),
            Case("varlen_backward", dt, 64, (1, 2, 1, 0, 0), causal=True, lengths=((5, 9), (17, 20), (1, 4))),
        ]
        if quick:
            continue
        for d in (32, 72, 80, 96, 128, 100, 192, 160, 256):  # every other bucket; 100 and 160 padded
            out += [
                Case("prefill", dt, d, (1, 4, 2, 70, 131), causal=True),
                Case("decode", dt, d, (1, 8, 2, 4, 200)),
                Case("decode_split", dt, d, (1, 4, 1, 1, 2100), causal=True),
                Case("backward", dt, d, (1, 4, 2, 70, 131), causal=True),
            ]
        for d in (32, 128, 256):  # the post's kernels' buckets
            out += [Case("untiled", dt, d, (1, 2, 2, 40, 50)), Case("tiled", dt, d, (1, 2, 1, 40, 50), causal=True)]
        out += [
            Case("prefill", dt, 128, (2, 4, 4, 257, 257), causal=True, mask="bool"),
            Case("prefill", dt, 128, (1, 8, 1, 300, 300), causal=True, window_left=64, softcap=30.0),
            Case("decode_split", dt, 128, (1, 8, 2, 1, 4096), mask="bool"),
            Case("backward", dt, 128, (1, 4, 1, 200, 200), mask="additive", softcap=30.0),
        ]
    return out


@contextlib.contextmanager
def poisoned_allocations():
    """While active, the ops' torch.empty outputs come back NaN-filled (torch's deterministic mode with
    fill_uninitialized_memory, as tests/conftest.py does), so an element a kernel never writes fails its
    check. Yields whether poisoning is on (torch >= 2.1)."""
    det = getattr(torch.utils, "deterministic", None)
    if det is None or not hasattr(det, "fill_uninitialized_memory"):
        yield False
        return
    old, old_fill = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        yield True
    finally:
        det.fill_uninitialized_memory = old_fill
        torch.use_deterministic_algorithms(old)


def _generator(case: Case) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(case.id.encode()))


def make_inputs(case: Case) -> Dict[str, object]:
    """The case's tensors on the CPU: q, k, v, options, and for the backward out, lse, grad_out, grad_lse."""
    g = _generator(case)
    B, Hq, Hkv, Nq, Nk = case.shape
    # Scores large enough that softcap bends them (tanh(s / cap) far from s / cap).
    amp = 3.0 if case.softcap else 1.0
    inputs: Dict[str, object] = {"options": {}}
    opts = inputs["options"]
    if case.window_left >= 0:
        opts["window_left"] = case.window_left
    if case.softcap:
        opts["softcap"] = case.softcap
    if case.lengths:
        tq, tk = sum(a for a, _ in case.lengths), sum(b for _, b in case.lengths)
        q = (torch.randn(tq, Hq, case.d, generator=g) * amp).to(case.dtype)
        k = (torch.randn(tk, Hkv, case.d, generator=g) * amp).to(case.dtype)
        v = torch.randn(tk, Hkv, case.dv or case.d, generator=g).to(case.dtype)
        cq = torch.tensor([0] + [a for a, _ in case.lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        ck = torch.tensor([0] + [b for _, b in case.lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        inputs["varlen"] = (cq, ck, max(a for a, _ in case.lengths), max(b for _, b in case.lengths))
    else:
        q = (torch.randn(B, Hq, Nq, case.d, generator=g) * amp).to(case.dtype)
        k = (torch.randn(B, Hkv, Nk, case.d, generator=g) * amp).to(case.dtype)
        v = torch.randn(B, Hkv, Nk, case.dv or case.d, generator=g).to(case.dtype)
        if case.mask == "bool":  # right padding: batch entry b keeps its first Nk - 7 (b + 1) keys (at least one)
            keep = torch.arange(Nk)[None, :] < torch.tensor([max(1, Nk - 7 * (b + 1)) for b in range(B)])[:, None]
            opts["attn_mask"] = keep[:, None, None, :]
        elif case.mask == "additive":  # a random bias, and a few keys masked with -inf
            bias = torch.randn(1, 1, Nq, Nk, generator=g)
            bias[torch.rand(1, 1, Nq, Nk, generator=g) < 0.1] = float("-inf")
            opts["attn_mask"] = bias.to(case.dtype)
    inputs.update(q=q, k=k, v=v)
    if case.backward:
        # The forward's out and lse from the float64 oracle (rounded as a kernel stores them), so a
        # backward check measures the backward kernels alone.
        if case.lengths:
            out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
            lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
            for qs, ks in testing.varlen_sequences(*inputs["varlen"][:2]):
                o, l_ = attention_reference(testing.as_batch(q, qs), testing.as_batch(k, ks),
                                            testing.as_batch(v, ks), case.causal, None, **opts)
                out[qs] = o[0].transpose(0, 1).to(case.dtype)
                lse[:, qs] = l_[0].float()
        else:
            o, l_ = attention_reference(q, k, v, case.causal, None, **opts)
            out, lse = o.to(case.dtype), l_.float()
        inputs.update(out=out, lse=lse, grad_out=torch.randn(out.shape, generator=g).to(case.dtype))
        inputs["grad_lse"] = torch.randn(lse.shape, generator=g) if case.grad_lse else None
    return inputs


def compare(case: Case, inputs: dict, result) -> List[testing.Comparison]:
    """The kernel's result against the float64 oracle by the 2x rule."""
    q, k, v, opts = inputs["q"], inputs["k"], inputs["v"], inputs["options"]
    if case.family == "varlen":
        return testing.varlen_errors(*result, q, k, v, *inputs["varlen"][:2], case.causal, None, **opts)
    if case.family == "varlen_backward":
        return testing.varlen_gradient_errors(result, q, k, v, inputs["grad_out"], *inputs["varlen"][:2],
                                              case.causal, None, inputs["grad_lse"], **opts)
    if case.backward:
        return testing.gradient_errors(result, q, k, v, inputs["grad_out"], case.causal, None, inputs["grad_lse"],
                                       **opts)
    return testing.attention_errors(*result, q, k, v, case.causal, None, **opts)


# The kernels each check must launch (host-name prefixes, the planner's names: csrc/metal/plan_detail.h), in
# the case's dtype. A family forced by impl runs exactly its own, in order, never a tensor-op kernel (their names
# hold "_mpp_" after the prefix, so "prefill_" + dtype excludes them); a family that runs impl='auto' (varlen, the
# backward) may run any kernel of its pass, the tensor-op ones included (Auto picks them on an M5).
FORCED_KERNELS = {"prefill": ("flash_attention_prefill_",), "decode": ("flash_decode_",),
                  "decode_split": ("flash_decode_split_", "flash_decode_merge_"),
                  "untiled": ("flash_attention_untiled_",), "tiled": ("flash_attention_tiled_",)}
AUTO_KERNELS = {"varlen": "flash_attention_prefill_", "backward": "flash_backward_",
                "varlen_backward": "flash_backward_"}


def kernel_problem(case: Case, kernels: List[str]) -> Optional[str]:
    """Why the launched kernels are not the check's (None when they are): a check that ran another kernel,
    or none (the composite path), would vouch for a kernel it never ran."""
    dt = dtype_name(case.dtype)
    if case.family in FORCED_KERNELS:
        want = [p + dt + "_" for p in FORCED_KERNELS[case.family]]
        ok = len(kernels) == len(want) and all(k.startswith(w) for k, w in zip(kernels, want))
        names = ", ".join(w + "*" for w in want)
        return None if ok else f"launched {kernels or 'no kernel'}, not the {case.family} kernels ({names})"
    prefix = AUTO_KERNELS[case.family]
    ok = kernels and all(k.startswith(prefix) and f"_{dt}_" in k for k in kernels)
    return None if ok else f"launched {kernels or 'no kernel'}, not {prefix}* kernels in {dt}"


def run_case(backend, case: Case) -> dict:
    """One check: the record selfcheck.json holds for it."""
    record = {"id": case.id, "family": case.family, "direction": "backward" if case.backward else "forward",
              "dtype": dtype_name(case.dtype), "head_dim": case.d, "head_dim_v": case.dv or case.d,
              "shape": list(case.shape), "options": case.options_text(), "kernels": [], "comparisons": [], "status": "error", "message": ""}
    t0 = time.perf_counter()
    try:
        inputs = make_inputs(case)
        result, launches = backend.run(case, inputs)
        record["kernels"] = [l["kernel"] for l in launches]
        record["launches"] = launches
        comps = compare(case, inputs, result)
    except testing.YardstickError as err:
        record["message"] = f"the yardstick is meaningless here (a problem of the check, not the kernel): {err}"
        return _timed(record, t0)
    except Exception as err:  # noqa: BLE001  (reported in the record; the sweep goes on)
        record["message"] = f"{type(err).__name__}: {str(err).strip()[:1500]}"
        return _timed(record, t0)
    record["comparisons"] = [{"name": c.name, "error": c.error, "tolerance": c.tolerance, "ok": c.ok}
                             for c in comps if c.error is not None or not c.ok]
    failed = [c.message for c in comps if not c.ok]
    problem = kernel_problem(case, record["kernels"])
    if problem:
        failed.insert(0, problem)
    record["status"] = "failed" if failed else "passed"
    measured = [c for c in comps if c.error is not None and c.tolerance]
    worst = max(measured, key=lambda c: c.error / c.tolerance, default=None)
    record["worst_ratio"] = None if worst is None else worst.error / worst.tolerance
    record["message"] = "; ".join(failed[:4]) if failed else (f"worst: {worst.message}" if worst else "")
    return _timed(record, t0)


def _timed(record, t0):
    record["seconds"] = round(time.perf_counter() - t0, 3)
    return record


# ------------------------------------------------------------------ timing


@dataclass
class TimingCase:
    name: str
    shape: Tuple[int, int, int, int, int]  # B, Hq, Hkv, Nq, Nk
    d: int
    causal: bool
    dtype: torch.dtype
    backward: bool = False
    extra: dict = field(default_factory=dict)


def timing_cases(device: str, quick: bool) -> List[TimingCase]:
    """LLM-like shapes on a GPU; small ones on a CPU (the metal-emu backend's stand-in measurement)."""
    if device == "cpu":
        n, nk = (256, 1024) if quick else (1024, 4096)
        return [TimingCase("prefill", (1, 4, 2, n, n), 64, True, torch.float32),
                TimingCase("decode", (1, 8, 2, 1, nk), 64, False, torch.float32),
                TimingCase("forward+backward", (1, 4, 2, n, n), 64, True, torch.float32, backward=True)]
    # Sizes where SDPA's unfused paths still fit a base Mac's memory (16 heads x 2048^2 float32 scores: 256 MiB).
    n = 1024 if quick else 2048
    dtypes = (torch.float16,) if quick else (torch.float16, torch.bfloat16, torch.float32)
    out = []
    for dt in dtypes:
        out += [TimingCase("prefill", (1, 16, 4, n, n), 128, True, dt),
                TimingCase("decode", (1, 32, 8, 1, 8192), 128, False, dt),
                TimingCase("forward+backward", (1, 8, 2, n, n), 64, True, dt, backward=True)]
    return out


def _median_ms(fn, sync, repeats):
    fn()  # warm-up (pipelines built, caches filled)
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _mlx_fn(tc: TimingCase, q, k, v):
    """MLX's fused attention on the same inputs, or None (no mlx), or a string (why it could not run)."""
    try:
        import mlx.core as mx
    except Exception:  # noqa: BLE001  (mlx not installed: its column is omitted)
        return None
    try:
        kinds = {torch.float16: mx.float16, torch.bfloat16: mx.bfloat16, torch.float32: mx.float32}
        qm, km, vm = (mx.array(t.float().cpu().numpy()).astype(kinds[t.dtype]) for t in (q, k, v))
        scale = 1.0 / math.sqrt(tc.d)
        mask = "causal" if tc.causal and tc.shape[3] > 1 else None

        def fn():
            mx.eval(mx.fast.scaled_dot_product_attention(qm, km, vm, scale=scale, mask=mask))

        fn()
        return fn
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"[:200]


def run_timing(device: str, quick: bool, progress=None) -> List[dict]:
    """Median times of flash_metal and torch's SDPA (and MLX where installed) on `device`."""
    import flash_metal
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sync = torch.mps.synchronize if device == "mps" else (lambda: None)
    repeats = 5 if quick else 10
    rows = []
    for tc in timing_cases(device, quick):
        B, Hq, Hkv, Nq, Nk = tc.shape
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(B, h, n, tc.d, generator=g).to(tc.dtype).to(device)
                   for h, n in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk)))
        # SDPA's own GQA expansion happens outside the timed call (as benchmarks/ do); causal with
        # Nq = Nk, where PyTorch's top-left and flash_metal's bottom-right alignments agree.
        kr, vr = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
        causal = tc.causal and Nq > 1
        row = {"case": tc.name, "dtype": dtype_name(tc.dtype), "shape": f"{B}x{Hq}:{Hkv}x{Nq}x{Nk}x{tc.d}",
               "causal": causal}
        try:
            if tc.backward:
                for t in (q, k, v, kr, vr):
                    t.requires_grad_(True)

                def ours():
                    flash_metal.attention(q, k, v, causal=causal).sum().backward()

                def theirs():
                    sdpa(q, kr, vr, is_causal=causal).sum().backward()
            else:
                def ours():
                    flash_metal.attention(q, k, v, causal=causal)

                def theirs():
                    sdpa(q, kr, vr, is_causal=causal)
            with torch.no_grad() if not tc.backward else contextlib.nullcontext():
                row["flash_metal_ms"] = _median_ms(ours, sync, repeats)
                row["sdpa_ms"] = _median_ms(theirs, sync, repeats)
            row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["flash_metal_ms"]
            if not tc.backward:
                mlx = _mlx_fn(tc, q, k, v)
                if callable(mlx):
                    row["mlx_ms"] = _median_ms(mlx, lambda: None, repeats)
                elif mlx is not None:
                    row["mlx_error"] = mlx
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        rows.append(row)
        if progress:
            progress.step(f"timing {tc.name} {row['dtype']}")
    return rows
