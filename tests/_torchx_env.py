"""TorchX 0.7.0 in a virtual environment of its own, for the compatibility tests.

``benchmarks/setup_torchx.sh`` makes it (``benchmarks/.venv-torchx``; TorchX pins urllib3 < 1.27, so it
cannot share the project's environment) with asynctorchx's runtime dependencies, and
``scripts/test.sh`` runs that script before the suite. Tests that compare with TorchX run its Python
as a subprocess: ``torchx_python()``, or ``run_in_torchx(code)``, which puts the tree under test first
on ``PYTHONPATH`` so that the code imports the real ``torchx`` and this tree's ``asynctorchx``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

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


def torchx_env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess in the TorchX venv: this tree first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *extra.pop("PYTHONPATH", "").split(os.pathsep)])
    env["PYTHONPATH"] = env["PYTHONPATH"].rstrip(os.pathsep)
    env.update(extra)
    return env


_PRELUDE = f"""
import sys, asynctorchx, torchx
assert asynctorchx.__file__.startswith({str(REPO) + os.sep!r}), asynctorchx.__file__
assert torchx.__version__ == "0.7.0", torchx.__version__
"""


def run_in_torchx(
    code: str, *, cwd: Path | None = None, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` with the TorchX venv's Python, after checking which packages it imports."""
    return subprocess.run(
        [torchx_python(), "-c", _PRELUDE + code],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=torchx_env(**env),
        check=False,
    )


def json_from_torchx(code: str, **kwargs: Any) -> Any:
    """The JSON ``code`` prints on its last stdout line, run as ``run_in_torchx`` runs it."""
    done = run_in_torchx(code, **kwargs)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


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
