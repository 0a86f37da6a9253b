"""PATH shims for the Slurm commands: a directory whose squeue obeys control files in it.

Control files (in the shim directory):
- ``hang``: every squeue sleeps 1000 s.
- ``slow_once``: the first squeue to take it runs the real one, touches ``slow_captured``, then
  waits (60 s at most) for a file ``go`` before printing what it got (a stale answer delivered late).
- ``drop_once``: like ``drop``, for the one squeue that takes it.
- ``drop`` (content: job ids, one a line): squeue's JSON listing leaves those jobs out.
- ``count``: one line appended per squeue call (its start time).
"""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

REAL_SQUEUE = shutil.which("squeue") or "/usr/bin/squeue"

SQUEUE = f"""#!/bin/bash
D="$(cd "$(dirname "$0")" && pwd)"
date +%s.%N >> "$D/count"
if [ -f "$D/hang" ]; then sleep 1000; fi
if mv "$D/slow_once" "$D/slow_once.taken" 2>/dev/null; then
  out="$({REAL_SQUEUE} "$@")"; rc=$?
  touch "$D/slow_captured"
  for i in $(seq 600); do [ -f "$D/go" ] && break; sleep 0.1; done
  printf '%s\\n' "$out"; exit $rc
fi
DROPFILE=""
if mv "$D/drop_once" "$D/drop_once.taken" 2>/dev/null; then DROPFILE="$D/drop_once.taken";
elif [ -s "$D/drop" ]; then DROPFILE="$D/drop"; fi
if [ -n "$DROPFILE" ]; then
  {REAL_SQUEUE} "$@" | DROP="$DROPFILE" python3 -c '
import json, os, sys
drop = set(open(os.environ["DROP"]).read().split())
doc = json.load(sys.stdin)
doc["jobs"] = [j for j in doc.get("jobs", []) if str(j.get("het_job_id") or j.get("job_id")) not in drop]
json.dump(doc, sys.stdout)
'
  exit ${{PIPESTATUS[0]}}
fi
exec {REAL_SQUEUE} "$@"
"""


def make_shims(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "squeue"
    path.write_text(SQUEUE)
    path.chmod(path.stat().st_mode | stat.S_IEXEC | stat.S_IXGRP | stat.S_IXOTH)
    return directory


def squeue_calls(directory: Path) -> int:
    f = directory / "count"
    return len(f.read_text().splitlines()) if f.exists() else 0
