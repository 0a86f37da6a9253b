"""Matching log lines against a user's regex filter without holding the event loop for long.

Python's ``re`` has no time limit and holds the GIL while it matches: one catastrophic pattern
(``(a|aa)+$`` on a long line of ``a``) froze the event loop, and with it every other app's wait,
follower and status round, for seconds or minutes. ``LineFilter`` matches with the ``regex``
module instead (the same syntax and meaning as ``re`` in its default version), which can bound a
match in time and release the GIL while it runs:

- on the event loop, a batch of lines is matched for at most ``LOOP_BUDGET`` seconds; the lines
  left then (a huge batch, or a line whose match ran out of the budget) are matched in a worker
  thread, GIL released;
- a filter one of whose lines ran out of the budget is slow: its later batches go straight to a
  worker thread;
- in a worker thread a line may take at most ``LINE_TIMEOUT`` seconds: past that the read fails
  with ``SlowLogRegexError`` naming the pattern (a filter that cannot be matched in that time is a
  mistake, and no answer would be wrong without it).

The ``regex`` module is 4-13 times slower than ``re`` on ordinary patterns, so it is kept for
those that can take that long: a pattern with a repeat inside a repeat (``(a+)+``), an alternation
inside a repeat (``(a|aa)+``) or a back-reference, which is where the exponential blow-ups are
(the "star height" of ``re``'s parse of it), and lines longer than ``SAFE_LENGTH`` characters (where
even a simple pattern's polynomial backtracking costs seconds). Every other match is ``re``'s, on
the event loop. A pattern that ``re`` accepts and ``regex`` does not (none is known) is matched with
``re`` on the event loop, as before.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from re import _constants as _c  # type: ignore[attr-defined]
from re import _parser  # type: ignore[attr-defined]
from typing import TYPE_CHECKING, Any, TypeVar, cast

import anyio

if TYPE_CHECKING:
    import regex

#: Lines up to this long are matched by ``re`` (on the event loop) when the pattern is not risky.
SAFE_LENGTH = 4096
#: Seconds of matching one batch may take on the event loop.
LOOP_BUDGET = 0.005
#: Seconds one line's match may take at all.
LINE_TIMEOUT = 5.0

T = TypeVar("T")

#: ``re``'s flags, by the name ``regex`` gives the same flag.
_FLAGS = ("IGNORECASE", "MULTILINE", "DOTALL", "VERBOSE", "ASCII")


class SlowLogRegexError(ValueError):
    """Raised when a log regex filter takes more than ``LINE_TIMEOUT`` seconds on one line."""


@lru_cache(maxsize=64)
def _bounded(pattern: str, flags: int) -> regex.Pattern[str] | None:
    """``pattern`` compiled by ``regex`` with ``re``'s ``flags``, or None if it cannot be (the
    module is imported here: only a log read with a filter pays for it)."""
    import regex

    mapped = 0
    for name in _FLAGS:
        if flags & getattr(re, name):
            mapped |= getattr(regex, name)
    try:
        return regex.compile(pattern, mapped | regex.VERSION0)
    except Exception:
        return None


_REPEATS = frozenset({_c.MAX_REPEAT, _c.MIN_REPEAT, _c.POSSESSIVE_REPEAT})
_LEAVES = frozenset(
    {_c.LITERAL, _c.NOT_LITERAL, _c.IN, _c.ANY, _c.AT, _c.CATEGORY, _c.RANGE, _c.NEGATE}
)


@lru_cache(maxsize=64)
def _risky(pattern: str, flags: int) -> bool:
    """True when ``pattern`` may backtrack exponentially: a variable repeat or an alternation
    inside a variable repeat, or a back-reference (or ``re``'s parse cannot be read)."""
    try:
        return _nests(_parser.parse(pattern, flags), 0)
    except Exception:
        return True


def _nests(items: Iterable[tuple[Any, Any]], depth: int) -> bool:
    for op, av in items:
        if op in _REPEATS:
            low, high, body = av
            inner = depth + (high != low)
            if inner >= 2 or _nests(body, inner):
                return True
        elif op is _c.BRANCH:
            if depth or any(_nests(branch, depth) for branch in av[1]):
                return True
        elif op is _c.SUBPATTERN:
            if _nests(av[-1], depth):
                return True
        elif op in (_c.ASSERT, _c.ASSERT_NOT):
            if _nests(av[1], depth):
                return True
        elif op is _c.ATOMIC_GROUP:
            if _nests(av, depth):
                return True
        elif op not in _LEAVES:  # back-references, conditionals, anything unknown
            return True
    return False


def _identity(text: str) -> str:
    return text


class LineFilter:
    """A log regex filter (``re.search`` semantics) that bounds its time on the event loop.

    Args:
        pattern: the filter, as ``compile_log_regex`` made it.
    """

    __slots__ = ("_bounded", "_pattern", "_risky", "slow")

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self._pattern = pattern
        self._bounded = _bounded(pattern.pattern, pattern.flags)
        self._risky = _risky(pattern.pattern, pattern.flags)
        #: a line's match ran out of the event loop's budget: batches go to a worker thread
        self.slow = False

    async def keep(
        self,
        items: Sequence[T],
        text: Callable[[T], str] = _identity,  # type: ignore[assignment]
    ) -> list[T]:
        """The items whose ``text`` matches, in order.

        Raises:
            SlowLogRegexError: one line took more than ``LINE_TIMEOUT`` seconds.
        """
        bounded = self._bounded
        if bounded is None:  # (matched as before)
            unbounded = self._pattern.search
            return [item for item in items if unbounded(text(item))]
        kept: list[T] = []
        done = 0
        if not self._risky:  # ``re`` up to the first long line
            quick = self._pattern.search
            texts = cast("Sequence[str]", items) if text is _identity else list(map(text, items))
            if max(map(len, texts), default=0) <= SAFE_LENGTH:  # (the usual case, at C speed)
                return [i for i, line in zip(items, texts, strict=True) if quick(line) is not None]
            for item in items:
                line = text(item)
                if len(line) > SAFE_LENGTH:
                    break
                if quick(line) is not None:
                    kept.append(item)
                done += 1
            if done == len(items):
                return kept
            items = items[done:]
            done = 0
        if not self.slow:
            deadline = time.monotonic() + LOOP_BUDGET
            search = bounded.search
            try:
                for item in items:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    if search(text(item), timeout=left) is not None:
                        kept.append(item)
                    done += 1
            except TimeoutError:
                self.slow = True
        if done < len(items):
            kept += await self._in_thread(items[done:], text)
        return kept

    async def matches(self, text: str) -> bool:
        """True when ``text`` matches (one line: for readers that get lines one at a time).

        Raises:
            SlowLogRegexError: it took more than ``LINE_TIMEOUT`` seconds.
        """
        bounded = self._bounded
        if bounded is None or (not self._risky and len(text) <= SAFE_LENGTH):
            return self._pattern.search(text) is not None
        if not self.slow:
            try:
                return bounded.search(text, timeout=LOOP_BUDGET) is not None
            except TimeoutError:
                self.slow = True
        return bool(await self._in_thread((text,), _identity))

    async def _in_thread(self, items: Sequence[T], text: Callable[[T], str]) -> list[T]:
        stop = threading.Event()
        try:
            return await anyio.to_thread.run_sync(
                self._keep_blocking, items, text, stop, abandon_on_cancel=True
            )
        finally:
            stop.set()  # (a cancelled read: the worker stops at its next line)

    def _keep_blocking(
        self, items: Sequence[T], text: Callable[[T], str], stop: threading.Event
    ) -> list[T]:
        assert self._bounded is not None
        search = self._bounded.search
        kept = []
        for item in items:
            if stop.is_set():
                break
            line = text(item)
            try:
                found = search(line, timeout=LINE_TIMEOUT, concurrent=True)
            except TimeoutError:
                shown = self._pattern.pattern
                shown = repr(shown) if len(shown) <= 200 else f"{shown[:200]!r}..."
                raise SlowLogRegexError(
                    f"the log regex {shown} took more than {LINE_TIMEOUT:g} s on one line "
                    f"({len(line)} characters); give a simpler one (nested repeats such as "
                    "(a+)+ or (a|aa)+ can take exponential time)"
                ) from None
            if found is not None:
                kept.append(item)
        return kept
