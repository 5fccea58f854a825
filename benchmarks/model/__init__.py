"""The Metal performance model (issues 9, 10, 19, 20, 21, 40, 43): what the
Metal kernels would cost on named Apple GPUs, predicted from the emulator's
exact per-dispatch counts. Nothing here is a measurement.

    python -m benchmarks.model --help

Layers (each imports only the ones above it; tests/model/test_metal_model.py
checks there is no cycle):

- core/: the GPU table (gpus.py, every figure with its source), the time
  model (timing.py), the counts from the emulator (emulator.py, counts.py,
  backward_counts.py), the I/O model (iomodel.py), the unfused baselines
  (unfused.py), the anchors and hand counts of other programs (anchors.py),
  and the reports' formatting (report.py).
- families/: one module per kernel family, its counts' rules and its report:
  prefill, backward, d192, d512, splitd, splitd_mla, splitd_backward,
  decode, decode_wide, accel (tensor ops), bookkeeping, paged, and the
  anchors' report.
- cli.py / __main__.py: the command, a table of the families' reports.
"""
