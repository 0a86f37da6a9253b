"""Log files of replicas that write to pipes: written on the event loop, read and followed line by line.

``ReplicaLogWriter`` pumps a replica's stdout/stderr pipes into ``stdout.log``, ``stderr.log`` and
``combined.log`` (plus a timing index for ``since``/``until``); ``iter_log_lines`` reads or follows one of
them. Backends that write their own files (Slurm) use ``iter_log_lines`` alone. ``LogQuery`` is the checked
form of a ``log_iter`` request that every backend receives, and ``Stream`` names what it reads. This
package sits below the backends and imports nothing of them (``schedulers.api`` re-exports ``Stream``).
"""

from asynctorchx.logs._cursor import LogEntry as LogEntry
from asynctorchx.logs._files import INDEX_FILE as INDEX_FILE
from asynctorchx.logs._files import LOG_FILES as LOG_FILES
from asynctorchx.logs._files import log_file_name as log_file_name
from asynctorchx.logs._notify import Wake as Wake
from asynctorchx.logs._notify import wake_readers as wake_readers
from asynctorchx.logs._query import ALL_STREAMS as ALL_STREAMS
from asynctorchx.logs._query import LogQuery as LogQuery
from asynctorchx.logs._query import Stream as Stream
from asynctorchx.logs._query import check_time_window as check_time_window
from asynctorchx.logs._query import compile_log_regex as compile_log_regex
from asynctorchx.logs._query import parse_stream as parse_stream
from asynctorchx.logs._reader import decode_lines as decode_lines
from asynctorchx.logs._reader import iter_log_entries as iter_log_entries
from asynctorchx.logs._reader import iter_log_lines as iter_log_lines
from asynctorchx.logs._reader import iter_query_entries as iter_query_entries
from asynctorchx.logs._reader import iter_query_lines as iter_query_lines
from asynctorchx.logs._writer import LogFiles as LogFiles
from asynctorchx.logs._writer import ReplicaLogWriter as ReplicaLogWriter

__all__ = [
    "ALL_STREAMS",
    "INDEX_FILE",
    "LOG_FILES",
    "LogEntry",
    "LogFiles",
    "LogQuery",
    "ReplicaLogWriter",
    "Stream",
    "Wake",
    "check_time_window",
    "compile_log_regex",
    "decode_lines",
    "iter_log_entries",
    "iter_log_lines",
    "iter_query_entries",
    "iter_query_lines",
    "log_file_name",
    "parse_stream",
    "wake_readers",
]
