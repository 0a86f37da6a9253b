"""Evaluates the Booth function f(x1, x2) = (x1 + 2*x2 - 7)^2 + (2*x1 + x2 - 5)^2 and records it.

The result goes where TorchX's booth app puts it: the JSON ``{"booth_eval": value}`` in the file
``{tracker_base}/{trial_idx}`` (a local path, ``file://``, or any fsspec URL when fsspec is there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def booth(x1: float, x2: float) -> float:
    return (x1 + 2 * x2 - 7) ** 2 + (2 * x1 + x2 - 5) ** 2


def put(tracker_base: str, key: object, results: dict[str, float]) -> None:
    """Writes ``results`` as indented JSON to ``{tracker_base}/{key}`` (atomically when local)."""
    data = json.dumps(results, indent=2).encode("utf-8")
    local = tracker_base[len("file://") :] if tracker_base.startswith("file://") else tracker_base
    if "://" not in local:
        local = os.path.expanduser(local)  # (as fsspec's local file system does)
        os.makedirs(local, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=local, prefix=".booth-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(local, str(key)))
        return
    try:
        import fsspec
    except ImportError:
        sys.exit(f"booth: --tracker_base {tracker_base!r} needs fsspec (pip install fsspec)")
    fsspec.get_mapper(tracker_base, create=True)[str(key)] = data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="evaluates the booth function at (x1, x2)")
    parser.add_argument("--x1", type=float, required=True, help="x1")
    parser.add_argument("--x2", type=float, required=True, help="x2")
    parser.add_argument("--trial_idx", type=int, default=0, help="the trial's index (the key)")
    parser.add_argument(
        "--tracker_base", default="/tmp/torchx-util-booth", help="where the results go"
    )
    args = parser.parse_args(argv)
    value = booth(args.x1, args.x2)
    put(args.tracker_base, args.trial_idx, {"booth_eval": value})
    print(f"booth({args.x1}, {args.x2}) = {value} -> {args.tracker_base}/{args.trial_idx}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
