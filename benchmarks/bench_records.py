"""The cost of app records on their own: writing and reading them through ``RecordStore``; prints
JSON.

    python benchmarks/bench_records.py              # under the temp dir (this VM: ext4)
    python benchmarks/bench_records.py --root DIR   # under DIR (e.g. a tmpfs)
    python benchmarks/bench_records.py --churn 5000 # after 5000 files were created and deleted

Three measurements, each in a fresh directory:

- ``lifecycle``: N apps of one replica, each written twice (RUNNING, then SUCCEEDED), as a fan-out
  writes them, one app per ``write_many`` call: the time per app and its file-system cost.
  ``lifecycle_from_spares``: the same with the store's spare files made first (as a launcher makes
  them in a lull; that cost is reported apart, per spare), so each new record is a spare linked
  into place (trees without spares skip it). ``lifecycle_claimed_from_spares``: the same, each
  app's id claimed first as a launcher does (``RecordStore.claim``: a hard link of one shared
  file, removed by the terminal write), the claims' own time also given apart (trees without
  claims skip it).
- ``read_1_replica`` and ``read_2000_replicas``: ``RecordStore.read`` of an app of one replica and
  of one of 2000 replicas, whose record was written ``--versions`` times (as an app's record is
  written while its replicas start and end), timed one read at a time: median, p90 and max in
  microseconds.

Runs on any tree with ``RecordStore`` (``PYTHONPATH=TREE`` measures another one).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from asynctorchx.schedulers._local.records import RecordStore


def _doc(app_id: str, replicas: int, state: str, version: int) -> dict[str, Any]:
    now = time.time()
    return {
        "format": 1,
        "app_id": app_id,
        "name": "bench",
        "backend": "local_cwd",
        "session": "bench",
        "state": state,
        "msg": f"version {version}",
        "submitted_at": now,
        "app_dir": f"/tmp/bench/{app_id}",
        "grace_period": 5.0,
        "owner": {"pid": 1, "start_ticks": 1},
        "replicas": [
            {
                "role": "trainer",
                "id": k,
                "state": state,
                "pid": None,
                "start_ticks": None,
                "exit_code": 0 if state == "SUCCEEDED" else None,
                "attempts": 1,
                "started_at": now,
                "ended_at": now if state == "SUCCEEDED" else None,
                "log_dir": f"/tmp/bench/{app_id}/trainer/{k}",
                "error_file": f"/tmp/bench/{app_id}/trainer/{k}/error.json",
                "structured_error_msg": "<NONE>",
            }
            for k in range(replicas)
        ],
        "app": {"name": "bench", "roles": [{"name": "trainer", "image": "x", "entrypoint": "sh"}]},
        "cgroup": None,
    }


def _stats_us(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_us": round(statistics.median(ordered) * 1e6, 1),
        "p90_us": round(ordered[int(len(ordered) * 0.9)] * 1e6, 1),
        "max_us": round(ordered[-1] * 1e6, 1),
    }


def lifecycle(parent: str, apps: int, spares: bool = False, claim: bool = False) -> dict[str, Any]:
    """N apps written RUNNING then SUCCEEDED; the time per app. ``spares``: with the store's spare
    files made first, as a launcher makes them in a lull (that time is reported apart). ``claim``:
    each app's id claimed first, as a launcher does before it starts anything (``RecordStore.claim``;
    the terminal write removes the claim)."""
    work = Path(tempfile.mkdtemp(prefix="atx-bench-records-", dir=parent))
    try:
        store = RecordStore(work / "root")
        store.ensure()
        made: dict[str, Any] = {}
        if spares:
            pool = store.spares
            pool.target = apps
            start = time.perf_counter()
            while pool.fill_some(64):
                pass
            made = {
                "spares_made_per_spare_us": round((time.perf_counter() - start) / apps * 1e6, 1)
            }
        start = time.perf_counter()
        if claim:
            for i in range(apps):
                assert store.claim(f"a-{i}")
            made["claim_per_app_us"] = round((time.perf_counter() - start) / apps * 1e6, 1)
        for i in range(apps):
            assert store.write_many({f"a-{i}": _doc(f"a-{i}", 1, "RUNNING", 0)}) == {}
        for i in range(apps):
            assert store.write_many({f"a-{i}": _doc(f"a-{i}", 1, "SUCCEEDED", 1)}) == {}
        seconds = time.perf_counter() - start
        return {"apps": apps, "per_app_us": round(seconds / apps * 1e6, 1), **made}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def reads(parent: str, replicas: int, versions: int, rounds: int) -> dict[str, Any]:
    """``RecordStore.read`` of an app of ``replicas`` written ``versions`` times."""
    work = Path(tempfile.mkdtemp(prefix="atx-bench-records-", dir=parent))
    try:
        store = RecordStore(work / "root")
        store.ensure()
        for v in range(versions):
            store.write_many({"r-1": _doc("r-1", replicas, "RUNNING", v)})
        path = store.records_dir / "r-1.json"
        samples = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            record = store.read("r-1")
            samples.append(time.perf_counter() - t0)
            assert record is not None and record.msg == f"version {versions - 1}"
        return {"file_bytes": path.stat().st_size, "versions": versions, **_stats_us(samples)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=tempfile.gettempdir(), help="parent directory")
    parser.add_argument("--apps", type=int, default=500)
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument(
        "--churn",
        type=int,
        default=0,
        help="create and delete this many files under --root first (the state a test suite or "
        "compare_torchx leaves: on a journal-less ext4 each creation then skips the freed inodes)",
    )
    args = parser.parse_args()
    if args.churn:
        churn = Path(tempfile.mkdtemp(prefix="atx-bench-churn-", dir=args.root))
        for i in range(args.churn):
            (churn / str(i)).touch()
        shutil.rmtree(churn)
    result = {
        "root": args.root,
        "lifecycle": lifecycle(args.root, args.apps),
        **(
            {"lifecycle_from_spares": lifecycle(args.root, args.apps, spares=True)}
            if hasattr(RecordStore(Path(args.root)), "spares")
            else {}
        ),
        **(
            {"lifecycle_claimed_from_spares": lifecycle(args.root, args.apps, True, True)}
            if hasattr(RecordStore, "claim")
            else {}
        ),
        "read_1_replica": reads(args.root, 1, args.versions, 2000),
        "read_2000_replicas": reads(args.root, 2000, args.versions, 30),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
