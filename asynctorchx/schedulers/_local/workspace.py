"""Workspaces on the local backends.

- ``local_cwd``: the workspace directory is the working directory (and ``img_root``) of every
  role's replicas, in place, as ``local_cwd`` otherwise runs them in the current directory: nothing
  is copied, so the replicas see edits as they are made. It must be one directory.
- ``local_dir``: the first role runs from a snapshot of the workspace taken at submit time (minus
  what ``.torchxignore`` excludes), so editing the code while a sweep runs does not change the
  trials already launched. Snapshots are content addressed and shared:
  ``{state root}/workspaces/snapshots/{hash}`` is made once per content (a reflink of each file
  where the file system offers them, else a copy; made in a temporary directory and renamed, so
  concurrent submits are safe) and never changes afterwards: its files are read-only. Each app
  then runs in a directory of its own, ``{state root}/workspaces/apps/{session}/{app_id}``, of
  hard links to the snapshot: what an app writes there stays its own, and a sweep of a thousand
  trials of one workspace costs one copy and a thousand directories of links, not a thousand
  copies. A replica must not rewrite a workspace file in place (replacing it, as editors and
  ``os.replace`` do, is fine): the file is shared with the other apps of that snapshot. One that
  does (as root, the read-only bits do not stop it) is caught by the next submit, which makes the
  snapshot again (``schedulers.workspace.snapshot``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

import anyio.to_thread

from asynctorchx._tasks import in_thread_shielded
from asynctorchx.schedulers.workspace import (
    TORCHXIGNORE,
    WorkspaceEvent,
    WorkspacePlan,
    WorkspaceProgress,
    check_directory,
    check_literal_names,
    copy_error,
    format_bytes,
    link_tree,
    remove_tree,
    report,
    run_in_thread,
    scan_workspace,
    snapshot,
)
from asynctorchx.specs.api import AppDef, CfgVal
from asynctorchx.specs.workspace import InvalidWorkspaceException, Workspace

STORE_DIR = "workspaces"


def snapshots_dir(root: Path) -> str:
    """Where the content-addressed snapshots live."""
    return os.path.join(root, STORE_DIR, "snapshots")


def app_workdir(root: Path, session: str, app_id: str) -> str:
    """The directory a ``local_dir`` app runs in (hard links to its snapshot)."""
    return os.path.join(root, STORE_DIR, "apps", session or "default", app_id)


def plan_local(
    backend: str,
    app: AppDef,
    workspace: Workspace,
    root: Path,
    cfg: Mapping[str, CfgVal] | None = None,
) -> WorkspacePlan:
    """What ``backend`` does with ``workspace`` (reads and hashes it for ``local_dir``).

    The state root and the log directory are never part of a snapshot, even inside the workspace:
    they hold the logs of running apps and the snapshots made before.

    Raises:
        InvalidWorkspaceException: the workspace is missing, not a directory, unreadable, or (on
            ``local_cwd``) not one directory.
    """
    if backend == "local_cwd":
        check_literal_names(workspace)
        path = workspace.root
        if path is None:
            raise InvalidWorkspaceException(
                f"local_cwd runs the replicas in the workspace directory itself, so the workspace "
                f"must be one directory, got {str(workspace)!r} (local_dir assembles several into "
                f"a snapshot)"
            )
        check_directory(path)
        return WorkspacePlan(
            backend=backend,
            workspace=workspace,
            action="run in place (nothing is copied; the replicas see edits as they are made)",
            roles=tuple(r.name for r in app.roles),
            target=path,
        )
    log_dir = (cfg or {}).get("log_dir")
    skip = [str(root)] + ([os.path.expanduser(log_dir)] if isinstance(log_dir, str) else [])
    scan = scan_workspace(workspace, TORCHXIGNORE, skip_dirs=skip)
    return WorkspacePlan(
        backend=backend,
        workspace=workspace,
        action="snapshot",
        roles=(app.roles[0].name,),
        target=os.path.join(snapshots_dir(root), scan.digest),
        content_hash=scan.digest,
        scan=scan,
        details=(("each app runs in", f"hard links to it under {root}/{STORE_DIR}/apps/"),),
    )


def workdirs(
    backend: str, plan: WorkspacePlan, root: Path, session: str, app_id: str
) -> dict[str, str]:
    """``{role: working directory}`` of the roles that run from the workspace."""
    if backend == "local_cwd":
        return dict.fromkeys(plan.roles, plan.target)
    return {plan.roles[0]: app_workdir(root, session, app_id)}


async def ship(plan: WorkspacePlan, workdir: str, progress: WorkspaceProgress | None) -> None:
    """Makes ``workdir`` for a submit: checks the in-place workspace (``local_cwd``), or makes the
    snapshot if missing and links the app's directory to it (``local_dir``), off the event loop.

    Whatever the error, even a cancellation, ``workdir`` is not left behind if this call made it:
    a cancelled caller returns once the worker thread has stopped (it checks between entries, and
    removes what it linked), and a directory linked whole just as the cancellation came is removed
    here. A directory that existed before is another launcher's and is left as it is.

    Raises:
        InvalidWorkspaceException: the workspace is gone, or a file changed since the dry run
            read it (nothing is left behind).
        ValueError: ``workdir`` exists already (it is left as it is).
        WorkspaceCopyError: the snapshot or the app's directory cannot be written (a full disk);
            nothing is left behind.
    """
    scan = plan.scan
    if scan is None:
        await anyio.to_thread.run_sync(check_directory, plan.target)
        return
    assert plan.content_hash is not None
    report(
        progress,
        WorkspaceEvent(
            "snapshot",
            plan.target,
            f"snapshot of {plan.workspace} ({scan.files} files, {format_bytes(scan.total_bytes)})",
        ),
    )
    started = time.monotonic()
    ours = [False]  # the thread made workdir (set and read only while no thread runs make)

    def make() -> bool:
        _, made = snapshot(scan, snapshots_dir_of(plan), plan.content_hash or "", read_only=True)
        try:
            os.makedirs(os.path.dirname(workdir), exist_ok=True)
            ours[0] = True  # (unless link_tree finds it exists)
            link_tree(plan.target, workdir)
        except BaseException as e:
            if isinstance(e, FileExistsError) and e.filename == workdir:
                ours[0] = False
                # another launcher's, maybe running (the app's claim was removed and made
                # again by it): left as it is
                raise ValueError(
                    f"the workspace directory of the app exists already ({workdir}); was this "
                    "dry run already scheduled? (if not, remove the directory)"
                ) from None
            remove_tree(workdir)
            if isinstance(e, OSError):
                raise copy_error(e, f"link snapshot {plan.target}", workdir) from None
            raise
        return made

    try:
        made = await run_in_thread(make, wait_on_cancel=True)
    except BaseException:
        if ours[0]:
            # the thread removes what it linked when it fails or sees the cancellation; but one
            # that finished just as the caller was cancelled left the whole directory
            await in_thread_shielded(remove_tree, workdir)
        raise
    took = time.monotonic() - started
    message = (
        f"made {plan.target} in {took:.2f}s"
        if made
        else f"{plan.target} exists: linked in {took:.2f}s"
    )
    report(progress, WorkspaceEvent("snapshot", plan.target, message, final=True, cached=not made))


def snapshots_dir_of(plan: WorkspacePlan) -> str:
    """The snapshot store a ``local_dir`` plan's target lives in."""
    return os.path.dirname(plan.target)


def remove_workdir(root: Path, session: str, app_id: str) -> None:
    """Removes the directory a ``local_dir`` app ran in, if any (after a failed start)."""
    remove_tree(app_workdir(root, session, app_id))
