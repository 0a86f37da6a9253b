"""Workspaces: the local code a submit ships along with the app (the model only; no file I/O).

A workspace is one or more local directories ("projects"), each mapped to a sub-directory of the
place the backend puts the workspace (TorchX's multi-project form)::

    Workspace.from_str("~/src/trainer")                  # one project, at the root
    Workspace.from_str("file:///home/me/src/trainer")    # the same, as a file:// URL
    Workspace.from_str("~/src/trainer:,~/src/lib:lib")   # two projects: the root, and lib/
    Workspace({"/home/me/src/trainer": "", "/home/me/src/lib": "lib"})

As in TorchX, the workspace goes into the first role's image (a Docker image, a directory copy);
what each backend does with it is up to the backend (see ``asynctorchx.schedulers.workspace``).
Paths are made absolute (against the current directory) and ``~`` is expanded when the workspace
is made, so a workspace names the same files wherever it is used later. Whether the directories
exist is checked when the workspace is read, not here.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["InvalidWorkspaceException", "Workspace"]


class InvalidWorkspaceException(ValueError):
    """Raised when a workspace cannot be used: a malformed value, a missing directory, a file where
    a directory should be, an unreadable file, a bad ignore pattern. The message names the
    workspace (or the file) and the offending value."""


@dataclass
class Workspace:
    """Local directories shipped with an app: ``{local directory: sub-directory in the target}``.

    A sub-directory of ``""`` puts the project at the root of the target. Name-compatible with
    TorchX's ``Workspace`` (``projects``, ``is_unmapped_single_project``, ``from_str``).

    Args:
        projects: the local directories (paths or ``file://`` URLs) and where each goes.

    Raises:
        InvalidWorkspaceException: no project, an empty or non-local path, a sub-directory that is
            absolute or leaves the target (``..``), a NUL character, or the same directory twice.
    """

    projects: dict[str, str]
    #: ``(as written, absolute path)`` of what the string the workspace was parsed from names as
    #: a directory, where the multi-project syntax read it otherwise (``exp,v2`` as two
    #: directories, ``runs/exp-10:30`` as ``runs/exp-10`` going to ``30/``): such a directory
    #: that exists is refused when the workspace is read, naming the ``file://`` URL to give.
    literal_names: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.projects, Mapping) or not self.projects:
            raise InvalidWorkspaceException(
                f"a workspace needs at least one directory, got {self.projects!r}"
            )
        normalized: dict[str, str] = {}
        for local, dest in self.projects.items():
            path = _local_path(local)
            if path in normalized:
                raise InvalidWorkspaceException(
                    f"workspace directory {path!r} is given twice (as {local!r})"
                )
            normalized[path] = _dest_dir(local, dest)
        self.projects = normalized

    def is_unmapped_single_project(self) -> bool:
        """True for one directory that goes to the root of the target (the common case)."""
        return len(self.projects) == 1 and not next(iter(self.projects.values()))

    @property
    def root(self) -> str | None:
        """The directory of an unmapped single-project workspace, else None."""
        return next(iter(self.projects)) if self.is_unmapped_single_project() else None

    @staticmethod
    def from_str(workspace: str) -> Workspace:
        """Parses a path, a ``file://`` URL, or ``"dir_a:dest_a,dir_b:dest_b"``.

        In the multi-project form each item is ``local[:dest]`` (split at its last ``:``; no
        ``dest`` means the root), and the whole may be wrapped in braces, as TorchX's YAML mapping
        ``{a: x, b: y}`` is. A path that itself contains ``,`` or ``:`` must be given as a
        ``file://`` URL (percent-encoded) or through ``Workspace({...})``.

        Raises:
            InvalidWorkspaceException: an empty string, or an item the rules above reject.
        """
        if not isinstance(workspace, str):
            raise InvalidWorkspaceException(f"a workspace must be a string, got {workspace!r}")
        text = workspace.strip()
        if text.startswith("{") and text.endswith("}"):
            text = text[1:-1].strip()
        if not text:
            raise InvalidWorkspaceException(f"empty workspace {workspace!r}")
        if "," not in text and ("://" in text or ":" not in text):
            return Workspace({text: ""})
        projects: dict[str, str] = {}
        for raw in text.split(","):
            item = raw.strip()
            if not item:
                raise InvalidWorkspaceException(f"workspace {workspace!r} has an empty item")
            local, sep, dest = item.rpartition(":")
            if not sep or not local or dest.startswith("//"):
                local, dest = item, ""
            local, dest = local.strip(), dest.strip()
            if local in projects:
                raise InvalidWorkspaceException(
                    f"workspace {workspace!r} names directory {local!r} twice"
                )
            projects[local] = dest
        items = [text, *(i.strip() for i in text.split(","))] if "," in text else [text]
        literal = tuple(
            dict.fromkeys(
                (item, os.path.normpath(os.path.abspath(os.path.expanduser(item))))
                for item in items
                if item and "\0" not in item and ("," in item or ":" in item)
            )
        )
        return Workspace(projects, literal)

    @classmethod
    def of(
        cls, value: Workspace | str | os.PathLike[str] | Mapping[str, str] | None
    ) -> Workspace | None:
        """The workspace a ``workspace=`` argument names; None for None or ``""`` (no workspace).

        Raises:
            InvalidWorkspaceException: the value is not a workspace.
        """
        if value is None:
            return None
        if isinstance(value, Workspace):
            return value
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if isinstance(value, str):
            return None if not value.strip() else cls.from_str(value)
        if isinstance(value, Mapping):
            return cls(dict(value))
        raise InvalidWorkspaceException(
            f"workspace must be a path, a file:// URL, a {{dir: subdir}} mapping or a Workspace, "
            f"got {value!r}"
        )

    def key(self) -> tuple[tuple[str, str], ...]:
        """A hashable identity of the workspace (its projects, sorted)."""
        return tuple(sorted(self.projects.items()))

    def __str__(self) -> str:
        """The path of a single unmapped project, else ``"dir_a:dest_a,dir_b"`` (for messages)."""
        if self.is_unmapped_single_project():
            return next(iter(self.projects))
        return ",".join(f"{k}:{v}" if v else k for k, v in self.projects.items())


def _local_path(local: object) -> str:
    if isinstance(local, os.PathLike):
        local = os.fspath(local)
    if not isinstance(local, str) or not local.strip():
        raise InvalidWorkspaceException(f"a workspace directory must be a path, got {local!r}")
    text = local.strip()
    if "\0" in text:
        raise InvalidWorkspaceException(f"workspace directory {text!r} contains a NUL character")
    if "://" in text:
        from urllib.parse import unquote, urlsplit

        url = urlsplit(text)
        if url.scheme != "file" or url.netloc not in ("", "localhost"):
            raise InvalidWorkspaceException(
                f"workspace {text!r} is not a local directory: give a path or a file:// URL"
            )
        text = unquote(url.path)
        if not text or "\0" in text:
            raise InvalidWorkspaceException(f"workspace URL {local!r} names no directory")
    return os.path.normpath(os.path.abspath(os.path.expanduser(text)))


def _dest_dir(local: object, dest: object) -> str:
    if dest is None:
        return ""
    if not isinstance(dest, str):
        raise InvalidWorkspaceException(
            f"the sub-directory of workspace directory {local!r} must be a string, got {dest!r}"
        )
    if "\0" in dest:
        raise InvalidWorkspaceException(
            f"the sub-directory {dest!r} of workspace directory {local!r} contains a NUL character"
        )
    text = dest.strip().replace("\\", "/")
    if text.startswith("/"):
        raise InvalidWorkspaceException(
            f"the sub-directory {dest!r} of workspace directory {local!r} must be relative"
        )
    norm = posixpath.normpath(text) if text else ""
    if norm == ".":
        norm = ""
    if norm == ".." or norm.startswith("../"):
        raise InvalidWorkspaceException(
            f"the sub-directory {dest!r} of workspace directory {local!r} leaves the workspace"
        )
    return norm
