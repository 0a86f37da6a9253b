"""Registers a model archive with a TorchServe management API (TorchX's ``torchx.apps.serve.serve``).

The archive (a local path, ``file://``, ``http(s)://``, or any fsspec URL when fsspec is installed) is
copied to a temporary directory and served over HTTP on ``--port``; the app then asks TorchServe to
register it: ``POST {management_api}/models?url=http://{this host}:{port}/{file}&...`` with the
TorchServe parameters given (``--model_name``, ``--handler``, ``--batch_size``...). TorchServe
downloads the archive during that request. The app prints TorchServe's answer and exits 0 when it
is a success, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

TORCHSERVE_PARAMS = (
    "model_name",
    "handler",
    "runtime",
    "batch_size",
    "max_batch_delay",
    "initial_workers",
    "synchronous",
    "response_timeout",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="registers a model with TorchServe")
    parser.add_argument("--model_path", required=True, help="the model archive (.mar) to serve")
    parser.add_argument(
        "--management_api", required=True, help="TorchServe's management API, http://host:8081"
    )
    parser.add_argument("--timeout", type=int, default=60, help="seconds to wait for TorchServe")
    parser.add_argument("--dryrun", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--port", type=int, default=8222, help="port of the file server TorchServe downloads from"
    )
    for param in TORCHSERVE_PARAMS:
        parser.add_argument(f"--{param}", type=str, help=f"TorchServe's {param} parameter")
    return parser.parse_args(argv)


def routable_ip_to(url: str) -> str:
    """This host's address on the route to ``url``'s host (no packet is sent)."""
    parsed = urllib.parse.urlparse(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((parsed.hostname or "localhost", parsed.port or 80))
        return str(s.getsockname()[0])


def download(src: str, dst: str) -> None:
    """Copies ``src`` (a path or URL) to the local file ``dst``."""
    local = src[len("file://") :] if src.startswith("file://") else src
    if "://" not in local:
        shutil.copyfile(os.path.expanduser(local), dst)  # (~ as fsspec expands it)
    elif src.startswith(("http://", "https://")):
        with urllib.request.urlopen(src, timeout=600) as r, open(dst, "wb") as w:
            shutil.copyfileobj(r, w, 1 << 20)
    else:
        try:
            import fsspec
        except ImportError:
            sys.exit(f"serve: --model_path {src!r} needs fsspec (pip install fsspec)")
        with fsspec.open(src, "rb") as r, open(dst, "wb") as w:
            shutil.copyfileobj(r, w, 1 << 20)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dryrun:
        print("App serve started successfully")
        return 0
    with tempfile.TemporaryDirectory() as tmpdir:
        model_file = f"{args.model_name or 'model'}_{secrets.token_hex(8)}.mar"
        print(f"downloading {args.model_path} to {model_file}...", flush=True)
        download(args.model_path, os.path.join(tmpdir, model_file))
        handler = partial(SimpleHTTPRequestHandler, directory=tmpdir)
        server = ThreadingHTTPServer(("", args.port), handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            model_url = (
                f"http://{routable_ip_to(args.management_api)}:{server.server_port}/{model_file}"
            )
            print(f"serving the model at {model_url}", flush=True)
            query = {"url": model_url}
            for param in TORCHSERVE_PARAMS:
                value = getattr(args, param)
                if value is not None:
                    query[param] = value
            url = f"{args.management_api.rstrip('/')}/models?{urllib.parse.urlencode(query)}"
            print(f"POST {url}", flush=True)
            request = urllib.request.Request(url, data=b"", method="POST")
            try:
                with urllib.request.urlopen(request, timeout=args.timeout) as r:
                    print(r.read().decode("utf-8", "replace"), flush=True)
            except urllib.error.HTTPError as e:
                print(e.read().decode("utf-8", "replace"), flush=True)
                print(f"TorchServe answered {e.code} {e.reason}", file=sys.stderr, flush=True)
                return 1
            except (urllib.error.URLError, OSError) as e:
                print(f"cannot reach TorchServe at {url}: {e}", file=sys.stderr, flush=True)
                return 1
        finally:
            print("shutting down...", flush=True)
            server.shutdown()
            server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
