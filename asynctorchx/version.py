"""The package version and the default container image, kept in one place."""

__version__ = "0.1.0"

IMAGE = "ghcr.io/pytorch/torchx:0.7.0"
"""The default image of the builtin components: TorchX 0.7's own (Python, PyTorch and TorchX).

Only backends that run containers (``local_docker``, ``kubernetes``; ``slurm`` ignores images) use
it; ``local_cwd`` runs in the current directory. It is TorchX's default so that a component file
written for TorchX (``image=torchx.IMAGE``) builds the same AppDef here, and so that the builtins'
programs (``python``, ``torchrun``) exist in it. Override it per component with ``--image``.
"""
