"""Start-up time of the ``asynctorchx`` CLI, side by side with TorchX 0.7's: prints JSON.

Every command runs in a fresh process, and the commands alternate round by round (the first round,
which also writes the bytecode caches, is dropped), so that a change in machine load hits them
alike. For each, the wall time (spawn to exit) and the CPU time (user + system of the child, which
load on other cores barely changes) are reported as median, min and max.

What is timed:

- ``python -c pass`` of each interpreter (the floor), ``asynctorchx --help``, ``python -m asynctorchx
  --help``, ``asynctorchx status`` of an unknown local app;
- the read-only queries of issue 17 against real apps: ``status HANDLE``, ``describe HANDLE`` and
  ``list -s local_cwd``. A holder process launches local apps through asynctorchx first (a running
  app of two roles and three replicas, two that succeeded, one that failed) and keeps them for the
  whole run; TorchX's CLI launches its own (``torchx run -s local_cwd utils.echo``), and its
  ``status``/``describe``/``list`` are asked about those.

TorchX's local scheduler keeps its apps in the memory of the process that launched them, so from
another process its CLI can only answer "not found" (``status``, ``describe``: exit 1) or fail
(``list -s local_cwd`` raises "App handles cannot be listed for local scheduler"). Those are the
timed TorchX commands: what a TorchX user gets. To compare like for like, ``torchx_in_process``
also measures what TorchX's runner costs to answer for an app it knows (launched in the same
process) against one it does not: the difference is what its CLI would add to the timed
"not found", were it able to answer.

Two interpreters run asynctorchx: ``installed`` (the console script next to this interpreter) and
``torchx_venv`` (TorchX's virtualenv interpreter, which has asynctorchx's dependencies, running the
same console-script code with the tree on PYTHONPATH). This environment's ``site`` runs a ``.pth``
file that imports ``certifi`` (tens of ms) in the installed interpreter only, so ``torchx_venv`` is
the like-for-like comparison: the same interpreter start-up for both tools. ``--before TREE`` times
another checkout (e.g. main) on the same commands in the same rounds.

No config file applies (run from a temporary directory; ``TORCHXCONFIG`` unset; the script stops if
``~/.torchxconfig`` exists, since each tool would read it). asynctorchx's state root is the default
one, ``{temp dir}/asynctorchx-{uid}``, as most users have it (``TMPDIR`` points at a temporary
directory). Bytecode caching is on, as in a normal install. Usage: ``python benchmarks/cli_startup.py [--runs N] [--before TREE] [--torchx PATH]``.
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
import textwrap
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TREE = HERE.parent

CONSOLE_SCRIPT = """\
#!{python}
import re
import sys
from asynctorchx.cli.main import main
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(main())
"""

HOLDER = """
import json, sys

import anyio
import anyio.to_thread

from asynctorchx.runner import get_runner
from asynctorchx.specs import AppDef, AppState, Role


def role(name, script, n=1):
    return Role(name, image=".", entrypoint="sh", args=["-c", script], num_replicas=n)


async def main():
    async with get_runner() as runner:
        running = await runner.run(
            AppDef("train", [role("trainer", "sleep 3600", 2), role("ps", "sleep 3600")]),
            "local_cwd",
        )
        done = [
            await runner.run(AppDef(name, [role(name, script)]), "local_cwd")
            for name, script in (("ok", "exit 0"), ("ok2", "exit 0"), ("bad", "exit 3"))
        ]
        for handle in done:
            await runner.wait(handle, timeout=60)
        with anyio.fail_after(60):
            while (await runner.status(running)).state != AppState.RUNNING:
                await anyio.sleep(0.05)
        print(json.dumps({"running": running, "finished": done}), flush=True)
        await anyio.to_thread.run_sync(sys.stdin.read)


anyio.run(main)
"""

TORCHX_IN_PROCESS = """
import json, statistics, sys, tempfile, time

from torchx import specs
from torchx.runner import get_runner

N = 200


def per_call(fn):
    times = []
    for _ in range(N):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_ms": round(statistics.median(times) * 1e3, 4),
            "min_ms": round(min(times) * 1e3, 4), "max_ms": round(max(times) * 1e3, 4)}


with tempfile.TemporaryDirectory() as logs:
    runner = get_runner()
    app = specs.AppDef("sleeper", roles=[specs.Role("sleeper", image=".", entrypoint="sleep",
                                                     args=["60"])])
    handle = runner.run(app, scheduler="local_cwd", cfg={"log_dir": logs})
    unknown = "local_cwd://torchx/no-such-app-0"
    out = {
        "handle": handle,
        "calls": N,
        "status_known_format": per_call(lambda: runner.status(handle).format()),
        "describe_known": per_call(lambda: runner.describe(handle)),
        "status_unknown": per_call(lambda: runner.status(unknown)),
        "describe_unknown": per_call(lambda: runner.describe(unknown)),
    }
    runner.cancel(handle)
    runner.close()
print(json.dumps(out))
"""

QUERIES = ("status", "describe", "list")


def _installed_script() -> str:
    candidate = Path(sys.executable).parent / "asynctorchx"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("asynctorchx")
    if found is None:
        raise SystemExit("asynctorchx is not installed: pip install -e .")
    return found


def _once(cmd: list[str], env: dict[str, str], cwd: str) -> tuple[float, float, int, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, env=env, cwd=cwd, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    said = (proc.stdout + proc.stderr).decode(errors="replace").strip().splitlines()
    return wall, cpu, proc.returncode, said[-1][:160] if said else ""


def _summary(samples: list[tuple[float, float]]) -> dict[str, float]:
    walls = [w for w, _ in samples]
    cpus = [c for _, c in samples]
    return {
        "wall_median_s": round(statistics.median(walls), 4),
        "wall_min_s": round(min(walls), 4),
        "wall_max_s": round(max(walls), 4),
        "cpu_median_s": round(statistics.median(cpus), 4),
        "cpu_min_s": round(min(cpus), 4),
        "cpu_max_s": round(max(cpus), 4),
        "runs": len(samples),
    }


def _launch_torchx_apps(torchx: str, env: dict[str, str], cwd: str, n: int) -> list[str]:
    handles = []
    for i in range(n):
        proc = subprocess.run(
            [torchx, "run", "-s", "local_cwd", "utils.echo", "--msg", f"hello {i}"],
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd,
            check=False,
            timeout=120,
        )
        if proc.returncode != 0 or not proc.stdout.strip():
            raise SystemExit(f"torchx run failed ({proc.returncode}): {proc.stderr[-500:]}")
        handles.append(proc.stdout.strip().splitlines()[-1])
    return handles


def _ratio(results: dict[str, Any], torchx: str, ours: str) -> dict[str, float]:
    a, b = results[torchx], results[ours]
    return {
        "wall": round(a["wall_median_s"] / b["wall_median_s"], 2),
        "cpu": round(a["cpu_median_s"] / b["cpu_median_s"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--before", type=Path, help="another tree to time alongside (e.g. main)")
    parser.add_argument(
        "--torchx",
        type=Path,
        default=HERE / ".venv-torchx" / "bin" / "torchx",
        help="TorchX 0.7's console script (default: benchmarks/.venv-torchx, setup_torchx.sh)",
    )
    args = parser.parse_args()
    if Path.home().joinpath(".torchxconfig").exists():
        raise SystemExit("~/.torchxconfig exists: both tools would read it; move it away first")
    torchx = str(args.torchx) if args.torchx.exists() else None
    venv_python = str(args.torchx.parent / "python") if torchx else None

    base_env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONDONTWRITEBYTECODE", "TORCHXCONFIG", "PYTHONPATH", "FORCE_COLOR")
    }
    base_env["NO_COLOR"] = "1"
    trees = {"after": TREE}
    if args.before is not None:
        trees["before"] = args.before.resolve()

    with tempfile.TemporaryDirectory() as tmp:
        work, root = Path(tmp) / "cwd", Path(tmp) / "tmp"
        work.mkdir()
        root.mkdir()
        cwd = str(work)
        # the default state root ({temp dir}/asynctorchx-{uid}), as most users have it
        env = {**base_env, "TMPDIR": str(root)}
        env.pop("ASYNCTORCHX_LOCAL_ROOT", None)
        interpreters = {"installed": _installed_script()}
        if venv_python:
            shim = Path(tmp) / "bin" / "asynctorchx"
            shim.parent.mkdir()
            shim.write_text(CONSOLE_SCRIPT.format(python=venv_python))
            shim.chmod(0o755)
            interpreters["torchx_venv"] = str(shim)

        holder_file = Path(tmp) / "holder.py"
        holder_file.write_text(textwrap.dedent(HOLDER))
        holder = subprocess.Popen(
            [sys.executable, str(holder_file)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env={**env, "PYTHONPATH": str(TREE)},
        )
        try:
            assert holder.stdout is not None
            line = holder.stdout.readline()
            if not line:
                raise SystemExit(f"the holder of the local apps exited with {holder.wait()}")
            apps = json.loads(line)
            handle = apps["running"]
            commands: dict[str, tuple[list[str], dict[str, str]]] = {
                "python_floor:installed": ([sys.executable, "-c", "pass"], env),
            }
            if venv_python:
                commands["python_floor:torchx_venv"] = ([venv_python, "-c", "pass"], env)
            for tree_name, tree in trees.items():
                tree_env = {**env, "PYTHONPATH": str(tree)}
                for interp, script in interpreters.items():
                    prefix = f"asynctorchx:{tree_name}:{interp}"
                    commands[f"{prefix}:help"] = ([script, "--help"], tree_env)
                    commands[f"{prefix}:status"] = ([script, "status", handle], tree_env)
                    commands[f"{prefix}:describe"] = ([script, "describe", handle], tree_env)
                    commands[f"{prefix}:list"] = ([script, "list", "-s", "local_cwd"], tree_env)
                    unknown = "local_cwd://asynctorchx/no-such-app-0"
                    commands[f"{prefix}:status_unknown"] = ([script, "status", unknown], tree_env)
                commands[f"asynctorchx:{tree_name}:installed:python_m_help"] = (
                    [sys.executable, "-m", "asynctorchx", "--help"],
                    tree_env,
                )
            torchx_handles: list[str] = []
            in_process: dict[str, Any] | None = None
            if torchx and venv_python:
                torchx_handles = _launch_torchx_apps(torchx, env, cwd, 3)
                commands["torchx:help"] = ([torchx, "--help"], env)
                commands["torchx:status"] = ([torchx, "status", torchx_handles[0]], env)
                commands["torchx:describe"] = ([torchx, "describe", torchx_handles[0]], env)
                commands["torchx:list"] = ([torchx, "list", "-s", "local_cwd"], env)
                measured = subprocess.run(
                    [venv_python, "-c", TORCHX_IN_PROCESS],
                    capture_output=True,
                    text=True,
                    env=env,
                    cwd=cwd,
                    check=True,
                    timeout=300,
                )
                in_process = json.loads(measured.stdout)

            samples: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
            answers: dict[str, dict[str, Any]] = {}
            for round_ in range(args.runs + 1):
                for name, (cmd, cmd_env) in commands.items():
                    wall, cpu, code, said = _once(cmd, cmd_env, cwd)
                    if round_:
                        samples[name].append((wall, cpu))
                    else:
                        answers[name] = {"exit_code": code, "last_line": said}
        finally:
            if holder.stdin is not None:
                holder.stdin.close()
            holder.wait(timeout=120)
            if holder.stdout is not None:
                holder.stdout.close()

    results: dict[str, Any] = {
        name: {**_summary(s), **answers[name]} for name, s in samples.items()
    }
    ratios: dict[str, Any] = {}
    if torchx:
        for tree_name in trees:
            for interp in interpreters:
                for query in (*QUERIES, "help"):
                    ours = f"asynctorchx:{tree_name}:{interp}:{query}"
                    ratios[f"{query}:{tree_name}:{interp}"] = _ratio(
                        results, f"torchx:{query}", ours
                    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(
        json.dumps(
            {
                "benchmark": "cli_startup",
                "cpus": os.cpu_count(),
                "load_average_1m": load,
                "runs": args.runs,
                "interpreters": {
                    "installed": sys.executable,
                    "torchx_venv": venv_python,
                },
                "trees": {k: str(v) for k, v in trees.items()},
                "asynctorchx_apps": apps,
                "torchx_apps": torchx_handles,
                "ratios_torchx_over_asynctorchx": ratios,
                "torchx_in_process": in_process,
                "commands": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
