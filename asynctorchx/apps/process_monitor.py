"""Runs a program until a condition is met: a timeout, or a file appearing (TorchX's process monitor).

``--start_on_file PATH`` waits for PATH to exist before starting the program (exit 34 if the timeout
comes first); ``--exit_on_file PATH`` stops the program once PATH exists; ``--timeout S`` stops it
after S seconds in all. Paths are local, ``file://``, or any fsspec URL when fsspec is installed.
Stopping is SIGTERM, then SIGKILL after ``--kill_timeout`` seconds.

Exit status: the program's own when it ends by itself; 0 when it was stopped because
``--exit_on_file`` appeared (the service was asked to end); 34 when the timeout stopped it or came
before the start file.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable

TIMEOUT_EXIT_CODE = 34


def exists_fn(url: str) -> Callable[[], bool]:
    """A function telling whether ``url`` exists now."""
    local = url[len("file://") :] if url.startswith("file://") else url
    if "://" not in local:
        local = os.path.expanduser(local)  # (as fsspec's local file system does)
        return lambda: os.path.exists(local)
    try:
        import fsspec
    except ImportError:
        sys.exit(f"process_monitor: {url!r} needs fsspec (pip install fsspec)")
    fs, path = fsspec.core.url_to_fs(url)
    return lambda: bool(fs.exists(path))


def stop(p: subprocess.Popen[bytes], kill_timeout: float) -> None:
    """SIGTERM, then SIGKILL if the program is still there after ``kill_timeout`` seconds."""
    p.terminate()
    print("issued terminate, waiting for exit...", flush=True)
    try:
        p.wait(kill_timeout)
    except subprocess.TimeoutExpired:
        print("reached safe termination timeout, killing...", flush=True)
        p.kill()
        p.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="runs a program and stops it when a condition is met"
    )
    parser.add_argument("--timeout", type=float, help="seconds before the program is stopped")
    parser.add_argument("--start_on_file", type=str, help="start the program once this exists")
    parser.add_argument("--exit_on_file", type=str, help="stop the program once this exists")
    parser.add_argument("--poll_rate", type=float, default=5, help="seconds between checks")
    parser.add_argument(
        "--kill_timeout", type=float, default=60, help="seconds between SIGTERM and SIGKILL"
    )
    parser.add_argument("entrypoint", help="the program")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.timeout if args.timeout else None

    if args.start_on_file:
        start_file = exists_fn(args.start_on_file)
        while not start_file():
            if deadline is not None and time.monotonic() > deadline:
                print("reached timeout before starting, exiting", flush=True)
                return TIMEOUT_EXIT_CODE
            time.sleep(args.poll_rate)
        print(f"{args.start_on_file} exists, starting the program", flush=True)

    exit_file = exists_fn(args.exit_on_file) if args.exit_on_file else None
    p = subprocess.Popen([args.entrypoint, *args.args])
    print(f"started process {p.pid}", flush=True)
    while True:
        wait = args.poll_rate
        if deadline is not None:
            wait = max(0.0, min(wait, deadline - time.monotonic()))
        try:
            code = p.wait(wait)
            print(f"process exited with exit code {code}", flush=True)
            return code if code >= 0 else 128 - code
        except subprocess.TimeoutExpired:
            pass
        if deadline is not None and time.monotonic() >= deadline:
            print("reached timeout, stopping the program", flush=True)
            stop(p, args.kill_timeout)
            return TIMEOUT_EXIT_CODE
        if exit_file is not None and exit_file():
            print(f"{args.exit_on_file} exists, stopping the program", flush=True)
            stop(p, args.kill_timeout)
            return 0


if __name__ == "__main__":
    sys.exit(main())
