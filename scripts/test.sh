#!/usr/bin/env bash
# Installs everything the test suite needs (the package with its dev extras, CPU torch, a Docker
# engine with its local test images, two Slurm clusters: one with accounting, one without, and tmux),
# runs the quick TorchX comparison (informational) and then the whole suite. Safe to run again.
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

log "TorchX 0.7.0 in benchmarks/.venv-torchx (the compatibility tests run it)"
bash benchmarks/setup_torchx.sh

log "benchmark, informational (not a gate): benchmarks/compare_torchx.py --quick"
# Shows that the side-by-side benchmark runs in CI's environment; its numbers are noisy here and
# never fail the run. The JSON goes to .benchmarks/compare_quick.json, a summary line to stderr.
mkdir -p .benchmarks
if timeout 600 python3 benchmarks/compare_torchx.py --quick \
    >.benchmarks/compare_quick.json 2>.benchmarks/compare_quick.log; then
  python3 -c 'import json, sys
d = json.load(open(".benchmarks/compare_quick.json"))
print("TorchX / asynctorchx:", ", ".join(
    "{}{}={:.2f}x".format(s["scenario"], s["params"].get("n", ""), s["ratio"]) for s in d["scenarios"]))
' >&2 || true
else
  log "compare_torchx --quick did not complete (see .benchmarks/*.log); not a gate, going on"
fi

log "tests"
# Engine-backed tests fail (not skip) when their engine is missing. One worker per core
# (pytest-xdist); tests/conftest.py keeps each module on one worker and every module that uses Docker
# or Slurm on the same one. pytest-benchmark, when the machine has it, refuses to load beside xdist.
export ASYNCTORCHX_REQUIRE_ENGINES=1
exec python3 -m pytest -n "${ASYNCTORCHX_TEST_WORKERS:-auto}" --dist loadgroup -p no:benchmark "$@"
