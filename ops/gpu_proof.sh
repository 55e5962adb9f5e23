#!/usr/bin/env bash
# The GPU proof kit (issue 50; docs/gpu.md, "The proof kit").
#
#   bash ops/gpu_proof.sh bundle   # here, with PyPI: build gpu_kit/ and check what travels fits 64 MiB
#   bash ops/gpu_proof.sh check    # the size rule alone, on the gpu_kit/ already built
#   bash ops/gpu_proof.sh gpu      # there (device call, carry gpu_kit): install, build, test, bench;
#                                  # one report and its log in $OUT, inside 9 minutes
#
# bundle runs the checkout's .venv (it reads the bundled GGUF); gpu runs the machine's python3, the
# one holding its CUDA torch (PYTHON overrides either).
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  bundle) exec "${PYTHON:-.venv/bin/python}" -m ops.gpu_proof.bundle "${@:2}" ;;
  check) exec "${PYTHON:-.venv/bin/python}" -m ops.gpu_proof.bundle --check "${@:2}" ;;
  gpu) exec "${PYTHON:-python3}" -m ops.gpu_proof.run ;;
  *)
    echo "usage: bash ops/gpu_proof.sh bundle|check|gpu" >&2
    exit 64
    ;;
esac
