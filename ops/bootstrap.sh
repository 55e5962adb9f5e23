#!/usr/bin/env bash
# Make this checkout runnable on a fresh machine: a virtualenv with Spool and its CPU engine, and
# Postgres + Redis up on their standard local ports. Safe to run again (it only does what is missing).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# llama-cpp-python compiles llama.cpp (about 8 minutes on 2 cores the first time; pip caches the wheel).
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
.venv/bin/python -m pip install --quiet --progress-bar off -e ".[cpu,test,bench]"

bash ops/services.sh
