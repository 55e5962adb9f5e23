#!/usr/bin/env bash
# Run Spool on this machine: install, migrate, print a first API key, and serve on :8000.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/bootstrap.sh
exec .venv/bin/spool up "$@"
