#!/usr/bin/env bash
# Installs everything the test suite needs (the package with its dev extras, CPU torch, a Docker
# engine, a Slurm cluster with accounting) and runs the whole suite. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*" >&2; }

log "python packages"
python3 -m pip install --quiet --disable-pip-version-check -e '.[dev]'
python3 -m pip install --quiet --disable-pip-version-check 'torch==2.13.0'

for engine in scripts/engines/*.sh; do
  log "engine: $engine"
  bash "$engine"
done

log "tests"
# Engine-backed tests fail (not skip) when their engine is missing.
export ASYNCTORCHX_REQUIRE_ENGINES=1
exec python3 -m pytest "$@"
