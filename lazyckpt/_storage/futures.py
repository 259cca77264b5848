"""Futures chained and gathered, as the storage's reads return them (tensorstore's
`Future`, whose `.result()` and `await` both the sync and async faces use), and the
answer of a read that lazyckpt makes itself (`RangeAnswer`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs

from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none

T = TypeVar("T")
U = TypeVar("U")


@attrs.frozen
class RangeAnswer:
    """What a read returns, shaped as tensorstore's `KvStore.ReadResult`."""

    state: str
    """"value", or "missing" where the server has no such file."""
    value: bytes | bytearray | memoryview = b""
    """The bytes; a view of the caller's buffer where they were read into one (empty
    where a `Scatter` of buffers holds them)."""
    size: int | None = None
    """The whole file's size, where the server said (`Content-Range`)."""


def then(
    future: ts.Future[T],
    fn: Callable[[T], U | ts.Future[U]],
    on_error: Callable[[Exception], Exception] | None = None,
) -> ts.Future[U]:
    """A future of `fn(result)`; if `fn` returns a future, of that future's result.

    `on_error` turns a failure of `future` into the exception the caller should see.
    """
    promise: ts.Promise[U]
    chained: ts.Future[U]
    promise, chained = ts.Promise.new()

    def settle(done: ts.Future[T]) -> None:
        try:
            result = done.result()
        except Exception as error:  # noqa: BLE001 - handed to whoever awaits
            promise.set_exception(on_error(error) if on_error else error)
            return
        try:
            value = fn(result)
        except BaseException as error:  # noqa: BLE001 - handed to whoever awaits
            promise.set_exception(error)
            return
        if isinstance(value, ts.Future):
            value.add_done_callback(lambda inner: _forward(inner, promise))
        else:
            promise.set_result(value)

    future.add_done_callback(settle)
    return chained


def _forward(done: ts.Future[U], promise: ts.Promise[U]) -> None:
    try:
        promise.set_result(done.result())
    except BaseException as error:  # noqa: BLE001 - handed to whoever awaits
        promise.set_exception(error)


def all_of(
    futures: Sequence[ts.Future[None]], on_error: Callable[[Exception], Exception]
) -> ts.Future[None]:
    """A future that is done when all of `futures` are, failed as the first of them
    that failed (`on_error` of its error): nothing still runs (a read into a
    buffer) when its caller learns of a failure."""
    promise: ts.Promise[None]
    future: ts.Future[None]
    promise, future = ts.Promise.new()
    state: dict[str, Any] = {"left": len(futures), "error": None}
    lock = threading.Lock()

    def done(one: ts.Future[None]) -> None:
        try:
            one.result()
        except Exception as failed:  # noqa: BLE001 - handed to whoever awaits
            with lock:
                state["error"] = state["error"] or failed
        with lock:
            state["left"] -= 1
            if state["left"]:
                return
        if state["error"] is not None:
            promise.set_exception(on_error(state["error"]))
        else:
            promise.set_result(None)

    if not futures:
        promise.set_result(None)
    for one in futures:
        one.add_done_callback(done)
    return future


def ready(value: T) -> ts.Future[T]:
    """A future that already holds `value`."""
    promise: ts.Promise[T]
    future: ts.Future[T]
    promise, future = ts.Promise.new()
    promise.set_result(value)
    return future
