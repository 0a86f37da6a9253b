"""An async web service that launches and follows jobs, all on one AsyncRunner (aiohttp).

    python examples/service.py --port 8080

Endpoints (``{scheduler}/{app_id}`` are the last two parts of an app handle):

- ``POST /apps`` with ``{"component": "utils.echo", "args": ["--msg", "hi"], "scheduler": "local_cwd"}``
  launches a component and answers ``{"handle": ..., "scheduler": ..., "app_id": ...}``;
- ``GET /apps/{scheduler}/{app_id}`` answers the app's status as JSON (404 when unknown);
- ``GET /apps/{scheduler}/{app_id}/logs?role=R&replica=K`` streams the replica's log lines as
  Server-Sent Events, following the tail until the app ends (one ``data:`` event per line, then an
  ``event: end`` with the final state). Each line's event has the line's log cursor as its ``id:``,
  so a browser's ``EventSource`` that reconnects sends it back as ``Last-Event-ID`` and the stream
  resumes exactly after the last line it received (a cursor of another log: 400);
- ``POST /apps/{scheduler}/{app_id}/wait`` waits for the app and answers its final status;
- ``DELETE /apps/{scheduler}/{app_id}`` cancels the app;
- ``POST /runs`` with the body of ``POST /apps`` (plus optional ``"role"`` and ``"replica"``) is an
  attached run: it launches the component and streams that replica's log as Server-Sent Events
  until the app ends. The app lives no longer than the request: a client that disconnects
  mid-stream gets its app cancelled (``runner.launched``).

Any number of clients can launch and stream at once: the runner's StatusHub shares one status loop
per scheduler between all of them, and each log stream is its own async generator. The runner is
made by ``get_runner``, so ``[limits:SCHEDULER]`` sections of ``.torchxconfig`` bound how many
submits the service has in flight and how many calls per second it makes to each backend; a launch
beyond the limit waits for its turn.

Its tests (``tests/test_example_service.py``) run it on ``asynctorchx.testing``'s scripted
scheduler: no process is started.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from aiohttp import web

from asynctorchx import AsyncRunner, get_runner
from asynctorchx.specs import make_app_handle

RUNNER = web.AppKey("runner", AsyncRunner)
SESSION = web.AppKey("session_name", str)
RUNNER_OPTIONS = web.AppKey("runner_options", dict[str, Any])


async def runner_ctx(app: web.Application) -> AsyncIterator[None]:
    """Opens one AsyncRunner for the service's lifetime; closing it stops the local apps it launched."""
    async with get_runner(app[SESSION], **app[RUNNER_OPTIONS]) as runner:
        app[RUNNER] = runner
        yield


def _handle(request: web.Request) -> str:
    runner = request.app[RUNNER]
    return make_app_handle(
        request.match_info["scheduler"], runner.name, request.match_info["app_id"]
    )


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _launch_request(request: web.Request) -> tuple[str, list[str], str, dict[str, Any]]:
    """``(component, args, scheduler, body)`` of a launch request.

    Raises:
        web.HTTPBadRequest: the body is not such a JSON object.
    """
    try:
        body = await request.json()
        component = body["component"]
        args = [str(a) for a in body.get("args", [])]
        scheduler = body.get("scheduler", "local_cwd")
        if not isinstance(component, str) or not isinstance(scheduler, str):
            raise TypeError("'component' and 'scheduler' must be strings")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise web.HTTPBadRequest(
            text=json.dumps(
                {
                    "error": "expected a JSON body with 'component' and optional 'args', "
                    f"'scheduler': {e}"
                }
            ),
            content_type="application/json",
        ) from None
    return component, args, scheduler, body


async def launch(request: web.Request) -> web.Response:
    runner = request.app[RUNNER]
    component, args, scheduler, _ = await _launch_request(request)
    try:
        handle = await runner.run_component(component, args, scheduler)
    except (ValueError, LookupError) as e:  # unknown component/scheduler, bad args or cfg
        return _error(400, str(e))
    except Exception as e:  # the backend refused the submission
        return _error(502, f"the scheduler {scheduler!r} did not accept the app: {e}")
    app_id = handle.rsplit("/", 1)[1]
    return web.json_response(
        {"handle": handle, "scheduler": scheduler, "app_id": app_id}, status=201
    )


async def status(request: web.Request) -> web.Response:
    runner = request.app[RUNNER]
    try:
        st = await runner.status(_handle(request))
    except (ValueError, LookupError) as e:  # no scheduler of that name (or a malformed handle)
        return _error(404, str(e))
    if st is None:
        return _error(404, "unknown app")
    return web.json_response(st.to_json())


async def wait(request: web.Request) -> web.Response:
    runner = request.app[RUNNER]
    try:
        st = await runner.wait(_handle(request))
    except (ValueError, LookupError) as e:  # no scheduler of that name (or a malformed handle)
        return _error(404, str(e))
    if st is None:
        return _error(404, "unknown app")
    return web.json_response(st.to_json())


async def cancel(request: web.Request) -> web.Response:
    runner = request.app[RUNNER]
    try:
        await runner.cancel(_handle(request))
    except (ValueError, LookupError) as e:  # no scheduler of that name (or a malformed handle)
        return _error(404, str(e))
    return web.json_response({"cancelled": _handle(request)})


async def logs(request: web.Request) -> web.StreamResponse:
    handle = _handle(request)
    role = request.query.get("role")
    if not role:
        return _error(400, "the 'role' query parameter is required")
    try:
        replica = int(request.query.get("replica", "0"))
    except ValueError:
        return _error(400, f"replica must be an integer, got {request.query.get('replica')!r}")
    cursor = request.headers.get("Last-Event-ID") or None
    return await _stream_log(request, handle, role, replica, cursor)


async def _stream_log(
    request: web.Request, handle: str, role: str, replica: int, cursor: str | None = None
) -> web.StreamResponse:
    """Streams a replica's log as Server-Sent Events until the app ends, then its final state.

    With ``cursor`` (a ``Last-Event-ID``) the log resumes right after the line it names.
    """
    runner = request.app[RUNNER]
    # aclosing: a client that goes away mid-stream stops the tail at once
    async with contextlib.aclosing(_entries(runner, handle, role, replica, cursor)) as entries:
        try:
            first = await anext(entries, None)
        except ValueError as e:  # a Last-Event-ID that is not a cursor of this log
            return _error(400 if cursor else 404, str(e))
        except NotImplementedError as e:  # a Last-Event-ID for a backend without cursors
            return _error(400, str(e))
        except LookupError as e:  # unknown app, role or replica
            return _error(404, str(e))
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        if first is not None:
            await response.write(_sse(*first))
            async for entry in entries:
                await response.write(_sse(*entry))
    final = await runner.wait(handle)
    state = final.state.name if final else "UNKNOWN"
    await response.write(f"event: end\ndata: {json.dumps({'state': state})}\n\n".encode())
    await response.write_eof()
    return response


async def attached_run(request: web.Request) -> web.StreamResponse:
    """Launches a component for the duration of the request and streams its log.

    ``runner.launched`` cancels the app (and waits for its end) if the handler is cancelled, which
    aiohttp does when the client disconnects (``handler_cancellation=True``), if streaming fails,
    or if the request ends before the app did (an unknown role, say).
    """
    runner = request.app[RUNNER]
    component, args, scheduler, body = await _launch_request(request)
    role = body.get("role")
    replica = body.get("replica", 0)
    if not isinstance(replica, int) or isinstance(replica, bool):
        return _error(400, f"replica must be an integer, got {replica!r}")
    async with contextlib.AsyncExitStack() as stack:
        try:
            # the app never outlives the request: cancelled on errors, disconnection, or the end
            handle = await stack.enter_async_context(
                runner.launched(
                    component,
                    scheduler,
                    component_args=args,
                    cancel_on_normal_exit=True,
                    cleanup_timeout=30,
                )
            )
        except (ValueError, LookupError) as e:  # unknown component/scheduler, bad args or cfg
            return _error(400, str(e))
        except Exception as e:  # the backend refused the submission
            return _error(502, f"the scheduler {scheduler!r} did not accept the app: {e}")
        if role is None:
            described = await runner.describe(handle)
            role = described.roles[0].name if described and described.roles else ""
        return await _stream_log(request, handle, str(role), replica)


async def _entries(
    runner: AsyncRunner, handle: str, role: str, replica: int, cursor: str | None
) -> AsyncGenerator[tuple[str | None, str], None]:
    """``(cursor, line)`` of the followed log; a backend without cursors (a third-party one) still
    streams its lines, without ids, unless the client asks to resume (NotImplementedError)."""
    try:  # (a bad argument, a backend without cursors: raised at the call)
        entries = runner.log_entries(handle, role, replica, should_tail=True, cursor=cursor)
    except NotImplementedError:
        if cursor is not None:
            raise
        # TorchX-style third-party backends: the lines, without ids
        async for line in runner.log_lines(handle, role, replica, should_tail=True):
            yield None, line
        return
    try:
        async for entry in entries:
            yield entry.cursor, entry.line
    finally:
        await entries.aclose()


def _sse(cursor: str | None, line: str) -> bytes:
    # one event per log line; JSON keeps '\r', the trailing '\n' and any other character intact;
    # the cursor is base64url text, safe on an SSE line
    event_id = "" if cursor is None else f"id: {cursor}\n"
    return f"{event_id}data: {json.dumps(line)}\n\n".encode()


def make_app(session_name: str = "service", **runner_options: Any) -> web.Application:
    """The aiohttp application (tests serve it on an ephemeral port).

    Args:
        session_name: the runner's session name (part of every handle).
        **runner_options: passed to ``get_runner`` (tests give ``scheduler_factories=``, a service
            may give ``limits=`` instead of ``.torchxconfig`` sections).
    """
    app = web.Application()
    app[SESSION] = session_name
    app[RUNNER_OPTIONS] = dict(runner_options)
    app.cleanup_ctx.append(runner_ctx)
    app.router.add_post("/apps", launch)
    app.router.add_get("/apps/{scheduler}/{app_id}", status)
    app.router.add_post("/apps/{scheduler}/{app_id}/wait", wait)
    app.router.add_delete("/apps/{scheduler}/{app_id}", cancel)
    app.router.add_get("/apps/{scheduler}/{app_id}/logs", logs)
    app.router.add_post("/runs", attached_run)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    # a client that disconnects cancels its handler: its attached run is then cancelled too
    web.run_app(make_app(), host=args.host, port=args.port, handler_cancellation=True)


if __name__ == "__main__":
    main()
