#!/usr/bin/env bash
# Installs TorchX 0.7.0 into benchmarks/.venv-torchx for compare_torchx.py. TorchX pins urllib3 < 1.27,
# which would downgrade the project's own environment, so it gets a virtual environment of its own.
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv-torchx/bin/python ] || ! .venv-torchx/bin/python -c 'import torchx' 2>/dev/null; then
  python3 -m venv .venv-torchx
  .venv-torchx/bin/pip install --quiet --disable-pip-version-check 'torchx==0.7.0'
fi
.venv-torchx/bin/python -c 'import torchx; print("torchx", torchx.__version__)'
