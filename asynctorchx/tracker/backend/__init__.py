"""Tracker backends: ``fsspec`` (TorchX's file layout on a local path or any fsspec file system)."""
