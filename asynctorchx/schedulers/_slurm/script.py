"""AppDef -> one heterogeneous Slurm batch script. Pure: no I/O, no clock, no environment.

Every replica of every role becomes one component (het group) of a heterogeneous job, in role order,
so rank 0 (replica 0 of the first role) is het group 0. Each component is named ``{role}-{replica}``
and asks for the replica's resources; one ``srun`` starts all components at once. The batch script
writes the wrapper (below) to ``slurm-{app_id}/replica.sh`` and each replica's command line to
``slurm-{app_id}/{role}/{replica}/command.sh`` (here-documents: no size limit but the script's),
so srun's own command line holds only its options and fixed words: a replica's bare ``:`` argument
would start another component there, and every replica's arguments together could exceed the
system's limit on a command line (E2BIG) though each replica's fit. Each replica writes
``slurm-{app_id}/{role}/{replica}/stdout.log``, ``stderr.log``, ``combined.log`` and ``exit_code``
under the job directory (appending across requeues, so no attempt's output is lost); the batch
script's own output goes to ``slurm-{app_id}.out``.

The combined log: a small POSIX ``sh`` wrapper (``REPLICA_WRAPPER``) starts the replica with its
stdout and stderr on two pipes, each read by a ``tee`` that appends to the stream's own file and
passes the bytes on to a line writer (``grep --line-buffered`` under ``stdbuf -o1M``) that appends
whole lines to ``combined.log``, each with one ``write``. So ``combined.log`` holds both streams'
lines in the order they were completed: a line the replica wrote in parts is never cut by a line of
the other stream (one longer than 1 MiB may be), and a stream's last line without a line break gets
one there. Where ``stdbuf`` is missing the lines are written by ``grep`` alone (whole up to 4 KiB),
and where ``grep`` lacks ``--line-buffered`` by ``cat`` (as read). The ``tee``s and line writers
ignore SIGTERM (``scancel``), so what a replica prints while it stops is kept; once the replica
exits the wrapper waits for them (at most 5 s, in case a daemon it left keeps the pipes open), then
writes ``exit_code``: when that file exists, the logs are complete. Where the node cannot make the pipes
(no ``mktemp``/``mkfifo``), the replica writes straight to ``stdout.log``/``stderr.log`` and
``combined.log`` says so in its first line.

Timing: the node has the job's image, ``sh`` and coreutils, not necessarily Python, so nothing
stamps each line; instead the wrapper samples the three files every ``SAMPLE_INTERVAL`` seconds
(one ``stat`` each time) and appends a line to ``index.txt`` when their sizes changed (format in
``logs/_files.py: SampledIndex``). Each byte is then dated to the interval between two samples,
which is what ``since``/``until`` use. An idle replica costs a ``stat`` and a ``sleep`` per
interval and writes nothing.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from asynctorchx.specs.api import (
    AppDef,
    CfgVal,
    InvalidRunConfigException,
    Resource,
    Role,
    check_host_mounts,
    check_replica_count,
    macros,
)

#: Per-component sbatch options that come from the cfg (same value for every component).
GROUP_OPTIONS: tuple[str, ...] = ("partition", "time", "constraint", "qos")
#: Whole-job sbatch options that come from the cfg (given once, on the sbatch command line).
JOB_OPTIONS: tuple[str, ...] = ("comment", "mail-user", "mail-type")

#: The most components a heterogeneous Slurm job can have (``MAX_HET_JOB_COMPONENTS`` in Slurm's
#: ``slurm.h``: srun numbers het groups 0-127, slurmrestd refuses bigger het jobs); each replica is one.
MAX_COMPONENTS = 128

#: The environment variable holding rank 0's host name inside every replica.
RANK0_ENV = "TORCHX_RANK0_HOST"

_APP_ID = macros.app_id
_OPTION_NAME = re.compile(r"[A-Za-z][A-Za-z0-9-]*")
#: sbatch options the backend sets itself: (long name, short letter, what to use instead).
_RESERVED_ARGS: tuple[tuple[str, str, str], ...] = (
    ("job-name", "J", "each component is named {role}-{replica}, which status and logs rely on"),
    ("chdir", "D", "use the run option 'job_dir'"),
)
_DIRECTIVE_SPECIAL = re.compile(r"""[\\"'#]""")
#: sbatch's short options that take no value (Slurm 22.05; every other letter takes one, or is
#: refused by sbatch).
_SBATCH_BARE_FLAGS = frozenset("hksvHOQVW")
#: The time limits sbatch takes (``time_str2mins``): minutes, minutes:seconds,
#: hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds, none.
_TIME = re.compile(
    r"[0-9]+(:[0-9]+){0,2}|[0-9]+-[0-9]+(:[0-9]+){0,2}|(?i:unlimited|infinite)", re.ASCII
)
#: The ``mail-type`` values sbatch takes (case does not matter).
MAIL_TYPES: tuple[str, ...] = (
    "NONE",
    "BEGIN",
    "END",
    "FAIL",
    "REQUEUE",
    "ALL",
    "INVALID_DEPEND",
    "STAGE_OUT",
    "TIME_LIMIT",
    "TIME_LIMIT_90",
    "TIME_LIMIT_80",
    "TIME_LIMIT_50",
    "ARRAY_TASKS",
)


def log_dir(app_id: str, role: str, replica_id: int) -> str:
    """The directory (relative to the job directory) of a replica's ``stdout.log``/``stderr.log``."""
    return f"slurm-{app_id}/{role}/{replica_id}"


#: The file in a replica's log directory where its exit code is written.
EXIT_CODE_FILE = "exit_code"
#: The file in a replica's log directory holding its stdout and stderr together.
COMBINED_FILE = "combined.log"

#: The file (under ``slurm-{app_id}/`` in the job directory) holding ``REPLICA_WRAPPER``, written by
#: the batch script; each srun group sources it.
WRAPPER_FILE = "replica.sh"
#: The file in a replica's log directory holding its command line (a one-line ``sh`` script,
#: ``exec ENTRYPOINT ARGS...``), written by the batch script, run by the wrapper.
COMMAND_FILE = "command.sh"

#: The file in a replica's log directory holding the timing samples (``logs/_files.py``).
TIMES_FILE = "index.txt"
#: Seconds between two timing samples of a replica's log files.
SAMPLE_INTERVAL = 0.25
#: Seconds the tees get to write what is left once the replica has exited (a daemon it left may hold
#: the pipes open: they are then killed).
TEE_DRAIN = 5.0

# Runs one replica (see the module docstring): ``sh -c REPLICA_WRAPPER LOG_DIR COMMAND ARGS...``.
# Its exit status goes to LOG_DIR/exit_code once its output is written. The wrapper outlives
# SIGTERM, SIGINT and SIGHUP (scancel, --kill-on-bad-exit), waiting for its replica, whose
# actions for them stay the defaults (a caught signal is reset at exec, an ignored one would not
# be): a replica that ignores or outlives SIGTERM stays the wrapper's child, so in the step's
# process tracking (proctrack/linuxproc follows parentage) until Slurm's SIGKILL after KillWait.
# Orphaned by a wrapper that died of the SIGTERM, it ran on for good. A replica ended by SIGTERM
# writes 143; one SIGKILLed, none (the wrapper dies with it). Only double quotes inside (it was
# once held in single quotes; the batch script now writes it to WRAPPER_FILE).
#
# ``sample`` is one timing sample: it truncates "$t/a" (its mtime is then the time just before the
# stat), stats both clock files and the three logs in one ``stat`` process, and truncates "$t/b"
# (the time just after). A sample is written to index.txt as "A B SIZE_OUT SIZE_ERR SIZE_COMBINED"
# (A: this sample's "a" time; B: the previous sample's "b" time, each printed by stat as "date time
# zone") when the sizes changed, together with the sample before (if not written yet) and the
# sample after (which closes the interval): the bytes a sample finds were written after the "a"
# time of the sample before it and before the "b" time that the sample after it reports. The
# sample not written yet is kept in "$t/p" too, for ``last``: the two last samples, written
# whatever they find (with that one before them). The three logs exist before the sampler starts,
# so its first sample is written and its B, set before the replica starts, dates what it finds
# (the replica may have written before it). The sampler ignores SIGTERM like the tees; after
# a cancel it takes the last samples itself once both tees are gone, else the wrapper stops it
# and takes them. "$t" (node-local) holds the clock files,
# so that the shared file system sees only the appends to index.txt. Once the replica has exited
# (the wrapper then makes "$t/x"), the sampler gives the tees TEE_DRAIN s to finish before it kills
# them (a daemon of the replica may hold the pipes): no timer process of its own, since a step lasts
# until its last process ends (a timer's leftover `sleep 5` kept every job running 5 s past its
# replicas' exit). What outlives the wrapper is at most the sampler's last `sleep`.
REPLICA_WRAPPER = """d=$0
trap : TERM INT HUP
if ! t=$(mktemp -d 2>/dev/null) || ! mkfifo "$t/o" "$t/e" "$t/O" "$t/E" 2>/dev/null; then
    [ -n "$t" ] && rm -rf "$t"
    echo "asynctorchx: could not make pipes on this node: see stdout.log and stderr.log" >>"$d/combined.log"
    "$@"; code=$?; echo "$code" >"$d/exit_code"; exit "$code"
fi
lines() {
    LC_ALL=C stdbuf -o1M grep -a --line-buffered "" 2>/dev/null ||
        LC_ALL=C grep -a --line-buffered "" 2>/dev/null || cat
}
(trap "" TERM INT HUP; exec tee -a "$d/stdout.log" <"$t/o" >"$t/O") & o=$!
(trap "" TERM INT HUP; exec tee -a "$d/stderr.log" <"$t/e" >"$t/E") & e=$!
(trap "" TERM INT HUP; lines <"$t/O" >>"$d/combined.log") & O=$!
(trap "" TERM INT HUP; lines <"$t/E" >>"$d/combined.log") & E=$!
exec 3>"$t/o" 4>"$t/e"
rm -f "$t/o" "$t/e"
: >>"$d/stdout.log"; : >>"$d/stderr.log"; : >>"$d/combined.log"; : >"$t/a"; : >"$t/b"
sample() {
    : >"$t/a"
    set -- $(stat -c "%s %y" "$t/a" "$t/b" "$d/stdout.log" "$d/stderr.log" "$d/combined.log" 2>/dev/null)
    : >"$t/b"
    [ $# -eq 20 ] || return 0
    l="$2 $3 $4 $6 $7 $8 $9 ${13} ${17}"
    if [ "$9 ${13} ${17}" != "$z" ]; then
        : >"$t/p"; [ -n "$p" ] && echo "$p" >>"$d/index.txt"
        echo "$l" >>"$d/index.txt"; p=; n=1
    elif [ -n "$n" ]; then
        : >"$t/p"; echo "$l" >>"$d/index.txt"; p=; n=
    else
        echo "$l" >"$t/p"; p=$l
    fi
    z="$9 ${13} ${17}"
}
last() {
    p=; z=; n=; [ -s "$t/p" ] && read -r p <"$t/p"
    sample; sample; rm -rf "$t"
}
(
    trap "" TERM INT HUP; p=; z=; n=; i=0
    while kill -0 $O 2>/dev/null || kill -0 $E 2>/dev/null; do
        sample
        if [ -e "$t/x" ]; then i=$((i + 1)); [ $i -gt @DRAIN@ ] && kill -9 $o $e 2>/dev/null; fi
        sleep @INTERVAL@
    done
    last
) 3>&- 4>&- >/dev/null 2>&1 & s=$!
"$@" >&3 2>&4 3>&- 4>&-
code=$?
exec 3>&- 4>&-
: >"$t/x"
wait $o $e $O $E 2>/dev/null
kill -9 $s 2>/dev/null; wait $s 2>/dev/null
last
echo "$code" >"$d/exit_code"
exit "$code"
""".replace("@INTERVAL@", f"{SAMPLE_INTERVAL:g}").replace(
    "@DRAIN@", str(math.ceil(TEE_DRAIN / SAMPLE_INTERVAL))
)


def _command_word(arg: str) -> str:
    """Quotes ``arg`` for the replica's ``COMMAND_FILE``, where the app id is its first argument."""
    if _APP_ID not in arg:
        return shlex.quote(arg)
    return '"$1"'.join(shlex.quote(part) if part else "" for part in arg.split(_APP_ID))


def _heredoc(text: str, tag: str) -> str:
    """``text`` as the body of a quoted here-document (no expansion) and its delimiter: ``tag``, with
    a number added while a line of ``text`` is that delimiter."""
    lines = set(text.split("\n"))
    delimiter, n = tag, 0
    while delimiter in lines:
        n += 1
        delimiter = f"{tag}_{n}"
    return f"<<'{delimiter}'\n{text}\n{delimiter}"


def pattern_path(path: str) -> str:
    """``path`` for an sbatch/srun ``--output``/``--error``, where Slurm replaces ``%`` patterns
    (``%j``...) and reads ``%%`` as a ``%``."""
    return path.replace("%", "%%")


def shell_word(arg: str) -> str:
    """Quotes ``arg`` for bash, replacing the ``${app_id}`` macro with the job id at run time.

    The app id is not known before submission; inside the batch script it is ``$SLURM_JOB_ID`` (the
    id of the heterogeneous job's first component, which is the app id).
    """
    if _APP_ID not in arg:
        return shlex.quote(arg)
    return '"$SLURM_JOB_ID"'.join(shlex.quote(part) if part else "" for part in arg.split(_APP_ID))


def _opts_to_args(opts: Mapping[str, str | None]) -> list[str]:
    return [f"--{key}" if value is None else f"--{key}={value}" for key, value in opts.items()]


def directive_word(word: str) -> str:
    """Escapes ``word`` for an ``#SBATCH`` line, where sbatch reads quotes as grouping, a backslash
    as an escape and an unescaped ``#`` as the start of a comment (which drops the rest of the line,
    so every option after it would be silently lost)."""
    return _DIRECTIVE_SPECIAL.sub(r"\\\g<0>", word)


@dataclass
class SlurmReplicaRequest:
    """One replica: one component of the heterogeneous job.

    Args:
        name: the component's job name, ``{role}-{replica}``.
        role: the role's name.
        replica_id: the replica's index within its role.
        entrypoint: the command to run.
        args: its arguments (macros substituted, except ``${app_id}``, resolved at run time).
        env: extra environment variables of this replica.
        sbatch_opts: the component's ``#SBATCH`` options (``None`` value = a flag).
        srun_opts: the component's ``srun`` options.
    """

    name: str
    role: str
    replica_id: int
    entrypoint: str
    args: list[str]
    env: dict[str, str]
    sbatch_opts: dict[str, str | None]
    srun_opts: dict[str, str | None]

    def sbatch_line(self) -> str:
        """The ``#SBATCH`` line of this component."""
        words = [f"--job-name={self.name}", *_opts_to_args(self.sbatch_opts)]
        return "#SBATCH " + " ".join(directive_word(w) for w in words)

    def command(self) -> str:
        """The replica's ``COMMAND_FILE``: its command line, quoted for ``sh``, run with ``exec`` (the
        app id is the script's first argument)."""
        words = ["exec"]
        if self.env:
            words += ["env", "--", *(_command_word(f"{k}={v}") for k, v in self.env.items())]
        words += [_command_word(self.entrypoint), *(_command_word(a) for a in self.args)]
        return " ".join(words)

    def srun_group(self) -> str:
        """This component's part of the ``srun`` command line (shell-quoted): its options and fixed
        words only (the wrapper, the log directory, the command file), so that no argument of the
        replica reaches srun's command line (a ``:`` there starts another component, and every
        replica's arguments together could exceed the system's limit on a command line)."""
        words = [shell_word(a) for a in _opts_to_args(self.srun_opts)]
        directory = log_dir(_APP_ID, self.role, self.replica_id)
        wrapper = f"slurm-{_APP_ID}/{WRAPPER_FILE}"
        words += ["sh", "-c", shell_word(f". ./{wrapper}"), shell_word(directory)]
        words += ["sh", shell_word(f"{directory}/{COMMAND_FILE}"), '"$SLURM_JOB_ID"']
        return " ".join(words)


@dataclass
class SlurmBatchRequest:
    """What ``sbatch`` is given: its command line and the batch script (passed on stdin).

    Args:
        cmd: the ``sbatch`` command line, without the script.
        replicas: one request per component, rank order.
        job_dir: the job's working directory (absolute); the log files live there.
        max_retries: how many times the job is requeued after a failure.
        app_name: the app's name (for the script's header).
        session_name: the session submitting it (goes into ``TORCHX_JOB_ID``).
    """

    cmd: list[str]
    replicas: list[SlurmReplicaRequest]
    job_dir: str
    max_retries: int = 0
    app_name: str = ""
    session_name: str = ""

    def materialize(self) -> str:
        """The batch script."""
        header = "#SBATCH hetjob\n".join(f"{r.sbatch_line()}\n" for r in self.replicas)
        srun = " :\\\n    ".join(r.srun_group() for r in self.replicas)
        dirs = " ".join(shell_word(log_dir(_APP_ID, r.role, r.replica_id)) for r in self.replicas)
        combined = " ".join(
            shell_word(f"{log_dir(_APP_ID, r.role, r.replica_id)}/{COMBINED_FILE}")
            for r in self.replicas
        )
        replicas = " ".join(shlex.quote(f"{r.role}/{r.replica_id}") for r in self.replicas)
        commands = "".join(
            f"cat >{shell_word(log_dir(_APP_ID, r.role, r.replica_id))}/{COMMAND_FILE} "
            f"{_heredoc(r.command(), 'ASYNCTORCHX_COMMAND')}\n"
            for r in self.replicas
        )
        wrapper = _heredoc(REPLICA_WRAPPER.rstrip("\n"), "ASYNCTORCHX_WRAPPER")
        # A line break in an option (job_dir, sbatch_args) must not end the comment: a next line
        # starting with #SBATCH would be read by sbatch as a directive.
        cmd = " ".join(shlex.quote(a) for a in self.cmd).replace("\n", "\n# ")
        return f"""#!/bin/bash
#
# Generated by asynctorchx for app {self.app_name!r}.
# Submit with: {cmd} < THIS_SCRIPT
#
{header}
set -eu

export PYTHONUNBUFFERED=1
export SLURM_UNBUFFEREDIO=1
export TORCHX_MAX_RETRIES={self.max_retries}
export TORCHX_JOB_ID={shell_word(f"slurm://{self.session_name}/{_APP_ID}")}
{RANK0_ENV}="$(scontrol show hostnames "${{SLURM_JOB_NODELIST_HET_GROUP_0:-$SLURM_JOB_NODELIST}}" | head -n 1)"
export {RANK0_ENV}
mkdir -p {dirs}
touch {combined}
rm -f slurm-"$SLURM_JOB_ID"/*/*/{EXIT_CODE_FILE}
cat >slurm-"$SLURM_JOB_ID"/{WRAPPER_FILE} {wrapper}
{commands}
set +e
srun {srun}
exitcode=$?
set -e

if [ "$exitcode" -ne 0 ]; then
    # srun reports the highest status of any task, often one it killed after another replica
    # failed: report the first replica (in rank order) that failed by itself instead.
    for replica in {replicas}; do
        code="$(cat "slurm-$SLURM_JOB_ID/$replica/{EXIT_CODE_FILE}" 2>/dev/null || true)"
        case "$code" in ""|0|137|143) ;; *) exitcode="$code"; break ;; esac
    done
fi

echo "asynctorchx: exit code $exitcode (restart ${{SLURM_RESTART_COUNT:-0}} of $TORCHX_MAX_RETRIES)"
if [ "$exitcode" -ne 0 ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt "$TORCHX_MAX_RETRIES" ]; then
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$exitcode"
"""

    def __repr__(self) -> str:
        return (
            f"{' '.join(shlex.quote(a) for a in self.cmd)} <<'SBATCH_SCRIPT'\n"
            f"{self.materialize()}SBATCH_SCRIPT\n"
        )


def _check_value(key: str, value: object, cfg: Mapping[str, CfgVal], *, in_script: bool) -> str:
    text = str(value)
    bad = not text.strip() or "\n" in text or (in_script and any(c.isspace() for c in text))
    if bad:
        what = "a value without whitespace" if in_script else "a one-line value"
        raise InvalidRunConfigException(
            f"Run option {key!r} must be {what}, got {value!r}", key, cfg
        )
    return text


def _extra_args(cfg: Mapping[str, CfgVal]) -> list[str]:
    raw = cfg.get("sbatch_args") or []
    assert isinstance(raw, list)
    out: list[str] = []
    for item in raw:
        arg = item.strip()
        name = arg.lstrip("-").partition("=")[0]
        if not arg or not _OPTION_NAME.fullmatch(name):
            raise InvalidRunConfigException(
                f"Run option 'sbatch_args' must hold sbatch options such as '--account=NAME' or "
                f"'exclusive', got {item!r}",
                "sbatch_args",
                cfg,
            )
        for option, letter, instead in _RESERVED_ARGS:
            if names_option(arg, option, letter):
                raise InvalidRunConfigException(
                    f"Run option 'sbatch_args' cannot set --{option} ({item!r}): {instead}",
                    "sbatch_args",
                    cfg,
                )
        out.append(arg if arg.startswith("-") else f"--{arg}")
    return out


def names_option(arg: str, option: str, letter: str) -> bool:
    """True when the sbatch argument ``arg`` (``--name=value``, ``name``, ``-Xvalue``, bundled short
    flags ``-HXvalue``) may set the long option ``option`` or its short form ``letter``.

    sbatch (getopt_long) takes any abbreviation of a long option that no other option shares
    (``--jo=NAME``, ``--ch=DIR``): every prefix of ``option`` counts (one other options share is
    refused by sbatch anyway). Short flags may be bundled: they are walked up to the first that
    takes a value (the rest of the word is that value).
    """
    if arg.startswith("-") and not arg.startswith("--"):
        for flag in arg[1:]:
            if flag == letter:
                return True
            if flag not in _SBATCH_BARE_FLAGS:
                return False
        return False
    name = arg.lstrip("-").partition("=")[0]
    return bool(name) and option.startswith(name)


def _check_job_dir(job_dir: str, cfg: Mapping[str, CfgVal]) -> None:
    """Refuses a job directory Slurm cannot write the logs to: one holding a control character (a
    line break in a path ends sbatch's option and the script's lines) or a backslash (Slurm reads a
    backslash in an output path as "do not replace % patterns", so %j would stay as it is)."""
    bad = next((c for c in job_dir if ord(c) < 0x20 or ord(c) == 0x7F or c == "\\"), None)
    if bad is not None:
        what = "a backslash" if bad == "\\" else f"a control character ({bad!r})"
        raise InvalidRunConfigException(
            f"Run option 'job_dir' cannot hold {what} (Slurm could not write the job's logs "
            f"there), got {job_dir!r}",
            "job_dir",
            cfg,
        )


def _check_time(value: str, cfg: Mapping[str, CfgVal]) -> None:
    if not _TIME.fullmatch(value):
        raise InvalidRunConfigException(
            "Run option 'time' must be a Slurm time limit: 'minutes', 'minutes:seconds', "
            "'hours:minutes:seconds', 'days-hours', 'days-hours:minutes', "
            f"'days-hours:minutes:seconds' (numbers) or 'UNLIMITED', got {value!r}",
            "time",
            cfg,
        )


def _check_mail_type(value: str, cfg: Mapping[str, CfgVal]) -> None:
    types = [t.strip() for t in value.split(",")]
    unknown = [t for t in types if t.upper() not in MAIL_TYPES]
    if unknown:
        raise InvalidRunConfigException(
            f"Run option 'mail-type' must be a comma-separated list of {', '.join(MAIL_TYPES)}, "
            f"got {value!r} ({', '.join(repr(t) for t in unknown)} unknown)",
            "mail-type",
            cfg,
        )


def _resource_opts(resource: Resource, nomem: bool) -> dict[str, str | None]:
    opts: dict[str, str | None] = {}
    if resource.cpu > 0:
        opts["cpus-per-task"] = str(int(resource.cpu))
    if resource.memMB > 0 and not nomem:
        opts["mem"] = str(int(resource.memMB))
    if resource.gpu > 0:
        opts["gpus-per-task"] = str(int(resource.gpu))
    return opts


def replica_request(role: Role, replica_id: int, cfg: Mapping[str, CfgVal]) -> SlurmReplicaRequest:
    """The request of one replica of ``role``, with the macros substituted."""
    values = macros.Values(
        img_root=role.image,
        app_id=_APP_ID,
        replica_id=str(replica_id),
        rank0_env=RANK0_ENV,
    )
    role = values.apply(role)
    name = f"{role.name}-{replica_id}"
    sbatch_opts: dict[str, str | None] = {"requeue": None, "ntasks-per-node": "1"}
    for key in GROUP_OPTIONS:
        value = cfg.get(key)
        if value is not None:
            sbatch_opts[key] = _check_value(key, value, cfg, in_script=True)
    if "time" in sbatch_opts:
        _check_time(str(sbatch_opts["time"]), cfg)
    sbatch_opts.update(_resource_opts(role.resource, bool(cfg.get("nomem"))))
    srun_opts: dict[str, str | None] = {
        "output": pattern_path(f"{log_dir(_APP_ID, role.name, replica_id)}/stdout.log"),
        "error": pattern_path(f"{log_dir(_APP_ID, role.name, replica_id)}/stderr.log"),
        "open-mode": "append",
        "kill-on-bad-exit": "1",
    }
    return SlurmReplicaRequest(
        name=name,
        role=role.name,
        replica_id=replica_id,
        entrypoint=role.entrypoint,
        args=list(role.args),
        env=dict(role.env),
        sbatch_opts=sbatch_opts,
        srun_opts=srun_opts,
    )


def build_request(
    app: AppDef, cfg: Mapping[str, CfgVal], job_dir: str, session_name: str
) -> SlurmBatchRequest:
    """The batch request for a validated ``app`` and a resolved ``cfg``.

    Args:
        job_dir: the absolute working directory of the job.
        session_name: the submitting session.

    Raises:
        InvalidRunConfigException: a cfg value cannot go into an sbatch option.
        InvalidAppDefException: more replicas than a Slurm job has components (``MAX_COMPONENTS``);
            a mount that cannot be applied on the nodes (``check_host_mounts``).
    """
    check_replica_count(
        app,
        "slurm",
        MAX_COMPONENTS,
        "each replica is one component of a heterogeneous Slurm job, and a job has at most "
        f"{MAX_COMPONENTS} (Slurm's MAX_HET_JOB_COMPONENTS)",
    )
    check_host_mounts(app, "slurm")
    replicas = [
        replica_request(role, i, cfg) for role in app.roles for i in range(role.num_replicas)
    ]
    _check_job_dir(job_dir, cfg)
    # Absolute: slurmd replaces the % patterns of the whole path it makes of a relative one and
    # the work directory (whose own % it would then replace too).
    output = f"{pattern_path(job_dir.rstrip('/'))}/slurm-%j.out"
    cmd = ["sbatch", "--parsable", f"--chdir={job_dir}", f"--output={output}"]
    for key in JOB_OPTIONS:
        value = cfg.get(key)
        if value is not None:
            text = _check_value(key, value, cfg, in_script=False)
            if key == "mail-type":
                _check_mail_type(text, cfg)
            cmd.append(f"--{key}={text}")
    cmd += _extra_args(cfg)
    return SlurmBatchRequest(
        cmd=cmd,
        replicas=replicas,
        job_dir=job_dir,
        max_retries=min(role.max_retries for role in app.roles),
        app_name=app.name,
        session_name=session_name,
    )
