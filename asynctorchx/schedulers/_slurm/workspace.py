"""Workspaces on Slurm: the workspace is copied into the job's directory, where every role runs.

The ``job_dir`` run option must name a directory that does not exist yet or is empty (the job's
own files, ``slurm-{job id}*``, go there too): a directory that already holds files, another
app's or anything else, is refused, so that no app's copy is ever overwritten. Without
``job_dir`` a workspace is refused as well (the current directory, Slurm's default, is usually
the workspace itself). Two submits racing for one directory are told apart by a claim file,
``.asynctorchx-workspace``, created exclusively before the copy; it stays, naming the workspace and
its content hash, and marks the directory as a job's: a job directory inside the workspace is never
copied into the next one (with ``job_dir=runs/trial-N`` each trial would otherwise copy every trial
before it, and the logs of those still running). The copy honours ``.torchxignore``, checks every
file against the hash the dry run took, and is made off the event loop; if the submit fails, the
copy is removed again (with the directories made for it: ``job_dir``, and its parents while
they are empty), as it is when the submit is cancelled (once the copying thread has stopped).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from collections.abc import Mapping, Sequence

from asynctorchx._tasks import in_thread_shielded
from asynctorchx.schedulers.workspace import (
    TORCHXIGNORE,
    WorkspaceEvent,
    WorkspacePlan,
    WorkspaceProgress,
    copy_error,
    copy_scan,
    format_bytes,
    remove_tree,
    report,
    run_in_thread,
    scan_workspace,
)
from asynctorchx.specs.api import AppDef, CfgVal, InvalidRunConfigException
from asynctorchx.specs.workspace import InvalidWorkspaceException, Workspace

CLAIM_FILE = ".asynctorchx-workspace"
_SHOWN = 3


def job_dir_of(cfg: Mapping[str, CfgVal], workspace: Workspace) -> str:
    """The absolute ``job_dir`` a workspace is copied into.

    Raises:
        InvalidRunConfigException: ``job_dir`` is not set.
    """
    value = cfg.get("job_dir")
    if not isinstance(value, str) or not value.strip():
        raise InvalidRunConfigException(
            f"a workspace ({workspace}) is copied into the job's directory: set the job_dir run "
            "option to a new (or empty) directory on a file system the compute nodes see, e.g. "
            "-cfg job_dir=/shared/runs/run-1",
            "job_dir",
            cfg,
        )
    return os.path.abspath(os.path.expanduser(value))


def check_job_dir(job_dir: str) -> None:
    """Raises InvalidWorkspaceException when ``job_dir`` holds files (or is not a directory)."""
    try:
        names = sorted(os.listdir(job_dir))
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise InvalidWorkspaceException(
            f"job_dir {job_dir!r} is a file: a workspace is copied into a new or empty directory"
        ) from None
    except OSError as e:
        raise InvalidWorkspaceException(
            f"job_dir {job_dir!r} cannot be read: {e.strerror or e}"
        ) from None
    if names:
        shown = ", ".join(names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")
        raise InvalidWorkspaceException(
            f"job_dir {job_dir!r} already holds files ({shown}): a workspace is copied into a new "
            "or empty directory, so that no other app's files are overwritten; choose another "
            "job_dir"
        )


def plan_slurm(app: AppDef, cfg: Mapping[str, CfgVal], workspace: Workspace) -> WorkspacePlan:
    """The copy of ``workspace`` into the job directory (reads and hashes the workspace).

    Raises:
        InvalidRunConfigException: no ``job_dir``.
        InvalidWorkspaceException: ``job_dir`` holds files; the workspace cannot be read.
    """
    job_dir = job_dir_of(cfg, workspace)
    check_job_dir(job_dir)
    scan = scan_workspace(workspace, TORCHXIGNORE, skip_marker=CLAIM_FILE)
    return WorkspacePlan(
        backend="slurm",
        workspace=workspace,
        action="copy into the job directory",
        roles=(app.roles[0].name,),
        target=job_dir,
        content_hash=scan.digest,
        scan=scan,
        details=(("every role runs in", job_dir),),
    )


def make_dirs(path: str, made: list[str]) -> None:
    """Creates the directory ``path`` and its missing parents, putting each one it made at the
    front of ``made`` (so deepest first) as soon as it exists.

    ``made`` is filled as the directories are made, not returned, so that a caller whose thread
    failed half-way, or was waited for after a cancellation, knows what to remove again. A
    directory another submit made meanwhile is that submit's, not added.
    """
    missing: list[str] = []
    here = path
    while not os.path.lexists(here) and os.path.dirname(here) != here:
        missing.append(here)
        here = os.path.dirname(here)
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            continue  # made by a racing submit (or a file: ``makedirs`` below says so)
        made.insert(0, directory)
    os.makedirs(path, exist_ok=True)  # raises when ``path`` is a file


def remove_empty_dirs(paths: Sequence[str]) -> None:
    """Removes ``paths`` in order, stopping at the first that is not empty (or is gone)."""
    for path in paths:
        try:
            os.rmdir(path)
        except OSError:
            return


def _claim(job_dir: str, plan: WorkspacePlan, parents: list[str]) -> bool:
    """Claims ``job_dir`` for this submit; returns True when it created the directory.

    The parent directories it creates are put in ``parents`` (see ``make_dirs``), for
    ``_release`` to remove again; when it raises, it has removed them itself (those still empty).

    Raises:
        InvalidWorkspaceException: the directory is claimed, a file, or holds files.
        WorkspaceCopyError: it cannot be made or written (a full disk).
    """
    try:
        return _claim_made(job_dir, plan, parents)
    except BaseException:
        remove_empty_dirs(parents)
        parents.clear()
        raise


def _claim_made(job_dir: str, plan: WorkspacePlan, parents: list[str]) -> bool:
    """``_claim``, but leaving the parents it made when it raises (``_claim`` removes them)."""
    what = f"copy workspace {plan.workspace}"
    created = False
    try:
        make_dirs(os.path.dirname(job_dir), parents)
        os.mkdir(job_dir)
        created = True
    except FileExistsError:
        pass
    except OSError as e:
        raise copy_error(e, what, job_dir) from None
    claim = os.path.join(job_dir, CLAIM_FILE)
    try:
        fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise InvalidWorkspaceException(
            f"job_dir {job_dir!r} was just claimed by another submit; choose another job_dir"
        ) from None
    except NotADirectoryError:
        raise InvalidWorkspaceException(
            f"job_dir {job_dir!r} is a file: a workspace is copied into a new or empty directory"
        ) from None
    except OSError as e:
        if created:
            remove_tree(job_dir)
        raise copy_error(e, what, job_dir, CLAIM_FILE) from None
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"workspace": str(plan.workspace), "content_hash": plan.content_hash}, f)
    except OSError as e:
        # only what this submit made goes: a racing submit may be using job_dir by now
        if created:
            remove_tree(job_dir)
        else:
            with contextlib.suppress(OSError):
                os.unlink(claim)
        raise copy_error(e, what, job_dir, CLAIM_FILE) from None
    others = [n for n in os.listdir(job_dir) if n != CLAIM_FILE]
    if others:
        os.unlink(claim)
        check_job_dir(job_dir)  # raises, naming what is there
    return created


def _release(job_dir: str, created: bool, parents: Sequence[str]) -> None:
    """Removes what ``_claim`` and the copy made: ``job_dir`` (or, when it was there before, what
    is in it), then the ``parents`` the claim created, deepest first, as long as they are empty
    (a racing submit may have put its own job_dir in one)."""
    if created:
        remove_tree(job_dir)
    else:
        _empty(job_dir)
    remove_empty_dirs(parents)


def _empty(job_dir: str) -> None:
    for name in os.listdir(job_dir):
        path = os.path.join(job_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            remove_tree(path)
        else:
            try:
                os.unlink(path)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise


class Shipped:
    """A copy made for a submit, removed again by ``undo`` when the submit fails."""

    def __init__(self, job_dir: str, created: bool, parents: Sequence[str] = ()) -> None:
        self.job_dir = job_dir
        self.created = created
        self.parents = list(parents)  # the parent directories of job_dir the submit made

    async def undo(self) -> None:
        """Removes the copy (and the job directory and its parents, those the submit created)."""
        # awaited whatever cancellation comes: the undo of a cancelled submit is what must run
        await in_thread_shielded(_release, self.job_dir, self.created, self.parents)


async def ship(plan: WorkspacePlan, progress: WorkspaceProgress | None) -> Shipped:
    """Claims the job directory and copies the workspace into it, off the event loop.

    Raises:
        InvalidWorkspaceException: the directory holds files (or was claimed by a racing submit),
            or a workspace file changed since the dry run read it (nothing is left behind).
        WorkspaceCopyError: the directory cannot be written (a full disk), naming it and the
            file (nothing is left behind).

    A cancelled caller returns once the copying thread has stopped, having removed what it
    claimed and copied (the whole job_dir, if the submit created it).
    """
    scan = plan.scan
    assert scan is not None
    job_dir = plan.target
    report(
        progress,
        WorkspaceEvent(
            "copy",
            job_dir,
            f"copying {plan.workspace} into {job_dir} ({scan.files} files, "
            f"{format_bytes(scan.total_bytes)})",
        ),
    )
    started = time.monotonic()
    # what the thread claimed and has not released again: [it created job_dir]. Written by the
    # thread; read here only once the thread has ended (run_in_thread waits for it on a failure or
    # a cancellation), so the two never race.
    claimed: list[bool] = []
    parents: list[str] = []  # the parent directories of job_dir the claim made (same rules)

    def copy() -> bool:
        created = _claim(job_dir, plan, parents)
        claimed.append(created)
        try:
            copy_scan(scan, job_dir)
        except BaseException:
            _release(job_dir, created, parents)
            # released: the caller must not empty job_dir again, a racing submit may own it now
            claimed.clear()
            raise
        return created

    try:
        created = await run_in_thread(copy, wait_on_cancel=True)
    except BaseException:
        if claimed:
            # the thread releases job_dir when the copy fails or sees the cancellation; but one
            # that copied the last file just as the caller was cancelled returned normally and
            # left the whole copy (and the claim, which refuses every later submit into job_dir)
            with contextlib.suppress(OSError):  # the submit's own error (or cancellation) wins
                await in_thread_shielded(_release, job_dir, claimed[0], parents)
        raise
    took = time.monotonic() - started
    report(progress, WorkspaceEvent("copy", job_dir, f"copied in {took:.2f}s", final=True))
    return Shipped(job_dir, created, parents)
