"""python -m flash_metal.selfcheck's accelerator timing (issue 21): the backward row (impl='tensor_ops' against
the simdgroup backward) and which rows a run plans. On Linux the row runs on fakes (ops and clock): only a Mac
whose device reports tensor ops usable ever times them, and the emulated section times nothing
(tests/api/test_selfcheck.py, test_metal_emu_accelerator_section_runs_in_emulation)."""
import os

import torch

from flash_metal.selfcheck import backends as sb
from flash_metal.selfcheck import cli
from flash_metal.selfcheck import sweep
from test_selfcheck import _NoAccelerator, _schema1


class _FakeOps:
    """torch.ops.flash_metal stand-in for the backward timing row: records each backward's impl and whether
    FLASH_METAL_DISABLE_TENSOR_OPS was set at the call; `fail` raises for that impl."""

    def __init__(self, fail=None):
        self.calls, self.fail = [], fail

    def attention_forward(self, q, k, v, causal, scale, impl):
        assert impl == "auto"
        return torch.zeros_like(q), torch.zeros(q.shape[:3])

    def attention_backward(self, grad_out, q, k, v, out, lse, causal, scale, grad_lse, impl):
        from flash_metal.selfcheck import accel

        self.calls.append((impl, os.environ.get(accel.DISABLE_ENV)))
        if impl == self.fail:
            raise RuntimeError("planted: no such pipeline")
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros(0)


def test_accelerator_backward_timing_row_on_fakes(monkeypatch):
    # The row's logic on Linux, never a Mac figure: fake ops on CPU tensors, a fake median (per impl, from the
    # call the row made) in place of the clock. tensor_ops runs with the switch off, the simdgroup backward
    # (impl='auto') with it on, the switch restored after; speedup = simdgroup / tensor_ops.
    from flash_metal.selfcheck import accel

    monkeypatch.delenv(accel.DISABLE_ENV, raising=False)
    ops = _FakeOps()
    fake_ms = {("tensor_ops", None): 2.0, ("auto", "1"): 5.0}

    def median(fn, sync, repeats):
        fn()
        sync()
        return fake_ms[ops.calls[-1]]

    monkeypatch.setattr(sweep, "_median_ms", median)
    syncs = []
    rows = accel.run_backward_timing(True, device="cpu", sync=lambda: syncs.append(1), ops=ops)
    [shape] = accel.backward_timing_shapes(True)
    assert len(rows) == 1 and rows[0]["shape"] == "1x16:4x1024x1024x128" and rows[0]["causal"] is True
    assert (rows[0]["tensor_ops_ms"], rows[0]["simdgroup_ms"], rows[0]["speedup"]) == (2.0, 5.0, 2.5)
    assert ops.calls == [("tensor_ops", None), ("auto", "1")] and len(syncs) == 2
    assert accel.DISABLE_ENV not in os.environ
    section = {"status": "passed", "gpu_family": 10, "checks": [],
               "timing": {"note": "n", "rows": [], "backward_note": "Measured on this Mac's GPU, as above",
                          "backward_rows": rows}}
    md = "\n".join(accel.to_markdown(section))
    assert "| float16 | 1x16:4x1024x1024x128 | True | 2.000 | 5.000 | 2.50x |" in md
    # A backward that fails is the row's error, and a failure of the section.
    ops = _FakeOps(fail="tensor_ops")
    [row] = accel.run_backward_timing(True, device="cpu", sync=lambda: None, ops=ops)
    assert "planted: no such pipeline" in row["error"] and "speedup" not in row
    section["timing"]["backward_rows"] = [row]
    assert accel.failures(section) == [f"accelerator backward timing {row['shape']}: {row['error']}"]


def test_accelerator_timing_is_planned_on_a_mac_only(monkeypatch):
    # A Mac whose device reports the tensor-op kernels usable plans the forward and the backward rows; the
    # emulator, --no-timing and a device without them plan none.
    from flash_metal.selfcheck import accel

    class _Usable(_NoAccelerator):
        def __init__(self):
            self.info = sb.parse_device_info(_schema1(tensor_ops={"usable": True, "reason": None,
                                                                  "forced_reason": None, "gpu_family": 10}))

    args = cli._parser().parse_args(["--quick"])
    planned = accel.plan(_Usable(), args)
    assert planned["timing"] == accel.timing_shapes(True) + accel.backward_timing_shapes(True)
    assert accel.plan(_Usable(), cli._parser().parse_args(["--quick", "--no-timing"]))["timing"] == []
    assert accel.plan(_NoAccelerator("an Apple 9 GPU", None), args)["timing"] == []
