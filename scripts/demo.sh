#!/usr/bin/env bash
# Installs asynctorchx and runs a real two-replica job on the default (local) scheduler,
# following its logs until it ends.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e .
# The single quotes are on purpose: each replica's shell expands the variables.
# shellcheck disable=SC2016
exec asynctorchx run --log utils.sh --num_replicas 2 \
  'echo "hello from replica $REPLICA_ID of $TORCHX_APP_ID"; sleep 0.5; echo "replica $REPLICA_ID done"'
