#!/usr/bin/env bash
# Make this checkout runnable on a fresh machine: the prerequisites (Python >= 3.11 with venv, a C/C++
# compiler for llama.cpp), a virtualenv with Spool and its CPU engine, and Postgres + Redis up on
# their standard local ports with a login Spool can use. Safe to run again (it only does what is missing).
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
apt_install() {
  command -v apt-get >/dev/null || { echo "missing: $* (install them, then run this again)" >&2; exit 1; }
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
}

PYTHON=${PYTHON:-python3}
command -v "$PYTHON" >/dev/null || apt_install python3 python3-venv
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "Spool needs Python >= 3.11 ($PYTHON is $("$PYTHON" -V 2>&1)); set PYTHON=..." >&2; exit 1; }
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || apt_install python3-venv
command -v c++ >/dev/null || apt_install build-essential  # llama.cpp is compiled; pip brings cmake

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# llama-cpp-python compiles llama.cpp (about 8-12 minutes on 2 cores the first time; the wheel is kept).
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
# Serving needs only the CPU engine (ops/run.sh); the test command asks for the test, bench and eval
# extras too (SPOOL_EXTRAS=cpu,test,bench,eval), and SPOOL_SKIP_EVAL=1 leaves lm-eval and torch out.
EXTRAS=${SPOOL_EXTRAS:-cpu}
[ "${SPOOL_SKIP_EVAL:-0}" != "1" ] || EXTRAS=$(echo "$EXTRAS" | sed 's/,eval//')
if [[ ",$EXTRAS," == *,eval,* ]] && ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  # PyPI's torch is the multi-gigabyte CUDA build; PyTorch's CPU index has the same release at a tenth
  # of the size. Where that index cannot be reached, pip falls back to PyPI (or a local copy) below.
  .venv/bin/python -m pip install --quiet --progress-bar off --retries 0 --timeout 10 \
    --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" 2>/dev/null || true
fi
if [[ ",$EXTRAS," == *,cpu,* ]]; then
  # llama.cpp built for a portable CPU baseline, not -march=native (why: ops/llama_wheel.sh); a venv
  # holding another build of it (pip's native one) gets this one instead, once.
  WHEEL=$(bash ops/llama_wheel.sh .venv/bin/python)
  MARK=".venv/.$(basename "$(dirname "$WHEEL")")"
  if [ ! -e "$MARK" ]; then
    .venv/bin/python -m pip install --quiet --progress-bar off --no-deps --force-reinstall "$WHEEL"
    touch "$MARK"
  fi
fi
.venv/bin/python -m pip install --quiet --progress-bar off -e ".[$EXTRAS]"

# SPOOL_NO_SERVICES=1 (ops/test.sh unit): the virtualenv only, no Postgres or Redis.
[ "${SPOOL_NO_SERVICES:-0}" = "1" ] || bash ops/services.sh
