"""Internals of the ``slurm`` backend: the batch script (pure), output parsers (pure), the command seam."""
