"""Internals of the ``local_docker`` backend (``asynctorchx.schedulers.docker``).

``request`` turns an AppDef into container and network requests (pure), ``state`` reads an app's
state back from a container listing (pure), and ``logs`` decodes Docker's log streams. Nothing here
imports aiodocker; only ``asynctorchx.schedulers.docker`` talks to the engine.
"""
