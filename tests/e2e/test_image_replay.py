"""CI replays the GPU image's Python install steps against the package registry (no Docker here):
every pinned requirement resolves, with the flags the image uses, for the image's Python and
platform. pip reads the registry's metadata only; nothing is installed or compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_image_install_steps_resolve(tmp_path):
    report = tmp_path / "report.json"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = subprocess.run(
        ["bash", "ops/docker/cuda-install.sh", "replay", str(report)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    pins = dict(
        line.split("=", 1)
        for line in (ROOT / "ops/docker/cuda-install.sh").read_text().splitlines()
        if line.split("=", 1)[0].endswith("_VERSION") and "=" in line and not line.startswith(" ")
    )
    build = {
        i["metadata"]["name"]: i["metadata"]["version"]
        for i in json.loads(Path(f"{report}.build").read_text())["install"]
    }
    runtime = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert build["torch"] == pins["TORCH_VERSION"] and any(n.startswith("nvidia-") for n in build)
    assert runtime["exllamav2"] == pins["EXLLAMAV2_VERSION"] and runtime["exllamav3"] == pins["EXLLAMAV3_VERSION"]
    assert runtime["torch"] == pins["TORCH_VERSION"]
    for dep in ("fastapi", "celery", "llguidance", "tokenizers", "safetensors"):
        assert dep in runtime, dep
