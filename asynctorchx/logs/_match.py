r"""Matching log lines against a user's regex filter without holding the event loop for long.

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
the patterns that can take that long ("risky", from ``re``'s parse of them): a repeat inside a
repeat (``(a+)+``), an alternation inside a repeat (``(a|aa)+``), a back-reference (exponential),
or two unbounded repeats next to each other (``\d+\d+x``, ``.*.*=``: polynomial). Every other
pattern is matched by ``re`` on the event loop, as before (a simple pattern's polynomial
backtracking on a very long line is not bounded). A pattern that ``re`` accepts and ``regex`` does
not is matched with ``re`` on the event loop too.

``regex`` writes out a repeat with a fixed count (``a{1000}``: a thousand items, ~280 bytes
each), where ``re`` keeps one item and a count: ``a{99999999}`` took 24 GB in ``regex``. Only a
risky pattern is compiled by ``regex``, and one that would expand to more than ``MAX_EXPANSION``
items is refused (``ValueError`` naming it, from ``check_log_filter``) rather than matched without
a time limit; any other pattern stays on ``re`` however large its counts.

A risky pattern is given to ``regex`` (version 0, ``re``'s) with what ``regex`` would read
otherwise escaped: a ``[`` followed by ``:``, ``=`` or ``.`` inside a set (a POSIX class there,
literal characters in ``re``) and a ``{`` that starts no ``re`` repeat (a fuzzy match there, a
literal in ``re``); a named character (``\N{...}``) stays whole. Left as ``regex`` has them, its
classes: ``\s`` does not match U+001C-U+001F, ``\w`` (so ``\b``) matches combining marks, and its
Unicode data is newer than this Python's (``\d`` takes a few more digits) — the README says so. Worker threads are at most ``MAX_THREADS`` per event loop, so that slow
filters do not take the threads other work of the process needs (reading log files, records).
"""

from __future__ import annotations

import asyncio
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any, TypeVar, cast

import anyio

if TYPE_CHECKING:
    import regex

#: Worker threads matching risky filters at once, per event loop.
MAX_THREADS = 4
#: Seconds of matching one batch may take on the event loop.
LOOP_BUDGET = 0.005
#: Seconds one line's match may take at all.
LINE_TIMEOUT = 5.0
#: Items a risky pattern may expand to in ``regex`` (its fixed repeat counts multiplied out): about
#: 30 MB and 40 ms to compile.
MAX_EXPANSION = 100_000

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
        return regex.compile(_as_re_reads_it(pattern), mapped | regex.VERSION0)
    except Exception:
        return None


_RE_REPEAT = re.compile(r"\{(?:\d+(?:,\d*)?|,\d+)\}")


def _as_re_reads_it(pattern: str) -> str:
    """``pattern`` with what ``regex`` reads otherwise than ``re`` escaped: ``[:``, ``[=``, ``[.``
    inside a set (POSIX classes) and a ``{`` that starts no repeat (fuzzy matching)."""
    out: list[str] = []
    i, n = 0, len(pattern)
    in_set = first = False
    while i < n:
        c = pattern[i]
        if (
            c == "\\"
        ):  # an escape: as it is (a named character, \N{...}, whole: its "{" is no repeat)
            end = pattern.find("}", i) + 1 if pattern.startswith("N{", i + 1) else 0
            end = end or i + 2
            out.append(pattern[i:end])
            i = end
            continue
        if in_set:
            if c == "]" and not first:  # (a "]" first in a set is one of its characters)
                in_set = False
            elif c == "[" and pattern[i + 1 : i + 2] in (":", "=", "."):
                c = "\\["
            first = False
        elif c == "[":
            in_set = first = True
            if pattern[i + 1 : i + 2] == "^":
                out.append("[^")
                i += 2
                continue
        elif c == "{" and not _RE_REPEAT.match(pattern, i):
            c = "\\{"
        out.append(c)
        i += 1
    return "".join(out)


if sys.version_info >= (3, 11):
    from re import _constants as _c  # type: ignore[attr-defined]
    from re import _parser  # type: ignore[attr-defined]
else:  # (the same modules, under their old names)
    import sre_constants as _c
    import sre_parse as _parser

# (possessive repeats and atomic groups came with Python 3.11)
_REPEATS = frozenset(
    {_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", _c.MAX_REPEAT)}
)
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


def _nests(items: Any, depth: int) -> bool:
    """True when the sequence ``items`` (inside ``depth`` variable repeats) is risky."""
    open_repeat: Any = None  # the body of an unbounded repeat that ends the sequence so far
    for op, av in items:
        if op in _REPEATS:
            low, high, body = av
            inner = depth + (high != low)
            if inner >= 2 or _nests(body, inner):
                return True
            if high == _c.MAXREPEAT:
                if open_repeat is not None and _overlap(open_repeat, body):
                    return True  # two unbounded repeats of the same characters in a row
                open_repeat = body
            elif low:
                open_repeat = None
            continue
        if op is _c.BRANCH:
            if depth or any(_nests(branch, depth) for branch in av[1]):
                return True
        elif op is _c.SUBPATTERN:
            if _nests(av[-1], depth):
                return True
        elif op in (_c.ASSERT, _c.ASSERT_NOT):
            if _nests(av[1], depth):
                return True
        elif op is getattr(_c, "ATOMIC_GROUP", None):
            if _nests(av, depth):
                return True
        elif op not in _LEAVES:  # back-references, conditionals, anything unknown
            return True
        if op is not _c.AT:  # (a zero-width anchor leaves two repeats next to each other)
            open_repeat = None
    return False


def _overlap(a: Any, b: Any) -> bool:
    """Whether two repeats' bodies surely match some character alike: either is ``.`` or they are
    the same (a cheap check: ``\\w+\\d+`` is missed, ``\\w+\\s+`` is rightly let go)."""
    return any(list(x) == [(_c.ANY, None)] for x in (a, b)) or list(a) == list(b)


def _expansion(items: Any, cap: int) -> int:
    """How many items ``regex`` makes of the parsed sequence ``items``: a repeat counts its least
    count times its body (``regex`` writes the fixed part of a repeat out), any other node one,
    plus what it holds. Stops counting past ``cap`` (the counts multiply: ``(a{9999}){9999}``)."""
    total = 0
    for op, av in items:
        if op in _REPEATS:
            low, _, body = av
            total += max(low, 1) * _expansion(body, cap)
        else:
            total += 1 + sum(_expansion(sub, cap) for sub in _subpatterns(av))
        if total > cap:
            break
    return total


def _subpatterns(av: Any) -> Iterator[Any]:
    """The parsed sequences within a node's argument (a group's body, the branches of an
    alternation, a conditional's two arms, a look-around's body)."""
    if isinstance(av, _parser.SubPattern):
        yield av
    elif isinstance(av, (tuple, list)):
        for x in av:
            yield from _subpatterns(x)


def check_log_filter(pattern: re.Pattern[str]) -> None:
    """Refuses a filter that ``LineFilter`` could not match within its time limits without
    expanding it in memory: a risky pattern whose repeats multiply out to more than
    ``MAX_EXPANSION`` items (``regex`` writes fixed repeats out; ``re`` does not, and takes the
    other patterns as they are).

    Raises:
        ValueError: the pattern is too large (names it and its expansion).
    """
    text, flags = pattern.pattern, pattern.flags
    if not _risky(text, flags):
        return
    try:
        size = _expansion(_parser.parse(text, flags), MAX_EXPANSION)
    except Exception:  # (``_risky`` could not read it either: ``regex`` is tried as before)
        return
    if size > MAX_EXPANSION:
        shown = repr(text) if len(text) <= 200 else f"{text[:200]!r}... ({len(text)} chars)"
        raise ValueError(
            f"the log regex {shown} repeats too much to be matched with a time limit: its "
            f"repeat counts multiply out to more than {MAX_EXPANSION} items (it can backtrack "
            "for a very long time, so it is matched by the regex module, with a time limit, "
            "which writes each repeat out); give smaller repeat counts"
        )


_limiters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = (
    weakref.WeakKeyDictionary()
)


def _limiter() -> anyio.CapacityLimiter:
    """The event loop's limiter of the threads that match risky filters (``MAX_THREADS``)."""
    loop = asyncio.get_running_loop()
    limiter = _limiters.get(loop)
    if limiter is None:
        limiter = _limiters[loop] = anyio.CapacityLimiter(MAX_THREADS)
    return limiter


def _identity(text: str) -> str:
    return text


class LineFilter:
    """A log regex filter (``re.search`` semantics) that bounds its time on the event loop.

    Args:
        pattern: the filter, as ``compile_log_regex`` made it.
    """

    __slots__ = ("_bounded", "_pattern", "_risky", "slow")

    def __init__(self, pattern: re.Pattern[str]) -> None:
        """Raises ValueError when ``check_log_filter`` refuses ``pattern``."""
        self._pattern = pattern
        self._risky = _risky(pattern.pattern, pattern.flags)
        self._bounded: regex.Pattern[str] | None = None
        if self._risky:  # (only then: ``regex`` expands what ``re`` compiles small)
            check_log_filter(pattern)
            self._bounded = _bounded(pattern.pattern, pattern.flags)
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
        if bounded is None or not self._risky:  # ``re``, on the event loop (as before)
            quick = self._pattern.search
            if text is _identity:
                return [i for i in items if quick(cast(str, i)) is not None]
            return [i for i in items if quick(text(i)) is not None]
        kept: list[T] = []
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
        if bounded is None or not self._risky:
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
                self._keep_blocking, items, text, stop, abandon_on_cancel=True, limiter=_limiter()
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
