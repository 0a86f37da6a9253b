"""Internals of the ``kubernetes`` backend (``asynctorchx.schedulers.kubernetes``), in four parts.

- the request builder: ``manifests``, the pure ``AppDef`` → headless Service + one Indexed Job per
  role translation (with ``names``, the naming rules and the 63-character budget), and a lint for
  what the OpenAPI schemas do not check;
- the status assessor: ``status``, the pure mapping of Services, Jobs and Pods to a
  ``DescribeAppResponse``, and of an app the backend looks after to the follow-up it owes;
- the engine client: ``client``, a thin wrapper over ``kubernetes_asyncio`` (imported lazily)
  returning plain JSON, connected on first use;
- the log source: ``logs``, a replica's lines across pod replacements and dropped streams.

Around them: ``informer`` keeps one list/watch of the backend's objects per namespace, ``reads``
reads apps from it (or lists them), and ``followups`` does the restarts and stops the watch asks for
(the scheduler's ``Reconciler`` runs them).

Only ``client`` imports ``kubernetes_asyncio``, and only when a scheduler talks to a cluster; the rest
is importable (and dry runs work) without the ``kubernetes`` extra.
"""
