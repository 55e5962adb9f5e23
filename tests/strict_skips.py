"""A pytest plugin: with SPOOL_STRICT_SKIPS=1 (the full test command, so CI) a skipped test fails the
run unless its reason is on the list below. A skip that CI never sees is a check that silently
stopped running (a tool not installed, a fixture gone missing); only the GPU may be absent here.
On a host where `nvidia-smi -L` lists a GPU, "no CUDA GPU" is not a reason either: torch that cannot
see it (a CPU build, a driver older than its CUDA) fails the run instead of skipping tests/gpu."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

NO_GPU = "no CUDA GPU"
# Skips CI accepts: no GPU on the machine, and the GPU tests' own inputs that only a GPU host has.
ALLOWED = (NO_GPU, "SPOOL_TEST_EXL3_MODEL", "unpaged (no flash-attn)")


def gpu_listed() -> bool:
    """Whether the driver lists a GPU on this host (what ops/test.sh asks before installing the GPU
    extra), whatever torch makes of it."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def allowed(reason: str, gpu: bool) -> bool:
    return any(a in reason for a in ALLOWED if not (gpu and a == NO_GPU))


def _reason(report: pytest.TestReport) -> str:
    lr = report.longrepr
    return lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("SPOOL_STRICT_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if not skipped:
        return
    gpu = gpu_listed()
    bad = [r for r in skipped if not allowed(_reason(r), gpu)]
    if bad:
        for r in bad:
            print(f"\nSKIPPED IN CI, NOT ALLOWED: {r.nodeid}: {_reason(r)}")
        if gpu and any(NO_GPU in _reason(r) for r in bad):
            print(
                "\nnvidia-smi lists a GPU here but torch sees no CUDA device: a CPU build of torch, or a "
                "driver older than torch's CUDA (`python -c 'import torch; print(torch.version.cuda)'`, "
                "`nvidia-smi`); ops/test.sh installs a CUDA torch on such a host (SPOOL_TORCH_INDEX)"
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
