"""An async web service that launches and follows jobs, all on one AsyncRunner (aiohttp).

    python examples/service.py --port 8080

Endpoints (``{scheduler}/{app_id}`` are the last two parts of an app handle):

- ``POST /apps`` with ``{"component": "utils.echo", "args": ["--msg", "hi"], "scheduler": "local_cwd"}``
  launches a component and answers ``{"handle": ..., "scheduler": ..., "app_id": ...}``;
- ``GET /apps/{scheduler}/{app_id}`` answers the app's status as JSON (404 when unknown);
- ``GET /apps/{scheduler}/{app_id}/logs?role=R&replica=K`` streams the replica's log lines as
  Server-Sent Events, following the tail until the app ends (one ``data:`` event per line, then an
  ``event: end`` with the final state);
- ``POST /apps/{scheduler}/{app_id}/wait`` waits for the app and answers its final status;
- ``DELETE /apps/{scheduler}/{app_id}`` cancels the app.

Any number of clients can launch and stream at once: the runner's StatusHub shares one status loop
per scheduler between all of them, and each log stream is its own async generator.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import AsyncIterator

from aiohttp import web

from asynctorchx import AsyncRunner
from asynctorchx.specs import make_app_handle

RUNNER = web.AppKey("runner", AsyncRunner)
SESSION = web.AppKey("session_name", str)


async def runner_ctx(app: web.Application) -> AsyncIterator[None]:
    """Opens one AsyncRunner for the service's lifetime; closing it stops the local apps it launched."""
    async with AsyncRunner(name=app[SESSION]) as runner:
        app[RUNNER] = runner
        yield


def _handle(request: web.Request) -> str:
    runner = request.app[RUNNER]
    return make_app_handle(
        request.match_info["scheduler"], runner.name, request.match_info["app_id"]
    )


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def launch(request: web.Request) -> web.Response:
    runner = request.app[RUNNER]
    try:
        body = await request.json()
        component = body["component"]
        args = [str(a) for a in body.get("args", [])]
        scheduler = body.get("scheduler", "local_cwd")
    except (ValueError, KeyError, TypeError) as e:
        return _error(
            400, f"expected a JSON body with 'component' and optional 'args', 'scheduler': {e}"
        )
    try:
        handle = await runner.run_component(component, args, scheduler)
    except (ValueError, LookupError) as e:  # unknown component/scheduler, bad args or cfg
        return _error(400, str(e))
    app_id = handle.rsplit("/", 1)[1]
    return web.json_response(
        {"handle": handle, "scheduler": scheduler, "app_id": app_id}, status=201
    )


async def status(request: web.Request) -> web.Response:
    runner = request.app[RUNNER]
    st = await runner.status(_handle(request))
    if st is None:
        return _error(404, "unknown app")
    return web.json_response(st.to_json())


async def wait(request: web.Request) -> web.Response:
    runner = request.app[RUNNER]
    st = await runner.wait(_handle(request))
    if st is None:
        return _error(404, "unknown app")
    return web.json_response(st.to_json())


async def cancel(request: web.Request) -> web.Response:
    runner = request.app[RUNNER]
    await runner.cancel(_handle(request))
    return web.json_response({"cancelled": _handle(request)})


async def logs(request: web.Request) -> web.StreamResponse:
    runner = request.app[RUNNER]
    handle = _handle(request)
    role = request.query.get("role")
    if not role:
        return _error(400, "the 'role' query parameter is required")
    try:
        replica = int(request.query.get("replica", "0"))
    except ValueError:
        return _error(400, f"replica must be an integer, got {request.query.get('replica')!r}")
    # aclosing: a client that goes away mid-stream stops the tail at once
    async with contextlib.aclosing(
        runner.log_lines(handle, role, replica, should_tail=True)
    ) as lines:
        try:
            first = await anext(lines, None)
        except (LookupError, ValueError) as e:  # unknown app, role or replica
            return _error(404, str(e))
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        if first is not None:
            await response.write(_sse(first))
            async for line in lines:
                await response.write(_sse(line))
    final = await runner.status(handle)
    state = final.state.name if final else "UNKNOWN"
    await response.write(f"event: end\ndata: {json.dumps({'state': state})}\n\n".encode())
    await response.write_eof()
    return response


def _sse(line: str) -> bytes:
    # one event per log line; JSON keeps '\r', the trailing '\n' and any other character intact
    return f"data: {json.dumps(line)}\n\n".encode()


def make_app(session_name: str = "service") -> web.Application:
    """The aiohttp application (tests serve it on an ephemeral port)."""
    app = web.Application()
    app[SESSION] = session_name
    app.cleanup_ctx.append(runner_ctx)
    app.router.add_post("/apps", launch)
    app.router.add_get("/apps/{scheduler}/{app_id}", status)
    app.router.add_post("/apps/{scheduler}/{app_id}/wait", wait)
    app.router.add_delete("/apps/{scheduler}/{app_id}", cancel)
    app.router.add_get("/apps/{scheduler}/{app_id}/logs", logs)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    web.run_app(make_app(), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
