"""TorchX's AWS named resources (``aws_p3.2xlarge``, ``aws_t3.medium``...) with TorchX 0.7's values.

Each name stands for an EC2 instance type: its vCPUs and GPUs, its memory less the 4% that ECS and
EC2 keep for themselves (AWS Batch enforces hard memory limits, so a job asking for the full amount
would never be placed), the instance type as the ``node.kubernetes.io/instance-type`` capability
(the Kubernetes backend turns it into a node selector) and, where the instance has them, EFA network
interfaces and Neuron devices as ``devices``.

The names and numbers are TorchX 0.7's, so a component written for TorchX asks for the same
resources here. Like TorchX's module, this one exposes ``NAMED_RESOURCES`` (name to factory), the
device and capability names, ``GiB`` and ``instance_type_from_resource``; ``aws_p3_2xlarge()``-style
factories are available as attributes too.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from functools import partial

from asynctorchx.specs.api import Resource

EFA_DEVICE = "vpc.amazonaws.com/efa"
"""The device name of an AWS Elastic Fabric Adapter (as the EFA device plugin registers it)."""
NEURON_DEVICE = "aws.amazon.com/neurondevice"
"""The device name of an AWS Neuron (Trainium/Inferentia) device."""
K8S_ITYPE = "node.kubernetes.io/instance-type"
"""The capability (and Kubernetes node label) naming the instance type."""
MEM_TAX = 0.96
"""The share of an instance's memory a container can ask for."""
GiB: int = int(1024 * MEM_TAX)
"""One GiB of instance memory as it can be asked for, in MiB (983)."""

# instance type: (vCPUs, GPUs, memory in GiB, devices)
_INSTANCES: dict[str, tuple[int, int, int, dict[str, int]]] = {
    "t3.medium": (2, 0, 4, {}),
    "m5.2xlarge": (8, 0, 32, {}),
    "p3.2xlarge": (8, 1, 61, {}),
    "p3.8xlarge": (32, 4, 244, {}),
    "p3.16xlarge": (64, 8, 488, {}),
    "p3dn.24xlarge": (96, 8, 768, {EFA_DEVICE: 1}),
    "p4d.24xlarge": (96, 8, 1152, {EFA_DEVICE: 4}),
    "p4de.24xlarge": (96, 8, 1152, {EFA_DEVICE: 4}),
    "p5.48xlarge": (192, 8, 2048, {EFA_DEVICE: 32}),
    "g4dn.xlarge": (4, 1, 16, {}),
    "g4dn.2xlarge": (8, 1, 32, {}),
    "g4dn.4xlarge": (16, 1, 64, {}),
    "g4dn.8xlarge": (32, 1, 128, {EFA_DEVICE: 1}),
    "g4dn.16xlarge": (64, 1, 256, {EFA_DEVICE: 1}),
    "g4dn.12xlarge": (48, 4, 192, {EFA_DEVICE: 1}),
    "g4dn.metal": (96, 8, 384, {EFA_DEVICE: 1}),
    "g5.xlarge": (4, 1, 16, {}),
    "g5.2xlarge": (8, 1, 32, {}),
    "g5.4xlarge": (16, 1, 64, {}),
    "g5.8xlarge": (32, 1, 128, {EFA_DEVICE: 1}),
    "g5.16xlarge": (64, 1, 256, {EFA_DEVICE: 1}),
    "g5.12xlarge": (48, 4, 192, {EFA_DEVICE: 1}),
    "g5.24xlarge": (96, 4, 384, {EFA_DEVICE: 1}),
    "g5.48xlarge": (192, 8, 768, {EFA_DEVICE: 1}),
    "trn1.2xlarge": (8, 0, 32, {NEURON_DEVICE: 1}),
    "trn1.32xlarge": (128, 0, 512, {EFA_DEVICE: 8, NEURON_DEVICE: 16}),
}


def _instance(instance_type: str) -> Resource:
    cpu, gpu, mem_gib, devices = _INSTANCES[instance_type]
    return Resource(
        cpu=cpu,
        gpu=gpu,
        memMB=mem_gib * GiB,
        capabilities={K8S_ITYPE: instance_type},
        devices=dict(devices),
    )


NAMED_RESOURCES: Mapping[str, Callable[[], Resource]] = {
    f"aws_{itype}": partial(_instance, itype) for itype in _INSTANCES
}
"""``aws_{instance type}`` to a factory of a fresh ``Resource``."""

# ``aws_p3_2xlarge``, as TorchX's module names its factories
_FACTORY_NAMES = {f"aws_{itype.replace('.', '_')}": itype for itype in _INSTANCES}


def instance_type_from_resource(resource: Resource) -> str | None:
    """The instance type a resource asks for (its ``node.kubernetes.io/instance-type``), if any.

    Warns (as TorchX does) when there is none: AWS Batch then cannot tell the instance type of a
    multi-node job on a compute environment with several types.
    """
    itype = resource.capabilities.get(K8S_ITYPE)
    if itype is None:
        warnings.warn(
            f"the resource has no {K8S_ITYPE!r} capability: its instance type is unknown",
            stacklevel=2,
        )
    return itype if itype is None else str(itype)


def __getattr__(name: str) -> Callable[[], Resource]:
    itype = _FACTORY_NAMES.get(name)
    if itype is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return partial(_instance, itype)
