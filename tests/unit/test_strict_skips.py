"""The strict-skip rule (tests/strict_skips.py) fails a run on a planted skip, and lets the GPU one pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, reason: str) -> int:
    test = tmp_path / "test_planted.py"
    test.write_text(f"import pytest\n\ndef test_x():\n    pytest.skip({reason!r})\n\ndef test_y():\n    pass\n")
    env = {**os.environ, "SPOOL_STRICT_SKIPS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.strict_skips", "-p", "no:cacheprovider"]
    out = subprocess.run([*cmd, "--rootdir", str(tmp_path), "-c", os.devnull, str(test)], env=env, cwd=tmp_path)
    return out.returncode


def test_a_planted_skip_fails_the_run(tmp_path: Path) -> None:
    assert _run(tmp_path, "schemathesis is not installed") == 1


def test_the_gpu_skip_is_allowed(tmp_path: Path) -> None:
    assert _run(tmp_path, "no CUDA GPU") == 0
