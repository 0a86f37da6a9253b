"""Parsers for what ``squeue``, ``sacct`` and ``sbatch`` print. Pure and defensive.

The JSON shapes differ between Slurm releases (22.05 prints ``"exit_code": 768`` and
``"job_state": "RUNNING"``; 23.02 and later print ``{"return_code": {"set": true, "number": 3}}`` and
``["RUNNING"]``). Every field is read through small helpers that accept each known shape and fall back
to "unknown" rather than raising, so one odd record never breaks a status round for every app.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

#: Values at or above this are Slurm's NO_VAL/INFINITE markers, not numbers.
_NO_VAL_FLOOR = 0xFFFFFFF0
_DIGITS = re.compile(r"[0-9]+")


def is_digits(text: str) -> bool:
    """True when ``text`` is ASCII digits only (``str.isdigit`` also takes superscripts, fullwidth
    and Arabic-Indic digits, which ``int`` or Slurm refuse)."""
    return _DIGITS.fullmatch(text) is not None


def is_job_id(text: str) -> bool:
    """True when ``text`` can be a Slurm job id: ASCII digits, not all zero (``sacct --jobs 0``
    would list every job)."""
    return is_digits(text) and text.strip("0") != ""


class SlurmOutputError(ValueError):
    """Raised when a Slurm command printed something that cannot be parsed at all."""


@dataclass(frozen=True)
class SlurmStep:
    """One step of a job (``sacct`` only).

    Args:
        step_id: ``0``, ``1``... for ``srun`` steps, or ``batch``/``extern``.
        state: the step's Slurm state (first word, upper case).
        exit_code: the step's exit code, when known.
        signal: the signal that ended it, when known.
    """

    step_id: str
    state: str
    exit_code: int | None = None
    signal: int | None = None


@dataclass(frozen=True)
class SlurmJob:
    """One job record (a component, for heterogeneous jobs) as ``squeue`` or ``sacct`` reports it.

    Args:
        job_id: this record's own job id.
        het_job_id: the id of the heterogeneous job it belongs to (its first component's id), or 0.
        het_offset: its component index (0 for plain jobs).
        name: the job name (``{role}-{replica}`` for jobs asynctorchx submits).
        state: the Slurm job state (first word, upper case; ``UNKNOWN`` when missing).
        reason: the state reason (e.g. ``Resources``), or "".
        exit_code: the batch script's exit code, when known.
        signal: the signal that ended it, when known.
        nodes: the node list expression (e.g. ``node[1-2]``), or "".
        workdir: the job's working directory, or "".
        restarts: how many times it was requeued (-1 when the source cannot tell).
        submit_time: when it was submitted (epoch seconds), if known.
        start_time: when it started, if known.
        end_time: when it ended, if known.
        steps: its steps (``sacct`` only).
        user_id: the submitting user's id (``squeue`` only).
    """

    job_id: int
    het_job_id: int
    het_offset: int
    name: str
    state: str
    reason: str = ""
    exit_code: int | None = None
    signal: int | None = None
    nodes: str = ""
    workdir: str = ""
    restarts: int = -1
    submit_time: int | None = None
    start_time: int | None = None
    end_time: int | None = None
    steps: tuple[SlurmStep, ...] = ()
    user_id: int | None = None

    @property
    def app_id(self) -> str:
        """The id of the app this record belongs to (the heterogeneous job's id)."""
        return str(self.het_job_id or self.job_id)


# -- field helpers -----------------------------------------------------------------------------


def num(value: Any) -> int | None:
    """An integer from any of Slurm's number shapes, or None (missing, NO_VAL, INFINITE, garbage)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value if abs(value) < _NO_VAL_FLOOR else None
    if isinstance(value, float):
        return num(int(value))
    if isinstance(value, dict):
        if value.get("set") is False or value.get("infinite") is True:
            return None
        return num(value.get("number"))
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"-?\d+", text):
            return num(int(text))
    return None


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return ",".join(_text(v) for v in value if v is not None)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return ""


def base_state(value: Any) -> str:
    """The Slurm state name from ``"RUNNING"``, ``"CANCELLED by 0"``, ``["PENDING", "REQUEUED"]``...

    Returns ``UNKNOWN`` when there is nothing usable.
    """
    if isinstance(value, dict):
        return base_state(value.get("current"))
    if isinstance(value, list):
        names = [base_state(v) for v in value]
        known = [n for n in names if n in KNOWN_STATES]
        return known[0] if known else (names[0] if names else "UNKNOWN")
    if isinstance(value, str) and value.strip():
        return value.split()[0].upper()
    return "UNKNOWN"


def _epoch(value: Any) -> int | None:
    n = num(value)
    return n if n else None


def _wait_status(value: Any) -> tuple[int | None, int | None]:
    """``(exit code, signal)`` from a raw wait status (22.05 ``squeue``) or a structured exit code."""
    if isinstance(value, dict):
        code = num(value.get("return_code"))
        sig_field = value.get("signal")
        signal = None
        if isinstance(sig_field, dict):
            signal = num(sig_field.get("signal_id"))
            if signal is None:
                signal = num(sig_field.get("id"))
        return code, signal or None
    raw = num(value)
    if raw is None:
        return None, None
    if raw & 0x7F:
        return None, raw & 0x7F
    return (raw >> 8) & 0xFF, None


# -- the Slurm state names ---------------------------------------------------------------------

#: Every job state ``squeue``/``sacct`` document (the keys of the state table live in status.py).
KNOWN_STATES: frozenset[str] = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "COMPLETING",
        "CONFIGURING",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PENDING",
        "PREEMPTED",
        "REQUEUED",
        "REQUEUE_FED",
        "REQUEUE_HOLD",
        "RESIZING",
        "RESV_DEL_HOLD",
        "REVOKED",
        "RUNNING",
        "SIGNALING",
        "SPECIAL_EXIT",
        "STAGE_OUT",
        "STOPPED",
        "SUSPENDED",
        "TIMEOUT",
    }
)


# -- squeue --json -----------------------------------------------------------------------------


def _load_json(text: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as e:
        snippet = text.strip()[:200]
        raise SlurmOutputError(f"{what} did not print JSON ({e}): {snippet!r}") from None
    if not isinstance(data, dict):
        raise SlurmOutputError(f"{what} printed JSON that is not an object: {text.strip()[:200]!r}")
    return data


def _records(data: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    jobs = data.get("jobs")
    if not isinstance(jobs, list):
        return []
    return [j for j in jobs if isinstance(j, dict)]


def json_errors(text: str) -> list[str]:
    """The messages in the ``errors`` list of a Slurm JSON document (empty when there are none)."""
    try:
        data = json.loads(text)
    except ValueError:
        return []
    errors = data.get("errors") if isinstance(data, dict) else None
    out: list[str] = []
    for err in errors if isinstance(errors, list) else []:
        if isinstance(err, dict):
            msg = _text(err.get("description")) or _text(err.get("error"))
            if msg:
                out.append(msg)
        elif isinstance(err, str):
            out.append(err)
    return out


def parse_squeue_json(text: str) -> list[SlurmJob]:
    """The job records in ``squeue --json`` output (every component of every job listed).

    Raises:
        SlurmOutputError: the output is not a JSON object.
    """
    out: list[SlurmJob] = []
    for rec in _records(_load_json(text, "squeue --json")):
        job_id = num(rec.get("job_id"))
        if job_id is None:
            continue
        code, signal = _wait_status(rec.get("exit_code"))
        het_id = num(rec.get("het_job_id")) or 0
        out.append(
            SlurmJob(
                job_id=job_id,
                het_job_id=het_id,
                het_offset=(num(rec.get("het_job_offset")) or 0) if het_id else 0,
                name=_text(rec.get("name")),
                state=base_state(rec.get("job_state")),
                reason=_text(rec.get("state_reason")),
                exit_code=code,
                signal=signal,
                nodes=_text(rec.get("nodes")),
                workdir=_text(rec.get("current_working_directory")),
                restarts=num(rec.get("restart_cnt")) or 0,
                submit_time=_epoch(rec.get("submit_time")),
                start_time=_epoch(rec.get("start_time")),
                end_time=_epoch(rec.get("end_time")),
                user_id=num(rec.get("user_id")),
            )
        )
    return out


# -- sacct --parsable2 -------------------------------------------------------------------------

#: The fields asked of ``sacct --parsable2`` (``--format``), in this order. ``sacct`` does not
#: escape its ``|`` separator in values: ``WorkDir``, a path that may hold one, comes last, and
#: takes every ``|`` past the other fields' (see ``parse_sacct_parsable``).
SACCT_FIELDS: tuple[str, ...] = (
    "JobID",
    "JobIDRaw",
    "JobName",
    "State",
    "ExitCode",
    "NodeList",
    "Submit",
    "Start",
    "End",
    "Reason",
    "WorkDir",
)

_JOBID = re.compile(r"(?P<id>\d+)(?:\+(?P<offset>\d+))?(?:_\S+)?(?:\.(?P<step>.+))?")


def _exit_pair(text: str) -> tuple[int | None, int | None]:
    code, _, sig = text.partition(":")
    signal = num(sig)
    return num(code), signal or None


def _sacct_time(text: str) -> int | None:
    text = text.strip()
    if not text or text in ("Unknown", "None", "N/A"):
        return None
    try:
        return int(datetime.fromisoformat(text).timestamp())
    except ValueError:
        return None


def parse_sacct_parsable(text: str) -> list[SlurmJob]:
    """The job records in ``sacct --parsable2 --format=...`` output (header line first).

    Step rows (``7+1.0``, ``12.batch``) are attached to their job's record. Works with any subset of
    ``SACCT_FIELDS`` as long as ``JobID`` and ``State`` are present. sacct does not escape ``|`` in
    values: a row with more of them than the header belongs to its last field (``WorkDir``, last
    in ``SACCT_FIELDS`` for that reason).

    Raises:
        SlurmOutputError: the header lacks ``JobID`` or ``State``.
    """
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return []
    fields = lines[0].split("|")
    if "JobID" not in fields or "State" not in fields:
        raise SlurmOutputError(f"sacct printed no JobID/State header: {lines[0][:200]!r}")
    jobs: list[SlurmJob] = []
    steps: list[list[SlurmStep]] = []
    latest: dict[int, int] = {}  # job id -> index in jobs of its latest run seen so far
    for line in lines[1:]:
        row = dict(zip(fields, line.split("|", len(fields) - 1), strict=False))
        m = _JOBID.fullmatch((row.get("JobID") or "").strip())
        if not m:
            continue
        raw = (row.get("JobIDRaw") or "").split(".")[0]
        leader = int(m["id"])
        offset = int(m["offset"]) if m["offset"] is not None else None
        own_id = num(raw) if raw else None
        if own_id is None:
            own_id = leader + (offset or 0)
        code, signal = _exit_pair(row.get("ExitCode") or "")
        state = base_state(row.get("State") or "")
        if m["step"] is not None:
            # A step row follows the row of the run it belongs to.
            if own_id in latest:
                steps[latest[own_id]].append(SlurmStep(m["step"], state, code, signal))
            continue
        reason = (row.get("Reason") or "").strip()
        latest[own_id] = len(jobs)
        steps.append([])
        jobs.append(
            SlurmJob(
                job_id=own_id,
                het_job_id=leader if offset is not None else 0,
                het_offset=offset or 0,
                name=row.get("JobName") or "",
                state=state,
                reason="" if reason == "None" else reason,
                exit_code=code,
                signal=signal,
                nodes=(row.get("NodeList") or "").strip().replace("None assigned", ""),
                workdir=row.get("WorkDir") or "",
                submit_time=_sacct_time(row.get("Submit") or ""),
                start_time=_sacct_time(row.get("Start") or ""),
                end_time=_sacct_time(row.get("End") or ""),
            )
        )
    return [
        replace(job, steps=tuple(st)) if st else job for job, st in zip(jobs, steps, strict=True)
    ]


# -- sbatch and node lists ---------------------------------------------------------------------


def parse_sbatch_parsable(stdout: str) -> str:
    """The job id ``sbatch --parsable`` printed (``ID`` or ``ID;CLUSTER``).

    Raises:
        SlurmOutputError: no job id in the output.
    """
    for line in reversed(stdout.strip().splitlines()):
        job_id = line.strip().split(";")[0]
        if is_job_id(job_id):
            return job_id
    raise SlurmOutputError(f"sbatch printed no job id: {stdout.strip()[:200]!r}")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list expression (``node[3-4,7],gpu1`` -> ``node3``)."""
    text = nodelist.strip()
    if not text or text in ("(null)", "None assigned"):
        return ""
    m = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", text)
    if not m:
        return text
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}"


_HOSTLIST_PART = re.compile(r"([^\[\]]*)\[([^\[\]]*)\]")
_HOSTLIST_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def expand_hostlist(nodelist: str, limit: int = 1_000_000) -> set[str] | None:
    """The host names of a Slurm host list expression (``node[1-3,07],gpu1``, ``r[1-2]n[01-02]``;
    ``(null)`` is none), or None when it is not one this reads or names more than ``limit`` hosts."""
    text = nodelist.strip()
    if not text or text == "(null)":
        return set()
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            return None
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    hosts: set[str] = set()
    for item in items:
        names = [""]
        pos = 0
        for m in _HOSTLIST_PART.finditer(item):
            if m.start() != pos:
                return None
            pos = m.end()
            numbers: list[str] = []
            for part in m.group(2).split(","):
                r = _HOSTLIST_RANGE.fullmatch(part)
                if r is None:
                    return None
                lo, hi = r.group(1), r.group(2) or r.group(1)
                if int(hi) < int(lo) or len(numbers) + int(hi) - int(lo) >= limit:
                    return None
                numbers += [str(k).zfill(len(lo)) for k in range(int(lo), int(hi) + 1)]
            if len(names) * len(numbers) > limit:
                return None
            names = [f"{name}{m.group(1)}{k}" for name in names for k in numbers]
        rest = item[pos:]
        if not item or "[" in rest or "]" in rest:
            return None
        hosts.update(f"{name}{rest}" for name in names)
        if len(hosts) > limit:
            return None
    return hosts


# -- cluster configuration ---------------------------------------------------------------------

#: Slurm's default ``max_script_size`` (``DEFAULT_BATCH_SCRIPT_LIMIT``: 4 MiB, per slurm.conf(5)).
DEFAULT_MAX_SCRIPT_SIZE = 4 * 1024 * 1024


@dataclass(frozen=True)
class SlurmPartition:
    """One partition as ``scontrol --oneliner show partition`` reports it.

    Args:
        name: the partition's name.
        total_nodes: how many nodes it holds, whatever their state.
        default: whether jobs that name no partition go to it.
        nodes: its nodes, as a Slurm host list expression (``node[1-4]``; partitions may share
            nodes).
    """

    name: str
    total_nodes: int
    default: bool
    nodes: str = ""


def parse_partitions(text: str) -> dict[str, SlurmPartition]:
    """The partitions of ``scontrol --oneliner show partition`` (one line each, ``Key=Value`` words);
    a line without a name or a node count is skipped."""
    out: dict[str, SlurmPartition] = {}
    for line in text.splitlines():
        fields = dict(w.partition("=")[::2] for w in line.split() if "=" in w)
        name, total = fields.get("PartitionName", ""), fields.get("TotalNodes", "")
        if name and is_digits(total):
            default = fields.get("Default") == "YES"
            out[name] = SlurmPartition(name, int(total), default, fields.get("Nodes", ""))
    return out


def parse_max_script_size(text: str) -> int | None:
    """The largest batch script the controller accepts (bytes), from ``scontrol show config``:
    ``max_script_size`` in ``SchedulerParameters``, else Slurm's default; None when the output
    holds no ``SchedulerParameters`` line (not a configuration listing)."""
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "SchedulerParameters":
            m = re.search(r"(?:^|,)\s*max_script_size=(\d+)", value.strip())
            return int(m.group(1)) if m else DEFAULT_MAX_SCRIPT_SIZE
    return None
