"""Start-up time of the ``asynctorchx`` console script: prints JSON with medians of N runs.

Each command runs in a fresh process: ``asynctorchx --help``, ``python -m asynctorchx --help``,
``asynctorchx status`` of an unknown local app (imports the runner and the local backend, reads the
state root), and ``python -c pass`` as the floor. The commands alternate round by round so that a
change in machine load hits them alike. For each, the wall time (spawn to exit) and the CPU time
(user + system of the child, which load on other cores barely changes) are reported.

Bytecode caching is on, as in a normal install (the first, dropped, round writes it). The console
script is the one next to this interpreter (a pyenv shim would add its own start-up).
Usage: ``python benchmarks/cli_startup.py [--runs N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _script() -> str:
    candidate = Path(sys.executable).parent / "asynctorchx"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("asynctorchx")
    if found is None:
        raise SystemExit("asynctorchx is not installed: pip install -e .")
    return found


def _once(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def _summary(samples: list[tuple[float, float]]) -> dict[str, float]:
    walls = [w for w, _ in samples]
    cpus = [c for _, c in samples]
    return {
        "wall_median_s": round(statistics.median(walls), 4),
        "wall_min_s": round(min(walls), 4),
        "cpu_median_s": round(statistics.median(cpus), 4),
        "runs": len(samples),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    script = _script()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(NO_COLOR="1", TORCHXCONFIG="")
    with tempfile.TemporaryDirectory() as root:
        env["ASYNCTORCHX_LOCAL_ROOT"] = root
        commands = {
            "python_floor": [sys.executable, "-c", "pass"],
            "help": [script, "--help"],
            "python_m_help": [sys.executable, "-m", "asynctorchx", "--help"],
            "status_unknown_local": [script, "status", "local_cwd://asynctorchx/no-such-app-0"],
        }
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
        for round_ in range(args.runs + 1):
            for name, cmd in commands.items():
                result = _once(cmd, env)
                if round_:
                    samples[name].append(result)
    results = {name: _summary(s) for name, s in samples.items()}
    results["help_over_floor"] = {
        "wall_median_s": round(
            results["help"]["wall_median_s"] - results["python_floor"]["wall_median_s"], 4
        ),
        "cpu_median_s": round(
            results["help"]["cpu_median_s"] - results["python_floor"]["cpu_median_s"], 4
        ),
    }
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(
        json.dumps(
            {
                "benchmark": "cli_startup",
                "script": script,
                "cpus": os.cpu_count(),
                "load_average_1m": load,
                **results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
