"""Internals of the local backends (``local_cwd``, ``local_dir``).

- ``request``: the pure dry run (AppDef + cfg -> one launch request per replica).
- ``procs``: starting replicas in their own process groups, exit codes, signalling groups.
- ``records``: the app records persisted on disk, so other processes can see and cancel apps.
- ``watchdog``: a stdlib-only script that stops a launcher's apps when the launcher dies, and that
  finishes a cancel started by a short-lived process.
- ``guard``: the launcher's side of the watchdog.
"""
