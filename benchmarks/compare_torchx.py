"""asynctorchx vs TorchX, side by side on their ``local_cwd`` schedulers; prints JSON.

    bash benchmarks/setup_torchx.sh                 # TorchX 0.7.0 in benchmarks/.venv-torchx
    python benchmarks/compare_torchx.py [--quick]   # --quick: smaller sizes, one round, < 2 minutes

Every measurement runs in a fresh interpreter (``_compare_worker.py``) with its own temporary state and
log directory, and the two implementations alternate within each round (the order flips every round)
so that machine noise hits both alike. TorchX is driven the best way a TorchX user can: one waiter
thread per app with ``wait_interval=0.1`` and its app cache raised above the number of apps.

``cold_start`` times a fresh process from before the library's import to its first app being
terminal (imports, runner, scheduler set-up included). The ``fanout`` scenarios run one warm-up app
first on both sides, so they time launching N apps and waiting for all of them, not the one-off set-up
(which TorchX does at import and ``get_runner`` time and asynctorchx lazily at the first launch).

Both sides import compiled modules, as a ``pip install`` leaves them: TorchX's virtual environment
was compiled by pip, and the asynctorchx tree under test is compiled (``compileall``) before the first
round. Without that, an editable install in an environment with ``PYTHONDONTWRITEBYTECODE=1`` (this
machine kind sets it) compiles the whole package from source in every fresh interpreter: cold start
measured 0.26 s instead of 0.16 s.

For each scenario the output has, per implementation, the median and range of the headline metric
over the rounds, and ``ratio`` = TorchX / asynctorchx (above 1: asynctorchx is better, since every
headline metric here is lower-is-better).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_compare_worker.py"
DEFAULT_TORCHX_PY = HERE / ".venv-torchx" / "bin" / "python"

# (name, params, headline metric path) in full and quick mode
FULL: list[tuple[str, dict[str, Any], str]] = [
    ("cold_start", {}, "seconds"),
    ("fanout", {"n": 10}, "seconds"),
    ("fanout", {"n": 50}, "seconds"),
    ("fanout", {"n": 200}, "seconds"),
    ("fanout", {"n": 1000}, "seconds"),
    ("wake", {"n": 30}, "latency_ms.median"),
    ("idle_cpu", {"n": 100, "seconds": 20}, "cpu_percent"),
    ("tail", {"lines": 60}, "latency_ms.median"),
    ("read_finished", {"lines": 200_000}, "seconds"),
    ("read_tailing", {"lines": 200_000}, "seconds"),
    ("cancel", {"settle": 1.0}, "terminal_s"),
]
QUICK: list[tuple[str, dict[str, Any], str]] = [
    ("cold_start", {}, "seconds"),
    ("fanout", {"n": 10}, "seconds"),
    ("fanout", {"n": 200}, "seconds"),
    ("wake", {"n": 10}, "latency_ms.median"),
    ("idle_cpu", {"n": 50, "seconds": 5}, "cpu_percent"),
    ("tail", {"lines": 20}, "latency_ms.median"),
    ("read_finished", {"lines": 200_000}, "seconds"),
    ("read_tailing", {"lines": 50_000}, "seconds"),
    ("cancel", {"settle": 0.5}, "terminal_s"),
]

# secondary metrics summarised next to the headline (median, min, max over the rounds)
EXTRA: dict[str, list[str]] = {
    "cold_start": ["with_close_s"],
    "wake": ["latency_ms.p95", "latency_ms.max"],
    "tail": ["latency_ms.p95", "latency_ms.max"],
    "read_finished": ["cpu_s", "intact_lines"],
    "read_tailing": ["after_app_end_ms", "cpu_s", "intact_lines"],
    "cancel": ["cancel_returned_s", "survivors"],
}


def dig(result: dict[str, Any], path: str) -> float | None:
    value: Any = result
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return float(value) if isinstance(value, (int, float)) else None


def compile_tree() -> None:
    """Writes the bytecode of the asynctorchx tree under test (what ``pip install`` does)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(HERE.parent / "asynctorchx")],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )


def measure(
    python: str, impl: str, scenario: str, params: dict[str, Any], timeout: float
) -> dict[str, Any]:
    cmd = [python, str(WORKER), impl, scenario, json.dumps(params)]
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    try:
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {"error": f"no JSON in output: {proc.stdout[-200:]!r}"}


def summarise(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, one round (< 2 minutes)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds per scenario (default 5, quick 1)"
    )
    parser.add_argument(
        "--torchx-python", default=None, help="an interpreter with torchx installed"
    )
    parser.add_argument("--only", default=None, help="run only scenarios whose name contains this")
    args = parser.parse_args()

    torchx_py = args.torchx_python or (
        str(DEFAULT_TORCHX_PY) if DEFAULT_TORCHX_PY.exists() else sys.executable
    )
    has_torchx = (
        subprocess.run(
            [torchx_py, "-c", "import torchx"], capture_output=True, check=False
        ).returncode
        == 0
    )
    rounds = args.rounds or (1 if args.quick else 5)
    plan = QUICK if args.quick else FULL
    if args.only:
        plan = [p for p in plan if args.only in p[0]]

    compile_tree()
    started = time.time()
    scenarios = []
    for name, params, metric in plan:
        per_impl: dict[str, list[dict[str, Any]]] = {"asynctorchx": [], "torchx": []}
        for r in range(rounds):
            order = ["asynctorchx", "torchx"] if r % 2 == 0 else ["torchx", "asynctorchx"]
            for impl in order:
                if impl == "torchx" and not has_torchx:
                    per_impl[impl].append(
                        {"error": "torchx is not installed (run benchmarks/setup_torchx.sh)"}
                    )
                    continue
                python = torchx_py if impl == "torchx" else sys.executable
                per_impl[impl].append(measure(python, impl, name, params, timeout=600))
        entry: dict[str, Any] = {"scenario": name, "params": params, "metric": metric}
        medians = {}
        for impl, runs in per_impl.items():
            values = [v for v in (dig(run, metric) for run in runs) if v is not None]
            entry[impl] = {
                "summary": summarise(values),
                "extra": {
                    path: summarise([v for v in (dig(run, path) for run in runs) if v is not None])
                    for path in EXTRA.get(name, [])
                },
                "runs": runs,
            }
            if values:
                medians[impl] = statistics.median(values)
        if "asynctorchx" in medians and "torchx" in medians and medians["asynctorchx"] > 0:
            entry["ratio"] = medians["torchx"] / medians["asynctorchx"]
        scenarios.append(entry)
        print(
            json.dumps({"progress": name, "params": params, "ratio": entry.get("ratio")}),
            file=sys.stderr,
        )

    print(
        json.dumps(
            {
                "machine": {
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                },
                "mode": "quick" if args.quick else "full",
                "rounds": rounds,
                "seconds": time.time() - started,
                "scenarios": scenarios,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
