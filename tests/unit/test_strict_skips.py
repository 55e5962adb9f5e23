"""The strict-skip rule (tests/strict_skips.py) fails a run on a planted skip, lets the GPU one pass where
no GPU is listed, and refuses it where `nvidia-smi -L` lists one (a stand-in `nvidia-smi` on PATH says
which: the rule must hold on any host, with or without a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LISTS_A_GPU = "echo 'GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)'"
# What nvidia-smi says on a host whose driver finds no device.
LISTS_NONE = "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'; exit 9"


def _run(tmp_path: Path, reason: str, smi: str = LISTS_NONE) -> subprocess.CompletedProcess[str]:
    test = tmp_path / "test_planted.py"
    test.write_text(f"import pytest\n\ndef test_x():\n    pytest.skip({reason!r})\n\ndef test_y():\n    pass\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    path = os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])  # ahead of a real one, if any
    env = {**os.environ, "SPOOL_STRICT_SKIPS": "1", "PYTHONPATH": str(ROOT), "PATH": path}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.strict_skips", "-p", "no:cacheprovider"]
    return subprocess.run(
        [*cmd, "--rootdir", str(tmp_path), "-c", os.devnull, str(test)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )


def test_a_planted_skip_fails_the_run(tmp_path: Path) -> None:
    assert _run(tmp_path, "schemathesis is not installed").returncode == 1


def test_the_gpu_skip_is_allowed_where_no_gpu_is_listed(tmp_path: Path) -> None:
    assert _run(tmp_path, "no CUDA GPU").returncode == 0


def test_the_gpu_skip_fails_the_run_where_nvidia_smi_lists_a_gpu(tmp_path: Path) -> None:
    """bootstrap's CPU torch on a GPU host skipped every GPU test "no CUDA GPU", and the run was green."""
    out = _run(tmp_path, "no CUDA GPU", LISTS_A_GPU)
    assert out.returncode == 1, out.stdout
    assert "SKIPPED IN CI, NOT ALLOWED" in out.stdout and "nvidia-smi lists a GPU" in out.stdout, out.stdout
