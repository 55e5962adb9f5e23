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
PYTEST=(.venv/bin/python -m pytest tests -p no:cacheprovider -p tests.strict_skips -ra)
if [ "${SPOOL_SERIAL:-0}" = 1 ]; then
  exec "${PYTEST[@]}" --durations=40 "$@"
fi

# Tests marked `wallclock` spend their time waiting (Postgres or Redis held away for 30 s, clients
# paused), not computing: they run in a second pytest beside the rest, on a database and Redis dbs of
# their own (SPOOL_SERIAL=1: one process, as before). The run fails if either fails; the second's
# report follows the first's.
WALL_LOG=$(mktemp /tmp/spool-wallclock.XXXXXX)
WALL_DB=$(.venv/bin/python -c "from ops.harness import TEST_DB; print(TEST_DB + '_wall')")
SPOOL_TEST_DATABASE_URL=$WALL_DB SPOOL_TEST_REDIS_URL=redis://127.0.0.1:6379/6 SPOOL_IT_REDIS_URL=redis://127.0.0.1:6379/11 \
  "${PYTEST[@]}" -m wallclock --durations=10 "$@" >"$WALL_LOG" 2>&1 &
WALL=$!
rc=0
"${PYTEST[@]}" -m "not wallclock" --durations=40 "$@" || rc=$?
wall_rc=0
wait $WALL || wall_rc=$?
echo
echo "=== the wallclock tests, run beside the rest ==="
cat "$WALL_LOG"
rm -f "$WALL_LOG"
[ "$wall_rc" = 5 ] && wall_rc=0  # "$@" selected none of them
[ "$rc" = 5 ] && rc=0
exit $((rc != 0 || wall_rc != 0))
