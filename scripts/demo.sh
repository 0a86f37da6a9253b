#!/usr/bin/env bash
# Installs asynctorchx and runs a real two-replica job on the default (local) scheduler,
# following its logs until it ends. (ASYNCTORCHX_DEMO_NO_INSTALL=1 skips the install: the test
# suite runs this script that way.)
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${ASYNCTORCHX_DEMO_NO_INSTALL:-0} != 1 ]]; then
  python3 -m pip install --quiet --disable-pip-version-check -e .
fi
# The single quotes are on purpose: the macro is substituted per replica, and each replica's shell
# expands the variables.
# shellcheck disable=SC2016
exec asynctorchx run --log utils.sh --num_replicas 2 --env 'REPLICA_ID=${replica_id}' -- \
  sh -c 'echo "hello from replica $REPLICA_ID of $TORCHX_JOB_ID"; sleep 0.5; echo "replica $REPLICA_ID done"'
