"""Components for model serving: registering a model with `TorchServe <https://pytorch.org/serve/>`_.

::

    asynctorchx run serve.torchserve --model_path s3://bucket/model.mar \\
        --management_api http://torchserve:8081 --params model_name=resnet,initial_workers=2
"""

from __future__ import annotations

from asynctorchx.apps import source
from asynctorchx.components import IMAGE
from asynctorchx.specs import AppDef, Resource, Role

MODEL_DOWNLOAD_PORT = 8222
"""The port of the file server TorchServe downloads the model from (it must reach this port)."""


def torchserve(
    model_path: str,
    management_api: str,
    image: str = IMAGE,
    params: dict[str, object] | None = None,
    dryrun: bool = False,
) -> AppDef:
    """Registers a model archive with a TorchServe management API.

    The replica serves the archive over HTTP (port 8222) and asks TorchServe to register it from
    there; it ends once TorchServe has answered (success: the app succeeds).

    Args:
        model_path: the model archive (.mar): a path or a URL (http(s), or fsspec such as s3://)
        management_api: the root URL of TorchServe's management API, e.g. http://torchserve:8081
        image: the image to run in (it needs python)
        params: TorchServe's registration parameters, e.g. model_name=x,initial_workers=2
            (see https://pytorch.org/serve/management_api.html#register-a-model)
        dryrun: start the app but register nothing
    """
    args = [
        "-c",
        source("serve"),
        "--model_path",
        model_path,
        "--management_api",
        management_api,
    ]
    for param, value in (params or {}).items():
        args += [f"--{param}", str(value)]
    if dryrun:
        args.append("--dryrun")
    return AppDef(
        name="torchx-torchserve",
        roles=[
            Role(
                name="worker",
                image=image,
                entrypoint="python",
                args=args,
                port_map={"model-download": MODEL_DOWNLOAD_PORT},
                resource=Resource(cpu=1, gpu=0, memMB=1024),
            )
        ],
    )
