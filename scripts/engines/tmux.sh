#!/usr/bin/env bash
# Installs tmux, the terminal the CLI's terminal test (tests/test_cli_terminal.py) runs
# `asynctorchx run --log` in. Safe to run again: does nothing when tmux is already installed.
set -euo pipefail

if command -v tmux >/dev/null 2>&1; then
  printf 'tmux.sh: %s already installed\n' "$(tmux -V)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y --no-install-recommends tmux >/dev/null 2>&1; then
  apt-get update >/dev/null
  apt-get install -y --no-install-recommends tmux >/dev/null
fi
printf 'tmux.sh: installed %s\n' "$(tmux -V)" >&2
