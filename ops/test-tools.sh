#!/usr/bin/env bash
# Tools only the test suite needs, from Debian's packages: headless Chromium and its driver (the
# status-page test), HAProxy (the cluster harness) and promtool (checks the alert rules). promtool is
# taken out of the `prometheus` package without installing it, so no Prometheus service is set up.
# Safe to run again; where apt is missing it says so, and the tests that need these skip with that
# reason.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
command -v apt-get >/dev/null || { echo "test-tools: no apt-get; chromium/promtool tests will skip" >&2; exit 0; }

if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
fi

# HAProxy: the cluster harness's load balancer (ops/cluster.py, tests/e2e/test_cluster.py). Debian's
# package is installed, and its service is not started (the harness runs its own with its own config).
if ! command -v haproxy >/dev/null; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends haproxy >/dev/null
fi

if [ ! -x .venv/bin/promtool ] && ! command -v promtool >/dev/null; then
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download prometheus >/dev/null 2>&1 || { $SUDO apt-get update -qq && apt-get download prometheus >/dev/null; })
  dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/x"
  cp "$tmp/x/usr/bin/promtool" .venv/bin/promtool
  rm -rf "$tmp"
fi

# The pinned exllamav2/exllamav3 Python sources for the GPU contract test (tests/unit/test_gpu_contract.py),
# without their dependencies or CUDA extensions: the test stubs those and inspects the real signatures.
pins=$(.venv/bin/python -c 'import tomllib; print(" ".join(r for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu"] if r.startswith("exllamav")))')
# shellcheck disable=SC2086
.venv/bin/python -m pip install -q --no-deps --upgrade --target .venv/gpu-contract $pins
