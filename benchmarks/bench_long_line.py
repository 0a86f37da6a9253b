"""Peak memory of reading back one very long log line; prints one JSON object.

A local app writes one line of N bytes (plus its ``\\n``) to stdout. Then, each in a fresh process
whose peak RSS (``ru_maxrss``) is measured from its parent:

- ``api``: ``runner.log_lines(handle, role, 0)`` iterated, characters counted (the reader alone);
- ``cli``: ``asynctorchx log HANDLE`` (the reader, the runner and the CLI's printing);
- ``cli_json``: ``asynctorchx log --json HANDLE``;
- ``baseline``: ``asynctorchx log`` of an app that printed one short line (the interpreter's own
  memory, to subtract).

The output of the CLI modes is read through a pipe in 1 MiB pieces and its size checked, so the
line is really printed whole. ``peak_mib`` is the process's peak RSS; ``extra_per_line_byte`` is
(peak - baseline) / N: about 1 when the line is held once, 2 when held as bytes and as str at once.

Run: ``python benchmarks/bench_long_line.py [--sizes 50M,1G] [--modes api,cli,cli_json]``. To
compare with another tree, put it first on ``PYTHONPATH`` (the CLI and the children import it too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

MEASURE = r"""
import resource, subprocess, sys, time
t = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE)
size = 0
while chunk := proc.stdout.read(1 << 20):
    size += len(chunk)
code = proc.wait()
rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(f"{code} {size} {rss_kib} {time.perf_counter() - t:.3f}")
"""

API = r"""
import asyncio, sys
from asynctorchx import AsyncRunner
async def main():
    session, handle = sys.argv[1], sys.argv[2]
    async with AsyncRunner(name=session) as runner:
        n = 0
        async for line in runner.log_lines(handle, "sh", 0):
            n += len(line)
    print(n)
asyncio.run(main())
"""

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def cli_exe() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "asynctorchx")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "asynctorchx"]


def launch(env: dict[str, str], size: int) -> str:
    """Runs an app printing one line of ``size`` bytes; returns its handle once it ended."""
    script = f"head -c {size} /dev/zero | tr '\\0' x; echo"
    run = subprocess.run(
        [*cli_exe(), "run", "utils.sh", "--", "sh", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return run.stdout.strip()


def measure(env: dict[str, str], argv: list[str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, *argv], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    code, size, rss_kib, seconds = int(out[0]), int(out[1]), int(out[2]), float(out[3])
    return {"exit": code, "output_bytes": size, "peak_mib": round(rss_kib / 1024, 1), "s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50M,1G")
    parser.add_argument("--modes", default="api,cli,cli_json")
    args = parser.parse_args()
    modes = args.modes.split(",")
    tmp = tempfile.mkdtemp(prefix="bench-long-line-")
    env = {**os.environ, "ASYNCTORCHX_LOCAL_ROOT": os.path.join(tmp, "root"), "TORCHXCONFIG": ""}
    import asynctorchx

    result: dict[str, Any] = {
        "package": os.path.dirname(asynctorchx.__file__),
        "python": sys.version.split()[0],
        "sizes": {},
    }
    try:
        small = launch(env, 10)
        base = measure(env, [*cli_exe(), "log", small])
        result["baseline_peak_mib"] = base["peak_mib"]
        for text in args.sizes.split(","):
            size = parse_size(text)
            t = time.perf_counter()
            handle = launch(env, size)
            row: dict[str, Any] = {"bytes": size, "launch_s": round(time.perf_counter() - t, 2)}
            session = handle.split("://", 1)[1].split("/", 1)[0]
            for mode in modes:
                if mode == "api":
                    argv = [sys.executable, "-c", API, session, handle]
                elif mode == "cli":
                    argv = [*cli_exe(), "log", handle]
                elif mode == "cli_json":
                    argv = [*cli_exe(), "log", "--json", handle]
                else:
                    raise SystemExit(f"unknown mode {mode!r}")
                m = measure(env, argv)
                if mode.startswith("cli"):
                    m["whole_line_printed"] = m["output_bytes"] > size
                m["extra_per_line_byte"] = round(
                    (m["peak_mib"] - base["peak_mib"]) * (1 << 20) / size, 2
                )
                row[mode] = m
            result["sizes"][text] = row
            shutil.rmtree(os.path.join(tmp, "root"), ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
