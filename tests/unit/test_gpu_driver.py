"""A GPU engine that cannot start says why in words an operator acts on: an NVIDIA driver older than
torch's CUDA (or, for exllamav3, than its kernels need) made torch see no device, and the worker read
"engine needs a CUDA GPU". Shown through the engines' own start check (`_require_cuda`), with torch's
CUDA answers and `nvidia-smi` stood in for: no GPU is needed to show the rule."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

from workers.engine.exllamav2 import ExLlamaV2Engine
from workers.engine.exllamav3 import ExLlamaV3Engine


def _host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, cuda: str | None, available: bool, driver: str | None):
    torch = types.ModuleType("torch")
    torch.version = types.SimpleNamespace(cuda=cuda)  # type: ignore[attr-defined]
    torch.cuda = types.SimpleNamespace(is_available=lambda: available)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    if driver is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho {driver}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir) + (os.pathsep + "/usr/bin:/bin" if driver is None else ""))


def _why(engine: type) -> str:
    with pytest.raises(RuntimeError) as err:
        engine.__new__(engine)._require_cuda()
    return str(err.value)


@pytest.mark.parametrize("engine", [ExLlamaV2Engine, ExLlamaV3Engine])
def test_an_old_driver_reads_as_an_old_driver(engine: type, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _host(monkeypatch, tmp_path, cuda="12.8", available=False, driver="470.256.02")
    why = _why(engine)
    assert "driver 470.256.02 is too old" in why and "needs a CUDA GPU" not in why, why


def test_exllamav3_needs_r570_even_where_torch_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """CUDA 12.8's torch starts on r525+ (minor version compatibility), exllamav3's kernels need r570."""
    _host(monkeypatch, tmp_path, cuda="12.8", available=True, driver="550.54.14")
    assert "driver >= 570" in _why(ExLlamaV3Engine)
    assert ExLlamaV2Engine.__new__(ExLlamaV2Engine)._require_cuda() is sys.modules["torch"]


def test_no_gpu_and_a_cpu_torch_say_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _host(monkeypatch, tmp_path, cuda="12.8", available=False, driver=None)
    assert "needs a CUDA GPU: nvidia-smi finds no NVIDIA driver" in _why(ExLlamaV2Engine)
    monkeypatch.undo()
    _host(monkeypatch, tmp_path / "cpu", cuda=None, available=False, driver="580.65.06")
    assert "CPU build" in _why(ExLlamaV3Engine)
