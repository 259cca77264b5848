"""How lazyckpt behaves on the network: deadlines, retries and the files whose version
cannot be checked (`NetworkOptions`, set with `lazyckpt.network_options`), and the
stop that ends a burst of reads when one of them fails for good (`Stop`).

The defaults follow the clients users trust: a request that cannot connect, or whose
answer does not begin, within `timeout` seconds fails, as huggingface_hub's and
object_store's do; a body that arrives slower than `min_rate` fails, as curl's
`--speed-limit` does, however often the server sends a byte; and a file whose
version the server does not say (no ETag, no Last-Modified) is refused, as
huggingface_hub refuses it.
"""

from __future__ import annotations

import datetime
import email.utils
import os
import re
import threading
import time
from typing import Any, Literal

import attrs

from lazyckpt._errors import LazyTypeError, StorageAccessError

FIRST_DELAY = 0.25
"""Seconds before the second attempt at a request; each later wait doubles, up to
`MAX_DELAY`."""
MAX_DELAY = 4.0
MAX_RETRY_AFTER = 8.0
"""The longest wait a server's `Retry-After` is obeyed for; a longer one waits this."""


def _within(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    low, high, spelled, why = _RANGES[attribute.name]
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise LazyTypeError(
            f"network_options({attribute.name}=...) takes {spelled}, not {value!r}: {why}"
        )


_RANGES: dict[str, tuple[float, float, str, str]] = {
    "timeout": (
        0.1,
        3600.0,
        "seconds from 0.1 to 3600 (an hour)",
        "a server that has not answered within an hour is retried, not waited on for days; "
        "give a number in that range",
    ),
    "min_rate": (
        1 << 10,
        1 << 30,
        "bytes a second from 1024 (1 KiB/s) to 1073741824 (1 GiB/s)",
        "a request may take `timeout` plus its size at `min_rate`, so a lower rate lets a "
        "stalled server hold a read for days (1e-06 would allow 10**12 s), and no link "
        "keeps to a higher one; give a number in that range",
    ),
}
"""The range of each setting in seconds or bytes a second, as the messages say it, and
why it ends there."""


def _attempts(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
        raise LazyTypeError(
            f"network_options(retries=...) takes the attempts at a request, 1 to 100, not {value!r}"
        )


def _count(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    low, high = _COUNTS[attribute.name]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise LazyTypeError(
            f"network_options({attribute.name}=...) takes a whole number from {low} to "
            f"{high}, not {value!r}"
        )


_COUNTS = {"connections": (1, 256), "request_bytes": (1 << 20, 1 << 30)}


def _unversioned(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in ("refuse", "warn"):
        raise LazyTypeError(
            f"network_options(unversioned=...) takes 'refuse' or 'warn', not {value!r}"
        )


@attrs.frozen
class NetworkOptions:
    """How reads over HTTP(S) and from the Hugging Face Hub wait, retry and check.

    The defaults come from the environment where it sets them (`LAZYCKPT_HTTP_TIMEOUT`,
    `LAZYCKPT_HTTP_MIN_RATE`, `LAZYCKPT_HTTP_RETRIES`, `LAZYCKPT_HTTP_UNVERSIONED`,
    `LAZYCKPT_HTTP_CONNECTIONS`, `LAZYCKPT_HTTP_REQUEST_BYTES`);
    `lazyckpt.network_options(...)` changes them for the process.

    >>> lazyckpt.NetworkOptions()
    NetworkOptions(timeout=30.0, min_rate=65536, retries=5, unversioned='refuse', \
connections=32, request_bytes=16777216)
    """

    timeout: float = attrs.field(default=30.0, validator=_within)
    """Seconds to connect, and for an answer to begin; also the most a request waits
    for its next byte. A request's whole answer must arrive within `timeout` plus its
    size at `min_rate`. From 0.1 s to 3600 s."""
    min_rate: int = attrs.field(default=65536, validator=_within)
    """Bytes a second an answer's body must at least average (64 KiB/s by default): a
    server that sends a byte a second fails the request after about `timeout` seconds.
    From 1 KiB/s to 1 GiB/s."""
    retries: int = attrs.field(default=5, validator=_attempts)
    """Attempts at a request that fails in a way that may pass (HTTP 429 and 5xx, a
    failed connection, a missed deadline): waits of 0.25 s doubling up to 4 s between
    them, or what the server's `Retry-After` asks, up to 8 s. From 1 to 100."""
    unversioned: Literal["refuse", "warn"] = attrs.field(default="refuse", validator=_unversioned)
    """What to do with a file at a plain URL whose server gives neither an ETag nor a
    Last-Modified date, so that a change between two reads cannot be detected:
    `"refuse"` it (a `StorageAccessError`), or read it with an `UnversionedWarning`.
    Files on the Hub are read at a pinned commit and always checked."""
    connections: int = attrs.field(default=32, validator=_count)
    """Requests in flight at once to one server (scheme, host and port). On a link
    with a long round trip, where one connection of a CDN carries a few tens of MB/s,
    many requests at once are what fill it (docs/benchmarks.md, section 23). From 1 to
    256."""
    request_bytes: int = attrs.field(default=16 << 20, validator=_count)
    """The most bytes one request asks for. A tensor is read in requests of up to this
    many bytes, smaller where that keeps every connection busy: the bytes a read may
    hold in flight (its `memory_budget`) shared among `connections`. A run of bytes is
    cut into equal requests of at least 1 MiB (below it, a request's round trip costs
    more than its bytes): one of 1.5 MiB is one request, whatever this says. From
    1 MiB to 1 GiB."""

    def deadline_for(self, size: int) -> float:
        """Seconds a request for `size` bytes may take, answer and body."""
        return float(self.timeout + size / self.min_rate)

    def bound(self) -> float:
        """The longest one read of up to 1 MiB may take with every retry, however the
        server answers: what the guide promises."""
        # Each wait is at most what a `Retry-After` may ask for.
        return self.retries * self.deadline_for(1 << 20) + (self.retries - 1) * MAX_RETRY_AFTER


def _from_environment() -> NetworkOptions:
    found: dict[str, object] = {}
    for name, field in (
        ("LAZYCKPT_HTTP_TIMEOUT", "timeout"),
        ("LAZYCKPT_HTTP_MIN_RATE", "min_rate"),
        ("LAZYCKPT_HTTP_RETRIES", "retries"),
        ("LAZYCKPT_HTTP_UNVERSIONED", "unversioned"),
        ("LAZYCKPT_HTTP_CONNECTIONS", "connections"),
        ("LAZYCKPT_HTTP_REQUEST_BYTES", "request_bytes"),
    ):
        text = os.environ.get(name)
        if text is None:
            continue
        if field == "unversioned":
            found[field] = text
        elif _NUMBER.fullmatch(text):
            number = float(text)
            found[field] = int(number) if field != "timeout" and number.is_integer() else number
        else:
            raise LazyTypeError(f"{name}={text[:40]!r} is not a number; unset it or write one")
    try:
        return NetworkOptions(**found)  # type: ignore[arg-type]
    except LazyTypeError as error:
        raise LazyTypeError(f"{error} (from the environment's LAZYCKPT_HTTP_*)") from None


_NUMBER = re.compile(r"[0-9]{1,12}(?:\.[0-9]{1,6})?", re.ASCII)


_OPTIONS: list[NetworkOptions] = []
_OPTIONS_LOCK = threading.Lock()


def options() -> NetworkOptions:
    """The options in force."""
    with _OPTIONS_LOCK:
        if not _OPTIONS:
            _OPTIONS.append(_from_environment())
        return _OPTIONS[-1]


def network_options(
    *,
    timeout: float | None = None,
    min_rate: int | None = None,
    retries: int | None = None,
    unversioned: Literal["refuse", "warn"] | None = None,
    connections: int | None = None,
    request_bytes: int | None = None,
) -> _NetworkOptionsContext:
    """Set how reads over the network wait, retry and check (`NetworkOptions`), for
    the whole process; as a `with` block, until its end, where the options it set go
    back to what they were (those another thread set meanwhile stay). Each request
    uses the options in force when it starts.

    >>> with lazyckpt.network_options(timeout=5, retries=2) as now:
    ...     now
    NetworkOptions(timeout=5, min_rate=65536, retries=2, unversioned='refuse', \
connections=32, request_bytes=16777216)
    >>> lazyckpt.network_options().timeout  # outside the block: as before
    30.0
    """
    changes: dict[str, object] = {
        name: value
        for name, value in (
            ("timeout", timeout),
            ("min_rate", min_rate),
            ("retries", retries),
            ("unversioned", unversioned),
            ("connections", connections),
            ("request_bytes", request_bytes),
        )
        if value is not None
    }
    with _OPTIONS_LOCK:
        previous = _OPTIONS[-1] if _OPTIONS else _from_environment()
        new = attrs.evolve(previous, **changes)  # type: ignore[arg-type]
        _OPTIONS[:] = [new]
    return _NetworkOptionsContext({k: getattr(previous, k) for k in changes}, new)


@attrs.frozen
class _NetworkOptionsContext:
    """What `network_options` returns: the options now in force, and, used in a `with`
    block, each option it set put back at its end (unless set again meanwhile)."""

    previous: dict[str, object] = attrs.field(repr=False)
    now: NetworkOptions

    def __getattr__(self, name: str) -> object:
        return getattr(self.now, name)

    def __enter__(self) -> NetworkOptions:
        return self.now

    def __exit__(self, *exc: object) -> None:
        with _OPTIONS_LOCK:
            current = _OPTIONS[-1]
            back = {
                name: value
                for name, value in self.previous.items()
                if getattr(current, name) == getattr(self.now, name)
            }
            _OPTIONS[:] = [attrs.evolve(current, **back)]  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return repr(self.now)


_SECONDS = re.compile(r"[0-9]{1,9}", re.ASCII)


def retry_after(value: str | None, now: float | None = None) -> float | None:
    """The seconds a `Retry-After` header asks to wait (a number of seconds, or an
    HTTP date), capped at `MAX_RETRY_AFTER`; None where it says nothing readable.

    >>> retry_after("3"), retry_after("²"), retry_after("9" * 5000), retry_after(None)
    (3.0, None, None, None)
    """
    if not value:
        return None
    text = value.strip()
    if _SECONDS.fullmatch(text):
        return min(float(text), MAX_RETRY_AFTER)
    if len(text) > 64:
        return None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # asctime's form, which is in GMT
        when = when.replace(tzinfo=datetime.UTC)
    wait = when.timestamp() - (time.time() if now is None else now)
    return min(max(wait, 0.0), MAX_RETRY_AFTER)


class Stop:
    """The reads of one open of files over HTTP, as a burst: the first that fails for
    good stops those submitted before its failure (queued, waiting to retry, or about
    to send), so a verb ends within one read's retry schedule, not one per read.
    Reads submitted after a failure are a new burst: a later call may succeed."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._burst = 0
        self._reason = ""

    def ticket(self) -> int:
        """The burst a read submitted now belongs to."""
        with self._condition:
            return self._burst

    def fail(self, ticket: int, reason: str) -> None:
        """A read of burst `ticket` failed for good: stop the rest of its burst."""
        with self._condition:
            if ticket == self._burst:
                self._burst += 1
                self._reason = reason
                self._condition.notify_all()

    def check(self, ticket: int, url: str) -> None:
        """Raise where burst `ticket` was stopped."""
        with self._condition:
            if ticket != self._burst:
                raise StorageAccessError(
                    f"{url}: not read, because another read of the same files failed "
                    f"for good: {self._reason[:300]}"
                )

    def sleep(self, ticket: int, seconds: float) -> None:
        """Wait `seconds`, or less where burst `ticket` is stopped meanwhile."""
        end = time.monotonic() + seconds
        with self._condition:
            while ticket == self._burst and (left := end - time.monotonic()) > 0:
                self._condition.wait(left)
