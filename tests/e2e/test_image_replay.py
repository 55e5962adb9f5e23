"""CI replays each GPU image target's registry part against the package registry (no Docker here):
`cuda-install.sh replay TARGET` resolves, with the target's own requirement lists and the flags the
image uses, for the image's Python and platform. pip reads the registry's metadata only; nothing is
installed or compiled. The GitHub artifacts (exllamav2's and flash-attn's release wheels, exllamav3's
source release) cannot be fetched here: PyPI's exllamav2/exllamav3 wheels of the same versions stand
in for their declared dependencies, and their addresses are checked by shape only
(tests/unit/test_image_steps.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ops/docker/cuda-install.sh"
PINS = dict(re.findall(r"^([A-Z0-9_]+_VERSION)=(\S+)$", SCRIPT.read_text(), re.M))
# wallclock: pip waits on the registry, so ops/test.sh runs it beside the CPU-bound shards. Each dry run
# reads wheel metadata by range requests (fast-deps, cuda-install.sh): this registry serves no PEP 658
# metadata, and the two replays downloaded ~8 GB of wheels whole, 51 CPU s, before (15 CPU s after).
pytestmark = pytest.mark.wallclock


def _replay(target: str, report: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = subprocess.run(
        ["bash", str(SCRIPT), "replay", target, str(report)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]


def _installed(report: Path) -> dict[str, str]:
    return {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}


def _spool_dependencies() -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[\[<>=~!; ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}


def _check_torch(runtime: dict[str, str]) -> None:
    assert runtime["torch"] == PINS["TORCH_VERSION"]
    # PyPI's Linux torch 2.8.0 is the CUDA 12.8 build: its CUDA runtime is 12.8.
    assert runtime["nvidia-cuda-runtime-cu12"].startswith("12.8."), runtime.get("nvidia-cuda-runtime-cu12")
    assert not any(n.endswith("-cu13") for n in runtime), sorted(n for n in runtime if n.startswith("nvidia"))
    names = {n.lower().replace("_", "-") for n in runtime}
    assert _spool_dependencies() <= names, _spool_dependencies() - names


TARGETS = ("exl2", "exl3")


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, Future[Path]]:
    """Both targets' replays, started at once: pip spends them waiting on the registry (a replay
    took 83 s of wall for 22 s of CPU), so side by side they take the longer one's time, not the sum."""
    pool = ThreadPoolExecutor(len(TARGETS))

    def replay(target: str) -> Path:
        report = tmp_path_factory.mktemp(target) / "report.json"
        _replay(target, report)
        return report

    futures = {t: pool.submit(replay, t) for t in TARGETS}
    pool.shutdown(wait=False)
    return futures


@pytest.mark.parametrize("target", TARGETS)
def test_each_gpu_image_target_resolves_what_it_installs(reports, target):
    report = reports[target].result()
    runtime = _installed(report)
    _check_torch(runtime)
    if target == "exl2":
        # PyPI's 0.3.2 stands in for the release wheel (same declared dependencies); flash-attn's
        # dependencies besides torch; and nothing of the other engine.
        assert runtime["exllamav2"] == PINS["EXLLAMAV2_VERSION"] and "einops" in runtime
        assert "exllamav3" not in runtime
    else:
        assert runtime["exllamav3"] == PINS["EXLLAMAV3_VERSION"] and "exllamav2" not in runtime
        build = _installed(Path(f"{report}.build"))
        assert build["torch"] == PINS["TORCH_VERSION"] and {"ninja", "setuptools", "wheel"} <= set(build)
