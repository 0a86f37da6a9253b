"""Per-backend launch limits: at most K submits in flight, at most R control-plane calls per second.

Slurm controllers and Kubernetes API servers punish floods, and a service or a sweep driver can start
hundreds of ``run()`` calls at once. ``AsyncRunner(limits={"slurm": Limits(8, 5.0)})`` (or a
``[limits:slurm]`` section of ``.torchxconfig``, read by ``get_runner``) bounds what one runner sends
to one backend:

- ``max_concurrent_submits``: how many submissions (the backend's ``schedule``) may be in flight at
  once; the others wait in FIFO order. The slot is held only while the backend is asked, not while
  a component is built or a dry run made.
- ``max_calls_per_second``: how many control-plane calls the runner makes per second. One call each:
  a submit, a ``status``/``describe``, a status round of the StatusHub (one ``describe_many`` for
  every app it follows, however many), a ``cancel``, a ``list``; two for the opening of a log by
  ``log_lines`` (the app's existence check, then the log itself; the lines read afterwards are not
  calls). What a backend does inside one of these
  (a local ``cancel`` that describes the app first, the default ``describe_many`` that describes
  apps one by one) is counted as the one call the runner made. With ``R`` calls per second the
  runner makes at most ``max(1, floor(R))`` calls in any window of ``max(1, floor(R)) / R``
  seconds: bursts of up to ``floor(R)`` calls, never more than ``R`` a second on average.

Waiting for a slot or a call is cancellable: a ``run()`` cancelled while it waits submits nothing.
Queued launches have no app handle yet, so ``watch()`` cannot show them; ``runner.launch_events()``
reports every launch as it is queued, sent, submitted, failed or cancelled (``LaunchEvent``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import decimal
import enum
import math
import numbers
import os
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from asynctorchx.specs.api import AppHandle

#: The keys of a ``[limits:BACKEND]`` section of ``.torchxconfig`` (and of a limits mapping).
LIMIT_KEYS = ("max_concurrent_submits", "max_calls_per_second")


class Clock(Protocol):
    """The time source of the rate limits (``asynctorchx.testing.VirtualClock`` in tests)."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back."""

    async def sleep(self, seconds: float) -> None:
        """Returns once ``seconds`` have passed on this clock."""


class SystemClock:
    """Real time: ``time.monotonic`` and ``anyio.sleep``."""

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)


def _where(backend: str | None) -> str:
    return "Limits" if backend is None else f"limits of backend {backend!r}"


def _check_submits(value: object, backend: str | None) -> int | None:
    if value is None:
        return None
    number: object = value
    if isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            number = value
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        number = int(value)  # numpy's integers, say
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise ValueError(
            f"{_where(backend)}: max_concurrent_submits must be an integer >= 1 "
            f"(None for no limit), got {value!r}"
        )
    return number


def _check_rate(value: object, backend: str | None) -> float | None:
    if value is None:
        return None
    number: object = value
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = value
    elif isinstance(value, (numbers.Real, decimal.Decimal)) and not isinstance(value, int):
        try:
            number = float(value)  # numpy's numbers, a Decimal, a Fraction (NaN: refused below)
        except OverflowError:  # a Fraction too large for a float: not finite either
            number = math.inf
    if isinstance(number, int) and not isinstance(number, bool):
        try:
            number = float(number)
        except OverflowError:  # too large for a float: not finite either
            number = math.inf
    if (
        isinstance(number, bool)
        or not isinstance(number, (int, float))
        or not math.isfinite(number)
        or number <= 0
    ):
        raise ValueError(
            f"{_where(backend)}: max_calls_per_second must be a finite number > 0 "
            f"(None for no limit), got {value!r}"
        )
    return float(number)


@dataclass(frozen=True)
class Limits:
    """What one runner may send to one backend.

    Args:
        max_concurrent_submits: submissions in flight at once (None: no limit).
        max_calls_per_second: control-plane calls per second (None: no limit); see the module's
            docstring for what counts as a call.

    Raises:
        ValueError: a limit is <= 0, NaN, infinite or not a number (names the field and the value).
    """

    max_concurrent_submits: int | None = None
    max_calls_per_second: float | None = None

    def __post_init__(self) -> None:
        # (kept as read: "8" is 8, so a string never reaches the limiter's comparisons)
        object.__setattr__(
            self, "max_concurrent_submits", _check_submits(self.max_concurrent_submits, None)
        )
        object.__setattr__(
            self, "max_calls_per_second", _check_rate(self.max_calls_per_second, None)
        )

    @classmethod
    def parse(cls, backend: str, values: Limits | Mapping[str, object]) -> Limits:
        """The limits of ``backend`` from a ``Limits`` or a mapping (values may be strings).

        Raises:
            ValueError: an unknown key, or a bad value (names the backend, the key and the value).
        """
        if isinstance(values, Limits):
            return values
        if not isinstance(values, Mapping):
            raise ValueError(
                f"{_where(backend)}: expected a Limits or a mapping of "
                f"{', '.join(LIMIT_KEYS)}, got {values!r}"
            )
        unknown = [k for k in values if k not in LIMIT_KEYS]
        if unknown:
            raise ValueError(
                f"{_where(backend)}: unknown key {unknown[0]!r}; the keys are {', '.join(LIMIT_KEYS)}"
            )
        return cls(
            max_concurrent_submits=_check_submits(values.get("max_concurrent_submits"), backend),
            max_calls_per_second=_check_rate(values.get("max_calls_per_second"), backend),
        )


_MAX_BURST = 100_000


class RateLimiter:
    """At most ``max(1, floor(rate))`` grants in any window of ``max(1, floor(rate)) / rate`` seconds.

    Grants are FIFO (one waiter at a time holds the lock while it sleeps); a cancelled waiter takes
    nothing.
    """

    def __init__(self, rate: float, clock: Clock) -> None:
        self.rate = rate
        # the burst is capped so that an absurd rate (1e300) costs no absurd memory
        self.burst = max(1, min(math.floor(rate), _MAX_BURST))
        self.window = self.burst / rate
        self._clock = clock
        self._grants: collections.deque[float] = collections.deque(maxlen=self.burst)
        self._lock = asyncio.Lock()

    def _delay(self, now: float) -> float:
        if len(self._grants) < self.burst:
            return 0.0
        return self._grants[0] + self.window - now

    def would_wait(self) -> bool:
        """True when an ``acquire`` now would have to wait."""
        return self._lock.locked() or self._delay(self._clock.monotonic()) > 1e-9

    async def acquire(self) -> None:
        """Returns when a call may be made (and counts it)."""
        async with self._lock:
            while (delay := self._delay(self._clock.monotonic())) > 1e-9:
                await self._clock.sleep(delay)
            self._grants.append(self._clock.monotonic())


class BackendLimiter:
    """The limits of one backend on one runner: a FIFO submit slot and a call rate."""

    def __init__(self, backend: str, limits: Limits, clock: Clock) -> None:
        self.backend = backend
        self.limits = limits
        n = limits.max_concurrent_submits
        self._slots = asyncio.Semaphore(n) if n is not None else None
        rate = limits.max_calls_per_second
        self._rate = RateLimiter(rate, clock) if rate is not None else None
        self.waiting = 0  # launches waiting for a slot or a call
        self._waits: set[anyio.CancelScope] = set()
        self._closed = False

    def close(self) -> None:
        """Ends every wait for a slot or a call, and every later one, with RuntimeError: the
        runner closed, and nothing it would let through may reach the backend."""
        self._closed = True
        for scope in self._waits:
            scope.cancel()

    def _wait(self, at_once: bool) -> contextlib.AbstractContextManager[None]:
        """A wait that ``close()`` ends with RuntimeError; ``at_once``: it will not suspend (a
        free slot, a free call), so nothing can end it and it needs no cancel scope (5 us)."""
        if self._closed:
            raise RuntimeError("the runner is closed")
        return contextlib.nullcontext() if at_once else self._closable()

    @contextlib.contextmanager
    def _closable(self) -> Iterator[None]:
        with anyio.CancelScope() as scope:
            self._waits.add(scope)
            try:
                yield
            finally:
                self._waits.discard(scope)
        if scope.cancelled_caught:
            raise RuntimeError("the runner was closed while this call waited for its turn")

    def would_wait(self) -> bool:
        """True when a submit now would have to wait for a slot or for the rate."""
        return bool(
            self.waiting
            or (self._slots is not None and self._slots.locked())
            or (self._rate is not None and self._rate.would_wait())
        )

    def call_would_wait(self) -> bool:
        """True when a ``call`` now would have to wait for the rate."""
        return self._rate is not None and self._rate.would_wait()

    async def call(self) -> None:
        """Waits (cancellably) until one more control-plane call may be made.

        Raises:
            RuntimeError: the runner closed (see ``close``).
        """
        if self._rate is not None:
            with self._wait(not self._rate.would_wait()):
                await self._rate.acquire()

    @contextlib.asynccontextmanager
    async def submit(self, on_queued: Callable[[int], None] | None = None) -> AsyncIterator[None]:
        """Holds a submit slot (and one call) for the body: the backend's ``schedule``.

        Args:
            on_queued: called with the number of waiting launches when this one has to wait.
        """
        if on_queued is not None and self.would_wait():
            on_queued(self.waiting + 1)
        self.waiting += 1
        acquired = False
        try:
            slot_free = self._slots is None or not self._slots.locked()
            with self._wait(slot_free and not self.call_would_wait()):
                if self._slots is not None:
                    await self._slots.acquire()
                    acquired = True
                if self._rate is not None:
                    await self._rate.acquire()
        except BaseException:
            if acquired and self._slots is not None:
                self._slots.release()
            raise
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            if self._slots is not None:
                self._slots.release()


def make_limiters(
    limits: Mapping[str, Limits | Mapping[str, object]] | None, clock: Clock
) -> dict[str, BackendLimiter]:
    """``{backend: BackendLimiter}`` for a runner's ``limits`` argument (validated)."""
    if limits is None:
        return {}
    if not isinstance(limits, Mapping):
        raise ValueError(f"limits must be a mapping of backend names to Limits, got {limits!r}")
    out: dict[str, BackendLimiter] = {}
    for backend, value in limits.items():
        if not isinstance(backend, str) or not backend:
            raise ValueError(f"limits: a backend name must be a non-empty string, got {backend!r}")
        parsed = Limits.parse(backend, value)
        if parsed.max_concurrent_submits is None and parsed.max_calls_per_second is None:
            continue
        out[backend] = BackendLimiter(backend, parsed, clock)
    return out


def limits_from_config(dirs: Iterable[str | os.PathLike[str]] | None = None) -> dict[str, Limits]:
    """The ``[limits:BACKEND]`` sections of ``.torchxconfig`` as ``{backend: Limits}``.

    Args:
        dirs: where to look for config files (see ``asynctorchx.runner.config.find_configs``).

    Raises:
        ValueError: an unknown key or a bad value (names the section, the key and the value).
        ConfigFileError: a config file is not valid INI.
    """
    from asynctorchx.runner.config import load_sections

    out: dict[str, Limits] = {}
    for backend, values in load_sections("limits", dirs).items():
        try:
            out[backend] = Limits.parse(backend, values)
        except ValueError as e:
            raise ValueError(f".torchxconfig [limits:{backend}]: {e}") from None
    return out


# -- launch events ---------------------------------------------------------------------------------


class LaunchPhase(enum.Enum):
    """Where a launch is: before a submission there is no app handle, so these are not AppStates."""

    QUEUED = "queued"  #: waiting for a submit slot or for the call rate of its backend
    SENT = "sent"  #: the backend is being asked to submit it
    SUBMITTED = "submitted"  #: the backend accepted it: ``handle`` is set
    FAILED = "failed"  #: the backend refused it (``error`` says why): nothing runs
    CANCELLED = "cancelled"  #: the caller was cancelled; after QUEUED alone, nothing was submitted


@dataclass(frozen=True, slots=True)
class LaunchEvent:
    """One step of one launch (``run``/``run_component``/``schedule``), seen by ``launch_events``.

    Args:
        launch_id: a number the runner gives each launch (the same in all events of a launch).
        scheduler: the backend it goes to.
        app_name: the name of the app.
        phase: what happened.
        handle: the app's handle (SUBMITTED only).
        error: why it failed (FAILED only).
        waiting: how many launches of this backend were waiting, this one included (QUEUED only).
        timestamp: when (``time.time()``).
    """

    launch_id: int
    scheduler: str
    app_name: str
    phase: LaunchPhase
    handle: AppHandle | None = None
    error: str | None = None
    waiting: int = 0
    timestamp: float = 0.0


_END: Any = object()


class LaunchEventStream:
    """The launch events of a runner from the moment this stream was made, until it is closed.

    Use it as ``async with runner.launch_events() as events: async for event in events: ...``;
    it also ends when the runner closes. Events are buffered until read.
    """

    def __init__(self, unsubscribe: Callable[[LaunchEventStream], None]) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._unsubscribe = unsubscribe
        self._closed = False

    def _put(self, event: LaunchEvent) -> None:
        if not self._closed:
            self._queue.put_nowait(event)

    def _end(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put_nowait(_END)

    def __aiter__(self) -> LaunchEventStream:
        return self

    async def __anext__(self) -> LaunchEvent:
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)
            raise StopAsyncIteration
        event: LaunchEvent = item
        return event

    async def aclose(self) -> None:
        """Stops receiving events (what is buffered can still be read)."""
        self._unsubscribe(self)
        self._end()

    async def __aenter__(self) -> LaunchEventStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class LaunchEvents:
    """The runner's launch counter and the streams that listen to its launches.

    Streams are held weakly: one its reader dropped without closing it (``break`` out of an
    ``async for`` without ``async with``) can never be read again, so it must not buffer every
    later launch's events for the runner's whole life.
    """

    def __init__(self) -> None:
        self._streams: weakref.WeakSet[LaunchEventStream] = weakref.WeakSet()
        self._next_id = 0

    def stream(self) -> LaunchEventStream:
        s = LaunchEventStream(self._remove)
        self._streams.add(s)
        return s

    def _remove(self, stream: LaunchEventStream) -> None:
        self._streams.discard(stream)

    def close(self) -> None:
        for s in list(self._streams):
            s._end()
        self._streams.clear()

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    @property
    def listened(self) -> bool:
        return bool(self._streams)

    def emit(self, event: LaunchEvent) -> None:
        for s in list(self._streams):
            s._put(event)
