"""ops/haproxy.example.cfg is what the cluster harness runs (ops/cluster.haproxy_config, proven by
`python -m ops.cluster` and tests/e2e/test_cluster.py), with example addresses; and HAProxy accepts it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ops.cluster import haproxy_config

EXAMPLE = Path(__file__).resolve().parents[2] / "ops/haproxy.example.cfg"


def _body() -> str:
    return "".join(line for line in EXAMPLE.read_text().splitlines(True) if not line.startswith("#"))


def test_the_example_is_the_harness_config():
    assert _body() == haproxy_config("*:8000", {"api1": "10.0.0.21:8000", "api2": "10.0.0.22:8000"})


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="needs HAProxy (ops/test-tools.sh installs it)")
def test_haproxy_accepts_it():
    out = subprocess.run(["haproxy", "-c", "-f", str(EXAMPLE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
