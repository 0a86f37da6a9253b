"""A fake Kubernetes API server and control plane for the kubernetes backend's tests.

``FakeKubeApiServer`` speaks real HTTP on 127.0.0.1, so the backend runs unchanged on the real
``kubernetes_asyncio`` client; its ``cluster`` (Job controller, kubelet, garbage collector) runs pods
as ``PodScript`` s say. See ``server``, ``cluster`` and ``store`` for what is faithful and what is not.
"""

from k8s_fake.cluster import FakeCluster as FakeCluster
from k8s_fake.cluster import PodContext as PodContext
from k8s_fake.cluster import PodScript as PodScript
from k8s_fake.cluster import default_script as default_script
from k8s_fake.cluster import format_ts as format_ts
from k8s_fake.server import FakeKubeApiServer as FakeKubeApiServer
from k8s_fake.store import ApiError as ApiError
from k8s_fake.store import Request as Request
from k8s_fake.store import Store as Store
