"""What every benchmark preset shares: loading flash_metal, picking the device,
checking an output against the float64 oracle, timing, machine metadata, and
writing the table and the CSV.

Timing method (benchmarks/README.md has the long version): build inputs, check
the output against the float64 reference, warm up, then time `batches`
batches; a batch runs enough back-to-back calls to last about `batch_s`
seconds (at least one), between two device synchronizations. Each batch gives
one per-call time; we report their median, min and max.
"""
import csv
import datetime
import gc
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------
# flash_metal and the device

def load_flash_metal():
    """Import the *installed* flash_metal.

    `python -m benchmarks.x` puts the checkout first on sys.path, and the
    source tree's flash_metal/ has no compiled _C unless it was built in place.
    In that case the checkout is hidden from sys.path while importing, so the
    pip-installed package (with its _C) is the one that loads.
    """
    if "flash_metal" in sys.modules:
        return sys.modules["flash_metal"]
    src = REPO / "flash_metal"
    has_c = src.is_dir() and any(p.name.startswith("_C") for p in src.iterdir())
    saved = list(sys.path)
    if not has_c:
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO]
    try:
        import flash_metal
    except ImportError as e:
        raise SystemExit(
            f"cannot import an installed flash_metal ({e}); run "
            "`pip install --no-build-isolation .` in the repository first"
        ) from e
    finally:
        sys.path[:] = saved
    return flash_metal


def mps_usable() -> bool:
    """MPS is present *and* works: allocate, compute, read back."""
    try:
        if not torch.backends.mps.is_available():
            return False
        x = torch.arange(4, dtype=torch.float32, device="mps")
        return float((x * 2).sum().item()) == 12.0
    except Exception:
        return False


def pick_device(requested: str) -> str:
    if requested == "cpu":
        return "cpu"
    if mps_usable():
        return "mps"
    if requested == "mps":
        raise SystemExit("--device mps requested, but MPS is not usable on this machine")
    return "cpu"


def synchronizer(device: str) -> Callable[[], None]:
    if device == "mps":
        return torch.mps.synchronize
    return lambda: None  # CPU ops return when their work is done


def set_threads(n: int) -> int:
    if n > 0:
        torch.set_num_threads(n)
    return torch.get_num_threads()


# --------------------------------------------------------------------------
# Correctness against the float64 oracle

# Largest accepted max|out - ref| / max|ref|, per input dtype. Loose enough for
# rounding of long reductions in the dtype; a wrong kernel is off by O(1).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


class CorrectnessError(AssertionError):
    pass


class Reference:
    """float64 reference outputs for some (batch, head) pairs of one problem.

    Built once per problem and shared by every implementation checked on it.
    Computed head by head and in chunks of query rows through
    flash_metal.reference.attention_reference, so even (32 heads, 32768 keys)
    problems need only a few MB at a time. A chunk of rows [a, e) with causal
    masking keeps only the first e + (Nk - Nq) keys: with the oracle's
    bottom-right alignment that reproduces exactly the full problem's mask.
    """

    def __init__(self, q, k, v, causal, heads: Optional[Sequence[tuple]] = None, chunk: int = 512):
        fm = load_flash_metal()
        q, k, v = (t.detach().cpu() for t in (q, k, v))
        B, Hq, Nq, _ = q.shape
        group = Hq // k.shape[1]
        offset = k.shape[2] - Nq
        if heads is None:
            heads = [(b, h) for b in range(B) for h in range(Hq)]
        self.heads = list(heads)
        self.refs: Dict[tuple, torch.Tensor] = {}
        for b, h in self.heads:
            qh = q[b, h]
            kh, vh = k[b, h // group], v[b, h // group]
            rows = []
            for a in range(0, Nq, chunk):
                e = min(a + chunk, Nq)
                keys = min(e + offset, kh.shape[0]) if causal else kh.shape[0]
                if keys <= 0:  # every row of this chunk sees no key
                    rows.append(torch.zeros(e - a, vh.shape[-1], dtype=torch.float64))
                    continue
                out, _ = fm.reference.attention_reference(
                    qh[a:e][None, None], kh[:keys][None, None], vh[:keys][None, None], causal=causal
                )
                rows.append(out[0, 0])
            self.refs[(b, h)] = torch.cat(rows)
        self.scale = max(float(r.abs().max()) for r in self.refs.values()) or 1.0

    def relative_error(self, out: torch.Tensor) -> float:
        out = out.detach().cpu()
        worst = 0.0
        for (b, h), ref in self.refs.items():
            got = out[b, h].double()
            if not torch.isfinite(got).all():
                return float("inf")
            worst = max(worst, float((got - ref).abs().max()))
        return worst / self.scale

    def check(self, name: str, out: torch.Tensor, dtype: torch.dtype) -> float:
        err = self.relative_error(out)
        tol = TOLERANCE[dtype]
        if not err <= tol:
            raise CorrectnessError(
                f"{name}: max|out - ref| / max|ref| = {err:.3g} exceeds {tol:g} for {dtype} "
                "(float64 reference); refusing to time a wrong kernel"
            )
        return err


# --------------------------------------------------------------------------
# Timing

@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    iters: int  # calls per batch
    batches: int


def calibrate(fn: Callable[[], object], sync: Callable[[], None], batch_s: float = 0.2,
              warmup_s: float = 0.1, first_call_s: Optional[float] = None) -> int:
    """Warm fn up and return how many calls make a batch of about batch_s.

    first_call_s: how long an earlier call already took (the correctness
    check), if any; a call that long is warm-up enough on its own. Otherwise
    fn is called until `warmup_s` has passed (at least twice), which also
    measures the per-call time.
    """
    if first_call_s is None:
        _, first_call_s = timed_first_call(fn, sync)
    per_call = first_call_s
    if first_call_s < batch_s:
        n, t0 = 0, time.perf_counter()
        while n < 2 or time.perf_counter() - t0 < warmup_s:
            fn()
            sync()
            n += 1
        per_call = (time.perf_counter() - t0) / n
    return max(1, int(batch_s / max(per_call, 1e-9)))


def time_batch(fn: Callable[[], object], sync: Callable[[], None], iters: int) -> float:
    """Seconds per call over `iters` back-to-back calls between two syncs."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        return (time.perf_counter() - t0) / iters
    finally:
        if gc_was_enabled:
            gc.enable()


def summarize(samples_s: Sequence[float], iters: int) -> Timing:
    ms = [x * 1e3 for x in samples_s]
    return Timing(median(ms), min(ms), max(ms), iters, len(ms))


def time_call(fn: Callable[[], object], sync: Callable[[], None], batches: int = 7,
              batch_s: float = 0.2, warmup_s: float = 0.1, first_call_s: Optional[float] = None) -> Timing:
    """Median and min-max over `batches` batches of the per-call time of fn()."""
    iters = calibrate(fn, sync, batch_s, warmup_s, first_call_s)
    gc.collect()
    return summarize([time_batch(fn, sync, iters) for _ in range(batches)], iters)


def timed_first_call(fn: Callable[[], torch.Tensor], sync: Callable[[], None]):
    """(output, seconds) of one call, synchronized: the correctness-check call."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def visible_pairs(n_q: int, n_k: int, causal: bool) -> float:
    """(query, key) pairs attention computes. Causal with Nq == Nk counts half
    (the usual FLOP convention); otherwise the bottom-right-aligned pairs."""
    if not causal:
        return float(n_q * n_k)
    if n_q == n_k:
        return n_q * n_k / 2
    offset = n_k - n_q
    return float(sum(min(max(i + offset + 1, 0), n_k) for i in range(n_q)))


def attention_flops(b: int, h: int, n_q: int, n_k: int, d: int, causal: bool) -> float:
    """4 * B * H * pairs * D: two matmuls (QK^T and PV) of 2 FLOPs per MAC."""
    return 4.0 * b * h * visible_pairs(n_q, n_k, causal) * d




# --------------------------------------------------------------------------
# Machine metadata

def _cpu_model() -> str:
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=5).stdout.strip()
        except Exception:
            pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args) -> str:
    try:
        r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else ""
    except Exception:
        return ""


def _cpu_jiffies():
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]), idle


def others_cpu_busy(seconds: float = 0.5) -> Optional[float]:
    """Fraction of all CPUs busy over `seconds` while this process sleeps, i.e.
    the load other processes put on the machine (Linux; None elsewhere)."""
    try:
        total0, idle0 = _cpu_jiffies()
        time.sleep(seconds)
        total1, idle1 = _cpu_jiffies()
    except (OSError, ValueError, IndexError):
        return None
    dt = total1 - total0
    return (dt - (idle1 - idle0)) / dt if dt > 0 else None


def cpu_isa(fm=None) -> str:
    """The CPU's ISA flags that decide the CPU kernel's path (issue 22), "-" marking an absent one, and the
    path bfloat16 takes: every CPU table prints this, since a CPU figure holds only for its CPU class."""
    fm = fm or load_flash_metal()
    if not hasattr(fm, "cpu_features"):
        return "?"
    feats = fm.cpu_features()
    flags = " ".join(n if feats[n] else "-" + n for n in
                     ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16"))
    return f"{flags}; bfloat16 path: {fm.cpu_path().path}"


def machine_metadata(device: str) -> Dict[str, str]:
    fm = load_flash_metal()
    sha = _git("rev-parse", "HEAD") or "unknown"
    # Uncommitted kernel changes mean the SHA alone does not identify the code.
    if _git("status", "--porcelain", "--", "csrc", "flash_metal", "shaders", "setup.py"):
        sha += "+dirty"
    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device,
        "cpu": _cpu_model(),
        "cpu_capability": getattr(torch.backends.cpu, "get_cpu_capability", lambda: "?")(),
        "logical_cpus": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "flash_metal": f"{getattr(fm, '__version__', '?')} ({Path(fm.__file__).parent})",
        "git_sha": sha,
    }
    meta["cpu_isa"] = cpu_isa(fm)
    if hasattr(os, "getloadavg"):
        meta["loadavg_1m_at_start"] = f"{os.getloadavg()[0]:.2f}"
    busy = others_cpu_busy()
    if busy is not None:
        meta["cpu_busy_before_start"] = f"{busy:.0%}"
        if busy > 0.1:
            print(f"warning: other processes kept the CPUs {busy:.0%} busy just before the run. Timings will "
                  "be inflated and noisy, multi-threaded (OpenMP) ops most of all: each parallel region waits "
                  "until all its threads get a core (on this kind of VM, a whole scheduler slice of several ms)",
                  file=sys.stderr)
    return meta


# --------------------------------------------------------------------------
# Output

def finish_metadata(meta: Dict[str, str], t_start: float) -> None:
    meta["wall_seconds"] = f"{time.perf_counter() - t_start:.0f}"
    if hasattr(os, "getloadavg"):
        meta["loadavg_1m_at_end"] = f"{os.getloadavg()[0]:.2f}"


def write_csv(path: Path, meta: Dict[str, str], rows: List[Dict[str, object]], columns: Sequence[str]) -> None:
    """CSV with the machine metadata as leading '# key: value' lines.

    Read it back with pandas.read_csv(path, comment="#") or by skipping lines
    that start with '#'.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        for key, value in meta.items():
            f.write(f"# {key}: {value}\n")
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({c: _fmt_cell(row.get(c, "")) for c in columns})


def _fmt_cell(x):
    if isinstance(x, float):
        return f"{x:.6g}"
    return x


def format_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.rjust(w) for h, w in zip(header, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def ms3(x: float) -> str:
    """Milliseconds to 3 significant digits, without exponents."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def fmt_ms(t: Optional[Timing]) -> str:
    if t is None:
        return "n/a"
    return f"{ms3(t.median_ms)} [{ms3(t.min_ms)}-{ms3(t.max_ms)}]"


class Progress:
    """A tqdm bar on stderr when tqdm is installed, else a plain counter line."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n = total, desc, 0
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def step(self, label: str = "") -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
        else:
            print(f"\r{self.desc}: {self.n}/{self.total} {label[:60]:<60}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            print(file=sys.stderr)


# --------------------------------------------------------------------------
# One problem, every implementation

def run_problem(impls, q, k, v, causal, device: str, ref: Reference, batches: int, batch_s: float) -> Dict[str, dict]:
    """Check, then time, each impl on one problem. Returns name -> result dict
    with "status" ("ok" or "n/a: why"), "timing" (Timing or None) and
    "rel_err". A wrong output raises CorrectnessError before anything is timed.

    Batches are interleaved across implementations (batch 1 of each, then
    batch 2 of each, ...), so load that comes and goes on a shared machine
    hits every row alike instead of whichever happened to run at that time.
    """
    sync = synchronizer(device)
    results, ready = {}, []
    for impl in impls:
        if not impl.runs_on(device):
            results[impl.name] = {"status": f"n/a: runs on {'/'.join(impl.devices)} only", "timing": None, "rel_err": None}
            continue
        why = impl.unsupported(q, k, v, causal) if impl.unsupported else None
        if why:
            results[impl.name] = {"status": f"n/a: {why}", "timing": None, "rel_err": None}
            continue
        call = impl.build(q, k, v, causal)
        out, first_s = timed_first_call(call, sync)
        err = ref.check(impl.name, impl.to_torch(out) if impl.to_torch else out, q.dtype)
        del out
        ready.append((impl.name, call, calibrate(call, sync, batch_s, first_call_s=first_s)))
        results[impl.name] = {"status": "ok", "timing": None, "rel_err": err}
    samples = {name: [] for name, _, _ in ready}
    gc.collect()
    for _ in range(batches):
        for name, call, iters in ready:
            samples[name].append(time_batch(call, sync, iters))
    for name, _, iters in ready:
        results[name]["timing"] = summarize(samples[name], iters)
    return results


def result_row(base: Dict[str, object], name: str, res: dict, baseline: Optional[dict]) -> Dict[str, object]:
    """A flat CSV row for one (problem, impl) result."""
    t = res["timing"]
    row = dict(base)
    row.update(impl=name, status=res["status"].split(":")[0], note=res["status"].partition(": ")[2])
    if t is not None:
        row.update(median_ms=t.median_ms, min_ms=t.min_ms, max_ms=t.max_ms,
                   calls_per_batch=t.iters, batches=t.batches, max_rel_err=res["rel_err"])
        if baseline is not None and baseline.get("timing") is not None:
            row["speedup_vs_sdpa"] = baseline["timing"].median_ms / t.median_ms
    return row


def common_args(ap, default_batch_s: float) -> None:
    ap.add_argument("--device", choices=["auto", "cpu", "mps"], default="auto",
                    help="auto: MPS when it is usable, else CPU")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--batches", type=int, default=7, help="timed batches per configuration (default 7)")
    ap.add_argument("--batch-seconds", type=float, default=default_batch_s,
                    help="target length of one batch; a batch is at least one call")
    ap.add_argument("--impls", default="", help="comma-separated subset of the registry's names")
    ap.add_argument("--out-dir", type=Path, default=RESULTS, help="where the CSV and PNG go")
