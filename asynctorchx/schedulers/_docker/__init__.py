"""Internals of the ``local_docker`` backend (``asynctorchx.schedulers.docker``), in four parts.

- the request builder: ``request`` turns an AppDef into container and network requests (pure);
- the status assessor: ``state`` reads an app's state back from its containers, with the
  follow-ups it owes (pure);
- the engine client: ``engine`` is the one module that calls aiodocker (imported lazily): images
  (``image`` builds and pushes workspaces with it), containers, networks, events and logs;
- the log source: ``logs`` reads a replica's log (``frames`` decodes Docker's log stream, pure).

Around them: ``events`` follows Docker's event stream, ``actions`` does the follow-ups it asks for
(the scheduler's ``Reconciler`` runs them), and ``launch`` submits an app.
"""
