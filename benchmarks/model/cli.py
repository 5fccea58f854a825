"""The model's one command: `python -m benchmarks.model [COMMAND] [options]`.

Each row of COMMANDS is one report of one family (families/), with its
options; with no command (or with only --quick) the full report runs, as
the old `python -m benchmarks.metal_model` did. `--help` lists every
command with its options.
"""
import argparse
import sys
import time


def _report(args):
    from .families import accel, anchors, prefill

    t0 = prefill.report(args.quick)
    anchors.anchors()
    accel.accelerators(args.quick)
    print(f"\n(wall time {time.perf_counter() - t0:.0f} s)")


def _anchors(args):
    from .families import anchors

    anchors.anchors(args.csv)


def _accel(args):
    from .families import accel

    accel.accelerators(args.quick)


def _backward(args):
    from .families import backward

    backward.report(args.quick, args.occupancy)


def _d192(args):
    from .families import d192

    d192.report(args.n, args.heads)


def _d512(args):
    from .families import d512, splitd, splitd_mla

    d512.report()
    if not args.only:
        splitd.report()
        splitd_mla.report()


def _splitd(args):
    from .families import splitd

    splitd.report()


def _splitd_mla(args):
    from .families import splitd_mla

    splitd_mla.report()


def _splitd_backward(args):
    from .families import splitd_backward

    splitd_backward.report()


def _decode(args):
    from .families import decode

    if args.grid:
        print(decode.grid(out=args.out))
    elif args.row_groups:
        decode.row_group_report()
    else:
        decode.side_by_side()


def _decode_wide(args):
    from .families import decode_wide

    decode_wide.report()


def _decode_quant(args):
    from .families import decode_quant

    decode_quant.report()


def _bookkeeping(args):
    from .families import bookkeeping

    bookkeeping.print_bookkeeping()


def _paged_kv(args):
    from .families import paged

    paged.report_decode(args.quick)


def _paged_prefill(args):
    from .families import paged

    paged.report_prefill(args.quick)


QUICK = ("--quick", dict(action="store_true", help="a small subset (minutes, not hours, once the emulator is built)"))

# (command, what it prints, [(option, argparse keywords)], runner). The family each reads is in its runner.
COMMANDS = [
    ("report", "the full report (the default): the post's grid, calibration, LLM preset, claims, then the "
               "anchors and M5's neural accelerators (families/prefill.py, anchors.py, accel.py)",
     [QUICK], _report),
    ("anchors", "only the anchors: MLX's and the post's published timings against the model, and decode beside "
                "MLX #4076 (core/anchors.py, families/anchors.py)",
     [("--csv", dict(metavar="PATH", help="write one row per anchor to PATH"))], _anchors),
    ("accel", "only M5's neural accelerators: our kernels' counts on tensor ops, our tensor-op kernels, MLX's "
              "NAX kernel, the D = 256 and MLA verdicts, the per-block bookkeeping (families/accel.py)",
     [QUICK], _accel),
    ("backward", "the backward: registers and occupancy before/after, fused vs unfused, the claims "
                 "(families/backward.py)",
     [("--quick", dict(action="store_true", help="D = 64, 96, 128 at N = 4096 on an M3 Max only")),
      ("--occupancy", dict(action="store_true", help="only the registers/occupancy before/after table"))],
     _backward),
    ("d192", "D = 192 in its own bucket against the 256-wide launch it had before (families/d192.py)",
     [("--n", dict(type=int, default=2048, help="sequence length (default 2048)")),
      ("--heads", dict(type=int, default=16, help="heads (default 16)"))], _d192),
    ("d512", "head dim 512: the fused FA2 template probe vs unfused, then the split-D and MLA tables "
             "(families/d512.py, splitd.py, splitd_mla.py)",
     [("--only", dict(action="store_true", help="only the probe's table (not split-D's and MLA's)"))], _d512),
    ("splitd", "the split-D forward at D = 512 vs unfused: the routing's verdict (families/splitd.py)", [], _splitd),
    ("splitd-mla", "the split-D forward at MLA's head dims, the packed absorbed-MLA decode and its split along "
                   "keys (families/splitd_mla.py)", [], _splitd_mla),
    ("splitd-backward", "the split-D backward at D = 512 vs the composite backward (families/splitd_backward.py)",
     [], _splitd_backward),
    ("decode", "the decode designs (ours, ours before issue 43, MLX, llama.cpp) beside MLX #4076 "
               "(families/decode.py)",
     [("--grid", dict(action="store_true", help="the decode grid before / after issue 43, per chip")),
      ("--out", dict(metavar="PATH", help="with --grid: write the table to PATH")),
      ("--row-groups", dict(action="store_true", help="GQA >= 4: ours against half the row groups with twice "
                                                      "the rows each, over the decode grid"))], _decode),
    ("decode-wide", "decode above 256 (buckets 512, 576) vs unfused and the composite path "
                    "(families/decode_wide.py)", [], _decode_wide),
    ("decode-quant", "quantized KV caches in the decode: K/V bytes per step per format and the bandwidth-bound "
                     "time they predict (families/decode_quant.py)", [], _decode_quant),
    ("bookkeeping", "the tensor-op kernels' per-block bookkeeping beside MLX's NAX attention "
                    "(families/bookkeeping.py)", [], _bookkeeping),
    ("paged-kv", "paged against contiguous one-pass decode (families/paged.py)", [QUICK], _paged_kv),
    ("paged-prefill", "paged against contiguous prefill, the paged varlen prefill, pack GQA (families/paged.py)",
     [QUICK], _paged_prefill),
]


def parser():
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.model",
        description="The Metal performance model: predictions from the emulator's exact counts on named Apple "
                    "GPUs, never measurements. With no command: the full report.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    usages = []
    for name, what, options, run in COMMANDS:
        p = sub.add_parser(name, help=what, description=what)
        for flag, kw in options:
            p.add_argument(flag, **kw)
        p.set_defaults(run=run)
        usages.append(p.format_usage().replace("usage: ", "  ").rstrip())
    ap.epilog = "every command with its options:\n" + "\n".join(usages)
    return ap


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] == "--quick":
        argv = ["report"] + argv  # the full report, as `python -m benchmarks.metal_model [--quick]` ran it
    args = parser().parse_args(argv)
    args.run(args)
    return 0
