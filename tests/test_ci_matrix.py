"""The per-vendor CI matrix: its cells, the generated workflow, one column's run, and the GPU-marker rule."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from resin.ci.matrix import load_matrix
from resin.ci.workflow import WORKFLOW_FILE, render
from resin.hal import detect_kind

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]


def test_matrix_cells():
    m = load_matrix()
    assert set(m.vendors) == {"cpu", "cuda", "rocm"}
    labels = {label for v in m.vendors.values() for label in v["runners"]}
    assert labels == {"cpu", "gpu-nvidia-h100", "gpu-nvidia-b200", "gpu-amd-mi300x", "gpu-amd-mi355x"}
    groups = {"unit", "parity", "kernels-interpreted", "kernels-gpu", "distributed", "e2e-server", "bench-smoke"}
    assert {c.group for c in m.column("cuda")} == groups == {c.group for c in m.column("rocm")}
    # tensor parallelism runs on 8-GPU runners, the rest on single-GPU ones; the cpu column runs it with gloo
    assert [c.group for c in m.column("cuda", "gpu-nvidia-h100x8")] == ["distributed"]
    assert [c.group for c in m.column("rocm", "gpu-amd-mi300x8")] == ["distributed"]
    assert "distributed" not in {c.group for c in m.column("rocm", "gpu-amd-mi300x")}
    assert "distributed" in {c.group for c in m.column("cpu", "cpu")}
    assert {c.group for c in m.column("cpu")} == groups - {"kernels-gpu"} | {"kernels-compiled"}
    interp = next(c for c in m.column("cpu") if c.group == "kernels-interpreted")
    assert interp.env == {"TRITON_INTERPRET": "1"} and "not requires_gpu" in interp.markers
    assert all(c.budget_minutes > 0 for c in m.cells)
    with pytest.raises(ValueError, match="unknown vendor 'xpu'"):
        m.column("xpu")


def test_committed_workflow_is_current():
    committed = (ROOT / WORKFLOW_FILE).read_text()
    assert committed == render(), "run: python -m resin.ci workflow --write"
    assert "gpu-amd-mi300x" in committed and "python -m resin.ci run --vendor rocm" in committed


@pytest.mark.parametrize("vendor", ["rocm", "cuda"])
def test_absent_vendor_column_reports_skips(vendor):
    if detect_kind() == vendor:
        pytest.skip(f"a {vendor} GPU is present: the column would really run")
    proc = subprocess.run([sys.executable, "-m", "resin.ci", "run", "--vendor", vendor], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for group in ("unit", "parity", "kernels-gpu", "e2e-server", "bench-smoke"):
        line = next(line for line in proc.stdout.splitlines() if line.strip().startswith(group))
        assert f"skipped: requires {vendor} GPU" in line


def test_cpu_column_runs_a_group():
    """The cell's markers and environment apply: `-k` names a kernels test and a unit test, and only the kernels
    one runs, in Triton's interpreter (there is no GPU here to run it otherwise). The suite itself runs the whole
    group; this checks the runner."""
    proc = subprocess.run([sys.executable, "-m", "resin.ci", "run", "--vendor", "cpu", "--groups",
                           "kernels-interpreted", "--", "-rA", "-k", "test_rms_norms or test_matrix_cells"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = next(line for line in proc.stdout.splitlines() if line.strip().startswith("kernels-interpreted"))
    assert "passed" in summary
    ran = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("PASSED ")]
    assert ran and all("::test_rms_norms[" in name for name in ran), proc.stdout


def test_pytest_arguments_need_pytest_groups():
    proc = subprocess.run([sys.executable, "-m", "resin.ci", "run", "--vendor", "cpu", "--groups", "bench-smoke",
                           "--", "-k", "x"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "only apply to pytest groups" in proc.stderr


def test_gpu_test_without_marker_fails_collection(tmp_path):
    (tmp_path / "test_gpu.py").write_text(textwrap.dedent("""
        import pytest

        def test_unmarked(gpu_device):
            pass

        @pytest.mark.requires_rocm
        def test_marked(gpu_device):
            pass
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "resin.ci.pytest_markers", "-q", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode != 0 and "without requires_cuda / requires_rocm / requires_gpu" in proc.stdout + proc.stderr
    (tmp_path / "test_gpu.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.requires_rocm
        def test_marked(gpu_device):
            pass
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "resin.ci.pytest_markers", "-rs", "-q",
                           str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    if detect_kind() != "rocm":
        assert proc.returncode == 0 and "requires rocm GPU" in proc.stdout


def test_markers_are_registered():
    proc = subprocess.run([sys.executable, "-m", "pytest", "--markers"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    for marker in ("requires_cuda", "requires_rocm", "requires_gpu", "unit", "parity", "kernels", "e2e"):
        assert f"@pytest.mark.{marker}:" in proc.stdout
