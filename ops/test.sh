#!/usr/bin/env bash
# The test command (README, CI): install, lint, check types and the architecture, then run every test
# against real Postgres, Redis, Celery worker processes and the real SmolLM2 model.
#
#   bash ops/test.sh          everything (what CI runs)
#   bash ops/test.sh unit     the fast loop: lint, types, import contracts, pure unit tests; no services
#   bash ops/test.sh -k expr  everything, with extra pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."

lint() {  # chained: called as `lint || ...`, where set -e does not stop at a failing step
  .venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/lint-imports && .venv/bin/mypy
}

if [ "${1:-}" = "unit" ]; then
  shift
  # The virtualenv only: no Postgres, Redis or other services are installed or started for this loop.
  [ -x .venv/bin/python ] || SPOOL_EXTRAS=cpu,test,bench,eval SPOOL_NO_SERVICES=1 bash ops/bootstrap.sh
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
  .venv/bin/lint-imports
  # mypy: seconds with its cache (.mypy_cache), a minute cold; then the unit tests on both cores.
  .venv/bin/mypy
  exec .venv/bin/python -m pytest tests/unit -p no:cacheprovider -q --durations=10 -n 2 "$@"
fi

# Root: the cluster and dead-host tests build network namespaces and links (`ip netns`), and the
# fresh-machine test makes a Debian Postgres cluster (`pg_createcluster`); as any other user those three
# modules skip, and strict skips fail the run. Said here, before anything is installed.
if [ "$(id -u)" -ne 0 ]; then
  echo "ops/test.sh: the full run needs root (network namespaces for tests/e2e/test_cluster.py and" \
    "test_dead_host.py, a Debian Postgres cluster for test_fresh_machine.py): run \`sudo bash ops/test.sh\`;" \
    "\`bash ops/test.sh unit\` needs neither root nor services" >&2
  exit 2
fi
EXTRAS=cpu,test,bench,eval
# A host with a CUDA device also installs the GPU engines and a CUDA build of torch, and tests/gpu then
# runs instead of skipping: a "no CUDA GPU" skip fails the run there (tests/strict_skips.py), never green.
GPU_HOST=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q GPU; then GPU_HOST=1; EXTRAS="$EXTRAS,gpu"; fi
SPOOL_EXTRAS=$EXTRAS bash ops/bootstrap.sh
torch_sees_cuda() { .venv/bin/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; }
if [ "$GPU_HOST" = 1 ] && ! torch_sees_cuda; then
  # bootstrap installs the eval extra's torch from PyTorch's CPU index. The same release again, from
  # SPOOL_TORCH_INDEX (e.g. https://download.pytorch.org/whl/cu128 for a driver below CUDA 13), or
  # from PyPI, whose Linux torch is a CUDA build.
  TORCH_PIN=$(.venv/bin/python -c 'import tomllib; print(*[r for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["eval"] if r.startswith("torch")])')
  .venv/bin/python -m pip uninstall --quiet -y torch
  .venv/bin/python -m pip install --quiet --progress-bar off ${SPOOL_TORCH_INDEX:+--index-url "$SPOOL_TORCH_INDEX"} "$TORCH_PIN" || true
  if ! torch_sees_cuda; then
    echo "ops/test.sh: nvidia-smi lists a GPU, but torch cannot use it, so tests/gpu cannot run here:" >&2
    .venv/bin/python -c 'import torch; print(f"  torch {torch.__version__}, built for CUDA {torch.version.cuda}")' >&2 \
      || echo "  torch ($TORCH_PIN) did not install" >&2
    echo "  driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)" \
      "(the CUDA it supports: nvidia-smi's header); set SPOOL_TORCH_INDEX to a torch build for that CUDA" >&2
    exit 1
  fi
fi
bash ops/test-tools.sh
# Each shard's database and Redis dbs come from ops/harness.py's allocator, which never hands out a local
# Spool's (database `spool`, Redis db 0): a SPOOL_TEST_SHARDS this Redis cannot serve is refused here.
SHARDS=${SPOOL_TEST_SHARDS:-${SPOOL_TEST_LANES:-2}}  # SPOOL_TEST_LANES: the old name, still read
ALLOCATED=$(.venv/bin/python -m ops.harness shards "$SHARDS")
read -r WALL_SHARD XDIST_SHARDS <<<"$ALLOCATED"
# --durations: where the suite's time goes, printed at the end of every run.
# SPOOL_STRICT_SKIPS: a skip fails the run unless its reason is an allowed one (no GPU; tests/strict_skips.py).
export SPOOL_STRICT_SKIPS=${SPOOL_STRICT_SKIPS:-1}
# SPOOL_COSTS: each module's wall and CPU seconds (tests/costs.py), printed as a table at the end.
export SPOOL_COSTS=${SPOOL_COSTS:-$(mktemp /tmp/spool-costs.XXXXXX)}
PYTEST=(.venv/bin/python -m pytest tests -p no:cacheprovider -p tests.strict_skips -p tests.costs -ra)
if [ "${SPOOL_SERIAL:-0}" = 1 ]; then
  lint
  exec "${PYTEST[@]}" --durations=40 "$@"
fi

# The tests marked `solo` (the fault harness: a schedule timed against a load of its own size) cannot
# share the machine with the shards, but the lint can share it with them: mypy, most of it, holds one core
# for about a minute on a fresh clone, and the solo run took 70-80 s after the shards. Side by side they
# take about the longer one's time. The engine takes one thread (SPOOL_N_THREADS=1): with two, llama.cpp's
# threads meet at a barrier after every operation, and while mypy holds a core one of them waits for it
# each time. Seen on a slow stretch (2026-11-28, yardstick 140 ms): 984 ms a decode step, the harness's
# reference requests timed out after 60 s.
SOLO_LOG=$(mktemp /tmp/spool-solo.XXXXXX)
T_TESTS=$SECONDS  # the tests' clock (printed at the end): from here, the solo run's start
SPOOL_COSTS_SHARD=solo SPOOL_N_THREADS=1 "${PYTEST[@]}" -m solo --durations=5 "$@" >"$SOLO_LOG" 2>&1 &
SOLO=$!
lint_rc=0
lint || lint_rc=$?
T_LINT=$SECONDS
solo_rc=0
wait $SOLO || solo_rc=$?
[ "$solo_rc" = 5 ] && solo_rc=0  # "$@" selected none of them
T_SHARDS=$SECONDS
if [ "$lint_rc" != 0 ]; then
  cat "$SOLO_LOG"
  exit "$lint_rc"
fi

# The suite runs in shards, pytest processes side by side, each on a database and Redis dbs of its own
# (ops/harness.py: SPOOL_TEST_SHARD): SPOOL_TEST_SHARDS (2) pytest-xdist workers share the tests a module
# at a time, longest first (tests/conftest.py: COSTS), and the tests marked `wallclock`, which spend
# their time waiting (an outage held, a client paused, a lease running out, the package registry),
# run in a process of their own beside them. Each stack's llama.cpp takes one thread: two one-thread engines on two cores generate ~1.4x
# what one two-thread engine does, and two engines of two threads each slow each other several-fold.
# The tests marked `solo` ran before them, beside the lint. SPOOL_SERIAL=1: one process, as it was. The run
# fails if any shard fails; the wallclock shard's report follows the rest.
export SPOOL_N_THREADS=${SPOOL_N_THREADS:-1}
WALL_LOG=$(mktemp /tmp/spool-wallclock.XXXXXX)
SPOOL_COSTS_SHARD=wallclock SPOOL_TEST_SHARD=$WALL_SHARD "${PYTEST[@]}" -m wallclock --durations=10 "$@" >"$WALL_LOG" 2>&1 &
WALL=$!
TX=()
for shard in $XDIST_SHARDS; do
  TX+=(--tx "popen//env:SPOOL_TEST_SHARD=$shard")
done
rc=0
"${PYTEST[@]}" -m "not wallclock and not solo" --durations=40 "${TX[@]}" --dist loadfile --no-loadscope-reorder "$@" || rc=$?
wall_rc=0
wait $WALL || wall_rc=$?
T_END=$SECONDS
echo
echo "=== the solo tests, run beside the lint, before the shards ==="
cat "$SOLO_LOG"
rm -f "$SOLO_LOG"
echo
echo "=== the wallclock tests, run beside the rest ==="
cat "$WALL_LOG"
rm -f "$WALL_LOG"
echo
echo "=== what each module cost (every shard; CPU: the pytest process and all it started) ==="
.venv/bin/python -m tests.costs "$SPOOL_COSTS" 30 || true
echo
echo "=== time: the solo tests beside the lint $((T_SHARDS - T_TESTS)) s (the lint $((T_LINT - T_TESTS)) s)," \
  "the shards $((T_END - T_SHARDS)) s;" \
  "tests in all (the solo run's start to the last shard's end) $((T_END - T_TESTS)) s ==="
[ "$wall_rc" = 5 ] && wall_rc=0  # "$@" selected none of them
[ "$rc" = 5 ] && rc=0
exit $((rc != 0 || wall_rc != 0 || solo_rc != 0))
