"""Internals of the local backends (``local_cwd``, ``local_dir``), the four parts of a backend:

- request builder: ``request`` (pure: AppDef + cfg -> one launch request per replica);
- status assessor: ``state`` (pure: what an exit, a cancel or a failed restart means: the app's and
  the replicas' states, what to restart or stop);
- engine wrapper, the processes: ``launch`` (starting and undoing an app), ``spawn`` (starting
  replicas, hearing their exits), ``supervise`` (each app's task: judging exits, stopping, restarting),
  over ``procs`` (process groups, exit codes), ``contain`` (stdlib-only: cgroups, the marker scan),
  ``guard`` (the watchdog's launcher side, containment, batched record writes), ``watchdog``
  (stdlib-only script: stops the apps of a launcher that died, finishes another process's cancel)
  and ``protocol`` (stdlib-only: the replica marker, the watchdog's lines, record locks);
- log source: ``logsource`` (over ``asynctorchx.logs``).

Besides: ``live`` (the apps in memory), ``runtime`` (what the parts share), ``records`` (the app
records other processes read) over ``recordfile`` (stdlib-only: finding, reading and judging one
record; the CLI's read-only commands load it by path, without this package) and
``workspace`` (workspaces).
"""
