"""Internals of the local backends (``local_cwd``, ``local_dir``).

- ``request``: the pure dry run (AppDef + cfg -> one launch request per replica).
- ``procs``: starting replicas in their own process groups, exit codes, signalling groups.
- ``records``: the app records persisted on disk, so other processes can see and cancel apps.
- ``recordfile``: (stdlib-only) where records are, reading and parsing one, lost apps; the CLI's
  read-only commands load it by path, without this package.
- ``protocol``: (stdlib-only) the replica marker, the watchdog's line protocol, record locks.
- ``contain``: (stdlib-only) cgroup v2 containment of each replica, and the marker scan fallback.
- ``watchdog``: a stdlib-only script that stops a launcher's apps when the launcher dies, and that
  finishes a cancel started by a short-lived process.
- ``guard``: the launcher's side of the watchdog and of containment, and batched record writes.
"""
