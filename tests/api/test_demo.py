"""The README's first command ends in `python -m flash_metal.demo`: it must run clean.

That command installs torch alone, without NumPy, and importing torch then
warns "Failed to initialize NumPy". The demo must print no warning there,
and still check itself against the float64 oracle.
"""
import subprocess
import sys

_NO_NUMPY = "import sys; sys.modules['numpy'] = None  # as if NumPy were not installed\n"


def _run(code):
    return subprocess.run([sys.executable, "-W", "default", "-c", _NO_NUMPY + code], capture_output=True, text=True,
                          timeout=300)


def test_torch_itself_warns_without_numpy():
    # The premise: without the filter in flash_metal/__init__.py, this warning shows.
    out = _run("import torch")
    assert out.returncode == 0, out.stderr
    assert "Failed to initialize NumPy" in out.stderr


def test_demo_prints_no_warnings_without_numpy():
    # As `python -m flash_metal.demo` runs it: the package is imported first.
    out = _run("import runpy\nsys.argv = ['flash_metal.demo', '--seq', '256']\n"
               "runpy.run_module('flash_metal.demo', run_name='__main__')")
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", out.stderr
    assert "max |error| vs float64 reference" in out.stdout and "SDPA" in out.stdout


def test_other_warnings_still_show():
    out = _run("import flash_metal, warnings\nwarnings.warn('still here', UserWarning)")
    assert out.returncode == 0 and "still here" in out.stderr
