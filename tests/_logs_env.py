"""Helpers for the log tests: real child processes writing through real pipes to a ReplicaLogWriter.

Tests import what they use: ``from _logs_env import spawn, run_child``.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import sys

from asynctorchx.logs import ReplicaLogWriter, Stream
from asynctorchx.logs._files import RECORD


async def spawn(
    writer: ReplicaLogWriter, code: str, *args: str, stdin: int | None = None
) -> asyncio.subprocess.Process:
    """Starts ``python -c code`` with its stdout/stderr on pipes attached to ``writer``."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, *args, stdin=stdin, stdout=out_w, stderr=err_w
        )
    finally:
        os.close(out_w)
        os.close(err_w)
    writer.attach(out_r, Stream.STDOUT)
    writer.attach(err_r, Stream.STDERR)
    return proc


async def run_child(directory: pathlib.Path, code: str, *args: str) -> ReplicaLogWriter:
    """Runs ``python -c code`` to completion with its output written to ``directory``."""
    writer = ReplicaLogWriter(directory)
    proc = await spawn(writer, code, *args)
    await proc.wait()
    await writer.wait_drained()
    writer.close()
    return writer


def index_records(chunks: list[tuple[int, int, int]]) -> bytes:
    """The ``index.bin`` records the writer writes for ``chunks``: (time_ns, stream id, length)
    each, in ``combined.log``'s order."""
    offsets = {0: 0, 1: 0}
    combined = 0
    out = []
    for t, sid, length in chunks:
        out.append(RECORD.pack(t, offsets[sid], combined, length, sid))
        offsets[sid] += length
        combined += length
    return b"".join(out)
