"""TorchX 0.7.0 in a virtual environment of its own, for the compatibility tests.

``benchmarks/setup_torchx.sh`` makes it (``benchmarks/.venv-torchx``; TorchX pins urllib3 < 1.27, so it
cannot share the project's environment) and ``scripts/test.sh`` runs that script before the suite.
Tests that compare with TorchX run its Python as a subprocess: ``torchx_python()``.
"""

from __future__ import annotations

from pathlib import Path

from conftest import engine_missing

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / "benchmarks" / ".venv-torchx"


def torchx_python() -> str:
    """The Python of the TorchX venv; fails the test in CI (skips elsewhere) when it is missing."""
    python = VENV / "bin" / "python"
    if not python.exists():
        engine_missing(
            f"the TorchX 0.7 virtual environment ({VENV}; run benchmarks/setup_torchx.sh)"
        )
    return str(python)


def run_torchx(code: str, **env: str) -> str:
    """Runs ``code`` (dedented) with TorchX 0.7's Python and ``env`` added; returns its stdout."""
    import os
    import subprocess
    import textwrap

    proc = subprocess.run(
        [torchx_python(), "-c", textwrap.dedent(code)],
        env={**os.environ, "PYTHONPATH": "", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout
