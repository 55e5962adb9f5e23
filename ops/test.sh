#!/usr/bin/env bash
# The test command (README, CI): install, lint, check types and the architecture, then run every test
# against real Postgres, Redis, Celery worker processes and the real SmolLM2 model.
#
#   bash ops/test.sh          everything (what CI runs)
#   bash ops/test.sh unit     the fast loop: lint, types, import contracts, pure unit tests; no services
#   bash ops/test.sh -k expr  everything, with extra pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."

lint() {
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
  .venv/bin/lint-imports
  .venv/bin/mypy
}

if [ "${1:-}" = "unit" ]; then
  shift
  [ -x .venv/bin/python ] || SPOOL_EXTRAS=cpu,test,bench,eval bash ops/bootstrap.sh
  lint
  exec .venv/bin/python -m pytest tests/unit -p no:cacheprovider -q "$@"
fi

EXTRAS=cpu,test,bench,eval
# A host with a CUDA device also installs the GPU engines, and tests/gpu then runs instead of skipping.
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then EXTRAS="$EXTRAS,gpu"; fi
SPOOL_EXTRAS=$EXTRAS bash ops/bootstrap.sh
bash ops/test-tools.sh
lint
exec .venv/bin/python -m pytest tests -p no:cacheprovider -ra "$@"
