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
  # The virtualenv only: no Postgres, Redis or other services are installed or started for this loop.
  [ -x .venv/bin/python ] || SPOOL_EXTRAS=cpu,test,bench,eval SPOOL_NO_SERVICES=1 bash ops/bootstrap.sh
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
  .venv/bin/lint-imports
  # mypy (a minute cold) runs beside the unit tests on the second core; both must pass.
  .venv/bin/mypy >/tmp/spool-unit-mypy.$$ 2>&1 &
  MYPY=$!
  rc=0
  .venv/bin/python -m pytest tests/unit -p no:cacheprovider -q --durations=10 "$@" || rc=$?
  wait $MYPY || { cat /tmp/spool-unit-mypy.$$; rc=1; }
  rm -f /tmp/spool-unit-mypy.$$
  exit $rc
fi

EXTRAS=cpu,test,bench,eval
# A host with a CUDA device also installs the GPU engines, and tests/gpu then runs instead of skipping.
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then EXTRAS="$EXTRAS,gpu"; fi
SPOOL_EXTRAS=$EXTRAS bash ops/bootstrap.sh
bash ops/test-tools.sh
lint
# --durations: where the suite's time goes, printed at the end of every run.
# SPOOL_STRICT_SKIPS: a skip fails the run unless its reason is an allowed one (no GPU; tests/strict_skips.py).
export SPOOL_STRICT_SKIPS=${SPOOL_STRICT_SKIPS:-1}
exec .venv/bin/python -m pytest tests -p no:cacheprovider -p tests.strict_skips -ra --durations=40 "$@"
