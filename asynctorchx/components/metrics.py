"""Components for looking at metrics: a TensorBoard server over a log directory.

TensorBoard runs as a service, so it is given a way to end: a timeout, and optionally a file whose
appearance stops it (``--exit_on_file``, e.g. written by the trainer when it is done) or starts it
(``--start_on_file``)::

    asynctorchx run metrics.tensorboard --logdir s3://bucket/run1/logs --exit_on_file s3://bucket/run1/done

The image needs ``tensorboard`` on its PATH.
"""

from __future__ import annotations

from asynctorchx.apps import source
from asynctorchx.components import IMAGE
from asynctorchx.specs import AppDef, Role


def tensorboard(
    logdir: str,
    image: str = IMAGE,
    timeout: float = 60 * 60,
    port: int = 6006,
    start_on_file: str = "",
    exit_on_file: str = "",
) -> AppDef:
    """Runs a TensorBoard server over logdir until a timeout or until a file appears.

    The files are checked every 5 seconds (local paths, or fsspec URLs when fsspec is installed).
    The app succeeds when exit_on_file stops the server, and fails (exit code 34) when the timeout
    does.

    Args:
        logdir: the TensorBoard logs (a directory or an fsspec URL)
        image: the image to run in (it needs python and tensorboard)
        timeout: the longest the server runs, in seconds
        port: the port TensorBoard listens on
        start_on_file: start the server only once this file exists
        exit_on_file: stop the server once this file exists
    """
    return AppDef(
        name="tensorboard",
        roles=[
            Role(
                name="tensorboard",
                image=image,
                entrypoint="python",
                args=[
                    "-c",
                    source("process_monitor"),
                    "--timeout",
                    str(timeout),
                    "--start_on_file",
                    start_on_file,
                    "--exit_on_file",
                    exit_on_file,
                    "--",
                    "tensorboard",
                    "--bind_all",
                    "--port",
                    str(port),
                    "--logdir",
                    logdir,
                ],
                port_map={"http": port},
            )
        ],
    )
