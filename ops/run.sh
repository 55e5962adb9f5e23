#!/usr/bin/env bash
# Run Spool on this machine: install, migrate, print a first API key, and serve on :8000.
#   bash ops/run.sh                          the CPU engine and the bundled SmolLM2
#   bash ops/run.sh --registry ops/models.host.example.toml
#                                            a GPU host, after its engine's install step (docs/gpu.md)
# Arguments go to `spool up` (--registry FILE: the registry API, worker and dispatcher all read).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/bootstrap.sh
exec .venv/bin/spool up "$@"
