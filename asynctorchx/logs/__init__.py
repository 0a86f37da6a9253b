"""Log files of replicas that write to pipes: written on the event loop, read and followed line by line.

``ReplicaLogWriter`` pumps a replica's stdout/stderr pipes into ``stdout.log``, ``stderr.log`` and
``combined.log`` (plus a timing index for ``since``/``until``); ``iter_log_lines`` reads or follows one of
them. Backends that write their own files (Slurm) use ``iter_log_lines`` alone. This package sits below
the backends and imports nothing of them.
"""

from asynctorchx.logs._files import INDEX_FILE as INDEX_FILE
from asynctorchx.logs._files import LOG_FILES as LOG_FILES
from asynctorchx.logs._files import log_file_name as log_file_name
from asynctorchx.logs._notify import wake_readers as wake_readers
from asynctorchx.logs._reader import decode_lines as decode_lines
from asynctorchx.logs._reader import iter_log_lines as iter_log_lines
from asynctorchx.logs._writer import ReplicaLogWriter as ReplicaLogWriter
from asynctorchx.schedulers.api import Stream as Stream

__all__ = [
    "INDEX_FILE",
    "LOG_FILES",
    "ReplicaLogWriter",
    "Stream",
    "decode_lines",
    "iter_log_lines",
    "log_file_name",
    "wake_readers",
]
