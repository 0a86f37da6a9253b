#!/usr/bin/env bash
# Installs TorchX 0.7.0 into benchmarks/.venv-torchx, for compare_torchx.py and the compatibility tests.
# TorchX pins urllib3 < 1.27, which would downgrade the project's own environment, so it gets a virtual
# environment of its own. asynctorchx's runtime dependencies go in too (not asynctorchx itself): the
# compatibility tests run this venv's Python with the tree under test first on PYTHONPATH, so that a
# component file loads the real torchx and the asynctorchx being tested side by side.
set -euo pipefail
cd "$(dirname "$0")"
PIP=(.venv-torchx/bin/pip install --quiet --disable-pip-version-check)
if [ ! -x .venv-torchx/bin/python ] || ! .venv-torchx/bin/python -c 'import torchx' 2>/dev/null; then
  python3 -m venv .venv-torchx
  "${PIP[@]}" 'torchx==0.7.0'
fi
if ! .venv-torchx/bin/python -c 'import anyio, aiofiles, pathspec' 2>/dev/null; then
  "${PIP[@]}" 'anyio>=4.3' 'aiofiles>=23.2' 'pathspec>=1.1'
fi
.venv-torchx/bin/python -c 'import torchx, anyio; print("torchx", torchx.__version__)'
