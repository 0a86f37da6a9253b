"""Internals of the ``kubernetes`` backend.

- ``names``: Kubernetes naming rules (DNS labels, label values, port names) and the 63-character
  budget of every name the backend derives from an app;
- ``manifests``: the pure ``AppDef`` → headless Service + one Indexed Job per role translation, and a
  lint for what the OpenAPI schemas do not check;
- ``status``: the pure mapping of Services, Jobs and Pods to ``DescribeAppResponse``;
- ``logs``: parsing of timestamped pod log lines and resumption without duplicates;
- ``client``: a thin wrapper over ``kubernetes_asyncio`` (imported lazily) returning plain JSON;
- ``informer``: one list/watch of the backend's Services, Jobs and Pods per namespace.

Only ``client`` imports ``kubernetes_asyncio``, and only when a scheduler talks to a cluster; the rest
is importable (and dry runs work) without the ``kubernetes`` extra.
"""
