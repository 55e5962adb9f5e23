#!/usr/bin/env bash
# The test command (README, CI): install, lint, check the architecture, then run every test against
# real Postgres, Redis, Celery worker processes and the real SmolLM2 model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/bootstrap.sh
.venv/bin/ruff check .
.venv/bin/lint-imports
exec .venv/bin/python -m pytest tests -p no:cacheprovider -ra "$@"
