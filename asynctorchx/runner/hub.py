"""StatusHub: one status loop per scheduler that serves every waiter of the runner.

However many tasks wait on however many apps, the hub runs one ``describe_many`` round at a time
(single-flight) for the apps someone is interested in:

- a backend that pushes changes (``Scheduler.pushes_changes``) wakes the hub at once with the id of the
  app that changed; the hub describes just the changed apps, and keeps a slow safety poll;
- any other backend is polled with an adaptive interval: short right after something changed or a new
  app arrived, growing while nothing changes.

Waiters never call the backend themselves: they wait on the hub's per-app events. The hub polls
only while someone waits (``wait``, ``wait_all``, ``as_completed``, ``watch``, a launch block) or
something is due (an app just submitted, not yet seen by its backend, within
``PollSettings.unknown_grace``); otherwise it sleeps until woken (a waiter, a submit, a cancel, a
push), so that apps launched and left running cost no status calls.

Answers are applied in the order they were asked: each carries the time its describe began (a
round's, or ``runner.status``'s, fed through ``record``), and an answer begun before the one the hub
has applied for an app is dropped, so a slow answer never moves an app back to an older state.

An app the hub has seen that one answer leaves out (a partial listing, an accounting lag) keeps its
last state: it is reported UNKNOWN ("the scheduler no longer knows this app") only once it has been
missing from ``PollSettings.missing_rounds`` answers in a row over at least
``PollSettings.missing_grace`` seconds.

A wait with a deadline never times out on what the hub happened to know: when the deadline passes
with the app not terminal, it asks for a round and raises ``TimeoutError`` only once a round begun
after that has answered for the app (or failed) without it being terminal. So ``wait(h, timeout=0)``
on an app that ended long ago reports it ended, on a fresh runner too, and a wait that ends before
its deadline costs no extra round. For a positive timeout that last round is waited for at most
``PollSettings.deadline_grace`` (the deadline is kept: a backend whose status call hangs, or a round
that began before the deadline and is still running, cannot hold the wait), and not at all when the
backend's call-rate limit holds it back (``round_would_wait``): the wait then raises
``TimeoutError`` on what the hub knew. A timeout of 0 asks for that one look and nothing else, so
it waits for the rate's next slot (the rate is never exceeded) and for the round, at most
``PollSettings.final_look_timeout`` (a hung backend).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import anyio

from asynctorchx._tasks import TaskSupervisor
from asynctorchx.schedulers.api import DescribeAppResponse, Scheduler
from asynctorchx.specs.api import AppState, AppStatus, is_terminal

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PollSettings:
    """How the hub paces its rounds.

    Args:
        min_interval: the poll interval right after a change (seconds).
        max_interval: the longest poll interval while nothing changes.
        backoff: the factor the interval grows by after a round without change.
        push_safety_interval: for pushing backends, how often all live apps are re-described anyway.
        unknown_grace: how long an app submitted by this runner may be unknown to its backend (e.g. not
            yet visible in a listing) before it is reported unknown.
        missing_grace: how long an app the backend has described may then be missing from its
            answers (a partial listing, an accounting lag) before it is reported unknown; it must
            also have been missing from ``missing_rounds`` answers in a row. Meanwhile it keeps
            its last state.
        missing_rounds: how many answers in a row (rounds, and ``runner.status`` calls) must leave
            an app out before it is reported unknown (with ``missing_grace``); an integer >= 1.
        final_look_timeout: how long a ``timeout=0`` wait waits for the scheduler's one answer
            (see the module's docstring), so that a hung backend cannot hold it forever.
        deadline_grace: how long past its deadline a wait with a positive timeout waits for the
            scheduler's last answer (at most ``final_look_timeout``): the timeout is kept, to
            within this, whatever the backend does.

    Raises:
        ValueError: a value that is no number of seconds in its range (NaN, a string, a
            ``min_interval`` <= 0 or above ``max_interval``, a ``backoff`` below 1, a
            ``missing_rounds`` that is no integer >= 1), naming it.
    """

    min_interval: float = 0.05
    max_interval: float = 2.0
    backoff: float = 1.5
    push_safety_interval: float = 5.0
    unknown_grace: float = 10.0
    missing_grace: float = 10.0
    missing_rounds: int = 3
    final_look_timeout: float = 10.0
    deadline_grace: float = 0.5

    def __post_init__(self) -> None:
        # (low, low allowed, inf allowed): a NaN or a string stopped the hub's loop for good, and
        # a min_interval <= 0 had it describe the apps thousands of times a second
        bounds = {
            "min_interval": (0.0, False, False),
            "max_interval": (0.0, False, True),
            "backoff": (1.0, True, False),
            "push_safety_interval": (0.0, False, True),
            "unknown_grace": (0.0, True, True),
            "missing_grace": (0.0, True, True),
            "final_look_timeout": (0.0, True, True),
            "deadline_grace": (0.0, True, True),
        }
        rounds = self.missing_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"PollSettings.missing_rounds must be an integer >= 1, got {rounds!r}")
        for name, (low, low_ok, inf_ok) in bounds.items():
            value = getattr(self, name)
            seconds = math.nan
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                try:
                    seconds = float(value)
                except OverflowError:  # an int too large for a float
                    seconds = math.inf
            if (
                not (seconds >= low if low_ok else seconds > low)  # also rejects NaN
                or (seconds == math.inf and not inf_ok)
            ):
                kind = "a number" if inf_ok else "a finite number"
                raise ValueError(
                    f"PollSettings.{name} must be {kind} {'>=' if low_ok else '>'} {low:g}, "
                    f"got {value!r}"
                )
            object.__setattr__(self, name, seconds)  # (frozen) the hub computes with floats
        if self.max_interval < self.min_interval:
            raise ValueError(
                f"PollSettings.max_interval ({self.max_interval!r}) must not be below "
                f"min_interval ({self.min_interval!r})"
            )


@dataclass
class AppEntry:
    """What the hub knows of one app (read it; the hub alone changes it).

    Args:
        app_id: the app.
        response: its last description (None: not described yet, or unknown).
        known: described at least once.
        final: terminal, or unknown to the backend: no more rounds for it.
        asked_at: when (``time.monotonic()``) the describe whose answer was applied last began;
            an answer begun earlier is older than what the hub knows, and is dropped.
        missing_since: when an answer first left this app out, of those in a row that did
            (None: the last answer had it).
        missing_count: how many answers in a row left it out.
    """

    app_id: str
    response: DescribeAppResponse | None = None
    known: bool = False  # described at least once
    final: bool = False  # terminal, or unknown to the backend: no more rounds for it
    submitted_at: float | None = None  # set when this runner submitted it
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    version: int = 0
    # by a key of each ``listen``: thousands of iterations may listen to one app, and each
    # stops listening on its own (a list's remove made that quadratic)
    _listeners: dict[object, Callable[[AppEntry], None]] = field(
        default_factory=dict, init=False, repr=False
    )
    # the number (``StatusHub.rounds``) of the last round that included this app, answered or failed
    consulted: int = 0
    # set after each such round; created only for an app someone waits on with a deadline
    answered: asyncio.Event | None = None
    asked_at: float = -math.inf
    missing_since: float | None = None
    missing_count: int = 0
    # set when the last round failed with an error no retry can mend (a Slurm command missing):
    # the waiters raise it (a later round that answers clears it)
    error: BaseException | None = None

    @property
    def status(self) -> AppStatus | None:
        """Its status (None when unknown)."""
        return None if self.response is None else self.response.to_status()

    @property
    def state(self) -> AppState | None:
        """Its state (None when unknown)."""
        return None if self.response is None else self.response.state


_MAX_FINAL_ENTRIES = 100_000


def _check_answer(answer: object, ids: list[str], backend: str) -> None:
    """Raises TypeError unless ``answer`` (of ``describe_many``) maps the ids to
    DescribeAppResponse or None: a malformed one (a backend's bug) is a failed round, whereas
    applying it ended the hub's loop, and every wait hung."""
    if isinstance(answer, Mapping):
        bad = next(
            (a for a in ids if not isinstance(answer.get(a), (DescribeAppResponse, type(None)))),
            None,
        )
        if bad is None:
            return
        answer = answer.get(bad)
    raise TypeError(
        f"{backend}: describe_many must return a mapping of app ids to DescribeAppResponse or "
        f"None, got {answer!r:.200}"
    )


def _key(resp: DescribeAppResponse | None) -> tuple[AppState, int] | None:
    return None if resp is None else (resp.state, resp.num_restarts)


class StatusHub:
    """Tracks apps of one scheduler and wakes their waiters when their status changes.

    Args:
        scheduler: the backend to describe apps with.
        supervisor: the task supervisor (owned by the runner) that runs the hub's loop.
        settings: pacing of the rounds.
        before_round: awaited before each status round (the backend's call-rate limit, if any).
        round_would_wait: True when ``before_round`` would have to wait now; a waiter whose
            deadline passed then gives up instead of waiting for that round.
    """

    def __init__(
        self,
        scheduler: Scheduler[object],
        supervisor: TaskSupervisor,
        settings: PollSettings | None = None,
        before_round: Callable[[], Awaitable[None]] | None = None,
        round_would_wait: Callable[[], bool] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.settings = settings or PollSettings()
        self._before_round = before_round
        self._round_would_wait = round_would_wait
        self._throttled = False  # the loop waits for before_round to let the next round go
        self._supervisor = supervisor
        self._entries: dict[str, AppEntry] = {}
        # the apps still followed, in the order they were first tracked (an ordered set)
        self._live: dict[str, None] = {}
        # final entries, oldest first: the oldest are forgotten beyond _MAX_FINAL_ENTRIES
        self._finals: dict[str, None] = {}
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._loop_cancelled = False  # by shut(), once
        self._unsubscribe = scheduler.subscribe(self._on_push) if scheduler.pushes_changes else None
        self.rounds = 0
        self._closed = False
        self._last_failure: str | None = None  # the error of the last round, if it failed
        # the wait_interval hints of the waits in progress, and how many waits gave none
        self._hints: list[float] = []
        self._unhinted_waits = 0
        self._listening = 0  # listeners of entries (as_completed, watch, launch blocks)
        self._interval = self.settings.min_interval
        self._idle = False  # the loop sleeps until woken: nobody waits, nothing is due

    # -- tracking -------------------------------------------------------------------------------

    def track(self, app_id: str, *, submitted: bool = False) -> AppEntry:
        """Starts following ``app_id`` (idempotent) and returns its entry."""
        self._check_open()
        entry = self._entries.get(app_id)
        if entry is None:
            entry = AppEntry(app_id, submitted_at=time.monotonic() if submitted else None)
            self._entries[app_id] = entry
            self._live[app_id] = None
            self._mark_dirty(app_id)
        elif entry.final and not submitted:
            pass
        elif entry.final and (entry.response is None or entry.response.state == AppState.UNKNOWN):
            # asked about before its dry run was scheduled (unknown then): followed from now on
            entry.final = entry.known = False
            entry.response = None
            entry.submitted_at = time.monotonic()
            entry.asked_at, entry.missing_since, entry.missing_count = -math.inf, None, 0
            self._finals.pop(app_id, None)
            self._live[app_id] = None
            self._mark_dirty(app_id)
        elif submitted and entry.submitted_at is None:
            entry.submitted_at = time.monotonic()
        self._ensure_loop()
        return entry

    def refresh(self, app_id: str) -> None:
        """Asks for a fresh description of ``app_id`` in the next round (e.g. after a cancel)."""
        entry = self._entries.get(app_id)
        if entry is not None and entry.final and entry.response is not None:
            return
        self.track(app_id)
        self._mark_dirty(app_id)

    def entry(self, app_id: str) -> AppEntry | None:
        """The hub's entry for ``app_id``, if tracked."""
        return self._entries.get(app_id)

    def listen(self, entry: AppEntry, callback: Callable[[AppEntry], None]) -> Callable[[], None]:
        """Calls ``callback(entry)`` after every change of ``entry`` (on the event loop, inside the
        round that saw it) until the returned function is called (idempotent).

        While someone listens, a final entry is not forgotten, and a polled backend is asked at
        least every ``PollSettings.max_interval`` whatever the waits' hints.
        """
        key = object()
        entry._listeners[key] = callback
        self._listening += 1
        self._wake_if_sleeping_long()

        def stop() -> None:
            if entry._listeners.pop(key, None) is not None:
                self._listening -= 1
                if (
                    entry.final
                    and not entry._listeners
                    and entry.app_id not in self._finals
                    and self._entries.get(entry.app_id) is entry
                ):
                    # dropped from the final entries while listened to: forgotten now
                    del self._entries[entry.app_id]

        return stop

    def _wake_if_sleeping_long(self) -> None:
        """Wakes the loop if it sleeps until woken (nobody waited), or may be sleeping longer than
        ``PollSettings.max_interval`` (for the ``poll_hint`` of other waits), for a waiter that
        relies on that bound. (The loop's sleep is never longer than ``_interval`` otherwise: no
        wake-up, so no extra round.)"""
        if self._idle or self._interval > self.settings.max_interval:
            self._wake.set()

    def awaited(self) -> bool:
        """True while someone waits for a change of an app here (a wait, a listener)."""
        return bool(self._unhinted_waits or self._hints or self._listening)

    def record(self, app_id: str, response: DescribeAppResponse | None, *, asked_at: float) -> None:
        """Feeds a description obtained elsewhere (e.g. by ``runner.status``) into the hub.

        Args:
            app_id: the app.
            response: the backend's answer (None: it does not know the app; see
                ``PollSettings.missing_grace``).
            asked_at: ``time.monotonic()`` taken just before the describe was sent: an answer
                asked before the one the hub has applied for the app is older, and is dropped.
        """
        entry = self._entries.get(app_id)
        if entry is not None and not entry.final:
            self._apply(entry, response, asked_at)

    def _on_push(self, app_id: str) -> None:
        if app_id in self._entries and not self._entries[app_id].final:
            self._mark_dirty(app_id)

    def _mark_dirty(self, app_id: str) -> None:
        self._dirty.add(app_id)
        self._wake.set()

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = self._supervisor.spawn(
                self._run(), name=f"hub:{self.scheduler.backend}"
            )

    # -- waiting --------------------------------------------------------------------------------

    def consult(self, app_id: str) -> tuple[AppEntry, int]:
        """Tracks ``app_id`` and asks the next round to describe it (a waiter's deadline passed).

        Returns:
            The entry and a token: once ``entry.consulted > token``, a round begun after this call
            has answered for the app (see ``wait_consulted``).
        """
        entry = self.track(app_id)
        if not entry.final:
            self._mark_dirty(app_id)
        return entry, self.rounds

    async def wait_consulted(
        self, entry: AppEntry, token: int, *, wait_for_rate: bool = False
    ) -> bool:
        """Waits until ``entry`` is final or a round numbered above ``token`` has answered for it.

        Args:
            wait_for_rate: wait for that round even when the call-rate limit holds it back (a
                ``timeout=0`` wait: its one look).

        Returns:
            True then; False at once when the next round is held back by the call-rate limit
            and not ``wait_for_rate`` (the caller's deadline has passed).
        """
        while not entry.final and entry.consulted <= token:
            self._check_open()
            if self._throttled and not wait_for_rate:
                return False
            if entry.answered is None:
                entry.answered = asyncio.Event()
            entry.answered.clear()
            await entry.answered.wait()
        return True

    def final_look_bound(self, timeout: float) -> float:
        """How long a wait of ``timeout`` seconds whose deadline has passed may wait for its last
        answer: ``PollSettings.final_look_timeout`` for ``timeout=0`` (a question), at most
        ``PollSettings.deadline_grace`` for a positive one (a deadline, kept)."""
        s = self.settings
        return s.final_look_timeout if timeout == 0 else min(s.final_look_timeout, s.deadline_grace)

    async def final_look(
        self,
        entry: AppEntry,
        token: int,
        *,
        wait_for_rate: bool = False,
        bound: float | None = None,
    ) -> bool:
        """``wait_consulted``, for at most ``bound`` seconds (None: ``final_look_timeout``);
        False after it."""
        with anyio.move_on_after(self.settings.final_look_timeout if bound is None else bound):
            return await self.wait_consulted(entry, token, wait_for_rate=wait_for_rate)
        return False

    async def wait_final(
        self,
        app_id: str,
        timeout: float | None = None,  # noqa: ASYNC109
        poll_hint: float | None = None,
    ) -> AppEntry:
        """Returns the entry once the app is terminal or known to be unknown.

        Args:
            app_id: the app.
            timeout: seconds to wait (None: no limit). When they have passed, the hub asks for one
                more round before giving up: an app that is already terminal is returned even with
                ``timeout=0``, which waits for the call rate's next slot for it if need be. A
                positive timeout waits for that round at most ``PollSettings.deadline_grace``.
            poll_hint: how often (seconds) this waiter wants a backend that is polled to be asked
                while it waits (TorchX's ``wait_interval``); see ``max_interval``.

        Raises:
            TimeoutError: the deadline passed and a round begun after it found the app not terminal.
        """
        entry = self.track(app_id)
        if entry.final:
            return entry
        entry.error = None  # (a new wait asks again: the backend may have been mended since)
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        bound = 0.0 if timeout is None else self.final_look_bound(timeout)
        if poll_hint is None:
            self._unhinted_waits += 1
            self._wake_if_sleeping_long()
        else:
            self._hints.append(poll_hint)
            if self._idle or poll_hint < self._interval:
                self._wake.set()  # the loop may be sleeping for longer than this waiter wants
        try:
            while not entry.final:
                self._check_open()
                if entry.error is not None:  # the backend cannot be asked (a permanent error)
                    raise entry.error
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    entry, token = self.consult(app_id)
                    # False: not answered in time
                    await self.final_look(entry, token, wait_for_rate=timeout == 0, bound=bound)
                    if entry.final:
                        break
                    raise TimeoutError(f"{self.scheduler.backend} app {app_id!r} is not terminal")
                entry.changed.clear()
                if entry.final:
                    break
                with anyio.move_on_after(remaining):
                    await entry.changed.wait()
        finally:
            if poll_hint is None:
                self._unhinted_waits -= 1
            else:
                self._hints.remove(poll_hint)
        return entry

    def max_interval(self) -> float:
        """The longest the loop waits between rounds of a polled backend, now.

        ``PollSettings.max_interval`` unless waits in progress gave ``poll_hint`` s: then the
        smallest hint (even below ``min_interval``), which may be longer than the default when every
        waiter gave one (fewer round trips to a busy cluster) and is never longer than the default
        otherwise (someone relies on it: a wait without a hint, ``as_completed`` or ``watch``).
        """
        s = self.settings
        if not self._hints:
            return s.max_interval
        cap = min(self._hints)
        if self._unhinted_waits or any(self._entries[i]._listeners for i in self._live):
            cap = min(cap, s.max_interval)
        return cap

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the runner was closed while waiting for an app")

    # -- the loop -------------------------------------------------------------------------------

    def _live_ids(self) -> list[str]:
        return list(self._live)

    def _finalized(self, entry: AppEntry) -> None:
        """Stops following ``entry``; forgets the oldest final entries nobody listens to, so that a
        long-lived runner does not keep every app it ever waited on (a forgotten app that is asked
        about again is simply described again)."""
        self._live.pop(entry.app_id, None)
        self._finals[entry.app_id] = None
        while len(self._finals) > _MAX_FINAL_ENTRIES:
            oldest = next(iter(self._finals))
            del self._finals[oldest]
            old = self._entries.get(oldest)
            if old is not None and old.final and not old._listeners:
                del self._entries[oldest]

    def _wanted(self) -> bool:
        """True while the loop has rounds to run: apps to describe now (dirty), someone waiting,
        or an app submitted lately that its backend has not shown yet (within
        ``unknown_grace``). Otherwise it sleeps until woken."""
        if self._dirty or self.awaited():
            return True
        now, grace = time.monotonic(), self.settings.unknown_grace
        for app_id in self._live:
            e = self._entries.get(app_id)
            since = None if e is None or e.known else e.submitted_at
            if since is not None and now - since < grace:
                return True
        return False

    async def _run(self) -> None:
        s = self.settings
        push = self.scheduler.pushes_changes
        self._interval = s.min_interval
        last_full = 0.0
        resumed = False  # woken from an idle sleep: what the hub knows may be old, ask at once
        while not self._closed:
            if not self._live or not self._wanted():
                self._dirty.clear()  # (nothing is dirty while wanted is False)
                self._wake.clear()
                self._idle = True
                try:
                    await self._wake.wait()
                finally:
                    self._idle = False
                self._interval = s.min_interval
                resumed = True
                continue
            timeout = s.push_safety_interval if push else min(self._interval, self.max_interval())
            if not self._dirty and not (resumed and not push):
                self._wake.clear()
                # not asyncio.wait_for: on Python < 3.12 it can swallow a cancellation that arrives
                # just as the event is set, which would leave aclose() waiting for this loop forever
                with anyio.move_on_after(timeout):
                    await self._wake.wait()
                if not self._wanted():
                    continue  # the last waiter left meanwhile: no round for nobody
            resumed = False
            now = time.monotonic()
            full = (not push) or now - last_full >= s.push_safety_interval or not self._dirty
            ids = self._live_ids() if full else [i for i in self._dirty if i in self._entries]
            self._dirty.clear()
            if full:
                last_full = now
            ids = [i for i in ids if not self._entries[i].final]
            if not ids:
                continue
            changed = await self._round(ids)
            self._interval = (
                s.min_interval if changed else min(self._interval * s.backoff, self.max_interval())
            )

    async def _round(self, ids: list[str]) -> bool:
        if self._before_round is not None:
            if self._round_would_wait is not None and self._round_would_wait():
                self._throttled = True
                self._wake_consulting()
            try:
                await self._before_round()
            except Exception as e:  # (a Clock's error): a failed round, not the loop's end
                if self._stopping():
                    raise
                self._round_failed(e, len(ids))
                return False
            finally:
                self._throttled = False
        self.rounds += 1
        number = self.rounds
        asked_at = time.monotonic()
        try:
            responses = await self.scheduler.describe_many(ids)
            _check_answer(responses, ids, self.scheduler.backend)
        except asyncio.CancelledError:
            if not self._stray_cancellation():
                raise
            logger.error(
                "status round for %d %s apps raised CancelledError though nothing cancelled it "
                "(a backend bug): counted as a failed round",
                len(ids),
                self.scheduler.backend,
            )
            self._answered(ids, number)
            return False
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            # an Exception, or a backend's BaseException (GeneratorExit, a task group's
            # BaseExceptionGroup): a failed round, unless this loop is being stopped; ending
            # the loop would leave every waiter waiting
            if not isinstance(e, Exception) and self._stopping():
                raise
            self._round_failed(e, len(ids))
            if getattr(e, "permanent", False):
                self._give_up(ids, e)
            self._answered(ids, number)
            return False
        if self._last_failure is not None:
            logger.info("status rounds for %s apps work again", self.scheduler.backend)
            self._last_failure = None
        changed = False
        for app_id in ids:
            entry = self._entries.get(app_id)
            if entry is not None and not entry.final:
                entry.error = None
                changed |= self._apply(entry, responses.get(app_id), asked_at)
        self._answered(ids, number)
        return changed

    def _give_up(self, ids: list[str], error: BaseException) -> None:
        """A round failed with an error that no retry mends (``permanent``: a Slurm command that
        is not installed): the waiters of its apps raise it rather than wait for ever."""
        for app_id in ids:
            entry = self._entries.get(app_id)
            if entry is None or entry.final:
                continue
            entry.error = error
            entry.changed.set()
            if entry.answered is not None:
                entry.answered.set()
            for listener in list(entry._listeners.values()):
                listener(entry)

    def _round_failed(self, error: BaseException, n: int) -> None:
        """Logs a failed round in one line (the traceback at DEBUG): at WARNING when its error
        differs from the last round's, else at DEBUG (a backend that stays down, such as an
        unreachable engine, fails every round the same way)."""
        what = f"{type(error).__name__}: {error}".strip()
        level = logging.DEBUG if what == self._last_failure else logging.WARNING
        self._last_failure = what
        logger.log(
            level,
            "status round for %d %s apps failed: %s",
            n,
            self.scheduler.backend,
            what,
            exc_info=error if logger.isEnabledFor(logging.DEBUG) else None,
        )

    def _stray_cancellation(self) -> bool:
        """True when a CancelledError from the backend did not come from cancelling this loop
        (which only ``aclose`` does): letting it end the loop would leave every waiter waiting.
        Python < 3.11 cannot tell (no ``Task.cancelling``): it is taken as a real one."""
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)
        return not self._closed and cancelling is not None and cancelling() == 0

    def _stopping(self) -> bool:
        """True when this loop is being cancelled (by ``aclose``, or by whoever cancels it)."""
        cancelling = getattr(asyncio.current_task(), "cancelling", None)  # Python 3.11+
        return self._closed or (cancelling is not None and cancelling() > 0)

    def _wake_consulting(self) -> None:
        """Wakes the waiters of a last round (``wait_consulted``): it is held back by the rate."""
        for app_id in self._live:
            entry = self._entries.get(app_id)
            if entry is not None and entry.answered is not None:
                entry.answered.set()

    def _answered(self, ids: list[str], number: int) -> None:
        """Marks the apps of round ``number`` as consulted and wakes whoever waits on that."""
        for app_id in ids:
            entry = self._entries.get(app_id)
            if entry is not None:
                entry.consulted = number
                if entry.answered is not None:
                    entry.answered.set()

    def _apply(
        self, entry: AppEntry, response: DescribeAppResponse | None, asked_at: float
    ) -> bool:
        """Applies an answer asked at ``asked_at`` to ``entry``; returns True when it changed."""
        if asked_at < entry.asked_at:
            return False  # older than what the hub knows (a slow runner.status): dropped
        entry.asked_at = asked_at
        if response is None:
            s, now = self.settings, time.monotonic()
            if entry.submitted_at is not None and now - entry.submitted_at < s.unknown_grace:
                return False  # not visible yet; ask again next round
            if entry.known and entry.response is not None:
                # seen before: one answer without it (a partial listing) is no proof it is gone
                if entry.missing_since is None:
                    entry.missing_since = now
                entry.missing_count += 1
                if (
                    entry.missing_count < s.missing_rounds
                    or now - entry.missing_since < s.missing_grace
                ):
                    return False  # keeps its last state; ask again next round
                # it vanished: keep what we knew but never pretend it succeeded
                response = DescribeAppResponse(
                    app_id=entry.app_id,
                    state=AppState.UNKNOWN,
                    num_restarts=entry.response.num_restarts,
                    msg="the scheduler no longer knows this app",
                    roles_statuses=entry.response.roles_statuses,
                    roles=entry.response.roles,
                    name=entry.response.name,
                )
            entry.final = True
        else:
            entry.missing_since, entry.missing_count = None, 0
        was_known = entry.known
        before = _key(entry.response)
        entry.response = response
        entry.known = True
        if response is not None and is_terminal(response.state):
            entry.final = True
        changed = (not was_known) or before != _key(response) or entry.final
        if entry.final:
            self._finalized(entry)
        if changed:
            entry.version += 1
            entry.changed.set()
            if entry.answered is not None:
                entry.answered.set()
            for listener in list(entry._listeners.values()):
                listener(entry)
        return changed

    def shut(self) -> None:
        """Stops listening to the backend, wakes every waiter (they raise RuntimeError) and
        cancels the loop, at once; ``aclose`` then waits for the loop. Idempotent: the loop is
        cancelled once (a second cancellation would cut short the backend's shielded clean-up of
        the round, e.g. reaping the status command it killed).

        Separate from ``aclose`` because the loop's round may take long to end (or never, if the
        backend ignores its cancellation): the waiters of this hub, and of every other hub of
        the runner, must not wait for that.
        """
        self._closed = True
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        for entry in self._entries.values():
            entry.changed.set()
            if entry.answered is not None:
                entry.answered.set()
        if self._loop_task is not None and not self._loop_cancelled:
            self._loop_cancelled = True
            self._loop_task.cancel()

    async def aclose(self) -> None:
        """``shut``, then waits until the loop has ended."""
        self.shut()
        if self._loop_task is not None:
            await asyncio.gather(self._loop_task, return_exceptions=True)
